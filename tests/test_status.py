"""`memsifter status RUN`: finished, running and failed pipelines, local and on S3, read from the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memsifter.store import lease, storage
from memsifter.pipeline import run_pipeline


def status(run: str, env: dict | None = None) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "memsifter.cli", "status", run]
    j = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120, env=env)
    txt = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert j.returncode == txt.returncode, (j.stderr, txt.stderr)
    return j.returncode, (json.loads(j.stdout) if j.stdout.strip() else {}), txt.stdout + txt.stderr


def spec(run: str, **evaluate) -> dict:
    return {"run": run, "stages": {"synth": {"questions": 3, "sessions_per_question": 4},
                                   "evaluate": {"rankings": [], "answers": [], **evaluate}}}


def test_finished_running_and_failed_local_runs(tmp_path):
    done = str(tmp_path / "done")
    run_pipeline(spec(done), echo=lambda s: None)
    rc, rep, text = status(done)
    assert rc == 0 and rep["planned"]
    assert [(s["stage"], s["state"]) for s in rep["stages"]] == [("synth", "published"), ("evaluate", "published")]
    assert rep["stages"][0]["headline"]["questions"] == 3 and "synth       published" in text

    failed = str(tmp_path / "failed")
    with pytest.raises(Exception, match="not-there"):
        run_pipeline(spec(failed, rankings=[str(tmp_path / "not-there")]), echo=lambda s: None)
    rc, rep, text = status(failed)
    states = {s["stage"]: s for s in rep["stages"]}
    assert rc == 1 and states["synth"]["state"] == "published" and states["evaluate"]["state"] == "failed"
    assert "not-there" in states["evaluate"]["error"] and states["evaluate"]["run_id"]
    assert "evaluate    failed" in text and "not-there" in text
    # the record lives under the output, so it outlives the process (and a pod)
    assert os.path.exists(os.path.join(failed, "evaluate", "_work", "failure.json"))
    # a later successful attempt clears it
    run_pipeline(spec(failed), echo=lambda s: None)
    assert not os.path.exists(os.path.join(failed, "evaluate", "_work", "failure.json"))
    assert status(failed)[0] == 0

    running = str(tmp_path / "running")
    run_pipeline({**spec(running), "stages": {"synth": spec(running)["stages"]["synth"]}}, echo=lambda s: None)
    storage.write_bytes(storage.join(running, "_run", "plan.json"), json.dumps({"stages": [
        {"stage": "synth", "output": storage.join(running, "synth")},
        {"stage": "embed", "output": storage.join(running, "embed")},
        {"stage": "evaluate", "output": storage.join(running, "evaluate")}]}).encode())
    held = lease.Lease(storage.join(running, "embed"), purpose="stage embed", ttl=60).acquire()
    try:
        storage.write_bytes(storage.join(running, "embed", "_work", "embeddings", "shard-00000.npy"), b"x")
        rc, rep, text = status(running)
    finally:
        held.release()
    states = {s["stage"]: s for s in rep["stages"]}
    assert states["embed"]["state"] == "running" and f"pid {os.getpid()}" in states["embed"]["holder"]
    assert states["embed"]["partial_files"] == 1
    assert states["evaluate"]["state"] == "not started" and "embed       running" in text


def test_s3_run(s3_root):
    run = storage.join(s3_root, "run")
    run_pipeline(spec(run), echo=lambda s: None)
    rc, rep, _ = status(run, env=dict(os.environ))
    assert rc == 0 and [s["state"] for s in rep["stages"]] == ["published", "published"]


def test_nothing_there_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "status", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "nothing there" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("cmd", ["pipeline", "demo", "status", "models"])
def test_help_is_plain_text(cmd):
    """`memsifter <cmd> --help` shows no reST markup (``literal``, :func:`role`)."""
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", cmd, "--help"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "``" not in p.stdout and ":func:" not in p.stdout, p.stdout[:500]


def test_data_info_on_a_run_prefix_points_to_status(tmp_path):
    run = str(tmp_path / "run")
    run_pipeline(spec(run), echo=lambda s: None)
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "data", "info", run], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and f"memsifter status {run}" in p.stderr and "Traceback" not in p.stderr


def test_running_stage_shows_items_done_rate_and_eta(tmp_path):
    """issue 41: status of a running stage showed the lease only. A real embed stage (BM25, no model),
    held at the start of its publish: status shows what its progress bars recorded (questions done, rate,
    ETA); then a count half done, recorded by the same progress bar a stage uses, gives a real ETA."""
    import time

    from memsifter import stage as stg
    from memsifter.models.raypool import Progress

    data, out = str(tmp_path / "data"), str(tmp_path / "embed")
    run_pipeline({"run": str(tmp_path / "r"), "stages": {"synth": {"questions": 3, "sessions_per_question": 4,
                                                                   "output": data}}}, echo=lambda s: None)
    env = {**os.environ, "MEMSIFTER_PAUSE_AT": "embed:publish-start:30"}
    p = subprocess.Popen([sys.executable, "-m", "memsifter.cli", "run", "embed", "--input", data, "--output", out,
                          "--no-zsum", "--no-cascade", "-q"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline, rep = time.time() + 60, {}
        while time.time() < deadline:   # until the stage took its lease and recorded its last count
            j = subprocess.run([sys.executable, "-m", "memsifter.cli", "status", out, "--json"],
                               capture_output=True, text=True, timeout=120)
            rep = json.loads(j.stdout) if j.returncode == 0 else {}
            st = rep["stages"][0] if rep.get("stages") else {}
            if st.get("state") == "running" and st.get("progress", {}).get("desc") == "embed: scores":
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no progress shown: {rep}")
        rc, rep, text = status(out)
        st = rep["stages"][0]
    finally:
        p.kill()
        p.communicate(timeout=30)
    prog = st["progress"]
    assert prog["done"] == prog["total"] == 3 and prog["unit"] == "question" and prog["eta_seconds"] == 0
    assert prog["per_second"] > 0
    assert "embed: scores: 3/3 questions done" in text and "question/s, ETA 0 s" in text, text

    # mid-count, as a stage's bar records it under its lease: 4 of 10 in 8 s -> 0.5/s, ETA 12 s
    held = lease.Lease(out, purpose="stage rank", ttl=60).acquire(steal=True)
    stg._progress.update(output=out, stage="rank")
    try:
        bar = Progress(10, desc="rank m", unit="question")
        bar.t0 -= 8
        bar.update(4)
        rc, rep, text = status(out)
    finally:
        stg._progress.clear()
        held.release()
    prog = rep["stages"][0]["progress"]
    assert prog["done"] == 4 and prog["total"] == 10 and 0.45 < prog["per_second"] < 0.55, prog
    assert 10 <= prog["eta_seconds"] <= 14 and "rank m: 4/10 questions done" in text and "ETA 1" in text, text
