#!/usr/bin/env python3
"""Curves of a ranker training run from the train stage's verl log (or its metrics.jsonl).

    python benchmarks/gpu/ranker_curves.py LOG_OR_JSONL --out benchmarks/gpu/results/<run>/ --title "..."

Writes ``curves.json`` (one record per step: reward mean, validation valid-format rate and NDCG@10 on
the held-out split, response length, step time and its parts, rollout tokens/s) and ``curves.png``
(``memsifter.training.trainmetrics.plot``), and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

KEEP = ("critic/score/mean", "response_length/mean", "timing_s/step", "timing_s/gen", "timing_s/old_log_prob",
        "timing_s/update_actor", "timing_s/save_checkpoint", "actor/entropy", "actor/grad_norm", "perf/throughput",
        "perf/total_num_tokens")


def main() -> int:
    from memsifter.training import trainmetrics

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="ranker training")
    ap.add_argument("--rollouts", type=int, default=128, help="responses per step (prompts x n), for rollout tok/s")
    a = ap.parse_args()
    text = open(a.source, errors="replace").read()
    recs: dict[int, dict] = {}
    if a.source.endswith(".jsonl"):
        for r in trainmetrics.read_jsonl(text):
            recs.setdefault(r["step"], {}).update(r)
    else:
        for line in text.splitlines():
            r = trainmetrics.parse_line(line)
            if r:
                recs.setdefault(r["step"], {}).update(r)
    rows = []
    for step, r in sorted(recs.items()):
        row = {"step": step, **{k: r[k] for k in KEEP if k in r}}
        row.update({k: v for k, v in r.items() if ("ndcg10" in k or "format_ok" in k) and k.startswith("val")})
        if r.get("timing_s/gen") and r.get("response_length/mean"):
            row["rollout_tokens_per_s"] = a.rollouts * r["response_length/mean"] / r["timing_s/gen"]
        rows.append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "curves.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(a.out, "curves.png"), "wb") as f:
        f.write(trainmetrics.plot([recs[s] for s in sorted(recs)], a.title))
    cols = ["step", "critic/score/mean", "response_length/mean", "timing_s/step", "timing_s/gen",
            "timing_s/update_actor", "rollout_tokens_per_s"]
    val = sorted({k for r in rows for k in r if k.startswith("val")})
    print("| " + " | ".join(c.split("/")[-1] if c != "critic/score/mean" else "reward mean" for c in cols)
          + " | " + " | ".join(v.replace("val-aux/memsifter_", "").replace("/mean@1", "") for v in val) + " |")
    print("|" + "---:|" * (len(cols) + len(val)))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols)
              + " | " + " | ".join(f"{r[v]:.3f}" if v in r else "" for v in val) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
