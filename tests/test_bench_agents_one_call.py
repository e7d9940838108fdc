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
    assert r.returncode != 0 and "chat-base.parquet" in r.stderr
    assert not (tmp_path / "out" / "_work" / "heldout").exists()
