"""memsifter.training.rewards: the verl custom reward (MEMSIFTER.md §6), hand-computed values for both modes."""

from __future__ import annotations

import json
import math
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from memsifter.training import rewards
from memsifter.training.rewards import combine_tiers, compute_score, compute_score_sync, score_batch, tiers_for

C = lambda k: 1 / math.log2(k + 1)  # noqa: E731

GOLD_A = "<user0>We adopted a puppy and named our dog Biscuit.</user>\n"
GOLD_B = "<user0>Biscuit the dog chewed my shoes again.</user>\n"
FILLER = ["<user0>How do I cook lentils?</user>\n", "<user0>Tax question about mileage.</user>\n",
          "<user0>Pruning roses in winter.</user>\n"]
# local ids 0..4 in chronological order: filler0, goldA, filler1, goldB, filler2
SESSIONS = [FILLER[0], GOLD_A, FILLER[1], GOLD_B, FILLER[2]]
EXTRA = {"question": "What is the name of my dog?", "question_date": "2023/05/01", "answer": "Biscuit",
         "sessions": SESSIONS, "dates": ["2023/01/01", "2023/02/01", "2023/03/01", "2023/04/01", "2023/04/15"],
         "dataset": "synth"}
GT = "1,3;5"


def test_tiers_and_combination_by_hand():
    assert tiers_for(10) == [0, 1, 2, 3, 5, 8, 10]
    assert tiers_for(5) == [0, 1, 2, 3, 5]
    assert tiers_for(4) == [0, 1, 2, 3, 4]
    assert tiers_for(1) == [0, 1]
    # the tier-1 term counts: C(1) = 1
    assert combine_tiers([0, 1], [0.2, 0.7]) == pytest.approx(0.5)
    assert combine_tiers([0, 1, 2, 3], [0.0, 0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.5 * 0.5)
    assert rewards.parse_ground_truth("1,3;5") == ([1, 3], 5)
    assert rewards.parse_ground_truth(";7") == ([], 7)


def test_dcg_mode_by_hand():
    resp = "<think>sessions 4 and 1 talk about it</think>\n<ranking>4, 0, 1, 2, 3, 5</ranking>"
    r = compute_score_sync("memsifter_synth", resp, "1,4;6", {}, mode="dcg")
    # K = min(10, 6) = 6; hits at ranks 1 and 3: (1/log2(2) + 1/log2(4)) / |gold| = 1.5 / 2
    assert r["score"] == pytest.approx(0.75) and r["acc"] == r["score"] and r["format_ok"] == 1.0
    assert set(r) == {"score", "acc", "format_ok", "dcg", "ndcg10", "n_ranked", "reward_error", "shown_ndcg",
                      "order_changed", "listing_from_rollout"}


@pytest.mark.parametrize("resp,why", [
    ("<think>no answer yet", "unfinished think"),
    ("<think>x</think> I think 3 and 1.", "no ranking tag"),
    ("</think><ranking>4, 0, 1</ranking>", "fewer than K = 6 ids"),
    ("<ranking>9, 8, 7, 6, 12, 40</ranking>", "ids out of range"),
    ("", "empty"),
])
def test_invalid_format_scores_zero(resp, why):
    r = compute_score_sync("memsifter_synth", resp, "1,4;6", {}, mode="dcg")
    assert r["score"] == 0.0 and r["format_ok"] == 0.0, why


def test_response_starting_inside_the_think_block():
    # Thinking-2507 templates pre-fill <think>: the response has only the closing tag
    resp = "The dog sessions are 1 and 4.\n</think>\n\n<ranking>1, 4, 0, 2, 3, 5</ranking>"
    r = compute_score_sync("memsifter_synth", resp, "1,4;6", {}, mode="dcg")
    assert r["score"] == pytest.approx((1 + 1 / math.log2(3)) / 2)


# --------------------------------------------------------------------------- task mode, fake endpoint
class FakeLLM:
    """An OpenAI-compatible /v1/chat/completions: answers by how many gold sessions it was shown."""

    def __init__(self, fail_marker: str | None = None):
        self.requests: list[dict] = []
        self.fail_marker = fail_marker
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                prompt = body["messages"][-1]["content"]
                if outer.fail_marker and outer.fail_marker in prompt:
                    self.send_response(500)
                    self.end_headers()
                    return
                n_gold = sum(g in prompt for g in (GOLD_A, GOLD_B))
                text = ["I don't know.", "<answer>Biscuit the dog</answer>", "<answer>Biscuit</answer>"][n_gold]
                out = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": text}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def fake_llm():
    llm = FakeLLM()
    yield llm
    llm.close()


def _kw(url, tmp_path, **kw):
    return {"mode": "task", "base_url": url, "model": "fake", "cache_uri": str(tmp_path / "cache"), **kw}


def test_task_mode_by_hand(fake_llm, tmp_path):
    # ranking: filler1(2), goldA(1), filler0(0), goldB(3), filler2(4); K = min(10, 5) = 5, tiers 0,1,2,3,5
    resp = "<think>…</think><ranking>2, 1, 0, 3, 4</ranking>"
    r = compute_score_sync("memsifter_synth", resp, GT, EXTRA, **_kw(fake_llm.url, tmp_path))
    # s_0 = 0 (no memory), s_1 = 0 (filler only), s_2 = s_3 = F1("Biscuit dog", "Biscuit") = 2/3, s_5 = 1
    expected = C(1) * 0 + C(2) * (2 / 3) + C(3) * 0 + C(5) * (1 - 2 / 3)
    assert r["score"] == pytest.approx(expected)
    assert r["s_no_memory"] == 0.0 and r["s_top_k"] == 1.0 and r["llm_calls"] == 5 and r["llm_failed"] == 0
    assert r["dcg"] == pytest.approx((1 / math.log2(3) + 1 / math.log2(5)) / 2)
    reqs = fake_llm.requests
    assert len(reqs) == 5 and all(q["temperature"] == 0.3 and q["model"] == "fake" for q in reqs)
    # each tier shows its top-t sessions in chronological order, renumbered 0..t-1, with dates
    tier3 = next(q["messages"][0]["content"] for q in reqs
                 if len(re.findall(r"<session\d+>", q["messages"][0]["content"])) == 3)
    assert tier3.index(FILLER[0]) < tier3.index(GOLD_A) < tier3.index(FILLER[1])
    assert "<session0> <date>2023/01/01</date>" in tier3 and "Current date: 2023/05/01" in tier3
    # the same sample again: answered from the cache, no new request
    r2 = compute_score_sync("memsifter_synth", resp, GT, EXTRA, **_kw(fake_llm.url, tmp_path))
    assert r2["score"] == r["score"] and len(fake_llm.requests) == 5


def test_task_mode_rewards_putting_gold_first(fake_llm, tmp_path):
    good = compute_score_sync("s", "</think><ranking>1, 3, 0, 2, 4</ranking>", GT, EXTRA, **_kw(fake_llm.url, tmp_path))
    bad = compute_score_sync("s", "</think><ranking>0, 2, 4, 1, 3</ranking>", GT, EXTRA, **_kw(fake_llm.url, tmp_path))
    # good: s = 0, 2/3, 1, 1, 1 -> C(1)*2/3 + C(2)*1/3 ; bad: only the last tier sees gold
    assert good["score"] == pytest.approx(C(1) * 2 / 3 + C(2) * 1 / 3)
    assert bad["score"] == pytest.approx(C(5) * 1.0)
    assert good["score"] > bad["score"]


def test_batch_is_concurrent_and_deduplicated(fake_llm, tmp_path):
    """n rollouts of one prompt: identical tier requests in flight share one call."""
    resp = "</think><ranking>2, 1, 0, 3, 4</ranking>"
    samples = [{"data_source": "memsifter_synth", "solution_str": resp, "ground_truth": GT, "extra_info": EXTRA}] * 6
    out = score_batch(samples, **_kw(fake_llm.url, tmp_path))
    assert len({o["score"] for o in out}) == 1 and len(fake_llm.requests) == 5
    # the response cache was persisted under cache_uri: a fresh process would re-send nothing
    assert list((tmp_path / "cache").glob("*.jsonl"))


def test_failed_call_scores_zero_and_is_counted(tmp_path):
    llm = FakeLLM(fail_marker=GOLD_B)  # every tier that shows gold B fails (HTTP 500, retried)
    try:
        r = compute_score_sync("s", "</think><ranking>1, 3, 0, 2, 4</ranking>", GT, EXTRA,
                               **_kw(llm.url, tmp_path, max_retries=1))
    finally:
        llm.close()
    # tiers 0,1 fine (s = 0, 2/3); tiers 2, 3, 5 include gold B and fail -> scored 0
    assert r["llm_failed"] == 3 and r["reward_error"] == 0.0
    assert r["score"] == pytest.approx(C(1) * 2 / 3 + C(2) * (0 - 2 / 3))
    assert len(llm.requests) == 1 + 1 + 3 * 2  # failing calls were retried once


def test_unreachable_endpoint_never_raises(tmp_path):
    r = compute_score_sync("s", "</think><ranking>1, 3, 0, 2, 4</ranking>", GT, EXTRA,
                           **_kw("http://127.0.0.1:9/v1", tmp_path, max_retries=0))
    assert r["score"] == 0.0 and r["llm_failed"] == 5


def test_malformed_extra_info_gives_zero_not_an_exception(fake_llm, tmp_path):
    r = compute_score_sync("s", "</think><ranking>1, 3, 0, 2, 4</ranking>", GT, {"question": "q"},
                           **_kw(fake_llm.url, tmp_path))
    assert r["score"] == 0.0 and r["reward_error"] == 1.0
    assert set(r) == {"score", "acc", "format_ok", "dcg", "ndcg10", "n_ranked", "reward_error", "s_no_memory", "s_top_k",
                      "llm_calls", "llm_failed", "shown_ndcg", "order_changed", "listing_from_rollout"}


def test_settings_from_environment(monkeypatch, fake_llm, tmp_path):
    monkeypatch.setenv("MEMSIFTER_REWARD_MODE", "task")
    monkeypatch.setenv("MEMSIFTER_REWARD_BASE_URL", fake_llm.url)
    monkeypatch.setenv("MEMSIFTER_REWARD_MODEL", "fake-env")
    monkeypatch.setenv("MEMSIFTER_REWARD_CACHE", str(tmp_path / "envcache"))
    r = compute_score_sync("s", "</think><ranking>1, 3, 0, 2, 4</ranking>", GT, EXTRA)
    assert r["llm_calls"] == 5 and fake_llm.requests[0]["model"] == "fake-env"
    with pytest.raises(ValueError, match="reward mode"):
        rewards.RewardSettings.resolve(mode="bogus")


def test_compute_score_is_a_coroutine_function_for_the_reward_loop():
    import inspect

    assert inspect.iscoroutinefunction(compute_score)
    params = inspect.signature(compute_score).parameters
    assert list(params)[:4] == ["data_source", "solution_str", "ground_truth", "extra_info"]


def qwen_like_tokenizer(tiny_model_dir: str, dest) -> str:
    """The tiny tokenizer with <think>, <ranking>, <answer> as plain added tokens, as in Qwen3: verl
    decodes responses with skip_special_tokens=True, which would strip special ones."""
    import shutil

    shutil.copytree(tiny_model_dir, dest, dirs_exist_ok=True)
    path = os.path.join(dest, "tokenizer.json")
    with open(path) as f:
        t = json.load(f)
    for a in t["added_tokens"]:
        if not a["content"].startswith("<|"):
            a["special"] = False
    with open(path, "w") as f:
        json.dump(t, f)
    cfg_path = os.path.join(dest, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for a in (cfg.get("added_tokens_decoder") or {}).values():
        if not a["content"].startswith("<|"):
            a["special"] = False
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return str(dest)


def test_through_verls_dapo_reward_manager(fake_llm, tmp_path, tiny_model_dir):
    """verl 0.9.1 loads the function from the config keys train writes and awaits it per sample."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    tok = AutoTokenizer.from_pretrained(qwen_like_tokenizer(tiny_model_dir, tmp_path / "tok"))
    assert "</ranking>" in tok.decode(tok("</ranking>")["input_ids"], skip_special_tokens=True)
    cfg = OmegaConf.create({"reward": {
        "custom_reward_function": {"path": "pkg://memsifter.training.rewards", "name": "compute_score",
                                   "reward_kwargs": _kw(fake_llm.url, tmp_path)},
        "reward_manager": {"source": "register", "name": "dapo", "module": {"path": None, "name": "x"}},
        "reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True},
                          "max_resp_len": 64},
        "reward_model": {"enable": False}, "sandbox_fusion": {"url": None}}})
    manager = load_reward_manager(cfg, tok)
    resp = "</think><ranking>2, 1, 0, 3, 4</ranking>"
    ids = tok(resp, add_special_tokens=False)["input_ids"]
    n = len(ids)
    width = 64
    responses = torch.full((1, width), tok.pad_token_id)
    responses[0, :n] = torch.tensor(ids)
    prompts = torch.full((1, 4), tok.pad_token_id)
    mask = torch.cat([torch.ones(1, 4), (torch.arange(width) < n).float().unsqueeze(0)], dim=1).long()
    data = DataProto.from_dict(tensors={"responses": responses, "prompts": prompts, "attention_mask": mask},
                               non_tensors={"data_source": ["memsifter_synth"],
                                            "reward_model": [{"style": "rule", "ground_truth": GT}],
                                            "extra_info": [EXTRA]})
    out = manager.loop.run_until_complete(manager.run_single(data))  # the worker's own loop, as in verl
    expected = C(2) * (2 / 3) + C(5) * (1 / 3)
    overlong = min(-(n - (64 - 4)) / 4, 0)  # DAPO's overlong penalty, applied by verl on top
    assert out["reward_score"] == pytest.approx(expected + overlong)
    assert out["reward_extra_info"]["acc"] == pytest.approx(expected)


def test_replacement_answer_prompt(fake_llm, tmp_path):
    tpl = tmp_path / "answer.txt"
    tpl.write_text("MEMORY:\n{history}\nQ ({date}): {current}\nReply in <answer></answer>.")
    compute_score_sync("s", "</think><ranking>1, 3, 0, 2, 4</ranking>", GT, EXTRA,
                       **_kw(fake_llm.url, tmp_path, answer_prompt=str(tpl)))
    assert all(q["messages"][0]["content"].startswith("MEMORY:\n") for q in fake_llm.requests)
    assert "Q (2023/05/01): What is the name of my dog?" in fake_llm.requests[0]["messages"][0]["content"]


def test_tier_prompts_are_chronological_whatever_the_rows_listing():
    """A history_order first_stage row lists sessions most similar first; the working LLM must still
    read the chosen ones chronologically (haystack_index), exactly as for the chronological row."""
    from memsifter.training.rewards import tier_prompts

    texts = [f"<user0>session number {i} about topic {i}</user>\n" for i in range(5)]
    dates = [f"2023/0{i + 1}/01" for i in range(5)]
    chrono = {"question": "Which topic?", "question_date": "2023/09/01", "answer": "3",
              "sessions": texts, "dates": dates}
    listing = [3, 0, 4, 1, 2]  # haystack position of each listed session (the first stage's order)
    listed = {**chrono, "sessions": [texts[i] for i in listing], "dates": [dates[i] for i in listing],
              "haystack_index": listing}
    ranking_listed = [2, 0, 4, 1]  # local ids of the listed row: haystack 4, 3, 2, 0
    ranking_chrono = [listing[i] for i in ranking_listed]
    tiers = tiers_for(4)
    a = tier_prompts(ranking_listed, tiers, listed)
    b = tier_prompts(ranking_chrono, tiers, chrono)
    assert a == b
    top2 = a[tiers.index(2)][0]["content"]
    assert top2.index("session number 3") < top2.index("session number 4")  # chronological, not rank order
    # without haystack_index the local ids are taken as chronological (the default rows)
    assert tier_prompts(ranking_listed, tiers, {k: v for k, v in listed.items() if k != "haystack_index"}) != b
