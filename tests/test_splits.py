"""Held-out splits that hold (issue 42 item 4): one split function (memsifter/data/splits.py) for prepare-rl,
prepare-agents and sft, separating by conversation and by session text (content hash, not id), refusing an
overlap in one line, and written into the output's manifest."""

from __future__ import annotations

import json
import pytest

from memsifter.data.model import Dataset, Question, Session, read_dataset
from memsifter.errors import InputError
from memsifter.stage import get_stage
from memsifter.store import storage


def _session(sid: str, text: str) -> Session:
    return Session(sid, [{"role": "user", "content": text}, {"role": "assistant", "content": "ok " + text}])


def _conversation(name: str, n_q: int, texts: list[str], ds: str = "locomo", prefix: str | None = None):
    """A LoCoMo-like conversation: n_q questions over the same sessions (ids ``{prefix}_session_i``)."""
    prefix = prefix or name
    sess = {f"{prefix}_session_{i}": _session(f"{prefix}_session_{i}", t) for i, t in enumerate(texts)}
    hay = list(sess)
    qs = [Question(f"{name}_q{i}", ds, f"q{i}?", "a", hay, [hay[i % len(hay)]]) for i in range(n_q)]
    return sess, qs


def test_a_conversation_imported_twice_under_other_ids_is_one_group():
    """Grouping by the sessions' text: the copy of conv-a (other session ids, other question ids) goes to the
    split conv-a goes to; conversations are never split across train and test."""
    from memsifter.data.splits import choose

    sessions, questions = {}, []
    for name, n, texts, prefix in (("conv-a", 6, ["a0", "a1", "a2"], None), ("conv-b", 5, ["b0", "b1"], None),
                                   ("copy-a", 6, ["a0", "a1", "a2"], "other"), ("conv-c", 9, ["c0", "c1"], None)):
        s, q = _conversation(name, n, texts, prefix=prefix)
        sessions.update(s)
        questions += q
    for seed in range(6):
        plan = choose(questions, sessions, {"train": {"locomo": 100}, "test": {"locomo": 12}}, seed)
        convs = {s: {q.question_id.split("_q")[0] for q in qs} for s, qs in plan.chosen.items()}
        assert not convs["train"] & convs["test"], (seed, convs)
        # conv-a and its copy travel together
        assert ("conv-a" in convs["test"]) == ("copy-a" in convs["test"]), (seed, convs)
        assert ("conv-a" in convs["train"]) == ("copy-a" in convs["train"]) or "conv-a" not in convs["test"]
        summary = plan.summary()["splits"]
        labels = {c for s in ("train", "test") for g in summary[s]["conversations"] for c in g.split("+")}
        assert labels <= {"conv-a", "conv-b", "copy-a", "conv-c"} and "conv-a+copy-a" in {
            g for s in ("train", "test") for g in summary[s]["conversations"]}


def test_overlapping_session_text_under_different_ids_is_detected():
    """LongMemEval-like: one question a haystack, filler sessions shared under other ids. A training question
    whose haystack holds a held-out question's session text (another id) loses it; one whose gold session is
    such a text is left out; the published split shares no text, and check() refuses one that does."""
    from memsifter.data.splits import check, choose

    sessions = {}
    questions = []
    for i in range(12):
        own = _session(f"q{i}_gold", f"gold text {i}")
        filler = _session(f"sharegpt_{i}", f"filler {i % 3}")   # 4 copies of each filler text, 4 ids each
        sessions.update({own.session_id: own, filler.session_id: filler})
        questions.append(Question(f"q{i}", "lme", "?", "a", [filler.session_id, own.session_id], [own.session_id]))
    # a training-side question whose gold session is, under another id, a held-out question's gold text
    for i in range(12):
        dup = _session(f"dup_{i}", f"gold text {i}")
        sessions[dup.session_id] = dup
        questions.append(Question(f"d{i}", "lme", "?", "a", [dup.session_id], [dup.session_id]))
    plan = choose(questions, sessions, {"train": {"lme": 100}, "test": {"lme": 4}}, 0)
    test_texts = {sessions[s].content_hash[:16] for q in plan.chosen["test"] for s in q.haystack_session_ids}
    for q in plan.chosen["train"]:
        assert not {sessions[s].content_hash[:16] for s in q.haystack_session_ids} & test_texts, q
    held = {q.question_id for q in plan.chosen["test"]}
    # the duplicates of a held-out question's gold session are in no training split
    assert all(f"d{i[1:]}" not in {q.question_id for q in plan.chosen["train"]} for i in held if i.startswith("q"))
    assert plan.excluded_gold_shared.get("train", 0) >= 1
    assert plan.haystack_sessions_removed.get("train", 0) >= 1
    doc = plan.document()
    check(doc, "split.json")
    assert doc["seed"] == 0 and len(doc["splits"]["test"]["question_ids"]) == 4
    # a split document whose splits share a text under different ids: refused in one line
    doc["splits"]["train"]["session_hashes"].append(doc["splits"]["test"]["session_hashes"][0])
    with pytest.raises(InputError) as e:
        check(doc, "s3://b/prep/split.json")
    msg = str(e.value)
    assert "\n" not in msg and "s3://b/prep/split.json" in msg and "session_hashes" in msg and "'test'" in msg


@pytest.fixture(scope="module")
def locomo_twice(shared_dir, tmp_path_factory):
    """LoCoMo dev2 imported, and a copy of conv-26 under other session and question ids (same text)."""
    src = shared_dir / "data" / "locomo_dev2.json.gz"
    if not src.exists():
        pytest.skip("../shared/data lacks the LoCoMo sample")
    root = tmp_path_factory.mktemp("splits")
    loc = str(root / "loc")
    get_stage("import").run({"output": loc, "format": "locomo", "source": str(src)})
    ds = read_dataset(loc)
    ren = {s: s.replace("conv-26", "copy-26") for s in ds.sessions if s.startswith("conv-26")}
    sess = {ren[s]: Session(ren[s], ds.sessions[s].turns, ds.sessions[s].date) for s in ren}
    qs = [Question(q.question_id.replace("conv-26", "copy-26"), "locomo_copy", q.question, q.answer,
                   [ren[s] for s in q.haystack_session_ids], [ren[s] for s in q.gold_session_ids], q.question_date,
                   q.question_type, q.haystack_dates, q.extra)
          for q in ds.questions if q.question_id.startswith("conv-26")]
    copy = str(root / "copy")
    pub = storage.Publication(copy, "import", {}, "copy", "test")
    pub.publish(Dataset(sess, qs).write(pub))
    return loc, copy, root


def _session_texts(uri_rows: list[dict], ds: dict) -> set[str]:
    return {ds[s].content_hash for r in uri_rows for s in r}


def test_prepare_agents_manifest_carries_the_split_and_sft_checks_it(locomo_twice, tiny_model_dir):
    """prepare-agents on LoCoMo and conv-26's copy: one conversation held out whole, its copy not trained on
    (same text, other ids), the split in the manifest and in split.json; sft refuses a split that overlaps."""
    loc, copy, root = locomo_twice
    out = str(root / "agents")
    m = get_stage("prepare-agents").run({
        "output": out, "datasets": [loc, copy], "agents": ["agent:memory"], "traces": True, "tokenizer": None,
        "recipe": {"train": {"locomo": 200, "locomo_copy": 200}, "test": {"locomo": 150}}})
    st = m["stats"]["split"]
    assert st["seed"] == 0 and st["file"] == "split.json"
    tests, trains = st["splits"]["test"], st["splits"]["train"]
    assert tests["conversations"] in (["conv-26"], ["conv-30"]) and tests["questions"] == len(tests["question_ids"])
    assert not set(tests["conversations"]) & set(trains["conversations"])
    assert tests["session_hashes"] > 0 and trains["session_hashes"] > 0
    held = tests["conversations"][0]
    if held == "conv-26":   # its copy has the same texts: no training question of it
        assert not any(q.startswith("copy-26") for q in trains["question_ids"])
    ds = {**read_dataset(loc).sessions, **read_dataset(copy).sessions}
    hay = {q.question_id: q.haystack_session_ids for q in read_dataset(loc).questions + read_dataset(copy).questions}
    test_texts = _session_texts([hay[q] for q in tests["question_ids"]], ds)
    train_texts = _session_texts([hay[q] for q in trains["question_ids"]], ds)
    assert not test_texts & train_texts
    doc = json.loads(storage.read_text(storage.join(out, "split.json")))
    assert doc["splits"]["test"]["question_ids"] == tests["question_ids"]

    # sft: the split is checked before anything loads; a published split that overlaps is one line, exit 2
    bad = str(root / "bad")
    pub = storage.Publication(bad, "prepare-agents", {}, "bad", "test")
    doc["splits"]["train"]["conversations"].append(held)
    pub.write_json("split.json", doc)
    for n in ("sft_train.jsonl", "sft_test.jsonl"):
        pub.write_bytes(n, storage.read_bytes(storage.join(out, n)))
    pub.publish({"traces": {"files": {"train": "sft_train.jsonl", "test": "sft_test.jsonl"}}})
    with pytest.raises(InputError) as e:
        get_stage("sft").run({"traces": bad, "output": str(root / "sft-bad"), "model": tiny_model_dir})
    msg = str(e.value)
    assert "\n" not in msg and "split.json" in msg and "conversations" in msg and "'train'" in msg, msg
    assert not storage.exists(str(root / "sft-bad" / "_SUCCESS"))


def test_prepare_rl_manifest_carries_the_split(locomo_twice, tiny_model_dir):
    """prepare-rl splits LoCoMo by conversation (it split conversations by question before) and records it."""
    loc, _, root = locomo_twice
    out = str(root / "rl")
    m = get_stage("prepare-rl").run({
        "output": out, "datasets": [loc], "tokenizer": tiny_model_dir, "history_budget_tokens": 2000,
        "max_prompt_tokens": 100000, "recipe": {"train": {"locomo": 20}, "test": {"locomo": 10}}})
    st = m["stats"]["split"]
    convs = {s: {q.split("_q")[0] for q in st["splits"][s]["question_ids"]} for s in ("train", "test")}
    assert len(convs["test"]) == 1 and not convs["train"] & convs["test"], convs
    assert st["splits"]["test"]["conversations"] == sorted(convs["test"])
    assert json.loads(storage.read_text(storage.join(out, "split.json")))["seed"] == 0


def test_gpu_drivers_publish_only_a_checked_held_out_split(tmp_path):
    """run_agents.publish_questions (also bench_agents_one_call's): with a split document, a question of the
    training split, or a split whose parts share a session text, is refused before anything is published."""
    import os
    import sys as _sys

    _sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu"))
    from run_agents import publish_questions

    from memsifter.data.splits import choose

    sessions, questions = {}, []
    for name, texts in (("conv-a", ["a0", "a1"]), ("conv-b", ["b0", "b1"])):
        s, q = _conversation(name, 3, texts)
        sessions.update(s)
        questions += q
    plan = choose(questions, sessions, {"train": {"locomo": 3}, "test": {"locomo": 3}}, 0)
    doc = plan.document()
    ds = Dataset(sessions, questions)
    held = doc["splits"]["test"]["question_ids"]
    with pytest.raises(InputError, match="of split 'train' is among the 'test' rows"):
        publish_questions([ds], held + doc["splits"]["train"]["question_ids"][:1], str(tmp_path / "h1"), "t", doc)
    assert not storage.exists(str(tmp_path / "h1" / "_SUCCESS"))
    bad = json.loads(json.dumps(doc))
    bad["splits"]["train"]["session_hashes"] += bad["splits"]["test"]["session_hashes"][:1]
    with pytest.raises(InputError, match="share 1 session hashes"):
        publish_questions([ds], held, str(tmp_path / "h2"), "t", bad)
    publish_questions([ds], held, str(tmp_path / "h3"), "t", doc)
    assert sorted(q.question_id for q in read_dataset(str(tmp_path / "h3")).questions) == sorted(held)


def test_prepare_ranker_split_holds_out_a_conversation_and_its_texts(shared_dir, tmp_path):
    """The ranker driver's held-out parts come from the same split: LoCoMo conv-30 whole, no held-out session text
    in a training haystack (LongMemEval_S haystacks share filler sessions under other ids)."""
    import os
    import sys as _sys

    if not (shared_dir / "data" / "longmemeval_s_train348.json.gz").exists():
        pytest.skip("../shared/data lacks the LongMemEval_S training split")
    _sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu"))
    from prepare_ranker import split_sources

    from memsifter.data.splits import check

    parts = split_sources(str(tmp_path), 60, 17, str(shared_dir / "data"))
    doc = json.loads((tmp_path / "split.json").read_text())
    check(doc, "split.json")
    assert doc["splits"]["heldout"]["conversations"] == ["conv-30"]
    assert doc["splits"]["train"]["conversations"] == ["conv-26"]
    texts = {}
    for name, uri in parts.items():
        ds = read_dataset(uri)
        texts[name] = {ds.sessions[s].content_hash for q in ds.questions for s in q.haystack_session_ids}
    held = texts["lme_heldout"] | texts["locomo_heldout"]
    assert held and not held & (texts["lme_train"] | texts["locomo_train"])
    assert len(read_dataset(parts["lme_heldout"]).questions) == 60
    summary = doc["summary"]["splits"]["train"]
    assert summary["haystack_sessions_removed"] > 0 and summary["questions"] > 250


def test_the_held_out_split_keeps_its_haystacks_whatever_its_datasets_are_called():
    """Held-out and training questions imported as separate datasets (prepare_ranker's parts): the smaller split
    owns the shared texts even when its dataset sorts after the training one; only training haystacks are cut."""
    from memsifter.data.splits import choose

    shared = _session("filler", "shared filler")
    sessions = {"filler": shared}
    questions = []
    for ds, prefix in (("a_train", "t"), ("z_heldout", "h")):
        for i in range(4):
            own = _session(f"{prefix}{i}_gold", f"{prefix} gold {i}")
            copy = _session(f"{prefix}{i}_filler", "shared filler")   # the same text under another id
            sessions.update({own.session_id: own, copy.session_id: copy})
            questions.append(Question(f"{prefix}{i}", ds, "?", "a", [copy.session_id, own.session_id], [own.session_id]))
    plan = choose(questions, sessions, {"train": {"a_train": 4}, "test": {"z_heldout": 2}}, 0)
    assert all(len(q.haystack_session_ids) == 2 for q in plan.chosen["test"])
    assert all(q.haystack_session_ids == [f"{q.question_id}_gold"] for q in plan.chosen["train"])
    assert len(plan.chosen["train"]) == 4 and plan.haystack_sessions_removed["train"] == 4
