#!/usr/bin/env python3
"""First-stage candidates against the default (``zsum`` k = 15), cross-validated across datasets (issue 42 item 5).

    nice -n 19 .venv/bin/python benchmarks/first_stage_cv.py --out runs/first-stage-cv \\
        --results benchmarks/results/first-stage-2026-11-27               # the 2026-11-27 candidates
    nice -n 19 .venv/bin/python benchmarks/first_stage_cv.py --set 2026-11-26 --lme 200 --minutes 0 \\
        --results benchmarks/results/first-stage-2026-11-26               # the 2026-11-26 candidates
    .venv/bin/python benchmarks/first_stage_cv.py --table benchmarks/results/first-stage-2026-11-27  # table only
    nice -n 19 .venv/bin/python benchmarks/first_stage_cv.py --set 2026-11-27-r3 --lme 1000 --out runs/first-stage-cv \
        --results benchmarks/results/first-stage-2026-11-27-r3            # round 3 (R3), all 324 LongMemEval q
    .venv/bin/python benchmarks/first_stage_cv.py --table benchmarks/results/first-stage-2026-11-27-r3 --detail \
        > benchmarks/results/first-stage-2026-11-27-r3/table.md          # + each fold's pick metric by metric

Data: ``../shared/data`` (LoCoMo conv-26 + conv-30, LongMemEval_S train348 without abstention), imported with
the platform (:func:`load`, shared with ``bench_first_stage.py``). Candidate sets: ``2026-11-26``
(``benchmarks/first_stage_variants.py``), ``2026-11-27`` and ``2026-11-27-r3``
(``memsifter/retrieval/first_stage_candidates.py``: ``CANDIDATES``, ``R3``).
Every candidate is computed with the first stage's functions (``Lexical``, ``cascade_candidates``,
``zsum_scores``, ``cascade_units``) and the embed stage's Embedder (all-MiniLM-L6-v2, float32 CPU); vectors are
kept in one content-hash store under ``--out`` (a text is embedded once over every run), the stage's BM25
scores in a pickle. A first pass records which texts each candidate embeds for each question (its cost:
distinct texts and words, against the default's); the default's texts are embedded first for every question,
then the others' (``--minutes`` bounds the embedding; a candidate lacking texts on a question is not scored
there, and the table says on how many questions it was).

Folds (nothing is fitted; the folds are for choosing among candidates): LoCoMo by conversation (fold A =
conv-26, B = conv-30); LongMemEval by session text: questions whose gold sessions share a text (content hash)
are one group, groups alternate between A and B in question-id order. Rule, applied on one fold and read on
the other, then swapped: a candidate replaces the default only if its mean paired difference to the default
in (recall_any@5 + NDCG@10) / 2 is > 0 on BOTH datasets of the choosing fold; then it is read on the other.
Per-question rankings of every candidate are written as ``<results>/<dataset>.<candidate>.jsonl.gz``;
``--table`` prints the table from those files alone.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
WORDS = 200


def folds_of(name: str, qs: list, sessions: dict) -> dict[str, str]:
    if name == "locomo":
        return {q.question_id: "A" if q.question_id.startswith("conv-26") else "B" for q in qs}
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x
    owner: dict[str, str] = {}
    for q in qs:
        for s in q.gold_session_ids:
            h = sessions[s].content_hash if s in sessions else s
            if h in owner:
                parent[find(q.question_id)] = find(owner[h])
            else:
                owner[h] = q.question_id
    groups: dict[str, list[str]] = {}
    for q in qs:
        groups.setdefault(find(q.question_id), []).append(q.question_id)
    out = {}
    for i, members in enumerate(sorted(groups.values(), key=min)):
        for m in members:
            out[m] = "AB"[i % 2]
    return out


def per_question(name: str, rows: list[dict], qs: list, sessions: dict) -> dict[str, dict[str, float]]:
    from memsifter.retrieval import rankings
    from memsifter.retrieval.benchmark_metrics import lme_retrieval_per_question

    ours = rankings.per_question_metrics(rows, qs, (5, 10))
    out = {qid: {"recall_any@5": m["recall_any@5"], "recall_all@5": m["recall_all@5"], "ndcg@10": m["ndcg@10"]}
           for qid, m in ours.items()}
    if name == "lme":
        theirs, _ = lme_retrieval_per_question(rows, qs, sessions, (5, 10))
        for qid, m in theirs.items():
            if qid in out:
                out[qid].update({"lme_recall_all@5": m["recall_all@5"], "lme_ndcg_any@10": m["ndcg_any@10"]})
    return out


def table(results: str, detail: bool = False) -> None:
    """Print the table from the per-question files of ``results``; with ``detail``, also each fold's pick against
    the default metric by metric (:func:`pick_detail`)."""
    from memsifter.retrieval.metrics import bootstrap_ci

    meta = json.load(open(os.path.join(results, "meta.json")))
    data: dict = {}
    for f in sorted(os.listdir(results)):
        if f.endswith((".jsonl", ".jsonl.gz")):
            ds, cand = f.removesuffix(".gz")[:-6].split(".", 1)
            with (gzip.open if f.endswith(".gz") else open)(os.path.join(results, f), "rt") as fh:
                data.setdefault(ds, {})[cand] = {r["question_id"]: r for r in map(json.loads, fh)}
    default = meta["default"]
    crit = lambda r: (r["recall_any@5"] + r["ndcg@10"]) / 2  # noqa: E731
    print(f"Default: {default}. Cells: recall_any@5 / recall_all@5 / NDCG@10 (fold A | fold B); "
          f"Δ = mean paired difference to the default of (recall_any@5 + NDCG@10) / 2 [95% bootstrap interval].\n")
    for ds in ("lme", "locomo"):
        rows = data[ds][default]
        print(f"### {meta['titles'][ds]}: fold A {sum(r['fold'] == 'A' for r in rows.values())} q, "
              f"fold B {sum(r['fold'] == 'B' for r in rows.values())} q\n")
        extra = " | LME recall_all@5 / ndcg_any@10 (own metric)" if ds == "lme" else ""
        print(f"| candidate | fold A | fold B | all{extra} | Δ fold A | Δ fold B | Δ all |")
        print("|---|---:|---:|---:|" + ("---:|" if ds == "lme" else "") + "---:|---:|---:|")
        for cand in meta["candidates"]:
            r = data[ds].get(cand, {})
            if not r:
                print(f"| {cand} | - | - | - |" + (" - |" if ds == "lme" else "") + " - | - | - |")
                continue

            def cell(fold: str | None) -> str:
                v = [x for x in r.values() if fold is None or x["fold"] == fold]
                return " / ".join(f"{np.mean([x[m] for x in v]):.3f}"
                                  for m in ("recall_any@5", "recall_all@5", "ndcg@10"))
            line = f"| {cand} | {cell('A')} | {cell('B')} | {cell(None)}"
            if len(r) != len(rows):
                line += f" ({len(r)} q)"
            if ds == "lme":
                v = [x for x in r.values() if "lme_recall_all@5" in x]
                line += f" | {np.mean([x['lme_recall_all@5'] for x in v]):.3f} / " \
                        f"{np.mean([x['lme_ndcg_any@10'] for x in v]):.3f} ({len(v)} q)"
            for fold in ("A", "B", None):
                d = [crit(r[q]) - crit(rows[q]) for q in rows if q in r and (fold is None or rows[q]["fold"] == fold)]
                lo, hi = bootstrap_ci(d)
                line += f" | {np.mean(d):+.4f} [{lo:+.4f}, {hi:+.4f}]"
            print(line + " |")
        print()
    print("### Cross-validation (rule: a candidate is chosen on a fold only if its mean paired Δ > 0 on both "
          "datasets of that fold; the best mean Δ of those; read on the other fold)\n")
    picks = []
    for pick, read in (("A", "B"), ("B", "A")):
        def delta(cand: str, fold: str, ds: str) -> float:
            base = data[ds][default]
            r = data[ds].get(cand, {})
            if not any(q in r for q in base if base[q]["fold"] == fold):
                return float("nan")
            return float(np.mean([crit(r[q]) - crit(base[q]) for q in base if q in r and base[q]["fold"] == fold]))
        ok = [c for c in meta["candidates"] if c != default and all(delta(c, pick, ds) > 0 for ds in ("lme", "locomo"))]
        best = max(ok, key=lambda c: np.mean([delta(c, pick, ds) for ds in ("lme", "locomo")]), default=default)
        print(f"- chosen on fold {pick}: **{best}** (" + ", ".join(
            f"{c}: LME {delta(c, pick, 'lme'):+.4f}, LoCoMo {delta(c, pick, 'locomo'):+.4f}"
            for c in meta["candidates"] if c != default) + f"); read on fold {read}: " + "; ".join(
            f"{ds} Δ {delta(best, read, ds):+.4f}" for ds in ("lme", "locomo")))
        picks.append(best)
    if detail:
        pick_detail(data, default, [c for c in dict.fromkeys(picks) if c != default])
    print("\n" + "\n".join(f"- {c}: {w}" for c, w in meta["candidates"].items()))
    if "cost" in meta:
        cost_table(meta)
    if "time_windows" not in meta:
        return
    print("\nTime windows (time-aware): " + "; ".join(
        f"{ds}: {w['scored_with_window']} of the {w['scored']} scored questions state one, {w['scored_with_leg']} have "
        f"sessions dated in it; of all {w['all']} questions {w['all_with_window']} state one, "
        f"{w['all_gold_outside']} with a gold session dated outside it"
        for ds, w in sorted(meta["time_windows"].items())))


def pick_detail(data: dict, default: str, picks: list[str]) -> None:
    """Each pick against the default, metric by metric: per dataset and fold, the mean paired difference of
    recall_any@5, recall_all@5 and NDCG@10 [95% bootstrap interval], the questions where the criterion
    ((recall_any@5 + NDCG@10) / 2) rises / falls / stays; then the criterion over both datasets' questions together."""
    from memsifter.retrieval.metrics import bootstrap_ci

    def ci(d: list[float]) -> str:
        lo, hi = bootstrap_ci(d)
        return f"{np.mean(d):+.4f} [{lo:+.4f}, {hi:+.4f}]"
    crit = lambda r: (r["recall_any@5"] + r["ndcg@10"]) / 2  # noqa: E731
    for cand in picks:
        print(f"\n#### {cand} − {default}, metric by metric (mean paired difference [95% bootstrap interval])\n")
        print("| dataset | fold | n | recall_any@5 | recall_all@5 | NDCG@10 | criterion up / down / same |")
        print("|---|---|---:|---:|---:|---:|---:|")
        both = []
        for ds in ("lme", "locomo"):
            base, r = data[ds][default], data[ds][cand]
            for fold in ("A", "B", None):
                qs = [q for q in base if q in r and (fold is None or base[q]["fold"] == fold)]
                d = [crit(r[q]) - crit(base[q]) for q in qs]
                both += d if fold is None else []
                print(f"| {ds} | {fold or 'all'} | {len(qs)} | " + " | ".join(
                    ci([r[q][m] - base[q][m] for q in qs]) for m in ("recall_any@5", "recall_all@5", "ndcg@10"))
                    + f" | {sum(x > 0 for x in d)} / {sum(x < 0 for x in d)} / {sum(x == 0 for x in d)} |")
        print(f"\nBoth datasets' questions together ({len(both)}): criterion Δ {ci(both)}")


SRCS = {"locomo": ("locomo", "locomo_dev2.json.gz"), "lme": ("longmemeval", "longmemeval_s_train348.json.gz")}


def load(name: str, data: str, out: str):  # noqa: ANN201 - (Dataset, questions)
    """``name``'s development sample (``SRCS``) imported with the platform into ``out/<name>`` (once), and its
    scored questions in question-id order: LoCoMo categories 1-4 with gold sessions, LongMemEval without
    abstention questions. Shared with ``bench_first_stage.py``."""
    from memsifter.data.model import read_dataset
    from memsifter.retrieval import rankings

    fmt, src = SRCS[name]
    path = os.path.join(out, name)
    if not os.path.exists(os.path.join(path, "_SUCCESS")):
        subprocess.run([sys.executable, "-m", "memsifter.cli", "data", "import", "--format", fmt,
                        os.path.join(data, src), path, "-q"], check=True, stdout=subprocess.DEVNULL)
    ds = read_dataset(path)
    qs = sorted((q for q in ds.questions if q.question_type != "adversarial" and rankings.eligible(q)),
                key=lambda q: q.question_id)
    return ds, qs


class Vectors:
    """all-MiniLM-L6-v2 vectors (the embed stage's Embedder, float32 CPU) in one content-hash store under
    ``out``: a text is embedded once over every run; ``seconds`` is the time this run spent embedding."""

    def __init__(self, out: str):
        from memsifter.models import embedding

        self.E = embedding
        self.spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
        self.store = embedding.EmbeddingStore(os.path.join(out, "store"), self.spec)
        self.store.load()
        self.model = None
        self.seconds, self.embedded = 0.0, 0
        self._cache: dict[str, np.ndarray] = {}

    def has(self, text: str) -> bool:
        return self.E.text_hash(text) in self.store

    def ensure(self, texts) -> None:
        items = sorted({(h, t) for h, t in ((self.E.text_hash(t), t) for t in texts) if h not in self.store})
        if not items:
            return
        if self.model is None:
            self.model = self.E.Embedder(self.spec, "cpu")
        t0 = time.time()
        for b in self.E.plan_batches(items, self.spec.max_length):
            self.store.add_shard([h for h, _ in b], self.model.encode([t for _, t in b]))
        self.seconds += time.time() - t0
        self.embedded += len(items)
        print(f"  embedded {len(items)} texts in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    def get(self, text: str) -> np.ndarray:
        h = self.E.text_hash(text)
        if h not in self._cache:
            self._cache[h] = self.store.get(h)
        return self._cache[h]

    def sims(self, question: str, texts: list[str]) -> np.ndarray:
        return np.stack([self.get(t) for t in texts]) @ self.get(question)


def tokenize_seconds(ds, qs: list) -> dict:  # noqa: ANN001
    """CPU seconds to turn the units of the sessions of ``qs`` into BM25 tokens: the stage's S-stemmer against
    Porter's (its per-word cache emptied first, as in a fresh process)."""
    from memsifter.retrieval import first_stage_candidates as C
    from memsifter.retrieval.first_stage_candidates import E

    sids = sorted({s for q in qs for s in q.haystack_session_ids})
    units = [u for s in sids for u in E.turn_units(ds.sessions[s].turns, WORDS)]
    tok = C.Tokens(ds)
    out = {"sessions": len(sids), "units": len(units)}
    C.porter.cache_clear()
    for label, porter_stem in (("s-stemmer", False), ("porter", True)):
        t0 = time.process_time()
        for u in units:
            tok.tokens(u, porter_stem)
        out[label] = time.process_time() - t0
    return out


def candidate_set(name: str) -> tuple[str, dict, dict, list[str]]:
    """(default, {candidate: fn(ctx)}, descriptions, lexical views to cache) of a named candidate set."""
    if name == "2026-11-26":
        from benchmarks import first_stage_variants as V

        def adapt(fn):  # noqa: ANN001, ANN202 - the 2026-11-26 signature, fn(L, q, ds, unit_sims)
            def run(c):  # noqa: ANN001, ANN202
                def unit_sims(j: int, turns: list | None) -> np.ndarray:
                    from memsifter.retrieval.first_stage_candidates import E
                    return c.texts_sims(E.cascade_units(turns or c.ds.sessions[c.hay[j]].turns, WORDS))
                return fn(lambda view: c.views[view], c.q, c.ds, unit_sims)
            return run
        return V.DEFAULT, {k: adapt(f) for k, f in V.CANDIDATES.items()}, V.DESCRIPTIONS, list(V.LEXICAL)
    from memsifter.retrieval import first_stage_candidates as C
    if name == "2026-11-27-r3":
        return C.DEFAULT, {k: f for k, (f, _) in C.R3.items()}, {k: d for k, (_, d) in C.R3.items()}, ["base"]
    return C.DEFAULT, C.CANDIDATES, C.DESCRIPTIONS, ["base"]


def cost_table(meta: dict) -> None:
    """What each candidate embeds and computes beyond the default, over the scored LongMemEval questions, and the
    default's measured LongMemEval_S test time carried over in proportion to the words embedded."""
    c, d = meta["cost"]["lme"], meta["cost"]["lme"][meta["default"]]
    test_s, n_test = meta["default_test"]["seconds"], meta["default_test"]["questions"]
    n_sess = meta["default_test"]["sessions"]
    print(f"\n### Cost on LongMemEval ({d['questions']} questions): distinct texts and words embedded, scoring CPU "
          f"seconds a question beyond BM25 and the vectors; test = the default's measured {test_s} s on LongMemEval_S "
          f"test ({n_test} q, 2 cores: {meta['default_test']['source']}) x the words ratio + the extra scoring "
          f"seconds x {n_test}\n")
    t = meta["cost"].get("tokenize")
    if t:
        print(f"BM25 tokens of the units of the {t['sessions']:,} sessions of these questions ({t['units']:,} units): "
              f"S-stemmer {t['s-stemmer']:.1f} CPU s, Porter {t['porter']:.1f} CPU s; scaled to LongMemEval_S test's "
              f"{n_sess:,} sessions: {t['s-stemmer'] * n_sess / t['sessions']:.1f} and "
              f"{t['porter'] * n_sess / t['sessions']:.1f} s\n")
    print("| candidate | questions | texts | words | words / default's | scoring ms / q | test s (estimate) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for cand in meta["candidates"]:
        x = c[cand]
        ratio = x["words"] / d["words"] if d["words"] else float("nan")
        extra = max(0.0, x["scoring_cpu_s_per_q"] - d["scoring_cpu_s_per_q"]) * n_test
        print(f"| {cand} | {x['questions']} | {x['texts']:,} | {x['words']:,} | {ratio:.2f} | "
              f"{1000 * x['scoring_cpu_s_per_q']:.1f} | {test_s * ratio + extra:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "first-stage-cv"))
    ap.add_argument("--data", default=SHARED)
    ap.add_argument("--set", default="2026-11-27", choices=("2026-11-26", "2026-11-27", "2026-11-27-r3"),
                    help="candidate set (2026-11-26: benchmarks/first_stage_variants.py; 2026-11-27: "
                         "memsifter/retrieval/first_stage_candidates.py CANDIDATES; 2026-11-27-r3: its R3)")
    ap.add_argument("--lme", type=int, default=1000, help="LongMemEval questions (first N in id order)")
    ap.add_argument("--minutes", type=float, default=1e9,
                    help="embed nothing more after this many minutes (0: score with the vectors already stored); "
                         "the default's texts of every question first, then the other candidates' question by "
                         "question; a question lacking the default's texts is left out, a candidate lacking its "
                         "texts on a question is scored without it (the table counts the questions)")
    ap.add_argument("--results", help="write per-question files and meta.json here")
    ap.add_argument("--table", metavar="RESULTS", help="only print the table of a results folder")
    ap.add_argument("--detail", action="store_true", help="with --table: each fold's pick against the default, "
                    "metric by metric")
    a = ap.parse_args()
    if a.table:
        table(a.table, a.detail)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"
    from memsifter.retrieval import first_stage_candidates as C
    from memsifter.retrieval import rankings
    from memsifter.retrieval.first_stage_candidates import E

    default, cands, descriptions, views = candidate_set(a.set)
    os.makedirs(a.out, exist_ok=True)
    vec = Vectors(a.out)
    started = time.time()
    all_rows: dict = {}
    cost: dict = {}
    windows: dict = {}
    for name in SRCS:
        ds, qs = load(name, a.data, a.out)
        if name == "lme":
            qs = qs[:a.lme]
        # the stage's BM25 views of each question (cached: a pickle per dataset)
        from benchmarks import first_stage_variants as V
        lex_file = os.path.join(a.out, f"lex-{name}.pkl")
        lex = pickle.load(open(lex_file, "rb")) if os.path.exists(lex_file) else {}
        lx = E.Lexical(ds, WORDS, stem=True)
        tokens = C.Tokens(ds)
        shared: dict[str, dict] = {}   # per question, the legs both passes share

        def save_lex() -> None:
            with open(lex_file + ".tmp", "wb") as f:
                pickle.dump(lex, f)
            os.replace(lex_file + ".tmp", lex_file)

        def ctx(q, texts_sims):  # noqa: ANN001, ANN202
            c = C.Ctx(q, ds, {m: lex[(q.question_id, "base")][m] for m in E.LEXICAL_LEGS}, tokens, texts_sims,
                      shared.setdefault(q.question_id, {}))
            c.views = {v: lex[(q.question_id, v)] for v in views}
            return c

        need: dict[str, dict[str, set[str]]] = {}

        def prepare(q) -> None:  # noqa: ANN001
            """The question's BM25 views, and which texts each candidate embeds for it (a recording pass:
            every similarity 0)."""
            for view in views:
                if (q.question_id, view) not in lex:
                    lex[(q.question_id, view)] = V.LEXICAL[view](lx, ds, q)
            base = ctx(q, None)
            need[q.question_id] = {}
            for cand, fn in cands.items():
                got: set[str] = set()

                def record(texts: list[str]) -> np.ndarray:
                    got.update(texts)
                    return np.zeros(len(texts))
                c = base.fork(record)
                c.views = base.views
                fn(c)
                need[q.question_id][cand] = got | {q.question}

        # the default's texts of each question, a few questions at a time (past --minutes: the questions so far);
        # then the other candidates' texts of those questions
        kept: list = []
        for i in range(0, len(qs), 4):
            chunk = qs[i:i + 4]
            for q in chunk:
                prepare(q)
            texts = set().union(*(need[q.question_id][default] for q in chunk))
            if time.time() - started > a.minutes * 60 and not all(vec.has(t) for t in texts):
                vec.store.load()   # shards another process wrote since
                if not all(vec.has(t) for t in texts):
                    break
            vec.ensure(sorted(texts))
            kept += chunk
            if i % 40 == 36:
                save_lex()
                print(f"{name}: {len(kept)}/{len(qs)} questions, {time.time() - started:.0f} s", file=sys.stderr,
                      flush=True)
        save_lex()
        qs = kept
        vec.store.load()
        for i in range(0, len(qs), 4):
            texts = set().union(*(t for q in qs[i:i + 4] for t in need[q.question_id].values()))
            if time.time() - started > a.minutes * 60 and not all(vec.has(t) for t in texts):
                break
            vec.ensure(sorted(texts))
        rows: dict = {c: [] for c in cands}
        secs = {c: 0.0 for c in cands}
        for i, q in enumerate(qs):
            hay = q.haystack_session_ids
            base = ctx(q, lambda texts, q=q: vec.sims(q.question, texts))
            for cand, fn in cands.items():
                if not all(vec.has(t) for t in need[q.question_id][cand]):
                    continue
                c = base.fork(base.texts_sims)
                c.views = base.views
                t0 = time.process_time()
                order = E.order_by(fn(c))
                secs[cand] += time.process_time() - t0
                rows[cand].append({"question_id": q.question_id, "status": "ok",
                                   "ranked_session_ids": [hay[j] for j in order]})
            if i % 50 == 49:
                print(f"{name}: {i + 1}/{len(qs)} questions scored, {time.time() - started:.0f} s", file=sys.stderr,
                      flush=True)
        # cost: the distinct texts (and words) each candidate embeds over these questions, against the default's
        texts = {c: set().union(*(need[q.question_id][c] for q in qs)) if qs else set() for c in cands}
        words = {c: sum(len(t.split()) for t in texts[c]) for c in cands}
        cost[name] = {c: {"texts": len(texts[c]), "words": words[c], "questions": len(rows[c]),
                          "scoring_cpu_s_per_q": secs[c] / max(len(rows[c]), 1)} for c in cands}
        all_rows[name] = (qs, ds, folds_of(name, qs, ds.sessions), rows)
        if name == "lme" and a.set.startswith("2026-11-27"):
            cost["tokenize"] = tokenize_seconds(ds, qs)
        if a.set == "2026-11-26":
            every = [q for q in ds.questions if q.question_type != "adversarial" and rankings.eligible(q)]
            windows[name] = V.time_stats(every, qs, ds)
    print(f"embedded {vec.embedded} texts in {vec.seconds:.0f} s this run", file=sys.stderr)
    if a.results:
        os.makedirs(a.results, exist_ok=True)
        for name, (qs, ds, fold, rows) in all_rows.items():
            for cand, rs in rows.items():
                pq = per_question(name, rs, qs, ds.sessions)
                # gzip without a name or time in its header: the same rows give the same bytes (a folder of these
                # files is ~20 MB as text, ~10x less compressed; they travel with every checkout)
                with open(os.path.join(a.results, f"{name}.{cand}.jsonl.gz"), "wb") as out, \
                        gzip.GzipFile(filename="", fileobj=out, mode="wb", mtime=0) as raw, \
                        io.TextIOWrapper(raw, encoding="utf-8") as f:
                    for r in rs:
                        f.write(json.dumps({**r, "fold": fold[r["question_id"]], **pq[r["question_id"]]},
                                           sort_keys=True) + "\n")
        lme_title = f"the first {len(all_rows['lme'][0])} scored questions in id order"
        meta = {"default": default, "candidates": descriptions,
                "titles": {"lme": f"LongMemEval_S train348 ({lme_title})",
                           "locomo": "LoCoMo (fold A = conv-26, fold B = conv-30)"}}
        if windows:
            meta["time_windows"] = windows
        else:
            meta["cost"] = cost
            meta["default_test"] = {"seconds": 142, "questions": 150, "sessions": 6692,
                                    "source": "issue 42, the lead's run"}
        with open(os.path.join(a.results, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, ensure_ascii=False)
        table(a.results)


if __name__ == "__main__":
    main()
