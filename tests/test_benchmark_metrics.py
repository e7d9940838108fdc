"""The benchmarks' own metrics (LoCoMo QA F1, LongMemEval retrieval and judge) and the answer tables'
reference rows (constant answer chosen on the other half, paired differences). Expected values are
worked out by hand from the reference scripts' rules (LoCoMo task_eval/evaluation.py, LongMemEval
src/retrieval/eval_utils.py, run_retrieval.py and src/evaluation/evaluate_qa.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from memsifter.retrieval import screen
from memsifter.data.model import Dataset, Question, Session
from memsifter.retrieval import benchmark_metrics as bm
from memsifter.retrieval import rankings
from memsifter.retrieval.metrics import bootstrap_ci, ndcg, token_f1
from memsifter.stage import get_stage
from memsifter.stages.chat import random_order
from memsifter.store import storage


# --------------------------------------------------------------------------- LoCoMo QA F1
def test_locomo_normalization_deletes_commas_and_punctuation_and_drops_and():
    # commas and punctuation deleted (no space in their place), a/an/the/and dropped, case folded
    assert bm.locomo_normalize("The Sept-2023, and a dog!") == "sept2023 dog"
    assert bm.locomo_normalize("1,000 dollars") == "1000 dollars"


def test_locomo_f1_stems_words():
    # Porter: running -> run, dogs -> dog: LoCoMo scores 1.0 where plain token F1 finds nothing in common
    assert bm.locomo_qa_score("running dogs", "run dog", 4) == pytest.approx(1.0)
    assert token_f1("running dogs", "run dog") == 0.0
    # "painted pottery" vs gold "painting, pottery" in a single-hop question: no comma split, commas deleted,
    # paint/pottery on both sides
    assert bm.locomo_qa_score("painted pottery", "painting, pottery", 2) == pytest.approx(1.0)


def test_locomo_multi_hop_splits_at_commas():
    # gold parts Paris | London; the one prediction part "London" matches London only: (0 + 1) / 2
    assert bm.locomo_qa_score("London", "Paris, London", 1) == pytest.approx(0.5)
    # the same pair without the split (categories 2-4) is the F1 of 1 common token of 1 and 2: 2/3
    assert bm.locomo_qa_score("London", "Paris, London", 4) == pytest.approx(2 / 3)
    assert bm.locomo_qa_score("London, Paris", "Paris, London", 1) == pytest.approx(1.0)
    # parts "Paris and Rome" | "London": gold Paris best 2/3 ("paris rome" vs "paris"), gold London 1 -> 5/6
    assert bm.locomo_qa_score("Paris and Rome, London", "Paris, London", 1) == pytest.approx(5 / 6)


def test_locomo_open_domain_gold_cut_at_semicolon():
    # category 3: gold "Likely yes; she mentions wanting to" is cut to "Likely yes" -> 1.0
    assert bm.locomo_qa_score("likely yes", "Likely yes; she mentions wanting to", 3) == pytest.approx(1.0)
    # not cut (category 4): 2 common tokens of 2 predicted and 6 gold -> P 1, R 1/3, F1 0.5
    assert bm.locomo_qa_score("likely yes", "Likely yes; she mentions wanting to", 4) == pytest.approx(0.5)


def test_locomo_adversarial_scores_abstention_only():
    gold = "She went to Paris"
    assert bm.locomo_qa_score("Not mentioned in the conversation", gold, 5) == 1.0
    assert bm.locomo_qa_score("No information available.", gold, 5) == 1.0
    assert bm.locomo_qa_score("NOT MENTIONED", gold, 5) == 1.0
    assert bm.locomo_qa_score(gold, gold, 5) == 0.0          # the gold text itself scores nothing
    assert bm.locomo_qa_score(None, gold, 5) == 0.0
    with pytest.raises(ValueError):
        bm.locomo_qa_score("x", "y", 7)


# --------------------------------------------------------------------------- LongMemEval retrieval
def test_longmemeval_retrieval_weighs_ranks_one_and_two_the_same():
    ranked = ["f1", "g1", "f2", "g2", "f3"]
    m = bm.lme_retrieval(ranked, {"g1", "g2"}, 5)
    # DCG: 0 + 1/log2(2) (rank 2) + 1/log2(4) (rank 4) = 1.5; ideal 1 + 1/log2(2) = 2
    assert m == {"recall_any@5": 1.0, "recall_all@5": 1.0, "ndcg_any@5": pytest.approx(0.75)}
    assert ndcg(ranked, ["g1", "g2"], 5) == pytest.approx((1 / 1.5849625 + 1 / 2.3219281) / (1 + 1 / 1.5849625))
    m3 = bm.lme_retrieval(ranked, {"g1", "g2"}, 3)
    assert m3 == {"recall_any@3": 1.0, "recall_all@3": 0.0, "ndcg_any@3": pytest.approx(0.5)}
    assert bm.lme_retrieval(["g1", "f1"], {"g1"}, 1) == {"recall_any@1": 1.0, "recall_all@1": 1.0, "ndcg_any@1": 1.0}


def _lme_dataset() -> Dataset:
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    sessions = {s: Session(s, turns) for s in ("answer_1", "answer_2", "answer_3", "f1", "f2", "f3")}
    hay = ["f1", "answer_1", "f2", "answer_2", "f3", "answer_3"]
    lme = "longmemeval_s"
    return Dataset(sessions, [
        # both answer sessions flagged on a user turn: both relevant
        Question("q1", lme, "?", "x", hay, ["answer_1", "answer_2"], question_type="multi-session",
                 extra={"answer_turns": {"answer_1": [0], "answer_2": [0]}}),
        # answer_2 flagged only on an assistant turn: not relevant (LongMemEval renames it 'noans')
        Question("q2", lme, "?", "x", hay, ["answer_1", "answer_2"], question_type="multi-session",
                 extra={"answer_turns": {"answer_1": [0], "answer_2": [1]}}),
        # abstention: left out
        Question("q3_abs", lme, "?", "x", hay, ["answer_3"], question_type="temporal-reasoning",
                 extra={"abstention": True, "answer_turns": {"answer_3": [0]}}),
        # no flagged user turn at all: left out
        Question("q4", lme, "?", "x", hay, ["answer_3"], question_type="temporal-reasoning"),
        # another dataset: not LongMemEval's
        Question("q5", "locomo", "?", "x", hay, ["answer_1"], question_type="single-hop", extra={"category": 4}),
    ])


def test_longmemeval_counts_non_abstention_questions_with_a_flagged_user_turn():
    ds = _lme_dataset()
    rows = [{"question_id": q.question_id, "ranked_session_ids": ["answer_1", "f1", "f2", "answer_2", "f3", "answer_3"]}
            for q in ds.questions]
    per_q, how = bm.lme_retrieval_per_question(rows, ds.questions, ds.sessions, [1, 5])
    assert how == "has_answer user turns"
    assert set(per_q) == {"q1", "q2"}
    assert per_q["q1"]["recall_all@1"] == 0.0 and per_q["q1"]["recall_all@5"] == 1.0
    assert per_q["q2"]["recall_all@1"] == 1.0          # only answer_1 is relevant for q2
    # q1: relevant at ranks 1 and 4: (1 + 1/log2(4)) / (1 + 1/log2(2)) = 0.75
    assert per_q["q1"]["ndcg_any@5"] == pytest.approx(0.75)
    # a dataset that recorded no has_answer flags: its gold sessions as they are
    bare = [Question(q.question_id, q.dataset, q.question, q.answer, q.haystack_session_ids, q.gold_session_ids,
                     question_type=q.question_type, extra={k: v for k, v in q.extra.items() if k != "answer_turns"})
            for q in ds.questions]
    per_q, how = bm.lme_retrieval_per_question(rows, bare, ds.sessions, [5])
    assert how.startswith("gold sessions") and set(per_q) == {"q1", "q2", "q4"}


# --------------------------------------------------------------------------- LongMemEval judge prompts
def test_longmemeval_judge_prompt_per_type_and_label():
    ds = _lme_dataset()
    q1, _, q3, q4, q5 = ds.questions
    p = bm.lme_judge_prompt(q1, "my reply")
    assert p.startswith("I will give you a question, a correct answer, and a response from a model.")
    assert "\n\nQuestion: ?\n\nCorrect Answer: x\n\nModel Response: my reply\n\n" in p
    assert p.endswith("Is the model response correct? Answer yes or no only.") and "off-by-one" not in p
    assert "off-by-one" in bm.lme_judge_prompt(q4, "r")                      # temporal-reasoning
    assert "unanswerable" in bm.lme_judge_prompt(q3, "r") and "Explanation: x" in bm.lme_judge_prompt(q3, "r")
    pref = Question("p", "longmemeval_s", "?", "rubric", [], [], question_type="single-session-preference")
    assert "Rubric: rubric" in bm.lme_judge_prompt(pref, "r")
    ku = Question("k", "longmemeval_s", "?", "x", [], [], question_type="knowledge-update")
    assert "updated answer" in bm.lme_judge_prompt(ku, "r")
    assert bm.lme_judge_prompt(q5, "r") is None                               # no prompt for that type
    assert [bm.lme_judge_label(t) for t in ("Yes.", "no", "eyes", None)] == [1.0, 0.0, 1.0, None]
    s = bm.lme_judge_summary([
        {"question_type": "a", "lme_judge": 1.0}, {"question_type": "a", "lme_judge": 0.0},
        {"question_type": "b", "lme_judge": 1.0, "abstention": True}, {"question_type": "b", "lme_judge": None}])
    # accuracy 2/3; task-averaged (0.5 + 1) / 2; abstention 1 of 1
    assert s["n"] == 3 and s["accuracy"] == pytest.approx(0.6667) and s["task_averaged"] == 0.75
    assert s["abstention"] == {"n": 1, "accuracy": 1.0}


# --------------------------------------------------------------------------- reference rows
def _q(qid, conv, answer, ds="locomo"):
    return Question(qid, ds, "?", answer, [f"{conv}_s1", f"{conv}_s2"], [f"{conv}_s1"], question_type="single-hop",
                    extra={"category": 4})


def test_constant_answer_is_chosen_on_the_other_conversation():
    qs = [_q("a1", "A", "Paris"), _q("a2", "A", "Paris"), _q("a3", "A", "2023"),
          _q("b1", "B", "2023"), _q("b2", "B", "2023"), _q("b3", "B", "London")]
    c = bm.constant_answer(qs, lambda cand, q: token_f1(cand, q.answer))
    assert c["split"] == {"locomo": "by conversation"}
    # A's constant is chosen on B ("2023": 2/3 there), B's on A ("Paris": 2/3): not the pooled best
    assert [p["answer"] for p in c["chosen"]["locomo"]] == ["2023", "Paris"]
    assert c["per_question"] == {"a1": 0.0, "a2": 0.0, "a3": 1.0, "b1": 0.0, "b2": 0.0, "b3": 0.0}
    # one conversation: its first and second half of questions
    one = bm.constant_answer(qs[:3], lambda cand, q: token_f1(cand, q.answer))
    assert one["split"] == {"locomo": "by question (one conversation)"}
    assert one["answer_of"] == {"a1": "2023", "a2": "2023", "a3": "Paris"}
    # extra candidates (LoCoMo's abstention option) win where they score best on the other half
    adv = [Question(f"x{i}", "locomo", "?", "Paris", [f"{i}"], [], extra={"category": 5}) for i in range(4)]
    lo = bm.constant_answer(adv, lambda cand, q: bm.locomo_qa_score(cand, q.answer, 5),
                            extra_candidates=lambda q: [bm.LOCOMO_NOT_MENTIONED])
    assert set(lo["answer_of"].values()) == {bm.LOCOMO_NOT_MENTIONED} and set(lo["per_question"].values()) == {1.0}


def test_paired_difference_over_common_questions():
    d = bm.paired_difference({"a": 1.0, "b": 0.0, "c": 1.0}, {"a": 0.0, "b": 0.0, "c": 1.0, "d": 1.0})
    lo, hi = bootstrap_ci([1.0, 0.0, 0.0])
    assert d == {"n": 3, "diff": pytest.approx(0.3333), "ci_low": round(lo, 4), "ci_high": round(hi, 4)}
    assert bm.paired_difference({"a": 1.0}, {"b": 1.0}) is None


def test_random_sessions_order_is_seeded_per_question():
    q1 = Question("q1", "d", "?", "x", [f"s{i}" for i in range(20)], [])
    q2 = Question("q2", "d", "?", "x", [f"s{i}" for i in range(20)], [])
    o = random_order(q1, 0)
    assert sorted(o) == sorted(q1.haystack_session_ids) and o != q1.haystack_session_ids
    assert o == random_order(q1, 0) and o != random_order(q2, 0) and o != random_order(q1, 1)


# --------------------------------------------------------------------------- evaluate
def _publish(uri, stage_name, write, stats=None, config=None):
    pub = storage.Publication(uri, stage_name, config or {}, "x", "test")
    write(pub)
    pub.publish(stats or {})


def test_evaluate_reports_benchmark_metrics_and_reference_rows(tmp_path):
    """evaluate puts LoCoMo's F1 beside ours, LongMemEval's retrieval metrics beside ours, the constant
    answer row (chosen on the other conversation) and every method's paired difference to the strongest
    reference, in the JSON, the Markdown and the manifest's stats."""
    turns = [{"role": "user", "content": "u"}]
    sessions = {s: Session(s, turns) for s in ("A_s1", "A_s2", "B_s1", "B_s2", "answer_1", "f1")}
    qs = [_q("a1", "A", "running dogs"), _q("a2", "A", "running dogs"), _q("b1", "B", "Paris, London"),
          _q("b2", "B", "running dogs"),
          Question("l1", "longmemeval_s", "?", "x", ["f1", "answer_1"], ["answer_1"],
                   question_type="multi-session", extra={"answer_turns": {"answer_1": [0]}})]
    qs[2].extra["category"] = 1
    ds = Dataset(sessions, qs)
    root = str(tmp_path)
    data = storage.join(root, "data")
    _publish(data, "synth", ds.write)
    ranked = [{"question_id": q.question_id, "ranked_session_ids": [s for s in q.haystack_session_ids
                                                                    if s not in q.gold_session_ids] + q.gold_session_ids,
               "scores": None, "method": "embed:x", "status": "ok", "reason": None, "raw_response": None} for q in qs]
    emb = storage.join(root, "embed")
    _publish(emb, "embed", lambda p: rankings.write_rankings(p, ranked))
    answers = {"embed:x": {"a1": "run dog", "a2": "run dog", "b1": "London", "b2": "x", "l1": "y"},
               "no memory": {"a1": "no", "a2": "no", "b1": "no", "b2": "no", "l1": "no"}}
    rows = [{"question_id": qid, "method": m, "dataset": ds.question(qid).dataset,
             "question_type": ds.question(qid).question_type, "answer": a, "status": "ok", "ranking_status": None,
             "exact_match": 0.0, "f1": token_f1(a, ds.question(qid).answer), "judge": None}
            for m, ans in answers.items() for qid, a in ans.items()]
    chat = storage.join(root, "chat")
    _publish(chat, "chat", lambda p: p.write_table("answers.parquet", pa.Table.from_pylist(rows)),
             stats={"methods": {"embed:x": {"source": emb, "kind": "rankings", "ranking_status": {"ok": 5}},
                                "no memory": {"source": "none", "kind": "none", "ranking_status": {}}}},
             config={"endpoint": {"model": "m"}})
    out = storage.join(root, "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "rankings": [emb], "answers": [chat]})
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    a = report["answers"]
    # LoCoMo F1: a1, a2 1.0 (stems), b1 0.5 (multi-hop split), b2 0; ours: 0, 0, 2/3, 0 and l1 0
    assert a["embed:x"]["overall"]["locomo_f1"] == pytest.approx(0.625)
    assert a["embed:x"]["by_type"]["single-hop"]["locomo_f1"] == pytest.approx(0.625)
    assert a["embed:x"]["overall"]["f1"] == pytest.approx(round((2 / 3) / 5, 4))
    # the constant: A's chosen on B (gold answers "Paris, London", "running dogs": tie, the first), B's on A
    const = a["constant answer"]
    assert const["kind"] == "constant"
    assert [p["answer"] for p in const["constant"]["f1"]["chosen"]["locomo"]] == ["Paris, London", "running dogs"]
    # per question F1: a1 0, a2 0 (Paris, London vs running dogs), b1 0, b2 1; l1: one question, chosen on none
    assert const["overall"]["n"] == 4 and const["overall"]["f1"] == pytest.approx(0.25)
    refs = report["references"]
    assert set(refs["labels"]) == {"no memory", "constant answer"} and refs["strongest"]["f1"] == "constant answer"
    vs = a["embed:x"]["vs_reference"]["f1"]
    # embed:x minus constant over a1, a2, b1, b2: (0 + 0 + 2/3 - 1) / 4
    assert vs["reference"] == "constant answer" and vs["n"] == 4 and vs["diff"] == pytest.approx(-0.0833, abs=1e-4)
    assert "vs_reference" not in a["no memory"]
    # LongMemEval's retrieval metrics: l1's gold at rank 2 -> ndcg_any@5 = 1 (ranks 1 and 2 weigh the same)
    lme = report["retrieval"]["embed:x"]["longmemeval"]
    assert lme["n"] == 1 and lme["overall"]["ndcg_any@5"] == 1.0 and report["retrieval"]["embed:x"]["overall"][
        "ndcg@5"] < 1.0
    md = storage.read_text(storage.join(out, "report.md"))
    assert "LoCoMo F1" in md and "ΔF1 vs ref" in md and "| constant answer |" in md
    assert "### LongMemEval's own retrieval metrics" in md and "chosen on 2 questions" in md
    st = m["stats"]
    assert st["answers"]["embed:x"]["vs_reference"]["f1"]["reference"] == "constant answer"
    assert st["answers"]["constant answer"]["kind"] == "constant"
    assert st["retrieval"]["embed:x"]["longmemeval"]["ndcg_any@5"] == 1.0
    # the demo's answers table: the reference rows first, both F1s, the difference to the strongest reference
    lines = screen.answers_table({"mixed": {"evaluate": m, "embed": {"stats": {"primary": "x"}}}}, width=120)
    assert all(len(ln) <= 120 for ln in lines), lines
    body = [ln for ln in lines if ln.startswith(("no memory", "constant answer", "embed:x"))]
    assert [ln.split()[0] for ln in body] == ["no", "constant", "embed:x"], lines
    assert "0.625" in body[2] and "-0.08 [" in body[2] and "LoCoMo" in lines[0] and "ΔF1 vs ref" in lines[0]
    assert "strongest reference's (constant answer)" in " ".join(lines)


def _judge_setup(root: str) -> tuple[str, str, Dataset]:
    ds = _lme_dataset()
    data = storage.join(root, "data")
    _publish(data, "synth", ds.write)
    rows = [{"question_id": q.question_id, "method": "m", "dataset": q.dataset, "question_type": q.question_type,
             "answer": "x", "status": "ok", "ranking_status": None, "exact_match": 1.0, "f1": 1.0, "judge": None}
            for q in ds.questions]
    chat = storage.join(root, "chat")
    _publish(chat, "chat", lambda p: p.write_table("answers.parquet", pa.Table.from_pylist(rows)))
    return data, chat, ds


def test_longmemeval_judge_on_a_real_vllm_server(vllm_endpoint, tmp_path):
    """LongMemEval's judge through a real OpenAI-compatible server (vLLM on the CPU with the shared session
    fixture's tiny random model: its verdicts are noise, the path is real): one request per answered
    LongMemEval row (the LoCoMo row is not judged), LongMemEval's prompt per type, 'yes' in the reply =
    correct, accuracy / task-averaged / abstention in the report and the stats, the verdicts file."""
    data, chat, ds = _judge_setup(str(tmp_path))
    out = storage.join(str(tmp_path), "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "answers": [chat],
                                   "lme_judge": {"base_url": vllm_endpoint, "model": "tiny", "api_key_env": None}})
    verdicts = storage.read_parquet(storage.join(out, "longmemeval_judge.parquet")).to_pylist()
    assert [(v["question_id"], v["prompt"]) for v in verdicts] == [
        ("q1", "default"), ("q2", "default"), ("q3_abs", "abstention"), ("q4", "temporal")]
    assert all(v["correct"] == float("yes" in (v["reply"] or "").lower()) for v in verdicts)
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    assert report["longmemeval_judge"]["client"]["requests"] == 4 and report["longmemeval_judge"]["max_tokens"] == 10
    s = report["answers"]["m"]["longmemeval_judge"]
    correct = [v["correct"] for v in verdicts]
    assert s["n"] == 4 and s["accuracy"] == round(sum(correct) / 4, 4)
    assert s["abstention"] == {"n": 1, "accuracy": correct[2]}
    by_type = {"multi-session": correct[:2], "temporal-reasoning": correct[2:]}
    assert s["task_averaged"] == round(sum(sum(v) / len(v) for v in by_type.values()) / 2, 4)
    assert m["stats"]["answers"]["m"]["longmemeval_judge"]["accuracy"] == s["accuracy"]
    assert "### LongMemEval's judge" in storage.read_text(storage.join(out, "report.md"))
    # what was sent: LongMemEval's prompt for each question as one user message, temperature 0, 10 tokens (the
    # request cache is keyed by model, messages and parameters; q1 and q2 send the same prompt)
    from memsifter.models.llm import LLMEndpoint, request_key

    params = LLMEndpoint(base_url=vllm_endpoint, model="tiny", api_key_env=None).params(temperature=0.0, max_tokens=10)
    want = {request_key("tiny", [{"role": "user", "content": bm.lme_judge_prompt(ds.question(q), "x")}], params)
            for q in ("q1", "q2", "q3_abs", "q4")}
    cache = storage.join(out, "_work", "llm-cache", "lme-judge")
    sent = {json.loads(line)["key"] for f in storage.list_files(cache)
            for line in storage.read_text(storage.join(cache, f)).splitlines() if line.strip()}
    assert len(want) == 3 and sent == want


def test_longmemeval_judge_failure_publishes_nothing(tmp_path):
    """A judge endpoint that cannot be reached fails the stage in one line naming it; nothing is published."""
    from memsifter.errors import MemsifterError
    from memsifter.testing.servers import free_port

    data, chat, _ = _judge_setup(str(tmp_path))
    out = storage.join(str(tmp_path), "eval")
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(MemsifterError, match="LongMemEval judge requests to http://127.0.0.1"):
        get_stage("evaluate").run({"output": out, "input": data, "answers": [chat],
                                   "lme_judge": {"base_url": url, "model": "j", "api_key_env": None,
                                                 "max_retries": 0, "timeout_s": 5}})
    assert not storage.exists(storage.join(out, "report.json"))


def test_longmemeval_judge_endpoint_is_never_implied(monkeypatch):
    """The judge is off by default; on, its endpoint must be named (no request goes to a server the user did
    not name): one line naming the field, before anything runs."""
    from memsifter.errors import ConfigError
    from memsifter.stages.evaluate import EvaluateConfig

    for var in ("MEMSIFTER_LLM_BASE_URL", "OPENAI_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    assert EvaluateConfig(output="o", input="i").lme_judge is None
    with pytest.raises(ConfigError, match=r"lme_judge\.base_url is not set"):
        EvaluateConfig(output="o", input="i", lme_judge={"model": "j"}).preflight()
