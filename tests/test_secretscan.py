"""The secret scanner (memsifter.security.secretscan) over the repo, an image build context, rendered manifests and a
real run's outputs and logs: every planted key is caught, the clean sources have no finding, and a key put
in a stage's environment never reaches its outputs or logs.

Fake keys are generated here at test time (random, in the shape of the real ones); none is committed.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import string
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from memsifter.security import secretscan
from memsifter.store import storage
from memsifter_dev.k8s import chart

REPO = chart.REPO
ALNUM = string.ascii_letters + string.digits


def _rand(n: int, alphabet: str = ALNUM) -> str:
    wants = [str.isdigit if any(c.isdigit() for c in alphabet) else None,
             str.isupper if any(c.isupper() for c in alphabet) else None,
             str.islower if any(c.islower() for c in alphabet) else None]
    while True:  # random, with the mix of character classes real keys have (of those in the alphabet)
        s = "".join(secrets.choice(alphabet) for _ in range(n))
        if all(sum(map(w, s)) >= 2 for w in wants if w):
            return s


def fake_keys() -> dict[str, str]:
    """kind -> a fresh fake key; the prefixes are assembled so that no key-shaped literal is in this file."""
    return {
        "aws-access-key-id": "AK" + "IA" + _rand(16, string.ascii_uppercase + string.digits),
        "aws-secret-access-key": _rand(40, ALNUM + "/+"),
        "openai-api-key": "sk" + "-" + _rand(48),
        "openai-project-key": "sk" + "-proj-" + _rand(100, ALNUM + "_-"),
        "huggingface-token": "hf" + "_" + _rand(34, string.ascii_letters),
        "private-key": "-----BEGIN " + "RSA PRIVATE KEY-----\n" + _rand(64) + "\n-----END RSA PRIVATE KEY-----",
    }


def planted_text(keys: dict[str, str]) -> str:
    """The keys as they would leak: in env-style and JSON assignments, a log line, a PEM block."""
    return (f"export AWS_ACCESS_KEY_ID={keys['aws-access-key-id']}\n"
            f"aws_secret_access_key = {keys['aws-secret-access-key']}\n"
            f"2026-11-23 INFO llm: calling with key {keys['openai-api-key']}\n"
            f'{{"api_key": "{keys["openai-project-key"]}", "hf": "{keys["huggingface-token"]}"}}\n'
            f"{keys['private-key']}\n")


def assert_all_caught(findings: list, keys: dict[str, str], where: str) -> None:
    values = {f.value for f in findings}
    for kind, key in keys.items():
        want = key.splitlines()[0] if kind == "private-key" else key
        assert any(want == v or want in v for v in values), f"{where}: planted {kind} not caught"
    for f in findings:  # reports are redacted
        assert f.value not in str(f) or f.kind == "private-key", f


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.split("\0") if p and (REPO / p).is_file()]


# --------------------------------------------------------------------------- scanner rules
def test_patterns_catch_each_kind_and_skip_placeholders():
    keys = fake_keys()
    found = secretscan.scan_text(planted_text(keys), "x")
    assert_all_caught(found, keys, "text")
    assert {f.kind for f in found} == {"aws-access-key-id", "aws-secret-access-key", "openai-api-key",
                                       "huggingface-token", "private-key"}
    clean = ("AWS_ACCESS_KEY_ID: CHANGE-ME\nAWS_SECRET_ACCESS_KEY: CHANGE-ME\nOPENAI_API_KEY=...\n"
             "aws_access_key_id = AKIA" + "IOSFODNN7EXAMPLE\n"     # AWS's documented example key
             "pip install scikit-learn; sk-learn-model-selection; hf_hub_download(repo)\n"
             "api_key_env: OPENAI_API_KEY\nsecret_key = uuid.uuid4().hex\n")
    assert secretscan.scan_text(clean, "clean") == []


def test_cli_exit_codes(tmp_path):
    keys = fake_keys()
    (tmp_path / "leak.txt").write_text(planted_text(keys))
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.txt").write_text("nothing here\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "memsifter.security.secretscan", *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=REPO)
    p = run(str(tmp_path / "ok"))
    assert p.returncode == 0, p.stdout + p.stderr
    p = run(str(tmp_path))
    assert p.returncode == 1 and "leak.txt:1: aws-access-key-id" in p.stdout
    for key in keys.values():  # printed redacted only
        assert key.splitlines()[-2 if "\n" in key else 0] not in p.stdout
    p = run(str(tmp_path / "missing"))
    assert p.returncode == 2 and "missing: no such file" in p.stderr


# --------------------------------------------------------------------------- repo and build context
def test_repo_clean_and_planted_keys_in_a_copy_are_caught(tmp_path):
    files = tracked_files()
    assert secretscan.scan([str(REPO / f) for f in files]) == [], "a key-shaped string is committed"
    copy = tmp_path / "repo"
    for f in files:
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, copy / f)
    keys = fake_keys()
    (copy / "memsifter" / "configs" / "leaked.yaml").write_text(planted_text(keys))
    found = secretscan.scan_path(str(copy))
    assert_all_caught(found, keys, "repo copy")
    assert {f.location.split(":")[0] for f in found} == {str(copy / "memsifter" / "configs" / "leaked.yaml")}


def build_context(root: Path, extra: dict[str, str] | None = None) -> bytes:
    """The tar that images/build.sh pipes into `docker build` (its own file list, read from the script)."""
    script = (REPO / "images" / "build.sh").read_text()
    names = re.search(r'^files="([^"]+)"', script, re.M).group(1).split() + ["README.md"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for n in names:
            if (root / n).exists():
                tf.add(root / n, arcname=n, filter=lambda ti: None if "__pycache__" in ti.name
                       or ti.name.endswith(".pyc") else ti)
        for name, text in (extra or {}).items():
            data = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_image_build_context(tmp_path):
    ctx = build_context(REPO)
    assert len(ctx) > 100_000  # the package is in there
    assert secretscan.scan_bytes(ctx, "context.tar") == []
    keys = fake_keys()
    leaked = build_context(REPO, {"memsifter/configs/.env": planted_text(keys)})
    (tmp_path / "context.tar").write_bytes(leaked)
    found = secretscan.scan_path(str(tmp_path / "context.tar"))
    assert_all_caught(found, keys, "build context")
    assert all("context.tar!memsifter/configs/.env" in f.location for f in found)


# --------------------------------------------------------------------------- rendered manifests
def test_rendered_manifests(tmp_path):
    for f in sorted((chart.CHART_DIR / "ci").glob("*.yaml")):
        assert secretscan.scan_text(chart.render([f]), f.name) == [], f
    keys = fake_keys()
    # a key pasted into values (instead of a Secret reference) shows up in the rendered manifests
    from memsifter.k8s.plan import chart_plan
    values = {"pipeline": chart_plan({"run": "s3://bkt/runs/r", "stages": {"synth": {}}}), "stages": {"synth": {"env": [
        {"name": "AWS_ACCESS_KEY_ID", "value": keys["aws-access-key-id"]},
        {"name": "AWS_SECRET_ACCESS_KEY", "value": keys["aws-secret-access-key"]},
        {"name": "OPENAI_API_KEY", "value": keys["openai-api-key"]},
        {"name": "OPENAI_PROJECT_KEY", "value": keys["openai-project-key"]},
        {"name": "HF_TOKEN", "value": keys["huggingface-token"]},
        {"name": "TLS_KEY", "value": keys["private-key"]}]}}}
    out = tmp_path / "rendered.yaml"
    out.write_text(chart.render([], values=values))
    assert [d for d in yaml.safe_load_all(out.read_text()) if d]
    assert_all_caught(secretscan.scan_path(str(out)), keys, "rendered manifest")


# --------------------------------------------------------------------------- a run's outputs and logs
def run_stage(args: list[str], env: dict[str, str], log: Path) -> None:
    with open(log, "ab") as f:
        verbose = ["-vv"] if args[0] == "run" else []  # debug logging: the most a stage ever prints
        p = subprocess.run([sys.executable, "-m", "memsifter.cli", *args, *verbose], env=env, cwd=log.parent,
                           stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert p.returncode == 0, log.read_text()[-3000:]


def test_run_outputs_and_logs(s3_root, s3_server, tmp_path):
    """Two real stages (synth, then import of its export) publish to a real S3 server with keys in their
    environment: the keys appear nowhere in the outputs, `_SUCCESS` manifests or logs; planted into a
    manifest and a log, they are caught (on S3 and on disk)."""
    env_keys = fake_keys()
    env = {**os.environ, **s3_server.env(), "OPENAI_API_KEY": env_keys["openai-api-key"],
           "HF_TOKEN": env_keys["huggingface-token"], "MEMSIFTER_LLM_KEY": env_keys["openai-project-key"]}
    log = tmp_path / "run.log"
    synth = f"{s3_root}/synth"
    run_stage(["run", "synth", "--output", synth, "--questions", "3", "--sessions-per-question", "4"], env, log)
    export = tmp_path / "export.parquet"
    run_stage(["data", "export", "--format", "memsifter", synth, str(export)], env, log)
    run_stage(["run", "import", "--format", "memsifter", "--source", str(export), "--output", f"{s3_root}/imported"],
              env, log)
    files = [storage.join(s3_root, f) for f in storage.list_files(s3_root)]
    assert any(f.endswith("synth/_SUCCESS") for f in files) and any(f.endswith("imported/_SUCCESS") for f in files)
    # nothing key-shaped, and none of the environment's secrets (also the S3 server's own secret key)
    assert secretscan.scan_path(s3_root) == []
    assert secretscan.scan_path(str(log)) == [] and log.stat().st_size > 0
    blobs = [storage.read_bytes(f) for f in files] + [log.read_bytes()]
    for value in [*env_keys.values(), s3_server.secret_key]:
        first = value.splitlines()[0].encode()
        assert not any(first in b for b in blobs), "a secret from the environment leaked into the run"

    # planted: a manifest whose config carries keys (copied under another prefix) and a log line
    keys = fake_keys()
    manifest = json.loads(storage.read_text(f"{synth}/_SUCCESS"))
    manifest["config"]["notes"] = planted_text(keys)
    leaked = f"{s3_root}/leaked/_SUCCESS"
    storage.write_bytes(leaked, json.dumps(manifest, indent=1).encode())
    assert_all_caught(secretscan.scan_path(f"{s3_root}/leaked"), keys, "_SUCCESS on S3")
    log_keys = fake_keys()
    with open(log, "a") as f:
        f.write(planted_text(log_keys))
    assert_all_caught(secretscan.scan_path(str(log)), log_keys, "run log")
