"""The README's main command: `memsifter demo`, offline, end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memsifter import storage


@pytest.mark.slow
def test_demo_runs_offline_and_reports(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    memsifter = Path(sys.executable).with_name("memsifter")
    proc = subprocess.run([str(memsifter), "demo", "--out", str(tmp_path / "demo"), "--questions", "6"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "UNTRAINED TINY STAND-IN" in proc.stdout
    assert "zstanjj/MemSifter-4B-Thinking" in proc.stdout
    report = tmp_path / "demo" / "evaluate" / "report.md"
    assert report.exists() and "report: " in proc.stdout
    # Every stage published; the report covers embedding methods and the ranker, with plots.
    for stage in ("synth", "embed", "rank", "chat", "evaluate"):
        assert storage.read_manifest(str(tmp_path / "demo" / stage))["stage"] == stage
    m = storage.read_manifest(str(tmp_path / "demo" / "evaluate"))
    assert any(f.endswith(".png") for f in m["files"])
    text = report.read_text()
    assert "embed" in text and "rank" in text
    # A second run finds everything published and redoes nothing.
    again = subprocess.run([str(memsifter), "demo", "--out", str(tmp_path / "demo"), "--questions", "6"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert json.dumps(storage.read_manifest(str(tmp_path / "demo" / "evaluate"))["published_at"]) == \
        json.dumps(m["published_at"])
