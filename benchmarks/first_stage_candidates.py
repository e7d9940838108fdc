#!/usr/bin/env python3
"""The candidates behind the embed stage's former ``fusion`` default (issue 9): dev / held-out halves.

Superseded (issue 16): ``fusion`` overfit the two shipped conversations and embeds every turn (hours on
LongMemEval_S test on 2 cores). The current default, ``zsum`` (issue 34; issue 16's ``cascade`` before it),
and its candidates with their costs are measured by ``benchmarks/bench_first_stage.py`` on LoCoMo conv-26
/ conv-30 and LongMemEval_S train348 halves. This script is kept, unchanged in what it computes, as the
record of issue 9.

Exploration script kept for the record (benchmarks/README.md, "bench_first_stage.py"): imports the two
shipped samples, embeds every turn unit and question once with all-MiniLM-L6-v2 (float32 CPU, the
stage's Embedder and batches; vectors cached in ``<out>/vecs.pkl``), then scores each candidate first
stage on all questions, the dev half and the held-out half (LoCoMo conv-26 / conv-30; LongMemEval dev30
questions at even / odd positions in id order). recall_any@5 / NDCG@10, categories 1-4, no abstention.

    python benchmarks/first_stage_candidates.py --out runs/first-stage-candidates
"""
import argparse
import os
import pickle
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["MEMSIFTER_EMBED_CPU_BF16"] = "0"
import bm25s  # noqa: E402
from bm25s.stopwords import STOPWORDS_EN  # noqa: E402

from memsifter.models import embedding
from memsifter.retrieval import rankings
from memsifter import samples  # noqa: E402
from memsifter.data.model import read_dataset  # noqa: E402
from memsifter.retrieval.metrics import mean_metrics  # noqa: E402
from memsifter.retrieval.render import render_session  # noqa: E402
from memsifter.stage import get_stage  # noqa: E402
from memsifter.stages.embed import bm25_tokens, order_by, rrf  # noqa: E402
from memsifter.stages.embed import turn_units as _units  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=os.path.join(ROOT, "runs", "first-stage-candidates"))
OUT = ap.parse_args().out


def turn_units(turns):
    return _units(turns, 200)


for name, fmt, s in (("locomo", "locomo", samples.LOCOMO), ("lme", "longmemeval", samples.LONGMEMEVAL)):
    if not os.path.exists(os.path.join(OUT, name, "_SUCCESS")):
        get_stage("import").run({"output": os.path.join(OUT, name), "format": fmt, "source": samples.path(s)})
vec_path = os.path.join(OUT, "vecs.pkl")
if not os.path.exists(vec_path):
    texts = set()
    for name in ("locomo", "lme"):
        ds = read_dataset(os.path.join(OUT, name))
        for sid in {x for q in ds.questions for x in q.haystack_session_ids}:
            texts.update(turn_units(ds.sessions[sid].turns))
        texts.update(q.question for q in ds.questions)
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    emb = embedding.Embedder(spec, "cpu")
    items = sorted((embedding.text_hash(t), t) for t in texts)
    vecs = {}
    progress = embedding.Progress(len(items), desc="candidates")
    for b in embedding.plan_batches(items, spec.max_length):
        for (h, _), x in zip(b, emb.encode([t for _, t in b])):
            vecs[h] = x
        progress.update(len(b))
    progress.close()
    with open(vec_path, "wb") as f:
        pickle.dump(vecs, f)
with open(vec_path, "rb") as f:
    V = pickle.load(f)
stop = frozenset(STOPWORDS_EN)
def vec(t): return V[embedding.text_hash(t)]
def bm25_scores(docs, q):
    r = bm25s.BM25(); r.index([d or ["<empty>"] for d in docs], show_progress=False)
    qt = [w for w in bm25_tokens(q, stop) if w in r.vocab_dict]
    return np.asarray(r.get_scores(qt), float) if qt else np.zeros(len(docs))
for name in ("locomo", "lme"):
    ds = read_dataset(os.path.join(OUT, name))
    qs = [q for q in ds.questions if q.question_type != "adversarial" and rankings.eligible(q)]
    res = {}
    for q in qs:
        hay = q.haystack_session_ids
        units = [turn_units(ds.sessions[s].turns) for s in hay]
        qv = vec(q.question)
        S = {}
        tsims = [np.array([vec(u) @ qv for u in us]) for us in units]
        S["turn_max"] = np.array([t.max() for t in tsims])
        S["turn_top2"] = np.array([np.sort(t)[-2:].mean() if len(t)>1 else t.max() for t in tsims])
        S["bm25"] = bm25_scores([bm25_tokens(render_session(ds.sessions[s].turns), stop) for s in hay], q.question)
        dated = [bm25_tokens(f"{q.date_of(s, ds.sessions) or ''}\n" + "\n".join(us), stop) for s, us in zip(hay, units)]
        S["bm25_named"] = bm25_scores(dated, q.question)
        # bm25 over turns, max per session
        flat, owner = [], []
        for i, us in enumerate(units):
            for u in us: flat.append(bm25_tokens(u, stop)); owner.append(i)
        ts = bm25_scores(flat, q.question)
        bt = np.full(len(hay), -1e9)
        for i, s_ in zip(owner, ts): bt[i] = max(bt[i], s_)
        S["bm25_turn_max"] = bt
        # bm25 over windows of 3 turns (±1) with date+names
        flat, owner = [], []
        for i, (s0, us) in enumerate(zip(hay, units)):
            d = q.date_of(s0, ds.sessions) or ""
            for j in range(len(us)): flat.append(bm25_tokens(d + " " + " ".join(us[max(0,j-1):j+2]), stop)); owner.append(i)
        ts = bm25_scores(flat, q.question)
        bw = np.full(len(hay), -1e9)
        for i, s_ in zip(owner, ts): bw[i] = max(bw[i], s_)
        S["bm25_win3"] = bw
        n = len(hay)
        O = {k: order_by(v) for k, v in S.items()}
        S["rrf(turn_max,bm25)"] = rrf([O["turn_max"], O["bm25"]], n, 60)
        S["rrf(turn_max,bm25_named)"] = rrf([O["turn_max"], O["bm25_named"]], n, 60)
        S["rrf(turn_max,bm25,bm25_turn)"] = rrf([O["turn_max"], O["bm25"], O["bm25_turn_max"]], n, 60)
        S["rrf(turn_max,bm25_named,bm25_turn)"] = rrf([O["turn_max"], O["bm25_named"], O["bm25_turn_max"]], n, 60)
        S["rrf(turn_max,turn_top2,bm25_named)"] = rrf([O["turn_max"], O["turn_top2"], O["bm25_named"]], n, 60)
        S["rrf(turn_max,bm25_named,bm25_win3)"] = rrf([O["turn_max"], O["bm25_named"], order_by(S["bm25_win3"])], n, 60)
        S["rrf(turn_max,bm25_named,bm25_turn,bm25_win3)"] = rrf([O["turn_max"], O["bm25_named"], O["bm25_turn_max"], order_by(S["bm25_win3"])], n, 60)
        S["rrf(turn_max,bm25_named,bm25_turn)k20"] = rrf([O["turn_max"], O["bm25_named"], O["bm25_turn_max"]], n, 20)
        for k, v in S.items():
            row = {"question_id": q.question_id, "status": "ok", "ranked_session_ids": [hay[i] for i in order_by(v)]}
            res.setdefault(k, []).append(row)
    # halves: A = first half of questions by id order (locomo: conv-26 vs conv-30)
    if name == "locomo":
        split = lambda q: q.question_id.startswith("conv-26")
    else:
        ids = sorted(q.question_id for q in qs); half = set(ids[::2]); split = lambda q: q.question_id in half
    print(f"\n## {name} ({len(qs)} q)  all | dev-half | held-out half")
    for k, rows in res.items():
        pq = rankings.per_question_metrics(rows, qs)
        def m(sel):
            ms = mean_metrics([pq[q.question_id] for q in qs if sel(q)])
            return f"{ms['recall_any@5']:.3f}/{ms['ndcg@10']:.3f}"
        print(f"{k:40s} {m(lambda q: True)} | {m(split)} | {m(lambda q: not split(q))}")
