#!/usr/bin/env python3
"""Peak memory of one DAPO actor micro-batch with an entropy bonus: verl's entropy as is vs checkpointed.

    python3 benchmarks/gpu/entropy_memory.py                      # on the GPU host (torch + transformers only)
    python3 benchmarks/gpu/entropy_memory.py --device cpu --tiny  # CPU smoke (tests/test_train.py)

Why (issue 17; results/2026-11-24-h100-m11): with ``verl.actor_rollout_ref.actor.entropy_coeff`` 0.01 the 135M ranker's actor update ran out of
memory on an H100 (a 6.99 GiB allocation with 69.97 GiB in use). Without flash-attn verl's FSDP engine
runs padded batches and takes the entropy of every position's full-vocabulary distribution
(``verl.utils.torch_functional.entropy_from_logits``); with the entropy in the loss its intermediates are
kept for the backward pass. ``verl.actor_rollout_ref.actor.entropy_checkpointing`` turns on verl's switch that wraps the same
function in ``torch.utils.checkpoint``.

One forward + backward of a SmolLM2-135M-shaped model (random weights: memory does not depend on them)
on the shapes of that run (19 sequences x 1,700 tokens, 300 of them left padding: one 32k-token
micro-batch), bf16, SDPA. Rows, each measured in this call:

- ``no entropy in the loss``: the policy-gradient term only (entropy computed without grad, for metrics);
- ``entropy in the loss``: the same plus ``- coeff * entropy.mean()``, verl's function as is;
- ``entropy in the loss, checkpointed``: the same function under ``torch.utils.checkpoint``.

Printed: peak memory allocated (CUDA) and the bytes autograd saved for the backward pass, with ratios
against the plain entropy row, and the time of a forward + backward (median of --repeats).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1's function when verl is installed; otherwise the same formula (logsumexp - E_p[logits])."""
    try:
        from verl.utils.torch_functional import entropy_from_logits as verl_entropy
    except ImportError:
        pd = torch.nn.functional.softmax(logits, dim=-1)
        return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
    return verl_entropy(logits)


def build(tiny: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=4096, max_position_embeddings=512, tie_word_embeddings=True)
    else:  # SmolLM2-135M-Instruct's shape
        cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                          tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype), cfg


def step(model, ids, am, pos, mode: str, coeff: float, resp: int) -> tuple[int, float]:
    """One forward + backward; returns (bytes saved for backward, seconds)."""
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
        logp = torch.log_softmax(logits[:, -resp - 1:-1].float(), -1).gather(-1, ids[:, -resp:, None]).squeeze(-1)
        adv = torch.linspace(-1, 1, ids.shape[0], device=ids.device)[:, None]
        loss = -(logp * adv).mean()
        if mode == "none":
            with torch.no_grad():
                ent = entropy_from_logits(logits.detach())
        elif mode == "plain":
            ent = entropy_from_logits(logits)
            loss = loss - coeff * (ent * am).sum() / am.sum()
        else:
            ent = torch.utils.checkpoint.checkpoint(entropy_from_logits, logits, use_reentrant=True)
            loss = loss - coeff * (ent * am).sum() / am.sum()
    loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return sum(saved), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (CPU smoke)")
    ap.add_argument("--batch", type=int, default=19)
    ap.add_argument("--length", type=int, default=1700)
    ap.add_argument("--pad", type=int, default=300)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--coeff", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    if a.tiny:
        a.batch, a.length, a.pad, a.response = 4, 96, 16, 8
    torch.manual_seed(0)
    model, cfg = build(a.tiny, a.device)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.length), device=a.device)
    am = torch.ones(a.batch, a.length, dtype=torch.long, device=a.device)
    am[:, :a.pad] = 0
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    rows = []
    for mode, label in (("none", "no entropy in the loss"), ("plain", "entropy in the loss (verl as is)"),
                        ("ckpt", "entropy in the loss, checkpointed")):
        step(model, ids, am, pos, mode, a.coeff, a.response)  # warm-up
        if a.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        runs = [step(model, ids, am, pos, mode, a.coeff, a.response) for _ in range(a.repeats)]
        peak = torch.cuda.max_memory_allocated() if a.device == "cuda" else None
        rows.append({"mode": mode, "label": label, "saved_bytes": runs[0][0], "peak_bytes": peak,
                     "seconds": statistics.median(r[1] for r in runs), "repeats": a.repeats})
    ref = rows[1]
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"# {dev}, {a.batch} x {a.length} tokens ({a.pad} padding), vocab {cfg.vocab_size}, "
          f"entropy coeff {a.coeff}, median of {a.repeats}")
    print("| run | peak memory allocated | vs verl as is | saved for backward | vs verl as is | fw+bw s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r["peak_bytes"] is not None else "-"
        pr = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}x" if r["peak_bytes"] is not None else "-"
        print(f"| {r['label']} | {peak} | {pr} | {r['saved_bytes'] / 2**30:.2f} GiB | "
              f"{r['saved_bytes'] / ref['saved_bytes']:.2f}x | {r['seconds']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "rows": rows, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
