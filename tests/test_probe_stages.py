"""Issue 30 (a newcomer's first run): model references, the train dry run and honest evaluate reports.

1. A model reference the stage cannot load is one line and exit 2, checked before Ray or any model
   library starts (:data:`MODEL_CASES`, the real CLI in a subprocess; embed, sft, and train when verl
   would run on this machine): a path that does not exist, a file, a directory that holds no model, a
   hub id that is not in the Hugging Face cache on an offline machine (``HF_HUB_OFFLINE=1``), and,
   online, a hub that cannot be reached or does not know the repository. The "hub" of the last two is a real HTTP server on 127.0.0.1 (``HF_ENDPOINT``)
   answering as huggingface.co does for a missing repository, or a closed port: nothing outside this
   machine can be reached here. The check is the first thing the stage body does: the output's lease is
   taken before the body runs, so its INFO line ("lease taken") may precede the error; a check before
   the lease needs a hook in memsifter/stage.py (reported to the lead).
2. ``run train --dry-run`` with ``s3://`` data and output opens no connection to the object store: the
   endpoint is a real listening socket that counts the connections it accepts.
3. evaluate: no answer plots without answers, n and 95% bootstrap intervals in report.json /
   report.md, a visible zero bar, and methods scored on different question sets flagged; the bootstrap
   helper's interval holds the mean and narrows as n grows.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import Dataset, Question, Session
from memsifter.stage import code_version, get_stage


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("probe")
    uri = str(root / "data")
    get_stage("synth").run({"output": uri, "questions": 4, "sessions_per_question": 4})
    return uri


@pytest.fixture(scope="module")
def prepare_rl(tmp_path_factory) -> str:
    """A published prepare-rl output with the right file names (the sft check runs before it is read)."""
    uri = str(tmp_path_factory.mktemp("rl") / "rl")
    pub = storage.Publication(uri, "prepare-rl", {}, "test", code_version())
    t = pa.table({"data_source": ["memsifter_synth"]})
    pub.write_table("train_00000.parquet", t)
    pub.write_table("test.parquet", t)
    pub.publish({})
    return uri


class _MissingRepo(BaseHTTPRequestHandler):
    """Answers every request as huggingface.co answers for a repository that does not exist."""

    def _answer(self) -> None:
        body = b'{"error":"Repository not found"}'
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def missing_repo_hub():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _MissingRepo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cli(args: list[str], cwd: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    full = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", *args], cwd=str(cwd), env=full,
                       capture_output=True, text=True, timeout=300)
    return p, time.time() - t0


# --------------------------------------------------------------------------- 1. model references
@dataclass
class ModelCase:
    name: str
    stage: str                    # embed | sft | train
    model: str                    # {tmp}: the test's directory
    says: list[str]               # words the one line must hold
    env: dict = field(default_factory=dict)   # {hub}: the missing-repository hub; {closed}: a closed port
    setup: str = ""               # "file" | "empty_dir" | "" | a config.json's text: what to make at {tmp}/thing


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ONLINE = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}

MODEL_CASES = [
    ModelCase("missing-path", "embed", "/nonexistent", ["embed: model '/nonexistent'", "no such"], OFFLINE),
    ModelCase("missing-relative-path", "embed", "./no/such/model", ["'./no/such/model'", "no such"], OFFLINE),
    ModelCase("file-not-dir", "embed", "{tmp}/thing", ["not a model directory"], OFFLINE, setup="file"),
    ModelCase("dir-without-model", "embed", "{tmp}/thing", ["not a model directory", "config.json"], OFFLINE,
              setup="empty_dir"),
    ModelCase("hub-id-offline-uncached", "embed", "BAAI/bge-m3",
              ["embed: model 'BAAI/bge-m3' is not a local directory",
               "not a memsifter model name (`memsifter models list`)", "not in the Hugging Face cache",
               "HF_HUB_OFFLINE"], OFFLINE),
    ModelCase("hub-unreachable", "embed", "BAAI/bge-m3", ["not in the Hugging Face cache", "cannot be reached"],
              {**ONLINE, "HF_ENDPOINT": "http://127.0.0.1:{closed}"}),
    ModelCase("hub-repo-missing", "embed", "nobody/no-such-encoder", ["not found on the Hugging Face hub"],
              {**ONLINE, "HF_ENDPOINT": "{hub}"}),
    # issue 41: a folder whose config.json is bad printed 331-362 lines of Ray traceback
    ModelCase("config-not-json", "embed", "{tmp}/thing", ["config.json is not JSON (line 1 column"], OFFLINE,
              setup='{"model_type": "bert",'),
    ModelCase("config-a-list", "embed", "{tmp}/thing", ["config.json holds a JSON list"], OFFLINE, setup="[1, 2]"),
    ModelCase("config-no-model-type", "embed", "{tmp}/thing", ["field 'model_type'"], OFFLINE,
              setup='{"hidden_size": 8}'),
    ModelCase("config-unknown-model-type", "embed", "{tmp}/thing", ["not a config transformers can load",
                                                                     "no-such-arch"], OFFLINE,
              setup='{"model_type": "no-such-arch"}'),
    ModelCase("sft-config-not-json", "sft", "{tmp}/thing", ["sft: model", "config.json is not JSON"], OFFLINE,
              setup="{"),
    ModelCase("sft-missing-path", "sft", "/nonexistent", ["sft: model '/nonexistent'", "no such"], OFFLINE),
    ModelCase("train-missing-path", "train", "/nonexistent", ["train: model '/nonexistent'", "no such"], OFFLINE),
    ModelCase("sft-hub-id-offline-uncached", "sft", "HuggingFaceTB/no-such-model",
              ["sft: model 'HuggingFaceTB/no-such-model'", "not in the Hugging Face cache"], OFFLINE),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_model_reference_is_one_line_exit_2_before_anything_starts(case, synth, prepare_rl, tmp_path,
                                                                    missing_repo_hub):
    thing = tmp_path / "thing"
    if case.setup == "file":
        thing.write_text("not a model")
    elif case.setup == "empty_dir":
        (thing / "sub").mkdir(parents=True)
    elif case.setup:   # a model directory whose config.json is this text (weights beside it)
        thing.mkdir()
        (thing / "config.json").write_text(case.setup)
        (thing / "model.safetensors").write_bytes(b"\0" * 64)
    hf_home = tmp_path / "hf"   # an empty Hugging Face cache: nothing is cached
    env = {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub")}
    env.update({k: v.replace("{hub}", missing_repo_hub).replace("{closed}", str(closed_port()))
                for k, v in case.env.items()})
    out = tmp_path / "out"
    model = case.model.replace("{tmp}", str(tmp_path))
    if case.stage == "embed":
        args = ["run", "embed", "--input", synth, "--output", str(out), "--model", model]
    elif case.stage == "sft":
        args = ["run", "sft", "--data", prepare_rl, "--output", str(out), "--model", model, "--device", "cpu"]
    else:   # train without RAY_ADDRESS: verl would start Ray and load the model on this machine
        args = ["run", "train", "--data", prepare_rl, "--output", str(out), "--model", model,
                "--set", "reward.mode=dcg", "--local-dir", str(tmp_path / "scratch")]
        env["RAY_ADDRESS"] = ""
    p, took = cli(args, tmp_path, env)
    # The check is the config's preflight (Stage.run, before the output's lease): one line and nothing else
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    for word in case.says:
        assert word in lines[0], lines[0]
    assert not (out / "_SUCCESS").exists()
    assert not out.exists() or not any(out.rglob("*"))  # nothing written, not even a lease or _work/
    assert "ray" not in p.stderr.lower() and took < 60   # no Ray, no model library loading a model


def test_model_reference_accepted_forms(tmp_path, monkeypatch):
    """What passes the check: a model directory, a memsifter registry name, an s3:// prefix (fetched at
    run time), and a hub id found in the Hugging Face cache (a cache laid out as huggingface_hub does)."""
    from memsifter.models.embedding import check_model_ref

    d = tmp_path / "enc"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "bert"}')   # a config transformers loads ("{}" is refused)
    cache = tmp_path / "hub"
    snap = cache / "models--org--cached-enc" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (cache / "models--org--cached-enc" / "refs").mkdir()
    (cache / "models--org--cached-enc" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for ref in (str(d), "all-minilm-l6-v2", "s3://bucket/models/enc", "org/cached-enc"):
        check_model_ref(ref, "embed", hf_cache=str(cache))


# --------------------------------------------------------------------------- 2. train --dry-run
class _CountingEndpoint:
    """A real listening socket standing in for the S3 endpoint: counts the connections made to it and
    closes each at once (any S3 call would fail)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.accepted = 0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _loop(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        self.sock.close()


def test_train_dry_run_makes_no_store_call(tmp_path):
    """`run train --config <s3 inputs and outputs> --dry-run` composes and prints the verl config without
    one connection to the object store (no manifest read, no listing, no lease): before, it retried the
    data manifest for ~55 s against an unreachable endpoint."""
    cfg = tmp_path / "train.yaml"
    cfg.write_text("data: s3://bucket/run/prepare-rl\noutput: s3://bucket/run/train\n"
                   "init_adapter: s3://bucket/run/sft\nlocal_dir: /scratch\n"
                   "reward:\n  mode: dcg\nverl:\n  actor_rollout_ref.model.lora_rank: 8\n")
    ep = _CountingEndpoint()
    try:
        p, took = cli(["run", "train", "--config", str(cfg), "--dry-run"], tmp_path,
                      {"MEMSIFTER_S3_ENDPOINT": ep.url, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                       "AWS_REGION": "us-east-1", **OFFLINE})
    finally:
        ep.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert ep.accepted == 0, f"the dry run connected to the store {ep.accepted} time(s)"
    import yaml

    composed = yaml.safe_load(p.stdout)
    assert composed["data"]["train_files"] == ["/scratch/data/train_00000.parquet"]
    assert composed["actor_rollout_ref"]["model"]["lora_adapter_path"] == "/scratch/init_adapter"
    assert "data s3://bucket/run/prepare-rl: not read" in p.stderr
    assert "transient store error" not in p.stderr
    assert took < 120


# --------------------------------------------------------------------------- 3. evaluate
def _dataset(n: int = 6) -> Dataset:
    sessions = {f"s{i}": Session(f"s{i}", [{"role": "user", "content": f"text {i}"}], f"2024-01-0{i % 9 + 1}")
                for i in range(6)}
    qs = [Question(f"q{j}", "dsA", "where?", "Paris", [f"s{i}" for i in range(6)], [f"s{j % 6}"],
                   question_type="single" if j % 2 else "multi") for j in range(n)]
    return Dataset(sessions, qs)


def _publish(uri, stage_name, write):
    pub = storage.Publication(uri, stage_name, {}, "x", "test")
    write(pub)
    pub.publish({})


def _rows(ds: Dataset, method: str, ids: list[str], gold_first: bool) -> list[dict]:
    out = []
    for q in ds.questions:
        if q.question_id not in ids:
            continue
        rest = [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        order = q.gold_session_ids + rest if gold_first else rest + q.gold_session_ids
        out.append({"question_id": q.question_id, "ranked_session_ids": order, "scores": None, "method": method,
                    "status": "ok", "reason": None, "raw_response": None})
    return out


def _rankings_file(tmp_path, name: str, rows: list[dict]) -> str:
    f = str(tmp_path / f"{name}.parquet")
    storage.write_bytes(f, storage.parquet_bytes(rankings.rankings_table(rows)))
    return f


def test_evaluate_without_answers_writes_no_answer_plots(tmp_path):
    ds = _dataset()
    data = str(tmp_path / "data")
    _publish(data, "synth", ds.write)
    f = _rankings_file(tmp_path, "m", _rows(ds, "m", [q.question_id for q in ds.questions], True))
    out = str(tmp_path / "eval")
    m = get_stage("evaluate").run({"output": out, "input": data, "rankings": [f]})
    assert "recall_curve.png" in m["files"]
    assert not {"answer_f1_by_type.png", "answer_f1_by_method.png"} & set(m["files"])
    md = storage.read_text(storage.join(out, "report.md"))
    assert "answer_f1_by" not in md and "(no answers)" not in md


def test_evaluate_reports_n_and_bootstrap_intervals(tmp_path):
    ds = _dataset()
    data = str(tmp_path / "data")
    _publish(data, "synth", ds.write)
    ids = [q.question_id for q in ds.questions]
    rows = _rows(ds, "half", ids[:3], True) + _rows(ds, "half", ids[3:], False)
    f = _rankings_file(tmp_path, "half", rows)
    ans = []
    for q in ds.questions:
        ans.append({"question_id": q.question_id, "method": "m", "dataset": q.dataset, "question_type": q.question_type,
                    "answer": "a", "status": "ok", "ranking_status": None, "exact_match": 0.0,
                    "f1": 1.0 if q.question_type == "single" else 0.0, "judge": None})
    chat = str(tmp_path / "chat")
    _publish(chat, "chat", lambda p: p.write_table("answers.parquet", pa.Table.from_pylist(ans)))
    out = str(tmp_path / "eval")
    get_stage("evaluate").run({"output": out, "input": data, "rankings": [f], "answers": [chat]})
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    r = report["retrieval"]["half"]
    ci = r["ci"]["recall_any@1"]
    assert ci["n"] == 6 and ci["ci_low"] <= r["overall"]["recall_any@1"] <= ci["ci_high"]
    assert ci["ci_low"] < 0.5 < ci["ci_high"]          # 3 of 6 questions: a wide interval
    assert r["by_type"]["single"]["ci"]["mrr"]["n"] == 3
    assert len(r["curve"]["recall_any_ci"]) == len(r["curve"]["recall_any"])
    a = report["answers"]["m"]
    assert a["ci"]["f1"]["n"] == 6 and a["ci"]["f1"]["ci_low"] <= 0.5 <= a["ci"]["f1"]["ci_high"]
    assert a["ci"]["judge"] is None                    # no judge scores: no interval
    assert a["by_type"]["multi"]["ci"]["f1"] == {"n": 3, "ci_low": 0.0, "ci_high": 0.0}
    md = storage.read_text(storage.join(out, "report.md"))
    assert "95% bootstrap" in md
    assert "0.500 [" in md                             # a mean shown with its interval
    # the zero bar of answer_f1_by_type is drawn visibly: its value is written on it
    from memsifter.stages.evaluate import f1_by_type_figure

    fig = f1_by_type_figure(report)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "0.00" in texts and "1.00" in texts
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["constant answer (n=6)", "m (n=6)"]   # the reference row is drawn beside the method


def test_evaluate_flags_methods_scored_on_different_question_sets(tmp_path):
    ds = _dataset()
    data = str(tmp_path / "data")
    _publish(data, "synth", ds.write)
    ids = [q.question_id for q in ds.questions]
    full = _rankings_file(tmp_path, "full", _rows(ds, "full", ids, True))
    part = _rankings_file(tmp_path, "part", _rows(ds, "part", ids[:2], True))
    out = str(tmp_path / "eval")
    get_stage("evaluate").run({"output": out, "input": data, "rankings": [full, part]})
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    qs = report["question_sets"]
    assert qs["same"] is False and qs["common"] == 2 and qs["per_method"] == {"full": 6, "part": 2}
    common = qs["on_common"]
    assert common["full"]["n"] == 2 and common["part"]["n"] == 2
    md = storage.read_text(storage.join(out, "report.md"))
    assert "different question sets" in md and "2 questions every method ranked" in md
    # the same set: nothing flagged
    out2 = str(tmp_path / "eval2")
    get_stage("evaluate").run({"output": out2, "input": data, "rankings": [full]})
    r2 = json.loads(storage.read_text(storage.join(out2, "report.json")))
    assert r2["question_sets"]["same"] is True
    assert "different question sets" not in storage.read_text(storage.join(out2, "report.md"))


def test_bootstrap_interval_holds_the_mean_and_narrows_with_n():
    from memsifter.retrieval.metrics import bootstrap_ci

    rng = np.random.default_rng(1)
    widths = []
    for n in (10, 100, 1000):
        vals = (rng.random(n) < 0.4).astype(float)
        lo, hi = bootstrap_ci(vals)
        assert lo <= vals.mean() <= hi
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2] > 0
    assert bootstrap_ci([0.2, 0.9, 0.4]) == bootstrap_ci([0.2, 0.9, 0.4])   # seeded: reproducible
    assert bootstrap_ci([0.7]) == (0.7, 0.7) and bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0)
    with pytest.raises(ValueError):
        bootstrap_ci([])
