"""rank: token-budgeted pre-filter, prompt files, real vLLM generation (Ray Data LLM and a served
endpoint), parsing, fallback to the embedding order, raw responses kept."""

from __future__ import annotations

import os

import pytest

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.retrieval.context import TokenCounter, load_tokenizer
from memsifter.data.model import read_dataset
from memsifter.retrieval.render import render_session
from memsifter.stage import get_stage
from memsifter.testing.faults import InjectedCrash
from memsifter.retrieval.prompting import default_prompt
from memsifter.stages.rank import RankConfig, build_prompt, ranking_regex


@pytest.fixture(scope="module")
def synth_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rankdata")
    data = str(root / "data")
    get_stage("synth").run({"output": data, "questions": 6, "sessions_per_question": 8, "seed": 1})
    ds = read_dataset(data)
    # An "embedding" order that is not chronological: reversed haystack (the stage only reads rankings).
    emb = str(root / "embed")
    pub = storage.Publication(emb, "embed", {}, "fake", "test")
    rankings.write_rankings(pub, [{
        "question_id": q.question_id, "ranked_session_ids": list(reversed(q.haystack_session_ids)),
        "scores": [1.0 - i / 10 for i in range(len(q.haystack_session_ids))], "method": "embed:dense",
        "status": "ok", "reason": None, "raw_response": None} for q in ds.questions])
    pub.publish({})
    return data, emb, ds


def test_prefilter_budget_order_and_cache(synth_data, tiny_model_dir):
    data, emb, ds = synth_data
    q = ds.questions[0]
    tok = load_tokenizer(tiny_model_dir)
    counter = TokenCounter(tok)
    texts = [render_session(ds.sessions[s].turns) for s in q.haystack_session_ids]
    sizes = counter.count_many(texts)
    template = default_prompt("ranker.txt")
    empty = counter.chat_prompt_tokens([{"role": "user", "content": template.replace("{history}", "")
                                         .replace("{current}", q.question)}])
    limit = empty + sum(sorted(sizes)[:1]) + int(sum(sizes) * 0.45)
    cfg = RankConfig(output="x", input=data, embeddings=emb, model=tiny_model_dir, context_limit=limit,
                     vllm={"max_model_len": limit + 16384})
    emb_row = {"ranked_session_ids": list(reversed(q.haystack_session_ids))}
    p = build_prompt(cfg, ds, q, emb_row, counter, template)
    assert p.prompt_tokens <= limit and 0 < len(p.id_map) < len(q.haystack_session_ids)
    # taken by similarity (here: the newest first), stopping at the first that does not fit ...
    k = len(p.id_map)
    assert set(p.id_map) == set(emb_row["ranked_session_ids"][:k])
    # ... then shown chronologically with local ids 0..n-1
    assert p.id_map == [s for s in q.haystack_session_ids if s in set(p.id_map)]
    content = p.messages[0]["content"]
    assert q.question in content and "{history}" not in content and "{current}" not in content
    for i, sid in enumerate(p.id_map):
        assert f"<session{i}> <date>" in content
        assert render_session(ds.sessions[sid].turns) in content
    assert f"<session{k}>" not in content
    hits = counter.hits
    build_prompt(cfg, ds, q, emb_row, counter, template)
    assert counter.hits > hits  # session token counts come from the cache the second time
    # nothing fits: recorded, no generation needed
    tiny = RankConfig(output="x", input=data, embeddings=emb, model=tiny_model_dir, context_limit=empty + 1,
                      vllm={"max_model_len": 20000})
    p0 = build_prompt(tiny, ds, q, emb_row, counter, template)
    assert p0.id_map == [] and "no session fits" in p0.skipped


def test_history_order_first_stage_lists_the_most_similar_first(synth_data, tiny_model_dir):
    """history_order first_stage: the same sessions are shown, listed in the first stage's order, and
    local ids map back through that list (what a ranker trained on such rows is served with)."""
    data, emb, ds = synth_data
    q = ds.questions[1]
    counter = TokenCounter(load_tokenizer(tiny_model_dir))
    template = default_prompt("ranker.txt")
    sim = list(reversed(q.haystack_session_ids))
    sim = sim[2:] + sim[:2]  # neither chronological nor its reverse
    row = {"ranked_session_ids": sim}
    kw = dict(output="x", input=data, embeddings=emb, model=tiny_model_dir, context_limit=20000,
              vllm={"max_model_len": 40000})
    chrono = build_prompt(RankConfig(**kw), ds, q, row, counter, template)
    first = build_prompt(RankConfig(**kw, history_order="first_stage"), ds, q, row, counter, template)
    assert set(first.id_map) == set(chrono.id_map) == set(q.haystack_session_ids)
    assert chrono.id_map == q.haystack_session_ids and first.id_map == sim
    content = first.messages[0]["content"]
    at = [content.index(render_session(ds.sessions[s].turns)) for s in first.id_map]
    assert at == sorted(at)  # listed in that order, session0 = the most similar
    assert rankings.to_original([0, 1], first.id_map) == sim[:2]


def test_prompt_file_is_replaceable(synth_data, tiny_model_dir, tmp_path):
    data, emb, ds = synth_data
    bad = tmp_path / "bad.txt"
    bad.write_text("no slots here {history}")
    with pytest.raises(Exception, match="current"):
        get_stage("rank").run({"output": str(tmp_path / "r"), "input": data, "embeddings": emb,
                               "model": tiny_model_dir, "prompt": str(bad), "context_limit": 2000,
                               "max_tokens": 8, "vllm": {"max_model_len": 4096}})
    assert not storage.exists(str(tmp_path / "r" / "_SUCCESS"))


def _check_rows(rows, ds, emb_uri):
    emb_order = {r["question_id"]: r["ranked_session_ids"] for r in rankings.read_rankings(emb_uri)}
    assert sorted(r["question_id"] for r in rows) == sorted(q.question_id for q in ds.questions)
    for r in rows:
        q = ds.question(r["question_id"])
        assert sorted(r["ranked_session_ids"]) == sorted(q.haystack_session_ids)  # a full ranking
        assert r["status"] in ("ok", "fallback", "error")
        assert r["raw_response"] is not None or r["status"] == "error"
        if r["status"] != "ok":
            assert r["reason"] and r["ranked_session_ids"] == emb_order[r["question_id"]]


def test_rank_endpoint_ok_path_and_resume(synth_data, tiny_model_dir, vllm_endpoint, tmp_path, monkeypatch):
    """The served engine with constrained output: every answer parses, so rows are 'ok' and their
    heads come from the ranker; an injected crash after one batch resumes without redoing it."""
    data, emb, ds = synth_data
    out = str(tmp_path / "rank")
    cfg = {"output": out, "input": data, "embeddings": emb, "model": tiny_model_dir, "engine": "endpoint",
           "endpoint": {"base_url": vllm_endpoint, "model": "tiny"}, "constrained_output": True,
           "context_limit": 3000, "max_tokens": 40, "shard_size": 2, "top_k": 3}
    monkeypatch.setenv("MEMSIFTER_CRASH_AFTER", "rank:1")
    with pytest.raises(InjectedCrash):
        get_stage("rank").run(cfg)
    assert not storage.exists(os.path.join(out, "_SUCCESS"))
    monkeypatch.delenv("MEMSIFTER_CRASH_AFTER")
    m = get_stage("rank").run(cfg)
    st = m["stats"]
    assert st["resumed"] == 2 and st["generated"] == len(ds.questions) - 2
    rows = rankings.read_rankings(out)
    _check_rows(rows, ds, emb)
    assert st["status"]["ok"] == len(ds.questions)
    details = {d["question_id"]: d for d in storage.read_parquet(os.path.join(out, "prompts.parquet")).to_pylist()}
    for r in rows:
        parsed = rankings.parse_ranking(r["raw_response"], len(details[r["question_id"]]["shown_session_ids"]))
        assert parsed.ok
        head = [details[r["question_id"]]["shown_session_ids"][i] for i in parsed.ids[:3]]
        assert r["ranked_session_ids"][:len(head)] == head
    # re-running the same config is a no-op
    assert get_stage("rank").run(cfg).get("skipped")


def test_ranking_regex_shape():
    import re

    rx = re.compile(ranking_regex(12, 10))
    assert rx.fullmatch("<ranking>11, 0, 3</ranking>")
    assert not rx.fullmatch("<ranking>12</ranking>")
    assert not rx.fullmatch("<ranking>" + ", ".join(["1"] * 11) + "</ranking>")


def test_result_row_statuses():
    from memsifter.stages.rank import Prompted, result_row

    cfg = RankConfig(output="x", input="d", embeddings="e", model="m", context_limit=100, max_tokens=10,
                     vllm={"max_model_len": 200}, top_k=2)
    p = Prompted("q", [], id_map=["s2", "s0", "s1"], fallback=["s1", "s0", "s2", "s3"])
    ok = result_row(cfg, p, {"text": "<think>a</think><ranking>session2, 0, 1</ranking>", "error": None}, "rank:m")
    assert ok["status"] == "ok" and ok["ranked_session_ids"] == ["s1", "s2", "s0", "s3"]
    bad = result_row(cfg, p, {"text": "I refuse", "error": None}, "rank:m")
    assert bad["status"] == "fallback" and bad["ranked_session_ids"] == p.fallback
    assert bad["raw_response"] == "I refuse" and bad["reason"].startswith("parse:")
    err = result_row(cfg, p, {"text": None, "error": "APIConnectionError"}, "rank:m")
    assert err["status"] == "error" and "APIConnectionError" in err["reason"] and err["ranked_session_ids"] == p.fallback
    assert result_row(cfg, p, None, "rank:m")["status"] == "error"
    skipped = Prompted("q", [], [], ["s0"], skipped="no session fits")
    assert result_row(cfg, skipped, None, "rank:m")["status"] == "fallback"
    strict = cfg.model_copy(update={"require_k": True, "top_k": 3})
    assert result_row(strict, p, {"text": "<ranking>1</ranking>", "error": None}, "m")["status"] == "fallback"


def test_sampling_params_ignore_eos_and_engine_env(monkeypatch):
    from memsifter.stages.rank import sampling_params
    from memsifter.models.vllm_env import engine_env

    base = dict(output="x", input="d", embeddings="e", model="m", context_limit=100, max_tokens=10,
                vllm={"max_model_len": 200})
    assert "ignore_eos" not in sampling_params(RankConfig(**base))
    assert sampling_params(RankConfig(**base, ignore_eos=True))["ignore_eos"] is True
    # found on the GPU run: vLLM's sampler imports FlashInfer unless told not to
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a))
    assert engine_env() == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")  # the user's choice stands
    assert engine_env() == {}
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flashinfer" else real(n, *a))
    assert engine_env() == {}


def test_limit_ranks_only_the_first_questions(synth_data, tiny_model_dir, tmp_path, monkeypatch):
    """``limit``: the stage body with the generator replaced (a stand-in for vLLM; the real engine is
    exercised in test_rank_vllm_ray_data_llm)."""
    from memsifter.stages import rank

    data, emb, ds = synth_data
    seen = []

    def fake_generate(config, todo):
        seen.extend(p.question_id for p in todo)
        for p in todo:
            yield {"question_id": p.question_id, "text": "<ranking>0</ranking>", "error": None,
                   "prompt_tokens": 7, "generated_tokens": 3}

    monkeypatch.setattr(rank, "generate_vllm", fake_generate)
    out = str(tmp_path / "rank-limit")
    m = get_stage("rank").run({"output": out, "input": data, "embeddings": emb, "model": tiny_model_dir,
                               "context_limit": 1500, "max_tokens": 8, "limit": 2,
                               "vllm": {"max_model_len": 2048}})
    assert seen == [q.question_id for q in ds.questions[:2]]
    assert [r["question_id"] for r in rankings.read_rankings(out)] == seen
    assert m["stats"]["engine_tokens"] == {"prompt_tokens": 14, "generated_tokens": 6}
    assert m["stats"]["status"]["ok"] == 2


def test_engine_window_spans_earliest_start_to_last_arrival():
    from memsifter.stages.rank import EngineWindow

    now = iter([100.0, 104.0, 110.0, 111.0])
    w = EngineWindow(clock=lambda: next(now))
    assert w.seconds is None
    w.add(None)          # a row without a time (an error row) does not move the window
    w.add(30.0)          # arrived at 100 after 30 s in its batch: started at 70
    w.add(2.0)           # arrived at 104, started at 102
    w.add(45.0)          # arrived at 110, started at 65: the earliest start
    assert w.seconds == 110.0 - 65.0


# --------------------------------------------------------------------------- fitting the model (issue 16)
def test_fit_lengths_from_the_models_context():
    from memsifter.errors import ConfigError
    from memsifter.stages.rank import fit_lengths

    base = dict(output="x", input="d", embeddings="e", model="m")
    # MemSifter's defaults on a 262k model: 16,384 new tokens, engine context = prompt + answer
    assert fit_lengths(RankConfig(**base), 262144) == (16384, 131072 + 16384)
    # an 8k model: thinking answers get what the context leaves; direct answers 8 per id + 16
    assert fit_lengths(RankConfig(**base, context_limit=3000), 8192) == (5192, 8192)
    assert fit_lengths(RankConfig(**base, context_limit=3000), 8192, "direct") == (96, 3096)
    assert fit_lengths(RankConfig(**base, context_limit=3000, top_k=5), 8192, "direct") == (56, 3056)
    # unknown model context (a hub id offline): the config's numbers, unchecked
    assert fit_lengths(RankConfig(**base), None) == (16384, 147456)
    with pytest.raises(ConfigError, match=r"context_limit = 131072 tokens does not fit the model's context of 8192"):
        fit_lengths(RankConfig(**base), 8192)
    with pytest.raises(ConfigError, match=r"3000 \+ 6000 = 9000 tokens exceeds the model's context of 8192"):
        fit_lengths(RankConfig(**base, context_limit=3000, max_tokens=6000), 8192)
    with pytest.raises(ConfigError, match="vllm.max_model_len = 9000 exceeds"):
        fit_lengths(RankConfig(**base, context_limit=3000, max_tokens=100, vllm={"max_model_len": 9000}), 8192)


def test_prompt_style_follows_the_tokenizer(tiny_model_dir):
    from memsifter.retrieval.prompting import RANKER_PROMPTS as PROMPTS
    from memsifter.stages.rank import resolve_style

    cfg = RankConfig(output="x", input="d", embeddings="e")
    assert resolve_style(cfg, load_tokenizer(tiny_model_dir)) == "thinking"  # knows <think>

    class Plain:
        def get_vocab(self):
            return {"a": 0, "<ranking>": 1}
    assert resolve_style(cfg, Plain()) == "direct"
    assert resolve_style(cfg.model_copy(update={"prompt_style": "thinking"}), Plain()) == "thinking"
    for name in PROMPTS.values():
        text = default_prompt(name)
        assert "{history}" in text and "{current}" in text and "<ranking>" in text


def test_condensed_sessions_keep_the_question_turns_in_order():
    from memsifter.retrieval.render import condense_session

    turns = [{"role": "user", "content": f"filler sentence number {i} about nothing much"} for i in range(12)]
    turns[7] = {"role": "user", "content": "my sister Anna adopted a beagle called Rufus"}
    turns[3] = {"role": "assistant", "content": "a beagle is a friendly dog"}

    def count(texts):
        return [len(t.split()) for t in texts]
    whole = render_session(turns)
    assert condense_session(turns, "What dog did Anna adopt?", 10_000, count) == whole
    short = condense_session(turns, "What dog did Anna adopt?", 20, count)
    assert "<user6>my sister Anna adopted a beagle called Rufus</user>" in short  # original counter kept
    assert short.index("beagle is a friendly") < short.index("Anna adopted")  # original order
    assert sum(count(short.splitlines(keepends=True))) <= 20
    lines = short.splitlines()
    assert set(lines) <= set(whole.splitlines())


def test_context_limit_beyond_the_model_is_one_line(synth_data, tmp_path):
    """`memsifter run rank --model smollm2 --context-limit 9000`: exit 2, one line naming the field
    and both numbers, nothing published (the SmolLM2 of memsifter.models.registry, from PyPI)."""
    import subprocess
    import sys

    from memsifter.models import registry as models
    from memsifter.errors import ConfigError

    try:
        models.resolve("smollm2")
    except ConfigError as e:
        pytest.skip(str(e))
    data, emb, ds = synth_data
    out = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "rank", "--input", data, "--embeddings", emb,
                           "--output", str(out), "--model", "smollm2", "--context-limit", "9000", "-q"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "context_limit = 9000" in err[0] and "8192" in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (out / "_SUCCESS").exists()


@pytest.mark.slow
def test_rank_smollm2_on_cpu_through_ray_data_llm(synth_data, tmp_path):
    """The issue's command: `memsifter run rank --model smollm2-135m-instruct --context-limit 3000
    --limit 2` through Ray Data LLM on the CPU, with no vllm.* setting: the engine context and the
    answer length derive from the model (8,192 tokens) and the direct prompt; every row keeps the
    model's own text, ok or fallback (a fallback row: the embedding order and its reason). With
    --ignore-eos and --shard-size 1 the same run also shows that ignore_eos reaches vLLM (exactly
    max_tokens per answer, as the engine counted) and that results are saved answer by answer under
    _work (crash-resume). One engine start serves both (each costs minutes on 2 cores)."""
    import subprocess
    import sys

    from memsifter.models import registry as models
    from memsifter.errors import ConfigError

    try:
        models.resolve("smollm2")
    except ConfigError as e:
        pytest.skip(str(e))
    data, emb, ds = synth_data
    out = str(tmp_path / "rank")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    proc = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "rank", "--input", data, "--embeddings", emb,
                           "--output", out, "--model", "smollm2-135m-instruct", "--context-limit", "3000",
                           "--limit", "2", "--ignore-eos", "--shard-size", "1", "-q"],
                          capture_output=True, text=True, timeout=800, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # -q: no Ray Data advice on the terminal ("Operator ... uses 454.0MiB of memory per task", every 30 s)
    assert "of memory per" not in proc.stderr and "high_memory_detector" not in proc.stderr
    st = storage.read_manifest(out)["stats"]
    assert st["prompt_style"] == "direct" and st["max_tokens"] == 96 and st["max_model_len"] == 3096
    assert st["method"] == "rank:smollm2-135m-instruct"
    rows = rankings.read_rankings(out)
    ds.questions = ds.questions[:2]
    _check_rows(rows, ds, emb)
    assert all(r["raw_response"] for r in rows), rows   # every question got a real generation
    assert all(r["status"] in ("ok", "fallback") for r in rows)
    assert all(r["method"].startswith("rank:") for r in rows)
    assert st["generated"] == 2 and sum(st["status"].values()) == 2
    assert st["engine_tokens"]["generated_tokens"] == 96 * 2
    details = storage.read_parquet(storage.join(out, "prompts.parquet")).to_pylist()
    assert st["engine_tokens"]["prompt_tokens"] == sum(d["prompt_tokens"] for d in details)
    assert all(0 < d["prompt_tokens"] <= 3000 for d in details)
    # the engines' busy window comes from Ray Data LLM's per-row time_taken_llm: present, and shorter
    # than the pipeline's wall time, which also starts the engine
    assert 0 < st["seconds"]["engine_busy"] < st["seconds"]["generation"]
    parts = [f for f in storage.list_files(storage.join(out, "_work")) if f.endswith(".parquet")]
    assert len(parts) >= 2


def test_s3_models_for_rank_and_embed(synth_data, tiny_model_dir, vllm_endpoint, s3_root, tmp_path, monkeypatch):
    """Issue 19: `s3://` model URIs work for rank (the driver fetches only tokenizer and config; the
    served or Ray Data LLM engine loads the weights) and for embed (fetched into the model cache of the
    node that loads it), from the real SeaweedFS, like train's."""
    from memsifter.models import embedding, registry as models

    monkeypatch.setenv("MEMSIFTER_MODEL_CACHE", str(tmp_path / "cache"))
    uri = storage.join(s3_root, "models", "tiny")
    for root, _, names in os.walk(tiny_model_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), tiny_model_dir)
            storage.copy_file(os.path.join(root, n), storage.join(uri, rel))
    small = models.fetch_s3(uri, weights=False)
    assert os.path.isfile(os.path.join(small, "tokenizer.json")) and not os.path.exists(
        os.path.join(small, "model.safetensors"))
    full = embedding.resolve_model(uri)
    assert os.path.isfile(os.path.join(full, "model.safetensors")) and models.fetch_s3(uri) == full
    data, emb, ds = synth_data
    out = str(tmp_path / "rank")
    m = get_stage("rank").run({"output": out, "input": data, "embeddings": emb, "model": uri, "engine": "endpoint",
                               "endpoint": {"base_url": vllm_endpoint, "model": "tiny"}, "constrained_output": True,
                               "context_limit": 1500, "max_tokens": 24, "top_k": 3, "limit": 2})
    assert m["stats"]["status"]["ok"] == 2 and m["stats"]["model"] == uri


def test_long_contexts_get_the_measured_prefill_chunk_on_gpu():
    """vllm.max_num_batched_tokens defaults to 16,384 on GPU at >= 64k-token contexts (measured 1.04x
    vLLM's 2,048 at ~114k), stays vLLM's below and on CPU, and a user's value always wins."""
    from memsifter.stages.rank import LONG_PREFILL_CHUNK, RankConfig, engine_kwargs

    def kw(max_model_len, on_gpu=True, **v):
        cfg = RankConfig(input="x", embeddings="y", output="z", model="m",
                         vllm={"max_model_len": max_model_len, **v})
        return engine_kwargs(cfg, on_gpu=on_gpu).get("max_num_batched_tokens")

    assert kw(140000) == LONG_PREFILL_CHUNK == 16384
    assert kw(65536) == 16384 and kw(32768) is None and kw(140000, on_gpu=False) is None
    assert kw(140000, max_num_batched_tokens=4096) == 4096


def test_engine_batches_spread_over_every_replica():
    """Measured on 2 H100s (benchmarks/gpu/results/2026-11-26-h100x2-multigpu): 64 prompts sent as one
    batch of 64 to 2 replicas ran on one of them (1.01x of one engine). Batches are cut so that every
    replica gets work, and never above the configured size."""
    from memsifter.stages.rank import engine_batch

    assert engine_batch(64, 64, 2) == 32
    assert engine_batch(8, 64, 2) == 8
    assert engine_batch(64, 3, 4) == 1
    assert engine_batch(16, 0, 2) == 1
    assert engine_batch(10, 25, 1) == 10
