"""prepare-rl: verl RL parquet from datasets and a recipe (MEMSIFTER.md §6)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import read_dataset
from memsifter.errors import ConfigError, InputError
from memsifter.retrieval.render import render_session
from memsifter.stage import get_stage
from memsifter.stages.prepare_rl import anchor_priority, ground_truth, read_rows, shard_sizes


@pytest.fixture(scope="module")
def synth_local(tmp_path_factory):
    """12 synthetic questions, 10 sessions each (1 gold), published locally."""
    uri = str(tmp_path_factory.mktemp("synth") / "ds")
    get_stage("synth").run({"output": uri, "questions": 12, "sessions_per_question": 10, "seed": 3})
    return uri


def _dataset_at(store_root: str, local_uri: str) -> str:
    if not storage.is_s3(store_root):
        return local_uri
    uri = storage.join(store_root, "ds")
    storage.upload_dir(local_uri, uri)
    return uri


def test_shard_sizes_have_no_tiny_trailing_shard():
    assert shard_sizes(0, 2000) == []
    assert shard_sizes(2000, 2000) == [2000]
    assert shard_sizes(2001, 2000) == [1001, 1000]
    assert shard_sizes(4500, 2000) == [1500, 1500, 1500]
    assert shard_sizes(8, 3) == [3, 3, 2]
    assert all(max(shard_sizes(n, 7)) <= 7 and min(shard_sizes(n, 7)) >= 7 // 2 for n in range(8, 200))


def test_prepare_rl_rows(store_root, synth_local, tiny_model_dir):
    ds_uri = _dataset_at(store_root, synth_local)
    out = storage.join(store_root, "rl")
    m = get_stage("prepare-rl").run({
        "output": out, "datasets": [ds_uri], "tokenizer": tiny_model_dir, "shard_rows": 3, "seed": 7,
        "recipe": {"train": {"synth": 8}, "test": {"synth": 3}}})
    st = m["stats"]
    assert st["rows"] == {"train": 8, "test": 3}
    assert st["rows_by_dataset"] == {"train": {"synth": 8}, "test": {"synth": 3}}
    assert st["files"] == {"train": ["train_00000.parquet", "train_00001.parquet", "train_00002.parquet"],
                           "test": ["test.parquet"]}
    assert [m["files"][f]["rows"] for f in st["files"]["train"]] == [3, 3, 2]
    assert st["sampling"] == {"synth": "random"} and st["order_source"] == {"haystack": 11}

    ds = read_dataset(ds_uri)
    train, test = read_rows(out, "train"), read_rows(out, "test")
    ids = [r["extra_info"]["question_id"] for r in train + test]
    assert len(set(ids)) == 11  # no question in two splits
    held = {ds.sessions[s].content_hash for i in set(ids[len(train):]) for s in ds.question(i).haystack_session_ids}
    for r in train + test:
        q = ds.question(r["extra_info"]["question_id"])
        if r in train:   # the held-out split's session texts are cut from the training haystacks (memsifter.data.splits)
            keep = [i for i, s in enumerate(q.haystack_session_ids) if ds.sessions[s].content_hash not in held]
            q.haystack_session_ids = [q.haystack_session_ids[i] for i in keep]
            q.haystack_dates = [q.haystack_dates[i] for i in keep]
        ei = r["extra_info"]
        assert r["data_source"] == "memsifter_synth" and r["ability"] == "memory_ranking"
        assert r["reward_model"]["style"] == "rule"
        gold, n = ground_truth(r)
        # the default 130k budget holds every session of this small haystack, in chronological order
        assert ei["session_ids"] == q.haystack_session_ids and n == len(q.haystack_session_ids) == ei["n_sessions"]
        assert [ei["session_ids"][g] for g in gold] == q.gold_session_ids == [ei["session_ids"][g] for g in ei["gold_local"]]
        assert ei["question"] == q.question and ei["answer"] == q.answer and ei["question_date"] == q.question_date
        assert ei["sessions"] == [render_session(ds.sessions[s].turns) for s in ei["session_ids"]]
        assert ei["dates"] == q.haystack_dates
        content = r["prompt"][0]["content"]
        assert r["prompt"][0]["role"] == "user" and len(r["prompt"]) == 1
        assert f"<session0> <date>{ei['dates'][0]}</date>\n{ei['sessions'][0]}</session>" in content
        assert f"<session{n - 1}> <date>" in content and f"<session{n}>" not in content
        assert q.question in content and "<ranking>" in content  # the packaged ranker template
    # same config, same output: the rows are deterministic
    again = get_stage("prepare-rl").run({
        "output": storage.join(store_root, "rl2"), "datasets": [ds_uri], "tokenizer": tiny_model_dir,
        "shard_rows": 3, "seed": 7, "recipe": {"train": {"synth": 8}, "test": {"synth": 3}}})
    assert again["files"]["train_00000.parquet"]["sha256"] == m["files"]["train_00000.parquet"]["sha256"]


def test_budget_always_keeps_gold_then_similar_sessions(tmp_path, synth_local, tiny_model_dir):
    ds = read_dataset(synth_local)
    # similarity: a rankings file putting, for each question, a known non-gold session first
    rows, favourite = [], {}
    for q in ds.questions:
        others = [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        favourite[q.question_id] = others[-1]
        order = [others[-1]] + q.gold_session_ids + others[:-1]
        rows.append({"question_id": q.question_id, "ranked_session_ids": order,
                     "scores": [1.0 - i / 100 for i in range(len(order))], "method": "embed:dense",
                     "status": "ok"})
    sims = str(tmp_path / "sims.parquet")
    pq.write_table(rankings.rankings_table(rows), sims)
    m = get_stage("prepare-rl").run({  # a 1-token budget: nothing but the gold sessions fits
        "output": str(tmp_path / "tiny"), "datasets": [synth_local], "tokenizer": tiny_model_dir,
        "recipe": {"train": {"synth": 5}}, "history_budget_tokens": 1,   # one split: no haystack is cut
        "similarities": [sims]})
    for r in read_rows(str(tmp_path / "tiny")):
        q = ds.question(r["extra_info"]["question_id"])
        assert r["extra_info"]["session_ids"] == q.gold_session_ids  # gold kept although over budget
        assert r["reward_model"]["ground_truth"] == f"0;{len(q.gold_session_ids)}"
    # a budget for roughly gold + one more session: the most similar non-gold one is the one added
    from memsifter.retrieval.context import TokenCounter, load_tokenizer

    counter = TokenCounter(load_tokenizer(tiny_model_dir))
    big = max(counter.count(render_session(s.turns)) for s in ds.sessions.values())
    m = get_stage("prepare-rl").run({
        "output": str(tmp_path / "two"), "datasets": [synth_local], "tokenizer": tiny_model_dir,
        "recipe": {"train": {"synth": 5}}, "history_budget_tokens": 2 * big + 40,
        "similarities": [sims]})
    assert m["stats"]["order_source"] == {"similarity": 5}
    for r in read_rows(str(tmp_path / "two")):
        q = ds.question(r["extra_info"]["question_id"])
        shown = r["extra_info"]["session_ids"]
        assert set(q.gold_session_ids) <= set(shown) and favourite[q.question_id] in shown
        assert shown == [s for s in q.haystack_session_ids if s in shown]  # chronological
        assert len(shown) < len(q.haystack_session_ids)


def test_history_order_first_stage_never_lists_gold_first_by_construction(tmp_path, synth_local, tiny_model_dir):
    """Gold sessions are taken first (always shown), but a first_stage row lists sessions by the first
    stage's order, not by when they were taken: the list must not give the answer away."""
    from memsifter.retrieval.context import shown_order

    assert shown_order([5, 1, 3], [3, 9, 5, 1], "first_stage") == [3, 5, 1]
    assert shown_order([5, 1, 3], [3, 9], "first_stage") == [3, 1, 5]  # unranked last, chronologically
    assert shown_order([5, 1, 3], [3, 9, 5, 1], "chronological") == [1, 3, 5]
    with pytest.raises(ValueError, match="history order"):
        shown_order([1], [1], "random")
    ds = read_dataset(synth_local)
    rows, sims_order = [], {}
    for q in ds.questions:
        others = [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        order = others[::-1] + q.gold_session_ids  # gold last in the first stage's order
        sims_order[q.question_id] = order
        rows.append({"question_id": q.question_id, "ranked_session_ids": order,
                     "scores": [1.0 - i / 100 for i in range(len(order))], "method": "embed:dense", "status": "ok"})
    sims = str(tmp_path / "sims.parquet")
    pq.write_table(rankings.rankings_table(rows), sims)
    out = str(tmp_path / "fs")
    get_stage("prepare-rl").run({"output": out, "datasets": [synth_local], "tokenizer": tiny_model_dir,
                                 "recipe": {"train": {"synth": 5}}, "similarities": [sims],   # no haystack cut
                                 "history_order": "first_stage"})
    for r in read_rows(out):
        ei = r["extra_info"]
        q = ds.question(ei["question_id"])
        assert ei["session_ids"] == sims_order[q.question_id]  # the whole haystack fits: in first-stage order
        assert ei["first_stage_local"] == list(range(ei["n_sessions"]))
        assert ei["gold_local"] == [ei["n_sessions"] - 1]  # gold listed last, where the first stage put it
        assert [q.haystack_session_ids[i] for i in ei["haystack_index"]] == ei["session_ids"]
        content = r["prompt"][0]["content"]
        assert content.index(ei["sessions"][0]) < content.index(ei["sessions"][-1])


def test_anchor_curriculum_prefers_dcg_near_0_2(tmp_path, synth_local, tiny_model_dir):
    ds = read_dataset(synth_local)
    # previous ranker: gold at rank 10 (DCG 0.289, priority 0.911), gold outside the top 10
    # (DCG 0, 0.8), gold at rank 4 (DCG 0.431, 0.769), gold at rank 1 (DCG 1, 0.2); three of each
    placement = {}
    rows = []
    for i, q in enumerate(ds.questions):
        kind = ["r10", "out", "r4", "r1"][i % 4]
        placement[q.question_id] = kind
        others = [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        gold = q.gold_session_ids[0]
        filler = (others * 3)[:12]
        filler = list(dict.fromkeys(filler)) + [f"missing-{k}" for k in range(12)]
        at = {"r10": 9, "out": 11, "r4": 3, "r1": 0}[kind]
        order = filler[:at] + [gold] + filler[at:]
        rows.append({"question_id": q.question_id, "ranked_session_ids": order, "method": "rank:old",
                     "status": "ok"})
    prev = str(tmp_path / "prev.parquet")
    pq.write_table(rankings.rankings_table(rows), prev)
    assert anchor_priority(0.2) == 1.0 and anchor_priority(1.0) == pytest.approx(0.2)
    m = get_stage("prepare-rl").run({
        "output": str(tmp_path / "rl"), "datasets": [synth_local], "tokenizer": tiny_model_dir,
        "recipe": {"train": {"synth": 3}, "test": {"synth": 3}}, "previous_rankings": [prev]})
    assert m["stats"]["sampling"] == {"synth": "anchor"}
    train = read_rows(str(tmp_path / "rl"), "train")
    test = read_rows(str(tmp_path / "rl"), "test")
    assert {placement[r["extra_info"]["question_id"]] for r in train} == {"r10"}
    assert {placement[r["extra_info"]["question_id"]] for r in test} == {"out"}
    assert all(r["extra_info"]["anchor_dcg10"] == pytest.approx(1 / __import__("math").log2(11)) for r in train)


def test_recipe_file_shortfall_and_errors(tmp_path, synth_local, tiny_model_dir):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("train:\n  synth: 10\ntest:\n  synth: 5\n")
    m = get_stage("prepare-rl").run({"output": str(tmp_path / "rl"), "datasets": [synth_local],
                                     "tokenizer": tiny_model_dir, "recipe": str(recipe)})
    assert m["config"]["recipe"] == {"train": {"synth": 10}, "test": {"synth": 5}}  # the manifest records it
    # the smaller split (test) chooses first; train takes what is left whose gold session text test does not hold
    st = m["stats"]
    assert st["rows"]["test"] == 5 and st["rows"]["train"] == 12 - 5 - st["split"]["splits"]["train"]["excluded_gold_shared"]
    assert st["shortfall"] == {"train": {"synth": 10 - st["rows"]["train"]}}
    with pytest.raises(InputError, match="no questions of dataset 'locomo'"):
        get_stage("prepare-rl").run({"output": str(tmp_path / "bad"), "datasets": [synth_local],
                                     "tokenizer": tiny_model_dir, "recipe": {"train": {"locomo": 1}}})
    with pytest.raises(ConfigError, match="non-negative integer"):
        get_stage("prepare-rl").run({"output": str(tmp_path / "bad"), "datasets": [synth_local],
                                     "tokenizer": tiny_model_dir, "recipe": {"train": {"synth": "x"}}})
    # prompts longer than verl's max_prompt_length are skipped (and replaced by other questions);
    # a requested split left with no row is an error, not a 0-row parquet (verl's loader cannot read
    # one: found on the GPU run, benchmarks/gpu/README.md)
    with pytest.raises(InputError, match=r"recipe train: no question fits: 12 over max_prompt_tokens=1"):
        get_stage("prepare-rl").run({"output": str(tmp_path / "short"), "datasets": [synth_local],
                                     "tokenizer": tiny_model_dir, "recipe": {"train": {"synth": 12}},
                                     "max_prompt_tokens": 1})
    assert not storage.exists(str(tmp_path / "short" / "_SUCCESS"))


def test_output_loads_with_verls_rlhf_dataset(tmp_path, synth_local, tiny_model_dir):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    out = str(tmp_path / "rl")
    m = get_stage("prepare-rl").run({"output": out, "datasets": [synth_local], "tokenizer": tiny_model_dir,
                                     "recipe": {"train": {"synth": 6}, "test": {"synth": 2}}, "shard_rows": 4})
    files = [os.path.join(out, f) for f in m["stats"]["files"]["train"]]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 135168, "filter_overlong_prompts": True,
                            "filter_overlong_prompts_workers": 1, "return_raw_chat": True, "truncation": "error",
                            "cache_dir": str(tmp_path / "verl-cache")})
    data = RLHFDataset(data_files=files, tokenizer=tok, config=cfg)
    assert len(data) == 6  # nothing filtered as overlong
    item = data[0]
    assert item["raw_prompt"][0]["role"] == "user" and "<session0>" in item["raw_prompt"][0]["content"]
    assert item["data_source"] == "memsifter_synth"
    gold, n = ground_truth(item)
    assert len(item["extra_info"]["sessions"]) == n and item["extra_info"]["answer"]
    assert gold == item["extra_info"]["gold_local"]
    batch = collate_fn([data[0], data[1]])
    assert len(batch["extra_info"]) == 2 and batch["reward_model"][1]["style"] == "rule"
    schema = pq.read_schema(files[0])
    assert schema.field("extra_info").type.get_field_index("sessions") >= 0
    assert isinstance(schema.field("prompt").type, pa.ListType)


def test_example_configs_validate():
    from importlib import resources

    from memsifter.stage import load_config_file, validate_config

    cfg_dir = resources.files("memsifter").joinpath("configs")
    c = validate_config("prepare-rl", load_config_file(str(cfg_dir.joinpath("prepare_rl_example.yaml"))))
    assert c.recipe["train"]["locomo"] == 800 and c.history_budget_tokens == 130 * 1024
    c = validate_config("prepare-rl", {"output": "x", "datasets": ["d"],
                                       "recipe": str(cfg_dir.joinpath("recipe_example.yaml"))})
    assert c.recipe == {"train": {"longmemeval_s": 400, "locomo": 800, "personamem_128k": 800},
                        "test": {"longmemeval_s": 50, "locomo": 50}}
