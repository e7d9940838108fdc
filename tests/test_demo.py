"""The README's main command: `memsifter demo`, offline, end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memsifter.store import storage


@pytest.mark.slow
def test_demo_runs_offline_on_real_data_and_reports(tmp_path):
    # a newcomer's machine: an EMPTY model cache, so the demo converts SmolLM2 and merges the trained
    # adapter onto it while its two vLLM servers start in threads (that first run once crashed on a race)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_ADDRESS": "",
           "MEMSIFTER_MODEL_CACHE": str(tmp_path / "empty-model-cache")}
    env.pop("RAY_ADDRESS")
    memsifter = Path(sys.executable).with_name("memsifter")
    argv = [str(memsifter), "demo", "--out", str(tmp_path / "demo"), "--questions", "3", "--answers", "2"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "SmolLM2-135M-Instruct" in proc.stdout and "NOT trained as a ranker" in proc.stdout
    assert "STAND-IN" not in proc.stdout.upper()  # the random stand-in left the demo
    # one clean screen: Ray/vLLM/library output went to the log file, not the terminal
    noisy = [ln for ln in out.splitlines()
             if any(w in ln for w in (" INFO ", "WARNING", "(raylet)", "Traceback", "it/s]"))]
    assert noisy == [], noisy[:5]
    log = tmp_path / "demo" / "_logs" / "demo.log"
    assert log.exists() and log.stat().st_size > 0
    # the real samples; LoCoMo goes through every stage, LongMemEval through the first stage
    stages = {"locomo": ("import", "embed", "rank", "chat", "evaluate"), "longmemeval": ("import", "embed", "evaluate")}
    for ds, names in stages.items():
        for stage in names:
            assert storage.read_manifest(str(tmp_path / "demo" / ds / stage))["stage"] == stage
        assert (tmp_path / "demo" / ds / "evaluate" / "report.md").exists()
        assert f"report {ds}" in proc.stdout
        for method in ("embed:dense", "embed:bm25"):
            assert any(ln.split()[:2] == [ds, method] for ln in proc.stdout.splitlines()), (ds, method)
    lines = proc.stdout.splitlines()
    assert any(ln.split()[:2] == ["locomo", "rank:smollm2-135m-instruct+structured"] for ln in lines)
    # the adapter this platform trained (the shipped LoRA adapter, served by a second vLLM server) beside it,
    # never presented as trained to rank: it returns its input order (issue 34)
    assert "TRAINED by this platform" not in proc.stdout and "(trained)" not in proc.stdout
    assert "the LoRA adapter this platform trained" in proc.stdout and "returns its input order" in proc.stdout
    assert any(ln.split()[:3] == ["locomo", "rank:smollm2-135m-memsifter-ranker", "(trained"] for ln in lines), \
        [ln for ln in lines if "rank:" in ln]
    # the rankers beside the first stage on the SAME questions: every row of that table has the rankers' n
    # (then recall_any@5 with its 95% interval), each ranker its order change against the first-stage order
    # it was given, and "returns its input order" exactly where it changed none
    ev = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "evaluate"))["stats"]
    n_rank = ev["retrieval"]["rank:smollm2-135m-memsifter-ranker"]["n"]
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("Rankers, beside"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("Answers of the working"))
    rank_rows = [ln for ln in lines[start:end] if ln.strip().startswith("locomo")]
    assert any(ln.split()[1] == "embed:dense" for ln in rank_rows), rank_rows
    for ln in rank_rows:
        assert re.search(rf"\s{n_rank}\s+\d\.\d{{3}} \[", ln), ln
    for name in ("rank:smollm2-135m-instruct+structured", "rank:smollm2-135m-memsifter-ranker"):
        row = next(ln for ln in rank_rows if ln.split()[1] == name)
        io = ev["retrieval"][name]["input_order"]
        assert io["n"] == n_rank and f"{io['changed']}/{io['n']} (" in row, row
        assert ("returns its input order" in row) == io["returns_input_order"], row
    tr = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "rank-trained"))
    assert tr["config"]["model"] == "smollm2-135m-memsifter-ranker" and not tr["config"]["constrained_output"]
    assert tr["config"]["endpoint"]["model"] == "smollm2-135m-memsifter-ranker" and tr["stats"]["questions"] == 2
    # with the prompt it was trained with: ids only, the shown sessions listed in first-stage order
    assert tr["config"]["prompt_style"] == "direct" and tr["config"]["history_order"] == "first_stage"
    # the answers table: every context, the real working LLM's F1 beside its retrieval metrics
    answers = [ln for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("Answers of the working"))):]
               if ln.strip().startswith("locomo")]
    labels = [" ".join(ln.split()[1:3]) for ln in answers]
    assert labels[0] == "no memory" and labels[-1] == "oracle (gold" and len(answers) == 6, answers
    assert any("embed:dense" in ln for ln in answers) and any("rank:smollm2-135m-instruct" in ln for ln in answers)
    assert any("rank:smollm2-135m-memsifter-ranker (trained adapter" in ln for ln in answers)
    # F1 with its n and 95% interval; the retrieval beside it over the same answered questions, with its n
    for ln in answers:
        if "no memory" not in ln and "oracle" not in ln:
            assert re.search(r"\s2\s+\d\.\d{3} \[", ln) and ln.count("[") >= 3, ln
    ans = storage.read_parquet(str(tmp_path / "demo" / "locomo" / "chat" / "answers.parquet")).to_pylist()
    assert len(ans) == 6 * 2 and all(r["status"] == "ok" and r["raw_response"] for r in ans)
    rk = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "rank"))
    assert rk["stats"]["questions"] == 2 and rk["config"]["model"] == "smollm2-135m-instruct"
    imp = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "import"))
    assert imp["stats"]["questions"] == 3 and "locomo_dev2" in imp["config"]["source"]
    m = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "evaluate"))
    assert {"answer_f1_by_method.png", "recall_curve.png"} <= set(m["files"])
    # A second run finds everything published and redoes nothing.
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert json.dumps(storage.read_manifest(str(tmp_path / "demo" / "locomo" / "evaluate"))["published_at"]) == \
        json.dumps(m["published_at"])
