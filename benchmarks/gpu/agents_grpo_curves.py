#!/usr/bin/env python3
"""Curves of a GRPO run of the memory agents (``run_agents.py``) from its committed files.

    python benchmarks/gpu/agents_grpo_curves.py benchmarks/gpu/results/2026-11-27-h100-agents-grpo

Reads the folder's ``train_metrics.jsonl`` (the train stage's verl metrics, one record per step; else verl's console
lines in ``logs/train.log``), ``agents.md`` (which step ``collect`` took) and ``answers/`` (the held-out F1 of the SFT
warm start, step 0, and of the collected GRPO step, from the agents stage's per-question answers). Writes
``curves.json`` and ``curves.png`` (train reward, held-out F1, response length, entropy against the step) into the
folder and prints the per-step table: reward, response length, entropy, step time and its parts, rollout tokens/s
(verl's ``perf/throughput`` and the responses' tokens over the generation time).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

COLS = [("critic/score/mean", "train reward", "{:.3f}"), ("response_length/mean", "response tokens", "{:.0f}"),
        ("actor/entropy", "entropy", "{:.3f}"), ("timing_s/step", "step s", "{:.1f}"), ("timing_s/gen", "rollout s",
        "{:.1f}"), ("timing_s/old_log_prob", "old log-prob s", "{:.1f}"), ("timing_s/ref", "ref s", "{:.1f}"),
        ("timing_s/update_actor", "update s", "{:.1f}"), ("timing_s/save_checkpoint", "save s", "{:.1f}"),
        ("rollout_tokens_per_s", "response tok/s (rollout)", "{:,.0f}"), ("perf/throughput", "verl tok/s", "{:,.0f}"),
        ("actor/perf/max_memory_allocated_gb", "actor peak GB", "{:.1f}")]


def steps(folder: str) -> dict[int, dict]:
    from memsifter.training import trainmetrics

    recs: dict[int, dict] = {}
    path = os.path.join(folder, "train_metrics.jsonl")
    if os.path.exists(path):
        for r in trainmetrics.read_jsonl(open(path, errors="replace").read()):
            recs.setdefault(int(r["step"]), {}).update(r)
    else:
        for line in open(os.path.join(folder, "logs", "train.log"), errors="replace"):
            r = trainmetrics.parse_line(line)
            if r:
                recs.setdefault(int(r["step"]), {}).update(r)
    return recs


def heldout_f1(folder: str) -> dict[str, dict]:
    """Mean F1 of each agent's held-out answers (status ok, as evaluate counts them) for SFT and GRPO."""
    import pyarrow.parquet as pq

    out: dict[str, dict] = {}
    for tag in ("sft", "grpo"):
        path = os.path.join(folder, "answers", f"agents-{tag}.parquet")
        if not os.path.exists(path):
            continue
        by: dict[str, list[float]] = {}
        for r in pq.read_table(path).to_pylist():
            if r["status"] == "ok" and r.get("f1") is not None:
                by.setdefault(r["method"], []).append(float(r["f1"]))
        for m, v in by.items():
            out.setdefault(m, {})[tag] = {"n": len(v), "f1": round(sum(v) / len(v), 4)}
    return out


def train_seconds(folder: str) -> float | None:
    """The train stage's wall seconds as the driver noted them (``train: … after Ns``)."""
    path = os.path.join(folder, "agents.md")
    m = re.search(r"train: .*? after (\d+)s", open(path).read()) if os.path.exists(path) else None
    return float(m.group(1)) if m else None


def collected_step(folder: str) -> int | None:
    path = os.path.join(folder, "agents.md")
    m = re.search(r"collect: step (\d+)", open(path).read()) if os.path.exists(path) else None
    return int(m.group(1)) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--rollouts", type=int, default=80, help="episodes per step (prompts x n), for response tok/s")
    a = ap.parse_args()
    recs = steps(a.folder)
    for r in recs.values():
        if r.get("timing_s/gen") and r.get("response_length/mean"):
            r["rollout_tokens_per_s"] = a.rollouts * r["response_length/mean"] / r["timing_s/gen"]
    held, last = heldout_f1(a.folder), collected_step(a.folder)
    doc = {"steps": [{"step": s, **{k: recs[s].get(k) for k, _, _ in COLS}} for s in sorted(recs)],
           "heldout_f1": {m: {"points": [[0, v["sft"]["f1"]]] + ([[last, v["grpo"]["f1"]]] if "grpo" in v and last
                                                                 else []), **v} for m, v in held.items() if "sft" in v},
           "collected_step": last}
    with open(os.path.join(a.folder, "curves.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print("| step | " + " | ".join(c[1] for c in COLS) + " |")
    print("|---:|" + "---:|" * len(COLS))
    for row in doc["steps"]:
        print(f"| {row['step']} | " + " | ".join(fmt.format(row[k]) if row[k] is not None else "–"
                                                 for k, _, fmt in COLS) + " |")
    stepped = sum(r["timing_s/step"] or 0 for r in doc["steps"])
    total = train_seconds(a.folder)
    if total:
        print(f"\ntrain stage {total:.0f} s: {len(doc['steps'])} steps {stepped:.0f} s, outside the steps (verl's start, "
              f"the deadline's cut) {total - stepped:.0f} s")
    for m, v in doc["heldout_f1"].items():
        print(f"\nheld-out F1, {m}: " + ", ".join(f"step {s}: {f:.3f}" for s, f in v["points"])
              + f" (n {v['sft']['n']}" + (f" / {v['grpo']['n']}" if "grpo" in v else "") + ")")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    xs = [r["step"] for r in doc["steps"]]
    for ax, key, title in ((axes[0], "critic/score/mean", "train reward (0.9 F1 + 0.1 format)"),
                           (axes[2], "response_length/mean", "response tokens (with observations)"),
                           (axes[3], "actor/entropy", "entropy")):
        ys = [r[key] for r in doc["steps"]]
        ax.plot([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], marker="o")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    for m, v in doc["heldout_f1"].items():
        axes[1].plot([p[0] for p in v["points"]], [p[1] for p in v["points"]], marker="s", label=m)
    axes[1].set_title("held-out F1 (0 = SFT warm start)", fontsize=9)
    axes[1].set_xlabel("step")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(a.folder, "curves.png"), dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
