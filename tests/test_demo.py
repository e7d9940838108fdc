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
def test_demo_runs_offline_on_real_data_and_reports(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    memsifter = Path(sys.executable).with_name("memsifter")
    argv = [str(memsifter), "demo", "--out", str(tmp_path / "demo"), "--questions", "3"]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "UNTRAINED TINY STAND-IN" in proc.stdout and "zstanjj/MemSifter-4B-Thinking" in proc.stdout
    # one clean screen: Ray/vLLM/library output went to the log file, not the terminal
    noisy = [ln for ln in out.splitlines()
             if any(w in ln for w in (" INFO ", "WARNING", "(raylet)", "Traceback", "it/s]"))]
    assert noisy == [], noisy[:5]
    log = tmp_path / "demo" / "_logs" / "demo.log"
    assert log.exists() and log.stat().st_size > 0
    # the real samples, every stage published per dataset, the side-by-side table
    for ds in ("locomo", "longmemeval"):
        for stage in ("import", "embed", "rank", "chat", "evaluate"):
            assert storage.read_manifest(str(tmp_path / "demo" / ds / stage))["stage"] == stage
        assert (tmp_path / "demo" / ds / "evaluate" / "report.md").exists()
        assert f"report {ds}" in proc.stdout
        for method in ("embed:dense", "embed:bm25", "embed:hybrid", "rank:tiny-standin (stand-in)"):
            assert any(ln.split()[:2] == [ds, method.split()[0]] for ln in proc.stdout.splitlines()), (ds, method)
    imp = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "import"))
    assert imp["stats"]["questions"] == 3 and "locomo_dev2" in imp["config"]["source"]
    m = storage.read_manifest(str(tmp_path / "demo" / "locomo" / "evaluate"))
    assert any(f.endswith(".png") for f in m["files"])
    # A second run finds everything published and redoes nothing.
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert json.dumps(storage.read_manifest(str(tmp_path / "demo" / "locomo" / "evaluate"))["published_at"]) == \
        json.dumps(m["published_at"])
