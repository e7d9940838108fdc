#!/usr/bin/env python3
"""Published tables, recomputed from the committed per-question files (issue 42 item 3).

    .venv/bin/python benchmarks/tables.py NAME        # prints the table NAME as the docs publish it
    .venv/bin/python benchmarks/tables.py --list      # the names, each with the files it reads and the docs it backs

Every number comes from committed per-question answers (``answers.parquet`` rows: one question and method a row,
with its F1, EM, format, calls, tokens and seconds). Intervals are the platform's seeded percentile bootstrap
(:func:`memsifter.retrieval.metrics.bootstrap_ci`): 1,000 resamples for a mean (as ``evaluate``), 2,000 for a
paired difference (as ``benchmarks/bench_agents_one_call.py``). ``tests/test_tables.py`` re-runs each table and
finds every printed line in the documents that publish it.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

AGENTS_SFT = "benchmarks/gpu/results/2026-11-26-h100-agents-sft"
CARD = "memsifter/adapters/smollm2-135m-agents-sft/MODEL_CARD.md"


def rows_of(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(ROOT, path)).to_pylist()


def answers(run: str) -> dict[str, list[dict]]:
    """(label -> rows) of the agents run's answers: chat methods of the base, and the agents as ``METHOD, base`` /
    ``METHOD, SFT``."""
    out: dict[str, list[dict]] = {}
    for r in rows_of(f"{run}/answers/chat-base.parquet"):
        out.setdefault(r["method"], []).append(r)
    for tag, f in (("base", "agents-base"), ("SFT", "agents-sft")):
        for r in rows_of(f"{run}/answers/{f}.parquet"):
            out.setdefault(f"{r['method']}, {tag}", []).append(r)
    return out


def ok(rs: list[dict]) -> list[dict]:
    return [r for r in rs if r["status"] == "ok"]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def f1_ci(rs: list[dict], digits: int = 2) -> str:
    from memsifter.retrieval.metrics import bootstrap_ci

    v = [float(r["f1"] or 0.0) for r in ok(rs)]
    lo, hi = bootstrap_ci(v)
    return f"{mean(v):.3f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def share(n: int, d: int) -> str:
    x = 100 * n / d
    return f"{x:.0f}%" if abs(x - round(x)) < 1e-9 else f"{x:.1f}%"


def seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def agents_row(label: str, rs: list[dict], variant: str) -> str:
    """One row of the held-out table. ``variant``: ``results`` (the results README: EM and seconds), ``card`` (the
    model card: EM, no seconds), ``bench`` (benchmarks/README: n, no EM, seconds)."""
    rs_ok = ok(rs)
    bold = label.startswith("**") or label.endswith(", SFT")
    f1 = f"**{f1_ci(rs)}**" if bold else f1_ci(rs)
    em = f"{round(mean([float(r['exact_match'] or 0) for r in rs_ok]), 4):.3f}"  # rounded as evaluate rounds
    if rs[0].get("llm_calls") is None:   # a chat row: one call
        fmt, searched, calls, secs = "–", "–", "1", "–"
        tokens = f"{mean([r['prompt_tokens'] for r in rs_ok]):,.0f}"
    else:
        fmt = share(sum(bool(r["format_ok"]) for r in rs), len(rs))
        searched = share(sum((r["searches"] or 0) >= 1 for r in rs), len(rs)) if "search" in label else "–"
        calls = f"{mean([r['llm_calls'] for r in rs]):.2f}"
        tokens = f"{mean([r['prompt_tokens'] for r in rs]):,.0f}"
        secs = seconds(mean([r["seconds"] for r in rs]))
    cells = {"results": [f1, em, fmt, searched, calls, tokens, secs], "card": [f1, em, fmt, searched, calls, tokens],
             "bench": [str(len(rs)), f1, fmt, searched, calls, tokens, secs]}[variant]
    return "| " + " | ".join([label, *cells]) + " |"


LABELS = {
    "results": (("chat, no memory", "no memory"), ("chat, first stage (BM25 top sessions)", "embed:bm25"),
                ("chat, gold sessions", "oracle (gold sessions)"), ("agent:search, base", "agent:search, base"),
                ("agent:memory, base", "agent:memory, base"), ("**agent:search, SFT**", "agent:search, SFT"),
                ("**agent:memory, SFT**", "agent:memory, SFT")),
    "card": (("base, no memory", "no memory"), ("base, first stage's top sessions", "embed:bm25"),
             ("base, gold sessions", "oracle (gold sessions)"), ("base as agent:search", "agent:search, base"),
             ("base as agent:memory", "agent:memory, base"), ("**this adapter, agent:search**", "agent:search, SFT"),
             ("**this adapter, agent:memory**", "agent:memory, SFT")),
    "bench": (("no memory (chat)", "no memory"), ("first stage, BM25 (chat)", "embed:bm25"),
              ("gold sessions (chat)", "oracle (gold sessions)"), ("agent:search, base", "agent:search, base"),
              ("agent:memory, base", "agent:memory, base"), ("agent:search, SFT", "agent:search, SFT"),
              ("agent:memory, SFT", "agent:memory, SFT")),
}
HEADS = {
    "results": ["| method | F1 [95% CI] | EM | valid format | searched ≥ 1 | LLM calls / q | prompt tokens / q | "
                "seconds / q |", "|---|---|---:|---:|---:|---:|---:|---:|"],
    "card": ["| method | F1 [95% CI] | EM | valid format | searched ≥ 1 | LLM calls / q | prompt tokens / q |",
             "|---|---|---:|---:|---:|---:|---:|"],
    "bench": ["| method | n | F1 [95% CI] | valid format | searched ≥ 1 | LLM calls / q | prompt tokens / q | s / q |",
              "|---|---:|---|---:|---:|---:|---:|---:|"],
}


def table_agents_sft(variant: str = "results") -> list[str]:
    a = answers(AGENTS_SFT)
    return HEADS[variant] + [agents_row(label, a[key], variant) for label, key in LABELS[variant]]


def table_agents_sft_readme() -> list[str]:
    """README's form of the held-out table: untrained and adapter agents side by side in one row."""
    a = answers(AGENTS_SFT)
    lines = ["| SmolLM2-135M-Instruct as | F1 [95% CI] | well-formed | LLM calls / q | prompt tokens / q |",
             "|---|---|---:|---:|---:|"]
    for label, key in (("chat, no memory", "no memory"), ("chat, first stage's top sessions", "embed:bm25"),
                       ("chat, gold sessions", "oracle (gold sessions)")):
        rs = ok(a[key])
        lines.append(f"| {label} | {f1_ci(rs)} | – | 1 | {mean([r['prompt_tokens'] for r in rs]):,.0f} |")
    for agent in ("agent:search", "agent:memory"):
        base, sft = a[f"{agent}, base"], a[f"{agent}, SFT"]
        f1_base = f1_ci(base) if any(r["f1"] for r in ok(base)) else f"{mean([float(r['f1'] or 0) for r in ok(base)]):.3f}"
        fmt = [f"{100 * sum(bool(r['format_ok']) for r in rs) / len(rs):.0f}%" for rs in (base, sft)]
        calls = [f"{mean([r['llm_calls'] for r in rs]):.2f}" for rs in (base, sft)]
        tokens = [f"{mean([r['prompt_tokens'] for r in rs]):,.0f}" for rs in (base, sft)]
        lines.append(f"| {agent}, untrained / **adapter** | {f1_base} / **{f1_ci(sft)}** | {fmt[0]} / {fmt[1]} | "
                     f"{calls[0]} / {calls[1]} | {tokens[0]} / {tokens[1]} |")
    return lines


def paired(a: list[dict], b: list[dict], digits: int = 3) -> str:
    """F1 of ``a`` minus ``b`` over the questions both answered: mean and the 95% interval (2,000 resamples)."""
    from memsifter.retrieval.metrics import bootstrap_ci

    fa = {r["question_id"]: float(r["f1"] or 0.0) for r in ok(a)}
    fb = {r["question_id"]: float(r["f1"] or 0.0) for r in ok(b)}
    d = [fa[q] - fb[q] for q in sorted(set(fa) & set(fb))]
    lo, hi = bootstrap_ci(d, resamples=2000)
    return f"{mean(d):+.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def table_agents_sft_paired() -> list[str]:
    """The paired differences and per-dataset means quoted under the held-out table."""
    a = answers(AGENTS_SFT)
    first = a["embed:bm25"]
    lines = ["| paired on the same questions (2,000 resamples) | n | F1 difference [95% CI] |", "|---|---:|---|"]
    for label, x, y in (("SFT search − base search", "agent:search, SFT", "agent:search, base"),
                        ("SFT memory − base memory", "agent:memory, SFT", "agent:memory, base"),
                        ("SFT search − chat from the first stage", "agent:search, SFT", None),
                        ("SFT memory − chat from the first stage", "agent:memory, SFT", None)):
        other = first if y is None else a[y]
        n = len({r["question_id"] for r in ok(a[x])} & {r["question_id"] for r in ok(other)})
        lines.append(f"| {label} | {n} | {paired(a[x], other)} |")
    lines += ["", "| F1 by dataset | LongMemEval_S | LoCoMo |", "|---|---:|---:|"]
    for label, key in (("SFT search", "agent:search, SFT"), ("SFT memory", "agent:memory, SFT"),
                       ("chat from the first stage", "embed:bm25")):
        by = {d: mean([float(r["f1"] or 0) for r in ok(a[key]) if r["dataset"] == d]) for d in ("longmemeval_s", "locomo")}
        lines.append(f"| {label} | {by['longmemeval_s']:.3f} | {by['locomo']:.3f} |")
    lines += ["", "| held-out questions | LongMemEval_S | LoCoMo | LoCoMo conversations |", "|---|---:|---:|---|"]
    qs = {r["question_id"]: r["dataset"] for r in a["agent:search, SFT"]}
    convs = sorted({q.rsplit("_q", 1)[0] for q, d in qs.items() if d == "locomo"})
    lines.append(f"| {len(qs)} | {sum(d == 'longmemeval_s' for d in qs.values())} | "
                 f"{sum(d == 'locomo' for d in qs.values())} | {', '.join(convs)} |")
    return lines


def stage_seconds(tarball: str, log: str) -> float:
    """The ``seconds`` of the stats a stage printed last in ``log`` inside a committed ``logs.tar.gz``."""
    import json
    import tarfile

    with tarfile.open(os.path.join(ROOT, tarball)) as t:
        text = t.extractfile(log).read().decode()
    start = text.rindex("\n{") + 1
    return float(json.loads(text[start:text.index("\n}", start) + 2])["seconds"])


def tokens(x: float) -> str:
    """1,680,000 -> 1.68M, 540,000 -> 0.54M, 64,000 -> 64k, 187,000 -> 187k (as the throughput table writes them)."""
    if x >= 5e5:
        return f"{x / 1e6:.2f}M"
    return f"{x / 1e3:.0f}k"


def rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 2e3 else f"{x / 1e3:.2f}k"


def table_agents_throughput() -> list[str]:
    """Agent episodes on vLLM: tokens from ``answers/agents-*.parquet`` (as the server counted them) over the
    agents stage's wall time (its printed stats in the machines' ``logs.tar.gz``)."""
    lines = ["| agents | episodes | wall s | prompt tokens (search / memory) | completion tokens (search / memory) | "
             "tokens/s (prompt + completion) | completion tokens/s |", "|---|---:|---:|---|---|---:|---:|"]
    for tag, f, machine in (("base", "agents-base", "machine2"), ("SFT", "agents-sft", "machine1")):
        rs = rows_of(f"{AGENTS_SFT}/answers/{f}.parquet")
        wall = stage_seconds(f"{AGENTS_SFT}/{machine}/logs.tar.gz", f"{f}.log")
        p = {m: sum(r["prompt_tokens"] or 0 for r in rs if r["method"] == m) for m in ("agent:search", "agent:memory")}
        c = {m: sum(r["completion_tokens"] or 0 for r in rs if r["method"] == m) for m in ("agent:search", "agent:memory")}
        total = sum(p.values()) + sum(c.values())
        lines.append(f"| {tag} | {len(rs)} | {wall:.0f} | {tokens(p['agent:search'])} / {tokens(p['agent:memory'])} | "
                     f"{tokens(c['agent:search'])} / {tokens(c['agent:memory'])} | {rate(total / wall)} | "
                     f"{rate(sum(c.values()) / wall)} |")
    return lines


ONE_CALL = "benchmarks/results/agents-one-call-2026-11-26"


def table_agents_one_call() -> list[str]:
    """The one-call control's table: the GPU run's rows recomputed from its answers on the control's questions
    (every other held-out question, in the chat rows' order, as ``bench_agents_one_call.py --every 2``); the
    adapter's one-call rows from the control's own ``paired.json`` / ``report.json`` (its per-question answers were
    not committed), and its paired differences from ``paired.json``."""
    import json

    from memsifter.retrieval.metrics import bootstrap_ci

    a = answers(AGENTS_SFT)
    ids = set(list(dict.fromkeys(r["question_id"] for r in rows_of(f"{AGENTS_SFT}/answers/chat-base.parquet")))[::2])
    with open(os.path.join(ROOT, ONE_CALL, "paired.json")) as f:
        pj = json.load(f)
    with open(os.path.join(ROOT, ONE_CALL, "report.json")) as f:
        cost = {k: v["cost"] for k, v in json.load(f)["side_by_side"]["methods"].items()}

    def computed(key: str) -> tuple[str, list[dict]]:
        rs = [r for r in ok(a[key]) if r["question_id"] in ids]
        v = [float(r["f1"] or 0.0) for r in rs]
        lo, hi = bootstrap_ci(v)
        r4 = [round(x, 4) for x in (mean(v), lo, hi)]   # rounded as the control's paired.json rounds
        return f"{r4[0]:.3f} [{r4[1]:.3f}, {r4[2]:.3f}]", rs

    def stored(key: str) -> str:
        m = pj["f1"][key]
        return f"{m['f1']:.3f} [{m['ci'][0]:.3f}, {m['ci'][1]:.3f}]"

    lines = ["| SmolLM2-135M-Instruct, n = 130 | F1 [95% CI] | LLM calls / q | prompt tokens / q |", "|---|---|---:|---:|"]
    for label, key in (("base, chat, no memory", "no memory"), ("base, chat, first stage", "embed:bm25")):
        f1, rs = computed(key)
        lines.append(f"| {label} | {f1} | 1 | {mean([r['prompt_tokens'] for r in rs]):,.0f} |")
    for label, key, method in (("**adapter, chat, no memory**", "chat none, sft", "no memory (chat-sft)"),
                               ("**adapter, chat, first stage**", "chat first stage, sft", "embed:bm25 (chat-sft)")):
        f1 = stored(key)
        f1 = f"**{f1}**" if "first stage" in label else f1
        lines.append(f"| {label} | {f1} | 1 | {cost[method]['prompt_tokens']['mean']:,.0f} |")
    for label, key in (("adapter, agent:search (GPU run)", "agent:search, SFT"),
                       ("adapter, agent:memory (GPU run)", "agent:memory, SFT")):
        f1, rs = computed(key)
        lines.append(f"| {label} | {f1} | {mean([r['llm_calls'] for r in rs]):.2f} | "
                     f"{mean([r['prompt_tokens'] for r in rs]):,.0f} |")
    lines += ["", "| difference | all (n 130) |", "|---|---|"]
    names = {("chat first stage, sft", "chat first stage, base"): "adapter − base, one call from the first stage",
             ("chat none, sft", "chat none, base"): "adapter − base, one call with no memory",
             ("agent:search, sft", "chat first stage, sft"): "agent:search − adapter's one call from the first stage",
             ("agent:memory, sft", "chat first stage, sft"): "agent:memory − adapter's one call from the first stage"}
    for p in pj["paired"]:
        label = names.get((p["a"], p["b"]))
        if label:
            sign = lambda x: f"{x:+.3f}".replace("-", "−")  # noqa: E731
            lines.append(f"| {label} | {sign(p['diff'])} [{sign(p['ci'][0])}, {sign(p['ci'][1])}] |")
    return lines


AGENTS_RANKER = "benchmarks/gpu/results/2026-11-26-h100-agents-ranker"


def table_agents_base_episodes() -> list[str]:
    """The untrained agents' rows of the earlier run (its agents stage did not publish: the episodes it kept,
    ``agents/base-agents-episodes.jsonl``, one line an episode); the chat rows of that table are evaluate's
    aggregates (``agents/report.md``), not per-question files, and are not printed here."""
    import json

    from memsifter.retrieval.metrics import bootstrap_ci, exact_match

    with open(os.path.join(ROOT, AGENTS_RANKER, "agents", "base-agents-episodes.jsonl")) as f:
        eps = [json.loads(line) for line in f if line.strip()]
    n_questions = len({e["question_id"] for e in eps})
    lines = []
    for method in ("agent:search", "agent:memory"):
        rs = [e for e in eps if e["method"] == method]
        v = [float(e["f1"] or 0.0) for e in rs]
        lo, hi = bootstrap_ci(v)
        em = mean([exact_match(e["answer"] or "", e["gold"]) for e in rs])
        n = f"{len(rs)}" if len(rs) == n_questions else f"{len(rs)} of {n_questions}"
        fmt = f"{sum(bool(e['format_ok']) for e in rs)} / {len(rs)}"
        searched = f"{sum((e['searches'] or 0) >= 1 for e in rs)} / {len(rs)}" if method == "agent:search" else "–"
        lines.append(f"| {method} | {n} | {mean(v):.3f} [{lo:.3f}, {hi:.3f}] | {em:.3f} | {fmt} | {searched} | "
                     f"{mean([e['llm_calls'] for e in rs]):.3g} | {mean([e['prompt_tokens'] for e in rs]):,.0f} | "
                     f"{mean([e['seconds'] for e in rs]):.1f} |")
    return lines


FIRST_STAGE = "benchmarks/results/first-stage-2026-11-26"


def table_first_stage_cv() -> list[str]:
    """Issue 42 item 5: first-stage candidates against the default, by fold (``first_stage_cv.py --table``)."""
    import contextlib
    import io

    import first_stage_cv

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        first_stage_cv.table(os.path.join(ROOT, FIRST_STAGE))
    return out.getvalue().splitlines()


TABLES = {
    "agents-base-episodes": (table_agents_base_episodes, [f"{AGENTS_RANKER}/agents/base-agents-episodes.jsonl"],
                             [f"{AGENTS_RANKER}/README.md"]),
    "agents-sft": (table_agents_sft, [f"{AGENTS_SFT}/answers/*.parquet"],
                   [f"{AGENTS_SFT}/README.md"]),
    "agents-sft-card": (lambda: table_agents_sft("card"), [f"{AGENTS_SFT}/answers/*.parquet"], [CARD]),
    "agents-sft-bench": (lambda: table_agents_sft("bench"), [f"{AGENTS_SFT}/answers/*.parquet"],
                         ["benchmarks/README.md"]),
    "agents-sft-readme": (table_agents_sft_readme, [f"{AGENTS_SFT}/answers/*.parquet"], ["README.md"]),
    "agents-throughput": (table_agents_throughput, [f"{AGENTS_SFT}/answers/agents-*.parquet",
                                                    f"{AGENTS_SFT}/machine*/logs.tar.gz"], [f"{AGENTS_SFT}/README.md"]),
    "agents-one-call": (table_agents_one_call, [f"{AGENTS_SFT}/answers/*.parquet", f"{ONE_CALL}/paired.json",
                                                f"{ONE_CALL}/report.json"], [f"{ONE_CALL}/README.md"]),
    "first-stage-cv": (table_first_stage_cv, [f"{FIRST_STAGE}/*.jsonl", f"{FIRST_STAGE}/meta.json"],
                       [f"{FIRST_STAGE}/README.md"]),
    "agents-sft-paired": (table_agents_sft_paired, [f"{AGENTS_SFT}/answers/*.parquet"],
                          [f"{AGENTS_SFT}/README.md"]),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", choices=sorted(TABLES))
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    if a.list or not a.name:
        for name, (_, files, docs) in sorted(TABLES.items()):
            print(f"{name}: from {', '.join(files)}; published in {', '.join(docs)}")
        return 0
    print("\n".join(TABLES[a.name][0]()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
