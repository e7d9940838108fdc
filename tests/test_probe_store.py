"""Probes of issue 30 against the storage layer, the lease and the importers: each was a real break
(a write through a symlink, a control file as an export target, a garbage ``_LEASE``, a store stall
that outlived its budget, URIs and settings that gave tracebacks, unbounded turns and ids).

:data:`CASES` runs the real CLI (``python -m memsifter.cli``) in a subprocess against a published
dataset on local disk and asserts, per case: exit code 2, exactly one non-empty stderr line naming the
file / field / variable at fault, no traceback, every file under the case's directory byte-identical
afterwards (nothing written outside the prefix either: the symlink targets live under that directory).
Focused tests below cover what is not a one-line refusal: recovery from a malformed lease with the
documented flag, the heartbeat's death, the stall bound end to end (a socket on 127.0.0.1 that
accepts and never answers, and the fault proxy hanging mid-stage), memory per input and the
lease holder's state for ``memsifter status``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from memsifter.store import lease, storage
from memsifter.data.importers import reading
from memsifter.errors import MemsifterError
from memsifter.stage import get_stage

SYNTH = {"questions": 4, "sessions_per_question": 3}
SYNTH_FLAGS = ["--questions", "4", "--sessions", "3"]
FORCE_SAME = ["data", "synth", "{c1}", *SYNTH_FLAGS, "--force"]
# an endpoint nobody listens on and a short budget: a case that is not refused before any request
# fails fast with a different message (and the test says which)
NO_STORE = {"MEMSIFTER_S3_ENDPOINT": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
            "AWS_SECRET_ACCESS_KEY": "s", "MEMSIFTER_STORE_RETRY_SECONDS": "2"}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    get_stage("synth").run({"output": str(root / "c1"), **SYNTH})
    return root / "c1"


def cli(args: list[str], *, cwd: Path, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "memsifter.cli", *args], cwd=str(cwd), env=full,
                          capture_output=True, text=True, timeout=timeout)


LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING) ")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Every file and link under ``root`` (links by their target: a link is not followed)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel.endswith("_work/failure.json"):
            continue
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = sha(p.read_bytes())
    return out


# --------------------------------------------------------------------------- setups
def symlinked_journal(ctx: dict) -> None:
    """``c1/sub -> elsewhere`` and a journal of this very stage and config listing ``sub/y.txt``, its
    staged file planted: completing the journal would write ``elsewhere/y.txt``."""
    c, elsewhere = ctx["c1"], ctx["tmp"] / "elsewhere"
    elsewhere.mkdir()
    (c / "sub").symlink_to(elsewhere)
    m = json.loads((c / "_SUCCESS").read_text())
    m["files"]["sub/y.txt"] = {"bytes": 4, "sha256": sha(b"evil")}
    staged = c / "_staging" / m["attempt"] / "sub" / "y.txt"
    staged.parent.mkdir(parents=True)
    staged.write_bytes(b"evil")
    (c / "_PUBLISHING").write_text(json.dumps(m))
    (c / "_SUCCESS").unlink()


def symlinked_staging(ctx: dict) -> None:
    """``c1/_staging -> elsewhere``: a re-run would stage (write) its files in ``elsewhere``."""
    (ctx["tmp"] / "elsewhere").mkdir()
    (ctx["c1"] / "_staging").symlink_to(ctx["tmp"] / "elsewhere")


def live_foreign_lease(ctx: dict) -> None:
    """``c1`` held by a live run on another host (a stage writing it right now)."""
    (ctx["c1"] / "_LEASE").write_text(json.dumps({
        "run_id": "run-other", "host": "node-7", "pid": 4242, "purpose": "stage synth", "token": "t-other",
        "started_at": "2026-01-01T00:00:00+00:00", "expires_at": time.time() + 600, "ttl": 60}))


def lease_with(**over) -> Callable[[dict], None]:
    def _setup(ctx: dict) -> None:
        body = {"run_id": "run-other", "host": "node-7", "pid": 4242, "purpose": "stage synth",
                "token": "t-other", "started_at": "2026-01-01T00:00:00+00:00",
                "expires_at": time.time() + 600, "ttl": 60, **over}
        (ctx["c1"] / "_LEASE").write_text(json.dumps(body))
    return _setup


def lease_bytes(data: bytes) -> Callable[[dict], None]:
    def _setup(ctx: dict) -> None:
        (ctx["c1"] / "_LEASE").write_bytes(data)
    return _setup


def raw_lease_json(text: str) -> Callable[[dict], None]:
    return lease_bytes(text.encode())


def lme_item(qid, content: str = "My dog is Biscuit.") -> dict:
    return {"question_id": qid, "question_type": "t", "question": "What is my dog called?",
            "answer": "Biscuit", "question_date": "2024/01/05 (Fri) 10:00",
            "haystack_session_ids": ["sa", "sb"], "answer_session_ids": ["sa"],
            "haystack_dates": ["2024/01/01 (Mon) 10:00", "2024/01/02 (Tue) 10:00"],
            "haystack_sessions": [[{"role": "user", "content": content},
                                   {"role": "assistant", "content": "Nice."}],
                                  [{"role": "user", "content": "Lentils?"}, {"role": "assistant", "content": "Soak."}]]}


def big_turn(ctx: dict) -> None:
    items = [lme_item("q0"), lme_item("q1", "x" * (2 << 20))]
    (ctx["tmp"] / "turn.json").write_text(json.dumps(items))


def huge_int_id(ctx: dict) -> None:
    text = json.dumps([lme_item("q0"), lme_item("QID")]).replace('"QID"', "7" * 5000)
    (ctx["tmp"] / "bigid.json").write_text(text)


@dataclass
class Case:
    name: str
    item: int                            # the issue-30 item this probe belongs to
    args: list[str]                      # {c1}, {tmp} are filled in
    names: list[str]                     # what the one stderr line must name
    setup: Callable[[dict], None] | None = None
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    # 1: writes never follow a symlink inside an output prefix
    Case("journal-through-symlink", 1, ["data", "synth", "{c1}", *SYNTH_FLAGS], ["{c1}/sub", "symlink"],
         setup=symlinked_journal),
    Case("staging-is-a-symlink", 1, FORCE_SAME, ["{c1}/_staging", "symlink"], setup=symlinked_staging),
    # 2: control files are not export targets; a garbage _LEASE is one line naming file and field
    Case("export-onto-live-lease", 2, ["data", "export", "{c1}", "{tmp}/x/_LEASE"], ["{tmp}/x/_LEASE"],
         setup=lambda ctx: ((ctx["tmp"] / "x").mkdir(), live_foreign_lease({"c1": ctx["tmp"] / "x"}))),
    Case("export-into-leased-prefix", 2, ["data", "export", "{c1}", "{tmp}/x/a.parquet"], ["{tmp}/x"],
         setup=lambda ctx: ((ctx["tmp"] / "x").mkdir(), live_foreign_lease({"c1": ctx["tmp"] / "x"}))),
    Case("export-onto-success", 2, ["data", "export", "{c1}", "{tmp}/new/_SUCCESS"], ["{tmp}/new/_SUCCESS"]),
    Case("export-onto-journal", 2, ["data", "export", "{c1}", "{tmp}/new/_PUBLISHING"], ["{tmp}/new/_PUBLISHING"]),
    Case("export-into-work", 2, ["data", "export", "{c1}", "{tmp}/new/_work/a.parquet"], ["{tmp}/new/_work"]),
    Case("export-into-run", 2, ["data", "export", "{c1}", "{tmp}/new/_run/_LEASE"], ["{tmp}/new/_run"]),
    Case("lease-not-utf8", 2, FORCE_SAME, ["{c1}/_LEASE", "--steal-lease"], setup=lease_bytes(b"\xff\xfe{\x80")),
    Case("lease-not-json", 2, FORCE_SAME, ["{c1}/_LEASE", "--steal-lease"], setup=lease_bytes(b"{not json")),
    Case("lease-null", 2, FORCE_SAME, ["{c1}/_LEASE", "--steal-lease"], setup=raw_lease_json("null")),
    Case("lease-expires-tomorrow", 2, FORCE_SAME, ["{c1}/_LEASE", "expires_at", "--steal-lease"],
         setup=lease_with(expires_at="tomorrow")),
    Case("lease-expires-null", 2, FORCE_SAME, ["{c1}/_LEASE", "expires_at"], setup=lease_with(expires_at=None)),
    Case("lease-expires-5000-digits", 2, FORCE_SAME, ["{c1}/_LEASE", "--steal-lease"],
         setup=raw_lease_json('{"token": "t", "host": "h", "pid": 1, "expires_at": ' + "9" * 5000 + "}")),
    Case("lease-pid-2-70", 2, FORCE_SAME, ["{c1}/_LEASE", "pid"],
         setup=lease_with(pid=2 ** 70, host=socket.gethostname())),
    # 4: URIs
    Case("endpoint-unclosed-bracket", 4, ["data", "info", "s3://b/x"], ["MEMSIFTER_S3_ENDPOINT", "http://[::1"],
         env={**NO_STORE, "MEMSIFTER_S3_ENDPOINT": "http://[::1"}),
    Case("endpoint-ftp", 4, ["data", "info", "s3://b/x"], ["MEMSIFTER_S3_ENDPOINT", "ftp"],
         env={**NO_STORE, "MEMSIFTER_S3_ENDPOINT": "ftp://127.0.0.1:9"}),
    Case("s3-empty-key-segment", 4, ["data", "info", "s3://bucket//x"],
         ["s3://bucket//x", "empty path segment"], env=NO_STORE),
    Case("s3-dotdot-segment", 4, ["data", "info", "s3://b/a/../x"],
         ["s3://b/a/../x", "'..' path segment"], env=NO_STORE),
    Case("s3-dot-segment", 4, ["data", "info", "s3://b/./x"], ["s3://b/./x", "'.' path segment"], env=NO_STORE),
    # 5: lease TTL range
    Case("lease-ttl-tiny", 5, FORCE_SAME, ["MEMSIFTER_LEASE_TTL"], env={"MEMSIFTER_LEASE_TTL": "0.0001"}),
    Case("lease-ttl-huge", 5, FORCE_SAME, ["MEMSIFTER_LEASE_TTL"], env={"MEMSIFTER_LEASE_TTL": "1e300"}),
    # 6: bounded turns and ids at import
    Case("turn-over-cap", 6, ["data", "import", "{tmp}/turn.json", "{tmp}/imp", "--format", "longmemeval", "-q"],
         ["{tmp}/turn.json", "question 'q1'", "haystack_sessions[0][0].content", "MEMSIFTER_MAX_TURN_BYTES"],
         setup=big_turn),
    Case("question-id-5000-digits", 6, ["data", "import", "{tmp}/bigid.json", "{tmp}/imp", "--format",
                                        "longmemeval", "-q"], ["{tmp}/bigid.json", "question #1", "question_id"],
         setup=huge_int_id),
    Case("max-turn-bytes-zero", 6, ["data", "import", "{tmp}/turn.json", "{tmp}/imp", "--format", "longmemeval"],
         ["MEMSIFTER_MAX_TURN_BYTES"], setup=big_turn, env={"MEMSIFTER_MAX_TURN_BYTES": "0"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_probe_refused_in_one_line(case: Case, published, tmp_path):
    tmp = tmp_path / "case"
    tmp.mkdir()
    shutil.copytree(published, tmp / "c1")
    ctx = {"tmp": tmp, "c1": tmp / "c1"}
    if case.setup:
        case.setup(ctx)
    fill = {"c1": str(ctx["c1"]), "tmp": str(tmp)}
    before = snapshot(tmp)

    r = cli([a.format(**fill) for a in case.args], cwd=tmp, env=case.env)

    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]   # progress logs aside
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1, r.stderr[-3000:]
    for want in case.names:
        assert want.format(**fill) in lines[0], (want.format(**fill), lines[0])
    assert snapshot(tmp) == before, "files changed under the case's directory"


# --------------------------------------------------------------------------- item 1, focused
def test_local_writes_below_a_guarded_prefix_do_not_follow_symlinks(tmp_path):
    """The storage calls themselves (not only the stage): write, atomic write, copy, delete below a
    prefix that is an output refuse a path through a symlink, and leave the target alone."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_bytes(b"keep")
    (out / "sub").symlink_to(elsewhere)
    (out / "f.txt").symlink_to(elsewhere / "keep.txt")
    storage.guard_prefix(str(out))
    src = tmp_path / "src.txt"
    src.write_bytes(b"evil")
    for op in (lambda: storage.write_bytes(str(out / "sub" / "y.txt"), b"evil"),
               lambda: storage.write_atomic(str(out / "sub" / "y.txt"), b"evil"),
               lambda: storage.write_bytes(str(out / "f.txt"), b"evil"),
               lambda: storage.copy_file(str(src), str(out / "sub" / "y.txt")),
               lambda: storage.delete(str(out / "sub" / "keep.txt")),
               lambda: storage.delete(str(out / "sub"))):
        with pytest.raises(storage.StorageError, match="symlink"):
            op()
    assert sorted(os.listdir(elsewhere)) == ["keep.txt"] and (elsewhere / "keep.txt").read_bytes() == b"keep"
    storage.write_bytes(str(out / "real" / "y.txt"), b"fine")   # no link on the way: written
    assert (out / "real" / "y.txt").read_bytes() == b"fine"


# --------------------------------------------------------------------------- item 2, focused
def test_malformed_lease_is_taken_over_with_steal_lease(published, tmp_path):
    """The documented recovery: ``--steal-lease`` replaces a malformed lease (no deleting by hand)."""
    out = tmp_path / "c1"
    shutil.copytree(published, out)
    (out / "_LEASE").write_bytes(b"\xff\xfe{\x80")
    args = ["run", "synth", "--output", str(out), "--questions", "4", "--sessions-per-question", "3", "--force"]
    r = cli(args, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--steal-lease" in r.stderr, r.stderr[-2000:]
    r = cli(args + ["--steal-lease"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (out / "_LEASE").exists()
    assert storage.read_manifest(str(out))["stage"] == "synth"


def test_running_stage_whose_lease_turns_to_garbage_stops_in_one_line(tmp_path):
    """The probe: ``data export ds1 X/_LEASE`` while a stage writes X used to kill that stage with a
    UnicodeDecodeError traceback. The export is refused now; a lease overwritten by anything else is
    a lost lease: the stage stops without publishing (exit 3, one line)."""
    prefix = str(tmp_path / "out")
    a = lease.Lease(prefix, purpose="stage synth", ttl=30).acquire()
    with open(os.path.join(prefix, "_LEASE"), "wb") as f:
        f.write(b"\x00PAR1\xff\xfe garbage")
    with pytest.raises(lease.LeaseLostError) as e:
        a.check()
    assert "_LEASE" in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- item 3: the stall bound
def _silent_server() -> tuple[socket.socket, list]:
    """A TCP server on 127.0.0.1 that accepts every connection and never reads or answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list = []

    def accept() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            held.append(c)
    threading.Thread(target=accept, daemon=True).start()
    return srv, held


BUDGET = 20.0
SLACK = BUDGET * 0.1 + 5   # the bound: budget + 10% + 5 s (python start-up included); the old code took ~36 s
HANG_BUDGET = 10.0


@pytest.mark.parametrize("args", [["data", "info", "s3://stalled/data"],
                                  ["run", "synth", "--output", "s3://stalled/out", "--questions", "2"]],
                         ids=["info", "stage"])
def test_silent_endpoint_fails_within_the_budget(args, tmp_path):
    srv, held = _silent_server()
    env = {"MEMSIFTER_S3_ENDPOINT": f"http://127.0.0.1:{srv.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "MEMSIFTER_STORE_RETRY_SECONDS": str(BUDGET)}
    t0 = time.monotonic()
    try:
        r = cli(args, cwd=tmp_path, env=env)
    finally:
        srv.close()
        for c in held:
            c.close()
    took = time.monotonic() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert took <= BUDGET + SLACK, (took, r.stderr[-2000:])
    assert len(lines) == 1 and "s3://stalled/" in lines[0] and "unavailable" in lines[0], r.stderr[-2000:]


def test_store_that_hangs_mid_stage_fails_within_the_budget(s3_server):
    """The store answers until the stage is under way, then accepts and never answers (the fault
    proxy's ``hang``): the stage fails with the store error within the budget + slack, cleanup
    included (abort, failure record, lease release), and nothing is published."""
    from memsifter.testing.faultproxy import FaultPlan, fault_proxy
    from memsifter.testing.servers import env_vars

    with fault_proxy(s3_server.endpoint) as proxy:
        storage._s3.cache_clear()
        try:
            with env_vars({**s3_server.env(), "MEMSIFTER_S3_ENDPOINT": proxy.endpoint,
                           "MEMSIFTER_STORE_RETRY_SECONDS": str(HANG_BUDGET)}):
                out = f"s3://hang-{os.getpid()}/synth"
                storage.ensure_bucket(out)
                proxy.set_plan(FaultPlan(rate=1.0, kinds=("hang",), skip_first=15))
                proxy.reset_counts()
                t0 = time.monotonic()
                with pytest.raises(MemsifterError) as e:
                    get_stage("synth").run({"output": out, "questions": 2, "sessions_per_question": 3})
                took = time.monotonic() - t0
                hung = proxy.counts["hang"]
                proxy.set_plan(FaultPlan(rate=0.0))
                proxy.release_hung()
                assert hung > 0, proxy.counts
                assert took <= HANG_BUDGET * 1.1 + 5, (took, str(e.value))
                assert "unavailable" in str(e.value) and "\n" not in str(e.value), str(e.value)
                print("mid-stage stall:", round(took, 1), "s:", e.value)
                assert not storage.exists(storage.join(out, storage.MANIFEST))
        finally:
            storage._s3.cache_clear()


def test_retry_never_starts_an_attempt_that_cannot_finish_in_the_budget(monkeypatch):
    """Unit view of the bound: attempts that each stall for a while (a fake op: time is what is
    tested, not a store) are not started once one more would end past the budget."""
    monkeypatch.setenv("MEMSIFTER_STORE_RETRY_SECONDS", "3")
    monkeypatch.setenv("MEMSIFTER_S3_ENDPOINT", "http://127.0.0.1:9")
    calls = []

    def stalls() -> None:
        calls.append(time.monotonic())
        time.sleep(1.5)
        raise OSError("curlCode: 28, Timeout was reached")
    t0 = time.monotonic()
    try:
        with pytest.raises(storage.StorageError, match="unavailable"):
            storage.retrying(stalls, "s3://b/k")
        took = time.monotonic() - t0
        assert took <= 3.0 + 0.2, (took, len(calls))
        assert len(calls) == 1    # a second stalled attempt would end at ~3.5 s
        # the store was given up on: writes to it fail at once for one budget, reads are still tried
        t0 = time.monotonic()
        with pytest.raises(storage.StorageError, match="not retried"):
            storage.retrying(stalls, "s3://b/k2", write=True)
        assert time.monotonic() - t0 < 0.5 and len(calls) == 1
    finally:
        storage._gave_up_at.clear()


# --------------------------------------------------------------------------- item 5, focused
def test_heartbeat_death_fails_the_stage(tmp_path, monkeypatch):
    """The heartbeat thread dying (any exception out of its loop: the old 1e300 TTL overflowed the
    wait; here the wait is made to raise, as that TTL is refused now) fails the stage before it
    publishes, in one line, instead of passing silently."""
    class Exploding:
        def wait(self, timeout=None):  # noqa: ANN001, ANN202
            raise OverflowError("timeout value is too large")

        def set(self):  # noqa: ANN202
            pass

        def is_set(self):  # noqa: ANN202
            return False
    original = lease.Lease.start

    def start(self):  # noqa: ANN001, ANN202
        self._stop = Exploding()
        got = original(self)
        self._thread.join(5)
        return got
    monkeypatch.setattr(lease.Lease, "start", start)
    out = str(tmp_path / "synth")
    with pytest.raises(lease.LeaseLostError) as e:
        get_stage("synth").run({"output": out, **SYNTH})
    assert "heartbeat" in str(e.value) and "OverflowError" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))


# --------------------------------------------------------------------------- item 6, focused
@pytest.mark.parametrize("name", ["in.json.gz", "in.json"], ids=["gz-by-extension", "gz-by-magic"])
def test_gzip_input_is_streamed_not_double_buffered(tmp_path, name):
    """A 24 MB (decompressed) gzipped input is read with well under 2x its size held in Python (one
    growing buffer and a chunk; the old code held the chunks and then their join)."""
    size = 24 << 20
    body = json.dumps([lme_item("q0")]).encode()
    (tmp_path / name).write_bytes(gzip.compress(body[:-1] + b" " * (size - len(body)) + b"]", 1))
    tracemalloc.start()
    try:
        data = reading._read_raw(str(tmp_path / name))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(data) == size
    assert peak < size * 1.5, f"peak {peak / size:.2f}x the input"   # was 2x: chunks, then joined


def test_gzip_input_over_the_cap_stops_early(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMSIFTER_MAX_INPUT_BYTES", str(1 << 20))
    (tmp_path / "bomb.json").write_bytes(gzip.compress(b"[" + b" " * (64 << 20) + b"]"))
    tracemalloc.start()
    try:
        with pytest.raises(MemsifterError, match="MEMSIFTER_MAX_INPUT_BYTES"):
            reading._read_raw(str(tmp_path / "bomb.json"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def _gzip_bomb(path: Path, inflated: int) -> int:
    """A gzip of ``inflated`` spaces inside a JSON list, written in 1 MiB pieces (never held whole): the
    shape of issue 41's 3 MB file that inflates to 3 GB, at 1/10 scale (~1000x). Its size in bytes."""
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b"[")
        piece = b" " * (1 << 20)
        for _ in range(inflated >> 20):
            f.write(piece)
        f.write(b"]")
    return path.stat().st_size


@pytest.fixture(scope="module")
def gzip_bomb(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bomb") / "bomb.gz"
    _gzip_bomb(path, 320 << 20)
    return path


@pytest.mark.parametrize("name", ["bomb.json.gz", "bomb.json"], ids=["gz-by-extension", "gz-by-magic"])
def test_gzip_bomb_is_bounded_by_its_ratio_while_streaming(tmp_path, name, gzip_bomb):
    """issue 41: a 3 MB gzip that unpacks to 3 GB (under the 4 GiB cap) took 12.4 GB of memory before its
    one-line error. A compressed file inflates to 100x its size at most (past 64 MiB), checked per chunk:
    this one (~300 kB -> 320 MiB) stops at 64 MiB, with one line naming the file."""
    shutil.copy(gzip_bomb, tmp_path / name)
    assert os.path.getsize(tmp_path / name) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(MemsifterError) as e:
            reading._read_raw(str(tmp_path / name))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert name in str(e.value) and "decompression bomb" in str(e.value) and "\n" not in str(e.value)
    assert peak < 80 << 20, f"peak {peak >> 20} MiB"   # was the whole 320 MiB (and 3 GB at full scale)
    # the same through the CLI: one line, exit 2, nothing written
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "data", "import", str(tmp_path / name), str(out),
                        "--format", "longmemeval", "-q"], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "decompression bomb" in lines[0], p.stderr[-2000:]
    assert not (out / "_SUCCESS").exists()


def test_real_compressed_data_inflates_within_the_ratio():
    """The shipped samples inflate 3-4x: far inside the bound."""
    from memsifter import samples

    for name in (samples.LOCOMO, samples.LONGMEMEVAL):
        path = samples.path(name)
        assert len(reading._read_raw(path)) < 5 * os.path.getsize(path)


# --------------------------------------------------------------------------- item 7
def test_holder_state_live_stale_expired(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here, now = socket.gethostname(), time.time()
    base = {"run_id": "r", "token": "t", "purpose": "stage synth", "started_at": "x"}
    assert lease.holder_state({**base, "host": here, "pid": os.getpid(), "expires_at": now + 60}) == "live"
    assert lease.holder_state({**base, "host": here, "pid": dead.pid, "expires_at": now + 60}) == "stale"
    assert lease.holder_state({**base, "host": "node-7", "pid": dead.pid, "expires_at": now + 60}) == "live"
    assert lease.holder_state({**base, "host": "node-7", "pid": 4242, "expires_at": now - 1}) == "expired"
    assert lease.holder_state({**base, "host": here, "pid": dead.pid, "expires_at": now - 1}) == "expired"
    assert lease.holder_state({**base, "host": "node-7", "pid": 4242, "expires_at": "tomorrow"}) == "malformed"
    # read_holder: the holder of a prefix as status reads it (None without a lease)
    prefix = str(tmp_path / "out")
    assert lease.read_holder(prefix) is None
    a = lease.Lease(prefix, ttl=30).acquire()
    h = lease.read_holder(prefix)
    assert h is not None and lease.holder_state(h) == "live" and h["run_id"] == a.holder["run_id"]
    a.release()
    os.makedirs(prefix, exist_ok=True)
    with open(os.path.join(prefix, "_LEASE"), "wb") as f:
        f.write(b"\xff")
    h = lease.read_holder(prefix)
    assert lease.holder_state(h) == "malformed" and "_LEASE" in h["malformed"]
