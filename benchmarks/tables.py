#!/usr/bin/env python3
"""Published tables, recomputed from the committed per-question files (issue 42 item 3).

    .venv/bin/python benchmarks/tables.py NAME        # prints the table NAME as the docs publish it
    .venv/bin/python benchmarks/tables.py --list      # the names, each with the files it reads and the docs it backs

Where the numbers come from, by kind of table:

- answer tables: committed per-question answers (``answers.parquet`` rows: one question and method a row, with its
  F1, EM, format, calls, tokens and seconds; the first-stage CV's per-question ``*.jsonl.gz``). Intervals are the
  platform's seeded percentile bootstrap (:func:`memsifter.retrieval.metrics.bootstrap_ci`): 1,000 resamples for a
  mean (as ``evaluate``), 2,000 for a paired difference (as ``benchmarks/bench_agents_one_call.py``);
- speed tables: the run's committed JSON or log with the timings (a GPU driver's ``*.json``, verl's metrics lines,
  a benchmark's printout), read by the driver's own summary code where it has one;
- ranker tables and the 2026-11-25 first-stage tables: the committed aggregates (``table.json``,
  ``bench_first_stage.json``) only, because those runs did not commit per-question rankings; the documents say so
  beside each of them.

Tables whose runs left nothing committed are not here: their documents mark them not recomputable.
``tests/test_tables.py`` re-runs each table and requires every printed line in every document that publishes it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

AGENTS_SFT = "benchmarks/gpu/results/2026-11-26-h100-agents-sft"
CARD = "memsifter/adapters/smollm2-135m-agents-sft/MODEL_CARD.md"


def rows_of(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(ROOT, path)).to_pylist()


@functools.lru_cache(maxsize=None)
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


def share(n: int, d: int) -> str:
    x = 100 * n / d
    return f"{x:.0f}%" if abs(x - round(x)) < 1e-9 else f"{x:.1f}%"


def seconds(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def agent_stats(rs: list[dict]) -> dict:
    """What every agents-table row shows, from per-question rows (answers or episodes): the answered rows' F1 with
    its 95% interval (1,000 resamples) and EM; over all rows the well-formed and searched counts, LLM calls, prompt
    tokens and seconds per question. EM from ``exact_match`` when the rows carry it, else scored from answer and
    gold as evaluate scores it."""
    from memsifter.retrieval.metrics import bootstrap_ci, exact_match

    done = [r for r in rs if r.get("status", "ok") == "ok"]
    f1 = [float(r["f1"] or 0.0) for r in done]
    em = [float(r["exact_match"] or 0) if "exact_match" in r else exact_match(r["answer"] or "", r["gold"])
          for r in done]
    chat = rs[0].get("llm_calls") is None   # a chat row: one call, no format or search
    per = rs if not chat else done
    return {"n": len(rs), "f1": mean(f1), "ci": bootstrap_ci(f1), "em": mean(em), "chat": chat,
            "format": None if chat else sum(bool(r["format_ok"]) for r in rs),
            "searched": None if chat else sum((r["searches"] or 0) >= 1 for r in rs),
            "calls": 1 if chat else mean([r["llm_calls"] for r in rs]),
            "tokens": mean([r["prompt_tokens"] for r in per]),
            "seconds": None if chat else mean([r["seconds"] for r in rs])}


def agents_row(label: str, rs: list[dict], variant: str) -> str:
    """One row of the held-out table. ``variant``: ``results`` (the results README: EM and seconds), ``card`` (the
    model card: EM, no seconds), ``bench`` (benchmarks/README: n, no EM, seconds)."""
    st = agent_stats(rs)
    bold_row = label.startswith("**") or label.endswith(", SFT")
    f1 = f"{st['f1']:.3f} [{st['ci'][0]:.2f}, {st['ci'][1]:.2f}]"
    f1 = f"**{f1}**" if bold_row else f1
    em = f"{round(st['em'], 4):.3f}"  # rounded as evaluate rounds
    tokens = f"{st['tokens']:,.0f}"
    if st["chat"]:
        fmt, searched, calls, secs = "–", "–", "1", "–"
    else:
        fmt = share(st["format"], st["n"])
        searched = share(st["searched"], st["n"]) if "search" in label else "–"
        calls, secs = f"{st['calls']:.2f}", seconds(st["seconds"])
    cells = {"results": [f1, em, fmt, searched, calls, tokens, secs], "card": [f1, em, fmt, searched, calls, tokens],
             "bench": [str(st["n"]), f1, fmt, searched, calls, tokens, secs]}[variant]
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
    "bench": ["| method | n | F1 [95% CI] | valid format | searched ≥ 1 | LLM calls / q | prompt tokens / q | "
              "s / q |",
              "|---|---:|---|---:|---:|---:|---:|---:|"],
}


def table_agents_sft(variant: str = "results") -> list[str]:
    a = answers(AGENTS_SFT)
    return HEADS[variant] + [agents_row(label, a[key], variant) for label, key in LABELS[variant]]


def table_agents_sft_readme() -> list[str]:
    """README's form of the held-out table: untrained and adapter agents side by side in one row."""
    a = answers(AGENTS_SFT)
    ci = lambda st: f"{st['f1']:.3f} [{st['ci'][0]:.2f}, {st['ci'][1]:.2f}]"  # noqa: E731
    lines = ["| SmolLM2-135M-Instruct as | F1 [95% CI] | well-formed | LLM calls / q | prompt tokens / q |",
             "|---|---|---:|---:|---:|"]
    for label, key in (("chat, no memory", "no memory"), ("chat, first stage's top sessions", "embed:bm25"),
                       ("chat, gold sessions", "oracle (gold sessions)")):
        st = agent_stats(a[key])
        lines.append(f"| {label} | {ci(st)} | – | 1 | {st['tokens']:,.0f} |")
    for agent in ("agent:search", "agent:memory"):
        base, sft = agent_stats(a[f"{agent}, base"]), agent_stats(a[f"{agent}, SFT"])
        f1_base = ci(base) if base["f1"] else f"{base['f1']:.3f}"   # no interval for an all-zero row
        fmt = [f"{100 * st['format'] / st['n']:.0f}%" for st in (base, sft)]
        lines.append(f"| {agent}, untrained / **adapter** | {f1_base} / **{ci(sft)}** | {fmt[0]} / {fmt[1]} | "
                     f"{base['calls']:.2f} / {sft['calls']:.2f} | {base['tokens']:,.0f} / {sft['tokens']:,.0f} |")
    return lines


def f1_by_dataset(rs: list[dict]) -> dict[str, float]:
    """Mean F1 of the answered rows, LongMemEval_S and LoCoMo apart."""
    return {d: mean([float(r["f1"] or 0) for r in ok(rs) if r["dataset"] == d]) for d in ("longmemeval_s", "locomo")}


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
        by = f1_by_dataset(a[key])
        lines.append(f"| {label} | {by['longmemeval_s']:.3f} | {by['locomo']:.3f} |")
    lines += ["", "| held-out questions | LongMemEval_S | LoCoMo | LoCoMo conversations |", "|---|---:|---:|---|"]
    qs = {r["question_id"]: r["dataset"] for r in a["agent:search, SFT"]}
    convs = sorted({q.rsplit("_q", 1)[0] for q, d in qs.items() if d == "locomo"})
    lines.append(f"| {len(qs)} | {sum(d == 'longmemeval_s' for d in qs.values())} | "
                 f"{sum(d == 'locomo' for d in qs.values())} | {', '.join(convs)} |")
    return lines


def log_text(tarball: str, log: str) -> str:
    """A log inside a committed ``logs.tar.gz``."""
    import tarfile

    with tarfile.open(os.path.join(ROOT, tarball)) as t:
        return t.extractfile(log).read().decode(errors="replace")


def stage_stats(tarball: str, log: str) -> dict:
    """The stats a stage printed last in ``log`` inside a committed ``logs.tar.gz``."""
    import json

    text = log_text(tarball, log)
    start = text.rindex("\n{") + 1
    return json.loads(text[start:text.index("\n}", start) + 2])


def stage_seconds(tarball: str, log: str) -> float:
    """The ``seconds`` of the stats a stage printed last in ``log`` inside a committed ``logs.tar.gz``."""
    return float(stage_stats(tarball, log)["seconds"])


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
        c = {m: sum(r["completion_tokens"] or 0 for r in rs if r["method"] == m)
             for m in ("agent:search", "agent:memory")}
        total = sum(p.values()) + sum(c.values())
        lines.append(f"| {tag} | {len(rs)} | {wall:.0f} | {tokens(p['agent:search'])} / {tokens(p['agent:memory'])} | "
                     f"{tokens(c['agent:search'])} / {tokens(c['agent:memory'])} | {rate(total / wall)} | "
                     f"{rate(sum(c.values()) / wall)} |")
    return lines


ONE_CALL = "benchmarks/results/agents-one-call-2026-11-26"


@functools.lru_cache(maxsize=None)
def one_call() -> dict:
    """The one-call control's figures (label -> (F1 [95% CI], LLM calls / q, prompt tokens / q)) and its paired
    differences ((a, b) -> difference [95% CI]): the GPU run's rows recomputed from its answers on the control's
    questions (every other held-out question, in the chat rows' order, as ``bench_agents_one_call.py --every 2``);
    the adapter's one-call rows from the control's own ``paired.json`` / ``report.json`` (its per-question answers
    were not committed), and its paired differences from ``paired.json``."""
    from memsifter.retrieval.metrics import bootstrap_ci

    a = answers(AGENTS_SFT)
    ids = set(list(dict.fromkeys(r["question_id"] for r in rows_of(f"{AGENTS_SFT}/answers/chat-base.parquet")))[::2])
    pj = load_json(f"{ONE_CALL}/paired.json")
    cost = {k: v["cost"] for k, v in load_json(f"{ONE_CALL}/report.json")["side_by_side"]["methods"].items()}
    out = {}
    for key in ("no memory", "embed:bm25", "agent:search, SFT", "agent:memory, SFT"):
        rs = [r for r in ok(a[key]) if r["question_id"] in ids]
        v = [float(r["f1"] or 0.0) for r in rs]
        r4 = [round(x, 4) for x in (mean(v), *bootstrap_ci(v))]   # rounded as the control's paired.json rounds
        calls = "1" if "agent" not in key else f"{mean([r['llm_calls'] for r in rs]):.2f}"
        out[key] = (f"{r4[0]:.3f} [{r4[1]:.3f}, {r4[2]:.3f}]", calls, f"{mean([r['prompt_tokens'] for r in rs]):,.0f}")
    for key, method in (("chat none, sft", "no memory (chat-sft)"), ("chat first stage, sft", "embed:bm25 (chat-sft)")):
        m = pj["f1"][key]
        out[key] = (f"{m['f1']:.3f} [{m['ci'][0]:.3f}, {m['ci'][1]:.3f}]", "1",
                    f"{cost[method]['prompt_tokens']['mean']:,.0f}")
    sign = lambda x: f"{x:+.3f}".replace("-", "−")  # noqa: E731
    out["paired"] = {(p["a"], p["b"]): f"{sign(p['diff'])} [{sign(p['ci'][0])}, {sign(p['ci'][1])}]"
                     for p in pj["paired"]}
    return out


SEARCH_VS_ONE_CALL = ("agent:search, sft", "chat first stage, sft")
MEMORY_VS_ONE_CALL = ("agent:memory, sft", "chat first stage, sft")


def table_agents_one_call() -> list[str]:
    """The one-call control's README tables (:func:`one_call`)."""
    v = one_call()
    lines = ["| SmolLM2-135M-Instruct, n = 130 | F1 [95% CI] | LLM calls / q | prompt tokens / q |",
             "|---|---|---:|---:|"]
    for label, key in (("base, chat, no memory", "no memory"), ("base, chat, first stage", "embed:bm25"),
                       ("**adapter, chat, no memory**", "chat none, sft"),
                       ("**adapter, chat, first stage**", "chat first stage, sft"),
                       ("adapter, agent:search (GPU run)", "agent:search, SFT"),
                       ("adapter, agent:memory (GPU run)", "agent:memory, SFT")):
        f1, calls, tokens = v[key]
        lines.append(row(label, bold(f1, key == "chat first stage, sft"), calls, tokens))
    lines += ["", "| difference | all (n 130) |", "|---|---|"]
    for label, pair in (("adapter − base, one call from the first stage",
                         ("chat first stage, sft", "chat first stage, base")),
                        ("adapter − base, one call with no memory", ("chat none, sft", "chat none, base")),
                        ("agent:search − adapter's one call from the first stage", SEARCH_VS_ONE_CALL),
                        ("agent:memory − adapter's one call from the first stage", MEMORY_VS_ONE_CALL)):
        lines.append(row(label, v["paired"][pair]))
    return lines


def table_agents_one_call_card() -> list[str]:
    """The agents adapter's model card: the one-call control's rows (:func:`one_call`)."""
    v = one_call()
    lines = ["| n = 130 | F1 [95% CI] |", "|---|---|"]
    for label, key in (("base, one call, first stage", "embed:bm25"),
                       ("this adapter, one call, no memory", "chat none, sft"),
                       ("this adapter, one call, first stage", "chat first stage, sft"),
                       ("this adapter, agent:search", "agent:search, SFT"),
                       ("this adapter, agent:memory", "agent:memory, SFT")):
        lines.append(row(label, v[key][0]))
    return lines


def table_agents_one_call_bench() -> list[str]:
    """benchmarks/README's paired differences of the one-call control (:func:`one_call`)."""
    v = one_call()["paired"]
    return ["| paired F1 difference | all (130) |", "|---|---|",
            row("agent:search − adapter, one call from the first stage", v[SEARCH_VS_ONE_CALL]),
            row("agent:memory − adapter, one call from the first stage", v[MEMORY_VS_ONE_CALL])]


AGENTS_RANKER = "benchmarks/gpu/results/2026-11-26-h100-agents-ranker"


def table_agents_base_episodes() -> list[str]:
    """The untrained agents' rows of the earlier run (its agents stage did not publish: the episodes it kept,
    ``agents/base-agents-episodes.jsonl``, one line an episode); the chat rows of that table are evaluate's
    aggregates (``agents/report.md``), not per-question files, and are not printed here."""
    import json

    with open(os.path.join(ROOT, AGENTS_RANKER, "agents", "base-agents-episodes.jsonl")) as f:
        eps = [json.loads(line) for line in f if line.strip()]
    n_questions = len({e["question_id"] for e in eps})
    lines = []
    for method in ("agent:search", "agent:memory"):
        st = agent_stats([e for e in eps if e["method"] == method])
        n = f"{st['n']}" if st["n"] == n_questions else f"{st['n']} of {n_questions}"
        searched = f"{st['searched']} / {st['n']}" if method == "agent:search" else "–"
        lines.append(f"| {method} | {n} | {st['f1']:.3f} [{st['ci'][0]:.3f}, {st['ci'][1]:.3f}] | {st['em']:.3f} | "
                     f"{st['format']} / {st['n']} | {searched} | {st['calls']:.3g} | {st['tokens']:,.0f} | "
                     f"{st['seconds']:.1f} |")
    return lines


FIRST_STAGE = "benchmarks/results/first-stage-2026-11-26"


FIRST_STAGE_27 = "benchmarks/results/first-stage-2026-11-27"   # the candidates of 2026-11-27, the same command
FIRST_STAGE_R3 = "benchmarks/results/first-stage-2026-11-27-r3"   # round 3: all 324 LME questions, with --detail


def table_first_stage_cv(folder: str = FIRST_STAGE, detail: bool = False) -> list[str]:
    """Issue 42 item 5: first-stage candidates against the default, by fold (``first_stage_cv.py --table``)."""
    import contextlib
    import io

    import first_stage_cv

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        first_stage_cv.table(os.path.join(ROOT, folder), detail)
    return out.getvalue().splitlines()



# Speed tables: each number read from the run's committed JSON or log (a speed figure is backed when its timings are
# committed and the builder reads it from them; quality figures need per-question files, above).

GPU = "benchmarks/gpu/results"
README_BENCH = "benchmarks/README.md"


def load_json(path: str):
    import json

    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def gpu_script(name: str):
    """A module of ``benchmarks/gpu`` (the drivers' own readers and table code), imported from there."""
    import importlib

    gpu = os.path.join(ROOT, "benchmarks", "gpu")
    if gpu not in sys.path:
        sys.path.insert(0, gpu)
    return importlib.import_module(name)


def bold(cell: str, on: bool = True) -> str:
    return f"**{cell}**" if on else cell


def span(d: dict, f: str = "{:.1f}", dash: str = "–") -> str:
    """``median (min–max)`` of a spread record (``n``, ``median``, ``min``, ``max``); one value alone."""
    if d["n"] == 1:
        return f.format(d["median"])
    return f"{f.format(d['median'])} ({f.format(d['min'])}{dash}{f.format(d['max'])})"


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_embed_gpu_2026_11_22() -> list[str]:
    """bench_embed_gpu.py on one H100 (2026-11-22), from its committed printout: texts, tokens and seconds from
    the timing lines; tokens/s, peak memory and speed-up from the table it printed (computed there from unrounded
    seconds), each checked against the timing lines."""
    with open(os.path.join(ROOT, "benchmarks/results/bench_embed_gpu_h100.txt")) as f:
        text = f.read().splitlines()
    timed = {(c[0], c[1]): (c[2], c[4], float(c[6])) for c in (ln.split() for ln in text)
             if len(c) == 8 and c[-1] == "s" and c[3] == "texts"}
    cells = ([x.strip() for x in ln.strip("|").split("|")] for ln in text if ln.startswith("| "))
    printed = {(c[0], c[1]): c for c in cells if c[0] in ("float32", "float16", "bfloat16")}
    base = timed[("float32", "naive")][2]
    lines = ["| precision | strategy | texts | tokens | seconds | tokens/s | peak GPU GiB | speed-up vs naive fp32 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for key, (texts, tok, secs) in timed.items():
        tps, peak, speed = printed[key][5], printed[key][6], printed[key][7]
        assert abs(float(tps.replace(",", "")) * secs / int(tok) - 1) < 0.005, key
        assert abs(float(speed.rstrip("x")) - base / secs) < 0.011, key
        lines.append(row(*key, texts, tok, f"{secs:.2f}", tps, peak, speed))
    return lines


def table_embed_gpu_2026_11_23() -> list[str]:
    """The embed stage against plain bf16 on one H100 (2026-11-23, ``call6-embed.json``)."""
    rs = {r["name"]: r for r in load_json(f"{GPU}/2026-11-23-h100-c/call6-embed.json")["results"]}
    plain = rs["plain-bf16 (HF, sorted, SDPA)"]["texts_s"]
    lines = ["| row | sessions/s | tokens/s | MFU | peak GiB | vs plain bf16 |", "|---|---:|---:|---:|---:|---:|"]
    for label, name, strong in (
            ("plain bf16 (HF, sorted, SDPA, padded budget 65,536; Rust tokenizer pool on)",
             "plain-bf16 (HF, sorted, SDPA)", False),
            ("stage, packed, 65,536 real tokens per batch (8 tokenizer threads)", "stage (budget 65536)", False),
            ("stage, packed, 131,072", "stage (budget 131072)", False),
            ("**stage, packed, 131,072 + `torch.compile`** (the stage's GPU default since this run)",
             "stage+compile (budget 131072)", True),
            ("GPU share only: packed forward on ids tokenized beforehand (131,072)",
             "gpu-only: packed forward, ids tokenized beforehand (budget 131072)", False),
            ("the stage's Ray Data path (`embed_missing`, plan 65,536 / 1,024, no compile), incl. actor start + "
             "model load",
             "pipeline: embed_missing (Ray Data actor, default plan, incl. model load)", False)):
        r = rs[name]
        peak = "-" if r["peak_gib"] != r["peak_gib"] else f"{r['peak_gib']:.1f}"  # NaN: not measured
        lines.append(row(label, bold(f"{r['texts_s']:.1f}", strong), f"{r['tokens_s']:,.0f}",
                         bold(f"{100 * r['mfu']:.1f}%", strong), peak, bold(f"{r['texts_s'] / plain:.2f}x", strong)))
    return lines


def table_embed_gpu_scale() -> list[str]:
    """Embed at scale on one H100 (2026-11-24, machine 4, ``embed.json``): median (min–max) of the repeats."""
    rs = {r["name"]: r for r in load_json(f"{GPU}/2026-11-24-h100-m4/embed.json")["results"]}
    plain = rs["plain-bf16 (HF, sorted, SDPA)"]["texts_s"]
    lines = ["| row | texts | repeats | texts/s | MFU (measured peak) | MFU (datasheet) | vs plain |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, name in (
            ("plain bf16 (HF, sorted, SDPA, padded 65,536)", "plain-bf16 (HF, sorted, SDPA)"),
            ("stage in-process, packed 131,072 + compile", "stage+compile (budget 131072)"),
            ("packed forward alone (ids tokenized beforehand)",
             "gpu-only (compiled): packed forward, ids tokenized beforehand (budget 131072)"),
            ("**the stage's Ray Data path** (actor start, model load, compile included)",
             "pipeline: embed_missing (Ray Data actor, default plan, incl. actor start + model load)")):
        r = rs[name]
        pipeline, alone = name.startswith("pipeline"), name.startswith("gpu-only")
        t = r["texts_s_spread"]
        med = bold(f"{t['median']:.1f}", pipeline)
        texts_s = f"{med} ({t['min']:.1f}–{t['max']:.1f})"
        lines.append(row(label, f"{r['texts']:,}", r["repeats"], texts_s, bold(f"{100 * r['mfu']:.1f}%", alone),
                         f"{100 * r['mfu_datasheet']:.1f}%", bold(f"{r['texts_s'] / plain:.2f}x", pipeline)))
    return lines



def rank_runs(path: str) -> tuple[dict, dict | None, dict]:
    """A ``run_rank.py`` rank.json: its runs summarised by run name as the driver summarises them, its HF
    baseline, its measured peak."""
    d = load_json(path)
    return gpu_script("run_rank").summarize(d["results"]), d.get("hf"), d.get("peak")


def table_rank_gpu_2026_11_23() -> list[str]:
    """The rank stage against the original's engine settings, two 130k-token prompts (``call16-rank.json``)."""
    runs, _, _ = rank_runs(f"{GPU}/2026-11-23-h100-c/call16-rank.json")
    lines = ["| run | prompts | engine busy s | pipeline s (incl. engine start) | prompts/s (busy) | "
             "prompt tok/s (vLLM log) | peak GPU MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, name in (("original settings (batch 1, `max_num_seqs=1`, `max_num_batched_tokens=133120`)", "original"),
                        ("ours (batch 2, vLLM defaults)", "ours")):
        r = runs[name]
        lines.append(row(label, r["prompts"], f"{r['busy']['median']:.2f}", f"{r['pipeline']['median']:.1f}",
                         f"{r['prompts_s']:.4f}", f"{r['vllm_log']['prompt_tok_s_max']:,.0f}", f"{r['gpu_mib']:,}"))
    return lines


def rank_rows(runs: dict, hf: dict | None, labels: dict, hf_label: str | None, hf_runs: str | None = None) -> list[str]:
    """Rows of the many-prompt rank tables: engine busy and start s (median (min–max)), prompts/s, and the ratio to
    the original's settings; the HF ``generate`` baseline last."""
    lines = ["| run | prompts | runs | engine busy s | engine start s | prompts/s (busy) | vs original |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    original = runs["original"]["prompts_s"]
    for name, (label, strong) in labels.items():
        r = runs[name]
        lines.append(row(label, r["prompts"], r["runs"], span(r["busy"]), span(r["start"]),
                         bold(f"{r['prompts_s']:.3f}", strong and name != "original"),
                         bold(f"{r['prompts_s'] / original:.2f}x", strong)))
    if hf_label:
        sp = hf.get("full_s_spread") or {"n": 1, "median": hf["full_s"]}
        rate = hf["prompts"] / hf["full_s"]
        lines.append(row(hf_label, hf["prompts"], hf_runs or sp["n"], span(sp), "-", f"{rate:.3f}",
                         f"{rate / original:.2f}x"))
    return lines


def table_rank_gpu_locomo() -> list[str]:
    """256 LoCoMo-length prompts (2026-11-24): vLLM runs of machine 5, HF ``generate`` of machine 7."""
    runs, _, _ = rank_runs(f"{GPU}/2026-11-24-h100-m5/rank.json")
    _, hf, _ = rank_runs(f"{GPU}/2026-11-24-h100-m7/rank.json")
    return rank_rows(runs, hf, {"original": ("original settings (batch 1, `max_num_seqs=1`)", False),
                                "ours": ("**ours** (the stage's defaults)", True)},
                     "HF `generate` (batch 8, left-padded)")


def table_rank_gpu_lme() -> list[str]:
    """64 LongMemEval-length prompts (2026-11-25): machines 13 and 14 pooled by ``run_rank.py --combine``."""
    runs, hf, _ = rank_runs(f"{GPU}/2026-11-25-h100-lme/rank.json")
    lines = rank_rows(runs, hf, {
        "original": ("original settings (batch 1, `max_num_seqs=1`, 133,120-token prefill)", False),
        "ours": ("ours (the stage's defaults: vLLM's 2,048-token prefill chunks, all prompts in flight)", False)},
        "HF `generate` (batch 1)", f"{hf['full_s_spread']['n']} (one per machine)")
    return [ln.replace(" | 0.99x |", " | **0.99x** |") if ln.startswith("| ours") else ln for ln in lines]


def table_rank_prefill_chunk() -> list[str]:
    """Larger prefill chunks at LongMemEval length (2026-11-25, ``2026-11-25-prefill-chunk/rank.json``): the share
    of the prefill roofline at the matmul peak measured in the same run (``run_rank.roofline``)."""
    from memsifter.models.tiny import QWEN3_4B

    runs, _, peak = rank_runs(f"{GPU}/2026-11-25-prefill-chunk/rank.json")
    roof = gpu_script("run_rank").roofline(dict(QWEN3_4B), runs["ours"]["prompt_lengths"], peak["peak"])
    ceiling = roof["prefill_ceiling_prompts_s"]
    lines = ["| setting (`vllm.max_num_batched_tokens`) | prompts | runs | engine busy s | prompts/s (busy) | "
             "% of prefill roofline | vs default |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, name in (("unset = vLLM's 2,048-token chunk (`ours`, today's default)", "ours"),
                        ("16,384", "ours-chunk16384"), ("32,768", "ours-chunk32768")):
        r = runs[name]
        best = name == "ours-chunk16384"
        share = {k: 100 * v / ceiling for k, v in r["prompts_s_spread"].items() if k != "n"}
        roof = bold(f"{share['median']:.1f}%", best)
        roof += f" ({share['min']:.1f}–{share['max']:.1f})" if r["runs"] > 1 else ""
        lines.append(row(label, r["prompts"], r["runs"], span(r["busy"]), bold(f"{r['prompts_s']:.3f}", best), roof,
                         bold(f"{r['prompts_s'] / runs['ours']['prompts_s']:.2f}x", best)))
    return lines



def verl_steps(log: str) -> list[dict]:
    """verl's per-step metrics from a committed train-stage log (its ``step:N - key:value - ...`` lines)."""
    steps: dict[int, dict] = {}
    with open(os.path.join(ROOT, log), errors="replace") as f:
        for line in f:
            at = line.find("step:")
            if at < 0 or " - " not in line[at:]:
                continue
            fields = dict(kv.split(":", 1) for kv in line[at:].strip().split(" - ") if ":" in kv)
            if not fields.get("step", "").isdigit():
                continue
            m = steps.setdefault(int(fields.pop("step")), {})
            for k, v in fields.items():
                try:
                    m[k] = float(v)
                except ValueError:   # a non-numeric metric (verl logs a few): not a table's
                    pass
    return [dict(step=n, **m) for n, m in sorted(steps.items())]


def table_train_gpu_2026_11_23() -> list[str]:
    """The train stage fresh and resumed from S3 (2026-11-23, machine c): verl's step metrics from the stage logs,
    each command's exit and wall time from its driver log; rollout tok/s = response tokens (mean length x 8 prompts
    x 4 samples) / generation s."""
    import re

    lines = ["| run | step | score mean | step s | gen s | update actor s | save ckpt s | rollout tok/s | grad norm |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for call, log, label in (("call7", "call7-train1.log", "fresh"),
                             ("call8", "call8-train2.log", "resumed from S3 on an empty local dir")):
        with open(os.path.join(ROOT, GPU, "2026-11-23-h100-c", f"{call}.log")) as f:
            rc, wall = re.findall(r"-> exit (\d+) in ([0-9.]+)s", f.read())[-1]
        for i, m in enumerate(verl_steps(f"{GPU}/2026-11-23-h100-c/{log}")):
            name = f"{label} (exit {rc}, {float(wall):.0f} s)" if i == 0 else label
            save = f"{m['timing_s/save_checkpoint']:.2f}" if "timing_s/save_checkpoint" in m else "-"
            rollout = m["response_length/mean"] * 8 * 4 / m["timing_s/gen"]
            lines.append(row(name, m["step"], f"{m['critic/score/mean']:.3f}", f"{m['timing_s/step']:.1f}",
                             f"{m['timing_s/gen']:.2f}", f"{m['timing_s/update_actor']:.2f}", save,
                             f"{rollout:,.0f}", f"{m['actor/grad_norm']:.3g}"))
    return lines


DAPO_AB_KEYS = ("timing_s/step", "timing_s/old_log_prob", "timing_s/update_actor", "perf/throughput", "perf/mfu/actor",
                "actor/perf/max_memory_allocated_gb")


def dapo_ab_runs() -> tuple[list[dict], list[dict]]:
    """The two runs of machine 9 (2026-11-24): verl's row-by-row log-probs and the blocks, each its training steps
    from ``train_dcg_{slow,fast}_metrics.jsonl`` (``dapo_ab.py``'s reading)."""
    return tuple(verl_metrics(f"{GPU}/2026-11-24-h100-m9/train_dcg_{k}_metrics.jsonl") for k in ("slow", "fast"))


def verl_metrics(path: str) -> list[dict]:
    """The training steps (those with a step time) of a train stage's committed ``metrics.jsonl``."""
    return gpu_script("dapo_ab").steps(os.path.join(ROOT, path))


def median_of(rs: list[dict], key: str) -> float:
    import statistics

    return statistics.median([r[key] for r in rs])


def table_dapo_ab() -> list[str]:
    """verl's row-by-row log-probs against the blocks: median (min–max) over each run's steps."""
    slow, fast = dapo_ab_runs()
    med, keys = median_of, DAPO_AB_KEYS
    lines = ["| run | step s | old log-probs s | actor update s | tokens/s | actor MFU (verl) | max GPU GB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, rs, strong in (("verl's row loop (`fast_logprobs=false`)", slow, False),
                              ("**blocks (default)**", fast, True)):
        st = [r["timing_s/step"] for r in rs]
        lines.append(row(label, f"{bold(f'{med(rs, keys[0]):.1f}', strong)} ({min(st):.1f}–{max(st):.1f})",
                         f"{med(rs, keys[1]):.1f}", f"{med(rs, keys[2]):.1f}", f"{med(rs, keys[3]):,.0f}",
                         f"{100 * med(rs, keys[4]):.2f}%", f"{med(rs, keys[5]):.1f}"))
    ratio = [med(slow, k) / med(fast, k) for k in keys[:3]] + [med(fast, k) / med(slow, k) for k in keys[3:]]
    lines.append(row("ratio", f"**{ratio[0]:.2f}x faster**", *(f"{x:.2f}x" for x in ratio[1:])))
    return lines


def table_dapo_ab_notes() -> list[str]:
    """benchmarks/gpu/README's form of the same A/B: metric by metric, median (min–max) over each run's steps
    (``dapo_ab.cell``), the ratio as ``dapo_ab.table`` takes it (times: row loop / blocks)."""
    dapo_ab = gpu_script("dapo_ab")
    slow, fast = dapo_ab_runs()
    lines = ["| metric | verl's row loop (`fast_logprobs=false`) | blocks (default) | ratio |", "|---|---:|---:|---:|"]
    for key, label in (("timing_s/step", "step s"), ("timing_s/gen", "generation s"),
                       ("timing_s/old_log_prob", "old log-probs s"), ("timing_s/update_actor", "actor update s"),
                       ("timing_s/update_weights", "weight sync s")):
        ratio = median_of(slow, key) / median_of(fast, key)
        ratio_cell = f"{ratio:.2f}x" + (" faster" if f"{ratio:.2f}" != "1.00" else "")
        b, x = (dapo_ab.cell([r[key] for r in rs]) for rs in (slow, fast))
        step = key == "timing_s/step"
        x = x.replace(x.split(" ")[0], bold(x.split(" ")[0], step), 1)
        lines.append(row(label, b, x, bold(ratio_cell, step)))
    b, x = (median_of(rs, "perf/throughput") for rs in (slow, fast))
    lines.append(row("tokens/s (whole step)", f"{b:,.0f}", f"{x:,.0f}", f"{x / b:.2f}x"))
    b, x = (median_of(rs, "perf/mfu/actor") for rs in (slow, fast))
    lines.append(row("actor MFU (verl's count)", f"{100 * b:.2f}%", f"{100 * x:.2f}%", f"{x / b:.2f}x"))
    b, x = (median_of(rs, "actor/perf/max_memory_allocated_gb") for rs in (slow, fast))
    lines.append(row("max GPU memory allocated", f"{b:.1f} GB", f"{x:.1f} GB", f"{x / b:.2f}x"))
    b, x = (median_of(rs, "critic/score/mean") for rs in (slow, fast))
    lines.append(row("reward mean", f"{b:.3f}", f"{x:.3f}", "(same data, sampling noise)"))
    return lines


def table_entropy_memory() -> list[str]:
    """The entropy term's memory (machine 12, 2026-11-24, ``entropy_memory.json``): peak allocated and saved for
    backward, median of 3."""
    d = load_json(f"{GPU}/2026-11-24-h100-m12/entropy_memory.json")
    rs = {r["mode"]: r for r in d["rows"]}
    gib = 2 ** 30
    lines = ["| run | peak memory allocated | vs verl as is | saved for backward | fw+bw s |",
             "|---|---:|---:|---:|---:|"]
    for label, mode in (("no entropy in the loss", "none"),
                        ("entropy in the loss (verl's `entropy_from_logits` formula)", "plain"),
                        ("the same, checkpointed (verl's `entropy_checkpointing`)", "ckpt")):
        r = rs[mode]
        lines.append(row(label, f"{r['peak_bytes'] / gib:.2f} GiB",
                         f"{r['peak_bytes'] / rs['plain']['peak_bytes']:.2f}x",
                         f"{r['saved_bytes'] / gib:.2f} GiB", f"{r['seconds']:.3f}"))
    return lines


def table_entropy_microbatch() -> list[str]:
    """Peak allocated by micro-batch size (machine 14, 2026-11-25, ``entropy_memory_b19/b9.json``)."""
    lines = ["| micro-batch | no entropy | entropy in the loss | checkpointed |", "|---|---:|---:|---:|"]
    for b, budget in ((19, "32k"), (9, "16k")):   # the micro-batch token budgets run_ranker.py sets
        d = load_json(f"{GPU}/2026-11-25-h100-m14/entropy_memory_b{b}.json")
        rs = {r["mode"]: r["peak_bytes"] / 2 ** 30 for r in d["rows"]}
        plain = bold(f"{rs['plain']:.2f} GiB", b == 9)
        lines.append(row(f"{d['args']['batch']} × {d['args']['length']:,} tokens ({budget})",
                         f"{rs['none']:.2f} GiB", plain, f"{rs['ckpt']:.2f} GiB"))
    return lines



TOKENIZER = "benchmarks/results/2026-11-24-tokenizer/tokenizer.json"


def table_tokenizer() -> list[str]:
    """bench_tokenizer.py on this machine's 2 cores (2026-11-24, ``tokenizer.json``): median (min–max) of 3."""
    d = load_json(TOKENIZER)
    gpu = d["args"]["gpu_texts_s"]
    base = {r["threads"]: r["texts_s"] for r in d["rows"] if r["name"] == "bpe-8k"}
    one = {r["name"]: r["texts_s"] for r in d["rows"] if r["threads"] == 1}
    names = {"bpe-8k": ("bpe-8k (the GPU runs')", "bpe-8k"), "unigram-xlmr": ("unigram, XLM-R recipe",) * 2,
             "wordpiece-30k": ("WordPiece (all-MiniLM-L6-v2)", "WordPiece")}
    lines = [f"| tokenizer | vocab | threads | tokens/text | texts/s | vs bpe-8k | threads to feed {gpu:g} texts/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        first = r["threads"] == 1
        lines.append(row(names[r["name"]][0 if first else 1], f"{r['vocab']:,}", r["threads"],
                         f"{r['tokens_per_text']:,.0f}",
                         f"{r['texts_s']:.1f} ({r['min_texts_s']:.1f}–{r['max_texts_s']:.1f})",
                         f"{r['texts_s'] / base[r['threads']]:.2f}x", f"{gpu / one[r['name']]:.1f}" if first else "-"))
    return lines


SERVE = "benchmarks/results/serve-2026-11-26"


def table_serve() -> list[str]:
    """bench_serve.py (2026-11-26, ``serve.json``): each level's queries/s and latencies, and the soak."""
    d = load_json(f"{SERVE}/serve.json")
    base = {r["clients"]: r["qps"] for r in d["levels"]["baseline"]}
    lines = ["| server | clients | queries/s | p50 ms | p90 ms | p99 ms | errors | ratio to baseline q/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind, rs in d["levels"].items():
        for r in rs:
            lines.append(row(kind, r["clients"], f"{r['qps']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}",
                             f"{r['p99_ms']:.1f}", r["errors"], f"{r['qps'] / base[r['clients']]:.2f}"))
    s = d["soak"]
    lines += ["", f"Soak (Ray Serve, {s['clients']} clients, {s['minutes']} min, run {s['date']}): "
              f"{s['requests']} requests, "
              f"{s['errors']} errors, {s['qps']:.1f} q/s, p99 {s['p99_ms']:.1f} ms; index re-published at "
              f"{s['reload_at_s']} s, reloads seen {s['reloads_seen']}; RSS {s['rss_first_mb']} -> "
              f"{s['rss_last_mb']} MB "
              f"(max {s['rss_max_mb']}), growth {100 * s['rss_growth']:.1f}%. Note: {s['note']}."]
    ident = {k: f"{v['full_order_identical']}/{v['questions']}" for k, v in d["prepare"]["identity"].items()}
    u = d["units_first_embedding"]
    lines += ["", "Identity with the embed stage's rankings.parquet (every question, the service's code): full order "
              f"identical for {ident['stored_query_vectors']} with stored query vectors (the default), "
              f"{ident['fresh_query_vectors']} with query vectors computed by the service.",
              "", f"Unit vectors of every session (once, cached in the state): {u['texts']} texts embedded in "
              f"{u['seconds']:.0f} s ({u['texts'] / u['seconds']:.1f} texts/s); index load (BM25 views of every "
              f"corpus): {d['prepare']['index_load_seconds']} s."]
    for e in d["earlier_soaks"]:
        lines += ["", f"Earlier soak ({e['note']}): {e['requests']} requests, {e['errors']} errors, "
                  f"{e['qps']:.1f} q/s, p99 {e['p99_ms']:.1f} ms; reloads seen {e['reloads_seen']}; "
                  f"RSS {e['rss_first_mb']} -> {e['rss_last_mb']} MB (max {e['rss_max_mb']}), "
                  f"growth {100 * e['rss_growth']:.1f}%."]
    return lines



COLLAPSE = f"{GPU}/2026-11-25-collapse/collapse.json"


@functools.lru_cache(maxsize=None)
def collapse_runs() -> list[dict]:
    """The runs ``collapse.json`` names, each read by ``collapse_compare.read_run`` (steps, verl settings, the
    guard's stop as the train stage decides it)."""
    read = gpu_script("collapse_compare").read_run
    return [read(f"{e['label']}={os.path.join(ROOT, e['metrics'])}") for e in load_json(COLLAPSE)]


def table_collapse() -> list[str]:
    """DAPO's collapse and the guard, one run per setting (machines 11, 16, 17): each run's verl metrics
    (``collapse.json`` names the files), read by ``collapse_compare.read_run`` (the guard's stop as the train stage
    decides it); step s the median over the steps, peak GPU memory the largest ``max_memory_allocated_gb`` of a step,
    validation the greedy NDCG@10 over the shown sessions (LME / LoCoMo) at each validation."""
    import statistics

    collapse_compare = gpu_script("collapse_compare")
    from memsifter.stages.train import EVICTED_KEY

    runs = collapse_runs()
    labels = ("lr 2e-4 (machine 11, 2026-11-24)", "lr 5e-5, the shipped recipe (machine 16)",
              "lr 5e-5, entropy_coeff 0.05, 16k micro-batches (machine 17)")
    lines = ["| setting | guard stop at step | discarded groups / token entropy at step 16 | step s (median) | "
             "peak GPU memory | held-out validation |", "|---|---:|---|---:|---:|---|"]
    shipped = None
    for label, r in zip(labels, runs):
        steps = [m for n, m in sorted(r["steps"].items()) if n > 0]
        secs = statistics.median([m["timing_s/step"] for m in steps if "timing_s/step" in m])
        shipped = shipped or (secs if "shipped" in label else None)
        at16 = r["steps"].get(16, {})
        s16 = f"{at16[EVICTED_KEY]:.0f} / {at16['actor/entropy']:.3f}" if EVICTED_KEY in at16 else "-"
        mem = max(m.get("actor/perf/max_memory_allocated_gb", 0) for m in steps)
        val = [(n, collapse_compare._validation(m)) for n, m in sorted(r["steps"].items())
               if collapse_compare._validation(m)]
        moved = [(n, v) for (n, v), (_, prev) in zip(val[1:], val) if v != prev]
        val_cell = "unchanged" if not moved else (
            f"{val[0][1]} at step {val[0][0]}, " + ", ".join(f"{v} at step {n}" for n, v in moved) + ", then unchanged")
        ratio = f" ({secs / shipped:.2f}x)" if shipped and "entropy" in label else ""
        lines.append(row(label, r["stop"][0], s16, f"{secs:.1f}{ratio}", f"{mem:.1f} GB", val_cell))
    return lines



def table_collapse_steps() -> list[str]:
    """benchmarks/gpu/README's per-step view of the same three runs: discarded groups / actor token entropy every 3
    steps from step 4, up to each run's guard stop (``collapse_runs``)."""
    from memsifter.stages.train import EVICTED_KEY

    runs = collapse_runs()
    lines = ["| step | lr 2e-4 (m11) | lr 5e-5 (m16) | lr 5e-5, entropy 0.05 (m17) |", "|---:|---|---|---|"]
    for n in range(4, max(r["stop"][0] for r in runs) + 1, 3):
        cells = []
        for r in runs:
            m = r["steps"].get(n, {})
            cell = f"{m[EVICTED_KEY]:.0f} / {m['actor/entropy']:.3f}" if n <= r["stop"][0] and EVICTED_KEY in m else "-"
            cells.append(f"**{cell}: guard stop**" if n == r["stop"][0] else cell)
        lines.append(row(n, *cells))
    return lines


# Ranker tables: the GPU drivers' held-out aggregates (``table.json``: evaluate's means per ranker). The runs did not
# commit their per-question rankings, so these check the documents against the committed aggregates only; each
# document says so beside its table.

RANKER_CARD = "memsifter/adapters/smollm2-135m-ranker-dapo/MODEL_CARD.md"
SHUFFLED = f"{GPU}/2026-11-26-h100-agents-ranker"


def ranker_json(path: str) -> dict:
    """``table.json`` of ``run_ranker.py``: {held-out part: {ranker: aggregates}} (answers left out)."""
    return {part: {k: v for k, v in t.items() if not k.startswith("_")} for part, t in load_json(path).items()}


def f3(x: float) -> str:
    return f"{x:.3f}"


def table_ranker_2026_11_24() -> list[str]:
    """The first real ranker (machine 1): chronological lists; random valid rankings from ``random_baseline.json``
    (``gpu/random_baseline.py``, 50 draws on the CPU)."""
    t = ranker_json(f"{GPU}/2026-11-24-h100-m1/table.json")
    rnd = load_json(f"{GPU}/2026-11-24-h100-m1/random_baseline.json")
    lme, loc = t["lme_heldout"], t["locomo_heldout"]
    nd = lambda part, k: f3(part[k]["ndcg@10"])  # noqa: E731
    return ["| ranker | valid format, free generation | LME NDCG@10 | LoCoMo NDCG@10 |", "|---|---:|---:|---:|",
            row("base, free", f"{lme['base-free']['valid_format']:.0%} (falls back to the first stage)",
                f"({nd(lme, 'base-free')})", f"({nd(loc, 'base-free')})"),
            row("base, structured outputs", "100% (forced)", nd(lme, "base-structured"), nd(loc, "base-structured")),
            row("SFT adapter (chronological lists; shipped until the DAPO adapter of machine 8 replaced it)",
                f"**{lme['sft']['valid_format']:.0%}**", nd(lme, "sft"), nd(loc, "sft")),
            row("random valid ranking of the same shown sessions", "-",
                *(f3(rnd[part]["random_valid"]["ndcg@10"]) for part in ("lme_heldout", "locomo_heldout"))),
            row("first stage", "-", nd(lme, "first-stage"), nd(loc, "first-stage"))]


def table_ranker_first_stage_lists() -> list[str]:
    """Rankers given first-stage lists (machines 3–4, ``m4/table.json``)."""
    t = ranker_json(f"{GPU}/2026-11-24-h100-m4/table.json")

    def cells(k: str, paren: bool = False) -> list[str]:
        out = []
        for part in ("lme_heldout", "locomo_heldout"):
            for m in ("ndcg@10", "recall_any@5"):
                out.append(f"({f3(t[part][k][m])})" if paren else f3(t[part][k][m]))
        return out

    fmt = lambda k: f"{t['lme_heldout'][k]['valid_format']:.0%}"  # noqa: E731
    return ["| ranker | valid format, free | LME NDCG@10 | LME R@5 | LoCoMo NDCG@10 | LoCoMo R@5 |",
            "|---|---:|---:|---:|---:|---:|",
            row("base, free", f"{fmt('base-free')} (falls back)", *cells("base-free", True)),
            row("base, structured outputs", f"{fmt('base-structured')} (forced)", *cells("base-structured")),
            row("SFT adapter (gold-first targets)", f"**{fmt('sft')}**", *cells("sft")),
            row("DAPO dcg, 8 steps (LoRA r16, merged sync)", f"**{fmt('dcg')}**", *cells("dcg")),
            row("random valid ranking of the same shown sessions", fmt("random-valid"), *cells("random-valid")),
            row("first stage", "-", *cells("first-stage"))]


def table_ranker_card() -> list[str]:
    """The shipped ranker adapter's held-out table (machine 8, ``m8/table.json``)."""
    t = ranker_json(f"{GPU}/2026-11-24-h100-m8/table.json")
    lme, loc = t["lme_heldout"], t["locomo_heldout"]

    def same(k: str, long: bool) -> list[str]:
        out = []
        for part in (lme, loc):
            for m in ("ndcg@10", "recall_any@5"):
                v = f3(part[k][m])
                assert v == f3(part["first-stage"][m]), (k, m)   # "(=)": equal to the first stage's
                out.append(f"{v} (= first stage)" if long and m == "ndcg@10" else f"{v} (=)")
        return out

    first = [f3(p["first-stage"][m]) for p in (lme, loc) for m in ("ndcg@10", "recall_any@5")]
    structured = [f3(p["base-structured"][m]) for p in (lme, loc) for m in ("ndcg@10", "recall_any@5")]
    below = [p["first-stage"]["ndcg@10"] - p["base-structured"]["ndcg@10"] for p in (lme, loc)]
    return ["| ranker | valid format (no constraints) | LME NDCG@10 (n 57) | LME recall_any@5 | LoCoMo NDCG@10 (n 105) "
            "| LoCoMo recall_any@5 | order changed vs input |", "|---|---:|---:|---:|---:|---:|---|",
            row("first stage (embed, default): **the input of every ranker below**", "-", *first, "-"),
            row("**this adapter**, free generation: returns its input order", f"{lme['dcg']['valid_format']:.0%}",
                *same("dcg", True), "none seen: answers `0, 1, 2, …`, its rankings equal the first stage's; "
                "0 of 96 on unseen LoCoMo (above)"),
            row("the sft adapter it continued", f"{lme['sft']['valid_format']:.0%}", *same("sft", False),
                "as above (every rank metric equals the first stage's)"),
            row("base, free generation",
                f"{lme['base-free']['valid_format']:.0%} (every answer falls back to the first stage)",
                *(f"({x})" for x in first), "none: fallbacks are the input order"),
            row("base, structured outputs", f"{lme['base-structured']['valid_format']:.0%} (forced by regex)",
                *structured, f"changed (NDCG {below[0]:.2f} / {below[1]:.2f} below its input)")]


def shuffled_rows() -> dict:
    """The shuffled-listing rankers (2026-11-26): the driver's ``ranker/table.json`` and, for the SFT adapter, the
    CPU re-rank's ``ranker-sft-shuf/table-cpu-rerank.json`` (its own random-valid draw)."""
    gpu = ranker_json(f"{SHUFFLED}/ranker/table.json")
    cpu = ranker_json(f"{SHUFFLED}/ranker-sft-shuf/table-cpu-rerank.json")
    return {part: {**gpu[part], "sft-shuf": cpu[part]["sft-shuf"], "random-valid (cpu)": cpu[part]["random-valid"]}
            for part in gpu}


def minus(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def ndcg_ci(r: dict) -> str:
    """NDCG@10 with its 95% interval where the driver computed one."""
    ci = r.get("ndcg@10_ci")
    return f"{r['ndcg@10']:.3f} [{ci['ci_low']:.2f}, {ci['ci_high']:.2f}]" if ci else f3(r["ndcg@10"])


def gain_ci(r: dict) -> str:
    """The paired NDCG@10 difference to the first stage with its 95% interval."""
    g, ci = r["ndcg@10_gain_vs_first_stage"], r["ndcg@10_gain_ci"]
    return f"{minus(g)} [{minus(ci['ci_low'])}, {minus(ci['ci_high'])}]"


def tau(r: dict) -> str:
    return minus(r["input_order"]["tau_mean"], 2).lstrip("+")


def table_ranker_shuffled() -> list[str]:
    """benchmarks/README's shuffled-listing table: NDCG@10 [95% CI], paired Δ vs the first stage, order changed."""
    t = shuffled_rows()
    nd, gain = ndcg_ci, gain_ci

    def changed(r: dict) -> str:
        return f"{r['input_order']['changed_share']:.0%} (τ {tau(r)})"

    lines = ["| ranker (SmolLM2-135M-Instruct) | listing | LME NDCG@10 | LME Δ vs first stage | LME changed | "
             "LoCoMo NDCG@10 | LoCoMo Δ | LoCoMo changed |", "|---|---|---|---|---:|---|---|---:|"]
    lme, loc = t["lme_heldout"], t["locomo_heldout"]
    lines.append(row("first stage (zsum)", "–", nd(lme["first-stage"]), "–", "–", nd(loc["first-stage"]), "–",
                     "–"))
    lines.append(row("random valid order of the same shown sessions", "–", nd(lme["random-valid"]), "–", "–",
                     nd(loc["random-valid"]), "–", "–"))
    for label, listing, k in (("base, structured outputs", "first stage", "base-structured"),
                              ("base, structured outputs", "shuffled", "base-structured-shuf"),
                              ("**SFT** (2 epochs on the shuffled rows, LoRA r16)", "shuffled", "sft-shuf")):
        lines.append(row(label, listing, nd(lme[k]), gain(lme[k]), changed(lme[k]), nd(loc[k]), gain(loc[k]),
                         changed(loc[k])))
    free = [lme[k]["input_order"]["changed"] + loc[k]["input_order"]["changed"]
            for k in ("base-free", "base-free-shuf")]
    assert free == [0, 0] and lme["base-free"]["valid_format"] == 0 == loc["base-free-shuf"]["valid_format"]
    lines.insert(6, row("base, free generation", "either",
                        "= first stage: 0% valid, every answer falls back to the input order", "0", "0%",
                        "= first stage", "0", "0%"))
    return lines


def table_ranker_shuffled_results() -> list[str]:
    """The agents-ranker results README's form of the shuffled-listing table (the GPU driver's rows only)."""
    t = shuffled_rows()
    lme, loc = t["lme_heldout"], t["locomo_heldout"]

    def changed(r: dict) -> str:
        o = r["input_order"]
        return f"{o['changed']}/{o['n']}, τ {tau(r)}"

    lines = ["| ranker | listing | LME NDCG@10 | LME order changed | LoCoMo NDCG@10 | LoCoMo order changed |",
             "|---|---|---|---:|---|---:|",
             row("first stage (zsum)", "–", ndcg_ci(lme["first-stage"]), "–", ndcg_ci(loc["first-stage"]), "–"),
             row("random valid order of the shown sessions", "–", ndcg_ci(lme["random-valid"]), "–",
                 ndcg_ci(loc["random-valid"]), "–")]
    for listing, k in (("first stage", "base-structured"), ("**shuffled**", "base-structured-shuf")):
        lines.append(row("base, structured outputs", listing, f"{ndcg_ci(lme[k])} (Δ {gain_ci(lme[k])})",
                         changed(lme[k]), f"{ndcg_ci(loc[k])} (Δ {minus(loc[k]['ndcg@10_gain_vs_first_stage'])})",
                         changed(loc[k])))
    lines.append(row("base, free generation", "either", "= first stage (0% valid: every answer falls back to the input "
                     "order)", lme["base-free"]["input_order"]["changed"], "= first stage",
                     loc["base-free"]["input_order"]["changed"]))
    return lines


def table_ranker_shuffled_card() -> list[str]:
    """The model card's form of the shuffled-listing table (the SFT row with the CPU re-rank's random draw)."""
    t = shuffled_rows()
    lme, loc = t["lme_heldout"], t["locomo_heldout"]
    nd = ndcg_ci
    share = lambda k: " / ".join(f"{p[k]['input_order']['changed_share']:.0%}" for p in (lme, loc))  # noqa: E731
    tau = [lme["sft-shuf"]["input_order"]["tau_mean"], loc["sft-shuf"]["input_order"]["tau_mean"]]
    return ["| ranker (shuffled listing) | LME NDCG@10 (n 57) | LoCoMo NDCG@10 (n 105) | "
            "order changed vs first stage | "
            "valid format |", "|---|---|---|---|---:|",
            row("first stage (its input, not shown in order)", nd(lme["first-stage"]), nd(loc["first-stage"]), "–",
                "–"),
            row("random valid order of the same shown sessions", nd(lme["random-valid (cpu)"]),
                nd(loc["random-valid (cpu)"]), "–", f"{lme['random-valid (cpu)']['valid_format']:.0%}"),
            row("base, structured outputs", nd(lme["base-structured-shuf"]), nd(loc["base-structured-shuf"]),
                share("base-structured-shuf"), f"{lme['base-structured-shuf']['valid_format']:.0%}"),
            row("SFT on the shuffled rows (same recipe as above)", nd(lme["sft-shuf"]), nd(loc["sft-shuf"]),
                f"{share('sft-shuf')} (τ ≈ {minus(sum(tau) / 2, 2).lstrip('+')})",
                f"{lme['sft-shuf']['valid_format']:.0%}")]



FIRST_STAGE_0 = "benchmarks/results/first-stage-2026-11-25/bench_first_stage.json"


def table_first_stage_2026_11_25() -> list[str]:
    """bench_first_stage.py of 2026-11-25 (issue 34): quality per half and cost, from its committed JSON (means per
    candidate and half; the per-question rankings were not committed). Cells are R@5 / NDCG@10 / MRR; LME test
    minutes extrapolated from this run's texts/s, calibrated by the JSON's factor."""
    d = load_json(FIRST_STAGE_0)
    cal = d["calibration"]

    def cell(h: dict) -> str:
        return f"{h['recall_any@5']:.3f} / {h['ndcg@10']:.3f} / {h['mrr']:.3f}"

    def lme_row(label: str, key: str) -> str:
        r = d["tables"]["lme"][key]
        c, strong = r["cost"], "new default" in label
        secs = "-" if not c["texts"] else f"{c['texts_per_s']:.1f}"
        return row(label, bold(cell(r["dev"]), strong), bold(cell(r["held-out"]), strong), f"{c['texts']:,}", secs,
                   f"{c['test_min']:.1f}", bold(f"{c['test_min'] * cal:.1f}", strong))

    lines = ["| candidate | dev (even) | held-out (odd) | texts embedded | texts/s | LME test min here | calibrated |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, key in (("bm25", "bm25"), ("lexical = RRF(bm25_dated, bm25_window)", "lexical"),
                       ("cascade k=5 (old default)",) * 2, ("cascade k=10",) * 2, ("cascade k=20",) * 2,
                       ("user max-sim (every session)", "user max-sim"), ("cascade all",) * 2, ("family all",) * 2,
                       ("zsum k=10",) * 2, ("**zsum k=15 (new default)**", "zsum k=15"), ("zsum k=20",) * 2,
                       ("zsum all",) * 2):
        lines.append(lme_row(label, key))
    lines += ["", "| candidate | dev (conv-26) | held-out (conv-30) |", "|---|---:|---:|"]
    for label, table, key in (("bm25", "locomo", "bm25"), ("lexical", "locomo", "lexical"),
                              ("cascade k=5 (old default)", "locomo", "cascade k=5 (old default)"),
                              ("cascade k=10", "locomo", "cascade k=10"),
                              ("cascade k=20 = all", "locomo", "cascade k=20"),
                              ("user max-sim (all units here)", "locomo", "user max-sim"),
                              ("family all", "locomo", "family all"), ("zsum k=10", "locomo", "zsum k=10"),
                              ("**zsum k=15 (new default)**", "locomo", "zsum k=15"),
                              ("zsum k=20 = all", "locomo", "zsum k=20"),
                              ("chunked (windows of 4 turns)", "locomo costly", "chunked"),
                              ("hybrid = RRF(bm25, chunked)", "locomo costly", "hybrid")):
        r = d["tables"][table][key]
        strong = "new default" in label
        lines.append(row(label, bold(cell(r["dev"]), strong), bold(cell(r["held-out"]), strong)))
    return lines



WRITES = "benchmarks/results/serve-writes-2026-11-26"
WRITES_QUIET = "benchmarks/results/serve-writes-2026-11-27"   # the same command on quiet cores
# session 49's runs on a loaded machine (load 8-21): the old code as control, then the new code twice
WRITES_49 = {name: f"benchmarks/results/serve-writes-2026-11-27-{name}" for name in
             ("groupcommit", "2-before", "2-run1", "2")}
# session 50's runs on quiet cores (load 0.7-2.2), alternating: the code before a461cb8 (c2d563e) and after it,
# twice each; then the query micro-batch split by length (README of the folder)
WRITES_AB = {name: f"benchmarks/results/serve-writes-2026-11-27-ab/{name}" for name in
             ("before-1", "after-1", "before-2", "after-2", "ratio-rule", "groups-own", "groups-sample", "padded-sample")}


# session 52's A/B of 41861a6 (an owner's copy shares its records: copy on write) on quiet cores: the code before it
# (1c39def) and after, alternating, on fresh work folders and on a copy of a large state (README of the folder)
WRITES_COW = "benchmarks/results/serve-writes-2026-11-27-cow"
COW_RUNS = (("fresh-before", "1c39def", "fresh"), ("fresh-after", "c7f2b92", "fresh"),
            ("again-before", "1c39def", "after one run"), ("again-after", "c7f2b92", "after one run"),
            ("big-before-1", "1c39def", "large state (519 MB)"), ("big-after-1", "c7f2b92", "large state (519 MB)"),
            ("big-before-2", "1c39def", "large state, after one run"), ("big-after-2", "c7f2b92", "large state, after one run"))


WRITES_COMPACT = "benchmarks/results/serve-writes-2026-11-27-compact"
COMPACT_RUNS = (("off-1", "memory_compact_files=0", "large state (519 MB)"),
                ("on-1", "compaction on (256)", "large state (519 MB)"),
                ("off-2", "memory_compact_files=0", "large state, after one run"),
                ("on-2", "compaction on (256)", "large state, after one run"))


WRITES_STARTFOLD = "benchmarks/results/serve-writes-2026-11-27-startfold"
STARTFOLD_RUNS = (("off-1", "memory_compact_at_start=false", "never folded (8 x 20,000 files)"),
                  ("on-1", "memory_compact_at_start=true", "never folded (8 x 20,000 files)"),
                  ("off-2", "memory_compact_at_start=false", "after one run"),
                  ("on-2", "memory_compact_at_start=true", "after one run"))


WRITES_GC = "benchmarks/results/serve-writes-2026-11-28-gc"
GC_RUNS = (("base-1", "Python's (700, 10, 10)", "fresh"), ("gc-1", "(50000, 20, 100)", "fresh"),
           ("gc-2", "(50000, 20, 100)", "fresh"), ("base-2", "Python's (700, 10, 10)", "fresh"))


WRITES_FAST = "benchmarks/results/serve-writes-2026-11-28-fastroutes"
FAST_RUNS = (("base-1", "e1140ae: FastAPI for every request", "fresh"), ("fast-1", "f12dc2e: fast routes", "fresh"),
             ("fast-2", "f12dc2e: fast routes", "fresh"), ("base-2", "e1140ae: FastAPI for every request", "fresh"))


WRITES_QPROC = "benchmarks/results/serve-writes-2026-11-28-queryproc"
QPROC_RUNS = (("off-1", "in the server's process", "fresh; machine shared"),
              ("on-1", "a process of its own", "fresh; machine shared"),
              ("on-2", "a process of its own", "fresh; machine shared"),
              ("off-2", "in the server's process", "fresh; machine shared"),
              ("on-3", "a process of its own", "fresh"), ("off-3", "in the server's process", "fresh"),
              ("off-4", "in the server's process", "fresh"), ("on-4", "a process of its own", "fresh"))


def table_serve_writes_cow(folder: str = WRITES_COW, runs: tuple = COW_RUNS, label: str = "code",
                           ready: bool = False) -> list[str]:
    """One row per run of an A/B of bench_serve.py --writes (copy on write; log compaction), from each run's
    writes.json, with a 95% bootstrap interval of the search p99 from its per-request latencies (requests.json.gz;
    2,000 resamples, seed 0); ``ready``: the seconds each run's first server and its restarted one took to ready."""
    import gzip

    import numpy as np

    rng = np.random.default_rng(0)
    lines = [f"| run | {label} | state at start | adds (n) | adds/s | adds p99 ms | searches (n, adds running) | search q/s | "
             "search p99 ms [95% CI] | adds p99 ms during search | baseline q/s | search over baseline |"
             + (" first server ready s | restarted server ready s |" if ready else ""),
             "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|" + ("---:|---:|" if ready else "")]
    for name, code, state in runs:
        w = load_json(f"{folder}/{name}/writes.json")["writes"]
        with gzip.open(os.path.join(ROOT, folder, name, "requests.json.gz"), "rt") as f:
            lat = np.asarray(json.load(f)["search_with_adds"])
        a, s, d, b = w["adds"], w["search_with_adds"], w["adds_during_search"], w["baseline_search"]
        if lat.size:
            boot = np.percentile(rng.choice(lat, size=(2000, lat.size)), 99, axis=1)
            lo, hi = np.percentile(boot, [2.5, 97.5])
            p99 = f"{s['p99_ms']:.0f} [{lo:.0f}, {hi:.0f}]"
        else:   # none ended inside the measured window
            p99 = "none ended in the window"
        adds_p99 = f"{d['p99_ms']:.1f}" if d["adds"] else "none ended in the window"
        lines.append(f"| {name} | {code} | {state} | {a['adds']:,} | {a['adds_per_s']:.0f} | {a['p99_ms']:.1f} | "
                     f"{s['requests']:,} | {s['qps']:.1f} | "
                     f"{p99} | {adds_p99} | {b['qps']:.1f} | "
                     f"{w['search_qps_over_baseline']:.2f}x |"
                     + (f" {w['first_ready_s']:.1f} | {w['restart_ready_s']:.1f} |" if ready else ""))
    return lines


QUERY_ENCODER = "benchmarks/results/query-encoder-2026-11-27"


def table_query_encoder() -> list[str]:
    """``bench_query_encoder.py``'s table, from its committed ``encoder.json`` (its own report function)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_query_encoder

    return bench_query_encoder.report(load_json(f"{QUERY_ENCODER}/encoder.json"))


def table_serve_writes(folder: str = WRITES) -> list[str]:
    """A bench_serve.py --writes run: its own report (``bench_serve.writes_report``) re-written from the run's
    committed ``writes.json`` into a scratch folder."""
    import contextlib
    import io
    import tempfile

    import bench_serve

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        bench_serve.writes_report(load_json(f"{folder}/writes.json"), tmp)
        with open(os.path.join(tmp, "writes.md")) as f:
            return f.read().splitlines()



REFERENCE_ROWS = "benchmarks/results/reference-rows-2026-11-26"
SHARED_LME = os.path.join(os.path.dirname(ROOT), "shared", "data", "longmemeval_s_train348.json.gz")


def table_reference_rows() -> list[str]:
    """The agents' held-out answers with the reference rows and both F1s: ``reference_rows.py`` (one ``evaluate`` of
    the committed answers, no LLM) into a scratch folder. Its LongMemEval questions come from the shared
    ``longmemeval_s_train348.json.gz`` beside the repository (not committed: LongMemEval's own file)."""
    import contextlib
    import io
    import tempfile

    import reference_rows

    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
        assert reference_rows.main(["--lme", SHARED_LME,
                                    "--locomo", os.path.join(ROOT, "memsifter/samples/locomo_dev2.json.gz"),
                                    "--answers", os.path.join(ROOT, AGENTS_SFT, "answers"), "--out", tmp]) == 0
    return [ln for ln in out.getvalue().splitlines() if not ln.startswith("report:")]



DAPO_4B = f"{GPU}/2026-11-26-h100-4b-dapo"


def table_dapo_4b() -> list[str]:
    """The 4B-shaped DAPO steps on one H100 (issue 43): ``dapo_4b_table.py``'s table from the committed
    ``runs.jsonl`` and ``steps.jsonl``."""
    dapo_4b_table = gpu_script("dapo_4b_table")
    text, _ = dapo_4b_table.table(*dapo_4b_table.load(os.path.join(ROOT, DAPO_4B)))
    return [ln for ln in text.splitlines() if ln.startswith("|")]



MULTI_GPU = f"{GPU}/2026-11-26-h100x2-multigpu"


def table_multigpu() -> list[str]:
    """The train stage on 1 and 2 GPUs and the rank stage with TP 2 (issue 35): ``multigpu.json``'s steps and
    ``rank-tp2.json``'s runs (summarised as ``run_rank.py`` does)."""
    steps = load_json(f"{MULTI_GPU}/multigpu.json")["steps"]
    labels = {"1gpu-full-tp1": "1 GPU, rollout TP 1",
              "2gpu-full-tp1 (killed)": "2 GPUs (FSDP over 2 ranks), rollout TP 1",
              "2gpu-full-tp1 (resumed, rollout TP 2)": "2 GPUs, resumed from S3, rollout TP 2"}
    lines = ["| run | step | step s | gen s | update s | rollout tok/s |", "|---|---|---|---|---|---|"]
    for st in steps:
        lines.append(row(labels[st["run"]], st["step"], f"{st['step_s']:.1f}", f"{st['gen_s']:.1f}",
                         f"{st['update_s']:.1f}", f"{round(st['rollout_tok_s'], -1):,.0f}"))
    runs, _, _ = rank_runs(f"{MULTI_GPU}/rank-tp2.json")
    one = runs["ours"]["prompts_s"]
    lines += ["", "| run | engine busy s | prompts/s (busy) | vs 1 GPU | pipeline s incl. engine start |",
              "|---|---|---|---|---|"]
    for label, name in (("1 engine, 1 GPU", "ours"), ("1 engine, tensor parallel 2", "ours-tp2"),
                        ("2 engines (replicas) of 1 GPU", "ours-rep2")):
        r = runs[name]
        lines.append(row(label, f"{r['busy']['median']:.1f}", f"{r['prompts_s']:.2f}",
                         bold(f"{r['prompts_s'] / one:.2f}×", name == "ours-tp2"), f"{r['pipeline']['median']:.1f}"))
    return lines


AGENTS_GRPO = f"{GPU}/2026-11-27-h100-agents-grpo"
AGENTS_GRPO7 = f"{GPU}/2026-11-27-h100-agents-grpo7"  # 7 steps, 4 updates a step, data phase made on the CPU
AGENTS_GRPO_EV = f"{GPU}/2026-11-28-h100-agents-grpo-evidence"  # 12 steps, reward 0.7 x F1 + 0.3 x gold session shown


@functools.lru_cache(maxsize=None)
def grpo_rows(folder: str = AGENTS_GRPO) -> dict[str, list[dict]]:
    """The GRPO run's answers by label (``agents_grpo_table.rows_by_label``), LoCoMo rows scored with LoCoMo's own
    F1 against the committed LoCoMo sample (the run's LoCoMo questions; LongMemEval rows need none)."""
    from memsifter.data.importers.locomo import convert_locomo
    from memsifter.retrieval.scoring import locomo_scores

    by = gpu_script("agents_grpo_table").rows_by_label(os.path.join(ROOT, folder, "answers"))
    qmap = {q.question_id: q for q in convert_locomo(os.path.join(ROOT, "memsifter/samples/locomo_dev2.json.gz"),
                                                     "locomo")[0].questions}
    for rs in by.values():
        locomo_scores(rs, qmap)
    return by


def table_agents_grpo_paired(folder: str = AGENTS_GRPO) -> list[str]:
    """The GRPO run's paired differences and episodes, as ``agents_grpo_table.py`` prints them after evaluate's table
    (its ``paired_rows``, ``markdown`` and ``episodes`` over the committed answers)."""
    t = gpu_script("agents_grpo_table")
    by = grpo_rows(folder)
    agents = sorted({k.rsplit(", ", 1)[0] for k in by if not k.startswith("one call")})
    pairs = [(f"{g}, GRPO", f"{g}, SFT") for g in agents]
    pairs += [(f"{g}, {tag}", f"one call, {t.FIRST_STAGE}") for g in agents for tag in ("SFT", "GRPO")]
    return t.markdown(t.paired_rows(by, pairs)) + t.episodes(by)


def table_agents_grpo_gold(folder: str = AGENTS_GRPO_EV) -> list[str]:
    """The GRPO run's paired differences and episodes (:func:`table_agents_grpo_paired`), then how often each agent's
    episode was shown a gold session, beside the one-call contexts (``agents_grpo_table.gold_shown`` over the
    committed answers and the committed ``gold_sessions.json``), how firm GRPO − SFT is (``robustness``) and how varied the answers are (``answer_spread``)."""
    t = gpu_script("agents_grpo_table")
    with open(os.path.join(ROOT, folder, t.GOLD)) as f:
        gold = json.load(f)
    by = grpo_rows(folder)
    return table_agents_grpo_paired(folder) + t.gold_shown(by, gold) + t.robustness(by) + t.answer_spread(by)


def table_agents_grpo_curves(folder: str = AGENTS_GRPO) -> list[str]:
    """The GRPO run's per-step table, train-stage time and held-out F1 points: ``agents_grpo_curves.py`` run on a
    scratch copy of the files it reads (it writes ``curves.json`` / ``curves.png`` beside them)."""
    import contextlib
    import io
    import shutil
    import tempfile

    curves = gpu_script("agents_grpo_curves")
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(ROOT, folder)
        for rel in ("train_metrics.jsonl", "agents.md", "answers"):
            (shutil.copytree if os.path.isdir(os.path.join(src, rel)) else shutil.copy)(os.path.join(src, rel),
                                                                                         os.path.join(tmp, rel))
        argv, sys.argv = sys.argv, ["agents_grpo_curves.py", tmp]
        try:
            with contextlib.redirect_stdout(out):
                assert curves.main() == 0
        finally:
            sys.argv = argv
    return [ln for ln in out.getvalue().splitlines() if ln.strip()]


def agents_md_phases(path: str) -> dict[str, float]:
    """``run_agents.py``'s phase table in a machine's ``agents.md``: phase -> seconds."""
    with open(os.path.join(ROOT, path)) as f:
        cells = ([c.strip() for c in ln.strip().strip("|").split("|")] for ln in f if ln.startswith("| "))
        return {c[0]: float(c[1]) for c in cells if len(c) == 2 and c[1].replace(".", "").isdigit()}


def table_agents_sft_phases() -> list[str]:
    """The agents-SFT run's phases on its two machines (each machine's ``agents.md``)."""
    m = {k: agents_md_phases(f"{AGENTS_SFT}/{k}/agents.md") for k in ("machine1", "machine2")}
    lines = ["| phase | machine 1 s | machine 2 s |", "|---|---:|---:|"]
    for phase in dict.fromkeys([*m["machine1"], *m["machine2"]]):
        lines.append(row(phase, *(f"{m[k][phase]:.1f}" if phase in m[k] else "–" for k in m)))
    return lines


def table_agents_grpo7_phases() -> list[str]:
    """The 7-step GRPO run's phases: the first machine (SFT, answers, GRPO round 1) and the second (round 2)."""
    m = {"machine 1 s": agents_md_phases(f"{AGENTS_GRPO7}/agents.md"),
         "machine 2 (round 2) s": agents_md_phases(f"{AGENTS_GRPO7}/round2/agents.md")}
    lines = ["| phase | " + " | ".join(m) + " |", "|---|---:|---:|"]
    for phase in dict.fromkeys(k for v in m.values() for k in v):
        lines.append(row(phase, *(f"{v[phase]:.1f}" if phase in v else "–" for v in m.values())))
    return lines


def table_agents_grpo_ev_phases() -> list[str]:
    """The evidence-reward GRPO run's phases on its one machine (``agents.md``)."""
    return ["| phase | seconds |", "|---|---:|",
            *(row(k, f"{v:.1f}") for k, v in agents_md_phases(f"{AGENTS_GRPO_EV}/agents.md").items())]


def table_agents_grpo_phases() -> list[str]:
    """The GRPO run's phases: ``agents.md``'s table and the re-run of the GRPO answers (the driver's log line)."""
    import re

    phases = agents_md_phases(f"{AGENTS_GRPO}/agents.md")
    log = log_text(f"{AGENTS_GRPO}/logs.tar.gz", "logs/driver-grpo-answers.log")
    phases.update({k: float(v) for k, v in re.findall(r"\] (grpo-answers): ([0-9.]+)s", log)})
    return ["| phase | seconds |", "|---|---:|", *(row(k, f"{v:.1f}") for k, v in phases.items())]


VLLM_WAIT = "benchmarks/results/vllm-cpu-wait-2026-11-27"


def table_vllm_cpu_wait() -> list[str]:
    """``bench_vllm_cpu.py --compare wait`` (2026-11-27): its per-measurement lines in the committed ``bench.log``
    (the run was stopped after the idle-cores pair, so it wrote no ``--json``), tabled by the bench's own code."""
    import re

    import bench_vllm_cpu as bench

    rows = [{"busy": int(m.group(1)), "repeat": int(m.group(2)), "setting": m.group(3), "seconds": float(m.group(4)),
             "load1": float(m.group(5))}
            for m in re.finditer(r"^\[bench\] busy (\d+), repeat (\d+): (.+): ([\d.]+)s \(load ([\d.]+)\)$",
                                 open(os.path.join(ROOT, VLLM_WAIT, "bench.log")).read(), re.MULTILINE)]
    return [line for line in bench.table(rows, bench.SETTINGS["wait"], 2, 1).splitlines() if line.startswith("|")]


# Issue 43/44 runs of 2026-11-27 on one 4-GPU host: the 4B DAPO runs (each run's runs.jsonl / steps.jsonl / train log,
# read by dapo_4b_table.py) and the ranker's DAPO with the improvement reward (the driver's table.json and the
# per-question NDCG@10 files, read by run_ranker.py's and ranker_paired.py's own code).
DAPO_X4 = f"{GPU}/2026-11-27-h100x4-4b-dapo"
DAPO_X1 = f"{GPU}/2026-11-26-h100-4b-dapo"
DAPO_RESIZE = f"{GPU}/2026-11-27-h100x4-4b-resize"   # the second 4-GPU host: resume 4 -> 2, 1 vs 4 GPUs, LoRA
RANKER_IMPROVE = f"{GPU}/2026-11-27-h100x4-ranker-improve"
DAPO_NODES = f"{GPU}/2026-11-27-h100x4-4b-nodes"     # two raylets of 2 GPUs; FlashAttention-4 varlen on Hopper
IMPROVE_PAIRS = [("improve-shuf", "sft-shuf"), ("improve-shuf", "first-stage"), ("sft-shuf", "first-stage"),
                 ("improve-shuf", "base-structured-shuf")]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def table_dapo_4b_folder(folder: str) -> list[str]:
    """A 4B DAPO results folder's tables (per step, scaling, 100-step cost), as ``dapo_4b_table.py`` prints them."""
    t = gpu_script("dapo_4b_table")
    runs, steps = t.load(os.path.join(ROOT, folder))
    return _table_rows(t.table(runs, steps)[0])


def table_train_4b_cost() -> list[str]:
    """README's training section: the 100-step cost rows of both 4B results folders."""
    t = gpu_script("dapo_4b_table")
    lines = []
    for folder in (DAPO_X1, DAPO_X4, DAPO_RESIZE, DAPO_NODES):
        runs, steps = t.load(os.path.join(ROOT, folder))
        _, rows = t.table(runs, steps)
        cost = t.cost_lines(runs, rows)
        lines += [x for x in _table_rows(cost) if x not in lines]
    return lines


def table_varlen_fa4() -> list[str]:
    """Which varlen attention verl's remove-padding can use on Hopper (issue 43 item 6), as ``varlen_check.py --table``
    prints it from the committed ``varlen_check.json``."""
    return _table_rows("\n".join(gpu_script("varlen_check").table(load_json(f"{DAPO_NODES}/varlen/varlen_check.json"))))


def table_ranker_improve() -> list[str]:
    """The ranker-improve run's held-out tables, as the driver wrote them (``run_ranker.table_lines``)."""
    return _table_rows("\n".join(gpu_script("run_ranker").table_lines(load_json(f"{RANKER_IMPROVE}/results/table.json"))))


def table_ranker_improve_paired() -> list[str]:
    """Paired NDCG@10 differences of the ranker-improve run, from its per-question files (``ranker_paired.py``)."""
    rp = gpu_script("ranker_paired")
    return _table_rows(rp.report(rp.load(os.path.join(ROOT, RANKER_IMPROVE, "results")), IMPROVE_PAIRS)[0])


TABLES = {
    "agents-grpo-paired": (table_agents_grpo_paired, [f"{AGENTS_GRPO}/answers/*.parquet",
                                                      "memsifter/samples/locomo_dev2.json.gz"],
                           [f"{AGENTS_GRPO}/README.md"]),
    "agents-grpo-curves": (table_agents_grpo_curves, [f"{AGENTS_GRPO}/train_metrics.jsonl", f"{AGENTS_GRPO}/agents.md",
                                                      f"{AGENTS_GRPO}/answers/agents-*.parquet"],
                           [f"{AGENTS_GRPO}/README.md", f"{AGENTS_GRPO}/curves.md"]),
    "agents-grpo7-paired": (functools.partial(table_agents_grpo_paired, AGENTS_GRPO7),
                            [f"{AGENTS_GRPO7}/answers/*.parquet", "memsifter/samples/locomo_dev2.json.gz"],
                            [f"{AGENTS_GRPO7}/README.md"]),
    "agents-grpo7-curves": (functools.partial(table_agents_grpo_curves, AGENTS_GRPO7),
                            [f"{AGENTS_GRPO7}/train_metrics.jsonl", f"{AGENTS_GRPO7}/agents.md",
                             f"{AGENTS_GRPO7}/answers/agents-*.parquet"],
                            [f"{AGENTS_GRPO7}/README.md", f"{AGENTS_GRPO7}/curves.md"]),
    "agents-grpo-evidence-paired": (functools.partial(table_agents_grpo_gold, AGENTS_GRPO_EV),
                                    [f"{AGENTS_GRPO_EV}/answers/*.parquet", f"{AGENTS_GRPO_EV}/gold_sessions.json",
                                     "memsifter/samples/locomo_dev2.json.gz"],
                                    [f"{AGENTS_GRPO_EV}/README.md"]),
    "agents-grpo-evidence-curves": (functools.partial(table_agents_grpo_curves, AGENTS_GRPO_EV),
                                    [f"{AGENTS_GRPO_EV}/train_metrics.jsonl", f"{AGENTS_GRPO_EV}/agents.md",
                                     f"{AGENTS_GRPO_EV}/answers/agents-*.parquet"],
                                    [f"{AGENTS_GRPO_EV}/README.md", f"{AGENTS_GRPO_EV}/curves.md"]),
    "agents-grpo-evidence-phases": (table_agents_grpo_ev_phases, [f"{AGENTS_GRPO_EV}/agents.md"],
                                    [f"{AGENTS_GRPO_EV}/README.md"]),
    "agents-grpo7-phases": (table_agents_grpo7_phases, [f"{AGENTS_GRPO7}/agents.md", f"{AGENTS_GRPO7}/round2/agents.md"],
                            [f"{AGENTS_GRPO7}/README.md"]),
    "agents-grpo-phases": (table_agents_grpo_phases, [f"{AGENTS_GRPO}/agents.md", f"{AGENTS_GRPO}/logs.tar.gz"],
                           [f"{AGENTS_GRPO}/README.md"]),
    "agents-sft-phases": (table_agents_sft_phases, [f"{AGENTS_SFT}/machine*/agents.md"], [f"{AGENTS_SFT}/README.md"]),
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
    "agents-one-call-card": (table_agents_one_call_card, [f"{AGENTS_SFT}/answers/*.parquet", f"{ONE_CALL}/paired.json",
                                                          f"{ONE_CALL}/report.json"], [CARD]),
    "agents-one-call-bench": (table_agents_one_call_bench, [f"{ONE_CALL}/paired.json"], [README_BENCH]),
    "first-stage-cv": (table_first_stage_cv, [f"{FIRST_STAGE}/*.jsonl.gz", f"{FIRST_STAGE}/meta.json"],
                       [f"{FIRST_STAGE}/README.md"]),
    "agents-sft-paired": (table_agents_sft_paired, [f"{AGENTS_SFT}/answers/*.parquet"],
                          [f"{AGENTS_SFT}/README.md"]),
    "first-stage-cv-2026-11-27": (lambda: table_first_stage_cv(FIRST_STAGE_27),
                                  [f"{FIRST_STAGE_27}/*.jsonl.gz", f"{FIRST_STAGE_27}/meta.json"],
                                  [f"{FIRST_STAGE_27}/README.md"]),
    "first-stage-cv-2026-11-27-r3": (lambda: table_first_stage_cv(FIRST_STAGE_R3, detail=True),
                                     [f"{FIRST_STAGE_R3}/*.jsonl.gz", f"{FIRST_STAGE_R3}/meta.json"],
                                     [f"{FIRST_STAGE_R3}/table.md"]),
    "embed-gpu-2026-11-22": (table_embed_gpu_2026_11_22, ["benchmarks/results/bench_embed_gpu_h100.txt"],
                             [README_BENCH]),
    "embed-gpu-2026-11-23": (table_embed_gpu_2026_11_23, [f"{GPU}/2026-11-23-h100-c/call6-embed.json"], [README_BENCH]),
    "embed-gpu-scale": (table_embed_gpu_scale, [f"{GPU}/2026-11-24-h100-m4/embed.json"], [README_BENCH]),
    "multigpu": (table_multigpu, [f"{MULTI_GPU}/multigpu.json", f"{MULTI_GPU}/rank-tp2.json"],
                 [f"{MULTI_GPU}/README.md"]),
    "rank-gpu-2026-11-23": (table_rank_gpu_2026_11_23, [f"{GPU}/2026-11-23-h100-c/call16-rank.json"], [README_BENCH]),
    "rank-gpu-locomo": (table_rank_gpu_locomo, [f"{GPU}/2026-11-24-h100-m5/rank.json",
                                                f"{GPU}/2026-11-24-h100-m7/rank.json"], [README_BENCH]),
    "rank-gpu-lme": (table_rank_gpu_lme, [f"{GPU}/2026-11-25-h100-lme/rank.json"], [README_BENCH]),
    "rank-prefill-chunk": (table_rank_prefill_chunk, [f"{GPU}/2026-11-25-prefill-chunk/rank.json"], [README_BENCH]),
    "train-gpu-2026-11-23": (table_train_gpu_2026_11_23, [f"{GPU}/2026-11-23-h100-c/call7*.log",
                                                          f"{GPU}/2026-11-23-h100-c/call8*.log"], [README_BENCH]),
    "dapo-4b": (table_dapo_4b, [f"{DAPO_4B}/runs.jsonl", f"{DAPO_4B}/steps.jsonl"], [f"{DAPO_4B}/README.md",
                                                                                  f"{DAPO_4B}/table.md"]),
    "dapo-ab-notes": (table_dapo_ab_notes, [f"{GPU}/2026-11-24-h100-m9/train_dcg_slow_metrics.jsonl",
                                            f"{GPU}/2026-11-24-h100-m9/train_dcg_fast_metrics.jsonl"],
                      ["benchmarks/gpu/README.md"]),
    "dapo-ab": (table_dapo_ab, [f"{GPU}/2026-11-24-h100-m9/train_dcg_slow_metrics.jsonl",
                                f"{GPU}/2026-11-24-h100-m9/train_dcg_fast_metrics.jsonl"], [README_BENCH]),
    "entropy-memory": (table_entropy_memory, [f"{GPU}/2026-11-24-h100-m12/entropy_memory.json"], [README_BENCH]),
    "entropy-microbatch": (table_entropy_microbatch, [f"{GPU}/2026-11-25-h100-m14/entropy_memory_b*.json"],
                           [README_BENCH]),
    "collapse-steps": (table_collapse_steps, [COLLAPSE, f"{GPU}/2026-11-2*-h100-m1[167]/train_dcg_*_metrics.jsonl"],
                       ["benchmarks/gpu/README.md"]),
    "collapse": (table_collapse, [COLLAPSE, f"{GPU}/2026-11-2*-h100-m1[167]/train_dcg_*_metrics.jsonl"],
                 [README_BENCH]),
    "ranker-2026-11-24": (table_ranker_2026_11_24, [f"{GPU}/2026-11-24-h100-m1/table.json",
                                                     f"{GPU}/2026-11-24-h100-m1/random_baseline.json"], [README_BENCH]),
    "ranker-first-stage-lists": (table_ranker_first_stage_lists, [f"{GPU}/2026-11-24-h100-m4/table.json"],
                                 [README_BENCH]),
    "ranker-card": (table_ranker_card, [f"{GPU}/2026-11-24-h100-m8/table.json"], [RANKER_CARD]),
    "ranker-shuffled": (table_ranker_shuffled, [f"{SHUFFLED}/ranker/table.json",
                                                f"{SHUFFLED}/ranker-sft-shuf/table-cpu-rerank.json"], [README_BENCH]),
    "ranker-shuffled-results": (table_ranker_shuffled_results, [f"{SHUFFLED}/ranker/table.json"],
                                [f"{SHUFFLED}/README.md"]),
    "ranker-shuffled-card": (table_ranker_shuffled_card, [f"{SHUFFLED}/ranker/table.json",
                                                          f"{SHUFFLED}/ranker-sft-shuf/table-cpu-rerank.json"],
                             [RANKER_CARD]),
    "first-stage-2026-11-25": (table_first_stage_2026_11_25, [FIRST_STAGE_0], [README_BENCH]),
    "reference-rows": (table_reference_rows, [f"{AGENTS_SFT}/answers/*.parquet",
                                              "../shared/data/longmemeval_s_train348.json.gz",
                                              "memsifter/samples/locomo_dev2.json.gz"],
                       [f"{REFERENCE_ROWS}/answers_table.txt"]),
    "serve-writes": (table_serve_writes, [f"{WRITES}/writes.json"], [f"{WRITES}/writes.md"]),
    "serve-writes-2026-11-27": (lambda: table_serve_writes(WRITES_QUIET), [f"{WRITES_QUIET}/writes.json"],
                                [f"{WRITES_QUIET}/writes.md"]),
    **{f"serve-writes-2026-11-27-{name}": ((lambda folder=folder: table_serve_writes(folder)),
                                           [f"{folder}/writes.json"], [f"{folder}/writes.md"])
       for name, folder in WRITES_49.items()},
    **{f"serve-writes-2026-11-27-ab-{name}": ((lambda folder=folder: table_serve_writes(folder)),
                                              [f"{folder}/writes.json"], [f"{folder}/writes.md"])
       for name, folder in WRITES_AB.items()},
    "serve-writes-cow": (table_serve_writes_cow, [f"{WRITES_COW}/*/writes.json", f"{WRITES_COW}/*/requests.json.gz"],
                         [f"{WRITES_COW}/README.md"]),
    "serve-writes-compact": (functools.partial(table_serve_writes_cow, WRITES_COMPACT, COMPACT_RUNS, "setting"),
                             [f"{WRITES_COMPACT}/*/writes.json", f"{WRITES_COMPACT}/*/requests.json.gz"],
                             [f"{WRITES_COMPACT}/README.md"]),
    "serve-writes-startfold": (functools.partial(table_serve_writes_cow, WRITES_STARTFOLD, STARTFOLD_RUNS, "setting",
                                                 ready=True),
                               [f"{WRITES_STARTFOLD}/*/writes.json", f"{WRITES_STARTFOLD}/*/requests.json.gz"],
                               [f"{WRITES_STARTFOLD}/README.md"]),
    "serve-writes-gc": (functools.partial(table_serve_writes_cow, WRITES_GC, GC_RUNS, "collector thresholds"),
                        [f"{WRITES_GC}/*/writes.json", f"{WRITES_GC}/*/requests.json.gz"], [f"{WRITES_GC}/README.md"]),
    "serve-writes-fastroutes": (functools.partial(table_serve_writes_cow, WRITES_FAST, FAST_RUNS, "code"),
                                [f"{WRITES_FAST}/*/writes.json", f"{WRITES_FAST}/*/requests.json.gz"],
                                [f"{WRITES_FAST}/README.md"]),
    "serve-writes-queryproc": (functools.partial(table_serve_writes_cow, WRITES_QPROC, QPROC_RUNS, "query encoder"),
                               [f"{WRITES_QPROC}/*/writes.json", f"{WRITES_QPROC}/*/requests.json.gz"],
                               [f"{WRITES_QPROC}/README.md"]),
    "query-encoder": (table_query_encoder, [f"{QUERY_ENCODER}/encoder.json"], [f"{QUERY_ENCODER}/encoder.md"]),
    "tokenizer": (table_tokenizer, [TOKENIZER], [README_BENCH]),
    "vllm-cpu-wait": (table_vllm_cpu_wait, [f"{VLLM_WAIT}/bench.log"], [README_BENCH, f"{VLLM_WAIT}/README.md"]),
    "serve": (table_serve, [f"{SERVE}/serve.json"], [README_BENCH, f"{SERVE}/serve.md"]),
}


# Tables whose command runs a stage over a large shared file (a minute or more on 2 cores): test_tables checks them
# only with --heavy, and where the shared file is present.
TABLES.update({
    "dapo-4b-x4": (functools.partial(table_dapo_4b_folder, DAPO_X4), [f"{DAPO_X4}/*/runs.jsonl", f"{DAPO_X4}/*/steps.jsonl",
                                                               f"{DAPO_X4}/d8k1/train-8k.log"], [f"{DAPO_X4}/README.md"]),
    "dapo-4b-resize": (functools.partial(table_dapo_4b_folder, DAPO_RESIZE),
                       [f"{DAPO_RESIZE}/*/runs.jsonl", f"{DAPO_RESIZE}/*/steps.jsonl", f"{DAPO_RESIZE}/resize2/run.json",
                        f"{DAPO_RESIZE}/resize2/train-8k-2gpu.log"], [f"{DAPO_RESIZE}/README.md"]),
    "train-4b-cost": (table_train_4b_cost, [f"{DAPO_X1}/runs.jsonl", f"{DAPO_X4}/*/runs.jsonl",
                                            f"{DAPO_RESIZE}/*/runs.jsonl", f"{DAPO_RESIZE}/*/steps.jsonl",
                                            f"{DAPO_NODES}/*/runs.jsonl", f"{DAPO_NODES}/*/steps.jsonl"], ["README.md"]),
    "dapo-4b-nodes": (functools.partial(table_dapo_4b_folder, DAPO_NODES),
                      [f"{DAPO_NODES}/*/runs.jsonl", f"{DAPO_NODES}/*/steps.jsonl"], [f"{DAPO_NODES}/README.md"]),
    "varlen-fa4": (table_varlen_fa4, [f"{DAPO_NODES}/varlen/varlen_check.json"], [f"{DAPO_NODES}/README.md"]),
    "ranker-improve": (table_ranker_improve, [f"{RANKER_IMPROVE}/results/table.json"], [f"{RANKER_IMPROVE}/README.md"]),
    "ranker-improve-paired": (table_ranker_improve_paired, [f"{RANKER_IMPROVE}/results/ndcg10-per-question-*.json"],
                              [f"{RANKER_IMPROVE}/README.md"]),
})
HEAVY = {"reference-rows": SHARED_LME}


def readme_figures() -> list[str]:
    """README's headline figures in its own words, each computed from the committed files the tables above read:
    phrases that must appear in README (whitespace aside)."""
    serve = load_json(f"{SERVE}/serve.json")
    at32 = {r["clients"]: r for r in serve["levels"]["serve"]}[32]
    base32 = {r["clients"]: r for r in serve["levels"]["baseline"]}[32]
    ident = serve["prepare"]["identity"]["stored_query_vectors"]
    embed = {r["name"]: r for r in load_json(f"{GPU}/2026-11-23-h100-c/call6-embed.json")["results"]}
    best, plain = embed["stage+compile (budget 131072)"], embed["plain-bf16 (HF, sorted, SDPA)"]
    scale = {r["name"]: r for r in load_json(f"{GPU}/2026-11-24-h100-m4/embed.json")["results"]}
    pipe = scale["pipeline: embed_missing (Ray Data actor, default plan, incl. actor start + model load)"]
    plain4 = scale["plain-bf16 (HF, sorted, SDPA)"]
    alone = scale["gpu-only (compiled): packed forward, ids tokenized beforehand (budget 131072)"]
    loc, _, _ = rank_runs(f"{GPU}/2026-11-24-h100-m5/rank.json")
    _, hf_loc, _ = rank_runs(f"{GPU}/2026-11-24-h100-m7/rank.json")
    lme, hf_lme, _ = rank_runs(f"{GPU}/2026-11-25-h100-lme/rank.json")
    hf_rate = lambda hf: hf["prompts"] / hf["full_s"]  # noqa: E731
    slow, fast = (median_of(rs, "timing_s/step") for rs in dapo_ab_runs())
    early = load_json(f"{GPU}/2026-11-23-h100-b/call8-rank.json")   # ours and HF on the same day's prompts
    ours_per_prompt = next(r["busy_s"] / r["questions"] for r in early["results"] if r["name"] == "ours")
    hf_per_prompt = early["hf"]["full_s"] / early["hf"]["prompts"]
    grew = [m["timing_s/step"] for m in verl_metrics(f"{GPU}/2026-11-24-h100-m10/train_dcg_metrics.jsonl")]
    runs = collapse_runs()
    stops = [r["stop"][0] for r in runs]
    step_s = [median_of([m for n, m in r["steps"].items() if n > 0 and "timing_s/step" in m], "timing_s/step")
              for r in runs]
    v = one_call()
    num = lambda x: float(x.replace("−", "-"))  # noqa: E731
    sign = lambda x, d: f"{x:+.{d}f}".replace("-", "−")  # noqa: E731
    pair = [num(x) for x in v["paired"][SEARCH_VS_ONE_CALL].replace("[", "").replace("]", "").replace(",", "").split()]
    one = [num(x) for x in v["chat first stage, sft"][0].replace("[", "").replace("]", "").replace(",", "").split()]
    return [
        f"at 32 clients {at32['qps']:.1f} queries/s against the baseline's {base32['qps']:.1f} "
        f"({at32['qps'] / base32['qps']:.2f}x)",
        f"identical to the embed stage's for {ident['full_order_identical']} of {ident['questions']} questions",
        f"p99 {at32['p99_ms']:.0f} ms", f"the baseline is at {base32['p99_ms']:.0f} ms",
        f"RSS +{100 * serve['soak']['rss_growth']:.1f}%",
        f"the embed stage did {best['texts_s']:.1f} sessions/s of LongMemEval_S length at {100 * best['mfu']:.0f}% MFU "
        f"({best['texts_s'] / plain['texts_s']:.1f}x a plain bf16 baseline)",
        f"did {pipe['texts_s']:.1f} texts/s: {pipe['texts_s'] / plain4['texts_s']:.2f}x plain bf16 measured in the "
        f"same call ({plain4['texts_s']:.1f}), with the first batch back after "
        f"{pipe['first_batch_s']['median']:.0f} s; the packed forward alone reached {100 * alone['mfu']:.1f}% MFU",
        f"the rank stage did {loc['ours']['prompts_s']:.3f} prompts/s of engine time, "
        f"{loc['ours']['prompts_s'] / loc['original']['prompts_s']:.2f}x the original's",
        f"{loc['ours']['prompts_s'] / hf_rate(hf_loc):.1f}x Hugging Face `generate`",
        f"the stage did {lme['ours']['prompts_s']:.3f} prompts/s, the same as the original's settings "
        f"({lme['original']['prompts_s']:.3f}, {lme['ours']['prompts_s'] / lme['original']['prompts_s']:.2f}x",
        f"{lme['ours']['prompts_s'] / hf_rate(hf_lme):.2f}x Hugging Face `generate`",
        f"takes {fast:.0f} s instead of {slow:.0f} s ({slow / fast:.2f}x",
        f"sessions separates the two (`benchmarks/bench_agents_one_call.py`, n = 130): "
        f"{one[0]:.3f} [{one[1]:.2f}, {one[2]:.2f}]",
        f"paired {sign(pair[0], 3)} [{sign(pair[1], 2)}, {sign(pair[2], 2)}]",
        f"With no memory it scores {v['chat none, sft'][0].split(' [')[0]}",
        f"{hf_per_prompt / ours_per_prompt:.1f}x Hugging Face `generate` per prompt",
        f"a step grew from {grew[0]:.0f} s to {grew[-1]:.0f} s",
        f"step {stops[0]} at a LoRA learning rate of 2e-4, step {stops[1]} at the shipped 5e-5, step {stops[2]} at "
        f"5e-5 with an entropy bonus of 0.05, which costs {step_s[2] / step_s[1]:.2f}x per step",
    ]


def agents_card_figures() -> list[str]:
    """The agents adapter's card, in its sentences: the paired gains over the base's first-stage answers, F1 by
    dataset, the one-call comparison, exact match and multi-hop F1 (the run's answers, the control's paired.json)."""
    a = answers(AGENTS_SFT)
    by = {k: f1_by_dataset(a[k]) for k in ("agent:search, SFT", "agent:memory, SFT")}
    em = sorted(agent_stats(a[k])["em"] for k in by)
    hops = [float(r["f1"] or 0) for r in ok(a["agent:search, SFT"]) if r["question_type"] == "multi-hop"]
    s, m = by["agent:search, SFT"], by["agent:memory, SFT"]
    return [f"agent:search minus the base's first-stage answers {paired(a['agent:search, SFT'], a['embed:bm25'])}; "
            f"agent:memory minus the same {paired(a['agent:memory, SFT'], a['embed:bm25'])}",
            f"By dataset: agent:search {s['longmemeval_s']:.3f} LongMemEval_S / {s['locomo']:.3f} LoCoMo, agent:memory "
            f"{m['longmemeval_s']:.3f} / {m['locomo']:.3f}",
            f"Searching minus one call is {one_call()['paired'][SEARCH_VS_ONE_CALL]}",
            f"Exact match stays at {100 * em[0]:.0f}–{100 * em[1]:.0f}%",
            f"on multi-hop LoCoMo questions agent:search scores {mean(hops):.3f} F1", *agents_grpo_figures()]


def agents_grpo_figures() -> list[str]:
    """The GRPO run of issue 44 as the agents card states it: its settings (the train stage's verl overrides and the
    sft stage's stats in ``logs.tar.gz``, the steps in ``train_steps.json``), the held-out questions and the paired
    differences (``agents_grpo_table.paired_rows`` over its answers; LoCoMo's F1 scored against the committed LoCoMo
    sample), the one-call reference, and the earlier adapter's search F1 on its older split."""
    import re

    grpo_table = gpu_script("agents_grpo_table")
    by = grpo_rows()
    pairs = {(r["metric"], r["dataset"]): r for r in grpo_table.paired_rows(by, [("agent:search, GRPO",
                                                                                     "agent:search, SFT")])}
    sign = lambda x: f"{x:+.3f}".replace("-", "−")  # noqa: E731
    ci = lambda r: f"{sign(r['diff'])} [{sign(r['ci_low'])}, {sign(r['ci_high'])}], n = {r['n']}"  # noqa: E731
    logs = f"{AGENTS_GRPO}/logs.tar.gz"
    train = log_text(logs, "logs/train.log")
    opt = {k: re.search(rf"{re.escape(k)}=([0-9.e-]+)", train).group(1)
           for k in ("data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.optim.lr",
                     "reward_kwargs.agent_format_score")}
    fmt = float(opt["reward_kwargs.agent_format_score"])
    qs = {r["question_id"]: r["dataset"] for r in by["agent:search, SFT"]}
    convs = sorted({q.rsplit("_q", 1)[0] for q, d in qs.items() if d == "locomo"})
    one = mean([float(r["f1"] or 0) for r in ok(by["one call, embed:bm25"])])
    allf1 = pairs[("f1", "all")]
    earlier = agent_stats(answers(AGENTS_SFT)["agent:search, SFT"])["f1"]
    return [f"from a search-only SFT warm start ({stage_stats(logs, 'logs/sft.log')['rows']} traces), "
            f"{len(load_json(f'{AGENTS_GRPO}/train_steps.json'))} GRPO steps of {opt['data.train_batch_size']} "
            f"prompts × {opt['actor_rollout_ref.rollout.n']} samples (LoRA, lr "
            f"{float(opt['actor_rollout_ref.actor.optim.lr']):.0e}".replace("e-0", "e-") + f", reward "
            f"{1 - fmt:.1f} F1 + {fmt:.1f} format), on {len(qs)} held-out questions "
            f"({sum(d == 'longmemeval_s' for d in qs.values())} LongMemEval_S, "
            f"{sum(d == 'locomo' for d in qs.values())} LoCoMo {', '.join(convs)}; split by session text)",
            f"GRPO {allf1['mean_a']:.3f} F1 against SFT {allf1['mean_b']:.3f}: paired {ci(allf1)} — not better",
            f"LoCoMo's F1 {ci(pairs[('locomo_f1', 'locomo')])}",
            f"Both below the same adapter answering in one call from the first stage ({one:.3f})",
            f"this adapter's {earlier:.3f}", f"a search-only SFT scores {allf1['mean_b']:.3f}"]


def ranker_card_figures() -> list[str]:
    """The ranker adapter's card, in its sentences: the working LLM's F1 from the first stage's contexts (machine 8's
    aggregates) and the shuffled SFT ranker's paired gains (the CPU re-rank's aggregates)."""
    m8 = load_json(f"{GPU}/2026-11-24-h100-m8/table.json")
    f1 = {part: t["_answers"]["embed:cascade"]["f1"] for part, t in m8.items()}
    sft = shuffled_rows()
    return [f"({f1['lme_heldout']:.3f} LME / {f1['locomo_heldout']:.3f} LoCoMo)",
            f"{gain_ci(sft['lme_heldout']['sft-shuf'])} on LME and {gain_ci(sft['locomo_heldout']['sft-shuf'])} on "
            "LoCoMo"]


def one_call_reading() -> tuple[float, float]:
    """The one-call control's CPU reading rate: prompt tokens (``report.json``'s estimate, 4 characters a token) of
    its 260 answers over their seconds (``one_call.md``'s ``answers``), rounded to tens; and those seconds."""
    import json

    with open(os.path.join(ROOT, ONE_CALL, "one_call.md")) as f:
        secs = json.loads(next(ln for ln in f if ln.startswith("Seconds: "))[len("Seconds: "):])["answers"]
    cost = {k: v["cost"] for k, v in load_json(f"{ONE_CALL}/report.json")["side_by_side"]["methods"].items()}
    tokens = sum(c["prompt_tokens"]["mean"] * c["prompt_tokens"]["n"] for k, c in cost.items() if "(chat-sft)" in k)
    return round(tokens / secs, -1), secs


def one_call_figures() -> list[str]:
    """The one-call control's README, in its sentences: the CPU's reading rate."""
    rate, secs = one_call_reading()
    return [f"the CPU read about {rate:.0f} prompt tokens/s at this length ({secs:,.0f} s for these 260 answers"]


def bench_figures() -> list[str]:
    """benchmarks/README's sentence figures: the 2026-11-25 first stage's end-to-end runs, cross-validation and gold
    depth (its JSON), the tokenizer's ratios, the GPU embed targets, the rank ratios, the one-call control and the
    memory service's writes (each run's committed files)."""
    fs = load_json(FIRST_STAGE_0)
    run, run10 = fs["stage_run"], fs["stage_run_zsum_k10"]
    old, new = run["old default (--no-zsum)"], run["new default"]
    cv = {c["chosen_on"]: c for c in fs["cross_validation"]}
    tabs = fs["tables"]

    def read_on(c: dict) -> str:
        h = c["read_on"]
        lo, lm = tabs["locomo"][c["chosen"]][h], tabs["lme"][c["chosen"]][h]
        return (f"read on {h}: LoCoMo {lo['recall_any@5']:.3f} / {lo['ndcg@10']:.3f}, LongMemEval "
                f"{lm['recall_any@5']:.3f} / {lm['ndcg@10']:.3f}")

    def ranking(c: dict) -> str:
        r = dict(c["ranking"])
        others = [k for k in ("zsum k=10", "zsum k=15", "cascade k=10") if k != c["chosen"]]
        return (f"{c['chosen']} ({r[c['chosen']]:.4f}; " + ", ".join(f"{k} {r[k]:.4f}" for k in others)
                + f", old default {r['cascade k=5 (old default)']:.4f})")

    depth = lambda d, h: " / ".join(f"{tabs[d]['lexical']['gold_depth'][h][f'recall_any@{k}']:.3f}"  # noqa: E731
                                    for k in (5, 10, 15, 20))
    tok = {(r["name"], r["threads"]): r for r in load_json(TOKENIZER)["rows"]}
    bpe, uni = tok[("bpe-8k", 1)], tok[("unigram-xlmr", 1)]
    embed = {r["name"]: r for r in load_json(f"{GPU}/2026-11-23-h100-c/call6-embed.json")["results"]}
    best, nocomp = embed["stage+compile (budget 131072)"], embed["stage (budget 131072)"]
    loc, _, _ = rank_runs(f"{GPU}/2026-11-24-h100-m5/rank.json")
    o, g = loc["ours"], loc["original"]
    chunk, _, _ = rank_runs(f"{GPU}/2026-11-25-prefill-chunk/rank.json")
    v = one_call()
    a = answers(AGENTS_SFT)
    w = load_json(f"{WRITES}/writes.json")["writes"]
    ad, sw, bs = w["adds"], w["search_with_adds"], w["baseline_search"]
    quiet = load_json(f"{WRITES_QUIET}/writes.json")
    q, qa, qs, qb = quiet["writes"], quiet["writes"]["adds"], quiet["writes"]["search_with_adds"], \
        quiet["writes"]["baseline_search"]
    cpu_read = one_call_reading()
    m4 = {part: t["_answers"] for part, t in load_json(f"{GPU}/2026-11-24-h100-m4/table.json").items()}
    m4r = ranker_json(f"{GPU}/2026-11-24-h100-m4/table.json")
    m8 = {part: t["_answers"] for part, t in load_json(f"{GPU}/2026-11-24-h100-m8/table.json").items()}
    f1 = lambda t, part, k: f"{t[part][k]['f1']:.3f}"  # noqa: E731
    over_random = [m4r[p]["sft"]["ndcg@10"] - m4r[p]["random-valid"]["ndcg@10"]
                   for p in ("lme_heldout", "locomo_heldout")]
    return [
        f"old default (`--no-zsum`) {old['wall_s']:.0f} s, {old['embedded']} texts; new default {new['wall_s']:.0f} s, "
        f"{new['embedded']:,} texts (recall_any@5 / NDCG@10 {old['recall_any@5']:.3f} / {old['ndcg@10']:.3f} → "
        f"{new['recall_any@5']:.3f} / {new['ndcg@10']:.3f}). Scaled by the old default's {fs['default_test_s']:.0f} s: "
        f"**{new['calibrated_min']:.1f} min**",
        f"(zsum_k = 10 in an earlier run: {run10['old default (--no-zsum)']['wall_s']:.0f} s vs "
        f"{run10['new default']['wall_s']:.0f} s, {run10['new default']['calibrated_min']:.1f} min)",
        f"Chosen on dev: {ranking(cv['dev'])}, {read_on(cv['dev'])}",
        f"Chosen on held-out: {ranking(cv['held-out'])}, {read_on(cv['held-out'])}",
        f"LongMemEval even {depth('lme', 'dev')}, odd {depth('lme', 'held-out')}; conv-26 {depth('locomo', 'dev')}, "
        f"conv-30 {depth('locomo', 'held-out')}",
        f"costs ~{bpe['texts_s'] / uni['texts_s']:.1f}x the BPE's CPU time per text",
        f"**{100 * (1 - uni['tokens_per_text'] / bpe['tokens_per_text']):.0f}% fewer tokens** "
        f"({uni['tokens_per_text']:,.0f} against {bpe['tokens_per_text']:,.0f} per session)",
        f"≥ 130 sessions/s ({best['texts_s']:.1f}) and MFU ≥ 40% ({100 * best['mfu']:.1f}%)",
        f"without compile {nocomp['texts_s']:.1f} / {100 * nocomp['mfu']:.1f}%",
        f"Ours: {o['prompts_s'] / g['prompts_s']:.2f}x the original's settings in engine-busy time "
        f"({(o['prompts'] / o['pipeline']['median']) / (g['prompts'] / g['pipeline']['median']):.2f}x with each "
        f"engine's start)",
        f"A 16k chunk is {100 * (chunk['ours-chunk16384']['prompts_s'] / chunk['ours']['prompts_s'] - 1):.0f}% faster",
        f"(paired: {paired(a['agent:search, SFT'], a['embed:bm25'])} searching, "
        f"{paired(a['agent:memory, SFT'], a['embed:bm25'])} reading",
        f"Adapter in one call: first stage {v['chat first stage, sft'][0]}, no memory {v['chat none, sft'][0]}. "
        f"Base in one call from the first stage: {v['embed:bm25'][0].split(' [')[0]}. The adapter searching scores "
        f"{v['agent:search, SFT'][0].split(' [')[0]} and reading {v['agent:memory, SFT'][0].split(' [')[0]}.",
        f"adds {ad['adds_per_s']}/s, p50 {ad['p50_ms']} ms, p99 {ad['p99_ms']} ms; {w['count']['acked']} acknowledged, "
        f"{w['count']['lost']} lost, {w['count']['duplicated']} duplicated",
        f"{ad['resent_answered_as_the_same_memory']}/{ad['resent']} re-sent texts answered as the same memory; search "
        f"with adds running {sw['qps']} q/s, p99 {sw['p99_ms']} ms, against the baseline's {bs['qps']} q/s, p99 "
        f"{bs['p99_ms']} ms ({w['search_qps_over_baseline']}x)",
        f"vLLM on 2 cores read ~{cpu_read[0]:.0f} prompt tokens/s at 6k-token prompts ({cpu_read[1]:,.0f} s for 260 "
        "answers; tokens estimated at 4 characters)",
        f"The same command on quiet cores ({quiet['date']}, load average {quiet['machine']['loadavg']:.1f} at its "
        f"start; table: `results/serve-writes-2026-11-27/writes.md`): adds {qa['adds_per_s']}/s, "
        f"p50 {qa['p50_ms']} ms, p99 {qa['p99_ms']} ms; {q['count']['acked']} acknowledged, {q['count']['lost']} lost, "
        f"{q['count']['duplicated']} duplicated, the same after a restart; search with adds running {qs['qps']} q/s, "
        f"p99 {qs['p99_ms']} ms, against the baseline's {qb['qps']} q/s, p99 {qb['p99_ms']} ms "
        f"({q['search_qps_over_baseline']}x)",
        f"(adds p99 {qa['p99_ms']:.0f} ms against 50 ms; search {q['search_qps_over_baseline']}x the baseline",
        f"LME no memory {f1(m4, 'lme_heldout', 'no memory')}, first stage {f1(m4, 'lme_heldout', 'embed:cascade')}, "
        f"SFT / DAPO ranker {f1(m4, 'lme_heldout', 'rank:adapter-sft')}, gold "
        f"{f1(m4, 'lme_heldout', 'oracle (gold sessions)')}; LoCoMo no memory {f1(m4, 'locomo_heldout', 'no memory')}, "
        f"first stage {f1(m4, 'locomo_heldout', 'embed:cascade')}, "
        f"SFT / DAPO {f1(m4, 'locomo_heldout', 'rank:adapter-dcg')}, base structured "
        f"{f1(m4, 'locomo_heldout', 'rank:smollm2-135m-instruct+structured')}, gold "
        f"{f1(m4, 'locomo_heldout', 'oracle (gold sessions)')}",
        f"+{over_random[0]:.2f} / +{over_random[1]:.2f} NDCG@10 over random",
        f"answer F1 first stage = trained ranker ({f1(m8, 'lme_heldout', 'rank:adapter-dcg')} / "
        f"{f1(m8, 'locomo_heldout', 'rank:adapter-dcg')}), no memory {f1(m8, 'lme_heldout', 'no memory')} / "
        f"{f1(m8, 'locomo_heldout', 'no memory')}, gold {f1(m8, 'lme_heldout', 'oracle (gold sessions)')} / "
        f"{f1(m8, 'locomo_heldout', 'oracle (gold sessions)')}",
    ]


def gpu_notes_figures() -> list[str]:
    """benchmarks/gpu/README's sentence figures: the working LLM's answer F1 of machines 1 and 8 (their
    ``table.json`` aggregates), HF ``generate`` against the original's settings at LongMemEval length (the pooled
    ``rank.json``) and the larger prefill chunks' share of the roofline (``run_rank.roofline``)."""
    from memsifter.models.tiny import QWEN3_4B

    n = {part: t["_answers"]["no memory"]["n"] for part, t in load_json(f"{GPU}/2026-11-24-h100-m1/table.json").items()}
    f1 = {m: {part: {k: f"{a['f1']:.3f}" for k, a in t["_answers"].items()}
              for part, t in load_json(f"{GPU}/2026-11-24-h100-{m}/table.json").items()} for m in ("m1", "m8")}
    lme, loc = f1["m1"]["lme_heldout"], f1["m1"]["locomo_heldout"]
    gold = "oracle (gold sessions)"
    runs, hf, _ = rank_runs(f"{GPU}/2026-11-25-h100-lme/rank.json")
    hf_rate = hf["prompts"] / hf["full_s"]
    chunk, _, peak = rank_runs(f"{GPU}/2026-11-25-prefill-chunk/rank.json")
    ceiling = gpu_script("run_rank").roofline(dict(QWEN3_4B), chunk["ours"]["prompt_lengths"],
                                              peak["peak"])["prefill_ceiling_prompts_s"]
    roof = {k: f"{100 * chunk[k]['prompts_s'] / ceiling:.1f}%" for k in ("ours-chunk16384", "ours-chunk32768")}
    return [f"LME ({n['lme_heldout']} q) no memory {lme['no memory']}, first stage {lme['embed:cascade']}, SFT ranker "
            f"{lme['rank:adapter-sft']}, gold sessions {lme[gold]}; LoCoMo (105 q) no memory {loc['no memory']}, first "
            f"stage {loc['embed:cascade']}, base structured {loc['rank:smollm2-135m-instruct+structured']}, SFT ranker "
            f"{loc['rank:adapter-sft']}, gold {loc[gold]}",
            f"No memory: F1 {f1['m8']['lme_heldout']['no memory']} (LME), {f1['m8']['locomo_heldout']['no memory']} "
            f"(LoCoMo); the gold sessions: {f1['m8']['lme_heldout'][gold]}, {f1['m8']['locomo_heldout'][gold]}",
            f"| - | {hf_rate:.3f} | {hf_rate / runs['original']['prompts_s']:.2f}x |",
            f"best {roof['ours-chunk32768']} (chunk32768), {roof['ours-chunk16384']} (chunk16384, 2 runs)",
            f"({roof['ours-chunk16384']}) *including* the 256-token decodes"]


FIGURES = {"README.md": readme_figures, "benchmarks/gpu/README.md": gpu_notes_figures, README_BENCH: bench_figures,
           CARD: agents_card_figures, RANKER_CARD: ranker_card_figures, f"{ONE_CALL}/README.md": one_call_figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", choices=sorted(TABLES))
    p.add_argument("--list", action="store_true")
    p.add_argument("--figures", action="store_true", help="the prose figures each document must state, as phrases")
    a = p.parse_args(argv)
    if a.figures:
        for doc, phrases in FIGURES.items():
            print("\n".join(f"{doc}: {x}" for x in phrases()))
        return 0
    if a.list or not a.name:
        for name, (_, files, docs) in sorted(TABLES.items()):
            print(f"{name}: from {', '.join(files)}; published in {', '.join(docs)}")
        return 0
    print("\n".join(TABLES[a.name][0]()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
