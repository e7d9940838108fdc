#!/usr/bin/env python3
"""First-stage retrieval (issues 16 and 34): quality AND cost of every candidate, dev / held-out, one run.

    .venv/bin/python benchmarks/bench_first_stage.py                        # ~25 min on 2 shared cores
    .venv/bin/python benchmarks/bench_first_stage.py --lme-per-half 162 --json out.json   # every question, ~1.5 h
    .venv/bin/python benchmarks/bench_first_stage.py --lme-per-half 20 --costly-per-half 2   # quicker

Data (read-only, ../shared/data; the script says so and exits 0 when it is absent): LoCoMo conv-26 +
conv-30 (``locomo_dev2.json.gz``) and the 348 LongMemEval_S training items
(``longmemeval_s_train348.json.gz``), imported with the platform (``memsifter data import``). Scored:
LoCoMo categories 1-4 with gold sessions; LongMemEval without abstention (``_abs``) questions.

Protocol (cross-validation, nothing fitted): DEV = LoCoMo conv-26 + the LongMemEval questions at even
positions in question-id order, HELD-OUT = conv-30 + the odd positions (the first ``--lme-per-half`` of
each half: every candidate on the same questions). The script applies one fixed rule twice: among the
candidates whose extrapolated LongMemEval_S test time is within ``--budget-min``, pick the best mean
over the two datasets of (recall_any@5 + NDCG@10) / 2 on one half, and read it on the other half; then
swap the halves. Candidates that embed every turn window of every session (``chunked``, ``hybrid``)
cost many minutes per LongMemEval question here, so on LongMemEval they are scored on the first
``--costly-per-half`` questions of each half, in a second table, next to the others on the same
questions.

Every candidate is computed with the embed stage's own functions (``memsifter.stages.embed``: the
``Lexical`` BM25 views, ``rrf``, ``cascade_candidates`` / ``cascade_scores``, ``cascade_units``,
``chunk_texts``) and the stage's ``Embedder`` and length-bucketed batches (all-MiniLM-L6-v2, float32,
CPU). Vectors live in one ``EmbeddingStore`` (content hash), so a text two candidates share is
embedded once; each text's seconds (its batch's time split evenly over the batch) are recorded when it
is embedded, so a candidate's cost is the sum over the distinct texts it needs, measured in this run
(a fresh store unless ``--reuse-store``, which keeps the texts and their seconds of an earlier run).

Cost, per candidate: distinct texts, their measured seconds and texts/s, and an extrapolation to the
LongMemEval_S test split (6,692 sessions, 150 questions): texts per LongMemEval session observed here
x 6,692 at that candidate's texts/s, plus BM25 seconds per question x 150. On a machine shared with
other jobs both are inflated alike, so the script also prints each extrapolation scaled by
``--default-test-s`` / (the default's extrapolation): the default's time measured by the project lead
on the test split (94 s on 2 cores) carried over to the others in proportion ("calibrated").
``--json`` writes every number of the run.

Last (``--stage-run N``, default 20): ``memsifter run embed`` end to end (Ray start, model load, BM25,
embedding, writing), the old default (``--no-zsum``) then the new defaults, each with a fresh store, back
to back on the first N held-out LongMemEval questions: wall seconds, their ratio, and the test split
extrapolated from it.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
TEST_SESSIONS, TEST_QUESTIONS = 6692, 150
RRF_K = 60          # the usual reciprocal-rank-fusion constant (Cormack et al., 2009); not tuned here
WORDS = 200         # words per turn unit (all-MiniLM-L6-v2 reads 256 tokens)

DEFAULT = "cascade k=5 (old default)"
CANDIDATES = {  # name: what it is (printed under the table)
    "bm25": "BM25 over the rendered session (anchor, no embedding)",
    "lexical": "RRF(bm25_dated, bm25_window) (no embedding)",
    DEFAULT: "RRF(bm25_dated, bm25_window, dense max-sim over the user units of the lexical top 5)",
    "cascade k=10": "the same, dense leg over the lexical top 10",
    "cascade k=20": "the same, dense leg over the lexical top 20",
    "user max-sim": "dense alone: max-sim of the question over the user units of EVERY session",
    "cascade all": "RRF(bm25_dated, bm25_window, user max-sim over every session)",
    "family all": "RRF(lexical, user max-sim over every session): one vote per family (lexical, dense)",
    "zsum k=10": "z(bm25_dated) + z(bm25_window) + z(dense max-sim over the user units of the lexical top 10; "
                 "the others at the lowest of those), z over the haystack",
    "zsum k=15": "the same, dense leg over the lexical top 15",
    "zsum k=20": "the same, dense leg over the lexical top 20",
    "zsum all": "the same, dense leg over every session",
}
COSTLY = {
    "chunked": "dense alone: best window of 4 turns (stride 2) of every session, all turns (the stage's chunked)",
    "hybrid": "RRF(bm25, chunked) (the stage's hybrid)",
    "family chunked": "RRF(lexical, chunked): one vote per family",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-first-stage"))
    ap.add_argument("--data", default=SHARED)
    ap.add_argument("--lme-per-half", type=int, default=40, help="LongMemEval questions per half (dev/held-out)")
    ap.add_argument("--costly-per-half", type=int, default=3,
                    help="LongMemEval questions per half for the candidates that embed every turn window")
    ap.add_argument("--budget-min", type=float, default=5.0, help="cost bound, LongMemEval_S test minutes "
                    "(calibrated extrapolation)")
    ap.add_argument("--default-test-s", type=float, default=94.0,
                    help="the old default's measured seconds on the LongMemEval_S test split (calibration)")
    ap.add_argument("--reuse-store", action="store_true", help="keep vectors (and their seconds) of a previous run")
    ap.add_argument("--stage-run", type=int, default=20, metavar="N",
                    help="end to end: `memsifter run embed`, old default (--no-zsum) then the new defaults, each "
                         "with a fresh store, on the first N held-out LongMemEval questions (0: skip)")
    ap.add_argument("--json", help="write every number of the run here")
    a = ap.parse_args()
    from first_stage_cv import SRCS, load   # one loader for both first-stage benchmarks

    missing = [s for _, s in SRCS.values() if not os.path.exists(os.path.join(a.data, s))]
    if missing:
        print(f"bench_first_stage: skipped, {', '.join(missing)} not in {a.data}")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"

    from memsifter.models import embedding
    from memsifter.retrieval import rankings
    from memsifter.data.model import Dataset
    from memsifter.retrieval.metrics import mean_metrics
    from memsifter.stages import embed as E

    os.makedirs(a.out, exist_ok=True)
    loaded = {name: load(name, a.data, a.out) for name in SRCS}

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
        with open(secs_file + ".tmp", "w") as f:
            json.dump(secs, f)
        os.replace(secs_file + ".tmp", secs_file)

    def vec(t: str) -> np.ndarray:
        return store.get(embedding.text_hash(t))

    def maxsim(units: list[str], qv: np.ndarray) -> float:
        return float((np.stack([vec(u) for u in units]) @ qv).max())

    def halves(name: str):
        qs = loaded[name][1]
        if name == "locomo":
            return ([q for q in qs if q.question_id.startswith("conv-26")],
                    [q for q in qs if q.question_id.startswith("conv-30")])
        return qs[::2][:a.lme_per_half], qs[1::2][:a.lme_per_half]

    def scores(ds: Dataset, q, lex: dict, costly: bool) -> tuple[dict, dict]:
        """Session scores per candidate for one question, and the texts each one embeds for it."""
        hay, n = q.haystack_session_ids, len(q.haystack_session_ids)
        S, T = {}, {}
        L = lex[q.question_id]
        lexical = E.rrf([E.order_by(L[m]) for m in E.LEXICAL_LEGS], n, RRF_K)
        S["bm25"], S["lexical"] = L["bm25"], lexical
        units = [E.cascade_units(ds.sessions[s].turns, WORDS) for s in hay]
        ensure([q.question] + [u for us in units for u in us])
        qv = vec(q.question)
        user = np.array([maxsim(us, qv) for us in units])
        for key, k in ((DEFAULT, 5), ("cascade k=10", 10), ("cascade k=20", 20)):
            cand = E.cascade_candidates(L, k, RRF_K)
            S[key] = E.cascade_scores(L, cand, {i: float(user[i]) for i in cand}, RRF_K)
            T[key] = [u for i in cand for u in units[i]] + [q.question]
        for k in (10, 15, 20):
            cand = E.cascade_candidates(L, k, RRF_K)
            S[f"zsum k={k}"] = E.zsum_scores(L, cand, {i: float(user[i]) for i in cand})
            T[f"zsum k={k}"] = [u for i in cand for u in units[i]] + [q.question]
        S["zsum all"] = E.zsum_scores(L, list(range(n)), {i: float(user[i]) for i in range(n)})
        S["user max-sim"] = user
        S["cascade all"] = E.rrf([E.order_by(L[m]) for m in E.LEXICAL_LEGS] + [E.order_by(user)], n, RRF_K)
        S["family all"] = E.rrf([E.order_by(lexical), E.order_by(user)], n, RRF_K)
        for key in ("user max-sim", "cascade all", "family all", "zsum all"):
            T[key] = [u for us in units for u in us] + [q.question]
        if costly:
            chunks = [E.chunk_texts(ds.sessions[s].turns, 4, 2) for s in hay]
            ensure([c for cs in chunks for c in cs])
            chunked = np.array([maxsim(cs, qv) for cs in chunks])
            S["chunked"] = chunked
            S["hybrid"] = E.rrf([E.order_by(chunked), E.order_by(L["bm25"])], n, RRF_K)
            S["family chunked"] = E.rrf([E.order_by(lexical), E.order_by(chunked)], n, RRF_K)
            for key in COSTLY:
                T[key] = [c for cs in chunks for c in cs] + [q.question]
        return S, T

    report: dict = {"machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}, "tables": {}}

    def table(title: str, names: list[str], ds: Dataset, parts: list[tuple[str, list]], lex: dict,
              bm25_q: float, costly: bool, lme: bool) -> dict:
        res: dict = {m: {} for m in names}
        for label, qs in parts:
            rows = {m: [] for m in names}
            texts = {m: set() for m in names}
            for q in qs:
                S, T = scores(ds, q, lex, costly)
                for m in names:
                    rows[m].append({"question_id": q.question_id, "status": "ok",
                                    "ranked_session_ids": [q.haystack_session_ids[i] for i in E.order_by(S[m])]})
                    texts[m].update(T.get(m, []))
            nsess = len({s for q in qs for s in q.haystack_session_ids})
            if "lexical" in names:  # how deep in the lexical order the first gold session lies
                depth = [min((i for i, s in enumerate(r["ranked_session_ids"]) if s in set(q.gold_session_ids)),
                             default=len(q.haystack_session_ids)) for r, q in zip(rows["lexical"], qs)]
                res["lexical"].setdefault("gold_depth", {})[label] = {
                    f"recall_any@{k}": float(np.mean([d < k for d in depth])) for k in (5, 10, 15, 20)}
            for m in names:
                met = mean_metrics(list(rankings.per_question_metrics(rows[m], qs).values()))
                res[m][label] = {"questions": len(qs), "recall_any@5": met["recall_any@5"], "ndcg@10": met["ndcg@10"],
                                 "mrr": met["mrr"], "texts": len(texts[m]), "sessions": nsess,
                                 "embed_s": sum(secs[embedding.text_hash(t)] for t in texts[m])}
        for m in names:
            per = [res[m][label] for label, _ in parts]
            n_texts = sum(r["texts"] for r in per)
            sec = sum(r["embed_s"] for r in per)
            sess = sum(r["sessions"] for r in per)
            res[m]["cost"] = {"texts": n_texts, "embed_s": sec, "texts_per_s": n_texts / sec if sec else None}
            if lme:
                test_texts = n_texts / sess * TEST_SESSIONS
                est = (test_texts * sec / n_texts if n_texts else 0.0) + bm25_q * TEST_QUESTIONS
                res[m]["cost"].update({"test_texts": test_texts, "bm25_s_per_q": bm25_q, "test_min": est / 60})
        return res

    def show(title: str, names: list[str], res: dict, parts: list[str], calib: float | None) -> None:
        print(f"\n### {title}\n")
        first = res[names[0]]
        head = " | ".join(f"{p} ({first[p]['questions']} q) R@5 / NDCG@10 / MRR" for p in parts)
        lme = "test_min" in first["cost"]
        cost = " | texts embedded | embed min measured | texts/s"
        cost += " | LME test min, extrapolated here | calibrated" if lme else ""
        print(f"| candidate | {head}{cost} |")
        print("|---|" + "---:|" * (len(parts) + (5 if lme else 3)))
        for m in names:
            r = res[m]
            cells = " | ".join(f"{r[p]['recall_any@5']:.3f} / {r[p]['ndcg@10']:.3f} / {r[p]['mrr']:.3f}" for p in parts)
            c = r["cost"]
            rate = f"{c['texts_per_s']:.1f}" if c["texts_per_s"] else "-"
            line = f"| {m} | {cells} | {c['texts']:,} | {c['embed_s'] / 60:.1f} | {rate}"
            if lme:
                line += (f" | {c['test_min']:.1f} ({c['test_texts']:,.0f} texts + BM25 {c['bm25_s_per_q']:.2f} s/q)"
                         f" | {c['test_min'] * calib:.1f}" if calib else " | -")
            print(line + " |", flush=True)

    results = {}
    bm25_q = 0.0
    for name in ("locomo", "lme"):
        ds = loaded[name][0]
        dev, ho = halves(name)
        t0 = time.time()
        lx = E.Lexical(ds, WORDS, stem=True)
        lex = {q.question_id: lx.scores(q) for q in dev + ho}
        if name == "lme":
            bm25_q = (time.time() - t0) / len(dev + ho)
        parts = [("dev", dev), ("held-out", ho)]
        results[name] = table(name, list(CANDIDATES), ds, parts, lex, bm25_q, False, name == "lme")
        c = len(dev) if name == "locomo" else a.costly_per_half
        results[name + " costly"] = table(name, list(COSTLY) + [DEFAULT, "zsum k=10", "zsum k=15", "zsum all"], ds,
                                          [("dev", dev[:c]), ("held-out", ho[:c])], lex, bm25_q, True, name == "lme")
    d = results["lme"][DEFAULT]["cost"]["test_min"]
    calib = a.default_test_s / 60 / d if d else None
    for name, title in (("locomo", "LoCoMo (dev = conv-26, held-out = conv-30)"),
                        ("lme", "LongMemEval_S train348 (dev = even, held-out = odd positions)")):
        show(title, list(CANDIDATES), results[name], ["dev", "held-out"], calib)
        c = results[name + " costly"]
        show(title + f": candidates that embed every turn window ({c[DEFAULT]['dev']['questions']} + "
             f"{c[DEFAULT]['held-out']['questions']} q)", list(c), c, ["dev", "held-out"], calib)
    print("\nLexical order, recall_any@K (what a dense leg over the lexical top K can reach): " + "; ".join(
        f"{n} {p}: " + ", ".join(f"@{k.split('@')[1]} {v:.3f}" for k, v in results[n]["lexical"]["gold_depth"][p].items())
        for n in ("locomo", "lme") for p in ("dev", "held-out")))
    print("\n" + "\n".join(f"- {m}: {w}" for m, w in {**CANDIDATES, **COSTLY}.items()))
    rate = len(secs) / max(sum(secs.values()), 1e-9)
    print(f"\nembedded in this run: {len(secs):,} texts, {sum(secs.values()) / 60:.1f} min ({rate:.1f} texts/s); "
          f"store reused from a previous run: {a.reuse_store}; load average now {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores (a loaded machine inflates every time alike; the calibrated column scales "
          f"them so that the old default takes its measured {a.default_test_s:.0f} s)")

    # ---- cross-validation: one fixed rule, applied on each half, read on the other
    def crit(m: str, part: str) -> float:
        return float(np.mean([(results[n][m][part]["recall_any@5"] + results[n][m][part]["ndcg@10"]) / 2
                              for n in ("locomo", "lme")]))

    within = [m for m in CANDIDATES if calib is None or results["lme"][m]["cost"]["test_min"] * calib <= a.budget_min]
    report["cross_validation"] = []
    print(f"\n### Cross-validation (rule: best mean over both datasets of (R@5 + NDCG@10) / 2 among the candidates "
          f"within {a.budget_min:g} calibrated minutes: {', '.join(within)})\n")
    for pick_on, read_on in (("dev", "held-out"), ("held-out", "dev")):
        best = max(within, key=lambda m: (crit(m, pick_on), m == DEFAULT))
        ranked = sorted(within, key=lambda m: -crit(m, pick_on))
        cells = "; ".join(f"{n} {results[n][best][read_on]['recall_any@5']:.3f} / "
                          f"{results[n][best][read_on]['ndcg@10']:.3f}" for n in ("locomo", "lme"))
        print(f"- chosen on {pick_on}: **{best}** ({crit(best, pick_on):.4f}; then "
              + ", ".join(f"{m} {crit(m, pick_on):.4f}" for m in ranked[1:4]) + f"); read on {read_on}: {cells}")
        report["cross_validation"].append({"chosen_on": pick_on, "chosen": best, "read_on": read_on,
                                           "ranking": [[m, crit(m, pick_on)] for m in ranked]})
    report.update({"tables": results, "calibration": calib, "budget_min": a.budget_min,
                   "default_test_s": a.default_test_s, "texts_per_s_all": rate, "loadavg_end": os.getloadavg(),
                   "lme_per_half": a.lme_per_half, "costly_per_half": a.costly_per_half})
    if a.stage_run:
        report["stage_run"] = stage_run(a, loaded["lme"][0], halves("lme")[1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


def stage_run(a, ds, held_out: list) -> dict:
    """The stage itself, end to end (Ray start, model load, BM25, embedding, writing), old default then
    new, each with a fresh store, on the same held-out LongMemEval questions; wall seconds measured
    back to back, so their ratio holds on a loaded machine."""
    from memsifter.store import storage
    from memsifter.data.model import Dataset

    qs = held_out[:a.stage_run]
    used = {s for q in qs for s in q.haystack_session_ids}
    sub = os.path.join(a.out, f"lme-heldout-{len(qs)}")
    if not os.path.exists(os.path.join(sub, "_SUCCESS")):
        pub = storage.Publication(sub, "import", {}, "subset", "bench")
        Dataset({k: v for k, v in ds.sessions.items() if k in used}, qs).write(pub)
        pub.publish({})
    out = {}
    print(f"\n### `memsifter run embed` end to end, {len(qs)} held-out LongMemEval questions ({len(used):,} "
          f"sessions), fresh store each\n")
    print("| run | primary | recall_any@5 / NDCG@10 | wall s | texts embedded | texts/s (stage) | LME test min: "
          "wall scaled by sessions | calibrated (x old default's 94 s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, flags in (("old default (--no-zsum)", ["--no-zsum"]), ("new default", [])):
        dst = os.path.join(a.out, "stage-" + label.split()[0])
        shutil.rmtree(dst, ignore_errors=True)
        store = os.path.join(a.out, f"stage-store-{label.split()[0]}-{int(time.time())}")
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "embed", "--input", sub, "--output", dst,
                        "--model", "all-MiniLM-L6-v2", "--store", store, "-q", *flags], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.time() - t0
        shutil.rmtree(store, ignore_errors=True)
        st = storage.read_manifest(dst)["stats"]
        r = st["retrieval"][st["primary"]]
        out[label] = {"primary": st["primary"], "wall_s": wall, "embedded": st["embedded"],
                      "texts_per_second": st.get("texts_per_second"), "recall_any@5": r["recall_any@5"],
                      "ndcg@10": r["ndcg@10"], "test_min": wall / len(used) * TEST_SESSIONS / 60}
    base = out["old default (--no-zsum)"]["wall_s"]
    for label, o in out.items():
        o["calibrated_min"] = a.default_test_s * o["wall_s"] / base / 60
        print(f"| {label} | {o['primary']} | {o['recall_any@5']:.3f} / {o['ndcg@10']:.3f} | {o['wall_s']:.0f} | "
              f"{o['embedded']:,} | {o['texts_per_second']} | {o['test_min']:.1f} | {o['calibrated_min']:.1f} |",
              flush=True)
    return out


if __name__ == "__main__":
    main()
