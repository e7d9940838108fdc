"""Task reward against a real vLLM (CPU) OpenAI-compatible server with the tiny model, temperature 0."""

from __future__ import annotations

import pytest

from memsifter.retrieval.metrics import token_f1
from memsifter.training.rewards import answer_messages, combine_tiers, score_batch, tiers_for
from memsifter.stages.chat import extract_answer

pytestmark = pytest.mark.slow

SESSIONS = ["<user0>I adopted a dog named Biscuit.</user>\n<assistant0>Congratulations!</assistant>\n",
            "<user0>How do I cook lentils?</user>\n",
            "<user0>Biscuit chewed my shoes.</user>\n",
            "<user0>What is a good budget app?</user>\n"]
EXTRA = {"question": "What is the name of my dog?", "question_date": "2023/05/01", "answer": "Biscuit",
         "sessions": SESSIONS, "dates": ["2023/01/01", "2023/02/01", "2023/03/01", "2023/04/01"],
         "dataset": "synth"}


def test_task_reward_with_a_real_vllm_server(vllm_endpoint, tmp_path):
    import openai

    kw = {"mode": "task", "base_url": vllm_endpoint, "model": "tiny", "temperature": 0.0, "max_tokens": 12,
          "cache_uri": str(tmp_path / "cache")}
    resp = "The dog sessions.</think><ranking>2, 0, 3, 1</ranking>"
    samples = [{"data_source": "memsifter_synth", "solution_str": resp, "ground_truth": "0,2;4", "extra_info": EXTRA},
               {"data_source": "memsifter_synth", "solution_str": "<think>unfinished", "ground_truth": "0,2;4",
                "extra_info": EXTRA}]
    out = score_batch(samples, **kw)
    assert out[1]["score"] == 0.0 and out[1]["format_ok"] == 0.0 and out[1]["llm_calls"] == 0
    r = out[0]
    assert r["format_ok"] == 1.0 and r["llm_failed"] == 0 and r["llm_calls"] == len(tiers_for(4)) == 5
    # recompute by hand: ask the server each tier's prompt directly, score with token F1, combine
    client = openai.OpenAI(base_url=vllm_endpoint, api_key="EMPTY")
    ranked = [2, 0, 3, 1]
    scores = []
    for t in tiers_for(4):
        chosen = sorted(ranked[:t])
        msgs = answer_messages(EXTRA["question"], EXTRA["question_date"], [SESSIONS[i] for i in chosen],
                               [EXTRA["dates"][i] for i in chosen])
        text = client.chat.completions.create(model="tiny", messages=msgs, temperature=0.0,
                                              max_tokens=12).choices[0].message.content
        scores.append(token_f1(extract_answer(text), "Biscuit"))
    assert r["score"] == pytest.approx(combine_tiers(tiers_for(4), scores))
    assert r["s_no_memory"] == pytest.approx(scores[0]) and r["s_top_k"] == pytest.approx(scores[-1])
    # temperature 0: a fresh cache gives the same reward
    again = score_batch(samples[:1], **{**kw, "cache_uri": str(tmp_path / "cache2")})
    assert again[0]["score"] == pytest.approx(r["score"])
