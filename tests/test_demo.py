"""The README's main command: `memsifter demo`, offline, end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memsifter.demo import parse_args
from memsifter.store import storage
from test_demo_screen import _rows


def _ci_demo() -> dict | None:
    """The demo CI ran just before pytest (.ci/demo: the README's command from an empty model cache), when
    $MEMSIFTER_CI_DEMO points at its record: its screen, exit status, command, directory and model cache."""
    where = os.environ.get("MEMSIFTER_CI_DEMO")
    if not where:
        return None
    d = Path(where)
    run = json.loads((d / "run.json").read_text())
    return {**run, "stdout": (d / "stdout.txt").read_text(), "stderr": (d / "stderr.txt").read_text()}


@pytest.mark.slow
def test_demo_runs_offline_on_real_data_and_reports(tmp_path):
    # a newcomer's machine: an EMPTY model cache, so the demo converts SmolLM2 while its vLLM server starts in a
    # thread and embed runs (the cache is built once under a lock: tests/test_models.py). In CI that demo has
    # just run (.ci/demo, the README's command with its defaults): its screen and run are checked here, as
    # strictly, instead of running it a second time from an empty cache.
    memsifter = Path(sys.executable).with_name("memsifter")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    ci = _ci_demo()
    if ci:
        args = parse_args(ci["argv"][1:])
        n_questions, n_answers = args.questions or 40, args.answers   # the demo's defaults: 40 LoCoMo questions
        assert ci["model_cache_entries_before"] == 0, ci   # it started from an empty model cache
        demo, cwd, env["MEMSIFTER_MODEL_CACHE"] = Path(ci["out"]), ci["cwd"], ci["model_cache"]
        argv = [str(memsifter), *ci["argv"]]
        proc = subprocess.CompletedProcess(argv, ci["returncode"], ci["stdout"], ci["stderr"])
    else:
        n_questions, n_answers = 3, 2
        demo, cwd, env["MEMSIFTER_MODEL_CACHE"] = tmp_path / "demo", tmp_path, str(tmp_path / "empty-model-cache")
        argv = [str(memsifter), "demo", "--out", str(demo), "--questions", str(n_questions),
                "--answers", str(n_answers)]
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "SmolLM2-135M-Instruct" in proc.stdout and "NOT trained as a ranker" in proc.stdout
    assert "STAND-IN" not in proc.stdout.upper()  # the random stand-in left the demo
    # one clean screen: Ray/vLLM/library output went to the log file, not the terminal
    noisy = [ln for ln in out.splitlines()
             if any(w in ln for w in (" INFO ", "WARNING", "(raylet)", "Traceback", "it/s]"))]
    assert noisy == [], noisy[:5]
    log = demo / "_logs" / "demo.log"
    assert log.exists() and log.stat().st_size > 0
    lines = proc.stdout.splitlines()
    # every line of the screen fits 120 columns, but for those that name a path or URL
    wide = [ln for ln in lines if len(ln) > 120 and "/" not in ln]
    assert wide == [], wide[:3]

    # each table as soon as its stage is done: LoCoMo's first stage right after its embed, before the rank stage
    # starts (before the demo waits for the vLLM server of the ranker, before rank's own line); its answers after
    # its evaluate; LongMemEval's first stage after LongMemEval's embed
    def at(pred, start: int = 0) -> int:
        return next(i for i, ln in enumerate(lines) if i >= start and pred(ln))

    def done(stage: str, ds: str) -> int:
        return at(lambda ln: ln.startswith(f"[pipeline] {stage} ") and f"/{ds}/{stage}" in ln)

    first = at(lambda ln: ln.startswith("First-stage retrieval (locomo)"))
    rank_starts = at(lambda ln: "(rank)" in ln and "waiting for the vLLM server" in ln
                     or ln.startswith("[pipeline] rank "))
    assert done("embed", "locomo") < first < rank_starts <= done("rank", "locomo"), (first, rank_starts)
    answers_at = at(lambda ln: ln.startswith("Answers of the working"))
    assert done("evaluate", "locomo") < answers_at < done("embed", "longmemeval")
    assert done("embed", "longmemeval") < at(lambda ln: ln.startswith("First-stage retrieval (longmemeval)")) \
        < done("evaluate", "longmemeval")

    # the real samples; LoCoMo goes through every stage, LongMemEval through the first stage
    stages = {"locomo": ("import", "embed", "rank", "chat", "evaluate"), "longmemeval": ("import", "embed", "evaluate")}
    for ds, names in stages.items():
        for stage in names:
            assert storage.read_manifest(str(demo / ds / stage))["stage"] == stage
        assert (demo / ds / "evaluate" / "report.md").exists()
        assert f"report {ds}" in proc.stdout
        table = _rows(lines[at(lambda ln: ln.startswith(f"First-stage retrieval ({ds})")):])
        for method in ("embed:dense", "embed:bm25"):
            assert any(r.split()[0] == method and re.match(rf"{method} +\d+ +\d\.\d{{3}} \[", r) for r in table), \
                (ds, method, table)
    # the ranker adapter that returns its input order is left out unless asked for (--trained-ranker)
    assert not (demo / "locomo" / "rank-trained").exists()
    assert "rank:smollm2-135m-memsifter-ranker" not in proc.stdout and "--trained-ranker" in proc.stdout
    # the ranker beside the first stage on the SAME questions: every row of that table has the ranker's n (then
    # recall_any@5 with its 95% interval), the ranker its order change against the first-stage order it was
    # given, and "returns its input order" exactly where it changed none
    ev = storage.read_manifest(str(demo / "locomo" / "evaluate"))["stats"]
    base = "rank:smollm2-135m-instruct+structured"
    n_rank = ev["retrieval"][base]["n"]
    rank_rows = _rows(lines[at(lambda ln: ln.startswith("Rankers, beside")):answers_at])
    assert any(r.split()[0] == "embed:dense" for r in rank_rows), rank_rows
    for r in rank_rows[1:]:
        assert re.search(rf"\s{n_rank}\s+\d\.\d{{3}} \[", r), r
    row = next(r for r in rank_rows if r.split()[0] == base)
    io = ev["retrieval"][base]["input_order"]
    assert io["n"] == n_rank and f"{io['changed']}/{io['n']} (" in row, row
    assert ("returns its input order" in row) == io["returns_input_order"], row
    # the answers table: every context, the real working LLM's F1 beside its retrieval metrics
    answers = _rows(lines[answers_at:at(lambda ln: ln.startswith("report "))])
    labels = [r.split()[0] for r in answers if not r.startswith("context")]
    assert labels[0] in ("no", "constant", "random") and {"oracle", "embed:dense", base} <= set(labels), answers
    # F1 with its n and 95% interval for every context; the retrieval beside it over the same answered questions
    for method in ("no memory", "embed:dense", base, "oracle (gold sessions)"):
        assert any(r.startswith(method) and re.search(rf"\s{n_answers}\s+\d\.\d{{3}} \[", r) for r in answers), \
            (method, answers)
    assert any(r.startswith("embed:dense") and re.search(rf"\s{n_answers}\s+\d\.\d{{3}} \[.*\] \d\.\d{{3}} \[", r)
               for r in answers), answers
    ans = storage.read_parquet(str(demo / "locomo" / "chat" / "answers.parquet")).to_pylist()
    per = {m: sum(1 for r in ans if r["method"] == m) for m in {r["method"] for r in ans}}
    assert set(per.values()) == {n_answers} and all(r["status"] == "ok" and r["raw_response"] for r in ans), per
    rk = storage.read_manifest(str(demo / "locomo" / "rank"))
    assert rk["stats"]["questions"] == n_answers and rk["config"]["model"] == "smollm2-135m-instruct"
    imp = storage.read_manifest(str(demo / "locomo" / "import"))
    assert imp["stats"]["questions"] == n_questions and "locomo_dev2" in imp["config"]["source"]
    m = storage.read_manifest(str(demo / "locomo" / "evaluate"))
    assert {"answer_f1_by_method.png", "recall_curve.png"} <= set(m["files"])
    # A second run finds everything published and redoes nothing, and prints the same tables.
    again = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert json.dumps(storage.read_manifest(str(demo / "locomo" / "evaluate"))["published_at"]) == \
        json.dumps(m["published_at"])
    assert _rows(again.stdout.splitlines()) == _rows(lines)
