#!/usr/bin/env python3
"""The held-out table of a GRPO run of the memory agents (``run_agents.py``), from its committed answers.

Reads a results folder's ``answers/`` (``agents-sft.parquet``: the SFT warm start's episodes, ``agents-grpo.parquet``:
the GRPO adapter's, ``chat-sft.parquet``: the SFT adapter answering in one call from the first stage, no memory and
random sessions) and its ``split.json`` (the held-out split they were measured on, checked). No LLM runs:

1. ``evaluate`` over the held-out questions: F1 (SQuAD-style token F1) and LoCoMo's own QA F1 with 95% intervals,
   the constant-answer reference (chosen on the other half of the questions), every method's paired difference to
   the strongest reference; writes ``report.md`` / ``report.json`` under ``--out`` and prints the answers table;
2. the paired differences on the same questions (95% paired bootstrap, :func:`paired_difference`, seeded), overall and
   by dataset, for both F1s (LoCoMo's F1 on the LoCoMo questions only): GRPO − SFT, and each agent − the SFT adapter
   answering in one call from the first stage.

    python benchmarks/gpu/agents_grpo_table.py --run benchmarks/gpu/results/2026-11-27-h100-agents-grpo \\
        --lme ../shared/data/longmemeval_s_train348.json.gz --locomo memsifter/samples/locomo_dev2.json.gz \\
        --out /tmp/agents-grpo-table
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

FILES = {"sft": "agents-sft.parquet", "grpo": "agents-grpo.parquet", "chat": "chat-sft.parquet"}
FIRST_STAGE = "embed:bm25"


def rows_by_label(answers: str) -> dict[str, list[dict]]:
    """label -> rows: ``agent:search, SFT`` / ``agent:search, GRPO`` and the one-call methods ``one call, …``."""
    import pyarrow.parquet as pq

    out: dict[str, list[dict]] = {}
    for tag, f in FILES.items():
        path = os.path.join(answers, f)
        if not os.path.exists(path):
            continue
        for r in pq.read_table(path).to_pylist():
            label = f"one call, {r['method']}" if tag == "chat" else f"{r['method']}, {tag.upper()}"
            out.setdefault(label, []).append(r)
    return out


def per_question(rows: list[dict], metric: str, dataset: str | None = None) -> dict[str, float]:
    """question id -> score of the answered rows (status ok, as evaluate counts them)."""
    return {r["question_id"]: float(r[metric]) for r in rows
            if r["status"] == "ok" and r.get(metric) is not None and (dataset is None or r["dataset"] == dataset)}


def paired_rows(by: dict[str, list[dict]], pairs: list[tuple[str, str]]) -> list[dict]:
    from memsifter.retrieval.benchmark_metrics import paired_difference

    out = []
    for a, b in pairs:
        if a not in by or b not in by:
            continue
        for metric, dataset in (("f1", None), ("f1", "longmemeval_s"), ("f1", "locomo"), ("locomo_f1", "locomo")):
            d = paired_difference(per_question(by[a], metric, dataset), per_question(by[b], metric, dataset))
            if d:
                ma = per_question(by[a], metric, dataset)
                mb = per_question(by[b], metric, dataset)
                common = sorted(set(ma) & set(mb))
                out.append({"a": a, "b": b, "metric": metric, "dataset": dataset or "all",
                            "mean_a": round(sum(ma[q] for q in common) / len(common), 4),
                            "mean_b": round(sum(mb[q] for q in common) / len(common), 4), **d})
    return out


def episodes(by: dict[str, list[dict]]) -> list[str]:
    """The agents' episodes: valid format, searched at least once, an answer given, LLM calls, searches, prompt and
    completion tokens and seconds per question (each agent label's rows)."""
    lines = ["| agent | n | valid format | searched ≥ 1 | answer given | LLM calls / q | searches / q | "
             "prompt tokens / q | completion tokens / q | seconds / q |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, rs in by.items():
        if label.startswith("one call"):
            continue
        n = len(rs)

        def per_q(k: str) -> float:
            return sum(float(r.get(k) or 0) for r in rs) / n

        lines.append(f"| {label} | {n} | {sum(bool(r.get('format_ok')) for r in rs) / n:.1%} | "
                     f"{sum((r.get('searches') or 0) >= 1 for r in rs) / n:.1%} | "
                     f"{sum(r.get('answer') not in (None, '') for r in rs) / n:.1%} | {per_q('llm_calls'):.2f} | "
                     f"{per_q('searches'):.2f} | {per_q('prompt_tokens'):,.0f} | {per_q('completion_tokens'):.1f} | "
                     f"{per_q('seconds'):.1f} |")
    return lines


GOLD = "gold_sessions.json"  # question id -> its gold session ids (written under --out; committed beside the answers)


def gold_shown(by: dict[str, list[dict]], gold: dict[str, list[str]]) -> list[str]:
    """How often an agent's episode was shown a gold session (its ``context_session_ids``: search hits, chunks; what
    the evidence term of the reward pays for), by agent and dataset with a 95% bootstrap interval, and GRPO − SFT on
    the same questions (95% paired bootstrap); the one-call rows (first stage, random sessions) as references, with
how many sessions each showed. Questions without gold sessions are left out."""
    from memsifter.retrieval.benchmark_metrics import bootstrap_ci, paired_difference

    def shown(rows: list[dict], dataset: str | None) -> dict[str, float]:
        return {r["question_id"]: float(bool(set(gold[r["question_id"]]) & set(r.get("context_session_ids") or [])))
                for r in rows if gold.get(r["question_id"]) and (dataset is None or r["dataset"] == dataset)}

    datasets = (None, *sorted({r["dataset"] for rs in by.values() for r in rs}))
    lines = ["| episodes / context | questions | n | sessions shown / q | gold session shown [95% CI] |",
             "|---|---|---:|---:|---|"]
    for label, rs in by.items():
        if not any(r.get("context_session_ids") for r in rs):
            continue  # no memory: shown nothing
        for d in datasets:
            v = shown(rs, d)
            if v:
                lo, hi = bootstrap_ci(list(v.values()))
                k = sum(len(r.get("context_session_ids") or []) for r in rs if r["question_id"] in v) / len(v)
                lines.append(f"| {label} | {d or 'all'} | {len(v)} | {k:.2f} | {sum(v.values()) / len(v):.3f} "
                             f"[{lo:.3f}, {hi:.3f}] |")
    lines += ["", "| A − B (same questions) | metric | questions | n | A − B [95% CI] |", "|---|---|---|---:|---|"]
    for g in sorted({k.rsplit(", ", 1)[0] for k in by if not k.startswith("one call")}):
        a, b = by.get(f"{g}, GRPO"), by.get(f"{g}, SFT")
        for d in datasets if a and b else ():
            pd = paired_difference(shown(a, d), shown(b, d))
            if pd:
                lines.append(f"| {g}, GRPO − {g}, SFT | gold session shown | {d or 'all'} | {pd['n']} | "
                             f"{pd['diff']:+.3f} [{pd['ci_low']:+.3f}, {pd['ci_high']:+.3f}] |")
    return lines


def robustness(by: dict[str, list[dict]], flips: int = 20000, seeds: tuple[int, ...] = (0, 1, 2, 3, 4),
               resamples: int = 10000) -> list[str]:
    """How firm GRPO − SFT's F1 difference is (over all questions): how many questions changed and which way, a
    two-sided sign-flip permutation p-value (``flips`` seeded flips of the per-question differences) and the 95%
    paired bootstrap interval again with ``resamples`` resamples under each of ``seeds`` (the table's interval uses
    1,000 under one seed)."""
    import random

    lines = ["| A − B (same questions) | n | questions up / down / same | mean | sign-flip p | 95% CI, "
             f"{resamples:,} resamples, seeds {seeds[0]}–{seeds[-1]} |", "|---|---:|---|---:|---:|---|"]
    for g in sorted({k.rsplit(", ", 1)[0] for k in by if not k.startswith("one call")}):
        if f"{g}, GRPO" not in by or f"{g}, SFT" not in by:
            continue
        a, b = per_question(by[f"{g}, GRPO"], "f1"), per_question(by[f"{g}, SFT"], "f1")
        d = [a[q] - b[q] for q in sorted(set(a) & set(b))]
        mean = sum(d) / len(d)
        rng = random.Random(0)
        p = sum(abs(sum(x if rng.random() < 0.5 else -x for x in d)) >= abs(sum(d)) - 1e-12
                for _ in range(flips)) / flips
        cis = []
        for seed in seeds:
            r = random.Random(seed)
            ms = sorted(sum(r.choice(d) for _ in d) / len(d) for _ in range(resamples))
            cis.append(f"[{ms[int(0.025 * resamples)]:+.4f}, {ms[int(0.975 * resamples) - 1]:+.4f}]")
        lines.append(f"| {g}, GRPO − {g}, SFT | {len(d)} | {sum(x > 0 for x in d)} / {sum(x < 0 for x in d)} / "
                     f"{sum(x == 0 for x in d)} | {mean:+.4f} | {p:.3f} | {' '.join(cis)} |")
    return lines


def answer_spread(by: dict[str, list[dict]]) -> list[str]:
    """How varied each agent's answers are (a small adapter can fall into a few stock answers): distinct answers
    (lower-cased, stripped), the most common one and its share, the share with no answer, by dataset."""
    import collections

    lines = ["| agent | questions | n | distinct answers | most common answer | its share | no answer |",
             "|---|---|---:|---:|---|---:|---:|"]
    for label, rs in by.items():
        if label.startswith("one call"):
            continue
        for d in (None, *sorted({r["dataset"] for r in rs})):
            ans = [(r.get("answer") or "").strip().lower() for r in rs if d is None or r["dataset"] == d]
            given = collections.Counter(a for a in ans if a)
            top, k = given.most_common(1)[0] if given else ("", 0)
            lines.append(f"| {label} | {d or 'all'} | {len(ans)} | {len(given)} | {top[:40]!r} | "
                         f"{k / len(ans):.1%} | {sum(not a for a in ans) / len(ans):.1%} |")
    return lines


def markdown(rows: list[dict]) -> list[str]:
    lines = ["| A − B (same questions) | metric | questions | n | A | B | A − B [95% CI] |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        metric = "F1 (SQuAD-style)" if r["metric"] == "f1" else "LoCoMo F1"
        lines.append(f"| {r['a']} − {r['b']} | {metric} | {r['dataset']} | {r['n']} | {r['mean_a']:.3f} | "
                     f"{r['mean_b']:.3f} | {r['diff']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="results folder: answers/*.parquet and split.json")
    p.add_argument("--lme", required=True, help="LongMemEval_S file the run's LongMemEval questions come from")
    p.add_argument("--locomo", required=True, help="LoCoMo file the run's LoCoMo questions come from")
    p.add_argument("--out", required=True, help="where the held-out dataset and evaluate's output go")
    a = p.parse_args(argv)
    answers = os.path.join(a.run, "answers")
    split = os.path.join(a.run, "split.json")
    for path in (a.lme, a.locomo, split, os.path.join(answers, FILES["sft"])):
        if not os.path.exists(path):
            print(f"agents_grpo_table: {path} does not exist", file=sys.stderr)
            return 2

    from memsifter.retrieval import screen
    from memsifter.data.importers.locomo import convert_locomo
    from memsifter.data.importers.longmemeval import convert_longmemeval
    from memsifter.stage import get_stage
    from memsifter.stages.evaluate import locomo_scores
    from run_agents import publish_questions

    by = rows_by_label(answers)
    ids = sorted({r["question_id"] for rs in by.values() for r in rs})
    parts = [convert_longmemeval(a.lme, "longmemeval_s")[0], convert_locomo(a.locomo, "locomo")[0]]
    data = os.path.join(a.out, "heldout")
    if not os.path.exists(os.path.join(data, "_SUCCESS")):
        with open(split) as f:
            publish_questions(parts, ids, data, "the agents' GRPO run's held-out questions", json.load(f))
    files = [os.path.join(answers, f) for f in FILES.values() if os.path.exists(os.path.join(answers, f))]
    m = get_stage("evaluate").run({"output": os.path.join(a.out, "evaluate"), "input": data, "answers": files})
    print("\n".join(screen.answers_table({"held-out": {"evaluate": m}}, width=120)))
    print(f"\nreport: {os.path.join(a.out, 'evaluate', 'report.md')}\n")

    qmap = {q.question_id: q for ds in parts for q in ds.questions}
    for rs in by.values():
        locomo_scores(rs, qmap)
    agents = sorted({k.rsplit(", ", 1)[0] for k in by if not k.startswith("one call")})
    pairs = [(f"{g}, GRPO", f"{g}, SFT") for g in agents]
    pairs += [(f"{g}, {t}", f"one call, {FIRST_STAGE}") for g in agents for t in ("SFT", "GRPO")]
    rows = paired_rows(by, pairs)
    print("\n".join(markdown(rows)))
    print("\n" + "\n".join(episodes(by)))
    gold = {q.question_id: list(q.gold_session_ids or []) for ds in parts for q in ds.questions if q.question_id in ids}
    with open(os.path.join(a.out, GOLD), "w") as f:
        json.dump(gold, f, indent=0, sort_keys=True)
    print("\n" + "\n".join(gold_shown(by, gold)))
    print("\n" + "\n".join(robustness(by)))
    print("\n" + "\n".join(answer_spread(by)))
    with open(os.path.join(a.out, "paired.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
