"""One writer per output: the lease (memsifter.store.lease) on a local directory and on real S3 (SeaweedFS,
conditional PUTs), the stage CLI's refusal/--force/--steal-lease, a robbed writer that must not publish,
and two pipeline drivers of one run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from memsifter import cli
from memsifter.store import lease, storage
from memsifter.errors import NotPublishedError
from memsifter.k8s.driver import Driver, Plan
from memsifter.stage import get_stage


def foreign_lease(prefix: str, expires_in: float, run: str = "run-other", host: str = "node-7") -> None:
    """A lease held by a run on another machine (as that run would have written it)."""
    now = time.time()
    storage.write_bytes(storage.join(prefix, lease.LEASE), json.dumps({
        "run_id": run, "host": host, "pid": 4242, "purpose": "stage synth", "token": "t-other",
        "started_at": "2026-01-01T00:00:00+00:00", "expires_at": now + expires_in, "ttl": 60}).encode())


def test_second_writer_is_refused_naming_the_holder_then_steals(store_root):
    prefix = storage.join(store_root, "out")
    storage.ensure_bucket(prefix)
    a = lease.Lease(prefix, purpose="stage synth", ttl=30).acquire().start()
    try:
        with pytest.raises(lease.LeaseHeldError) as e:
            lease.Lease(prefix, purpose="stage embed").acquire()
        msg = str(e.value)
        assert a.holder["run_id"] in msg and a.holder["host"] in msg and f"pid {a.holder['pid']}" in msg
        assert "--steal-lease" in msg and e.value.exit_code == 3
        b = lease.Lease(prefix, purpose="stage embed", ttl=30).acquire(steal=True)
        with pytest.raises(lease.LeaseLostError, match="taken over by run"):
            a.check()
        b.check()
        b.release()
        assert not storage.exists(storage.join(prefix, lease.LEASE))
    finally:
        a.release()


def test_expired_lease_of_a_dead_holder_is_taken_over(store_root):
    prefix = storage.join(store_root, "out")
    storage.ensure_bucket(prefix)
    foreign_lease(prefix, expires_in=0.5)
    with pytest.raises(lease.LeaseHeldError):
        lease.Lease(prefix).acquire()
    time.sleep(0.7)
    got = lease.Lease(prefix, ttl=5).acquire()
    assert got.holder["took_over"]["run_id"] == "run-other"
    got.release()


def test_lease_expiring_implausibly_far_ahead_is_expired(tmp_path, capsys):
    """issue 41: a lease whose expires_at is now + 1e8 kept a stage "running" forever. No holder writes an
    expiry past the longest lease (a day) plus clock skew: such a lease is expired, for `memsifter status`
    and for the next writer; one within a day stays live."""
    from memsifter import status

    out = str(tmp_path / "out")
    foreign_lease(out, expires_in=1e8)
    holder = lease.read_holder(out)
    assert lease.holder_state(holder) == "expired"
    assert "beyond the longest lease" in lease.describe(holder)
    capsys.readouterr()
    assert status.main([out, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["stages"][0]
    assert st["state"] == "stale lease", st
    got = lease.Lease(out, ttl=5).acquire()   # taken over, not refused as held
    assert got.holder["took_over"]["run_id"] == "run-other"
    got.release()
    foreign_lease(out, expires_in=lease.MAX_TTL)   # the longest real lease: live
    assert lease.holder_state(lease.read_holder(out)) == "live"
    with pytest.raises(lease.LeaseHeldError):
        lease.Lease(out).acquire()


def test_heartbeat_keeps_a_short_lease_alive(tmp_path):
    prefix = str(tmp_path / "out")
    a = lease.Lease(prefix, ttl=0.6).acquire().start()
    time.sleep(1.5)   # well past one ttl: only the heartbeat keeps it
    with pytest.raises(lease.LeaseHeldError):
        lease.Lease(prefix).acquire()
    a.check()
    a.release()


def test_cli_refuses_force_does_not_steal_steal_lease_does(tmp_path, capsys):
    out = str(tmp_path / "synth")
    foreign_lease(out, expires_in=120)
    args = ["run", "synth", "--output", out, "--questions", "2", "--sessions-per-question", "3"]
    assert cli.main(args) == 3
    err = capsys.readouterr().err
    assert "run-other" in err and "node-7" in err and "pid 4242" in err and err.count("\n") == 1
    assert cli.main(args + ["--force"]) == 3          # --force re-runs a published output, never a held one
    assert "run-other" in capsys.readouterr().err
    with pytest.raises(NotPublishedError):
        storage.read_manifest(out)
    assert cli.main(args + ["--steal-lease"]) == 0
    assert storage.read_manifest(out)["stage"] == "synth"
    assert not storage.exists(storage.join(out, lease.LEASE))   # released after the run


def test_robbed_writer_does_not_publish(s3_root, monkeypatch):
    out = storage.join(s3_root, "synth")
    original = storage.Publication.publish

    def steal_then_publish(self, stats=None, check=None):
        # another run takes the output over at the worst moment: everything staged, nothing published
        thief = lease.Lease(self.uri, purpose="thief", ttl=30).acquire(steal=True)
        try:
            return original(self, stats, check)
        finally:
            thief.release()

    monkeypatch.setattr(storage.Publication, "publish", steal_then_publish)
    with pytest.raises(lease.LeaseLostError, match="not publishing"):
        get_stage("synth").run({"output": out, "questions": 2, "sessions_per_question": 3})
    with pytest.raises(NotPublishedError):
        storage.read_manifest(out)
    # nothing published; the failed attempt left only its record for `memsifter status`
    assert not [f for f in storage.list_files(out) if not f.startswith(lease.LEASE) and f != "_work/failure.json"]


def test_two_processes_on_one_output_one_is_refused(tmp_path):
    """Two real `memsifter run synth` processes with different configs on one output: while the first
    one runs (held just before it publishes), the second is refused (exit 3, holder named) instead of
    both succeeding with the last writer winning."""
    import os

    out = str(tmp_path / "synth")
    exe = [sys.executable, "-m", "memsifter.cli", "run", "synth", "--output", out, "--questions", "3",
           "--sessions-per-question", "3"]
    first = subprocess.Popen(exe + ["--seed", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "MEMSIFTER_PAUSE_AT": "synth:publish-start:6"})
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(out, lease.LEASE)):
        assert time.time() < deadline and first.poll() is None, first.stderr.read()
        time.sleep(0.1)
    second = subprocess.run(exe + ["--seed", "2"], capture_output=True, text=True, timeout=120)
    assert first.wait(120) == 0, first.stderr.read()
    assert second.returncode == 3, second.stderr
    assert "another writer holds this output" in second.stderr and f"pid {first.pid}" in second.stderr
    assert storage.read_manifest(out)["config"]["seed"] == 1


def test_two_drivers_of_one_run_do_not_both_create_rayjobs(s3_root):
    plan = Plan.from_dict({"run": {"id": "r9", "root": s3_root}, "stages": [
        {"name": "synth", "needs": [], "config": {"output": storage.join(s3_root, "synth")},
         "rayjob": {"metadata": {"name": "r9-synth"}, "spec": {}}}]})

    class Backend:   # in memory: the RayJob API is not what is tested here
        def __init__(self):
            self.created = []

        def get(self, name):
            return {"status": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}} \
                if name in self.created else None

        def create(self, rj):
            self.created.append(rj["metadata"]["name"])

        def delete(self, name):
            pass

        def logs_hint(self, name):
            return "-"

    first = lease.Lease(storage.join(s3_root, "_run"), purpose="driver of run r9", ttl=30).acquire().start()
    be = Backend()
    try:
        with pytest.raises(lease.LeaseHeldError, match="driver of run r9"):
            Driver(plan, be, poll=0, check_configs=False, sleep=lambda s: None, lease_wait=1,
                   is_published=lambda st: (bool(be.created), "x")).run()
        assert be.created == []
    finally:
        first.release()
    m = Driver(plan, be, poll=0, check_configs=False, sleep=lambda s: None,
               is_published=lambda st: (bool(be.created), "x")).run()
    assert m["state"] == "succeeded" and be.created == ["r9-synth"]
    assert not storage.exists(storage.join(s3_root, "_run", lease.LEASE))


def test_restarted_driver_waits_for_the_dead_drivers_lease(s3_root):
    """A driver pod that replaces a dead one (other host) waits for its lease to expire, then runs."""
    foreign_lease(storage.join(s3_root, "_run"), expires_in=1.5, run="r9", host="driver-pod-old")
    plan = Plan.from_dict({"run": {"id": "r9", "root": s3_root}, "stages": []})
    t0 = time.time()
    m = Driver(plan, object(), poll=0, check_configs=False, sleep=lambda s: None, lease_wait=20).run()
    assert m["state"] == "succeeded" and 1.0 < time.time() - t0 < 15
