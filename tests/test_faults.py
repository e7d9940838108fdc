"""Object-store faults: every CPU stage under a fault-injecting proxy in front of the real SeaweedFS.

The proxy (memsifter.testing.faultproxy) resets connections, stalls past the client's timeout, drops answers
after the request ran, answers 503 SlowDown / 500, and refuses everything for a while. Each stage must
publish outputs identical (sha256, read back from the store) to a clean run of the same config; a
store that stays down must fail the stage with one clear error after bounded retries, publishing
nothing. The table of faults per stage is printed at the end (visible without -s).
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
from stage_cases import before_stage, output_hashes, setup_inputs, stored_hashes

from memsifter.store import storage
from memsifter.errors import NotPublishedError, StorageError
from memsifter.testing.faultproxy import FaultPlan, fault_proxy
from memsifter.stage import get_stage
from memsifter.testing.servers import env_vars

# Short timeouts so that a stalled request costs seconds, not minutes.
FAULT_ENV = {"MEMSIFTER_S3_REQUEST_TIMEOUT": "2", "MEMSIFTER_S3_CONNECT_TIMEOUT": "2",
             "MEMSIFTER_S3_ATTEMPTS": "3", "MEMSIFTER_STORE_RETRY_SECONDS": "60"}
# every kind of fault; stalls (each costs a client timeout) drawn less often than the rest
KINDS_MIX = ("reset", "reset", "reset_after", "reset_after", "stall", "slow", "503", "503", "500", "500")
# every stage, merge's ranged tensor reads included (storage.RangeReader), gets every kind of fault
KINDS_FOR: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def proxy(s3_server):
    with fault_proxy(s3_server.endpoint) as p:
        yield p


@pytest.fixture
def proxied(s3_server, proxy):
    proxy.set_plan(FaultPlan(rate=0.0))
    proxy.down = False
    storage._s3.cache_clear()
    with env_vars({**s3_server.env(), "MEMSIFTER_S3_ENDPOINT": proxy.endpoint, **FAULT_ENV}):
        yield proxy
    proxy.set_plan(FaultPlan(rate=0.0))
    proxy.down = False
    storage._s3.cache_clear()


def _root() -> str:
    root = f"s3://f-{uuid.uuid4().hex[:10]}/run"
    storage.ensure_bucket(root)
    return root


def test_every_stage_survives_store_faults(proxied, tiny_model_dir, tmp_path, capsys):
    root = _root()
    cases = setup_inputs(root, str(tmp_path), tiny_model_dir)
    clean = {}
    for name, cfg in cases:                      # 1) clean run through the proxy (no faults)
        before_stage(name, cfg)
        clean[name] = output_hashes(get_stage(name).run(cfg))
    for _, cfg in cases:                         # 2) same outputs again, now with faults
        storage.delete(cfg["output"])
    rows = []
    for i, (name, cfg) in enumerate(cases):
        proxied.set_plan(FaultPlan(rate=0.15, seed=100 + i, kinds=KINDS_FOR.get(name, KINDS_MIX), stall_s=3.0, slow_s=0.3))
        proxied.reset_counts()
        retries0 = storage.STATS["retries"]
        t0 = time.time()
        before_stage(name, cfg)
        m = get_stage(name).run(cfg)
        secs = time.time() - t0
        counts = proxied.reset_counts()
        proxied.set_plan(FaultPlan(rate=0.0))
        got = stored_hashes(cfg["output"])
        same = output_hashes(m) == clean[name] == got
        rows.append((name, counts, storage.STATS["retries"] - retries0, secs, same))
        assert not m.get("skipped")
        assert same, f"{name}: outputs differ from the clean run"
        assert counts["faults"] > 0, f"{name}: no fault was injected (requests: {counts['requests']})"
    # 3) a full outage in the middle of the chain: the stage waits it out
    storage.delete(cases[1][1]["output"])
    proxied.outage(4.0)
    t0 = time.time()
    m = get_stage("synth").run(cases[1][1])
    counts = proxied.reset_counts()
    assert output_hashes(m) == clean["synth"] == stored_hashes(cases[1][1]["output"])
    assert counts["outage"] > 0
    rows.append(("synth+outage 4s", counts, None, time.time() - t0, True))
    total = sum(r[1]["faults"] for r in rows)
    with capsys.disabled():
        print("\n\nobject-store faults (FaultProxy in front of SeaweedFS; outputs compared by sha256 with a clean run)")
        print(f"{'stage':<16} {'requests':>8} {'faults':>6} {'reset':>5} {'reset_after':>11} {'stall':>5} "
              f"{'slow':>4} {'503':>4} {'500':>4} {'outage':>6} {'our retries':>11} {'secs':>6}  outcome")
        for name, c, retries, secs, same in rows:
            print(f"{name:<16} {c['requests']:>8} {c['faults']:>6} {c['reset']:>5} {c['reset_after']:>11} "
                  f"{c['stall']:>5} {c['slow']:>4} {c['503']:>4} {c['500']:>4} {c['outage']:>6} "
                  f"{'-' if retries is None else retries:>11} {secs:>6.1f}  "
                  f"{'published, hashes equal' if same else 'DIFFERENT'}")
        print(f"total faults injected: {total}; outputs lost or different: 0\n")


def test_store_that_stays_down_fails_clearly_and_publishes_nothing(proxied):
    root = _root()
    out = storage.join(root, "synth")
    proxied.down = True
    t0 = time.time()
    with env_vars({"MEMSIFTER_STORE_RETRY_SECONDS": "3"}):
        with pytest.raises(StorageError) as e:
            get_stage("synth").run({"output": out, "questions": 4, "sessions_per_question": 4})
    secs = time.time() - t0
    proxied.down = False
    msg = str(e.value)
    assert "s3://" in msg and ("gave up after" in msg or "unavailable" in msg), msg
    assert secs < 60, f"took {secs:.0f}s: retries are not bounded"
    with pytest.raises(NotPublishedError):
        storage.read_manifest(out)
    assert proxied.counts["outage"] > 0


@pytest.mark.heavy
def test_merge_survives_answers_cut_off_mid_body(proxied, tiny_model_dir, tmp_path):
    root = _root()
    name, cfg = setup_inputs(root, str(tmp_path), tiny_model_dir)[-1]
    proxied.set_plan(FaultPlan(rate=0.5, seed=7, kinds=("reset_after",)))
    get_stage(name).run(cfg)


def test_range_reader_survives_answers_cut_off_mid_body(proxied):
    """storage.RangeReader (the retrying ranged read offered to merge.py) under a fault on every
    other request: cut-off answers, resets, 5xx."""
    import numpy as np

    uri = storage.join(_root(), "blob.bin")
    payload = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8).tobytes()
    storage.write_bytes(uri, payload)
    proxied.set_plan(FaultPlan(rate=0.5, seed=11, kinds=("reset_after", "reset", "503", "500")))
    proxied.reset_counts()
    r = storage.RangeReader(uri)
    for off, n in ((0, 8), (1000, 1 << 20), (len(payload) - 4096, 4096), (5, 300000)):
        buf = np.empty(n, dtype=np.uint8)
        assert r.read_into(off, buf) == n and buf.tobytes() == payload[off:off + n]
    r.close()
    assert proxied.counts["faults"] > 0


def test_a_server_that_accepts_and_never_answers_fails_within_the_budget(tmp_path):
    """Issue 19: an S3 endpoint that accepts connections and never answers used to hang 485 s inside one
    retry attempt (SDK attempts x 120 s request timeout). The timeouts now fit the retry budget: with
    MEMSIFTER_STORE_RETRY_SECONDS=8 the command fails in one line well before a minute."""
    import socket
    import subprocess
    import sys
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held = []

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            held.append(c)  # never read, never answer
    threading.Thread(target=accept, daemon=True).start()
    env = {**os.environ, "MEMSIFTER_S3_ENDPOINT": f"http://127.0.0.1:{srv.getsockname()[1]}",
           "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "MEMSIFTER_STORE_RETRY_SECONDS": "8"}
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-m", "memsifter.cli", "data", "info", "s3://stalled/data"], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        srv.close()
        for c in held:
            c.close()
    took = time.time() - t0
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert took < 45, (took, p.stderr[-1000:])
    assert "s3://stalled/data" in p.stderr
