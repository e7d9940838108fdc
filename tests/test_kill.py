"""Kill and resume: SIGKILL every CPU stage at several points, on the real S3 server (SeaweedFS).

Each stage runs as its own ``python`` process and is killed (``MEMSIFTER_KILL_AT``, a real SIGKILL
from memsifter.testing.faults.checkpoint) while it stages its files, after the first file of its publish
moved into place, and once more while the restarted run completes that publish (before
``_SUCCESS``). The last restart must finish with outputs byte-identical to a clean run, completing the
interrupted publish from its journal instead of recomputing, and a further run republishes nothing.
A reader thread polls every output during all of it and checks each file against the manifest it
read: it must never get a file that its manifest does not describe (a half-published output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pyarrow.fs as pafs
import pytest
from stage_cases import STAGE_NAMES, before_stage, output_hashes, setup_inputs, stored_hashes

from memsifter.store import storage
from memsifter.errors import NotPublishedError, StorageError
from memsifter.stage import get_stage
from memsifter.testing.servers import env_vars

CHILD = ("import json, sys; from memsifter.stage import get_stage; "
         "get_stage(sys.argv[1]).run(json.loads(sys.argv[2]), replace=True)")
KILLS = ("write:1", "publish-move:1", "publish-commit:1")
# CI: every point on the cheap stages; the full matrix (prepare-rl too: its tokenizer load makes each
# process slow) runs with `python -m pytest -q --heavy tests/test_kill.py tests/test_faults.py`.
CI_STAGES = ("import", "synth", "evaluate", "merge")


def run_child(name: str, cfg: dict, kill: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEMSIFTER_RUN_ID": f"kill-test-{uuid.uuid4().hex[:6]}"}
    env.pop("MEMSIFTER_KILL_AT", None)
    if kill:
        env["MEMSIFTER_KILL_AT"] = f"{name}:{kill}"
    return subprocess.run([sys.executable, "-c", CHILD, name, json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=300)


class PollingReader(threading.Thread):
    """Reads every output over and over: manifest, then each listed file, checked against it.

    ``storage`` verifies each read against the manifest (ConcurrentPublishError on a mismatch); the
    reader checks the sha256 itself as well, so a silent mix would be counted in ``half_seen``.
    ``raw_mixed`` counts files that a reader *without* that check (plain pyarrow reads) got from
    another publication than its manifest: what the check protects from."""

    def __init__(self, outputs: list[str]):
        super().__init__(daemon=True)
        self.outputs = outputs
        self.stop = threading.Event()
        self.complete = self.refused = self.half_seen = self.raw_mixed = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for out in self.outputs:
                try:
                    m = storage.read_manifest(out)
                    for name, meta in m["files"].items():
                        data = storage.read_bytes(storage.join(out, name))
                        if storage.sha256_bytes(data) != meta["sha256"]:
                            self.half_seen += 1
                    self.complete += 1
                except (NotPublishedError, StorageError):
                    self.refused += 1
            time.sleep(0.2)

    def raw_read(self, out: str) -> None:
        """One unchecked read (manifest, then the files with plain pyarrow): for the comparison."""
        try:
            m = storage.read_json(storage.join(out, storage.MANIFEST))
        except StorageError:
            return
        fs, root = storage.resolve(out)
        for name, meta in m["files"].items():
            try:
                with fs.open_input_stream(f"{root}/{name}") as f:
                    if storage.sha256_bytes(f.read()) != meta["sha256"]:
                        self.raw_mixed += 1
            except OSError:
                pass


def test_sigkill_at_every_point_resumes_byte_identical(s3_root, tiny_model_dir, tmp_path, capsys, monkeypatch):
    _kill_chain(CI_STAGES, s3_root, tiny_model_dir, tmp_path, capsys, monkeypatch)


@pytest.mark.heavy
def test_sigkill_every_stage_full_matrix(s3_root, tiny_model_dir, tmp_path, capsys, monkeypatch):
    _kill_chain(STAGE_NAMES, s3_root, tiny_model_dir, tmp_path, capsys, monkeypatch)


def _kill_chain(stages, s3_root, tiny_model_dir, tmp_path, capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("MEMSIFTER_LEASE_TTL", "30")
    cases = setup_inputs(s3_root, str(tmp_path), tiny_model_dir)
    clean = {}
    for name, cfg in cases:
        before_stage(name, cfg)
        clean[name] = output_hashes(get_stage(name).run(cfg))
    for _, cfg in cases:
        storage.delete(cfg["output"])
    cases = [(n, c) for n, c in cases if n in stages or n == "synth"]   # synth feeds evaluate
    reader = PollingReader([cfg["output"] for _, cfg in cases])
    reader.start()
    rows, kills = [], 0
    try:
        for name, cfg in cases:
            before_stage(name, cfg)
            t0 = time.time()
            for kill in KILLS:
                p = run_child(name, cfg, kill)
                assert p.returncode == -9, f"{name} killed at {kill}: rc {p.returncode}\n{p.stderr[-3000:]}"
                kills += 1
            p = run_child(name, cfg)
            assert p.returncode == 0, f"{name} restart: rc {p.returncode}\n{p.stderr[-3000:]}"
            m = storage.read_manifest(cfg["output"])
            same = output_hashes(m) == clean[name] == stored_hashes(cfg["output"])
            assert same, f"{name}: output differs from the clean run after kills"
            assert "resumed_publish_at" in m, f"{name}: the interrupted publish was recomputed, not completed"
            before = m["published_at"], m["attempt"]
            p = run_child(name, cfg)   # finished: nothing is republished
            assert p.returncode == 0, p.stderr[-2000:]
            m2 = storage.read_manifest(cfg["output"])
            assert (m2["published_at"], m2["attempt"]) == before
            leftovers = [f for f in storage.list_files(cfg["output"])
                         if f.startswith((storage.STAGING, storage.JOURNAL, "_LEASE"))]
            assert not leftovers, f"{name}: left behind {leftovers}"
            rows.append((name, len(KILLS), time.time() - t0, same))
        # a republish (another config on the same output) killed mid-publish, then completed, while
        # the reader polls and an unchecked reader reads alongside
        name, cfg = cases[1]
        cfg2 = {**cfg, "seed": 4}
        stop_raw = threading.Event()

        def raw_loop() -> None:
            while not stop_raw.is_set():
                reader.raw_read(cfg["output"])

        raw = threading.Thread(target=raw_loop, daemon=True)
        raw.start()
        p = run_child(name, cfg2, "publish-move:1")
        assert p.returncode == -9
        kills += 1
        p = run_child(name, cfg2)
        assert p.returncode == 0, p.stderr[-2000:]
        stop_raw.set()
        raw.join(10)
        assert storage.read_manifest(cfg["output"])["config"]["seed"] == 4
    finally:
        reader.stop.set()
        reader.join(30)
    assert reader.half_seen == 0
    assert reader.complete > 0
    with capsys.disabled():
        print("\n\nkill and resume (SIGKILL in a child process, SeaweedFS S3)")
        print(f"{'stage':<12} {'kills':>5} {'secs':>6}  outcome")
        for name, k, secs, same in rows:
            print(f"{name:<12} {k:>5} {secs:>6.1f}  {'completed, byte-identical, no republish' if same else 'DIFFERENT'}")
        print("republish of synth killed mid-publish: 1 kill, completed")
        print(f"kills survived: {kills}; outputs lost: 0; polling reader: {reader.complete} complete reads, "
              f"{reader.refused} refused while unpublished/replaced, {reader.half_seen} half-published seen; "
              f"an unchecked reader got {reader.raw_mixed} file(s) of another publication than its manifest\n")


def test_local_disk_kill_mid_publish_rolls_forward(tmp_path):
    """The same on a local directory (rename instead of copy+delete)."""
    out = str(tmp_path / "synth")
    cfg = {"output": out, "questions": 4, "sessions_per_question": 4, "seed": 1}
    for kill in ("publish-move:1", "publish-commit:1"):
        assert run_child("synth", cfg, kill).returncode == -9
        assert not os.path.exists(os.path.join(out, storage.MANIFEST))
        assert os.path.exists(os.path.join(out, storage.JOURNAL))
    p = run_child("synth", cfg)
    assert p.returncode == 0, p.stderr[-2000:]
    m = storage.read_manifest(out)
    assert "resumed_publish_at" in m
    ref = get_stage("synth").run({**cfg, "output": str(tmp_path / "ref")})
    assert output_hashes(m) == output_hashes(ref) == stored_hashes(out)
    assert sorted(os.listdir(out)) == sorted([*m["files"], storage.MANIFEST])
    assert pafs.LocalFileSystem().get_file_info(os.path.join(out, "_LEASE")).type == pafs.FileType.NotFound


@pytest.mark.heavy
def test_embed_real_minilm_under_faults_and_kills(s3_server, s3_root, tmp_path, capsys):
    """embed (real all-MiniLM-L6-v2 on a local Ray cluster in each process): a clean run, then the same
    config killed while writing its embedding shards, mid-publish and before _SUCCESS, then finished
    through the fault proxy; outputs byte-identical to the clean run."""
    from memsifter.testing.faultproxy import FaultPlan, fault_proxy

    synth = storage.join(s3_root, "synth")
    get_stage("synth").run({"output": synth, "questions": 6, "sessions_per_question": 6, "seed": 5})
    cfg = {"input": synth, "model": "all-MiniLM-L6-v2", "output": storage.join(s3_root, "embed-clean"),
           "max_batch_size": 8}
    assert run_child("embed", cfg).returncode == 0
    clean = output_hashes(storage.read_manifest(cfg["output"]))
    cfg = {**cfg, "output": storage.join(s3_root, "embed")}
    for kill in KILLS:
        p = run_child("embed", cfg, kill)
        assert p.returncode == -9, p.stderr[-3000:]
    with fault_proxy(s3_server.endpoint, FaultPlan(rate=0.1, seed=3, kinds=("reset", "503", "500", "slow"))) as proxy:
        with env_vars({"MEMSIFTER_S3_ENDPOINT": proxy.endpoint, "MEMSIFTER_S3_REQUEST_TIMEOUT": "5"}):
            p = run_child("embed", cfg)
        faults = proxy.counts["faults"]
    assert p.returncode == 0, p.stderr[-3000:]
    m = storage.read_manifest(cfg["output"])
    assert output_hashes(m) == clean == stored_hashes(cfg["output"])
    with capsys.disabled():
        print(f"\nembed (MiniLM): {len(KILLS)} kills survived, {faults} store faults on the final run, "
              f"outputs byte-identical to the clean run\n")
