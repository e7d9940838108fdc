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
