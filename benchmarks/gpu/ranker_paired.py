#!/usr/bin/env python3
"""Paired NDCG@10 differences between the rankers of one ``run_ranker.py`` results folder, from its per-question
files (``ndcg10-per-question-<part>.json``: {ranker: {question id: NDCG@10}}), per held-out part and both pooled:

    python3 benchmarks/gpu/ranker_paired.py benchmarks/gpu/results/2026-11-27-h100x4-ranker-improve/results \
        improve-shuf:sft-shuf improve-shuf:first-stage sft-shuf:first-stage      # -> paired.md, paired.json there

Each pair A:B is mean(A - B) over the questions both ranked, with its 95% paired bootstrap interval
(``memsifter.retrieval.benchmark_metrics.paired_difference``: the same questions resampled for both).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from memsifter.retrieval.benchmark_metrics import paired_difference  # noqa: E402
from memsifter.retrieval.metrics import bootstrap_ci  # noqa: E402


def load(folder: str) -> dict[str, dict[str, dict[str, float]]]:
    """{part: {ranker: {question: NDCG@10}}} from the folder's per-question files."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "ndcg10-per-question-*.json"))):
        part = re.sub(r"^ndcg10-per-question-|\.json$", "", os.path.basename(path))
        out[part] = json.load(open(path))
    if not out:
        raise SystemExit(f"{folder}: no ndcg10-per-question-*.json")
    return out


def report(parts: dict, pairs: list[tuple[str, str]]) -> tuple[str, dict]:
    pooled = {}
    for part, by in parts.items():  # question ids are unique within a part; pooled ids carry the part
        for ranker, per in by.items():
            pooled.setdefault(ranker, {}).update({f"{part}/{q}": v for q, v in per.items()})
    views = {**parts, "pooled": pooled}
    res: dict = {}
    lines = ["| held-out part | ranker | n | NDCG@10 [95% CI] |", "|---|---|---:|---|"]
    for part, by in views.items():
        res[part] = {"ndcg10": {}, "pairs": {}}
        for ranker in sorted({r for pair in pairs for r in pair}):
            vals = list(by.get(ranker, {}).values())
            if not vals:
                continue
            lo, hi = bootstrap_ci(vals)
            mean = sum(vals) / len(vals)
            res[part]["ndcg10"][ranker] = {"n": len(vals), "mean": round(mean, 4), "ci_low": round(lo, 4),
                                           "ci_high": round(hi, 4)}
            lines.append(f"| {part} | {ranker} | {len(vals)} | {mean:.3f} [{lo:.3f}, {hi:.3f}] |")
    lines += ["", "| held-out part | A − B | n | mean paired difference [95% CI] | interval excludes 0 |",
              "|---|---|---:|---|---|"]
    for part, by in views.items():
        for a, b in pairs:
            d = paired_difference(by.get(a, {}), by.get(b, {}))
            res[part]["pairs"][f"{a}:{b}"] = d
            if d:
                sign = "yes, above" if d["ci_low"] > 0 else "yes, below" if d["ci_high"] < 0 else "no"
                lines.append(f"| {part} | {a} − {b} | {d['n']} | {d['diff']:+.3f} [{d['ci_low']:+.3f}, "
                             f"{d['ci_high']:+.3f}] | {sign} |")
    return "\n".join(lines) + "\n", res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("pairs", nargs="+", metavar="A:B")
    a = ap.parse_args()
    pairs = []
    for p in a.pairs:
        x, sep, y = p.partition(":")
        if not sep or not x or not y:
            print(f"ranker_paired: {p!r}: A:B expected", file=sys.stderr)
            sys.exit(2)
        pairs.append((x, y))
    text, res = report(load(a.folder), pairs)
    with open(os.path.join(a.folder, "paired.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.folder, "paired.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
