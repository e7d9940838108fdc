"""The ranker's DAPO with the improvement reward (issue 44 item 2), on the CPU, through verl's own code.

What is real: prepare-rl's rows (synthetic dataset, SmolLM2-135M-Instruct's tokenizer, the direct prompt, a shuffled
listing), the rank stage's prompt builder (:func:`memsifter.retrieval.ranker.build_prompt`), the train config the GPU
driver runs (``benchmarks/gpu/run_ranker.py``'s improve phase) composed and validated by the train stage's dry run,
verl 0.9.1's agent-loop worker with the v1 trainer's post-processing, its registry read from the shipped
``ranker_loop.yaml``, and its reward-loop worker with the reward manager that config names, calling
``memsifter.training.rewards.compute_score``.

Stand-in, and why: vLLM cannot run inside verl's rollout here, so the LLM server client is test_agent_loops'
``RecordedServer`` (recorded replies as SmolLM2's token ids; it keeps the prompt ids it was sent).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

from memsifter.data.model import read_dataset
from memsifter.stage import get_stage
from memsifter.stages import train
from memsifter.stages.prepare_rl import read_rows
from memsifter.stages.train import TrainConfig
from memsifter.training import ranker_loop, rewards

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

CONTEXT_LIMIT = 6000   # every session of a 10-session synthetic haystack fits
SHUFFLE_SEED = 5       # prepare-rl's listing of each row (the rank stage's shuffle_seed)
EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def rl(tmp_path_factory, smollm2_dir):
    """prepare-rl's rows for the SmolLM2 ranker with a shuffled listing: (output, dataset)."""
    tmp = tmp_path_factory.mktemp("ranker-rl")
    ds = str(tmp / "ds")
    get_stage("synth").run({"output": ds, "questions": 8, "sessions_per_question": 10, "seed": 3})
    out = str(tmp / "rl")
    get_stage("prepare-rl").run({
        "output": out, "datasets": [ds], "tokenizer": smollm2_dir, "prompt_style": "direct", "seed": 1,
        "context_limit": CONTEXT_LIMIT, "history_order": "shuffled", "shuffle_seed": SHUFFLE_SEED,
        "recipe": {"train": {"synth": 4}, "test": {"synth": 2}}})
    return out, ds


def served_prompt(ds_uri: str, row: dict, smollm2_dir: str, seed: int) -> list[dict]:
    """What the rank stage serves for the row's question with ``history_order: shuffled, shuffle_seed: seed``, over
    the haystack the row was built from (the split cuts held-out session texts from training haystacks)."""
    import dataclasses

    from memsifter.retrieval.context import TokenCounter, load_tokenizer
    from memsifter.retrieval.prompting import RANKER_PROMPTS, load_prompt
    from memsifter.retrieval.ranker import build_prompt
    from memsifter.stages.rank import RankConfig

    cfg = RankConfig(input=ds_uri, embeddings=ds_uri, output="/unused", model="smollm2-135m-instruct",
                     tokenizer=smollm2_dir, prompt_style="direct", answer_prefix="", context_limit=CONTEXT_LIMIT,
                     history_order="shuffled", shuffle_seed=seed)
    ds = read_dataset(ds_uri)
    info = row["extra_info"]
    q = ds.question(info["question_id"])
    hay = [s for _, s in sorted(zip(info["haystack_index"], info["session_ids"]))]
    assert set(hay) <= set(q.haystack_session_ids)
    q = dataclasses.replace(q, haystack_session_ids=hay, haystack_dates=[q.date_of(s, ds.sessions) for s in hay])
    counter = TokenCounter(load_tokenizer(smollm2_dir))
    template = load_prompt(None, RANKER_PROMPTS["direct"], ("history", "current"))
    return build_prompt(cfg, ds, q, None, counter, template).messages


# --------------------------------------------------------------------------- the listing of a rollout
def test_a_rollouts_prompt_is_the_one_the_rank_stage_serves_with_its_seed(rl, smollm2_dir):
    out, ds = rl
    row = read_rows(out, "train")[0]
    info = row["extra_info"]
    # prepare-rl's own listing is the rank stage's with shuffle_seed 5; re-listing with that seed changes nothing
    assert row["prompt"][:1] == served_prompt(ds, row, smollm2_dir, SHUFFLE_SEED)[:1]
    same, listing = ranker_loop.relist(row["prompt"], info, SHUFFLE_SEED)
    assert same == row["prompt"] and listing == list(range(info["n_sessions"]))
    for seed in (11, 2024):
        msgs, listing = ranker_loop.relist(row["prompt"], info, seed)
        assert msgs[:1] == served_prompt(ds, row, smollm2_dir, seed)[:1]
        assert listing != list(range(info["n_sessions"]))
        # rollout id j shows the row's session listing[j]
        text = msgs[0]["content"]
        for j, i in enumerate(listing):
            assert f"<session{j}> <date>{info['dates'][i]}</date>\n{info['sessions'][i]}</session>" in text


def test_rollouts_of_one_training_prompt_get_different_listings_validation_keeps_the_rows(rl):
    out, _ = rl
    row = read_rows(out, "train")[0]
    listings = {tuple(ranker_loop.rollout_prompt(row["prompt"], row["extra_info"], "uid-1", i)[1]) for i in range(8)}
    assert len(listings) == 8
    again = ranker_loop.rollout_prompt(row["prompt"], row["extra_info"], "uid-1", 3)
    assert again == ranker_loop.rollout_prompt(row["prompt"], row["extra_info"], "uid-1", 3)  # seeded, reproducible
    val = read_rows(out, "test")[0]
    msgs, listing, seed = ranker_loop.rollout_prompt(val["prompt"], val["extra_info"], "uid-2", 1)
    assert msgs == val["prompt"] and listing == list(range(val["extra_info"]["n_sessions"])) and seed is None


def test_a_row_whose_history_is_not_its_prompts_is_refused(rl):
    out, _ = rl
    row = read_rows(out, "train")[0]
    info = dict(row["extra_info"], sessions=list(reversed(row["extra_info"]["sessions"])))
    with pytest.raises(ValueError, match="history block"):
        ranker_loop.relist(row["prompt"], info, 9)


# --------------------------------------------------------------------------- the GPU run's config, composed
def driver_args(**kw) -> argparse.Namespace:
    run_ranker = importlib.import_module("run_ranker")
    return run_ranker.build_parser().parse_args(["run", *kw.pop("argv", [])])


@pytest.fixture(scope="module")
def composed(rl, tmp_path_factory, smollm2_dir):
    """The improve phase's train config as benchmarks/gpu/run_ranker.py writes it (on this machine's data), the
    train stage's dry run of it (verl config composed and validated), and the config."""
    from omegaconf import OmegaConf

    run_ranker = importlib.import_module("run_ranker")
    a = driver_args()
    data = run_ranker.train_data(a, "improve", None, run_ranker.REWARDS["improve"], 24, "shuffled")
    data["data"] = rl[0]
    data["local_dir"] = str(tmp_path_factory.mktemp("pod"))
    cfg = TrainConfig(**data)
    text = train.dry_run(cfg, in_process=True)
    return OmegaConf.create(text), data


def test_the_improve_phase_composes_the_ranker_loop_and_the_improvement_reward(composed):
    c, data = composed
    assert data["experiment_name"] == "ranker-improve-shuf" and data["reward"]["mode"] == "improvement"
    agent = c.actor_rollout_ref.rollout.agent
    assert agent.default_agent_loop == ranker_loop.NAME
    assert Path(agent.agent_loop_config_path).is_file()
    assert c.reward.reward_manager.name == "naive"  # it hands the loop's extra_fields to the reward
    kw = c.reward.custom_reward_function.reward_kwargs
    assert kw.mode == "improvement" and kw.format == "exact"
    assert c.reward.custom_reward_function.path == "pkg://memsifter.training.rewards"
    assert c.trainer.use_v1 and c.actor_rollout_ref.rollout.n == 8 and c.trainer.total_training_steps == 24


def test_the_shipped_loop_file_names_the_ranker_loop():
    """verl's worker fills its registry from agent_loop_config_path and instantiates the entry with Hydra."""
    import hydra
    from omegaconf import OmegaConf

    entries = {e.name: e for e in OmegaConf.load(ranker_loop.config_path())}
    assert hydra.utils.get_class(entries[ranker_loop.NAME]._target_) is ranker_loop.RankerAgentLoop


def test_the_driver_keeps_the_split_with_its_results(tmp_path, monkeypatch):
    run_ranker = importlib.import_module("run_ranker")
    data, res = tmp_path / "data", tmp_path / "res"
    (data / "rl-shuffled").mkdir(parents=True)
    res.mkdir()
    (data / "split.json").write_text('{"splits": {"heldout": {}}}')
    (data / "rl-shuffled" / "split.json").write_text('{"splits": {"test": {}}}')
    monkeypatch.setattr(run_ranker, "DATA", str(data))
    monkeypatch.setattr(run_ranker, "RES", str(res))
    run_ranker.keep_splits()
    assert sorted(p.name for p in res.iterdir()) == ["split-rl-shuffled.json", "split.json"]
    assert "heldout" in (res / "split.json").read_text()


def test_other_phases_keep_the_single_turn_loop():
    run_ranker = importlib.import_module("run_ranker")
    data = run_ranker.train_data(driver_args(), "dcg", None, run_ranker.REWARDS["dcg"], 4, "shuffled")
    assert "agent" not in data["verl"]["actor_rollout_ref"]["rollout"]
    assert run_ranker.phase_order("improve@shuffled", "first_stage") == ("improve", "shuffled")


# --------------------------------------------------------------------------- rollouts through verl's worker
@pytest.fixture(scope="module")
def worker(composed, smollm2_dir):
    """verl's agent-loop worker (v1 post-processing) built from the composed config; its LLM client the recorded
    server, its reward handle verl's reward-loop worker with the composed reward manager."""
    from test_agent_loops import LocalRewardHandle, RecordedServer
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils.ray_utils import get_event_loop

    c, _ = composed
    c.actor_rollout_ref.model.path = smollm2_dir
    c.actor_rollout_ref.model.lora_adapter_path = None

    class Worker(AgentLoopWorker):  # AgentLoopWorkerTQ without tq.init() (no TransferQueue controller here)
        _agent_loop_postprocess = AgentLoopWorkerTQ.__ray_actor_class__._agent_loop_postprocess

    loop = get_event_loop()
    server = RecordedServer(AutoTokenizer.from_pretrained(smollm2_dir))
    w = Worker(c, llm_client=server, reward_loop_worker_handles=[LocalRewardHandle(c)])
    w.server, w.event_loop = server, loop
    return w


def score(field: dict) -> float:
    """The reward the trainer gets for a rollout (on its last response token)."""
    return field["rm_scores"][-1].item()


def rollout(worker, monkeypatch, row: dict, uid: str, session_id: int, reply: str) -> tuple[dict, list[int]]:
    """One rollout of ``row`` through verl's ``_run_agent_loop``: (the field put for the trainer, the prompt ids the
    server was sent)."""
    import asyncio

    import transfer_queue as tq
    from verl.trainer.ppo.v1 import agent_loop_tq

    rows: list[list[dict]] = []
    real = agent_loop_tq.list_of_dict_to_tensordict
    monkeypatch.setattr(agent_loop_tq, "list_of_dict_to_tensordict", lambda f: (rows.append(f), real(f))[1])

    async def put(keys, fields, tags, partition_id):
        assert partition_id == "train" and all(t["status"] == "success" for t in tags)

    monkeypatch.setattr(tq, "async_kv_batch_put", put)
    worker.server.load([reply + EOT])
    worker.server.calls = []
    kw = {"agent_name": ranker_loop.NAME, "uid": uid, "session_id": session_id, "global_steps": 1, "index": 0,
          "data_source": row["data_source"], "raw_prompt": row["prompt"], "reward_model": row["reward_model"],
          "extra_info": row["extra_info"]}
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    trajectory = {"step": 1, "sample_index": 0, "rollout_n": session_id, "validate": False}
    asyncio.set_event_loop(worker.event_loop)
    worker.event_loop.run_until_complete(worker._run_agent_loop(sampling, trajectory, trace=False, **kw))
    assert len(rows) == 1 and len(worker.server.calls) == 1
    return rows[0][-1], worker.server.calls[0]["prompt_ids"]


def test_rollouts_of_one_prompt_see_different_listings_and_copying_earns_nothing(rl, worker, monkeypatch,
                                                                                   smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    row = read_rows(rl[0], "train")[0]
    n = row["extra_info"]["n_sessions"]
    copy = "<ranking>" + ", ".join(str(i) for i in range(min(10, n))) + "</ranking>"
    got = [rollout(worker, monkeypatch, row, "uid-7", i, copy) for i in range(2)]
    (f0, ids0), (f1, ids1) = got
    assert ids0 != ids1
    listings = [f["extra_fields"][rewards.LISTING] for f in (f0, f1)]
    assert listings[0] != listings[1]
    for (f, ids), listing in zip(got, listings):
        prompt = tok.decode(ids)
        want, _ = ranker_loop.relist(row["prompt"], row["extra_info"], f["extra_fields"][ranker_loop.SEED_FIELD])
        assert want[0]["content"] in prompt  # the tokens sent are the re-listed prompt
        info = f["extra_fields"]["reward_extra_info"]
        # the reply copied the order it was shown: nothing earned, whatever that order
        assert f["rm_scores"][-1].item() == 0.0 and info["listing_from_rollout"] == 1.0 and info["order_changed"] == 0.0
    # a rollout whose listing does not show the gold session first: ranking gold first earns more than 0, last less
    gold = set(rewards.parse_ground_truth(row["reward_model"]["ground_truth"])[0])
    sid = next(i for i in range(2, 40)
               if ranker_loop.rollout_prompt(row["prompt"], row["extra_info"], "uid-7", i)[1][0] not in gold)
    listing = ranker_loop.rollout_prompt(row["prompt"], row["extra_info"], "uid-7", sid)[1]
    first = [j for j, i in enumerate(listing) if i in gold] + [j for j, i in enumerate(listing) if i not in gold]
    up, _ = rollout(worker, monkeypatch, row, "uid-7", sid,
                    "<ranking>" + ", ".join(map(str, first[:10])) + "</ranking>")
    down, _ = rollout(worker, monkeypatch, row, "uid-7", sid,
                      "<ranking>" + ", ".join(map(str, (first[len(gold):] + first[:len(gold)])[:10])) + "</ranking>")
    shown = up["extra_fields"]["reward_extra_info"]["shown_ndcg"]
    assert shown < 1.0 and score(up) == pytest.approx(1.0 - shown, abs=1e-6) and score(up) > 0
    assert score(down) < 0


def test_the_held_out_table_keeps_ndcg_per_question(tmp_path, monkeypatch):
    """run_ranker.py's eval keeps each ranker's NDCG@10 per held-out question with its results (the paired
    differences against the first stage can be recomputed from the results alone)."""
    import json

    from memsifter.retrieval import rankings
    from memsifter.stage import code_version
    from memsifter.store import storage

    run_ranker = importlib.import_module("run_ranker")
    data = tmp_path / "rk"
    ds_uri = str(data / "data" / "heldout")
    get_stage("synth").run({"output": ds_uri, "questions": 4, "sessions_per_question": 5, "seed": 2})
    qs = read_dataset(ds_uri).questions
    pub = storage.Publication(ds_uri + "-embed", "embed", {}, "heldout", code_version())
    # the first stage: gold last (NDCG@10 of one gold session at rank 5 = 1/log2(6))
    rows = [{"question_id": q.question_id, "ranked_session_ids": [s for s in q.haystack_session_ids
                                                                    if s not in q.gold_session_ids]
             + list(q.gold_session_ids), "status": "ok", "method": "embed", "scores": None, "reason": None,
             "raw_response": None} for q in qs]
    rankings.write_rankings(pub, rows)
    pub.publish({})
    res, runs = tmp_path / "res", tmp_path / "runs"
    res.mkdir()
    runs.mkdir()
    for name, value in (("DATA", str(data)), ("RES", str(res)), ("RUNS", str(runs))):
        monkeypatch.setattr(run_ranker, name, value)
    a = run_ranker.build_parser().parse_args(["run", "--no-answers"])
    table = run_ranker.phase_answers(a, "", ["heldout"])
    per_q = json.loads((res / "ndcg10-per-question-heldout.json").read_text())
    assert set(per_q) == {"first-stage"} and set(per_q["first-stage"]) == {q.question_id for q in qs}
    from math import log2

    assert all(v == pytest.approx(1 / log2(6)) for v in per_q["first-stage"].values())
    assert table["heldout"]["first-stage"]["ndcg@10"] == pytest.approx(1 / log2(6), abs=1e-4)


def test_eval_ranks_with_the_improve_adapter_on_its_own_listing(tmp_path, monkeypatch):
    run_ranker = importlib.import_module("run_ranker")
    runs = tmp_path / "runs"
    for kind in ("sft-shuf", "improve-shuf"):
        (runs / f"adapter-{kind}").mkdir(parents=True)
        (runs / f"adapter-{kind}" / "adapter_config.json").write_text("{}")
    monkeypatch.setattr(run_ranker, "RUNS", str(runs))
    monkeypatch.setattr(run_ranker, "STATE", str(tmp_path / "none"))
    got = {tag: (adapter, order) for tag, adapter, _, order in run_ranker.rankers()}
    assert got["improve-shuf"] == (str(runs / "adapter-improve-shuf"), "shuffled")
    assert got["sft-shuf"][1] == "shuffled" and "base-free" in got


def test_a_users_train_config_with_the_improvement_reward_gets_the_ranker_loop(tmp_path):
    """`reward.mode: improvement` in a train config (the chart's values, a config file) runs ranker rows through
    the ranker's loop with the naive reward manager, no `verl:` keys needed; the dapo manager is refused (it drops
    each rollout's listing); other modes keep verl's single-turn loop."""
    from memsifter.errors import ConfigError
    from test_train import fake_prepare_rl

    data = fake_prepare_rl(str(tmp_path / "rl"))

    def overrides(**kw) -> dict:
        cfg = TrainConfig(output="s3://b/run/train", data=data, **kw)
        return dict(o.lstrip("+").split("=", 1) for o in train.verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"]))

    ov = overrides(reward={"mode": "improvement"})
    for path, value in ranker_loop.verl_settings().items():
        assert ov[path].strip("'") == value, path
    plain = overrides(reward={"mode": "dcg"})
    assert "actor_rollout_ref.rollout.agent.default_agent_loop" not in plain
    assert plain["reward.reward_manager.name"] == "'dapo'"
    with pytest.raises(ConfigError, match="improvement needs verl's naive reward manager"):
        overrides(reward={"mode": "improvement"}, verl={"reward": {"reward_manager": {"name": "dapo"}}})
