#!/usr/bin/env python3
"""The copy of a memory owner that every read after a write makes (issue 46), against the copy before 41861a6,
in one run: the owner's containers only (records shared until changed) vs every record and history list copied.

    .venv/bin/python benchmarks/bench_owner_copy.py [--memories 1000,10000,44000] [--repeat 20]
    .venv/bin/python benchmarks/bench_owner_copy.py --profile FILE   # a py-spy raw profile: shares of top frames
    .venv/bin/python benchmarks/bench_owner_copy.py --reread 40000   # a re-read of an owner's log, before/after folding

The second form summarises a ``py-spy record -f raw`` file of a ``memsifter serve`` process: each function's share
of the samples whose stack holds it (the committed profile of the service under adds and searches:
``benchmarks/results/owner-copy-2026-11-27/``).

The third times ``read_log`` on an owner of N events, one event file each (the shape of the profiled state: one
file per owner and journal pass), in a temp folder on local disk: the log as it was before snapshots (``read_log``
before issue 46's compaction, kept below as the baseline) against the same log folded by ``mem0.compact`` (the
folded files removed). Rows: a re-read that finds nothing new and one that finds one new event file (a replica
every ``memory_refresh_s``; each the median of 3 rounds of the mean of --repeat reads), and a reader from scratch
(a restart or a new replica; one read each). The compaction's own time and the snapshot's size are printed after.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def deep_copy(o):
    """The copy before 41861a6: every record and history list copied (the baseline)."""
    from memsifter.service.mem0 import Owner

    return Owner(o.kind, o.oid, list(o.files), {k: dict(v) for k, v in o.memories.items()},
                 {k: list(v) for k, v in o.history.items()}, o.checked_at, o.version, seen=set(o.seen),
                 by_key=dict(o.by_key))


def owner(n: int):
    from memsifter.service.mem0 import Owner

    o = Owner("user", "u")
    for i in range(n):
        o.apply({"id": f"m{i}", "event": "ADD", "memory": f"memory text {i}", "hash": f"h{i}", "metadata": {"i": i},
                 "user_id": "u", "agent_id": None, "run_id": None, "role": "user", "at": "2026-11-27", "eid": f"e{i}"})
    return o


def read_log_before(state: str, owner):
    """``read_log`` before snapshots (the baseline): every event file listed and sorted on each re-read."""
    import json

    from memsifter.service.mem0 import Owner, owner_prefix
    from memsifter.store import storage

    prefix = owner_prefix(state, owner.kind, owner.oid)
    names = sorted(n for n in storage.list_files(prefix, recursive=False)
                   if n.startswith("ev-") and n.endswith(".json"))
    if names[:len(owner.files)] != owner.files:
        owner = Owner(owner.kind, owner.oid)
    elif len(names) > len(owner.files):
        owner = owner.copy()
    for name in names[len(owner.files):]:
        for ev in json.loads(storage.read_text(storage.join(prefix, name))):
            owner.apply(ev)
        owner.files.append(name)
    owner.checked_at = time.time()
    return owner


def _event(i: int) -> dict:
    return {"id": f"user-u~m{i}", "event": "ADD", "memory": f"memory text {i}", "hash": f"h{i}", "metadata": {"i": i},
            "user_id": "u", "agent_id": None, "run_id": None, "role": "user", "at": "2026-12-01", "eid": f"e{i}"}


def reread(n: int, repeat: int, max_files: int) -> None:
    """The table of the third form for an owner of ``n`` events."""
    import json
    import shutil
    import statistics
    import tempfile

    from memsifter.service import mem0 as M

    root = tempfile.mkdtemp(prefix="bench-reread-")
    try:
        state = os.path.join(root, "state")
        folder = os.path.join(state, M.ROOT, "user-u")
        os.makedirs(folder)
        for i in range(n):
            M._write_local(os.path.join(folder, M.event_name()), json.dumps([_event(i)]).encode())
        extra = iter(range(n, n + 10 * repeat + max_files + 10))

        def add_one() -> None:
            i = next(extra)
            M._write_local(os.path.join(folder, M.event_name()), json.dumps([_event(i)]).encode())

        def rounds(read, owner) -> tuple[float, float]:
            """(nothing new, one new file): each the median of 3 rounds of the mean of ``repeat`` reads, ms."""
            same, new = [], []
            owner = read(state, owner)
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(repeat):
                    owner = read(state, owner)
                same.append((time.perf_counter() - t) / repeat * 1000)
                spent = 0.0
                for _ in range(repeat):
                    add_one()
                    t = time.perf_counter()
                    owner = read(state, owner)
                    spent += time.perf_counter() - t
                new.append(spent / repeat * 1000)
            return statistics.median(same), statistics.median(new)

        t = time.perf_counter()
        fresh_before = read_log_before(state, M.Owner("user", "u"))
        scratch_before = (time.perf_counter() - t) * 1000
        same_before, new_before = rounds(read_log_before, fresh_before)
        t = time.perf_counter()
        out = M.compact(state, "user", "u", max_files=max_files, grace_s=0)
        compact_s = time.perf_counter() - t
        snap = os.path.getsize(os.path.join(folder, out["snapshot"]))
        t = time.perf_counter()
        fresh_after = M.read_log(state, M.Owner("user", "u"))
        scratch_after = (time.perf_counter() - t) * 1000
        same_after, new_after = rounds(M.read_log, fresh_after)
        left = len(os.listdir(folder))
        for _ in range(max_files + 1 - (left - 1)):   # the next compaction: the snapshot and max_files + 1 files
            add_one()
        t = time.perf_counter()
        later = M.compact(state, "user", "u", max_files=max_files, grace_s=0)
        later_s = time.perf_counter() - t
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"| re-read of an owner of {n:,} events | log, {n:,} event files (before) ms | folded, "
          f"{left} files left (after) ms | ratio |")
    print("|---|---:|---:|---:|")
    for what, b, a in (("nothing new", same_before, same_after), ("one new event file", new_before, new_after),
                       ("from scratch (a restart, a new replica)", scratch_before, scratch_after)):
        print(f"| {what} | {b:.2f} | {a:.2f} | {b / a:.1f}x |")
    print(f"\ncompaction: {out['folded']:,} event files folded in {compact_s:.2f} s, {out['removed']:,} removed; "
          f"snapshot {snap / 1e6:.1f} MB; memory_compact_files={max_files}; the next compaction (the snapshot and "
          f"{later['folded']} new files): {later_s:.2f} s")


def timed(fn, o, repeat: int) -> float:
    fn(o)  # warm
    t = time.perf_counter()
    for _ in range(repeat):
        fn(o)
    return (time.perf_counter() - t) / repeat * 1000


def profile(path: str, top: int = 12) -> None:
    import gzip

    total, share = 0, Counter()
    for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path)):
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        total += int(count)
        for name in {f.split(" (")[0] for f in stack.split(";")}:
            share[name] += int(count)
    print(f"{total} samples of {path}")
    for name in ("Owner.copy", "read_log", "Encoder.encode", "RequestResponseCycle.run_asgi"):
        print(f"{name}: {100 * share[name] / total:.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memories", default="1000,10000,44000")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--profile")
    ap.add_argument("--reread", type=int, help="events of the owner whose re-read is timed before/after folding")
    ap.add_argument("--compact-files", type=int, default=256, help="memory_compact_files of --reread")
    a = ap.parse_args()
    if a.profile:
        profile(a.profile)
        return
    if a.reread:
        reread(a.reread, a.repeat, a.compact_files)
        return
    print("| memories | every record copied (before) ms | containers only (now) ms | ratio |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in a.memories.split(",")):
        o = owner(n)
        # interleaved, so that both see the same machine state
        before, now = [], []
        for _ in range(3):
            before.append(timed(deep_copy, o, a.repeat))
            now.append(timed(lambda x: x.copy(), o, a.repeat))
        b, c = sorted(before)[1], sorted(now)[1]   # the median of 3 interleaved rounds, each a mean of --repeat
        print(f"| {n:,} | {b:.2f} | {c:.2f} | {b / c:.1f}x |")


if __name__ == "__main__":
    main()
