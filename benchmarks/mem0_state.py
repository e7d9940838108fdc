"""A mem0 state never compacted, for the service's start-up and load benchmarks (issue 46): ``--owners`` users,
each with ``--files`` event files of ``--events`` ADD events, as a service with ``memory_compact_files=0`` leaves
them after many runs of ``bench_serve.py --writes`` (whose writers during the searches are the users ``mixed-0`` ..
``mixed-7``: the default owners here). The texts are the bench writers' (12 words of a small vocabulary, numbered),
so no two are the same. Deterministic given ``--seed`` apart from the file names' time stamps.

    .venv/bin/python benchmarks/mem0_state.py --state /tmp/sb/state --files 20000 --events 3
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memsifter.service import mem0 as M  # noqa: E402

WORDS = "trip cat garden piano nurse Lisbon tea bike sister novel coffee museum train recipe".split()


def make(state: str, owners: list[str], files: int, events: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    t0, n = time.time(), 0
    for owner in owners:
        kind, _, oid = owner.partition("-")
        folder = os.path.join(state, M.ROOT, owner)
        os.makedirs(folder, exist_ok=True)
        for f in range(files):
            evs = []
            for _ in range(events):
                n += 1
                text = f"note {n} of {oid}: " + " ".join(rng.choice(WORDS) for _ in range(12))
                evs.append({"event": "ADD", "id": f"{owner}~{uuid.UUID(int=rng.getrandbits(128)).hex}",
                            "memory": text, "hash": M.text_hash(text), "metadata": None, "user_id": oid,
                            "agent_id": None, "run_id": None, "role": "user",
                            "at": f"2026-11-27T00:{f // 3600 % 60:02d}:{f // 60 % 60:02d}",
                            "eid": uuid.UUID(int=rng.getrandbits(128)).hex})
            with open(os.path.join(folder, M.event_name()), "w") as fh:   # no fsync: a benchmark's input
                json.dump(evs, fh)
    size = sum(p.stat().st_size for p in Path(state, M.ROOT).rglob("*") if p.is_file())
    return {"owners": len(owners), "files": files * len(owners), "memories": n, "bytes": size,
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", required=True)
    ap.add_argument("--owners", default=",".join(f"user-mixed-{i}" for i in range(8)))
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--events", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    owners = [o for o in a.owners.split(",") if o]
    bad = [o for o in owners if not M._owner_dir(o)]
    if bad:
        print(f"mem0_state: not an owner's folder name (KIND-ID): {bad[0]!r}", file=sys.stderr)
        return 2
    print(json.dumps(make(a.state, owners, a.files, a.events, a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
