"""evaluate: any rankings file scored the same way; JSON + Markdown + PNG; per type / dataset."""

import json

import pyarrow as pa

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import Dataset, Question, Session
from memsifter.stage import get_stage


def _dataset() -> Dataset:
    sessions = {f"s{i}": Session(f"s{i}", [{"role": "user", "content": f"text {i}"}], f"2024-01-0{i + 1}")
                for i in range(6)}
    qs = [
        Question("q1", "dsA", "where?", "Paris", [f"s{i}" for i in range(6)], ["s2"], question_type="single"),
        Question("q2", "dsA", "who?", "Ann", [f"s{i}" for i in range(6)], ["s0", "s5"], question_type="multi"),
        Question("q3", "dsB", "when?", "May", [f"s{i}" for i in range(6)], ["s3"], question_type="single"),
        Question("q4_abs", "dsB", "what?", "unknown", [f"s{i}" for i in range(6)], [],
                 question_type="single", extra={"abstention": True}),
    ]
    return Dataset(sessions, qs)


def _publish(uri, stage_name, write):
    pub = storage.Publication(uri, stage_name, {}, "x", "test")
    write(pub)
    pub.publish({})


def test_evaluate_report(store_root):
    ds = _dataset()
    data = storage.join(store_root, "data")
    _publish(data, "synth", ds.write)
    perfect = [{"question_id": q.question_id, "ranked_session_ids": q.gold_session_ids +
                [s for s in q.haystack_session_ids if s not in q.gold_session_ids], "scores": None,
                "method": "oracle", "status": "ok", "reason": None, "raw_response": None} for q in ds.questions]
    reverse = [{**r, "ranked_session_ids": list(reversed(r["ranked_session_ids"])), "method": "reverse",
                "status": "fallback" if r["question_id"] == "q1" else "ok", "reason": "parse: x"} for r in perfect]
    ranked = storage.join(store_root, "ranked")
    _publish(ranked, "rank", lambda p: rankings.write_rankings(p, perfect))
    rev_file = storage.join(store_root, "reverse.parquet")
    storage.write_bytes(rev_file, storage.parquet_bytes(rankings.rankings_table(reverse)))
    answers = storage.join(store_root, "chat")
    ans_rows = [
        {"question_id": "q1", "dataset": "dsA", "question_type": "single", "answer": "Paris", "status": "ok",
         "exact_match": 1.0, "f1": 1.0, "judge": None},
        {"question_id": "q2", "dataset": "dsA", "question_type": "multi", "answer": "Bob", "status": "ok",
         "exact_match": 0.0, "f1": 0.0, "judge": None},
        {"question_id": "q3", "dataset": "dsB", "question_type": "single", "answer": None, "status": "error",
         "exact_match": None, "f1": None, "judge": None},
    ]
    _publish(answers, "chat", lambda p: p.write_table("answers.parquet", pa.Table.from_pylist(ans_rows)))

    out = storage.join(store_root, "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "rankings": [ranked, rev_file],
                                   "answers": [answers], "curve_max_k": 6})
    files = m["files"]
    assert {"report.json", "report.md", "recall_curve.png", "answer_f1_by_type.png"} <= set(files)
    for png in ("recall_curve.png", "answer_f1_by_type.png"):
        assert storage.read_bytes(storage.join(out, png))[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    oracle, rev = report["retrieval"]["oracle"], report["retrieval"]["reverse"]
    assert oracle["n"] == 3  # abstention excluded
    assert oracle["overall"]["recall_all@5"] == 1.0 and oracle["overall"]["ndcg@10"] == 1.0
    assert oracle["overall"]["mrr"] == 1.0
    assert rev["overall"]["recall_any@1"] == 0.0
    assert abs(rev["overall"]["recall_any@5"] - 1 / 3) < 1e-4  # only q2's s5 is in the reversed top 5
    assert rev["status"] == {"fallback": 1, "ok": 3}
    assert set(oracle["by_type"]) == {"single", "multi"} and set(oracle["by_dataset"]) == {"dsA", "dsB"}
    assert oracle["curve"]["recall_all"][-1] == 1.0 and len(oracle["curve"]["recall_any"]) == 6
    a = report["answers"]["chat"]
    assert a["overall"] == {"n": 3, "answered": 2, "exact_match": 0.5, "f1": 0.5, "locomo_f1": None, "judge": None,
                            "lme_judge": None}   # no LoCoMo questions, no LongMemEval judge
    assert a["by_type"]["single"]["f1"] == 1.0
    md = storage.read_text(storage.join(out, "report.md"))
    assert "| oracle |" in md and "| reverse |" in md and "F1 by question type" in md


def test_evaluate_original_ndcg_variant(tmp_path):
    ds = _dataset()
    data = str(tmp_path / "data")
    _publish(data, "synth", ds.write)
    rows = [{"question_id": "q2", "ranked_session_ids": ["s5", "s1", "s0"], "scores": None, "method": "m",
             "status": "ok", "reason": None, "raw_response": None}]
    f = str(tmp_path / "r.parquet")
    storage.write_bytes(f, storage.parquet_bytes(rankings.rankings_table(rows)))
    std = get_stage("evaluate").run({"output": str(tmp_path / "e1"), "input": data, "rankings": [f]})
    orig = get_stage("evaluate").run({"output": str(tmp_path / "e2"), "input": data, "rankings": [f],
                                      "ndcg_variant": "original"})
    r1 = json.loads(storage.read_text(str(tmp_path / "e1" / "report.json")))["retrieval"]["m"]["overall"]
    r2 = json.loads(storage.read_text(str(tmp_path / "e2" / "report.json")))["retrieval"]["m"]["overall"]
    assert std["stats"] and orig["stats"]
    ideal = 1 + 1 / __import__("math").log2(3)
    dcg = 1 + 1 / 2  # hits at ranks 1 and 3
    assert abs(r1["ndcg@10"] - dcg / ideal) < 1e-4
    assert abs(r2["ndcg@10"] - dcg / 2) < 1e-4


def test_answers_per_method_with_fallback_marking(tmp_path):
    """One chat output answered with several contexts: evaluate reports F1 / EM per method with that
    method's retrieval metrics beside it, marks a ranker whose rows are mostly fallbacks in the JSON,
    the Markdown table and the plot, and leaves retrieval out for no memory (oracle: gold)."""
    ds = _dataset()
    root = str(tmp_path)
    data = storage.join(root, "data")
    _publish(data, "synth", ds.write)
    gold_first = [{"question_id": q.question_id, "ranked_session_ids": q.gold_session_ids +
                   [s for s in q.haystack_session_ids if s not in q.gold_session_ids], "scores": None,
                   "method": "embed:fusion", "status": "ok", "reason": None, "raw_response": None}
                  for q in ds.questions]
    ranker = [{**r, "method": "rank:smol", "status": "fallback" if i < 3 else "ok", "reason": "parse: x",
               "raw_response": "prose"} for i, r in enumerate(gold_first)]
    emb, rk = storage.join(root, "embed"), storage.join(root, "rank")
    _publish(emb, "embed", lambda p: rankings.write_rankings(p, gold_first))
    _publish(rk, "rank", lambda p: rankings.write_rankings(p, ranker))
    rows = []
    for method, f1, status in (("rank:smol", 0.2, "fallback"), ("embed:fusion", 0.5, "ok"),
                               ("no memory", 0.0, None), ("oracle (gold sessions)", 1.0, None)):
        for q in ds.questions[:3]:
            rows.append({"question_id": q.question_id, "method": method, "dataset": q.dataset,
                         "question_type": q.question_type, "answer": "a", "status": "ok",
                         "ranking_status": status, "exact_match": 0.0, "f1": f1, "judge": None})
    chat = storage.join(root, "chat")

    def write_chat(p):
        p.write_table("answers.parquet", pa.Table.from_pylist(rows))
    pub = storage.Publication(chat, "chat", {"endpoint": {"model": "smollm2"}}, "x", "test")
    write_chat(pub)
    pub.publish({"methods": {
        "rank:smol": {"source": rk, "kind": "rankings", "ranking_status": {"fallback": 3, "ok": 1}},
        "embed:fusion": {"source": emb, "kind": "rankings", "ranking_status": {"ok": 4}},
        "no memory": {"source": "none", "kind": "none", "ranking_status": {}},
        "oracle (gold sessions)": {"source": "oracle", "kind": "oracle", "ranking_status": {}}}})
    out = storage.join(root, "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "rankings": [emb, rk], "answers": [chat]})
    assert "answer_f1_by_method.png" in m["files"]
    assert storage.read_bytes(storage.join(out, "answer_f1_by_method.png"))[:4] == b"\x89PNG"
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    a = report["answers"]
    # the chat contexts and the constant-answer reference row (chosen on the other half of the questions)
    assert set(a) == {"rank:smol", "embed:fusion", "no memory", "oracle (gold sessions)", "constant answer"}
    assert report["references"]["strongest"]["f1"] == "oracle (gold sessions)"
    assert a["embed:fusion"]["vs_reference"]["f1"]["diff"] == -0.5 and "vs_reference" not in a["no memory"]
    assert a["rank:smol"]["fallback"] == "mostly fallback (3/4)" and a["embed:fusion"]["fallback"] is None
    assert a["rank:smol"]["model"] == "smollm2" and a["embed:fusion"]["overall"]["f1"] == 0.5
    assert a["embed:fusion"]["retrieval"] == {"recall_any@5": 1.0, "ndcg@10": 1.0}
    assert a["no memory"]["retrieval"] is None and a["oracle (gold sessions)"]["retrieval"]["note"] == "gold sessions"
    assert report["retrieval"]["rank:smol"]["fallback"] == "mostly fallback (3/4)"
    md = storage.read_text(storage.join(out, "report.md"))
    assert "## Answers by retrieval method" in md and "**mostly fallback (3/4)**" in md
    assert "| no memory | 3 | 3 | 0.000 [0.00, 0.00] | 0.000 [0.00, 0.00] |" in md   # mean [95% interval]
    st = m["stats"]["answers"]
    assert st["rank:smol"]["fallback"] and st["oracle (gold sessions)"]["f1"] == 1.0
