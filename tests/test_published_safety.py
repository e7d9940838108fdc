"""Published work is not lost, inputs are bounded and validated, and every such refusal is one line
(issue 19, items 1-3).

One table (:data:`CASES`) runs the real CLI (``python -m memsifter.cli``) in a subprocess, against a
published dataset on local disk and, for the s3 cases, on the real SeaweedFS server (``s3_root``), and
asserts for each case: exit code 2, exactly one non-empty stderr line that names the file / field /
variable at fault, no traceback, and every file that existed before the command (published data
included) byte-identical afterwards, with nothing new published. Focused tests below cover what is
not a refusal: the skip check re-running a stage whose published files were damaged, a forged
``_PUBLISHING`` journal that names a key outside its prefix, ``--force`` replacing a broken
``_SUCCESS``, and ``--replace`` replacing a different config's output.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from memsifter.store import storage
from memsifter.data import importers
from memsifter.stage import get_stage

SYNTH = {"questions": 6, "sessions_per_question": 4}
SYNTH_FLAGS = ["--questions", "6", "--sessions", "4"]   # `data synth` flags for the same config


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> dict[str, Path]:
    """Two published synth datasets built once (in-process): ``c1`` and ``alt`` (another seed)."""
    root = tmp_path_factory.mktemp("published")
    out = {}
    for name, seed in (("c1", 0), ("alt", 1)):
        get_stage("synth").run({"output": str(root / name), "seed": seed, **SYNTH})
        out[name] = root / name
    return out


def cli(args: list[str], *, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "memsifter.cli", *args], cwd=str(cwd), env=full,
                          capture_output=True, text=True, timeout=300)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


FAILURE_RECORD = "_work/failure.json"  # a failed attempt's record for `memsifter status` (scratch, not data)


def snapshot_local(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha(p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file() and not str(p).endswith(FAILURE_RECORD)}


def snapshot_s3(uri: str) -> dict[str, str]:
    return {rel: sha(storage.read_bytes(storage.join(uri, rel))) for rel in storage.list_files(uri)
            if not rel.endswith(FAILURE_RECORD)}


def manifest_matches(uri: str) -> bool:
    m = json.loads(storage.read_bytes(storage.join(uri, "_SUCCESS")))
    return all(sha(storage.read_bytes(storage.join(uri, n))) == meta["sha256"] for n, meta in m["files"].items())


# --------------------------------------------------------------------------- setups
def lme_item(i: int) -> dict:
    return {"question_id": f"q{i}", "question_type": "t", "question": "What is my dog called?",
            "answer": "Biscuit", "question_date": "2024/01/05 (Fri) 10:00",
            "haystack_session_ids": [f"s{i}a", f"s{i}b"], "answer_session_ids": [f"s{i}a"],
            "haystack_dates": ["2024/01/01 (Mon) 10:00", "2024/01/02 (Tue) 10:00"],
            "haystack_sessions": [[{"role": "user", "content": "My dog is Biscuit."},
                                   {"role": "assistant", "content": "Nice."}],
                                  [{"role": "user", "content": "Lentils?"}, {"role": "assistant", "content": "Soak."}]]}


def big_gz(ctx: dict) -> None:
    """A valid LongMemEval file padded to ~5 MB, gzipped to a few KB (a small 'zip bomb')."""
    body = json.dumps([lme_item(0)]).encode()
    (ctx["tmp"] / "big.json.gz").write_bytes(gzip.compress(body[:-1] + b" " * 5_000_000 + b"]"))


def deep_json_input(ctx: dict) -> None:
    (ctx["tmp"] / "deep.json").write_text("[" * 100_000 + "]" * 100_000)


def write(rel: str, data: bytes | str) -> Callable[[dict], None]:
    def _setup(ctx: dict) -> None:
        p = ctx["tmp"] / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
    return _setup


def lease_dir(ctx: dict) -> None:
    (ctx["tmp"] / "c1" / "_LEASE").mkdir()


def replaced_file(ctx: dict) -> None:
    """A published file replaced after publishing (by another valid parquet file)."""
    shutil.copyfile(ctx["alt"] / "questions.parquet", ctx["tmp"] / "c1" / "questions.parquet")


def export_into_d(ctx: dict) -> None:
    importers.export_memsifter(str(ctx["tmp"] / "c1"), str(ctx["tmp"] / "d" / "src.parquet"))


def escaping_manifest(ctx: dict) -> None:
    p = ctx["tmp"] / "c1" / "_SUCCESS"
    m = json.loads(p.read_text())
    m["files"]["../victim/keep.txt"] = {"bytes": 4, "sha256": sha(b"evil")}
    p.write_text(json.dumps(m))


def s3_dataset(ctx: dict) -> None:
    get_stage("synth").run({"output": f"{ctx['s3']}/c2", **SYNTH})


@dataclass
class Case:
    name: str
    args: list[str]                      # {c1}, {tmp}, {s3} are filled in
    names: list[str]                     # what the one stderr line must name
    setup: Callable[[dict], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    s3: bool = False                     # needs the SeaweedFS server (s3_root)
    skip_root: bool = False              # needs a filesystem that root cannot write


FORCE_SAME = ["data", "synth", "{c1}", *SYNTH_FLAGS, "--force"]
CASES = [
    # item 1: losing published work
    Case("force-output-equals-input", ["run", "embed", "--input", "{c1}", "--output", "{c1}", "--force",
                                       "--no-cascade", "--no-zsum", "-q"], ["{c1}", "input"]),
    Case("force-over-another-stages-output", ["run", "embed", "--input", "{alt}", "--output", "{c1}", "--force",
                                              "--no-cascade", "--no-zsum", "-q"], ["{c1}", "synth"]),
    Case("output-inside-input", ["run", "embed", "--input", "{c1}", "--output", "{c1}/emb", "--no-cascade", "--no-zsum", "-q"],
         ["{c1}/emb", "input"]),
    Case("input-inside-output", ["data", "import", "{tmp}/d/src.parquet", "{tmp}/d", "--format", "memsifter", "-q"],
         ["{tmp}/d/src.parquet"], setup=export_into_d),
    Case("export-over-published-file", ["data", "export", "{c1}", "{c1}/questions.parquet"], ["{c1}"]),
    Case("export-into-published-s3-prefix", ["data", "export", "{c1}", "{s3}/c2/sub/x.parquet"], ["{s3}/c2"],
         setup=s3_dataset, s3=True),
    Case("changed-config", ["data", "synth", "{c1}", "--questions", "7", "--sessions", "4"], ["{c1}", "--replace"]),
    Case("changed-config-force", ["data", "synth", "{c1}", "--questions", "7", "--sessions", "4", "--force"],
         ["{c1}", "--replace"]),
    Case("manifest-key-escapes-prefix", ["data", "export", "{c1}", "{tmp}/x.parquet"], ["../victim/keep.txt"],
         setup=escaping_manifest),
    # item 2: bounded and validated
    Case("lease-ttl-zero", FORCE_SAME, ["MEMSIFTER_LEASE_TTL"], env={"MEMSIFTER_LEASE_TTL": "0"}),
    Case("lease-ttl-abc", FORCE_SAME, ["MEMSIFTER_LEASE_TTL"], env={"MEMSIFTER_LEASE_TTL": "abc"}),
    Case("store-attempts-zero", FORCE_SAME, ["MEMSIFTER_STORE_ATTEMPTS"], env={"MEMSIFTER_STORE_ATTEMPTS": "0"}),
    Case("store-retry-seconds-zero", FORCE_SAME, ["MEMSIFTER_STORE_RETRY_SECONDS"],
         env={"MEMSIFTER_STORE_RETRY_SECONDS": "0"}),
    Case("s3-attempts-zero", ["data", "synth", "{s3}/c2", *SYNTH_FLAGS, "--force"], ["MEMSIFTER_S3_ATTEMPTS"],
         setup=s3_dataset, env={"MEMSIFTER_S3_ATTEMPTS": "0"}, s3=True),
    Case("s3-empty-bucket", ["run", "synth", "--output", "s3://", "--questions", "2"], ["s3://"], s3=True),
    Case("s3-empty-bucket-key", ["run", "synth", "--output", "s3:///x", "--questions", "2"], ["s3:///x"], s3=True),
    Case("gzip-bomb", ["data", "import", "{tmp}/big.json.gz", "{tmp}/imp", "--format", "longmemeval", "-q"],
         ["{tmp}/big.json.gz", "MEMSIFTER_MAX_INPUT_BYTES"], setup=big_gz,
         env={"MEMSIFTER_MAX_INPUT_BYTES": "1000000"}),
    Case("input-nested-100k", ["data", "import", "{tmp}/deep.json", "{tmp}/imp", "--format", "longmemeval", "-q"],
         ["{tmp}/deep.json", "nested"], setup=deep_json_input),
    # item 3: one line, exit 2
    Case("output-is-a-file", ["run", "synth", "--output", "{tmp}/afile", "--questions", "2"], ["{tmp}/afile"],
         setup=write("afile", "not a directory\n")),
    Case("output-read-only", ["run", "synth", "--output", "/sys/memsifter-probe/out", "--questions", "2"],
         ["/sys/memsifter-probe/out"]),
    Case("success-is-a-list", ["data", "synth", "{c1}", *SYNTH_FLAGS], ["{c1}/_SUCCESS"],
         setup=write("c1/_SUCCESS", "[]")),
    Case("success-is-a-list-reader", ["data", "export", "{c1}", "{tmp}/x.parquet"], ["{c1}/_SUCCESS"],
         setup=write("c1/_SUCCESS", "[]")),
    Case("success-lacks-keys", ["data", "synth", "{c1}", *SYNTH_FLAGS], ["{c1}/_SUCCESS", "files"],
         setup=write("c1/_SUCCESS", '{"stage": "synth"}')),
    Case("lease-is-a-list", FORCE_SAME, ["{c1}/_LEASE"], setup=write("c1/_LEASE", "[]")),
    Case("lease-is-a-directory", FORCE_SAME, ["{c1}/_LEASE"], setup=lease_dir),
    Case("config-binary", ["run", "synth", "--config", "{tmp}/bin.yaml", "--output", "{tmp}/o"], ["{tmp}/bin.yaml"],
         setup=write("bin.yaml", bytes(range(256)) * 8)),
    Case("config-yaml-nested-100k", ["run", "synth", "--config", "{tmp}/deep.yaml", "--output", "{tmp}/o"],
         ["{tmp}/deep.yaml", "nested"], setup=write("deep.yaml", "seed: " + "[" * 100_000 + "]" * 100_000 + "\n")),
    Case("config-json-nested-100k", ["run", "synth", "--config", "{tmp}/deep.json", "--output", "{tmp}/o"],
         ["{tmp}/deep.json", "nested"], setup=write("deep.json", '{"seed": ' + "[" * 100_000 + "]" * 100_000 + "}")),
    Case("file-modified-after-publish", ["data", "export", "{c1}", "{tmp}/x.parquet"],
         ["{c1}/questions.parquet", "modified after publishing", "--force"], setup=replaced_file),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_refused_in_one_line_and_published_data_intact(case: Case, published, tmp_path, request):
    tmp = tmp_path / "case"
    tmp.mkdir()
    shutil.copytree(published["c1"], tmp / "c1")
    ctx = {"tmp": tmp, "c1": tmp / "c1", "alt": published["alt"], "s3": ""}
    env = dict(case.env)
    if case.s3:
        ctx["s3"] = request.getfixturevalue("s3_root")
        env.update(request.getfixturevalue("s3_server").env())
    if case.setup:
        case.setup(ctx)
    fill = {"c1": str(ctx["c1"]), "tmp": str(tmp), "s3": ctx["s3"], "alt": str(ctx["alt"])}
    before = snapshot_local(tmp)
    before_s3 = snapshot_s3(ctx["s3"]) if case.s3 else {}

    r = cli([a.format(**fill) for a in case.args], cwd=tmp, env=env)

    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1, r.stderr[-3000:]
    for want in case.names:
        assert want.format(**fill) in lines[0], (want.format(**fill), lines[0])
    assert snapshot_local(tmp) == before, "files changed under the case's directory"
    if case.s3:
        assert snapshot_s3(ctx["s3"]) == before_s3, "files changed under the s3 root"


# --------------------------------------------------------------------------- focused tests
def test_skip_check_verifies_published_files(published, tmp_path):
    """A published file damaged in place: the same config re-runs (names the file) instead of skipping."""
    c = tmp_path / "c7"
    shutil.copytree(published["c1"], c)
    good = (c / "questions.parquet").read_bytes()
    shutil.copyfile(published["alt"] / "questions.parquet", c / "questions.parquet")
    r = cli(["data", "synth", str(c), *SYNTH_FLAGS], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "synth: published" in r.stdout and "skipped" not in r.stdout, r.stdout
    assert "questions.parquet" in r.stderr            # the damaged file is named in the warning
    assert (c / "questions.parquet").read_bytes() == good and manifest_matches(str(c))
    r = cli(["data", "synth", str(c), *SYNTH_FLAGS], cwd=tmp_path)   # intact now: skipped
    assert r.returncode == 0 and "already published (skipped)" in r.stdout, r.stdout


def test_forged_journal_cannot_move_a_file_outside_the_prefix(published, tmp_path):
    """A ``_PUBLISHING`` journal for this very stage/config naming ``../victim/keep.txt`` (its staged
    file planted too): the re-run drops the journal instead of writing outside the prefix."""
    c = tmp_path / "c1"
    shutil.copytree(published["c1"], c)
    victim = tmp_path / "victim" / "keep.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"keep me")
    m = json.loads((c / "_SUCCESS").read_text())
    m["files"]["../victim/keep.txt"] = {"bytes": 4, "sha256": sha(b"evil")}
    (c / "_PUBLISHING").write_text(json.dumps(m))
    planted = c / "_staging" / m["attempt"] / ".." / "victim" / "keep.txt"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"evil")
    (c / "_SUCCESS").unlink()
    r = cli(["data", "synth", str(c), *SYNTH_FLAGS], cwd=tmp_path)
    assert victim.read_bytes() == b"keep me", r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "../victim/keep.txt" in r.stderr             # the refused key is named
    assert manifest_matches(str(c)) and "../victim/keep.txt" not in json.loads((c / "_SUCCESS").read_text())["files"]


@pytest.mark.parametrize("content", ["{not json", "[]", '{"stage": "synth"}'], ids=["invalid-json", "list", "no-keys"])
def test_force_replaces_a_broken_manifest(published, tmp_path, content):
    c = tmp_path / "c1"
    shutil.copytree(published["c1"], c)
    (c / "_SUCCESS").write_text(content)
    r = cli(["data", "synth", str(c), *SYNTH_FLAGS, "--force"], cwd=tmp_path)
    assert r.returncode == 0 and "synth: published" in r.stdout, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and manifest_matches(str(c))


def test_replace_flag_replaces_another_configs_output(published, tmp_path):
    c = tmp_path / "c1"
    shutil.copytree(published["c1"], c)
    r = cli(["data", "synth", str(c), "--questions", "7", "--sessions", "4", "--replace"], cwd=tmp_path)
    assert r.returncode == 0 and "synth: published" in r.stdout, r.stderr[-3000:]
    m = json.loads((c / "_SUCCESS").read_text())
    assert m["config"]["questions"] == 7 and manifest_matches(str(c))
    for args in (["run", "synth", "--help"], ["data", "synth", "--help"]):
        out = cli(args, cwd=tmp_path).stdout
        assert "--replace" in out and "--force" in out, out
    # the Python API: replace= is a keyword; existing callers (force=) keep working
    st = get_stage("synth")
    assert st.run({"output": str(c), **SYNTH, "questions": 7}).get("skipped")
    assert st.run({"output": str(c), **SYNTH}, replace=True)["config"]["questions"] == 6
