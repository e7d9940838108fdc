#!/usr/bin/env python3
"""Compare how fast DAPO runs of the train stage lose their learning signal, step by step.

    python3 benchmarks/gpu/collapse_compare.py \\
        "lr 5e-5=results/2026-11-25-h100-m16/train_dcg_lr5e5_metrics.jsonl" \\
        "lr 5e-5, entropy 0.05=results/2026-11-25-h100-m17/train_dcg_ent05_metrics.jsonl" \\
        --out results/2026-11-25-collapse

Each run is ``LABEL=METRICS_JSONL`` (the train stage's ``metrics.jsonl``, verl's metric lines by step).
Its train config is read from ``configs/train-<kind>.yaml`` beside the metrics file when it exists
(``run_ranker.py`` keeps it there): its ``verl:`` block, or the ``dapo:`` section of configs recorded
before the train stage took verl's names (read through the stage's table of the former names); else the
stage's recipe is used. The stop step is found with the train stage's own
:func:`memsifter.stages.train.collapse_guard`, so the bound is defined in one place.

Per step and run: groups discarded by dynamic sampling (prompts whose samples all scored the same),
actor token entropy, sampled reward mean, step seconds, and the greedy validation on the held-out split.
Writes ``collapse.md`` (the table), ``collapse.json`` and ``collapse.png`` (discarded groups on a log
axis with the guard's bound, entropy, reward) under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from memsifter.stages.train import EVICTED_KEY as EVICTED  # one name for verl's metric

COLS = (("discarded", EVICTED, "{:.0f}"), ("entropy", "actor/entropy", "{:.3f}"),
        ("reward", "critic/score/mean", "{:.3f}"), ("step s", "timing_s/step", "{:.0f}"))


def read_run(spec: str) -> dict:
    """``LABEL=PATH`` -> {label, path, steps: {step: merged metrics}, verl: verl settings (verl's names, the
    recipe merged with the run's), stop: (step, why)}."""
    from memsifter.stages.train import collapse_guard, merged

    label, sep, path = spec.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"{spec!r}: expected LABEL=METRICS_JSONL")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such metrics file (run {label!r})")
    steps: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise SystemExit(f"{path}: line {n}: field 'step': expected an integer step number")
            steps.setdefault(rec["step"], {}).update(rec)
    verl = merged(_verl_config(path))
    guard = collapse_guard(verl)
    stop = None
    for s in sorted(steps):
        why = guard(steps[s]) if guard else None
        if why:
            stop = (s, why)
            break
    return {"label": label, "path": path, "steps": steps, "verl": verl, "stop": stop}


def _verl_config(metrics_path: str) -> dict:
    """The ``verl:`` block of ``configs/train-<kind>.yaml`` next to ``train_<kind>_metrics.jsonl`` (its
    former ``dapo:`` section in verl's names for a config recorded before), or {}."""
    import yaml

    from memsifter.stages.train import from_dapo

    name = os.path.basename(metrics_path)
    if not (name.startswith("train_") and name.endswith("_metrics.jsonl")):
        return {}
    cfg = os.path.join(os.path.dirname(metrics_path), "configs", f"train-{name[6:-14]}.yaml")
    if not os.path.isfile(cfg):
        return {}
    with open(cfg) as f:
        data = yaml.safe_load(f) or {}
    return data.get("verl") or from_dapo(data.get("dapo") or {}, f"{cfg}: dapo")[0]


def _bound(verl: dict) -> tuple[int, tuple[int, int, int]]:
    """The guard's bound on discarded groups, and (max_num_gen_batches, gen batch, train batch)."""
    from memsifter.stages.train import get

    most, tb = get(verl, "algorithm.filter_groups.max_num_gen_batches"), get(verl, "data.train_batch_size")
    gb = get(verl, "data.gen_batch_size") or tb
    return most * gb - tb, (most, gb, tb)


def _validation(rec: dict) -> str:
    vals = sorted((k, v) for k, v in rec.items() if k.startswith("val-aux/") and k.endswith("/ndcg10/mean@1"))
    return " / ".join(f"{v:.3f}" for _, v in vals)


def table(runs: list[dict]) -> str:
    head = "| step | " + " | ".join(f"{r['label']}: " + ", ".join(c[0] for c in COLS) for r in runs) + " |"
    lines = [head, "|---:|" + "---|" * len(runs)]
    for s in sorted({s for r in runs for s in r["steps"] if s > 0}):
        cells = []
        for r in runs:
            rec = r["steps"].get(s)
            if rec is None:
                cells.append("-")
                continue
            cell = " / ".join(fmt.format(rec[k]) if k in rec else "-" for _, k, fmt in COLS)
            if r["stop"] and r["stop"][0] == s:
                cell = f"**{cell}: guard stop**"
            cells.append(cell)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    notes = []
    from memsifter.stages.train import get

    for r in runs:
        v = r["verl"]
        bound, (most, gb, tb) = _bound(v)
        val = {s: _validation(rec) for s, rec in sorted(r["steps"].items()) if _validation(rec)}
        notes.append(f"- {r['label']}: lr {get(v, 'actor_rollout_ref.actor.optim.lr'):g}, entropy_coeff "
                     f"{get(v, 'actor_rollout_ref.actor.entropy_coeff'):g}, {get(v, 'actor_rollout_ref.rollout.n')} "
                     f"samples x {tb} prompts per step; the guard stops past {bound} discarded groups "
                     f"({most} x {gb} - {tb}); "
                     + (f"stopped at step {r['stop'][0]}" if r["stop"] else "no guard stop")
                     + ("; greedy validation NDCG@10 (held-out parts, alphabetical) by step: "
                        + ", ".join(f"{s}: {v}" for s, v in val.items()) if val else ""))
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def plot(runs: list[dict], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memsifter.training.trainmetrics import _png

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for r in runs:
        steps = sorted(s for s in r["steps"] if s > 0)
        for ax, (_, key, _f) in zip(axes, (COLS[0], COLS[1], COLS[2])):
            pts = [(s, r["steps"][s][key]) for s in steps if key in r["steps"][s]]
            if key == EVICTED:
                pts = [(s, max(v, 0.5)) for s, v in pts]  # log axis: a step that discarded none shows at 0.5
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=r["label"])
            if r["stop"] and key == EVICTED:
                ax.axvline(r["stop"][0], color=line.get_color(), ls=":", lw=1)
    axes[0].axhline(_bound(runs[0]["verl"])[0], color="k", ls="--", lw=1, label="guard bound")
    axes[0].set_yscale("log")
    for ax, t in zip(axes, ("groups discarded by dynamic sampling", "actor token entropy", "sampled reward mean")):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    return _png(fig, title)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=METRICS_JSONL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="DAPO: how fast dynamic sampling runs out of signal")
    a = ap.parse_args(argv)
    runs = [read_run(s) for s in a.runs]
    os.makedirs(a.out, exist_ok=True)
    text = table(runs)
    with open(os.path.join(a.out, "collapse.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "collapse.json"), "w") as f:
        json.dump([{"label": r["label"], "metrics": r["path"], "verl": r["verl"],
                    "guard_stop_step": r["stop"][0] if r["stop"] else None,
                    "guard_reason": r["stop"][1] if r["stop"] else None,
                    "steps": [{"step": s, **{c[0]: rec.get(c[1]) for c in COLS}}
                              for s, rec in sorted(r["steps"].items()) if s > 0]} for r in runs], f, indent=1)
    with open(os.path.join(a.out, "collapse.png"), "wb") as f:
        f.write(plot(runs, a.title))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
