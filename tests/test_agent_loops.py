"""The memory agents in verl 0.9.1's training loop (issue 33 items 2 and 5), on the CPU, through verl's own code.

What is real here: verl 0.9.1's agent-loop worker (``AgentLoopWorker`` with the v1 trainer's
``_agent_loop_postprocess`` of ``AgentLoopWorkerTQ``: the registry read from the shipped yaml, the loop
instantiated by Hydra, the list of outputs, the reward copied to every output), verl's reward-loop worker
(``RewardLoopWorker`` with the reward manager the train stage configures, calling
``memsifter.training.rewards.compute_score``), verl's GRPO advantage for multi-output sessions
(``compute_advantage_for_multi_trajectories``), the verl config composed by the train stage for agent rows,
SmolLM2-135M-Instruct's real tokenizer and chat template, the agents' own episodes (``memsifter.agents``)
and ``http_search`` over real HTTP.

Stand-ins, and why: vLLM cannot run inside verl's rollout on this CPU machine, so the LLM server manager
is :class:`RecordedServer`: it returns recorded token ids (the replies below, tokenized by SmolLM2's
tokenizer, ending as vLLM ends them: with the stop string included, or with the end-of-turn token, or cut at
``max_tokens``), honouring the request's ``max_tokens`` as vLLM does. The memory service is
:class:`RecordedMemoryService`: an HTTP server on loopback answering ``POST /retrieve`` with recorded hits in
the service's response format (the real service needs Ray and an embedding model; its own tests cover it).
TransferQueue's put is captured (the v1 trainer's store; no TQ controller runs here).
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("verl")

from memsifter.errors import ConfigError  # noqa: E402
from memsifter.stage import code_version  # noqa: E402
from memsifter.stages import train  # noqa: E402
from memsifter.stages.train import TrainConfig  # noqa: E402
from memsifter.store import storage  # noqa: E402
from memsifter.training import rewards  # noqa: E402

QUESTION = "When did Caroline go to the LGBTQ pride parade?"
GOLD = "June 2023"
SESSIONS = [
    {"session_id": "s1", "date": "2023-06-20",
     "text": "<Caroline1>I went to a LGBTQ pride parade last week, it was amazing!</Caroline>\n"
             "<Melanie2>That sounds wonderful, Caroline.</Melanie>\n"},
    {"session_id": "s2", "date": "2023-07-02",
     "text": "<Melanie1>We went camping with the kids.</Melanie>\n<Caroline2>How lovely!</Caroline>\n"},
]
HITS = [
    {"document": {"id": "s1", "contents": "2023-06-20 | session s1\n" + SESSIONS[0]["text"].rstrip("\n")},
     "score": 7.5},
    {"document": {"id": "s2", "contents": "2023-07-02 | session s2\n" + SESSIONS[1]["text"].rstrip("\n")},
     "score": 1.25},
]

EOT = "<|im_end|>"  # SmolLM2's end of turn (generation_config eos_token_id 2)
CUT = "<cut>"       # marks a reply vLLM cut at max_tokens (no stop string, no end of turn)

# What the policy wrote, per agent and session (the recorded replies); the last entry of each list is the
# episode's final reply. A reply ending in EOT ended with the end-of-turn token; one ending in a stop string
# stopped there (vLLM keeps it: include_stop_str_in_output).
REPLIES = {
    "memsifter_search": [
        ["<think>I need the date of the parade.</think>\n<search>Caroline pride parade</search>",
         "She went to the parade in summer." + EOT,                      # malformed: a correction follows
         "<answer>June 2023</answer>"],
        ["<search>Caroline pride parade date" + CUT,                     # cut: the environment closes the tag
         "<answer>July 2023</answer>"],
        ["<search>Caroline parade" + EOT,                                 # ended its turn inside the tag
         "<answer>June 2023</answer>"],
    ],
    "memsifter_memory": [
        ["<memory>- (2023-06-20) Caroline went to a LGBTQ pride parade the week before</memory>",
         "<memory>- (2023-06-20) Caroline went to a LGBTQ pride parade the week before; so in June 2023"
         + CUT,
         "<answer>June 2023</answer>"],
        ["<memory>nothing about a parade</memory>",
         "<memory>nothing about a parade</memory>",
         "I do not know." + EOT],                                        # no answer: format failure
    ],
    "memsifter_memory_recall": [
        ["<update>- (2023-06-20) Caroline: pride parade last week</update>" + EOT,
         "<update>- (2023-06-20) Caroline: pride parade last week (June 2023)</update><recall>parade</recall>",
         "<answer>in June 2023</answer>"],
        ["<update>camping</update>" + EOT,
         "<update>camping</update>" + EOT,
         "<answer>July</answer>"],
    ],
}


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


class RecordedMemoryService:
    """``POST /retrieve`` on loopback answering recorded hits in the memory service's format; keeps what it
    was asked (body, Authorization header)."""

    def __init__(self):
        self.requests: list[tuple[dict, str | None]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append((body, self.headers.get("Authorization")))
                out = json.dumps({"result": [HITS[: body["topk"]]]}).encode()
                self.send_response(200 if self.path == "/retrieve" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def memory_service():
    with RecordedMemoryService() as svc:
        yield svc


def recorded_ids(tokenizer, reply: str) -> list[int]:
    """The token ids a vLLM server returns for ``reply`` (see REPLIES)."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    if reply.endswith(EOT):
        return tokenizer(reply[: -len(EOT)], add_special_tokens=False)["input_ids"] + [eot]
    return tokenizer(reply.removesuffix(CUT), add_special_tokens=False)["input_ids"]


class RecordedServer:
    """Stands in for verl's LLM server client (``LLMServerClient.generate``), whose vLLM servers cannot run
    here: it returns the next recorded reply's token ids, cut at the request's ``max_tokens`` as vLLM cuts,
    and keeps every call (request id, prompt ids, sampling params, returned ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.queue: list[list[int]] = []
        self.calls: list[dict] = []

    def load(self, replies: list[str]) -> None:
        self.queue = [recorded_ids(self.tokenizer, r) for r in replies]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        ids = self.queue.pop(0)
        max_tokens = sampling_params.get("max_tokens")
        if max_tokens is not None:
            ids = ids[:max_tokens]
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params), "ids": list(ids)})
        logprobs = [-0.25 - 0.001 * i for i in range(len(ids))] if sampling_params.get("logprobs") else None
        return TokenOutput(token_ids=list(ids), log_probs=logprobs, stop_reason="completed",
                           extra_fields={"global_steps": 3, "min_global_steps": 3, "max_global_steps": 3})


class LocalRewardHandle:
    """verl's own ``RewardLoopWorker`` (the reward manager and reward function the train stage configures)
    behind the call verl makes on its Ray actor handle (``handle.compute_score.remote(data)``); the data is
    pickled on the way as Ray would."""

    def __init__(self, config):
        from verl.experimental.reward_loop import RewardLoopWorker

        self.worker = RewardLoopWorker(config)
        self.compute_score = SimpleNamespace(remote=self._remote)

    def _remote(self, data):
        return self.worker.compute_score(pickle.loads(pickle.dumps(data)))


def fake_prepare_agents(uri: str, names: tuple[str, ...] = ("memsifter_search", "memsifter_memory")) -> str:
    """A published prepare-agents output: verl rows carrying ``agent_name`` (the content a dry run reads is
    the column)."""
    pub = storage.Publication(uri, "prepare-agents", {}, "test", code_version())
    t = pa.table({"data_source": ["memsifter_agent"] * len(names), "agent_name": list(names)})
    pub.write_table("train_00000.parquet", t)
    pub.write_table("test.parquet", t)
    pub.publish({"rows": {"train": len(names), "test": len(names)}})
    return uri


def agent_train_config(tmp_path, data: str, **fields) -> TrainConfig:
    return TrainConfig(
        output=str(tmp_path / "train"), data=data, model="smollm2-135m-instruct", n_gpus_per_node=1,
        verl={"data.max_prompt_length": 2048, "data.max_response_length": 1024,
              "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
              "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1,
              "actor_rollout_ref.rollout.calculate_log_probs": True,
              "actor_rollout_ref.rollout.n": 2},
        **fields)


@pytest.fixture(scope="module")
def composed(tmp_path_factory, smollm2_dir, memory_service):
    """The verl config the train stage composes for prepare-agents rows (what main_ppo would get)."""
    from omegaconf import OmegaConf

    tmp = tmp_path_factory.mktemp("agents-train")
    data = fake_prepare_agents(str(tmp / "data"))
    cfg = agent_train_config(tmp, data, search_url=memory_service.url, search_api_key_env="MEMSIFTER_TEST_KEY")
    text = train.compose(cfg, train.verl_overrides(cfg, ["/x/train_00000.parquet"], ["/x/test.parquet"]),
                         in_process=True)
    train.validate_composed(text)
    return OmegaConf.create(text)


@pytest.fixture(scope="module")
def worker(composed, tokenizer):
    """verl's agent-loop worker with the v1 trainer's post-processing (``AgentLoopWorkerTQ``), built from the
    composed config, its LLM client the recorded server, its reward handle verl's reward-loop worker."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    tq_cls = AgentLoopWorkerTQ.__ray_actor_class__

    class Worker(AgentLoopWorker):  # AgentLoopWorkerTQ without tq.init() (no TransferQueue controller here)
        _agent_loop_postprocess = tq_cls._agent_loop_postprocess

    from verl.utils.ray_utils import get_event_loop

    # one event loop, as in a Ray actor: verl's workers and reward managers keep the loop they were built on
    w_loop = get_event_loop()
    server = RecordedServer(tokenizer)
    w = Worker(composed, llm_client=server, reward_loop_worker_handles=[LocalRewardHandle(composed)])
    w.server, w.event_loop = server, w_loop
    return w


def run_on(worker, coro_fn):
    """Run ``coro_fn()`` on the worker's event loop (other tests' asyncio.run may have replaced the current
    loop; a loop built now must see the worker's, as it would in its Ray actor)."""
    import asyncio

    asyncio.set_event_loop(worker.event_loop)
    return worker.event_loop.run_until_complete(coro_fn())


@pytest.fixture
def ray_env(composed, monkeypatch):
    """The Ray job's environment as the train stage writes it (ray_kwargs.ray_init.runtime_env.env_vars)."""
    for k, v in composed.ray_kwargs.ray_init.runtime_env.env_vars.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("MEMSIFTER_TEST_KEY", "search-key-123")
    monkeypatch.setenv("MEMSIFTER_AGENT_KEEP_MESSAGES", "1")  # each output's conversation in its extra_fields


def row_kwargs(agent_name: str, uid: str, session_id: int) -> dict:
    """One dataset row as verl's v1 worker hands it to ``_run_agent_loop`` (prepare-agents' columns plus
    what verl adds: uid, index, global_steps, session_id)."""
    extra = {"question_id": "q1", "question": QUESTION, "question_date": "2023-08-01", "corpus_id": "q1",
             "sessions": [dict(s) for s in SESSIONS] if agent_name != "memsifter_search" else [],
             "agent_options": '{"max_turns": 3}' if agent_name == "memsifter_search" else "{}"}
    return {"agent_name": agent_name, "uid": uid, "session_id": session_id, "global_steps": 3, "index": 0,
            "data_source": "memsifter_agent", "raw_prompt": [{"role": "user", "content": QUESTION}],
            "reward_model": {"style": "rule", "ground_truth": GOLD}, "extra_info": extra}


def run_session(worker, monkeypatch, agent_name: str, uid: str, session_id: int, server=None,
                options: str | None = None) -> tuple[list[str], list[dict], list[dict]]:
    """One episode through verl's ``_run_agent_loop``; (TransferQueue keys, the fields put, the LLM calls).
    ``server``: another LLM server client than the recorded one; ``options``: the row's agent_options."""
    import transfer_queue as tq
    from verl.trainer.ppo.v1 import agent_loop_tq

    puts: list[tuple[list[str], list[dict]]] = []
    real = agent_loop_tq.list_of_dict_to_tensordict
    rows: list[list[dict]] = []

    def capture_rows(fields):
        rows.append(fields)
        return real(fields)

    async def kv_batch_put(keys, fields, tags, partition_id):
        puts.append((keys, rows[-1]))
        assert len(fields) == len(keys) and partition_id == "train"
        assert all(t["status"] == "success" for t in tags)

    monkeypatch.setattr(agent_loop_tq, "list_of_dict_to_tensordict", capture_rows)
    monkeypatch.setattr(tq, "async_kv_batch_put", kv_batch_put)
    if server is None:
        server = worker.server
        server.load(REPLIES[agent_name][session_id])
    server.calls = []
    monkeypatch.setattr(worker, "llm_client", server)
    kw = row_kwargs(agent_name, uid, session_id)
    if options is not None:
        kw["extra_info"]["agent_options"] = options
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    trajectory = {"step": 3, "sample_index": 0, "rollout_n": session_id, "validate": False}
    run_on(worker, lambda: worker._run_agent_loop(sampling, trajectory, trace=False, **kw))
    assert len(puts) == 1 and not getattr(server, "queue", None), "one put per episode; every recorded reply used"
    return puts[0][0], puts[0][1], server.calls


# --------------------------------------------------------------------------- (c) registry and config
def test_the_train_stage_composes_agent_loops_for_agent_rows(tmp_path, composed, memory_service):
    from memsifter.agents import verl_loop

    r = composed.actor_rollout_ref.rollout
    path = r.agent.agent_loop_config_path
    assert path == verl_loop.config_path() and os.path.isabs(path) and os.path.exists(path)
    assert composed.trainer.use_v1 is True and r.mode == "async"
    assert composed.reward.reward_manager.name == "naive"  # hands the last output's extra_fields to the reward
    assert composed.data.return_raw_chat is True
    env = composed.ray_kwargs.ray_init.runtime_env.env_vars
    assert env[verl_loop.SEARCH_URL_ENV] == memory_service.url
    assert env[verl_loop.SEARCH_KEY_ENV] == "MEMSIFTER_TEST_KEY" and "search-key-123" not in json.dumps(dict(env))
    kw = composed.reward.custom_reward_function.reward_kwargs
    assert kw.agent_metric == "f1" and kw.agent_format_score == 0.1 and kw.agent_evidence_score == 0.0
    # ranker rows: none of it
    rl = tmp_path / "rl"
    pub = storage.Publication(str(rl), "prepare-rl", {}, "test", code_version())
    pub.write_table("train_00000.parquet", pa.table({"data_source": ["memsifter_synth"]}))
    pub.write_table("test.parquet", pa.table({"data_source": ["memsifter_synth"]}))
    pub.publish({})
    ranker = TrainConfig(output=str(tmp_path / "t2"), data=str(rl))
    ovs = train.verl_overrides(ranker, ["/x/a.parquet"], ["/x/b.parquet"])
    assert not any("agent_loop_config_path" in o or verl_loop.SEARCH_URL_ENV in o for o in ovs)
    assert "reward.reward_manager.name='dapo'" in ovs


def test_search_rows_need_a_search_url(tmp_path):
    data = fake_prepare_agents(str(tmp_path / "data"))
    cfg = agent_train_config(tmp_path, data)
    with pytest.raises(ConfigError, match="search_url is not set"):
        train.verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"])
    only_memory = fake_prepare_agents(str(tmp_path / "mem"), ("memsifter_memory", "memsifter_memory_recall"))
    ovs = train.verl_overrides(agent_train_config(tmp_path, only_memory), ["/x/a.parquet"], ["/x/b.parquet"])
    assert any("agent_loop_config_path" in o for o in ovs)
    with pytest.raises(Exception, match="search_url"):
        agent_train_config(tmp_path, data, search_url="ftp://nowhere")


def test_verls_registry_finds_the_loops_through_the_shipped_yaml(worker):
    """verl's worker read the yaml (agent_loop_config_path) into its registry; Hydra builds each loop."""
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry

    from memsifter.agents import verl_loop

    for name, cls in (("memsifter_search", verl_loop.SearchAgentLoop), ("memsifter_memory", verl_loop.MemoryAgentLoop),
                      ("memsifter_memory_recall", verl_loop.MemoryRecallAgentLoop)):
        assert name in _agent_loop_registry
        loop = hydra.utils.instantiate(_agent_loop_registry[name], trainer_config=DictConfigWrap(worker.config),
                                       server_manager=worker.llm_client, tokenizer=worker.tokenizer, processor=None,
                                       dataset_cls=worker.dataset_cls, data_config=DictConfigWrap(worker.config.data))
        assert type(loop) is cls and loop.method == verl_loop.METHODS[name]


# --------------------------------------------------------------------------- (b) masks, token by token
def reward_of(row: dict) -> float:
    """The reward verl put on an output (``AgentLoopOutput.as_dict``: ``rm_scores``, on its last token)."""
    return row["rm_scores"][-1].item()


def check_trajectories(tokenizer, keys, rows, calls, uid, session, logprobs: bool = True, strict: bool = True):
    """Every mask-1 token is a generated token (in order, nothing else), every other response token is
    environment text, each generation saw exactly its trajectory so far, and each trajectory's tokens
    decode to the chat-template rendering of its conversation."""
    assert keys == [f"{uid}_{session}_{i}" for i in range(len(rows))]
    used = 0
    for row in rows:
        prompt, resp, mask = row["prompts"].tolist(), row["responses"].tolist(), row["response_mask"].tolist()
        logp = row["rollout_log_probs"].tolist() if logprobs else [1.0 if m else 0.0 for m in mask]
        assert len(resp) == len(mask) == len(logp) and row["loss_mask"].tolist() == mask
        steps = row["extra_fields"]["agent_steps"]
        mine = [c for c in calls[used:] if c["prompt_ids"][: len(prompt)] == prompt][:steps]
        used += len(mine)
        # the generated tokens, and only those, carry mask 1 (and the server's log-probs)
        gen = [t for c in mine for t in c["ids"]]
        assert [t for t, m in zip(resp, mask) if m] == gen
        assert all((lp != 0.0) == bool(m) for lp, m in zip(logp, mask))
        # each call saw the prompt plus the response so far; its ids are the next mask-1 run
        pos = 0
        for c in mine:
            while pos < len(mask) and not mask[pos]:
                pos += 1
            assert c["prompt_ids"] == prompt + resp[:pos]
            assert resp[pos: pos + len(c["ids"])] == c["ids"] and all(mask[pos: pos + len(c["ids"])])
            pos += len(c["ids"])
        assert pos == len(resp)  # the trajectory ends with the model's last reply
        mismatch = row["extra_fields"]["agent_render_mismatch"]
        assert mismatch == 0 or not strict
        # decoded: prompt + response is the chat template's rendering of the final conversation (the
        # template's end of the last turn aside, which the model never wrote)
        conv = row["extra_fields"]["agent_messages"]
        full = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
        text = tokenizer.decode(prompt + resp, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not mismatch:  # (else: test_a_reply_the_agent_recorded_otherwise_keeps_its_tokens)
            assert full.startswith(text) and full[len(text):] in (EOT + "\n", "\n")
        # the prompt is what the SFT stage and vLLM's OpenAI server feed the model for the first request
        first = tokenizer.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
        assert prompt == tokenizer(first, add_special_tokens=False)["input_ids"]
        # mask-0 tokens: the environment's text between the replies
        runs, cur = [], []
        for t, m in zip(resp, mask):
            if m and cur:
                runs.append(cur)
                cur = []
            elif not m:
                cur.append(t)
        assert not cur
        yield row, [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]
    assert used == len(calls)


def test_search_agent_masks_token_by_token(worker, tokenizer, monkeypatch, ray_env, memory_service):
    memory_service.requests.clear()
    keys, rows, calls = run_session(worker, monkeypatch, "memsifter_search", "u1", 0)
    assert len(rows) == 1  # one trajectory: every request continued the conversation
    (row, obs), = list(check_trajectories(tokenizer, keys, rows, calls, "u1", 0))
    # observations: the <information> block (after the search), the correction (after the malformed reply),
    # each with the chat template's tokens around it
    assert len(obs) == 2
    assert obs[0].startswith(EOT + "\n<|im_start|>user\n<information>") and obs[0].endswith("<|im_start|>assistant\n")
    assert "Caroline1>I went to a LGBTQ pride parade" in obs[0] and "</information>" in obs[0]
    assert obs[1].startswith("\n<|im_start|>user\nYour reply had no <search>")  # the reply ended with EOT itself
    assert obs[1].endswith("<|im_start|>assistant\n")
    # the search went to the service over HTTP, scoped to the row's corpus, with the key the env names
    assert [(b["queries"], b["corpus_id"]) for b, _ in memory_service.requests] == [(["Caroline pride parade"], "q1")]
    assert memory_service.requests[0][1] == "Bearer search-key-123"
    for c in calls:
        sp = c["sampling_params"]
        assert sp["stop"] == ["</search>", "</answer>"] and sp["include_stop_str_in_output"] is True
    ef = row["extra_fields"]
    assert ef["agent_answer"] == GOLD and ef["agent_format_ok"] is False and ef["agent_searches"] == 1
    assert reward_of(row) == pytest.approx(0.9 * 1.0 + 0.0)  # F1 1.0, malformed reply: no format term


def test_a_cut_reply_is_closed_by_the_environment_with_mask_0(worker, tokenizer, monkeypatch, ray_env):
    keys, rows, calls = run_session(worker, monkeypatch, "memsifter_search", "u1", 1)
    (row, obs), = list(check_trajectories(tokenizer, keys, rows, calls, "u1", 1))
    assert obs[0].startswith("</search>" + EOT + "\n<|im_start|>user\n<information>")  # closed by the agent
    assert row["extra_fields"]["agent_answer"] == "July 2023"


def test_a_reply_the_agent_recorded_otherwise_keeps_its_tokens(worker, tokenizer, monkeypatch, ray_env):
    """The model ended its turn inside <search> (end-of-turn token): the agent closes the tag in its record
    of the reply; the trajectory keeps the generated tokens and adds only the template's text after the
    turn (the model's own end of turn not repeated)."""
    keys, rows, calls = run_session(worker, monkeypatch, "memsifter_search", "u1", 2)
    (row,) = rows
    prompt, resp, mask = row["prompts"].tolist(), row["responses"].tolist(), row["response_mask"].tolist()
    assert [t for t, m in zip(resp, mask) if m] == calls[0]["ids"] + calls[1]["ids"]
    assert row["extra_fields"]["agent_render_mismatch"] == 1
    n = len(calls[0]["ids"])
    env = [t for t, m in zip(resp[n:], mask[n:]) if not m]
    assert tokenizer.decode(env).startswith("\n<|im_start|>user\n<information>")
    conv = row["extra_fields"]["agent_messages"]
    assert conv[1]["content"] == "<search>Caroline parade</search>"  # the agent's record
    full = tokenizer.apply_chat_template(conv, tokenize=False)
    text = tokenizer.decode(prompt + resp)
    assert full.replace("<search>Caroline parade</search>", "<search>Caroline parade", 1) == text + EOT + "\n"
    assert calls[1]["prompt_ids"] == prompt + resp[: len(resp) - len(calls[1]["ids"])]


def loop_with(worker, name: str, **rollout):
    """A loop as verl's worker builds it (registry entry from the yaml, Hydra), with other rollout budgets."""
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry

    import asyncio

    asyncio.set_event_loop(worker.event_loop)
    cfg = OmegaConf.create(OmegaConf.to_container(worker.config, resolve=True))
    for k, v in rollout.items():
        cfg.actor_rollout_ref.rollout[k] = v
    return hydra.utils.instantiate(_agent_loop_registry[name], trainer_config=DictConfigWrap(cfg),
                                   server_manager=worker.llm_client, tokenizer=worker.tokenizer, processor=None,
                                   dataset_cls=worker.dataset_cls, data_config=DictConfigWrap(cfg.data))


def test_an_episode_over_the_response_budget_stops_with_a_format_failure(worker, tokenizer, ray_env):
    loop = loop_with(worker, "memsifter_search", response_length=200)
    long = "<think>" + " ".join(["The parade was one of the events she mentioned."] * 12) + "</think>"
    worker.server.load(["<search>Caroline pride parade</search>", long, "<answer>June 2023</answer>"])
    worker.server.calls = []
    kw = row_kwargs("memsifter_search", "u5", 0)
    outs = run_on(worker, lambda: loop.run({"temperature": 1.0, "logprobs": False}, **kw))
    (out,) = outs
    calls = worker.server.calls
    assert len(calls) == 2 and len(out.response_ids) == 200  # the second reply cut to the room left
    assert calls[1]["sampling_params"]["max_tokens"] == 200 - len(calls[0]["ids"]) - sum(
        1 for m in out.response_mask[len(calls[0]["ids"]):] if not m)
    ef = out.extra_fields
    assert ef["agent_over_budget"] is True and ef["agent_format_ok"] is False and ef["agent_answer"] is None
    assert out.response_logprobs is None
    assert worker.server.queue == [recorded_ids(tokenizer, "<answer>June 2023</answer>")]  # never asked
    # a memory agent whose first prompt does not fit: nothing to train on, verl drops the group
    small = loop_with(worker, "memsifter_memory", prompt_length=64)
    with pytest.raises(ValueError, match="prompt of .* tokens, more than rollout.prompt_length=64"):
        run_on(worker, lambda: small.run({}, **row_kwargs("memsifter_memory", "u6", 0)))
    worker.server.queue = []


@pytest.mark.parametrize("agent_name", ["memsifter_memory", "memsifter_memory_recall"])
def test_memory_agents_one_output_per_step(worker, tokenizer, monkeypatch, ray_env, agent_name):
    keys, rows, calls = run_session(worker, monkeypatch, agent_name, "u2", 0)
    assert len(rows) == len(calls) == 3  # two chunk steps and the answer step, each its own trajectory
    for row, obs in check_trajectories(tokenizer, keys, rows, calls, "u2", 0):
        assert obs == []  # a fresh conversation per step: nothing but generated tokens in the response
    stops = [c["sampling_params"]["stop"] for c in calls]
    chunk_stop = ["</recall>"] if agent_name.endswith("recall") else ["</memory>"]
    assert stops == [chunk_stop, chunk_stop, ["</answer>"]]
    # the second chunk's prompt carries the notes of the first; the answer prompt the (closed) notes of the last
    second = tokenizer.decode(calls[1]["prompt_ids"])
    assert "Caroline" in second and "pride parade" in second
    assert all(reward_of(r) == reward_of(rows[-1]) for r in rows)


# --------------------------------------------------------------------------- (a) reward and advantage copying
def test_final_reward_and_grpo_advantage_are_copied_to_every_output(worker, tokenizer, monkeypatch, ray_env):
    """Two sessions of one prompt (a GRPO group): every output of a session carries the session's final
    reward (verl's _agent_loop_postprocess) and the same advantage (compute_advantage_for_multi_trajectories)."""
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    keys, rows = [], []
    finals = []
    for session in (0, 1):
        k, r, _ = run_session(worker, monkeypatch, "memsifter_memory", "u3", session)
        keys += k
        rows += r
        finals.append(reward_of(r[-1]))
        # the reward the last output got, copied to every output of the session, with its metrics
        assert len(r) == 3 and all(reward_of(x) == reward_of(r[-1]) for x in r)
        assert all(x["extra_fields"]["reward_extra_info"] == r[-1]["extra_fields"]["reward_extra_info"] for x in r)
        for x in r:  # AgentLoopOutput.as_dict's token-level score: the reward on the last response token only
            assert x["rm_scores"][:-1].abs().sum() == 0
    assert finals[0] == pytest.approx(0.9 + 0.1)  # "June 2023" exact, well formed
    assert finals[1] == 0.0  # no answer
    # the v1 trainer's advantage step (trainer_base._compute_advantage) on these rows
    width = max(len(x["responses"]) for x in rows)

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - len(t)))

    data = DataProto(batch=TensorDict({"response_mask": torch.stack([pad(x["response_mask"]) for x in rows]),
                                       "token_level_rewards": torch.stack([pad(x["rm_scores"]) for x in rows])},
                                      batch_size=len(rows)),
                     non_tensor_batch={"uid": np.array([x["uid"] for x in rows], dtype=object)})
    out = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO,
                                                   num_repeat=2, norm_adv_by_std_in_grpo=True)
    adv, mask = out.batch["advantages"], out.batch["response_mask"]
    per_session = {}
    for key, a, m in zip(keys, adv, mask):
        vals = set(a[m.bool()].tolist())
        assert len(vals) == 1 and a[~m.bool()].abs().sum() == 0  # one advantage on its generated tokens
        per_session.setdefault(key.rsplit("_", 1)[0], set()).update(vals)
    assert all(len(v) == 1 for v in per_session.values())  # the same for every output of a session
    a0, a1 = (per_session["u3_0"].pop(), per_session["u3_1"].pop())
    assert a0 > 0 > a1 and a0 == pytest.approx(-a1)  # the better session up, the other down


# --------------------------------------------------------------------------- (d) the reward
def score(solution: str, extra: dict | None = None, **kw) -> dict:
    return rewards.compute_score_sync("memsifter_agent", solution, GOLD, extra or {"question_id": "q1"}, **kw)


def test_agent_reward_good_malformed_wrong():
    good = score("<think>it was June</think> <answer>June 2023</answer>")
    assert good["score"] == pytest.approx(1.0) and good["format_ok"] == 1.0 and good["answer_f1"] == 1.0
    assert good["acc"] == good["score"] and good["answer_em"] == 1.0 and good["reward_error"] == 0.0
    partial = score("<answer>in June</answer>")
    assert partial["score"] == pytest.approx(0.9 * rewards.token_f1("in June", GOLD) + 0.1)
    wrong = score("<answer>July 2022</answer>")
    assert wrong["score"] == pytest.approx(0.1) and wrong["answer_f1"] == 0.0
    for bad in ("June 2023", "<answer>June 2023", "<answer></answer>", ""):  # no parsable answer
        r = score(bad)
        assert r["format_ok"] == 0.0 and r["score"] == 0.0 and r["has_answer"] == 0.0, bad
    nested = score("<answer>June <answer>2023</answer>")  # an answer, malformed: no format term
    assert nested["format_ok"] == 0.0 and nested["score"] == pytest.approx(0.9 * nested["answer_f1"])
    # the search agent's whole trajectory: only the final answer counts, not the environment's text
    traj = ("<search>parade</search>user\n<information>\n[1] <answer>July</answer>\n</information>\n"
            "assistant\n<answer>June 2023</answer>")
    assert score(traj)["answer_f1"] == 1.0
    # exact match as the answer metric
    em = score("<answer>in June 2023</answer>", agent_metric="em")
    assert em["score"] == pytest.approx(0.1) and em["answer_em"] == 0.0 and em["answer_f1"] > 0.5
    # what the verl loop hands over (the episode's parsed answer and format) wins over the text
    loop = {"agent_answer": "June 2023", "agent_format_ok": False, "agent_searches": 2}
    r = score("<answer>June 2023</answer>", loop)
    assert r["score"] == pytest.approx(0.9) and r["format_ok"] == 0.0 and r["searches"] == 2.0
    assert score("", {"agent_answer": None, "agent_format_ok": False})["score"] == 0.0
    # the ranker's reward is unchanged
    assert rewards.compute_score_sync("memsifter_synth", "<ranking>0</ranking>", "0;1", {}, mode="dcg")["score"] == 1.0


def test_agent_reward_evidence_term_pays_for_a_gold_session_among_the_hits():
    """``agent_evidence_score`` g: reward = (1 - f - g) x F1 + f x format + g x (a session the episode was shown is
    gold). A GRPO run with g = 0 and f = 0.1 learned to stop searching (2026-11-27-h100-agents-grpo7); with g > 0 a
    search that finds the gold session pays even when the answer is wrong. Off by default."""
    from memsifter.agents.verl_loop import seen_sessions
    from memsifter.stages.train import AgentTraining

    steps = [{"kind": "search", "hits": ["s3", "s1"]}, {"kind": "search", "hits": ["s1", "s9"]},
             {"kind": "chunk", "session_id": "s4"}, {"kind": "answer"}]
    assert seen_sessions(steps) == ["s3", "s1", "s9", "s4"] and seen_sessions([]) == []
    import numpy as np

    found = {"agent_answer": "July 2022", "agent_format_ok": True, "agent_seen": ["s3", "s1"],
             "gold_session_ids": np.array(["s1"])}
    missed = {**found, "agent_seen": ["s3"]}
    nosearch = {**found, "agent_seen": []}
    assert score("", found)["score"] == pytest.approx(0.1) and score("", found)["evidence_hit"] == 1.0  # default: off
    r = score("", found, agent_format_score=0.0, agent_evidence_score=0.3)
    assert r["score"] == pytest.approx(0.3) and r["evidence_hit"] == 1.0
    assert score("", missed, agent_format_score=0.0, agent_evidence_score=0.3)["score"] == 0.0
    assert score("", nosearch, agent_format_score=0.0, agent_evidence_score=0.3)["evidence_hit"] == 0.0
    right = score("", {**found, "agent_answer": "June 2023"}, agent_format_score=0.1, agent_evidence_score=0.3)
    assert right["score"] == pytest.approx(1.0)
    assert score("", found, agent_format_score=0.8, agent_evidence_score=0.3)["reward_error"] == 1.0  # f + g > 1
    with pytest.raises(ValueError, match="at most 1"):
        AgentTraining(format_score=0.8, evidence_score=0.3)
    assert AgentTraining(evidence_score=0.3).evidence_score == 0.3


# --------------------------------------------------------------------------- prepare-agents' own rows
@pytest.fixture(scope="module")
def prepared_rows(shared_dir, tmp_path_factory):
    """A real prepare-agents output: LoCoMo dev questions (../shared/data), every agent."""
    from memsifter.stage import get_stage

    src = shared_dir / "data" / "locomo_dev2.json.gz"
    if not src.exists():
        pytest.skip("../shared/data lacks the LoCoMo sample")
    root = tmp_path_factory.mktemp("prepared-agents")
    loc, out = str(root / "loc"), str(root / "agents")
    get_stage("import").run({"output": loc, "format": "locomo", "source": str(src)})
    get_stage("prepare-agents").run({"output": out, "datasets": [loc], "traces": False, "tokenizer": None,
                                     "recipe": {"train": {"locomo": 2}, "test": {"locomo": 1}}})
    return out


def test_prepare_agents_rows_drive_the_loops_as_a_fresh_episode(prepared_rows, worker, tokenizer, ray_env,
                                                                 memory_service, tmp_path):
    """prepare-agents' rows, as verl hands them over, run through the loops: each generation sees exactly the
    tokens the SFT stage and vLLM's OpenAI server give the same request of a fresh drive of the agent (the
    oracle's replies recorded as the policy's), and the episode ends in the oracle's answer."""
    from memsifter.agents.base import Session, Task, registry, requests_of
    from memsifter.agents.search import http_search
    from memsifter.stages.prepare_agents import read_rows

    rows = read_rows(prepared_rows, "train")
    names = {r["agent_name"] for r in rows}
    assert names == {"memsifter_search", "memsifter_memory", "memsifter_memory_recall"}
    # the train stage sees agent rows in this output and composes the loops
    cfg = TrainConfig(output=str(tmp_path / "t"), data=prepared_rows, search_url=memory_service.url)
    assert train.agent_names(cfg) == names
    assert any("agent_loop_config_path" in o for o in train.verl_overrides(cfg, ["/x/a.parquet"], ["/x/b.parquet"]))
    for name in sorted(names):
        row = next(r for r in rows if r["agent_name"] == name)
        info, gold = row["extra_info"], row["reward_model"]["ground_truth"]
        # a fresh drive of the agent prepare-agents built, its oracle writing the replies
        agent = registry()[METHODS_OF[name]](**json.loads(info["agent_options"]))
        task = Task(question_id=info["question_id"], question=info["question"], question_date=info["question_date"],
                    sessions=[Session(**s) for s in info["sessions"]])
        if name == "memsifter_search":
            task.search = http_search(memory_service.url, info["corpus_id"])
        reqs, res = requests_of(agent.episode(task), agent.oracle(task, gold, []))
        assert row["prompt"] == reqs[0][0].messages  # the row's prompt is the episode's first request
        worker.server.load([text for _, text in reqs])
        worker.server.calls = []
        loop = loop_with(worker, name, prompt_length=8192, response_length=2048)
        kw = {**row, "uid": "u7", "session_id": 0, "global_steps": 1}
        outs = run_on(worker, lambda: loop.run({"temperature": 1.0, "logprobs": False}, **kw))
        calls = worker.server.calls
        assert len(calls) == len(reqs) and not worker.server.queue
        for (req, _), call in zip(reqs, calls):
            rendered = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
            assert call["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
            assert call["sampling_params"]["stop"] == list(req.stop)
            assert call["sampling_params"]["max_tokens"] == req.max_tokens
        assert len(outs) == (1 if name == "memsifter_search" else len(reqs))
        ef = outs[-1].extra_fields
        assert ef["agent_answer"] == res.answer and ef["agent_format_ok"] is True and res.format_ok
        assert rewards.agent_reward("", gold, ef)["answer_f1"] == 1.0
        shown = {h for st in res.steps for h in [*(st.get("hits") or ()), st.get("session_id")] if h}
        assert set(ef["agent_seen"]) == shown and (name != "memsifter_search" or shown)


METHODS_OF = {"memsifter_search": "agent:search", "memsifter_memory": "agent:memory",
              "memsifter_memory_recall": "agent:memory+recall"}


# --------------------------------------------------------------------------- a real vLLM server
class VLLMTokenServer:
    """verl's LLM server client (``generate``: token ids in, token ids out) over a real vLLM (CPU) OpenAI
    server: ``POST /v1/completions`` with the prompt as token ids, the request's stop strings kept in the
    output (``include_stop_str_in_output``), greedy, the generated ids returned (``return_token_ids``)."""

    def __init__(self, url: str):
        import httpx

        self.client, self.url, self.calls = httpx.Client(timeout=600), url, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        sp = sampling_params
        body = {"model": "smollm2", "prompt": list(prompt_ids), "max_tokens": sp["max_tokens"], "stop": sp["stop"],
                "include_stop_str_in_output": sp["include_stop_str_in_output"], "temperature": 0.0,
                "return_token_ids": True}
        r = self.client.post(f"{self.url}/completions", json=body)
        r.raise_for_status()
        ids = list(r.json()["choices"][0]["token_ids"])
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids), "sampling_params": dict(sp),
                           "ids": ids, "text": r.json()["choices"][0]["text"]})
        return TokenOutput(token_ids=ids, stop_reason="completed", extra_fields={"global_steps": 1})


SMALL = {"memsifter_search": '{"max_turns": 2, "max_tokens": 48, "answer_tokens": 16}',
         "memsifter_memory": '{"memory_tokens": 48, "answer_tokens": 16}',
         "memsifter_memory_recall": '{"memory_tokens": 48, "answer_tokens": 16}'}


@pytest.mark.slow
def test_loops_on_a_real_vllm_server(smollm2_vllm, worker, tokenizer, monkeypatch, ray_env, memory_service):
    """Each loop against SmolLM2-135M-Instruct on a real vLLM server (untrained: it writes prose, so the
    episodes are mostly corrections and format failures; the structure is checked, not the quality): the
    token ids vLLM returns (stop strings included) are the mask-1 tokens, the rest is the environment's."""
    server = VLLMTokenServer(smollm2_vllm)
    for name in ("memsifter_search", "memsifter_memory", "memsifter_memory_recall"):
        keys, rows, calls = run_session(worker, monkeypatch, name, "u8", 0, server=server, options=SMALL[name])
        assert calls and all(c["sampling_params"]["include_stop_str_in_output"] for c in calls)
        # vLLM's text is the generated ids decoded, cut after the stop string; the ids may hold a few more
        # characters in their last token (seen: '>.' closing '</search>.'): the loop hands the episode the ids
        # decoded, so the reply's text and its tokens agree
        for c in calls:
            decoded = tokenizer.decode(c["ids"], skip_special_tokens=True)
            assert decoded.startswith(c["text"])
            assert decoded == c["text"] or tokenizer.decode(c["ids"][:-1], skip_special_tokens=True) != decoded
        list(check_trajectories(tokenizer, keys, rows, calls, "u8", 0, logprobs=False, strict=False))
        assert len(rows) == (1 if name == "memsifter_search" else len(calls))
        ef = rows[-1]["extra_fields"]
        assert ef["agent_llm_calls"] == len(calls) and isinstance(ef["agent_format_ok"], bool)
