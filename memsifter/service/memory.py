"""User memories: sessions appended by ``POST /memories``, persisted so that a restart keeps them.

Layout, under the service's ``state`` URI (local dir or ``s3://``)::

    <state>/memories/<user_id>/seg-<time_ns>-<uuid>.parquet    one per append that added sessions

A segment is written whole in one atomic write (:func:`memsifter.store.storage.write_atomic`: temp file +
rename locally, one PUT on S3) before the append is acknowledged, and never changed after. A user's
memory is the union of their segments in name order (time, then a random tie-break), each session id
kept once (the first occurrence): segments need no coordination between writers, so two replicas, or
a client that retries, can never lose a session, and a session id sent twice is stored once. Appends of
one user within a replica are serialised (an asyncio lock), so the duplicate check sees every earlier
append; across replicas the read-side de-duplication covers the race. ``DELETE`` removes the prefix.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import pyarrow as pa

from ..store import storage
from ..data.model import SESSION_SCHEMA, Session

MEMORIES = "memories"


def user_prefix(state: str, user_id: str) -> str:
    return storage.join(state, MEMORIES, user_id)


@dataclass
class UserMemory:
    """A user's sessions in append order, and the segments they came from."""

    user_id: str
    sessions: list[Session] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    checked_at: float = 0.0

    def ids(self) -> set[str]:
        return {s.session_id for s in self.sessions}


def read_segments(state: str, user_id: str, known: UserMemory | None = None) -> UserMemory:
    """The user's memory from the store: ``known`` plus the segments it has not read (blocking)."""
    prefix = user_prefix(state, user_id)
    names = sorted(n for n in storage.list_files(prefix, recursive=False)
                   if n.startswith("seg-") and n.endswith(".parquet"))
    mem = UserMemory(user_id, list(known.sessions), list(known.segments)) if known else UserMemory(user_id)
    if known and names[:len(known.segments)] != known.segments:   # deleted and re-created meanwhile
        mem = UserMemory(user_id)
    seen = mem.ids()
    for name in names[len(mem.segments):]:
        rows = storage.read_parquet(storage.join(prefix, name)).to_pylist()
        for r in rows:
            if r["session_id"] not in seen:
                seen.add(r["session_id"])
                mem.sessions.append(Session(r["session_id"], r["turns"], r["date"], r["content_hash"]))
        mem.segments.append(name)
    mem.checked_at = time.time()
    return mem


def write_segment(state: str, user_id: str, sessions: list[Session]) -> str:
    """Persist ``sessions`` as one new segment (atomic); returns its name."""
    name = f"seg-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.parquet"
    table = pa.table({"session_id": [s.session_id for s in sessions],
                      "content_hash": [s.content_hash for s in sessions],
                      "date": [s.date for s in sessions],
                      "turns": [[{"role": t["role"], "content": t["content"]} for t in s.turns] for s in sessions]},
                     schema=SESSION_SCHEMA)
    storage.write_atomic(storage.join(user_prefix(state, user_id), name), storage.parquet_bytes(table))
    return name


def delete_user(state: str, user_id: str) -> None:
    storage.delete(user_prefix(state, user_id))
