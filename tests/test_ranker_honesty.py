"""Rankers that show what they do (issue 34): every ranker's report says how often it changed the
order it was given (its input: the first stage's order) and its mean Kendall tau to it, and a ranker
that changes nothing reads as "returns its input order", never as trained to rank. The demo's tables
compare methods on the same questions, with n and intervals.

Real parts throughout: the evaluate stage on a local store, the demo's table functions fed the
evaluate manifest (no vLLM: the demo itself is tests/test_demo.py)."""

from __future__ import annotations

import json
import math
from importlib import resources

import pyarrow as pa
import pytest

from memsifter import demo
from memsifter.retrieval import screen
from memsifter.retrieval import metrics, rankings
from memsifter.models import registry as models
from memsifter.store import storage
from memsifter.data.model import Dataset, Question, Session
from memsifter.stage import get_stage

INPUT = ["a", "b", "c", "d", "e", "f"]


@pytest.mark.parametrize("name, ranked, shown, k, changed, tau", [
    # the ranker's output is its input: nothing changed, tau 1
    ("identity", INPUT, None, 10, 0.0, 1.0),
    ("identity over shown", INPUT, ["a", "b", "c"], 10, 0.0, 1.0),
    # a reversed order: every pair discordant
    ("reversed", list(reversed(INPUT)), None, 10, 1.0, -1.0),
    ("reversed shown", ["c", "b", "a", "d", "e", "f"], ["a", "b", "c"], 10, 1.0, -1.0),
    # a swap of the top two: changed; 1 of the 15 pairs discordant
    ("swap of two", ["b", "a", "c", "d", "e", "f"], None, 10, 1.0, 1 - 2 * 1 / 15),
    # a swap among sessions the ranker was not shown does not count as its change
    ("swap outside shown", ["a", "b", "c", "e", "d", "f"], ["a", "b", "c"], 10, 0.0, 1.0),
    # no shown sessions recorded: compared over the top-k of both orders; promoting "d" into the top 2
    # changes the order ("a", "d", "b" against "a", "b", "d": one of three pairs discordant)
    ("promotion into top-k", ["a", "d", "b", "c", "e", "f"], None, 2, 1.0, 1 - 2 * 1 / 3),
    # one session shown: nothing the ranker could reorder; tau undefined
    ("one shown", INPUT, ["a"], 10, 0.0, None),
])
def test_order_change_against_input(name, ranked, shown, k, changed, tau):
    got = metrics.order_change(ranked, INPUT, shown=shown, k=k)
    assert got["changed"] == changed, name
    if tau is None:
        assert got["tau"] is None, name
    else:
        assert got["tau"] == pytest.approx(tau), name


@pytest.mark.parametrize("order, reference, tau", [
    (["a", "b", "c"], ["a", "b", "c"], 1.0),
    (["c", "b", "a"], ["a", "b", "c"], -1.0),
    (["b", "a", "c"], ["a", "b", "c"], 1 / 3),
    (["a"], ["a"], None),
    (["x", "a", "b"], ["b", "y", "a"], -1.0),   # only the items both orders hold are compared
])
def test_kendall_tau(order, reference, tau):
    got = metrics.kendall_tau(order, reference)
    assert got == (None if tau is None else pytest.approx(tau))


@pytest.mark.parametrize("name, per_question, share, tau, returns_input", [
    ("identity everywhere", [(0.0, 1.0)] * 4, 0.0, 1.0, True),
    ("one swap in four", [(0.0, 1.0)] * 3 + [(1.0, 0.6)], 0.25, 0.9, False),
    ("all reversed", [(1.0, -1.0)] * 2, 1.0, -1.0, False),
    ("a swap of two", [(1.0, 13 / 15)], 1.0, 13 / 15, False),
    ("nothing comparable", [(0.0, None)] * 2, 0.0, None, True),
])
def test_order_change_summary(name, per_question, share, tau, returns_input):
    s = metrics.order_change_summary([{"changed": c, "tau": t} for c, t in per_question])
    assert s["n"] == len(per_question), name
    assert s["changed_share"] == pytest.approx(share) and s["changed"] == round(share * len(per_question))
    assert (s["tau_mean"] is None) if tau is None else s["tau_mean"] == pytest.approx(tau, abs=1e-4)  # rounded
    assert s["returns_input_order"] is returns_input, name
    assert s["ci"]["changed_share"]["n"] == len(per_question)
    assert ("returns its input order" in metrics.order_change_note(s)) is returns_input
    assert metrics.order_change_summary([]) is None


# --------------------------------------------------------------------------- evaluate + demo tables
HAY = [f"s{i}" for i in range(8)]
SHOWN = ["s3", "s1", "s0", "s2"]                # what the ranker was shown (first-stage order: s3 s1 s0 s2 …)
FIRST = ["s3", "s1", "s0", "s2", "s7", "s6", "s5", "s4"]
TRAINED_LABEL = f"rank:{demo.TRAINED}"


def _dataset() -> Dataset:
    sessions = {s: Session(s, [{"role": "user", "content": f"text {s}"}], "2024-01-01") for s in HAY}
    qs = [Question(f"q{i}", "locomo", f"question {i}?", "x", HAY, [g], question_type="single")
          for i, g in enumerate(["s0", "s3", "s1", "s2", "s7"])]
    return Dataset(sessions, qs)


def _row(qid: str, ranked: list[str], method: str, status: str = "ok") -> dict:
    return {"question_id": qid, "ranked_session_ids": ranked, "scores": None, "method": method, "status": status,
            "reason": None, "raw_response": None}


def _publish(uri: str, stage_name: str, config: dict, write) -> None:
    pub = storage.Publication(uri, stage_name, config, "x", "test")
    write(pub)
    pub.publish({})


def _rank_output(uri: str, emb: str, rows: list[dict]) -> None:
    def write(p):
        rankings.write_rankings(p, rows)
        p.write_table("prompts.parquet", pa.table({"question_id": [r["question_id"] for r in rows],
                                                   "shown_session_ids": [SHOWN for _ in rows]}))
    _publish(uri, "rank", {"embeddings": emb, "model": "x"}, write)


@pytest.fixture()
def evaluated(tmp_path):
    """A dataset of 5 questions; the first stage ranks all 5, two rankers rank the first 3: one returns
    its input (the trained adapter's behaviour), one reverses the sessions it was shown."""
    ds = _dataset()
    root = str(tmp_path)
    data, emb = storage.join(root, "data"), storage.join(root, "embed")
    _publish(data, "synth", {}, ds.write)
    _publish(emb, "embed", {}, lambda p: rankings.write_rankings(
        p, [_row(q.question_id, FIRST, "embed:fusion") for q in ds.questions]))
    ident, rev = storage.join(root, "rank-trained"), storage.join(root, "rank")
    _rank_output(ident, emb, [_row(f"q{i}", FIRST, TRAINED_LABEL) for i in range(3)])
    reversed_shown = list(reversed(SHOWN)) + FIRST[4:]
    _rank_output(rev, emb, [_row(f"q{i}", reversed_shown, "rank:smollm2-135m-instruct+structured") for i in range(3)])
    chat = storage.join(root, "chat")
    ans = [{"question_id": f"q{i}", "method": m, "dataset": "locomo", "question_type": "single", "answer": "x",
            "status": "ok", "ranking_status": "ok", "exact_match": 0.0, "f1": 0.5 if i else 1.0, "judge": None}
           for i in range(2) for m in ("embed:fusion", TRAINED_LABEL)]
    pub = storage.Publication(chat, "chat", {"endpoint": {"model": "smol"}}, "x", "test")
    pub.write_table("answers.parquet", pa.Table.from_pylist(ans))
    pub.publish({"methods": {"embed:fusion": {"source": emb, "kind": "rankings"},
                             TRAINED_LABEL: {"source": ident, "kind": "rankings"}}})
    out = storage.join(root, "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "rankings": [emb, ident, rev], "answers": [chat]})
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    return {"manifest": m, "report": report, "md": storage.read_text(storage.join(out, "report.md")), "emb": emb}


def test_evaluate_reports_order_change_against_the_rank_input(evaluated):
    r = evaluated["report"]["retrieval"]
    ident, rev = r[TRAINED_LABEL]["input_order"], r["rank:smollm2-135m-instruct+structured"]["input_order"]
    # compared over the sessions it was shown; no run-prefix URI in the report (two runs of one pipeline
    # under different prefixes publish equal reports: tests/test_pipeline.py)
    assert ident["compared_over"] == "shown sessions" and evaluated["emb"] not in json.dumps(ident)
    assert ident["n"] == 3 and ident["changed"] == 0 and ident["tau_mean"] == 1.0 and ident["returns_input_order"]
    assert rev["n"] == 3 and rev["changed_share"] == 1.0 and rev["tau_mean"] == -1.0 and not rev["returns_input_order"]
    assert r["embed:fusion"].get("input_order") is None   # the first stage has no input order to compare with
    # the same figures on the questions every method ranked, and in the manifest's stats
    on_common = evaluated["report"]["question_sets"]["on_common"]
    assert on_common[TRAINED_LABEL]["input_order"]["returns_input_order"] and on_common["embed:fusion"]["n"] == 3
    st = evaluated["manifest"]["stats"]["retrieval"][TRAINED_LABEL]
    assert st["n"] == 3 and st["input_order"]["changed"] == 0 and st["ci"]["ndcg@10"]["n"] == 3
    assert evaluated["manifest"]["stats"]["question_sets"]["on_common"]["embed:fusion"]["n"] == 3
    md = evaluated["md"]
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {TRAINED_LABEL}"))
    assert "returns its input order" in line and "0/3" in line, line
    assert "3/3" in next(ln for ln in md.splitlines() if ln.startswith("| rank:smollm2-135m-instruct+structured"))


def test_answers_beside_retrieval_on_the_same_questions(evaluated):
    """The first stage ranked 5 questions, the chat answered 2: the retrieval figures beside its F1 are
    those 2 questions' (q0: gold s0 at rank 3; q1: gold s3 at rank 1), with their n."""
    a = evaluated["report"]["answers"]["embed:fusion"]
    assert a["retrieval"]["ndcg@10"] == pytest.approx(round((1 / math.log2(4) + 1) / 2, 4))
    assert a["retrieval_on"]["n"] == 2 and a["retrieval_on"]["ci"]["ndcg@10"]["n"] == 2
    st = evaluated["manifest"]["stats"]["answers"]["embed:fusion"]
    assert st["retrieval_on"]["n"] == 2 and st["ci"]["f1"]["n"] == 2


def _results(evaluated) -> dict:
    return {"locomo": {"evaluate": evaluated["manifest"], "embed": {"stats": {"primary": "fusion", "questions": 5}},
                       "rank": {"stats": {"questions": 3}}}}


def test_demo_tables_compare_on_the_same_questions_and_show_order_change(evaluated):
    lines = screen.first_stage_table(_results(evaluated))
    text = "\n".join(lines)
    assert "TRAINED" not in text and "(trained)" not in text
    # the first stage on all its questions, then every ranker beside the first stage on the rankers' questions
    first = [ln for ln in lines if ln.split()[:2] == ["locomo", "embed:fusion"]]
    assert len(first) == 2 and {ln.split()[3] for ln in first} == {"5", "3"}, first
    trained = next(ln for ln in lines if ln.split()[:2] == ["locomo", TRAINED_LABEL])
    assert "(trained adapter; returns its input order)" in trained and " 3 " in trained and "0/3" in trained
    base = next(ln for ln in lines if ln.split()[:2] == ["locomo", "rank:smollm2-135m-instruct+structured"])
    assert "3/3" in base and "returns its input order" not in base and "-1.000" in base
    assert any("order changed" in ln for ln in lines)
    answers = screen.answers_table(_results(evaluated))
    row = next(ln for ln in answers if ln.split()[:2] == ["locomo", TRAINED_LABEL])
    assert "returns its input order" in row and "[" in row   # F1 with its 95% interval


def test_no_screen_or_card_calls_the_identity_ranker_trained_to_rank():
    assert "TRAINED by this platform" not in demo.BANNER and "returns its input order" in demo.BANNER
    entry = models.lookup(demo.TRAINED)
    assert "returns its input order" in entry.good_for
    card = resources.files("memsifter").joinpath("adapters", "smollm2-135m-ranker-dapo", "MODEL_CARD.md").read_text()
    assert "returns its input order" in card and "0 of 96" in card and "+0.34" not in card


def test_a_rank_output_whose_input_is_gone_is_scored_and_says_so(tmp_path):
    """The first-stage output a rank output read was removed since: evaluate still scores the ranker and
    says its input order is unknown (naming what could not be read), rather than failing or staying silent."""
    ds = _dataset()
    data, rk = str(tmp_path / "data"), str(tmp_path / "rank")
    _publish(data, "synth", {}, ds.write)
    _rank_output(rk, str(tmp_path / "gone-embed"), [_row(q.question_id, FIRST, TRAINED_LABEL) for q in ds.questions])
    out = str(tmp_path / "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "rankings": [rk]})
    io = json.loads(storage.read_text(storage.join(out, "report.json")))["retrieval"][TRAINED_LABEL]["input_order"]
    assert "gone-embed" in io["error"] and m["stats"]["retrieval"][TRAINED_LABEL]["n"] == 5
    line = next(ln for ln in storage.read_text(storage.join(out, "report.md")).splitlines()
                if ln.startswith(f"| {TRAINED_LABEL}"))
    assert "input order unknown" in line and "returns its input order" not in line
    row = next(ln for ln in screen.first_stage_table({"locomo": {"evaluate": m, "embed": {}, "rank": {}}})
               if ln.split()[:2] == ["locomo", TRAINED_LABEL])
    assert "(trained adapter)" in row and "returns its input order" not in row, row
