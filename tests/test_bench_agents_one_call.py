"""benchmarks/bench_agents_one_call.py: its paired differences and its argument checks (the run itself needs
vLLM answering 130+ questions; its results are in benchmarks/results/agents-one-call-2026-11-26)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
bench = importlib.import_module("bench_agents_one_call")


def test_paired_is_over_the_questions_both_answered():
    rows = {"a": {"q1": 1.0, "q2": 0.5, "q3": 0.0, "only_a": 1.0},
            "b": {"q1": 0.0, "q2": 0.5, "q3": 0.5, "only_b": 1.0}}
    p = bench.paired(rows, "a", "b")
    assert p["n"] == 3
    assert p["diff"] == pytest.approx((1.0 + 0.0 - 0.5) / 3, abs=1e-4)
    assert p["ci"][0] <= p["diff"] <= p["ci"][1] and p["ci"][0] < p["ci"][1]
    assert bench.paired(rows, "b", "a")["diff"] == pytest.approx(-p["diff"], abs=1e-4)


def test_the_base_rows_labels_map_to_the_chat_stages_contexts():
    # the labels the chat stage writes for its baselines and the BM25 first stage (the GPU rows carry them)
    from memsifter.stages import chat

    src = open(chat.__file__).read()
    for label in ("no memory", "oracle (gold sessions)"):
        assert label in src, label
    assert set(bench.CHAT_METHODS.values()) == {"none", "first stage", "oracle"}


def test_missing_answers_dir_fails_before_any_work(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_agents_one_call.py"), "--lme", "x",
                        "--locomo", "y", "--answers", str(tmp_path / "none"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "chat-base.parquet is missing" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "_work" / "heldout").exists()


def test_heldout_publishes_exactly_the_asked_questions_with_their_first_stage(tmp_path, shared_dir):
    import types

    from memsifter.data.model import read_dataset
    from memsifter.store import storage

    import gzip
    import json

    full_lme, full_locomo = shared_dir / "data" / "longmemeval_s_dev30.json.gz", shared_dir / "data" / "locomo_dev2.json.gz"
    if not full_lme.exists() or not full_locomo.exists():
        pytest.skip("../shared/data lacks the samples")
    # two LongMemEval questions and one LoCoMo conversation (smaller imports; the same formats)
    lme, locomo = tmp_path / "lme.json.gz", tmp_path / "locomo.json.gz"
    lme.write_bytes(gzip.compress(json.dumps(json.load(gzip.open(full_lme))[:2]).encode()))
    locomo.write_bytes(gzip.compress(json.dumps(json.load(gzip.open(full_locomo))[:1]).encode()))
    a = types.SimpleNamespace(lme=str(lme), locomo=str(locomo), work=str(tmp_path / "w"), out=str(tmp_path / "o"))
    (tmp_path / "o").mkdir()

    first = json.load(gzip.open(lme))[0]["question_id"]
    locomo_ids = [q.question_id for q in _imported(a, "locomo", str(locomo))][:2]
    out = bench.heldout(a, [first, *locomo_ids])
    ds = read_dataset(out)
    assert sorted(q.question_id for q in ds.questions) == sorted([first, *locomo_ids])
    assert set(ds.sessions) == {s for q in ds.questions for s in q.haystack_session_ids}
    assert storage.exists(f"{out}-embed/_SUCCESS")
    with pytest.raises(SystemExit, match="in none of the datasets"):
        bench.heldout(types.SimpleNamespace(**{**vars(a), "work": str(tmp_path / "w2")}), ["no-such-question"])


def _imported(a, fmt, src):
    from memsifter.data.model import read_dataset

    dst = str(a.work) + "-probe"
    subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "import", "--format", fmt, "--source", src,
                    "--output", dst, "-q"], check=True, cwd=REPO, capture_output=True)
    return read_dataset(dst).questions
