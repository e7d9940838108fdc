#!/usr/bin/env python3
"""What one search costs the service's query encoder (issue 46): milliseconds of the dense model per query,
by batch size, on the threads the service gives it.

    .venv/bin/python benchmarks/bench_query_encoder.py --out benchmarks/results/query-encoder-2026-11-27

Queries: the 30 questions of the shipped LongMemEval sample (``memsifter/samples``), shuffled once (seed 0)
and cycled; the same model and code as ``memsifter serve`` (``service.index.Encoder``: all-MiniLM-L6-v2 in
float32 on ``encoder_threads()`` torch threads). At each batch size the same batches run both ways, one after
the other, until each way has run ``--seconds``: as the service encodes a micro-batch (``index.length_groups``
at the service's default ``query_pass_tokens``) and as one batch padded to its longest query (the service
before 2026-11-27). A search costs one query's share of a batch; under load the service's micro-batcher forms
batches of up to ``query_batch`` queries, so the large-batch figure bounds the queries per second one core
can encode, whatever the HTTP, scoring and writes around it cost.

Output: ``encoder.json`` (every number, the machine) and ``encoder.md`` (the table).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from memsifter.service.config import QUERY_PASS_TOKENS as CALL_TOKENS  # noqa: E402


def questions() -> list[str]:
    from importlib import resources

    path = resources.files("memsifter").joinpath("samples", "longmemeval_s_dev30.json.gz")
    with gzip.open(str(path), "rt") as f:
        return [q["question"] for q in json.load(f)]


def measure(encoder, texts: list[str], batch: int, seconds: float) -> list[dict]:
    """Both ways at ``batch``, interleaved: the same batches of queries alternately as length groups (the
    service's default pass cost) and as one padded batch (a pass cost no split can pay back), until each has
    run ``seconds``; so that a change in the machine's load during the run falls on both alike."""
    ways = {CALL_TOKENS: [0, 0, 0.0], None: [0, 0, 0.0]}   # queries, calls, seconds
    i = 0
    for call in ways:   # warm-up at this shape
        encoder.pass_tokens = 10 ** 9 if call is None else call
        encoder.encode(texts[:batch], urgent=True)
    while min(w[2] for w in ways.values()) < seconds:
        part = [texts[(i + k) % len(texts)] for k in range(batch)]
        i += batch
        for call, w in ways.items():
            encoder.pass_tokens = 10 ** 9 if call is None else call
            t0 = time.perf_counter()
            encoder.encode(part, urgent=True)
            w[0], w[1], w[2] = w[0] + batch, w[1] + 1, w[2] + time.perf_counter() - t0
    encoder.pass_tokens = CALL_TOKENS
    return [{"batch": batch, "call_tokens": call, "queries": n, "calls": c, "seconds": round(dt, 3),
             "ms_per_query": round(1000 * dt / n, 2), "queries_per_s": round(n / dt, 1)}
            for call, (n, c, dt) in ways.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,4,8,16,32")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args(argv)
    from memsifter.models import embedding
    from memsifter.service.index import Encoder, encoder_threads

    texts = questions()
    random.Random(0).shuffle(texts)
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    enc = Encoder(spec)
    rows = [r for b in a.batches.split(",") for r in measure(enc, texts, int(b), a.seconds)]
    lengths = [len(ids) for ids in enc._load().tokenizer(texts, truncation=True, max_length=spec.max_length)["input_ids"]]
    import torch

    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": spec.name, "torch_threads": torch.get_num_threads(),
           "encoder_threads_default": encoder_threads(), "queries": len(texts),
           "query_tokens": {"min": min(lengths), "mean": round(sum(lengths) / len(lengths), 1), "max": max(lengths)},
           "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()[0], "processor": platform.processor()},
           "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "encoder.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = report(res)
    with open(os.path.join(a.out, "encoder.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def report(res: dict) -> list[str]:
    lines = [f"# The service's query encoder ({res['date']}, {res['model']}, {res['torch_threads']} torch thread(s), "
             f"{res['machine']['cpus']} CPUs, load average at start {res['machine']['loadavg']:.2f})", "",
             f"{res['queries']} questions of {res['query_tokens']['min']} to {res['query_tokens']['max']} tokens "
             f"(mean {res['query_tokens']['mean']}).", "",
             "| batch | micro-batch as | ms per query | queries/s on these threads |", "|---|---|---|---|"]

    def how(r: dict) -> str:
        return ("one batch, padded to its longest" if r["call_tokens"] is None
                else f"length groups, {r['call_tokens']} tokens a pass")

    lines += [f"| {r['batch']} | {how(r)} | {r['ms_per_query']} | {r['queries_per_s']} |" for r in res["rows"]]
    by = {(r["batch"], r["call_tokens"]): r["ms_per_query"] for r in res["rows"]}
    lines += ["", "Length groups over one padded batch, by batch: " + ", ".join(
        f"{b}: {by[(b, None)] / by[(b, r)]:.2f}x" for (b, r) in by if r is not None) + " (time per query, same run)."]
    return lines


if __name__ == "__main__":
    sys.exit(main())
