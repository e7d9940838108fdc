"""prepare-agents (issue 33): verl rows per (question, agent) and oracle SFT traces for the memory agents,
on real LongMemEval_S and LoCoMo questions (../shared/data); the sft stage trained on those traces, with
the loss on the assistant replies only (the mask checked token by token with SmolLM2's tokenizer)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from memsifter.agents.base import Session, Task, close_stop, requests_of
from memsifter.agents.memory import MemoryAgent, gold_evidence
from memsifter.agents.search import SearchAgent, parse_reply
from memsifter.data.model import read_dataset
from memsifter.errors import ConfigError, InputError
from memsifter.stage import get_stage, validate_config
from memsifter.store import storage

NAMES = {"agent:search": "memsifter_search", "agent:memory": "memsifter_memory",
         "agent:memory+recall": "memsifter_memory_recall"}
RECIPE = {"train": {"longmemeval_s": 6, "locomo": 8}, "test": {"longmemeval_s": 3, "locomo": 4}}


@pytest.fixture(scope="module")
def sources(shared_dir, tmp_path_factory):
    """LongMemEval_S dev30 and LoCoMo dev2 imported; a BM25 embed output of the LongMemEval questions."""
    root = tmp_path_factory.mktemp("agents-data")
    lme, loc, emb = str(root / "lme"), str(root / "loc"), str(root / "emb")
    lme_src, loc_src = shared_dir / "data" / "longmemeval_s_dev30.json.gz", shared_dir / "data" / "locomo_dev2.json.gz"
    if not lme_src.exists() or not loc_src.exists():
        pytest.skip("../shared/data lacks the LongMemEval or LoCoMo sample")
    get_stage("import").run({"output": lme, "format": "longmemeval", "source": str(lme_src)})
    get_stage("import").run({"output": loc, "format": "locomo", "source": str(loc_src)})
    get_stage("embed").run({"output": emb, "input": lme, "model": "all-MiniLM-L6-v2", "zsum": False,
                            "cascade": False})   # BM25 views only: no model is loaded
    return {"lme": lme, "loc": loc, "emb": emb, "root": root}


def _config(src: dict, out: str, **kw) -> dict:
    return {"output": out, "datasets": [src["lme"], src["loc"]], "embeddings": [src["emb"]], "recipe": RECIPE,
            **kw}


@pytest.fixture(scope="module")
def prepared(sources):
    out = str(sources["root"] / "agents")
    m = get_stage("prepare-agents").run(_config(sources, out))
    return out, m


def _rows(out: str, split: str) -> list[dict]:
    from memsifter.stages.prepare_agents import read_rows

    return read_rows(out, split)


def _traces(out: str, split: str) -> list[dict]:
    from memsifter.stages.prepare_agents import read_traces

    return read_traces(out, split)


def _datasets(src: dict):
    a, b = read_dataset(src["lme"]), read_dataset(src["loc"])
    qs = {q.question_id: q for q in a.questions + b.questions}
    return a, b, qs


# --------------------------------------------------------------------------- rows
def test_rows_carry_agent_name_gold_answer_and_the_episode_first_request(sources, prepared):
    out, m = prepared
    st = m["stats"]
    lme, loc, qs = _datasets(sources)
    assert st["questions"] == {"train": 14, "test": 7}
    assert st["rows"] == {"train": 42, "test": 21} and st["files"] == {"train": ["train_00000.parquet"],
                                                                       "test": ["test.parquet"]}
    assert st["agent_names"] == NAMES
    for split in ("train", "test"):
        rows = _rows(out, split)
        assert len(rows) == st["rows"][split]
        for r in rows:
            ei = r["extra_info"]
            q = qs[ei["question_id"]]
            assert r["agent_name"] == NAMES[ei["method"]] and r["data_source"] == "memsifter_agent"
            assert r["reward_model"] == {"style": "rule", "ground_truth": q.answer} and ei["answer"] == q.answer
            assert ei["split"] == split and ei["corpus_id"] == q.question_id and ei["dataset"] == q.dataset
            assert ei["question"] == q.question and ei["question_date"] == q.question_date
            ds = lme if q.dataset == "longmemeval_s" else loc
            # the loop rebuilds the Task from extra_info; its first request is the row's prompt
            sessions = [Session(**s) for s in ei["sessions"]]
            if ei["method"] == "agent:search":
                assert sessions == [] and ei["chunk_source"] is None
                agent, task = SearchAgent(), Task(q.question_id, q.question, q.question_date, search=lambda *_: [])
            else:
                agent = MemoryAgent(recall=ei["method"] == "agent:memory+recall")
                task = Task(q.question_id, q.question, q.question_date, sessions=sessions)
                ids = [s.session_id for s in sessions]
                hay = q.haystack_session_ids
                assert ids == [s for s in hay if s in set(ids)]   # chronological, from the haystack
                assert [s.text for s in sessions] == [
                    __import__("memsifter.retrieval.render", fromlist=["x"]).render_session(ds.sessions[s].turns)
                    for s in ids]
                if q.dataset == "locomo":     # 19 sessions: read whole
                    assert ids == hay and ei["chunk_source"] == "haystack"
                else:                         # ~48 sessions: the first stage's top 20
                    assert len(ids) == 20 < len(hay) and ei["chunk_source"] == "first_stage"
                assert ei["gold_in_chunks"] == bool(set(ids) & set(q.gold_session_ids))
            first = next(agent.episode(task))
            assert r["prompt"] == first.messages and r["prompt"][0]["role"] == "user"
            assert q.question in r["prompt"][0]["content"]
    assert st["gold_in_chunks"] >= 0.9 and st["chunks"]["max"] == 20
    assert st["prompt_tokens"]["max"] < 8192   # SmolLM2's window, counted through its chat template


def test_splits_are_disjoint_by_question_and_by_conversation(sources, prepared):
    out, m = prepared
    ids = {split: {r["extra_info"]["question_id"] for r in _rows(out, split)} for split in ("train", "test")}
    assert not ids["train"] & ids["test"]
    listed = json.loads(storage.read_text(storage.join(out, "questions.json")))
    assert {s: set(v) for s, v in listed.items()} == ids
    conv = {s: {i.split("_q")[0] for i in v if i.startswith("conv-")} for s, v in ids.items()}
    assert conv["train"] and conv["test"] and not conv["train"] & conv["test"]   # LoCoMo: by conversation
    for s in ids:   # every method has a row for every question of the split
        rows = _rows(out, s)
        assert {(r["extra_info"]["question_id"], r["extra_info"]["method"]) for r in rows} == \
            {(i, mth) for i in ids[s] for mth in NAMES}
    _, _, qs = _datasets(sources)
    for i in ids["train"] | ids["test"]:   # no abstention, adversarial or preference question
        q = qs[i]
        assert not q.abstention and not q.extra.get("adversarial") and q.gold_session_ids
        assert q.question_type != "single-session-preference"


def test_split_choice_takes_whole_conversations_and_strands_few():
    """Held-out by conversation: the smaller split takes the group that strands the fewest questions; a
    group is never in two splits; one-question groups (LongMemEval) give exact counts."""
    from memsifter.data.model import Question, Session
    from memsifter.data.splits import choose as choose_split

    sessions: dict = {}

    def conv(name: str, n: int, ds: str = "locomo") -> list[Question]:
        hay = [f"{name}_session_{i}" for i in range(3)]
        sessions.update({s: Session(s, [{"role": "user", "content": s}]) for s in hay})
        return [Question(f"{name}_q{i}", ds, f"q{i}?", "a", hay, hay[:1]) for i in range(n)]

    def choose(qs, recipe, by_group, seed):
        plan = choose_split(qs, sessions, recipe, seed, by_group=by_group)
        return plan.chosen, plan.shortfall, plan.stranded

    qs = conv("conv-26", 152) + conv("conv-30", 81) + [q for i in range(40) for q in conv(f"lme{i}", 1, "lme")]
    chosen, short, stranded = choose(qs, {"train": {"locomo": 150, "lme": 30}, "test": {"locomo": 60, "lme": 10}},
                                     True, 0)
    convs = {s: {q.question_id.split("_q")[0] for q in v if q.dataset == "locomo"} for s, v in chosen.items()}
    assert convs == {"test": {"conv-30"}, "train": {"conv-26"}}
    assert [len([q for q in chosen[s] if q.dataset == d]) for s in ("train", "test") for d in ("locomo", "lme")] == \
        [150, 30, 60, 10]
    assert short == {} and stranded == (81 - 60) + (152 - 150)
    again = choose(qs, {"train": {"locomo": 150, "lme": 30}, "test": {"locomo": 60, "lme": 10}}, True, 0)[0]
    assert {s: [q.question_id for q in v] for s, v in again.items()} == {s: [q.question_id for q in v]
                                                                          for s, v in chosen.items()}
    # more than a split can get without sharing a conversation: a shortfall, never a shared conversation
    chosen, short, _ = choose(qs, {"train": {"locomo": 200}, "test": {"locomo": 100}}, True, 0)
    assert short == {"test": {"locomo": 19}, "train": {"locomo": 48}} and len(chosen["test"]) == 81
    ids = {s: {q.question_id.split("_q")[0] for q in v} for s, v in chosen.items()}
    assert not ids["train"] & ids["test"]
    # without grouping: by question, and still by session text (a question over a held-out text is not trained on)
    from memsifter.data.splits import texts_of

    plan = choose_split(qs, sessions, {"train": {"locomo": 200}, "test": {"locomo": 33}}, 0, by_group=False)
    texts = {s: {h for q in v for h in texts_of(q, sessions)} for s, v in plan.chosen.items()}
    assert len(plan.chosen["test"]) == 33 and plan.stranded == 0 and not texts["train"] & texts["test"]
    assert plan.excluded_gold_shared["train"] > 0


def test_same_config_same_files(sources, prepared):
    out, m = prepared
    again = get_stage("prepare-agents").run(_config(sources, str(sources["root"] / "again")))
    for name in ("train_00000.parquet", "test.parquet", "sft_train.jsonl", "sft_test.jsonl"):
        assert again["files"][name]["sha256"] == m["files"][name]["sha256"], name


# --------------------------------------------------------------------------- traces
def test_traces_are_the_oracle_episodes_and_end_in_the_gold_answer(sources, prepared):
    out, m = prepared
    lme, loc, qs = _datasets(sources)
    tr = m["stats"]["traces"]
    assert tr["files"] == {"train": "sft_train.jsonl", "test": "sft_test.jsonl"}
    for split in ("train", "test"):
        recs = _traces(out, split)
        assert len(recs) == sum(tr["records"][split].values()) > 0
        rows = {(r["extra_info"]["question_id"], r["extra_info"]["method"]): r for r in _rows(out, split)}
        episodes: dict = {}
        for r in recs:
            assert r["split"] == split and (r["question_id"], r["method"]) in rows
            episodes.setdefault((r["question_id"], r["method"]), []).append(r)
            msgs = r["messages"]
            assert msgs[-1]["role"] == "assistant" and msgs[0]["role"] == "user"
            assert [x["role"] for x in msgs] == ["user", "assistant"] * (len(msgs) // 2)
            assert msgs[-1]["content"] == close_stop(msgs[-1]["content"], r["stop"])
        assert {m_ for _, m_ in episodes} == set(NAMES)
        for (qid, method), ep in episodes.items():
            q = qs[qid]
            ep.sort(key=lambda r: r["step"])
            last = ep[-1]
            # every episode ends in the gold answer, and the model saw evidence on the way
            assert last["messages"][-1]["content"] == f"<answer>{q.answer}</answer>"
            assert any(r["evidence_seen"] for r in ep)
            ds = lme if q.dataset == "longmemeval_s" else loc
            ev = gold_evidence(ds, q)
            if method == "agent:search":
                assert len(ep) == 1 and ep[0]["steps"] == 1
                msgs = ep[0]["messages"]
                assert parse_reply(msgs[1]["content"]).action == "search"
                assert msgs[2]["content"].startswith("<information>") and any(e in msgs[2]["content"] for e in ev)
                assert msgs[0] == rows[(qid, method)]["prompt"][0]
            else:
                assert ep[0]["steps"] == len(rows[(qid, method)]["extra_info"]["sessions"]) + 1 or \
                    ep[0]["steps"] > len(rows[(qid, method)]["extra_info"]["sessions"])   # long sessions split
                assert all(len(r["messages"]) == 2 for r in ep)   # each chunk request is its own trajectory
                assert last["kind"] == "answer" and last["step"] == last["steps"] - 1
                chunks = [r for r in ep if r["kind"] == "chunk"]
                plain = [r for r in chunks if not r["evidence_seen"]]
                assert len(plain) <= 4   # max_plain_chunks
                tag = "update" if method == "agent:memory+recall" else "memory"
                for r in chunks:
                    assert re.fullmatch(rf"<{tag}>.*</{tag}>", r["messages"][1]["content"], re.S)
                noted = [r for r in chunks if r["evidence_seen"]]
                assert noted and all(any(e.split(">", 1)[1][:40] in r["messages"][1]["content"] for e in ev
                                         if e in r["messages"][0]["content"]) for r in noted)
                if ep[0]["step"] == 0:   # the first chunk trajectory is the row's prompt
                    assert ep[0]["messages"][:1] == rows[(qid, method)]["prompt"]
    assert m["stats"]["traces"]["tokens"]["max"] <= 8192


def test_trace_records_equal_a_fresh_drive_of_the_agent(sources, prepared):
    """The traces are the agents' own generator driven by their oracle: rebuilt here for one LoCoMo question
    with the agent API alone, the memory agent's records are the same messages."""
    out, _ = prepared
    lme, loc, qs = _datasets(sources)
    recs = [r for r in _traces(out, "train") if r["method"] == "agent:memory" and r["dataset"] == "locomo"]
    qid = recs[0]["question_id"]
    mine = {r["step"]: r["messages"] for r in recs if r["question_id"] == qid}
    row = next(r for r in _rows(out, "train") if r["extra_info"]["question_id"] == qid
               and r["extra_info"]["method"] == "agent:memory")
    q = qs[qid]
    task = Task(q.question_id, q.question, q.question_date,
                sessions=[Session(**s) for s in row["extra_info"]["sessions"]])
    agent = MemoryAgent()
    pairs, res = requests_of(agent.episode(task), agent.oracle(task, q.answer, gold_evidence(loc, q)))
    assert res.answer == q.answer and res.format_ok
    for step, msgs in mine.items():
        req, reply = pairs[step]
        assert msgs == req.messages + [{"role": "assistant", "content": close_stop(reply, req.stop)}]


def test_search_oracle_hits_are_the_memory_services(sources, prepared):
    """The in-process search of the traces answers as the memory service's /retrieve does (same corpus,
    same scoring, same documents, read by http_search's reader)."""
    from memsifter.service.config import ServeConfig
    from memsifter.service.core import RetrievalService
    from memsifter.service.auth import Principal
    from memsifter.stages.prepare_agents import Searcher
    from memsifter.agents.search import _title, keywords

    lme, _, _ = _datasets(sources)
    svc = RetrievalService(ServeConfig(index=sources["emb"], dataset=sources["lme"], reload_poll_s=0,
                                       auth={"anonymous": {"read": ["*"]}}), start_threads=False)
    principal = svc.principal(None, None)
    assert isinstance(principal, Principal)
    searcher = Searcher([sources["emb"]], "auto")
    for q in lme.questions[:5]:
        search, how = searcher.for_question(lme, q, sources["emb"])
        assert how == "bm25"
        for query in (keywords(q.question), q.question):
            got = search(query, 3)
            want = asyncio.run(svc.retrieve(principal, [query], 3, True, q.question_id))["result"][0]
            assert [h.session_id for h in got] == [d["document"]["id"] for d in want]
            assert [(h.date, h.text) for h in got] == [_title(d["document"]["contents"]) for d in want]
            assert [h.score for h in got] == pytest.approx([d["score"] for d in want])


def test_bad_inputs_are_one_line(sources, tmp_path):
    with pytest.raises(InputError, match="no questions of dataset 'lme'") as e:
        get_stage("prepare-agents").run(_config(sources, str(tmp_path / "a"), recipe={"train": {"lme": 2}}))
    assert "\n" not in str(e.value)
    # LongMemEval's haystacks are longer than max_chunks: without a first-stage order the memory agent
    # cannot choose its sessions
    with pytest.raises(InputError, match="max_chunks=20.*embeddings") as e:
        get_stage("prepare-agents").run(_config(sources, str(tmp_path / "b"), embeddings=[],
                                                agents=["agent:memory"]))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="agents"):
        validate_config("prepare-agents", _config(sources, str(tmp_path / "c"), agents=["agent:read"]))
    with pytest.raises(ConfigError, match="agent_options"):
        validate_config("prepare-agents", _config(sources, str(tmp_path / "d"), agent_options={"x": {}}))


# --------------------------------------------------------------------------- sft on traces
def _smollm2():
    from memsifter.models import registry as models

    try:
        path = models.resolve("smollm2-135m-instruct")
    except ConfigError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path), path


def _expected_mask(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Independently of the stage: the rendered text's tokens (with offsets) and, per token, whether it lies
    in an assistant reply: its content and the end-of-turn marker after it (ChatML: ``<|im_end|>``)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans, cur = [], 0
    for msg in messages:
        head = f"<|im_start|>{msg['role']}\n"
        i = text.index(head + msg["content"] + "<|im_end|>", cur)
        cur = i + len(head) + len(msg["content"]) + len("<|im_end|>")
        if msg["role"] == "assistant":
            spans.append((i + len(head), cur))
    mask = []
    for a, b in enc["offset_mapping"]:
        inside = [s <= a and b <= e for s, e in spans]
        straddles = [a < s < b or a < e < b for s, e in spans]
        assert not any(straddles), (a, b)
        mask.append(any(inside))
    return enc["input_ids"], mask


def test_sft_trace_mask_covers_exactly_the_assistant_replies_smollm2(prepared):
    from memsifter.stages.sft import encode_chat, end_of_turn_ids

    tok, path = _smollm2()
    out, _ = prepared
    recs = _traces(out, "train")
    picked = [next(r for r in recs if r["method"] == "agent:search"),
              next(r for r in recs if r["method"] == "agent:memory+recall" and r["kind"] == "chunk"),
              next(r for r in recs if r["method"] == "agent:memory" and r["kind"] == "answer")]
    multi = {"messages": picked[0]["messages"] + [{"role": "user", "content": "and then?"},
                                                  {"role": "assistant", "content": "<answer>x</answer>"}]}
    eot = end_of_turn_ids(tok, path)
    assert tok.convert_tokens_to_ids("<|im_end|>") in eot
    for r in picked + [multi]:
        ids, labels = encode_chat(tok, r["messages"], eot)
        want_ids, want_mask = _expected_mask(tok, r["messages"])
        assert ids == want_ids == tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
        assert len(labels) == len(ids)
        for i, (t, lab, inside) in enumerate(zip(ids, labels, want_mask)):   # token by token
            assert (lab != -100) == inside, (i, tok.decode([t]))
            assert lab in (-100, t)
        # the trained spans, decoded, are the replies each followed by its end-of-turn token
        spans, cur = [], []
        for t, lab in zip(ids, labels):
            if lab != -100:
                cur.append(t)
            elif cur:
                spans.append(cur)
                cur = []
        replies = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert [tok.decode(s) for s in spans] == [c + "<|im_end|>" for c in replies]


def test_trace_replies_parse_with_the_agents_parsers(prepared):
    """The parse rate's check: every oracle reply of the traces parses, cut at its stop strings as a server
    cuts it; prose, an unclosed tag or the wrong action does not."""
    from memsifter.stages.sft import cut_at_stop, reply_parses

    out, _ = prepared
    recs = _traces(out, "test")
    for r in recs:
        text = r["messages"][-1]["content"]
        assert reply_parses(r["method"], r["kind"], cut_at_stop(text + " and more", r["stop"]), r["stop"])
        assert not reply_parses(r["method"], r["kind"], "I think it was in May.", r["stop"])
    assert cut_at_stop("<search>a</search> <answer>b</answer>", ["</search>", "</answer>"]) == "<search>a</search>"
    assert not reply_parses("agent:search", "answer", "<search>more</search>", ["</answer>"])
    assert reply_parses("agent:memory+recall", "chunk", "<update>x</update><recall>may", ["</recall>"])
    assert not reply_parses("agent:memory", "chunk", "<update>x</update>", ["</memory>"])


def test_sft_config_takes_ranker_rows_or_traces(tmp_path):
    with pytest.raises(ConfigError, match="data.*traces|traces.*data"):
        validate_config("sft", {"output": str(tmp_path / "o"), "data": "a", "traces": "b"})
    with pytest.raises(ConfigError, match="data.*traces|traces.*data"):
        validate_config("sft", {"output": str(tmp_path / "o")})
    assert validate_config("sft", {"output": str(tmp_path / "o"), "traces": "b"}).traces == "b"


@pytest.fixture(scope="module")
def short_traces(sources):
    """Traces short enough for a tiny model on the CPU: one hit of 100 tokens per search, small chunks."""
    out = str(sources["root"] / "short")
    get_stage("prepare-agents").run(_config(
        sources, out, recipe={"train": {"locomo": 12}, "test": {"locomo": 4}}, tokenizer=None,
        agents=["agent:search", "agent:memory"], max_plain_chunks=1,
        agent_options={"agent:search": {"topk": 1, "hit_tokens": 100, "max_turns": 1},
                       "agent:memory": {"chunk_tokens": 200, "memory_tokens": 64}}))
    return out


def test_sft_on_traces_lowers_the_loss(short_traces, tiny_model_dir, tmp_path):
    out = str(tmp_path / "sft-traces")
    m = get_stage("sft").run({"output": out, "model": tiny_model_dir, "traces": short_traces, "lora_rank": 0,
                              "lr": 1e-2, "epochs": 5, "batch_tokens": 6000, "eval_generate": 2,
                              "device": "cpu", "max_rows": 16})
    st = m["stats"]
    assert st["rows"] == 16 and st["eval_rows"] > 0 and st["artifact"] == "model"
    recs = [json.loads(x) for x in storage.read_text(storage.join(out, "metrics.jsonl")).splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert len(evals) == 6 and {"eval_loss", "parse_rate", "rows"} <= set(evals[0])
    assert 0.0 <= evals[-1]["parse_rate"] <= 1.0 and evals[-1]["rows"] == 2
    first = sum(r["loss"] for r in train[:2]) / 2
    last = sum(r["loss"] for r in train[-2:]) / 2
    assert last < 0.7 * first, (first, last)   # measured: 5.8 -> 3.4
    assert evals[-1]["eval_loss"] < 0.8 * evals[0]["eval_loss"]   # measured: 6.0 -> 4.0
    assert st["before"]["eval_loss"] > st["after"]["eval_loss"]


def test_several_search_traces_per_question_open_with_other_queries(sources, prepared):
    """search_traces=3 (with search_retry): per question up to three search episodes, opening with the keywords,
    the question and the keywords' second half; each trace still ends in the gold answer with the evidence shown,
    none is written twice, variant 0 is the single-trace default's episode, and more questions or as many get a
    trace as with one."""
    from memsifter.agents.search import query_variants

    out = str(sources["root"] / "agents-3")
    get_stage("prepare-agents").run(_config(sources, out, agents=["agent:search"], search_traces=3,
                                            search_retry=True))
    one = [t for t in _traces(prepared[0], "train") if t["method"] == "agent:search"]
    many = _traces(out, "train")
    _, _, qs = _datasets(sources)
    assert len(many) > len(one) and {t["question_id"] for t in many} >= {t["question_id"] for t in one}
    keys = [json.dumps(t["messages"], sort_keys=True) for t in many]
    assert len(keys) == len(set(keys))
    for t in many:
        q = qs[t["question_id"]]
        assert t["messages"][-1]["content"] == f"<answer>{q.answer}</answer>" and t["evidence_seen"]
        first = t["messages"][1]["content"]
        assert first == f"<search>{query_variants(q.question)[t['variant']]}</search>"
    base = {t["question_id"]: t["messages"] for t in one}
    assert all(t["messages"] == base[t["question_id"]] for t in many if t["variant"] == 0 and t["question_id"] in base)
    assert {t["variant"] for t in many} == {0, 1, 2}
