"""An owner's mem0 log folded into snapshots (issue 46: ``read_log`` listed and sorted every event file ever
written on each re-read, 9.1% of the service's samples under 32 writers on a 519 MB state).

* Folding is exact: a reader that starts from a snapshot has the memories, each memory's history, the events
  applied (eids) and the index by content that replaying the whole log gives, through updates, deletes, the
  same content added twice, an event file written twice (a recovered journal) and a reset of the owner.
* A reader that starts after a compaction sees every memory; a reader that held the owner before it moves on
  without re-reading anything (fast-forward), and one several snapshots behind reloads.
* Writer threads, two compactors and a reader at once: no memory lost or duplicated, every write that was on
  disk before a read began is in that read.
* A crash mid-snapshot (a half-written temp file), or between a snapshot and the removal of what it folded,
  leaves the state readable and equal to the replay.
* A re-read lists a bounded number of files and reads only the event files written since the last one.
* Recovery of a dead process's journal does not write again what a snapshot already holds.

Real parts only: the real module on a real local directory (and the test S3 server for the conditional
create), real threads; nothing mocked but counters wrapped around the storage layer's list and read.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO

from memsifter.service import mem0 as M
from memsifter.store import storage


def _ev(kind: str, mid: str, eid: str, text: str | None = None, **kw) -> dict:
    ev = {"event": kind, "id": mid, "eid": eid, "at": f"2026-12-01T00:00:{len(eid):02d}", "role": "user"}
    if kind in ("ADD", "UPDATE"):
        ev.update(memory=text, hash=M.text_hash(text), metadata=kw.pop("metadata", None))
    if kind == "ADD":
        ev.update(user_id="u", agent_id=None, run_id=None)
    ev.update(kw)
    return ev


def _write(folder: str, events: list[dict], name: str | None = None) -> str:
    name = name or M.event_name()
    M._write_local(os.path.join(folder, name), json.dumps(events).encode())
    return name


def _state(o: M.Owner) -> tuple:
    return (o.memories, o.history, o.seen, o.by_key, o.version)


def _fresh(state: str) -> M.Owner:
    return M.read_log(state, M.Owner("user", "u"))


def _workload(seed: int, files: int) -> list[list[dict]]:
    """``files`` event files of random ADD / UPDATE / DELETE events on a few contents (so that the same content
    is added twice, an update turns one memory into another's content, a deleted memory's content comes
    back), each event with an eid; some files written twice (a journal recovered after its file was written)."""
    rng = random.Random(seed)
    live: dict[str, str] = {}
    out, n = [], 0
    for _ in range(files):
        evs = []
        for _ in range(rng.randint(1, 3)):
            n += 1
            eid = f"e{seed}x{n}"
            r = rng.random()
            if r < 0.5 or not live:
                mid = f"user-u~m{n}"
                text = f"content {rng.randint(0, 12)}"
                evs.append(_ev("ADD", mid, eid, text, metadata={"n": n}))
                live.setdefault(mid, text)
            elif r < 0.8:
                mid = rng.choice(sorted(live))
                text = f"content {rng.randint(0, 12)}"
                evs.append(_ev("UPDATE", mid, eid, text, old_memory=live[mid]))
                live[mid] = text
            else:
                mid = rng.choice(sorted(live))
                evs.append(_ev("DELETE", mid, eid, old_memory=live.pop(mid)))
        out.append(evs)
        if rng.random() < 0.05:
            out.append(list(evs))   # the same events again (same eids): applied once
    return out


@pytest.fixture
def state(tmp_path):
    return str(tmp_path / "state")


def _folder(state: str) -> str:
    return os.path.join(state, "mem0", "user-u")


def _listing(state: str) -> tuple[list[str], list[str]]:
    names = sorted(os.listdir(_folder(state)))
    return ([n for n in names if n.startswith("ev-") and n.endswith(".json")],
            [n for n in names if n.startswith("snap-") and n.endswith(".json")])


# --------------------------------------------------------------------------- folding is exact
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_folding_gives_the_state_of_replaying_the_whole_log(state, seed):
    """Event files written in turns; after each turn a compaction (a low threshold) may fold them. A reader
    from scratch, and one that re-read after every turn, both equal the replay of every event file ever
    written (kept aside in a second folder that is never compacted)."""
    folder, plain = _folder(state), os.path.join(state + "-plain", "mem0", "user-u")
    os.makedirs(folder)
    os.makedirs(plain)
    follower = M.Owner("user", "u")
    snapshots = set()
    for turn, batch in enumerate([_workload(seed, 40)[i:i + 7] for i in range(0, 40, 7)]):
        for evs in batch:
            name = M.event_name()
            _write(folder, evs, name)
            _write(plain, evs, name)
        out = M.compact(state, "user", "u", max_files=5, grace_s=0)
        if out["snapshot"]:
            snapshots.add(out["snapshot"])
        follower = M.read_log(state, follower)
        replay = M.read_log(state + "-plain", M.Owner("user", "u"))
        assert _state(follower) == _state(replay), f"turn {turn}: an incremental reader"
        assert _state(_fresh(state)) == _state(replay), f"turn {turn}: a reader from scratch"
    assert len(snapshots) >= 3
    evs, snaps = _listing(state)
    assert len(snaps) == 1 and len(evs) <= 5, (evs, snaps)   # folded files and older snapshots removed
    # every memory's history and the index by content survive the round trip through JSON
    final = _fresh(state)
    assert final.history and any(len(h) > 1 for h in final.history.values())
    assert any(h[-1]["event"] == "DELETE" for h in final.history.values())


def test_a_reset_owner_starts_again_from_nothing_and_compacts_again(state):
    """``POST /reset`` removes the owner's folder: a reader that held it (at a snapshot) sees only what came
    after; compaction starts a new line of snapshots; the result equals the replay of the new files only."""
    folder = _folder(state)
    os.makedirs(folder)
    for evs in _workload(7, 30):
        _write(folder, evs)
    assert M.compact(state, "user", "u", max_files=4, grace_s=0)["snapshot"]
    held = _fresh(state)
    assert held.memories and held.base
    storage.delete(storage.join(state, "mem0", "user-u"))   # what Mem0API._delete_owner does
    assert M.read_log(state, held).memories == {}
    os.makedirs(folder)
    later = _workload(8, 12)
    plain = os.path.join(state + "-plain", "mem0", "user-u")
    os.makedirs(plain)
    for evs in later:
        name = M.event_name()
        _write(folder, evs, name)
        _write(plain, evs, name)
    again = M.read_log(state, held)
    out = M.compact(state, "user", "u", max_files=4, grace_s=0)
    assert out["snapshot"] == "snap-0000000001.json", out
    replay = M.read_log(state + "-plain", M.Owner("user", "u"))
    assert _state(M.read_log(state, again)) == _state(replay) == _state(_fresh(state))


# --------------------------------------------------------------------------- readers after a compaction
def test_readers_after_a_compaction_see_every_memory_and_read_only_what_is_new(state, monkeypatch):
    """300 memories in 300 event files. A reader that held all of them before the compaction moves to the
    snapshot without reading a byte (its files are the snapshot's); a new reader reads the snapshot once;
    then 3 new event files cost 3 reads, whatever the owner's past."""
    folder = _folder(state)
    os.makedirs(folder)
    for i in range(300):
        _write(folder, [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")])
    held = _fresh(state)
    out = M.compact(state, "user", "u", max_files=64, grace_s=0)
    assert out["folded"] == 300 and out["removed"] == 300, out
    reads: list[str] = []
    real = storage.read_bytes

    def counting(uri, *a, **kw):
        reads.append(uri.rsplit("/", 1)[-1])
        return real(uri, *a, **kw)
    monkeypatch.setattr(M.storage, "read_bytes", counting)
    moved = M.read_log(state, held)
    assert set(moved.memories) == {f"user-u~m{i}" for i in range(300)}
    assert moved.base == out["snapshot"] and moved.files == []
    assert reads == [out["snapshot"]], "only the snapshot's header looked at, no event file"
    reads.clear()
    new = _fresh(state)
    assert _state(new) == _state(moved) and reads == [out["snapshot"]]
    for i in range(300, 303):
        _write(folder, [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")])
    reads.clear()
    again = M.read_log(state, new)
    assert len(again.memories) == 303 and len(reads) == 3 and all(r.startswith("ev-") for r in reads), reads


def test_a_reader_several_snapshots_behind_reloads_from_the_newest(state):
    folder = _folder(state)
    os.makedirs(folder)
    for i in range(10):
        _write(folder, [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")])
    old = _fresh(state)
    for round_ in range(3):
        for i in range(10 * (round_ + 1), 10 * (round_ + 2)):
            _write(folder, [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")])
        _write(folder, [_ev("DELETE", f"user-u~m{round_}", f"d{round_}", old_memory=f"fact {round_}")])
        assert M.compact(state, "user", "u", max_files=4, grace_s=0)["snapshot"]
    assert _listing(state)[1] == ["snap-0000000003.json"]
    got = M.read_log(state, old)
    assert set(got.memories) == {f"user-u~m{i}" for i in range(3, 40)}
    assert [h["event"] for h in got.history["user-u~m1"]] == ["ADD", "DELETE"]


def test_a_late_event_file_named_before_the_snapshot_is_not_lost(state):
    """An event file may appear after a compaction with a name (a time) before the files it folded: another
    replica's clock, an S3 PUT that took long. It is not in the snapshot's list, so it is applied."""
    folder = _folder(state)
    os.makedirs(folder)
    early = M.event_name()   # named now, written after the compaction
    for i in range(8):
        _write(folder, [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")])
    held = _fresh(state)
    assert M.compact(state, "user", "u", max_files=4, grace_s=0)["snapshot"]
    _write(folder, [_ev("ADD", "user-u~late", "elate", "a late fact")], early)
    assert "user-u~late" in M.read_log(state, held).memories
    assert "user-u~late" in _fresh(state).memories
    out = M.compact(state, "user", "u", max_files=0, grace_s=0)
    assert out["snapshot"] is None   # max_files 0: never folds


# --------------------------------------------------------------------------- concurrency
def test_writers_two_compactors_and_a_reader_at_once_lose_and_duplicate_nothing(state):
    """4 writer threads write 120 event files each (one ADD; 40 contents written by every writer, each under
    different ids), 2 compactor threads fold every 8 files and remove what is folded after 0.3 s, a reader
    re-reads all along. Each read holds every write that was on disk before it began; at the end each
    content is one memory with one ADD in its history, and every id written is applied once."""
    folder = _folder(state)
    os.makedirs(folder)
    acked: list[tuple[float, str, str]] = []   # (on disk at, id, content)
    done = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for i in range(120):
                text = f"shared {i % 40}" if i % 3 == 0 else f"writer {w} fact {i}"
                mid = f"user-u~w{w}i{i}"
                _write(folder, [_ev("ADD", mid, f"w{w}e{i}", text)])
                acked.append((time.monotonic(), mid, text))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def compactor() -> None:
        try:
            while not done.is_set():
                M.compact(state, "user", "u", max_files=8, grace_s=0.3)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    reads = 0

    def reader() -> None:
        nonlocal reads
        owner = M.Owner("user", "u")
        try:
            while not done.is_set():
                began = time.monotonic()
                before = [a for a in acked if a[0] < began]
                owner = M.read_log(state, owner)
                texts = {m["memory"] for m in owner.memories.values()}
                for _, mid, text in before:
                    assert mid in owner.memories or text.startswith("shared"), mid
                    assert text in texts, text
                assert len(texts) == len(owner.memories), "a content twice"
                reads += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    others = [threading.Thread(target=compactor), threading.Thread(target=compactor), threading.Thread(target=reader)]
    for t in threads + others:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)
    M.compact(state, "user", "u", max_files=8, grace_s=0.3)
    done.set()
    for t in others:
        t.join()
    assert not errors, errors
    assert reads > 3
    final = _fresh(state)
    want = {text for _, _, text in acked}
    assert len(want) == 4 * 80 + 40 and sorted(m["memory"] for m in final.memories.values()) == sorted(want)
    assert all([h["event"] for h in final.history[mid]] == ["ADD"] for mid in final.memories)
    assert {f"w{w}e{i}" for w in range(4) for i in range(120)} == final.seen
    assert _listing(state)[1], "compacted"


# --------------------------------------------------------------------------- crashes
def test_a_crash_mid_snapshot_leaves_the_state_readable(state, monkeypatch):
    """A compactor killed while writing its snapshot leaves a half-written temp file: readers ignore it and a
    later compaction succeeds (and removes the temp file once it is old). A compactor killed after publishing,
    before removing what it folded: readers skip the folded files (not applied twice)."""
    folder = _folder(state)
    os.makedirs(folder)
    for evs in _workload(11, 20):
        _write(folder, evs)
    replay = _fresh(state)
    tmp = os.path.join(folder, "snap-0000000001.json.0badc0de.tmp")
    with open(tmp, "wb") as f:
        f.write(b'{"format": 1, "gen": 1, "base": "", "folded": {"1": ["ev-')
    assert _state(_fresh(state)) == _state(replay)

    def killed(*a, **kw):
        raise OSError("killed")
    monkeypatch.setattr(M.os, "link", killed)   # dies between its temp file and the publish
    with pytest.raises(OSError):
        M.compact(state, "user", "u", max_files=4, grace_s=0)
    monkeypatch.undo()
    assert _listing(state)[1] == [] and _state(_fresh(state)) == _state(replay)
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    out = M.compact(state, "user", "u", max_files=4, grace_s=3600)   # published, nothing removed yet
    assert out["snapshot"] == "snap-0000000001.json" and out["removed"] == 1, out   # the old temp file only
    assert not os.path.exists(tmp)
    evs, _ = _listing(state)
    assert len(evs) == len(os.listdir(folder)) - 1 > 4, "folded files still there"
    assert _state(_fresh(state)) == _state(replay)
    for evs_ in _workload(12, 3):
        _write(folder, evs_)
    both = M.read_log(state, replay)
    assert _state(_fresh(state)) == _state(both)


# --------------------------------------------------------------------------- bounded re-reads
def test_a_re_read_lists_a_bounded_number_of_files(state, monkeypatch):
    """1,000 event files: before folding a re-read lists all of them; after, at most the threshold plus the
    snapshot, however many were ever written."""
    folder = _folder(state)
    os.makedirs(folder)
    for i in range(1000):
        _write(folder, [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")])
    listed: list[int] = []
    real = storage.list_files

    def counting(uri, *a, **kw):
        out = real(uri, *a, **kw)
        listed.append(len(out))
        return out
    monkeypatch.setattr(M.storage, "list_files", counting)
    owner = _fresh(state)
    assert listed[-1] == 1000
    M.compact(state, "user", "u", max_files=64, grace_s=0)
    for round_ in range(5):
        for i in range(50):
            n = 1000 + 50 * round_ + i
            _write(folder, [_ev("ADD", f"user-u~m{n}", f"e{n}", f"fact {n}")])
        M.compact(state, "user", "u", max_files=64, grace_s=0)
        listed.clear()
        owner = M.read_log(state, owner)
        assert len(listed) == 1 and listed[0] <= 64 + 1, listed
        assert len(owner.files) <= 64
    assert len(owner.memories) == 1250


# --------------------------------------------------------------------------- recovery
def test_recovery_of_a_dead_journal_does_not_write_again_what_a_snapshot_holds(state):
    """A dead process's journal segment holds 20 events that reached event files, were folded into a snapshot
    and whose files were removed, and one that never reached a file. Recovery writes the one only."""
    folder = _folder(state)
    os.makedirs(folder)
    events = [_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}") for i in range(20)]
    for ev in events:
        _write(folder, [ev])
    assert M.compact(state, "user", "u", max_files=4, grace_s=0)["removed"] == 20
    lost = _ev("UPDATE", "user-u~m3", "e-lost", "fact 3, changed", old_memory="fact 3")
    wal = os.path.join(state, "mem0", M.WAL)
    os.makedirs(wal)
    with open(os.path.join(wal, f"{time.time_ns():020d}-1-deadbeef.log"), "w") as f:
        for ev in events + [lost]:
            f.write(json.dumps({"f": "user-u", "d": [ev]}) + "\n")
    c = M.Committer(state)
    c.start()
    assert c.recovered == 1
    got = _fresh(state)
    assert got.memories["user-u~m3"]["memory"] == "fact 3, changed"
    assert [h["event"] for h in got.history["user-u~m3"]] == ["ADD", "UPDATE"]
    assert all(len(got.history[f"user-u~m{i}"]) == 1 for i in range(20) if i != 3)


# --------------------------------------------------------------------------- S3
def test_on_s3_one_compactor_wins_a_generation_and_readers_follow(s3_root):
    """On S3 a snapshot is created with a conditional PUT (If-None-Match): of two compactors that folded the
    same generation, one publishes; the other's attempt changes nothing. Readers see every memory."""
    prefix = storage.join(s3_root, "mem0", "user-u")
    for i in range(12):
        storage.write_atomic(storage.join(prefix, M.event_name()),
                             json.dumps([_ev("ADD", f"user-u~m{i}", f"e{i}", f"fact {i}")]).encode())
    held = M.read_log(s3_root, M.Owner("user", "u"))
    first = M.compact(s3_root, "user", "u", max_files=4, grace_s=3600)
    assert first["snapshot"] == "snap-0000000001.json" and first["removed"] == 0
    data = storage.read_bytes(storage.join(prefix, first["snapshot"]))
    assert not M._publish(prefix, first["snapshot"], data + b" ", None, 3600), "the generation is taken"
    assert storage.read_bytes(storage.join(prefix, first["snapshot"])) == data
    assert len(M.read_log(s3_root, held).memories) == 12
    assert len(M.compact(s3_root, "user", "u", max_files=4, grace_s=0)["snapshot"] or "") == 0
    assert [n for n in storage.list_files(prefix, recursive=False)] == [first["snapshot"]]
    assert len(M.read_log(s3_root, M.Owner("user", "u")).memories) == 12


# --------------------------------------------------------------------------- the micro-benchmark
def test_the_reread_benchmark_prints_its_table():
    """``benchmarks/bench_owner_copy.py --reread N`` (the numbers of issue 46's compaction), on a small owner."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_owner_copy.py"), "--reread", "300",
                        "--repeat", "1", "--compact-files", "16"], check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| re-read of an owner of 300 events") and len(rows) == 4, p.stdout
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| nothing new", "| one new event file",
                                                      "| from scratch (a restart, a new replica)"], rows
    assert "303 event files folded" in p.stdout and "303 removed" in p.stdout, p.stdout   # 300 and 3 added before
    assert "the next compaction (the snapshot and 17 new files)" in p.stdout, p.stdout


def test_a_failed_compaction_logs_no_credential(monkeypatch, caplog):
    """A compaction that fails logs one warning and keeps the log; the error's text can hold the state's URI
    (an S3 endpoint with user:password@): that never reaches the log."""
    import asyncio
    import logging
    import types

    secret = "s3cr3t-pass-8842"

    def boom(*a, **k):
        raise storage.StorageError(f"http://minio:{secret}@10.0.0.5:9000/state/mem0/user-x: connection reset")

    monkeypatch.setattr(M, "compact", boom)
    api = M.Mem0API(types.SimpleNamespace(_need_state=lambda: "/tmp/unused-state"))
    with caplog.at_level(logging.WARNING, logger=M.log.name):
        asyncio.run(api._compact(("user", "x"), 4, 60.0))
    text = caplog.text
    assert "compaction failed" in text and secret not in text
    assert api._compact_after[("user", "x")] > time.monotonic()


def test_compact_backlog_folds_each_owner_over_the_limit_at_start(tmp_path):
    """A replica's start (``memory_compact_at_start``): every owner with more than ``max_files`` event files is
    folded, one at or under it only listed, a folder that is no owner's ignored; what each owner holds is what
    its log held; a second pass folds nothing; a state with no mem0 folder yet lists no owner, without error."""
    state = str(tmp_path / "state")
    assert M.compact_backlog(state, 4, 0)["owners"] == 0
    big, small = os.path.join(state, "mem0", "user-big"), os.path.join(state, "mem0", "user-small")
    for i in range(9):
        _write(big, [_ev("ADD", f"user-big~m{i}", f"b{i}", f"fact {i}")])
    for i in range(3):
        _write(small, [_ev("ADD", f"user-small~m{i}", f"s{i}", f"fact {i}")])
    os.makedirs(os.path.join(state, "mem0", "not an owner"))
    before = {o: _state(M.read_log(state, M.Owner("user", o))) for o in ("big", "small")}
    seen = []
    r = M.compact_backlog(state, 4, 0, progress=lambda d, t: seen.append((d, t)))
    assert (r["owners"], r["folded_owners"], r["folded_files"], r["failed"]) == (2, 1, 9, 0), r
    assert seen == [(1, 2), (2, 2)]
    assert any(n.startswith("snap-") for n in os.listdir(big))
    assert not any(n.startswith("snap-") for n in os.listdir(small))
    assert {o: _state(M.read_log(state, M.Owner("user", o))) for o in ("big", "small")} == before
    assert M.compact_backlog(state, 4, 0)["folded_owners"] == 0
    assert M.compact_backlog(state, 0, 0) == {"owners": 0, "folded_owners": 0, "folded_files": 0, "failed": 0,
                                              "seconds": 0.0}


def test_the_benchmarks_never_compacted_state_reads_as_its_adds(tmp_path):
    """``benchmarks/mem0_state.py`` (the start-up benchmark's input): each owner's log reads back as every ADD it
    wrote, all distinct; a folder name that is no owner's is one line, exit 2, nothing written."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import mem0_state

    state = str(tmp_path / "state")
    r = mem0_state.make(state, ["user-mixed-0", "agent-a1"], files=5, events=3)
    assert (r["owners"], r["files"], r["memories"]) == (2, 10, 30)
    for kind, oid in (("user", "mixed-0"), ("agent", "a1")):
        o = M.read_log(state, M.Owner(kind, oid))
        assert len(o.memories) == 15 and len({m["memory"] for m in o.memories.values()}) == 15
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mem0_state.py"), "--state", str(tmp_path / "x"),
                        "--owners", "nobody", "--files", "1"], capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()
