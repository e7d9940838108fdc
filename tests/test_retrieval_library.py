"""One retrieval library under every front door (issue 45 item 1): the ranker's window settings, the token
estimate and the working LLM's prompt are each declared once, and the stages, the memory service, the agents
and the reward use that one declaration. Pure unit checks: no model, no server."""

from __future__ import annotations

import pytest

from memsifter.agents import base as agents_base
from memsifter.data.model import Question, Session
from memsifter.retrieval import context, ranker, window
from memsifter.service.config import RankerSettings
from memsifter.stages import chat, prepare_rl, rank
from memsifter.training import rewards

WINDOW = tuple(window.WindowSettings.model_fields)


def _declared(f):  # noqa: ANN001, ANN202 - a pydantic FieldInfo as declared (FieldInfo has no equality)
    return f.annotation, f.default, f.description, repr(f.metadata)


@pytest.mark.parametrize("model", [rank.RankConfig, RankerSettings, prepare_rl.PrepareRLConfig])
def test_every_ranker_config_is_the_one_window_model(model):
    """rank, the service's ranker and prepare-rl declare no window field of their own: the same fields,
    defaults and descriptions (prepare-rl's context_limit alone differs: unset, a history budget instead)."""
    assert issubclass(model, window.WindowSettings)
    for name in WINDOW:
        if model is prepare_rl.PrepareRLConfig and name == "context_limit":
            assert model.model_fields[name].default is None
            continue
        assert _declared(model.model_fields[name]) == _declared(window.WindowSettings.model_fields[name]), \
            (model.__name__, name)


def test_the_service_ranker_and_the_rank_stage_share_their_defaults():
    """The drift of issue 45 (service context_limit 32,768, rank 131,072) is gone: one documented default."""
    served = RankerSettings(engine="endpoint", endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "m"})
    staged = rank.RankConfig(input="d", embeddings="e", output="o")
    assert served.context_limit == staged.context_limit == window.CONTEXT_LIMIT == 131072
    for name in WINDOW:
        assert getattr(served, name) == getattr(staged, name), name
    assert issubclass(RankerSettings, ranker.RankerOptions) and issubclass(rank.RankConfig, ranker.RankerOptions)


def test_one_token_estimate_for_chat_and_the_agents():
    texts = ["", "abcd", "x" * 17, "a longer sentence with some words in it " * 7]
    counter = chat.ApproxCounter()
    assert [counter.count(t) for t in texts] == [agents_base.approx_tokens(t) for t in texts] \
        == [context.approx_tokens(t) for t in texts]
    assert context.approx_tokens("x" * 17) == 5      # 17 / 3.4, the one constant
    msgs = [{"role": "user", "content": "x" * 10}, {"role": "assistant", "content": "y" * 7}]
    assert counter.chat_prompt_tokens(msgs) == context.approx_tokens("x" * 10 + "y" * 7)


def test_the_reward_asks_the_working_llm_with_the_chat_stage_prompt(tmp_path):
    """A tier's prompt (the reward) is the chat stage's prompt over the same sessions: same builder, slots
    and template."""
    turns = [[{"role": "user", "content": f"I adopted dog number {i}."}] for i in range(3)]
    sessions = {f"s{i}": Session(f"s{i}", t, f"2023/0{i + 1}/01") for i, t in enumerate(turns)}
    hay = list(sessions)
    q = Question(question_id="q1", dataset="d", question="Which dog?", answer="1", haystack_session_ids=hay,
                 gold_session_ids=["s1"], question_date="2023/09/01")
    template = rewards.chat_template(None)
    b = window.PromptBuilder(context.ApproxCounter(), template, limit=100000, stop_at_first_overflow=False)
    w = b.build(q.question, hay, sessions, [sessions[s].date for s in hay], hay, key=q.question_id,
                slots=window.answer_slots(q.question_date))
    assert w.session_ids == hay
    got = rewards.answer_messages(q.question, q.question_date, w.texts, w.dates)
    assert got == w.messages
    content = got[0]["content"]
    assert "2023/09/01" in content and all(f"dog number {i}" in content for i in range(3))


def test_ranked_mode_hands_the_ranker_the_corpus_sessions_themselves():
    """The service's ranked mode (``/search``, ``/retrieve``) gives the ranker the corpus's own Session objects,
    its dates and the first stage's order (no dict copy rebuilt into a stand-in haystack), and maps the
    ranker's order back over the first stage's. The ranker is a stand-in that records its request (the
    real one needs an engine: tests/test_service.py drives it); ``ranked`` is the service's own method."""
    import asyncio

    from memsifter.service.core import RetrievalService
    from memsifter.service.config import ServeConfig
    from memsifter.service.index import Corpus
    from memsifter.service.metrics import ServiceMetrics

    seen = []

    async def fake_ranker(req):  # noqa: ANN001, ANN202
        seen.append(req)
        return {"ranked_session_ids": [req.order[-1], req.order[0]], "status": "ok", "reason": None}

    sessions = [Session(f"s{i}", [{"role": "user", "content": f"turn {i}"}], f"2023/0{i + 1}/01") for i in range(5)]
    corpus = Corpus("c", sessions, [s.date for s in sessions], None)
    svc = RetrievalService.__new__(RetrievalService)   # no index to load: only ranked() is exercised
    svc.cfg = ServeConfig(index="-", ranker={"engine": "endpoint", "candidates": 3,
                                             "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}})
    svc.ranker, svc.metrics, svc.secrets = fake_ranker, ServiceMetrics(), []
    order, info = asyncio.run(svc.ranked(None, corpus, "which turn?", [3, 0, 4, 1, 2], "c:0"))
    (req,) = seen
    assert isinstance(req, ranker.RankRequest)
    assert [id(s) for s in req.sessions] == [id(sessions[i]) for i in (0, 3, 4)]   # the candidates, oldest first
    assert req.dates == ["2023/01/01", "2023/04/01", "2023/05/01"] and req.order == ["s3", "s0", "s4"]
    assert (req.question, req.key) == ("which turn?", "c:0")
    assert order == [4, 3, 0, 1, 2] and info == {"status": "ok", "reason": None}


def test_a_prompt_with_an_assistant_prefill_counts_as_the_engines_render_it(smollm2_dir):
    """The ranker's direct prompt ends with an assistant prefill ('<ranking>'): vLLM continues that message
    (Ray Data LLM's chat-template stage, ``continue_final_message`` on the endpoint and in the service). The
    count the context budget uses is that prompt's, not one with the prefill closed and a new turn opened
    (6 tokens more with SmolLM2's template: the engine counted 6 fewer per question than prompts.parquet)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    counter = context.TokenCounter(tok)
    msgs = [{"role": "system", "content": "Rank the sessions."}, {"role": "user", "content": "Which session? 1. a 2. b"},
            {"role": "assistant", "content": "<ranking>"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("<ranking>")
    assert counter.chat_prompt_tokens(msgs) == len(tok(rendered, add_special_tokens=False)["input_ids"])
    # without a prefill: the generation prompt is part of the count
    plain = msgs[:2]
    opened = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert counter.chat_prompt_tokens(plain) == len(tok(opened, add_special_tokens=False)["input_ids"])
