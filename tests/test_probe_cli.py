"""Issue 30's probes of the command line, `memsifter status` and `memsifter pipeline`: each is one
row or one test here, with one defined outcome.

- Bad input (a 5,000-digit integer in ``--set`` or a config file, a config that is a device, a pipe,
  too large or an alias bomb, a plan.json of the wrong shape, ``status --watch -1``, unknown keys and
  names, synthetic totals without bound): one line naming what is wrong, exit 2, never a traceback;
  typos get "did you mean".
- status: the same run named three ways lists each stage once; a lease whose process is gone on this
  host is "stale lease", not "running"; ``--watch`` ends once nothing is running; a stage's own output
  shows that stage; outputs outside the run's plan are marked as such.
- pipeline: ``pipeline schema`` is the config's JSON schema, generated from the stage registry, and
  the README documents the same keys; the ``--replace`` hint names the stage.
- ``-q``: stderr holds memsifter's own warnings and errors only (no bm25s, Ray or C++ lines).

Real parts throughout: the CLI (in-process ``cli.main`` where the process survives the probe, a
subprocess where it might not: a FIFO, /dev/zero, ``-q``), real stages publishing to a local
directory and SeaweedFS, real leases held by real processes that are then killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memsifter import cli
from memsifter.store import lease, storage
from memsifter.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[1]
HUGE = "1" + "0" * 5000          # more digits than Python converts to int by default (4,300)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def call(argv: list[str], capsys) -> tuple[int, str]:
    """``memsifter ARGV`` in this process: (exit code, stderr). An exception escaping it fails the test
    (that is the traceback a user would see)."""
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except SystemExit as e:   # argparse: usage line and exit 2
        rc = e.code
    return rc, capsys.readouterr().err


def shell(argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memsifter.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=ENV, **kw)


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


SYNTH_SECTION = "stages:\n  synth: {questions: 2, sessions_per_question: 3}\n"


def pipeline_cfg(tmp: Path, extra: str = "", stages: str = SYNTH_SECTION) -> str:
    return write(tmp / "p.yaml", f"run: {tmp / 'run'}\n{extra}{stages}")


def plan(tmp: Path, doc) -> str:
    run = tmp / "run"
    write(run / "_run" / "plan.json", json.dumps(doc))
    return str(run)


# (case, argv from tmp_path, what the one line says). Each exits 2 with one line (argparse: usage + one).
ONE_LINE = [
    ("set-5000-digit-int", lambda t: ["run", "synth", "--output", str(t / "o"), "--set", f"questions={HUGE}"],
     "--set questions"),
    ("config-5000-digit-int", lambda t: ["run", "synth", "--output", str(t / "o"), "--config",
                                         write(t / "c.yaml", f"questions: {HUGE}\n")], "c.yaml"),
    ("config-bad-date", lambda t: ["run", "synth", "--output", str(t / "o"), "--config",
                                   write(t / "c.yaml", "seed: 2024-13-45\n")], "c.yaml"),
    ("pipeline-set-5000-digit-int", lambda t: ["pipeline", "show", "--config", pipeline_cfg(t), "--set",
                                               f"stages.synth.seed={HUGE}"], "--set stages.synth.seed"),
    ("pipeline-config-5000-digit-int", lambda t: ["pipeline", "show", "--config",
                                                  pipeline_cfg(t, f"dataset: {HUGE}\n")], "p.yaml"),
    ("config-over-1MiB", lambda t: ["run", "synth", "--output", str(t / "o"), "--config",
                                    write(t / "big.yaml", "# padding\n" * 120_000 + "seed: 1\n")], "1 MiB"),
    ("config-is-a-directory", lambda t: ["run", "synth", "--output", str(t / "o"), "--config", str(t)], "directory"),
    ("pipeline-unknown-top-key", lambda t: ["pipeline", "show", "--config", pipeline_cfg(t, "rey: {}\n")],
     "did you mean 'ray'"),
    ("pipeline-misspelt-dataset", lambda t: ["pipeline", "show", "--config", pipeline_cfg(
        t, "datset: /d\n", "stages:\n  embed: {}\n")], "did you mean 'dataset'"),
    ("pipeline-unknown-ray-key", lambda t: ["pipeline", "show", "--config",
                                            pipeline_cfg(t, "ray: {adress: x}\n")], "did you mean 'address'"),
    ("pipeline-misspelt-stage", lambda t: ["pipeline", "show", "--config", pipeline_cfg(
        t, "", "stages:\n  synht: {}\n")], "did you mean 'synth'"),
    ("pipeline-section-typo", lambda t: ["pipeline", "show", "--config", pipeline_cfg(
        t, "", "stages:\n  synth: {questoins: 2}\n")], "did you mean 'questions'"),
    ("pipeline-force-typo", lambda t: ["pipeline", "run", "--config", pipeline_cfg(t), "--force", "synht"],
     "did you mean 'synth'"),
    ("pipeline-force-bogus", lambda t: ["pipeline", "run", "--config", pipeline_cfg(t), "--force", "bogus"],
     "--force bogus: not a stage of this pipeline"),
    ("pipeline-replace-bogus", lambda t: ["pipeline", "run", "--config", pipeline_cfg(t), "--replace", "bogus"],
     "--replace bogus: not a stage of this pipeline"),
    ("pipeline-replace-elsewhere", lambda t: ["pipeline", "run", "--config", pipeline_cfg(t), "--replace",
                                              "embed"], "--replace embed: not a stage of this pipeline"),
    # evaluate has no cascade_k: the typo is named, with no suggestion from another stage
    ("set-key-typo", lambda t: ["run", "evaluate", "--input", "/d", "--output", str(t / "o"), "--set",
                                "cascde_k=3"], "cascde_k"),
    ("set-key-typo-stage", lambda t: ["run", "embed", "--input", "/d", "--output", str(t / "o"), "--set",
                                      "cascde_k=3"], "did you mean 'cascade_k'"),
    ("flag-typo", lambda t: ["run", "embed", "--inptu", "x"], "did you mean --input"),
    ("command-typo", lambda t: ["statsu", str(t)], "did you mean 'status'"),
    ("data-command-typo", lambda t: ["data", "sytnh", str(t)], "did you mean 'synth'"),
    ("pipeline-command-typo", lambda t: ["pipeline", "rnu"], "did you mean 'run'"),
    ("status-watch-negative", lambda t: ["status", str(t), "--watch", "-1"], "--watch"),
    ("status-watch-nan", lambda t: ["status", str(t), "--watch", "nan"], "--watch"),
    ("status-watch-1e300", lambda t: ["status", str(t), "--watch", "1e300"], "--watch"),
    ("status-plan-stages-int", lambda t: ["status", plan(t, {"stages": 5})], "plan.json"),
    ("status-plan-output-list", lambda t: ["status", plan(t, {"stages": [{"stage": "synth", "output": ["a"]}]})],
     "plan.json"),
    ("status-plan-not-object", lambda t: ["status", plan(t, [1, 2])], "plan.json"),
    # issue 41: YAML reads a hexadecimal literal at any length; printing it later raised (a traceback)
    ("set-hex-5000-fs", lambda t: ["run", "synth", "--output", str(t / "o"), "--set", "seed=0x" + "f" * 5000],
     "--set seed"),
    ("config-hex-5000-fs", lambda t: ["run", "synth", "--output", str(t / "o"), "--config",
                                      write(t / "c.yaml", "seed: 0x" + "f" * 5000 + "\n")], "c.yaml"),
    ("pipeline-set-hex-5000-fs", lambda t: ["pipeline", "show", "--config", pipeline_cfg(t), "--set",
                                            "stages.synth.seed=0x" + "f" * 5000], "--set stages.synth.seed"),
]
@pytest.mark.parametrize("case,argv,says", ONE_LINE, ids=[c for c, *_ in ONE_LINE])
def test_bad_input_is_one_line_exit_2(case, argv, says, tmp_path, capsys):
    rc, err = call(argv(tmp_path), capsys)
    assert rc == 2, (case, err[-2000:])
    assert "Traceback" not in err and says in err, (case, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if lines[0].startswith("usage:"):   # argparse: its usage line, then one error line
        lines = lines[1:]
    if "invalid config for stage" not in lines[0]:   # pydantic's list: one line per field
        assert len(lines) == 1, (case, err[-2000:])


@pytest.mark.parametrize("name,make", [("fifo", os.mkfifo), ("dev-zero", None)])
def test_config_that_is_not_a_regular_file_is_refused(name, make, tmp_path):
    """A pipe would block forever and /dev/zero never ends: both are refused before any read (a
    subprocess with 1 GiB of address space and a time limit, so the old behaviour fails, not hangs)."""
    path = "/dev/zero"
    if make is not None:
        path = str(tmp_path / name)
        make(path)

    def limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    try:
        p = shell(["run", "synth", "--output", str(tmp_path / "o"), "--config", path], timeout=60,
                  preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"--config {path}: still reading after 60 s")
    assert p.returncode == 2 and "not a regular file" in p.stderr and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert len(p.stderr.strip().splitlines()) == 1


def test_config_alias_bomb_is_refused(tmp_path):
    """Nine levels of ten YAML aliases: 10^9 values once expanded (validation, hashing and JSON copy
    every use), in a field that takes any mapping. A subprocess with 4 GiB and a time limit."""
    anchors = "".join(f"    {c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    cfg = write(tmp_path / "bomb.yaml", "input: /d\nembeddings: /e\nmodel: m\nvllm:\n  engine_kwargs:\n"
                "    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + anchors)

    def limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    try:
        p = shell(["run", "rank", "--config", cfg, "--output", str(tmp_path / "o"), "--print-config"], timeout=60,
                  preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail("an alias bomb: still expanding after 60 s")
    assert p.returncode == 2 and "bomb.yaml" in p.stderr and "aliases" in p.stderr, p.stderr[-1500:]
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_s3_config_over_the_cap_is_refused(s3_root, capsys):
    uri = storage.join(s3_root, "big.yaml")
    storage.write_bytes(uri, b"# padding\n" * 120_000 + b"seed: 1\n")
    rc, err = call(["run", "synth", "--output", storage.join(s3_root, "o"), "--config", uri], capsys)
    assert rc == 2 and "1 MiB" in err and uri in err and len(err.strip().splitlines()) == 1, err
    small = storage.join(s3_root, "ok.yaml")
    storage.write_bytes(small, b"questions: 2\nsessions_per_question: 3\n")
    rc, err = call(["run", "synth", "--output", storage.join(s3_root, "o"), "--config", small], capsys)
    assert rc == 0, err


def test_synth_bound_is_stated_and_what_fits_runs(tmp_path, capsys):
    """Each field's own bound allowed 10^6 questions × 10^4 sessions: the product is bounded too (the
    CLI runs in a subprocess with 4 GiB of address space and a time limit, so the old behaviour fails)."""
    from pydantic import ValidationError

    from memsifter.data import synth

    with pytest.raises(ValidationError, match=r"questions × sessions_per_question × turns_per_session"):
        synth.SynthConfig(output=str(tmp_path / "x"), questions=100_000, sessions_per_question=100)

    def limit() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    try:
        p = shell(["data", "synth", str(tmp_path / "s"), "--questions", "1000000", "--sessions", "10000"],
                  timeout=60, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail("data synth --questions 1000000 --sessions 10000: still generating after 60 s")
    assert p.returncode == 2 and "at most 2,000,000" in p.stderr and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert not os.path.exists(tmp_path / "s" / "_SUCCESS")
    rc, err = call(["data", "synth", str(tmp_path / "ok"), "--questions", "3", "--sessions", "4"], capsys)
    assert rc == 0, err


def test_data_synth_takes_steal_lease_as_its_hint_says(tmp_path, capsys):
    out = str(tmp_path / "s")
    held = lease.Lease(out, purpose="stage synth", ttl=60).acquire()
    try:
        rc, err = call(["data", "synth", out, "--questions", "2", "--sessions", "3"], capsys)
        assert rc == 3 and "--steal-lease" in err, err
        rc, err = call(["data", "synth", out, "--questions", "2", "--sessions", "3", "--steal-lease", "-q"], capsys)
        assert rc == 0, err
    finally:
        held.release()
    assert storage.read_manifest(out)["stage"] == "synth"


# --------------------------------------------------------------------------- status
def status_json(argv: list[str], capsys) -> tuple[int, dict]:
    from memsifter import status

    capsys.readouterr()
    rc = status.main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


SPEC = {"stages": {"synth": {"questions": 2, "sessions_per_question": 3},
                   "evaluate": {"rankings": [], "answers": []}}}


def test_status_lists_each_stage_once_however_the_run_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_pipeline({"run": "./RUN", **SPEC}, echo=lambda s: None)
    for name in ("RUN", "RUN/", "./RUN", str(tmp_path / "RUN"), str(tmp_path / "RUN") + "/"):
        rc, rep = status_json([name], capsys)
        assert rc == 0 and [(s["stage"], s["state"]) for s in rep["stages"]] == [
            ("synth", "published"), ("evaluate", "published")], (name, rep)
    # from another directory the plan's relative outputs still mean the run that was asked about
    monkeypatch.chdir("/")
    rc, rep = status_json([str(tmp_path / "RUN")], capsys)
    assert [s["state"] for s in rep["stages"]] == ["published", "published"], rep


def _killed_holder(prefix: str) -> int:
    """A real process that takes the lease on ``prefix`` (60 s TTL), then is killed: its lease stays."""
    code = ("import sys, time\nfrom memsifter.store import lease\n"
            f"lease.Lease({prefix!r}, purpose='stage embed', ttl=60).acquire()\nprint('held', flush=True)\n"
            "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout.readline().strip() == "held"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    return p.pid


def test_status_dead_holder_is_stale_and_watch_ends(tmp_path, capsys):
    run = str(tmp_path / "run")
    run_pipeline({"run": run, "stages": {"synth": SPEC["stages"]["synth"]}}, echo=lambda s: None)
    storage.write_bytes(storage.join(run, "_run", "plan.json"), json.dumps({"run": run, "stages": [
        {"stage": "synth", "output": storage.join(run, "synth")},
        {"stage": "embed", "output": storage.join(run, "embed")},
        {"stage": "evaluate", "output": storage.join(run, "evaluate")}]}).encode())
    pid = _killed_holder(storage.join(run, "embed"))
    _killed_holder(storage.join(run, "_run"))          # the pipeline itself was killed too
    rc, rep = status_json([run], capsys)
    embed = {s["stage"]: s for s in rep["stages"]}["embed"]
    assert embed["state"] == "stale lease" and f"pid {pid}" in embed["holder"], rep
    # --watch ends: nothing runs any more (it used to redraw until the lease expired, then for ever)
    t0 = time.time()
    p = shell(["status", run, "--watch", "0.2"], timeout=60)
    assert time.time() - t0 < 30 and p.returncode == 1, p.stdout + p.stderr
    assert "stale" in p.stdout and "not started" in p.stdout and "Traceback" not in p.stderr


def test_status_watch_ends_on_a_failed_pipeline(tmp_path):
    """The pipeline stopped at a failed stage; the stage after it never starts: --watch ends (it used
    to wait for "not started" stages for ever)."""
    run = str(tmp_path / "run")
    with pytest.raises(Exception, match="not-there"):
        run_pipeline({"run": run, "stages": {"import": {"format": "locomo", "source": str(tmp_path / "not-there")},
                                             "evaluate": {"rankings": [], "answers": []}}}, echo=lambda s: None)
    try:
        p = shell(["status", run, "--watch", "0.2"], timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("status --watch of a failed pipeline: still watching after 60 s")
    assert p.returncode == 1 and "failed" in p.stdout and "not started" in p.stdout, p.stdout + p.stderr


def test_status_of_one_stage_output_shows_that_stage(tmp_path, capsys):
    run = str(tmp_path / "run")
    run_pipeline({"run": run, **SPEC}, echo=lambda s: None)
    rc, rep = status_json([storage.join(run, "synth")], capsys)
    assert rc == 0 and [(s["stage"], s["state"]) for s in rep["stages"]] == [("synth", "published")], rep
    capsys.readouterr()
    from memsifter import status
    assert status.main([storage.join(run, "synth")]) == 0
    assert "synth" in capsys.readouterr().out.split("\n", 1)[1]


def test_status_marks_outputs_outside_the_plan(tmp_path, capsys):
    run = str(tmp_path / "run")
    run_pipeline({"run": run, **SPEC}, echo=lambda s: None)
    # a mistyped command leaves a failed output inside the run
    rc, _ = call(["run", "evaluate", "--input", storage.join(run, "synht"), "--output",
                  storage.join(run, "evalute")], capsys)
    assert rc == 2
    rc, rep = status_json([run], capsys)
    states = {s["stage"] if s.get("in_plan", True) else "stray": s for s in rep["stages"]}
    assert rc == 0, rep   # the run's own stages are all published
    assert states["stray"]["state"] == "failed" and states["stray"]["in_plan"] is False, rep
    from memsifter import status
    capsys.readouterr()
    status.main([run])
    text = capsys.readouterr().out
    assert "not in the run's plan" in text and text.index("not in the run's plan") < text.index("evalute")


def _live_run(tmp_path: Path, escapes: str = "") -> tuple[str, "lease.Lease"]:
    """A run whose embed stage holds a live lease of this process (the caller releases it)."""
    run = str(tmp_path / "run")
    run_pipeline({"run": run, "stages": {"synth": SPEC["stages"]["synth"]}}, echo=lambda s: None)
    storage.write_bytes(storage.join(run, "_run", "plan.json"), json.dumps({"run": run, "stages": [
        {"stage": "synth", "output": storage.join(run, "synth")},
        {"stage": "embed", "output": storage.join(run, "embed")},
        {"stage": "evaluate" + escapes, "output": storage.join(run, "evaluate")}]}).encode())
    return run, lease.Lease(storage.join(run, "embed"), purpose="stage embed" + escapes, ttl=60).acquire()


def test_status_watch_interval_is_floored(tmp_path):
    """issue 41: `status --watch 1e-9` redrew 8,805 times in 6 s; the interval is raised to 1 s."""
    run, held = _live_run(tmp_path)
    try:
        p = subprocess.Popen([sys.executable, "-m", "memsifter.cli", "status", run, "--watch", "1e-9"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        time.sleep(6)
        p.terminate()
        out, err = p.communicate(timeout=30)
    finally:
        held.release()
    draws = out.count(f"run {run}")
    assert 2 <= draws <= 8, (draws, err[-2000:])   # ~6 at the 1 s floor (plus start-up)


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31mRED\x9b1m\u202e"


def test_status_escapes_control_characters_from_store_files(tmp_path, capsys):
    """issue 41: terminal escape sequences taken from store files (a failure record, a lease, the plan)
    reached the terminal raw; every control character is shown escaped."""
    from memsifter import status

    run, held = _live_run(tmp_path, ESCAPES)
    try:
        storage.write_bytes(storage.join(run, "evaluate", "_work", "failure.json"), json.dumps({
            "stage": "evaluate", "error": "boom" + ESCAPES, "failed_at": "2026-01-01T00:00:00Z",
            "run_id": "r" + ESCAPES, "host": "h\nfake line", "log_tail": ["tail" + ESCAPES]}).encode())
        capsys.readouterr()
        status.main([run])
        out = capsys.readouterr().out
    finally:
        held.release()
    assert "boom" in out and "tail" in out and "RED" in out, out
    bad = [c for c in out if (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) <= 0x9f or c == "\u202e"]
    assert bad == [], repr(bad)
    assert "\\x1b]0;owned\\x07" in out and "\\x9b" in out and "h\\nfake line" in out, out
    assert not any(ln.startswith("fake line") for ln in out.splitlines())


@pytest.mark.parametrize("word", ["null", "None", "~", ""])
def test_optional_flag_null_means_unset(word, tmp_path, capsys):
    """issue 41: `--search-api-key-env null` was read as a variable named "null"; null/none/~/empty unset
    an optional field, as `--set key=null` does."""
    capsys.readouterr()
    rc = cli.main(["run", "agents", "--input", str(tmp_path / "d"), "--output", str(tmp_path / "o"),
                   "--search-url", "http://127.0.0.1:9", "--search-api-key-env", word, "--print-config"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["search_api_key_env"] is None
    rc = cli.main(["run", "agents", "--input", str(tmp_path / "d"), "--output", str(tmp_path / "o"),
                   "--search-api-key-env", "MY_KEY", "--print-config"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["search_api_key_env"] == "MY_KEY"


# --------------------------------------------------------------------------- pipeline
def test_pipeline_schema_is_generated_and_documented(capsys):
    import jsonschema

    from memsifter.stage import available, load_config_file

    rc = cli.main(["pipeline", "schema"])
    schema = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(schema["properties"]) == {"run", "dataset", "ray", "stages"}
    assert schema["additionalProperties"] is False
    stages = schema["properties"]["stages"]
    resolved = stages if "properties" in stages else schema["$defs"][stages["$ref"].split("/")[-1]]
    assert set(resolved["properties"]) == set(available())
    demo = load_config_file(str(ROOT / "memsifter" / "configs" / "demo.yaml"))
    jsonschema.validate(demo, schema)
    for bad in ({**demo, "rey": {}}, {**demo, "stages": {**demo["stages"], "synht": {}}},
                {**demo, "stages": {**demo["stages"], "synth": {"questoins": 1}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    readme = (ROOT / "README.md").read_text()
    ref = readme.split("### Pipeline config reference", 1)[1].split("\n## ", 1)[0]
    ray = schema["$defs"][schema["properties"]["ray"]["$ref"].split("/")[-1]]
    keys = [*schema["properties"], *(f"ray.{k}" for k in ray["properties"])]
    for key in (*keys, "memsifter pipeline schema"):
        assert f"`{key}`" in ref, key


def test_pipeline_replace_hint_names_the_stage(tmp_path, capsys):
    cfg = pipeline_cfg(tmp_path)
    assert call(["pipeline", "run", "--config", cfg, "-q"], capsys)[0] == 0
    rc, err = call(["pipeline", "run", "--config", cfg, "--set", "stages.synth.seed=3", "-q"], capsys)
    assert rc == 2 and "--replace synth" in err and len(err.strip().splitlines()) == 1, err
    assert call(["pipeline", "run", "--config", cfg, "--set", "stages.synth.seed=3", "--replace", "synth", "-q"],
                capsys)[0] == 0


# --------------------------------------------------------------------------- -q
OWN_LINE = re.compile(r"^\d\d:\d\d:\d\d (WARNING|ERROR|CRITICAL) memsifter[.:]")


@pytest.mark.slow  # a local Ray instance (~20 s on 2 cores)
def test_quiet_shows_only_memsifters_own_lines(tmp_path):
    """bm25s's DEBUG lines, Ray's token-auth warning and its C++ core-worker lines, Ray Data's INFO
    lines and the workers' output stay off the terminal at -q (Ray is real: a local instance)."""
    data = str(tmp_path / "d")
    p = shell(["data", "synth", data, "--questions", "3", "--sessions", "4", "-q"])
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr
    p = shell(["run", "embed", "-q", "--input", data, "--output", str(tmp_path / "e"), "--model",
               "all-MiniLM-L6-v2", "--dense"], timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    foreign = [ln for ln in p.stderr.splitlines() if ln.strip() and not OWN_LINE.match(ln)]
    assert not foreign, "\n".join(foreign[:20])
