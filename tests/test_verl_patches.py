"""memsifter.training.verl_patches: verl's log-prob fallback computed in blocks, with the same values and gradients,
installed in verl's own processes through ``VERL_USE_EXTERNAL_MODULES`` (a real ``import verl`` in a fresh
interpreter, the way verl's Ray workers start); the train stage's ``fast_logprobs``
wiring is tested in test_train.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
vf = pytest.importorskip("verl.utils.torch_functional")

from memsifter.training import verl_patches

ORIGINAL = getattr(vf, "_memsifter_original_logprobs_v2", vf.logprobs_from_logits_v2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37,), (3, 11)])
def test_blocks_match_verl_row_loop(monkeypatch, dtype, shape):
    monkeypatch.setattr(verl_patches, "BLOCK_ELEMENTS", 5 * 50)  # 5 rows per block: several blocks and a remainder
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(*shape, 50, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 50, shape, generator=g)
    a, b = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    ours, ref = verl_patches.logprobs_rows(a, labels), ORIGINAL(b.reshape(-1, 50), labels.reshape(-1)).reshape(shape)
    assert ours.shape == labels.shape and ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    w = torch.randn(shape, generator=g).to(dtype)
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    # and they are log-probabilities: logsumexp over the vocabulary of a row's log-softmax is 0
    full = torch.log_softmax(base.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ours.float(), full, rtol=0.02, atol=0.05)


def test_empty_input_keeps_shape():
    out = verl_patches.logprobs_rows(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)


def test_import_verl_installs_it_in_a_fresh_process(tmp_path):
    """As in each Ray worker of a run: VERL_USE_EXTERNAL_MODULES makes `import verl` import the patch, and the
    engine's own logprobs_from_logits (bound at import) then runs the blocks (no flash-attn here)."""
    code = """
import json, torch, verl
from verl.utils import torch_functional as vf
from verl.workers.engine.fsdp import transformer_impl as ti
from memsifter.training import verl_patches
calls = []
real = verl_patches.logprobs_rows
def spy(x, y):
    calls.append(tuple(x.shape))
    return real(x, y)
vf.logprobs_from_logits_v2 = spy
x, y = torch.randn(6, 9), torch.randint(0, 9, (6,))
out = ti.logprobs_from_logits(x, y)
ref = torch.log_softmax(x, -1).gather(-1, y[:, None])[:, 0]
print(json.dumps({"installed": hasattr(vf, "_memsifter_original_logprobs_v2"), "calls": calls,
                  "flash": vf.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE, "err": float((out - ref).abs().max())}))
"""
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": verl_patches.MODULE}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["installed"] is True
    if got["flash"]:
        pytest.skip("flash-attn's cross-entropy is installed here: verl does not use the fallback")
    assert got["calls"] == [[6, 9]] and got["err"] < 1e-5
    # without the variable nothing is patched
    probe = "import verl; from verl.utils import torch_functional as vf; print(hasattr(vf, '_memsifter_original_logprobs_v2'))"
    r = subprocess.run([sys.executable, "-c", probe], check=False,
                       env={k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", r.stderr[-2000:]



def test_a_verl_without_the_fallback_is_left_alone(monkeypatch):
    """A verl release without logprobs_from_logits_v2 must still import (the patch runs inside `import verl`)."""
    monkeypatch.delattr(vf, "logprobs_from_logits_v2")
    assert verl_patches.install() is False and not hasattr(vf, "logprobs_from_logits_v2")


def test_int_seqlens_passes_the_longest_sequence_as_an_int():
    """transformers 5.10 hands a varlen function ``max_seqlen_q``/``max_seqlen_k`` as 0-dim tensors
    (``cu_seqlens.diff().max()``); FA4's compiler wants ints. Ints and None pass as they are; wrapping is idempotent."""
    calls = []

    def varlen(q, k, v, **kwargs):
        calls.append(kwargs)
        return "out"

    f = verl_patches.int_seqlens(varlen)
    assert f(1, 2, 3, cu_seqlens_q="c", max_seqlen_q=torch.tensor(7), max_seqlen_k=torch.tensor([5])[0]) == "out"
    got = calls[-1]
    assert got["max_seqlen_q"] == 7 and type(got["max_seqlen_q"]) is int
    assert got["max_seqlen_k"] == 5 and type(got["max_seqlen_k"]) is int and got["cu_seqlens_q"] == "c"
    f(1, 2, 3, max_seqlen_q=9, max_seqlen_k=None)
    assert calls[-1] == {"max_seqlen_q": 9, "max_seqlen_k": None}
    f(1, 2, 3)
    assert calls[-1] == {}
    assert verl_patches.int_seqlens(f) is f and f.__wrapped__ is varlen and f.__name__ == "varlen"


def _fake_cute(monkeypatch, fn=None):
    """``flash_attn.cute`` as a module of our own: FA4 needs a CUDA GPU (Hopper or Blackwell) and is not installed
    here, so its varlen function is faked; the real one was run, forward and backward, on an H100 by
    benchmarks/gpu/varlen_check.py."""
    import types

    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    if fn is not None:
        cute.flash_attn_varlen_func = fn
    pkg.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return cute


def test_install_fa4_wraps_flash_attn_cute_varlen_func(monkeypatch):
    """With flash-attn-4 installed, install_fa4 replaces flash_attn.cute.flash_attn_varlen_func (which transformers
    imports by name at its first flash attention call) by the int_seqlens wrapper, once however often it runs."""
    seen = []

    def flash_attn_varlen_func(q, k, v, **kwargs):
        seen.append({k: type(v) for k, v in kwargs.items()})
        return q

    cute = _fake_cute(monkeypatch, flash_attn_varlen_func)
    monkeypatch.setattr(verl_patches, "fa4_installed", lambda: False)
    assert verl_patches.install_fa4() is False and cute.flash_attn_varlen_func is flash_attn_varlen_func
    monkeypatch.setattr(verl_patches, "fa4_installed", lambda: True)
    assert verl_patches.install_fa4() is True
    wrapped = cute.flash_attn_varlen_func
    assert wrapped is not flash_attn_varlen_func and wrapped.__wrapped__ is flash_attn_varlen_func
    assert verl_patches.install_fa4() is True and cute.flash_attn_varlen_func is wrapped
    from flash_attn.cute import flash_attn_varlen_func as by_name  # as transformers imports it

    assert by_name(1, 2, 3, max_seqlen_q=torch.tensor(4), max_seqlen_k=torch.tensor(4)) == 1
    assert seen == [{"max_seqlen_q": int, "max_seqlen_k": int}]


def test_install_fa4_leaves_a_broken_or_foreign_flash_attn_cute_alone(monkeypatch, caplog):
    """flash-attn-4 recorded but flash_attn.cute without the function, or not importing: False, nothing changed
    (transformers then fails with its own error), and install() still goes on to the log-prob patch."""
    monkeypatch.setattr(verl_patches, "fa4_installed", lambda: True)
    cute = _fake_cute(monkeypatch)
    assert verl_patches.install_fa4() is False and not hasattr(cute, "flash_attn_varlen_func")
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # `import flash_attn.cute` raises ImportError
    with caplog.at_level("WARNING", logger=verl_patches.__name__):
        assert verl_patches.install_fa4() is False
    assert "flash_attn.cute does not import" in caplog.text
    monkeypatch.delenv(verl_patches.FAST_LOGPROBS_ENV, raising=False)
    monkeypatch.setattr(vf, "logprobs_from_logits_v2", ORIGINAL)  # restored after the test, as below
    monkeypatch.setattr(vf, "_memsifter_original_logprobs_v2", ORIGINAL, raising=False)
    assert verl_patches.install() is True and vf.logprobs_from_logits_v2 is verl_patches.logprobs_rows


def test_fast_logprobs_off_leaves_verl_alone(monkeypatch):
    """MEMSIFTER_FAST_LOGPROBS=0 (the train stage's fast_logprobs off, module listed for FA4): the fallback stays
    verl's own."""
    monkeypatch.setenv(verl_patches.FAST_LOGPROBS_ENV, "0")
    monkeypatch.setattr(vf, "logprobs_from_logits_v2", ORIGINAL)
    assert verl_patches.install() is False and vf.logprobs_from_logits_v2 is ORIGINAL
