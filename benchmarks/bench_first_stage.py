#!/usr/bin/env python3
"""First-stage retrieval (issue 16): quality AND cost of every candidate, dev / held-out, one run.

    .venv/bin/python benchmarks/bench_first_stage.py                       # ~20 min on 2 cores
    .venv/bin/python benchmarks/bench_first_stage.py --lme-per-half 20 --costly-per-half 2   # quicker

Data (read-only, ../shared/data): LoCoMo conv-26 + conv-30 (``locomo_dev2.json.gz``) and the 348
LongMemEval_S training items (``longmemeval_s_train348.json.gz``), imported with the platform
(``memsifter data import``). Scored: LoCoMo categories 1-4 with gold sessions; LongMemEval without
abstention (``_abs``) questions.

Protocol: the default was chosen on DEV = LoCoMo conv-26 + the LongMemEval questions at even positions
in question-id order, and is confirmed on HELD-OUT = conv-30 + the odd positions (the first
``--lme-per-half`` of each half: every candidate on the same questions). Cross-over: choose on the
held-out columns, read the dev columns. Candidates whose dense leg embeds every session or every turn
(``fusion``, the old default; ``dense``; ``lex+dense``) cost minutes per LongMemEval question on CPU, so
they are scored on the first ``--costly-per-half`` questions of each half, in a second table, next to
the default on the same questions.

Every candidate is computed with the embed stage's own functions (``memsifter.stages.embed``: the
``Lexical`` BM25 views, ``cascade_candidates`` / ``cascade_scores``, ``turn_units``, ``cascade_units``)
and the stage's ``Embedder`` and length-bucketed batches (all-MiniLM-L6-v2, float32, CPU). Vectors are
kept in an ``EmbeddingStore`` (content hash), so a text two candidates share is embedded once; each
text's seconds (its batch's time split evenly over the batch) are recorded when it is embedded, so the
cost of a candidate is the sum over the distinct texts it needs (plus its BM25 seconds), measured in
this run (the store starts empty unless ``--reuse-store``). Extrapolation to the LongMemEval_S test
split (6,692 sessions, 150 questions): texts per session observed here x 6,692 at the texts/s measured
here, plus BM25 seconds per question x 150. It is an extrapolation, on a machine shared with other jobs.

Last: ``memsifter run embed`` with its defaults on the held-out LongMemEval questions (fresh store),
wall seconds end to end (Ray start, model load, BM25, embedding, writing), extrapolated the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
TEST_SESSIONS, TEST_QUESTIONS = 6692, 150


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-first-stage"))
    ap.add_argument("--data", default=SHARED)
    ap.add_argument("--lme-per-half", type=int, default=40, help="LongMemEval questions per half (dev/held-out)")
    ap.add_argument("--costly-per-half", type=int, default=3,
                    help="LongMemEval questions per half for the candidates that embed every session/turn")
    ap.add_argument("--reuse-store", action="store_true", help="keep vectors (and their seconds) of a previous run")
    ap.add_argument("--no-stage-run", action="store_true", help="skip the end-to-end `memsifter run embed`")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"

    from memsifter import embedding, rankings, storage
    from memsifter.data.model import Dataset, read_dataset
    from memsifter.metrics import mean_metrics
    from memsifter.render import render_session
    from memsifter.stages import embed as E

    os.makedirs(a.out, exist_ok=True)
    ms = [sys.executable, "-m", "memsifter.cli"]
    paths = {}
    for name, fmt, src in (("locomo", "locomo", "locomo_dev2.json.gz"),
                           ("lme", "longmemeval", "longmemeval_s_train348.json.gz")):
        paths[name] = os.path.join(a.out, name)
        subprocess.run(ms + ["data", "import", "--format", fmt, os.path.join(a.data, src), paths[name], "-q"],
                       check=True, stdout=subprocess.DEVNULL)

    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    store_dir = os.path.join(a.out, "store")
    secs_file = os.path.join(a.out, "store-seconds.json")
    if not a.reuse_store:
        shutil.rmtree(store_dir, ignore_errors=True)
        if os.path.exists(secs_file):
            os.remove(secs_file)
    store = embedding.EmbeddingStore(store_dir, spec)
    store.load()
    secs: dict[str, float] = json.load(open(secs_file)) if os.path.exists(secs_file) else {}
    emb = {}

    def ensure(texts) -> None:
        """Embed the texts the store lacks (the stage's batches), recording seconds per text."""
        items = sorted({(h, t) for h, t in ((embedding.text_hash(t), t) for t in texts) if h not in store})
        if not items:
            return
        if "e" not in emb:
            emb["e"] = embedding.Embedder(spec, "cpu")
        for b in embedding.plan_batches(items, spec.max_length):
            t0 = time.time()
            v = emb["e"].encode([t for _, t in b])
            dt = time.time() - t0
            store.add_shard([h for h, _ in b], v)
            for h, _ in b:
                secs[h] = dt / len(b)
        with open(secs_file, "w") as f:
            json.dump(secs, f)

    def vec(t: str) -> np.ndarray:
        return store.get(embedding.text_hash(t))

    def maxsim(units: list[str], qv: np.ndarray) -> float:
        return float(max(float(vec(u) @ qv) for u in units))

    # ---- splits
    def halves(name: str, ds: Dataset):
        qs = sorted((q for q in ds.questions if q.question_type != "adversarial" and rankings.eligible(q)),
                    key=lambda q: q.question_id)
        if name == "locomo":
            return ([q for q in qs if q.question_id.startswith("conv-26")],
                    [q for q in qs if q.question_id.startswith("conv-30")])
        return qs[::2][:a.lme_per_half], qs[1::2][:a.lme_per_half]

    CHEAP = ["bm25_window (no stem)", "bm25_dated (no stem)", "bm25", "bm25_dated", "bm25_window",
             "lexical = RRF(bm25_dated, bm25_window)", "cascade k=5 (no stem)", "cascade k=5 (default)",
             "cascade k=10"]
    COSTLY = ["fusion (old default: every turn)", "dense (whole session)", "lex+dense = RRF(dense, bm25_dated, "
              "bm25_window)", "cascade k=5 (default)", "cascade k=10"]

    def candidates(ds: Dataset, q, lex: dict, lex_ns: dict, costly: bool) -> tuple[dict, dict]:
        """Session scores per candidate, and the texts each one embeds for this question."""
        hay, n = q.haystack_session_ids, len(q.haystack_session_ids)
        S, T = {}, {}
        L, Lns = lex[q.question_id], lex_ns[q.question_id]
        S["bm25_window (no stem)"], S["bm25_dated (no stem)"] = Lns["bm25_window"], Lns["bm25_dated"]
        for m in ("bm25", "bm25_dated", "bm25_window"):
            S[m] = L[m]
        S["lexical = RRF(bm25_dated, bm25_window)"] = E.rrf([E.order_by(L[m]) for m in E.LEXICAL_LEGS], n, 60)
        ensure([q.question])
        qv = vec(q.question)
        for key, lx, k in (("cascade k=5 (no stem)", Lns, 5), ("cascade k=5 (default)", L, 5),
                           ("cascade k=10", L, 10)):
            cand = E.cascade_candidates(lx, k, 60)
            units = {i: E.cascade_units(ds.sessions[hay[i]].turns, 200) for i in cand}
            texts = [u for us in units.values() for u in us]
            ensure(texts)
            S[key] = E.cascade_scores(lx, cand, {i: maxsim(us, qv) for i, us in units.items()}, 60)
            T[key] = texts + [q.question]
        if costly:
            units = [E.turn_units(ds.sessions[s].turns, 200) for s in hay]
            ensure([u for us in units for u in us])
            turns = np.array([maxsim(us, qv) for us in units])
            S[COSTLY[0]] = E.rrf([E.order_by(turns)] + [E.order_by(Lns[m]) for m in E.LEXICAL_LEGS], n, 60)
            T[COSTLY[0]] = [u for us in units for u in us] + [q.question]
            whole = [render_session(ds.sessions[s].turns) for s in hay]
            ensure(whole)
            S[COSTLY[1]] = np.array([float(vec(t) @ qv) for t in whole])
            T[COSTLY[1]] = whole + [q.question]
            S[COSTLY[2]] = E.rrf([E.order_by(S[COSTLY[1]])] + [E.order_by(L[m]) for m in E.LEXICAL_LEGS], n, 60)
            T[COSTLY[2]] = whole + [q.question]
        return S, T

    def table(title: str, names: list[str], ds: Dataset, parts: list[tuple[str, list]], lex: dict, lex_ns: dict,
              lex_secs: dict, costly: bool, extrapolate: bool) -> None:
        res = {}
        for label, qs in parts:
            rows = {m: [] for m in names}
            texts = {m: set() for m in names}
            for q in qs:
                S, T = candidates(ds, q, lex, lex_ns, costly)
                for m in names:
                    rows[m].append({"question_id": q.question_id, "status": "ok",
                                    "ranked_session_ids": [q.haystack_session_ids[i] for i in E.order_by(S[m])]})
                    texts[m].update(T.get(m, []))
            nsess = len({s for q in qs for s in q.haystack_session_ids})
            for m in names:
                met = mean_metrics(list(rankings.per_question_metrics(rows[m], qs).values()))
                sec = sum(secs[embedding.text_hash(t)] for t in texts[m])
                res.setdefault(m, []).append((len(qs), met, len(texts[m]), sec, nsess, lex_secs[label] / len(qs)))
        print(f"\n### {title}\n")
        head = " | ".join(f"{lab} ({res[names[0]][i][0]} q) R@5 / NDCG@10 / MRR" for i, (lab, _) in enumerate(parts))
        cost = " | texts embedded (all parts) | embed min measured | LME test min (extrapolated)" if extrapolate \
            else " | texts embedded (all parts) | embed min measured"
        print(f"| candidate | {head}{cost} |")
        print("|---|" + "---:|" * (len(parts) + (3 if extrapolate else 2)))
        for m in names:
            cells = " | ".join(f"{met['recall_any@5']:.3f} / {met['ndcg@10']:.3f} / {met['mrr']:.3f}"
                               for _, met, *_ in res[m])
            n_texts = sum(r[2] for r in res[m])
            sec = sum(r[3] for r in res[m])
            line = f"| {m} | {cells} | {n_texts:,} | {sec / 60:.1f}"
            if extrapolate:
                sess = sum(r[4] for r in res[m])
                rate = n_texts / sec if sec else 0.0
                test_texts = n_texts / sess * TEST_SESSIONS
                bm25_q = sum(r[5] * r[0] for r in res[m]) / sum(r[0] for r in res[m])
                est = (test_texts / rate if rate else 0.0) + bm25_q * TEST_QUESTIONS
                line += f" | {est / 60:.1f} ({test_texts:,.0f} texts at {rate:.1f}/s + BM25 {bm25_q:.2f} s/q)"
            print(line + " |", flush=True)

    summary = {}
    for name, title in (("locomo", "LoCoMo (dev = conv-26, held-out = conv-30)"),
                        ("lme", "LongMemEval_S train348 (dev = even, held-out = odd positions)")):
        ds = read_dataset(paths[name])
        dev, ho = halves(name, ds)
        lex, lex_ns, lex_secs = {}, {}, {}
        for label, qs in (("dev", dev), ("held-out", ho)):
            t0 = time.time()
            lx = E.Lexical(ds, 200, stem=True)
            lex.update({q.question_id: lx.scores(q) for q in qs})
            lex_secs[label] = time.time() - t0
            lxn = E.Lexical(ds, 200, stem=False)
            lex_ns.update({q.question_id: lxn.scores(q) for q in qs})
        # costly parts use their own (smaller) question sets; BM25 seconds per question carry over
        table(title, CHEAP, ds, [("dev", dev), ("held-out", ho)], lex, lex_ns, lex_secs, False, name == "lme")
        if name == "locomo":
            table(title + ": candidates that embed every session / turn", COSTLY, ds,
                  [("dev", dev), ("held-out", ho)], lex, lex_ns, lex_secs, True, False)
        else:
            c = a.costly_per_half
            lex_secs_c = {"dev": lex_secs["dev"] / len(dev) * c, "held-out": lex_secs["held-out"] / len(ho) * c}
            table(title + f": first {c} of each half, candidates that embed every session / turn", COSTLY, ds,
                  [("dev", dev[:c]), ("held-out", ho[:c])], lex, lex_ns, lex_secs_c, True, True)
        summary[name] = (ds, ho)
    print(f"\nembedded in this run: {len(secs):,} texts, {sum(secs.values()) / 60:.1f} min "
          f"({len(secs) / max(sum(secs.values()), 1e-9):.1f} texts/s); "
          f"store reused from a previous run: {a.reuse_store}")

    if not a.no_stage_run:  # the stage itself, its defaults, a fresh store, end to end
        ds, ho = summary["lme"]
        used = {s for q in ho for s in q.haystack_session_ids}
        sub = os.path.join(a.out, "lme-heldout")
        if not os.path.exists(os.path.join(sub, "_SUCCESS")):
            pub = storage.Publication(sub, "import", {}, "subset", "bench")
            Dataset({k: v for k, v in ds.sessions.items() if k in used}, ho).write(pub)
            pub.publish({})
        emb_out = os.path.join(a.out, "lme-heldout-embed")
        shutil.rmtree(emb_out, ignore_errors=True)
        t0 = time.time()
        subprocess.run(ms + ["run", "embed", "--input", sub, "--output", emb_out, "--model", "all-MiniLM-L6-v2",
                             "--store", os.path.join(a.out, "stage-store-" + str(int(t0))), "-q"], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.time() - t0
        st = storage.read_manifest(emb_out)["stats"]
        r = st["retrieval"][st["primary"]]
        print(f"\n`memsifter run embed` (defaults: primary {st['primary']}) on the {len(ho)} held-out LongMemEval "
              f"questions ({len(used):,} sessions), fresh store: {wall:.0f} s wall, {st['embedded']:,} texts "
              f"embedded ({st.get('texts_per_second', 0)} texts/s), recall_any@5 {r['recall_any@5']:.3f}, "
              f"NDCG@10 {r['ndcg@10']:.3f}, embed {st.get('embed_seconds', 0):.0f} s of it; extrapolated "
              f"(wall incl. Ray start and model load, scaled) to {TEST_SESSIONS:,} sessions: "
              f"{wall / len(used) * TEST_SESSIONS / 60:.1f} min, to {TEST_QUESTIONS} questions: "
              f"{wall / len(ho) * TEST_QUESTIONS / 60:.1f} min")


if __name__ == "__main__":
    main()
