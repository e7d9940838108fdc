"""Speed fixes for verl 0.9.1, imported into every process of a train run (``VERL_USE_EXTERNAL_MODULES``).

verl computes the log-probabilities of the sampled tokens with flash-attn's Triton cross-entropy when
the ``flash-attn`` package is importable, and otherwise with ``logprobs_from_logits_v2``: a Python loop
over the **rows** of a ``(tokens, vocab)`` matrix. Its engine workers call it on every position of a
packed micro-batch, so at ~30k tokens a micro-batch that is ~30k tiny softmaxes forward and again
backward. On the H100 (``benchmarks/gpu/results/2026-11-24-h100-m8``) the actor's forward and backward
of a whole DAPO step took ~1 s and ~3 s, verl's ``old_log_prob`` and ``update_actor`` phases 14–18 s and
42–48 s; the GPU sat idle while the loop launched kernels.

:func:`logprobs_rows` computes the same values over blocks of rows (``block_rows``), so each block is a
few large kernels; it keeps the fallback's numerics (``log_softmax`` in the input dtype for 16-bit
logits, ``x - logsumexp(x)`` for float32/64) and its memory: autograd keeps the same per-row tensors,
only grouped. The train stage turns it on with its ``fast_logprobs`` setting (default on): it is the path runs
take where flash-attn is missing (hosts and images other than the train image, which compiles it for sm_90).

:func:`install_fa4` makes FlashAttention-4 (PyPI ``flash-attn-4``: CuTe DSL kernels compiled at run time, for
Hopper and Blackwell) usable by verl's remove-padding and Ulysses paths (``attn_implementation:
flash_attention_4``): transformers 5.10 hands its varlen function the longest sequence as a 0-dim tensor
(``cu_seqlens.diff().max()``), which FA2's C++ binding accepts and FA4's compiler rejects ("Expected IntTuple, whose
leaves are integers"). The wrapper passes a Python int instead; nothing else changes.
"""
from __future__ import annotations

import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

MODULE = __name__
BLOCK_ELEMENTS = 1 << 26  # ~64M logits per block: 256 MiB in float32, 128 MiB in bfloat16


def logprobs_rows(logits, labels):
    """Log-probability of ``labels`` under ``logits`` (``(..., vocab)``), as verl's row loop, in blocks."""
    import torch
    import torch.nn.functional as F

    vocab = logits.shape[-1]
    flat, lab = logits.reshape(-1, vocab), labels.reshape(-1)
    rows = flat.shape[0]
    block = max(1, BLOCK_ELEMENTS // max(1, vocab))
    out = []
    for start in range(0, rows, block):
        x, y = flat[start:start + block], lab[start:start + block].unsqueeze(-1)
        if x.dtype in (torch.float32, torch.float64):
            out.append(torch.gather(x, -1, y).squeeze(-1) - torch.logsumexp(x, dim=-1))
        else:  # as verl: logsumexp is unstable in 16 bits, log_softmax is not
            out.append(F.log_softmax(x, dim=-1).gather(-1, y).squeeze(-1))
    if not out:
        return flat.new_zeros(labels.shape)
    return torch.cat(out).reshape(labels.shape)


FAST_LOGPROBS_ENV = "MEMSIFTER_FAST_LOGPROBS"  # "0": leave verl's log-prob fallback as it is (fast_logprobs off)


def fa4_installed() -> bool:
    """The ``flash-attn-4`` distribution is installed here (FA2's ``flash-attn`` also ships a ``flash_attn.cute``
    folder: the distribution's name tells them apart, as transformers does)."""
    from importlib import metadata

    try:
        metadata.distribution("flash-attn-4")
    except metadata.PackageNotFoundError:
        return False
    return True


def int_seqlens(fn):
    """``fn`` (a varlen attention function) called with ``max_seqlen_q``/``max_seqlen_k`` as Python ints."""
    if getattr(fn, "_memsifter_int_seqlens", False):
        return fn

    @functools.wraps(fn)
    def varlen(*args, **kwargs):
        for key in ("max_seqlen_q", "max_seqlen_k"):
            v = kwargs.get(key)
            if v is not None and not isinstance(v, int):
                kwargs[key] = int(v)  # one host sync, as FA2's binding does for a tensor
        return fn(*args, **kwargs)

    varlen._memsifter_int_seqlens = True
    return varlen


def install_fa4() -> bool:
    """Wrap ``flash_attn.cute.flash_attn_varlen_func`` with :func:`int_seqlens` (transformers imports it by name at
    its first flash attention call, after this); False where flash-attn-4 is not installed or does not import."""
    if not fa4_installed():
        return False
    try:
        import flash_attn.cute as cute
    except Exception as e:  # noqa: BLE001 - a broken FA4 install: the run fails later with transformers' own error
        log.warning("memsifter: flash-attn-4 is installed but flash_attn.cute does not import (%s)", e)
        return False
    fn = getattr(cute, "flash_attn_varlen_func", None)
    if not callable(fn):
        return False
    cute.flash_attn_varlen_func = int_seqlens(fn)
    return True


def install() -> bool:
    """Point verl's fallback at :func:`logprobs_rows` (unless ``MEMSIFTER_FAST_LOGPROBS=0``) and make FA4 take
    transformers' calls (:func:`install_fa4`); False (log-probs unchanged) without verl, with the setting off, or
    without that function (a verl release that renamed it: the run goes on with verl's own code)."""
    install_fa4()
    if os.environ.get(FAST_LOGPROBS_ENV) == "0":
        return False
    try:
        from verl.utils import torch_functional as vf
    except ImportError:
        return False
    if not callable(getattr(vf, "logprobs_from_logits_v2", None)):  # another verl: leave it as it is
        log.warning("memsifter: verl %s has no logprobs_from_logits_v2; fast_logprobs changes nothing",
                    getattr(sys.modules.get("verl"), "__version__", "?"))
        return False
    if vf.logprobs_from_logits_v2 is not logprobs_rows:
        vf._memsifter_original_logprobs_v2 = vf.logprobs_from_logits_v2
        vf.logprobs_from_logits_v2 = logprobs_rows  # looked up by name at each call of logprobs_from_logits
        log.info("memsifter: verl's row-by-row log-prob fallback replaced by blocks of %d logits", BLOCK_ELEMENTS)
    return True


def external_modules(existing: str | None) -> str:
    """The ``VERL_USE_EXTERNAL_MODULES`` value with this module added (a user's own modules kept)."""
    mods = [m for m in (existing or "").split(",") if m.strip()]
    return ",".join(mods + ([MODULE] if MODULE not in mods else []))


if "verl" in sys.modules:  # imported by `import verl` (VERL_USE_EXTERNAL_MODULES); the train stage only reads MODULE
    install()
