#!/usr/bin/env python3
"""First-stage candidates against the default (``zsum`` k = 15), cross-validated across datasets (issue 42 item 5).

    nice -n 19 .venv/bin/python benchmarks/first_stage_cv.py --lme 200 --out runs/first-stage-cv \\
        --results benchmarks/results/first-stage-2026-11-26
    .venv/bin/python benchmarks/first_stage_cv.py --table benchmarks/results/first-stage-2026-11-26  # table only

Data: ``../shared/data`` (LoCoMo conv-26 + conv-30, LongMemEval_S train348 without abstention), imported with
the platform. Every candidate is computed with the embed stage's functions (``Lexical``, ``cascade_candidates``,
``zsum_scores``, ``cascade_units``) and its Embedder (all-MiniLM-L6-v2, float32 CPU); vectors are kept in one
content-hash store under ``--out`` (a text is embedded once over every run), lexical scores in a pickle.

Folds (nothing is fitted; the folds are for choosing among candidates): LoCoMo by conversation (fold A =
conv-26, B = conv-30); LongMemEval by session text: questions whose gold sessions share a text (content hash)
are one group, groups alternate between A and B in question-id order. Rule, applied on one fold and read on
the other, then swapped: a candidate replaces the default only if its mean paired difference to the default
in (recall_any@5 + NDCG@10) / 2 is > 0 on BOTH datasets of the choosing fold; then it is read on the other.
Per-question rankings of every candidate are written as ``<results>/<dataset>.<candidate>.jsonl``;
``--table`` prints the table from those files alone.
"""
from __future__ import annotations

import argparse
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
K = 15


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


def table(results: str) -> None:
    """Print the table from the per-question files of ``results``."""
    from memsifter.retrieval.metrics import bootstrap_ci

    meta = json.load(open(os.path.join(results, "meta.json")))
    data: dict = {}
    for f in sorted(os.listdir(results)):
        if f.endswith(".jsonl"):
            ds, cand = f[:-6].split(".", 1)
            with open(os.path.join(results, f)) as fh:
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
            r = data[ds][cand]

            def cell(fold: str | None) -> str:
                v = [x for x in r.values() if fold is None or x["fold"] == fold]
                return " / ".join(f"{np.mean([x[m] for x in v]):.3f}"
                                  for m in ("recall_any@5", "recall_all@5", "ndcg@10"))
            line = f"| {cand} | {cell('A')} | {cell('B')} | {cell(None)}"
            if ds == "lme":
                v = [x for x in r.values() if "lme_recall_all@5" in x]
                line += f" | {np.mean([x['lme_recall_all@5'] for x in v]):.3f} / " \
                        f"{np.mean([x['lme_ndcg_any@10'] for x in v]):.3f} ({len(v)} q)"
            for fold in ("A", "B", None):
                d = [crit(r[q]) - crit(rows[q]) for q in rows if fold is None or rows[q]["fold"] == fold]
                lo, hi = bootstrap_ci(d)
                line += f" | {np.mean(d):+.4f} [{lo:+.4f}, {hi:+.4f}]"
            print(line + " |")
        print()
    print("### Cross-validation (rule: a candidate is chosen on a fold only if its mean paired Δ > 0 on both "
          "datasets of that fold; the best mean Δ of those; read on the other fold)\n")
    for pick, read in (("A", "B"), ("B", "A")):
        def delta(cand: str, fold: str, ds: str) -> float:
            base = data[ds][default]
            return float(np.mean([crit(data[ds][cand][q]) - crit(base[q]) for q in base if base[q]["fold"] == fold]))
        ok = [c for c in meta["candidates"] if c != default and all(delta(c, pick, ds) > 0 for ds in ("lme", "locomo"))]
        best = max(ok, key=lambda c: np.mean([delta(c, pick, ds) for ds in ("lme", "locomo")]), default=default)
        print(f"- chosen on fold {pick}: **{best}** (" + ", ".join(
            f"{c}: LME {delta(c, pick, 'lme'):+.4f}, LoCoMo {delta(c, pick, 'locomo'):+.4f}"
            for c in meta["candidates"] if c != default) + f"); read on fold {read}: " + "; ".join(
            f"{ds} Δ {delta(best, read, ds):+.4f}" for ds in ("lme", "locomo")))
    print("\n" + "\n".join(f"- {c}: {w}" for c, w in meta["candidates"].items()))
    print("\nTime windows (time-aware): " + "; ".join(
        f"{ds}: {w['scored_with_window']} of the {w['scored']} scored questions state one, {w['scored_with_leg']} have "
        f"sessions dated in it; of all {w['all']} questions {w['all_with_window']} state one, "
        f"{w['all_gold_outside']} with a gold session dated outside it"
        for ds, w in sorted(meta["time_windows"].items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "first-stage-cv"))
    ap.add_argument("--data", default=SHARED)
    ap.add_argument("--lme", type=int, default=200, help="LongMemEval questions (first N in id order)")
    ap.add_argument("--minutes", type=float, default=1e9, 
                    help="embed nothing more after this many minutes (0: score the questions already embedded)")
    ap.add_argument("--results", help="write per-question files and meta.json here")
    ap.add_argument("--table", metavar="RESULTS", help="only print the table of a results folder")
    a = ap.parse_args()
    if a.table:
        table(a.table)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"
    from memsifter.models import embedding
    from memsifter.retrieval import rankings
    from memsifter.data.model import read_dataset
    from memsifter.stages import embed as E
    from benchmarks import first_stage_variants as V

    srcs = {"locomo": ("locomo", "locomo_dev2.json.gz"), "lme": ("longmemeval", "longmemeval_s_train348.json.gz")}
    os.makedirs(a.out, exist_ok=True)
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    store = embedding.EmbeddingStore(os.path.join(a.out, "store"), spec)
    store.load()
    emb: dict = {}

    def ensure(texts) -> None:
        items = sorted({(h, t) for h, t in ((embedding.text_hash(t), t) for t in texts) if h not in store})
        if not items:
            return
        if "e" not in emb:
            emb["e"] = embedding.Embedder(spec, "cpu")
        t0 = time.time()
        for i, b in enumerate(embedding.plan_batches(items, spec.max_length)):
            store.add_shard([h for h, _ in b], emb["e"].encode([t for _, t in b]))
            if i % 20 == 0:
                print(f"  batch {i}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        print(f"  embedded {len(items)} texts in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    vcache: dict = {}

    def vec(t: str) -> np.ndarray:
        h = embedding.text_hash(t)
        if h not in vcache:
            vcache[h] = store.get(h)
        return vcache[h]

    all_rows: dict = {}
    windows: dict = {}
    started = time.time()
    for name, (fmt, src) in srcs.items():
        path = os.path.join(a.out, name)
        if not os.path.exists(os.path.join(path, "_SUCCESS")):
            subprocess.run([sys.executable, "-m", "memsifter.cli", "data", "import", "--format", fmt,
                            os.path.join(a.data, src), path, "-q"], check=True, stdout=subprocess.DEVNULL)
        ds = read_dataset(path)
        qs = sorted((q for q in ds.questions if q.question_type != "adversarial" and rankings.eligible(q)),
                    key=lambda q: q.question_id)
        if name == "lme":
            qs = qs[:a.lme]
        fold = folds_of(name, qs, ds.sessions)
        lex_file = os.path.join(a.out, f"lex-{name}.pkl")
        lex = pickle.load(open(lex_file, "rb")) if os.path.exists(lex_file) else {}
        n_lex = len(lex)
        lx = E.Lexical(ds, WORDS, stem=True)
        for q in qs:
            for view, fn in V.LEXICAL.items():
                if (q.question_id, view) not in lex:
                    lex[(q.question_id, view)] = fn(lx, ds, q)
        if len(lex) != n_lex:
            with open(lex_file + ".tmp", "wb") as f:
                pickle.dump(lex, f)
            os.replace(lex_file + ".tmp", lex_file)
        # every text any candidate embeds, a few questions at a time (the store keeps them for the next run);
        # past --minutes, the questions whose texts are not all embedded yet are left out (the table counts them)
        def texts_of(q) -> set[str]:
            need = {q.question}
            for view in V.LEXICAL:
                for j in E.cascade_candidates(lex[(q.question_id, view)], V.K, V.RRF_K):
                    need.update(E.cascade_units(ds.sessions[q.haystack_session_ids[j]].turns, WORDS))
            return need
        done = []
        for i in range(0, len(qs), 4):
            texts = set().union(*(texts_of(q) for q in qs[i:i + 4]))
            if time.time() - started > a.minutes * 60 and any(embedding.text_hash(t) not in store for t in texts):
                break
            ensure(sorted(texts))
            done += qs[i:i + 4]
            print(f"{name}: {len(done)}/{len(qs)} questions embedded, {time.time() - started:.0f} s", file=sys.stderr,
                  flush=True)
        qs = done
        rows: dict = {c: [] for c in V.CANDIDATES}
        t0 = time.time()
        for i, q in enumerate(qs):
            hay = q.haystack_session_ids
            qv = vec(q.question)

            def unit_sims(j: int, turns: list | None) -> np.ndarray:
                us = E.cascade_units(turns or ds.sessions[hay[j]].turns, WORDS)
                return np.stack([vec(u) for u in us]) @ qv
            for cand, fn in V.CANDIDATES.items():
                L = lambda view: lex[(q.question_id, view)]  # noqa: E731
                order = E.order_by(fn(L, q, ds, unit_sims))
                rows[cand].append({"question_id": q.question_id, "status": "ok",
                                   "ranked_session_ids": [hay[j] for j in order]})
            if i % 20 == 19:
                print(f"{name}: {i + 1}/{len(qs)} questions, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        all_rows[name] = (qs, ds, fold, rows)
        every = [q for q in ds.questions if q.question_type != "adversarial" and rankings.eligible(q)]
        windows[name] = V.time_stats(every, qs, ds)
    if a.results:
        os.makedirs(a.results, exist_ok=True)
        for name, (qs, ds, fold, rows) in all_rows.items():
            for cand, rs in rows.items():
                pq = per_question(name, rs, qs, ds.sessions)
                with open(os.path.join(a.results, f"{name}.{cand}.jsonl"), "w") as f:
                    for r in rs:
                        f.write(json.dumps({**r, "fold": fold[r["question_id"]], **pq[r["question_id"]]},
                                           sort_keys=True) + "\n")
        with open(os.path.join(a.results, "meta.json"), "w") as f:
            json.dump({"default": V.DEFAULT, "candidates": V.DESCRIPTIONS, "time_windows": windows,
                       "titles": {"lme": f"LongMemEval_S train348 (the first {len(all_rows['lme'][0])} scored "
                                         "questions in id order)",
                                  "locomo": "LoCoMo (fold A = conv-26, fold B = conv-30)"}}, f, indent=1)
        table(a.results)


if __name__ == "__main__":
    main()
