#!/usr/bin/env python3
"""The copy of a memory owner that every read after a write makes (issue 46), against the copy before 41861a6,
in one run: the owner's containers only (records shared until changed) vs every record and history list copied.

    .venv/bin/python benchmarks/bench_owner_copy.py [--memories 1000,10000,44000] [--repeat 20]
    .venv/bin/python benchmarks/bench_owner_copy.py --profile FILE   # a py-spy raw profile: shares of top frames

The second form summarises a ``py-spy record -f raw`` file of a ``memsifter serve`` process: each function's share
of the samples whose stack holds it (the committed profile of the service under adds and searches:
``benchmarks/results/owner-copy-2026-11-27/``).
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
    a = ap.parse_args()
    if a.profile:
        profile(a.profile)
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
