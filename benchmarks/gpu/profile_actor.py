#!/usr/bin/env python3
"""Time one DAPO actor micro-batch outside verl: forward, forward + backward, with and without LoRA.

    python3 benchmarks/gpu/profile_actor.py                                  # SDPA and eager, full weights
    python3 benchmarks/gpu/profile_actor.py --impl sdpa --lora 16 --profile  # the ranker's actor (LoRA r16)
    python3 benchmarks/gpu/profile_actor.py --verl-logprobs                  # + verl's log-prob fallback
    python3 benchmarks/gpu/profile_actor.py --device cpu --tiny              # CPU smoke

What the model itself costs in a DAPO step, to compare with verl's ``timing_s/old_log_prob`` and
``timing_s/update_actor``: a SmolLM2-135M-Instruct-shaped model (``entropy_memory.build``; random
weights, since time depends on the shape; ``--model DIR`` loads a local Hugging Face model instead) on
the micro-batch of the ranker's DAPO runs (``--batch`` 19 sequences x ``--length`` 1,700 tokens,
``--pad`` 300 of them left padding: one 32k-token micro-batch), bf16, log-probs of the last
``--response`` 64 tokens. Per attention implementation (``--impl``): the forward without grad and the
forward + backward, median of ``--repeats`` after a warm-up, and x ``--micro-batches`` (7 make one
step of ~213k tokens). ``--lora R`` wraps the model in peft LoRA r R on all linear layers (the
actor of ``run_ranker.py``); ``--profile`` prints the torch profiler's kernel table of one
forward + backward; ``--verl-logprobs`` times verl's ``logprobs_from_logits`` on the response rows
(the function the train stage's ``fast_logprobs`` replaces when flash-attn is missing; needs verl).

Results of 2026-11-24 (H100 80GB, the real SmolLM2 weights): ``results/2026-11-24-h100-m8/profile_forward.log``
and ``profile_lora.log``, tabled in README.md ("Where a DAPO step's actor time goes").
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from entropy_memory import build  # noqa: E402


def load(a, impl: str):
    if a.model:
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
        m = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation=impl).to(a.device)
        vocab = m.config.vocab_size
    else:
        m, cfg = build(a.tiny, a.device)
        m.config._attn_implementation = impl
        vocab = cfg.vocab_size
    if a.lora:
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(m, LoraConfig(r=a.lora, lora_alpha=2 * a.lora, target_modules="all-linear"))
    return m, vocab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short sequences (CPU smoke)")
    ap.add_argument("--model", help="a local Hugging Face model directory instead of the random SmolLM2 shape")
    ap.add_argument("--impl", default="sdpa,eager", help="attention implementations, comma-separated")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on all linear layers (0: full weights)")
    ap.add_argument("--batch", type=int, default=19)
    ap.add_argument("--length", type=int, default=1700)
    ap.add_argument("--pad", type=int, default=300)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=7, help="micro-batches per DAPO step (for the x N column)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="kernel table of one forward + backward (first --impl)")
    ap.add_argument("--verl-logprobs", action="store_true", help="also time verl's logprobs_from_logits")
    a = ap.parse_args(argv)
    if a.tiny:
        a.batch, a.length, a.pad, a.response = 4, 96, 16, 8
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name() if cuda else 'cpu'}, {a.batch} x {a.length} tokens ({a.pad} padding), "
          f"LoRA r{a.lora or '-'}, median of {a.repeats}")
    print("| attention | grad | s per micro-batch | x micro-batches (one step) |")
    print("|---|---|---:|---:|")
    for n, impl in enumerate(a.impl.split(",")):
        m, vocab = load(a, impl)
        ids = torch.randint(0, vocab, (a.batch, a.length), device=a.device)
        am = torch.ones(a.batch, a.length, dtype=torch.long, device=a.device)
        am[:, :a.pad] = 0
        pos = (am.cumsum(-1) - 1).clamp(min=0)

        def fw(grad: bool) -> None:
            with torch.set_grad_enabled(grad):
                lg = m(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False).logits
                lp = torch.log_softmax(lg[:, -a.response - 1:-1].float(), -1)
                lp = lp.gather(-1, ids[:, -a.response:, None]).sum()
                if grad:
                    lp.backward()
                    m.zero_grad(set_to_none=True)

        for grad in (False, True):
            try:
                fw(grad)
                sync()
                times = []
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    fw(grad)
                    sync()
                    times.append(time.perf_counter() - t)
                s = statistics.median(times)
                print(f"| {impl} | {grad} | {s:.3f} | {a.micro_batches * s:.1f} |", flush=True)
            except torch.OutOfMemoryError:
                print(f"| {impl} | {grad} | out of memory | - |", flush=True)
        if a.profile and n == 0:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as pr:
                fw(True)
                sync()
            key = "cuda_time_total" if cuda else "cpu_time_total"
            print(pr.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=40))
        del m
        if cuda:
            torch.cuda.empty_cache()
    if a.verl_logprobs:
        from verl.utils.torch_functional import logprobs_from_logits

        rows = a.batch * a.response
        lg = torch.randn(rows, vocab, device=a.device)
        labels = torch.randint(0, vocab, (rows,), device=a.device)
        for k in range(max(1, rows - 40), rows, 5):
            sync()
            t = time.perf_counter()
            logprobs_from_logits(lg[:k], labels[:k])
            sync()
            print(f"verl logprobs_from_logits, {k} rows: {time.perf_counter() - t:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
