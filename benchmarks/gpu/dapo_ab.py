#!/usr/bin/env python3
"""Compare two DAPO runs of the train stage step by step (verl's metrics lines), as a table of ratios.

    python3 benchmarks/gpu/dapo_ab.py --baseline results/.../train_dcg_slow_metrics.jsonl \\
        --run results/.../train_dcg_fast_metrics.jsonl [--out ab.md]

Used for issue 20, item 3: the same phase (``run_ranker.py --phases dcg``) run twice on one machine, once
with ``--set fast_logprobs=false`` (verl's row-by-row log-prob fallback) and once with the default.
Per metric: median (min–max) over the training steps of each run, and baseline / run for times.
"""
from __future__ import annotations

import argparse
import json
import statistics

ROWS = [  # (verl metric, label, kind): "time" rows get baseline/run, others run/baseline
    ("timing_s/step", "step s", "time"),
    ("timing_s/gen", "generation s", "time"),
    ("timing_s/old_log_prob", "old log-probs s", "time"),
    ("timing_s/update_actor", "actor update s", "time"),
    ("timing_s/update_weights", "weight sync s", "time"),
    ("perf/throughput", "tokens/s (whole step)", "rate"),
    ("perf/mfu/actor", "actor MFU (verl)", "rate"),
    ("actor/perf/max_memory_allocated_gb", "max GPU memory allocated GB", "rate"),
    ("perf/total_num_tokens", "tokens per step", "rate"),
    ("critic/score/mean", "reward mean", "rate"),
    ("response_length/mean", "response length", "rate"),
]


def steps(path: str) -> list[dict]:
    """Training-step rows (those with a step time) of a metrics.jsonl."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if "timing_s/step" in r]


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    fmt = (lambda v: f"{v:.4f}") if max(abs(v) for v in values) < 1 else (lambda v: f"{v:,.1f}")
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}–{fmt(max(values))})"


def table(base: list[dict], run: list[dict], names: tuple[str, str]) -> str:
    lines = [f"| metric | {names[0]} ({len(base)} steps) | {names[1]} ({len(run)} steps) | ratio |",
             "|---|---:|---:|---:|"]
    for key, label, kind in ROWS:
        b = [r[key] for r in base if key in r]
        x = [r[key] for r in run if key in r]
        ratio = "-"
        if b and x and statistics.median(b) and statistics.median(x):
            mb, mx = statistics.median(b), statistics.median(x)
            ratio = f"{mb / mx:.2f}x faster" if kind == "time" else f"{mx / mb:.2f}x"
        lines.append(f"| {label} | {cell(b)} | {cell(x)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--names", nargs=2, default=("baseline", "run"))
    ap.add_argument("--out")
    a = ap.parse_args()
    text = table(steps(a.baseline), steps(a.run), tuple(a.names))
    print(text)
    if a.out:
        open(a.out, "w").write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
