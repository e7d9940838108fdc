"""A mem0-compatible memory API beside the native one, on the same state store and first stage (issue 46).

A mem0 client points its base URL at ``<service>/mem0``: ``POST /memories`` (``messages`` with
``user_id`` / ``agent_id`` / ``run_id`` and ``metadata``), ``GET /memories`` (list), ``GET|PUT|DELETE
/memories/{memory_id}``, ``GET /memories/{memory_id}/history``, ``DELETE /memories`` (all of an owner),
``POST /search`` (``filters``, ``limit``, ``threshold``) and ``POST /reset`` (an owner's memories and
history). Each message is one memory, stored as sent; with ``extract`` configured, an add asks an LLM for
the facts in the messages and what they do to the stored memories instead (:mod:`memsifter.service.extract`).

Owner and tenancy. A memory belongs to its ``user_id``, else its ``agent_id``, else its ``run_id`` (the
*owner*); an API key's grant is checked against the owner's id (read: list, get, history, search; write:
add, update, delete, reset). A memory id names its owner (``<kind>-<owner>~<random>``), so that a get or
a delete by id is authorised before anything is read.

Storage, under ``<state>/mem0/<kind>-<owner>/``: an append-only log of event files
(``ev-<time_ns>-<random>.json``, each an atomic write). An add, update or delete is durable and searchable
when its answer arrives: the writes that arrive together are committed together (:class:`Committer`: on a
local disk one journal append and one ``fdatasync`` per batch, the event files written after; on S3 the
batch's objects PUT in parallel). The owner's memories are the log replayed in name order: ``ADD``
(ignored when a memory of the same content and scope exists: the same content twice is one memory, also
when two replicas race), ``UPDATE`` (the text replaced; the old one stays in the history) and ``DELETE``;
an event read twice (its ``eid`` seen) changes nothing. ``POST /reset`` removes the owner's folder.

Snapshots (compaction). A re-read lists the owner's folder; to keep that O(recent events) rather than O(every
event ever), the log is folded: once more than ``memory_compact_files`` event files follow the newest snapshot
(:func:`compact`, started in the background by a read), the newest snapshot's state plus those files replayed
in name order is written as ``snap-<generation>.json`` (a header line: generation, a random id, the snapshot it
was folded on, the names of the event files it holds, grouped by the generation that folded them, and its
last generations; then the memories, histories, eids applied, index by content and version), and the folded
files and older snapshots are removed later (the *sweep*). A reader starts from the newest snapshot, skips
the files it names and applies the others in name order (:func:`read_log`); a reader that already holds
exactly what the snapshot folded moves to it without loading its state (it parses the header only). Why
nothing is lost or applied twice:

* Exact: a snapshot is the replay of its base and the files it names, as a reader would do it; the eids it
  applied go with it, so an event file read again (a journal recovered after its file was written, or folded
  and still listed) changes nothing. Recovery counts a snapshot's eids as written (:func:`_logged_eids`).
* One line: generation ``g + 1`` is created only on top of generation ``g`` and only if no file of its name
  exists (locally a fsync'd temp file ``link(2)``-ed to the name, on S3 a PUT with ``If-None-Match: *``): of
  compactors racing on the same base one publishes, the others remove nothing. So every snapshot holds every
  older one, and the newest holds everything any snapshot ever folded.
* Only what is folded goes: an event file is removed only if the snapshot that names it (or a newer one) was
  published; a file that was not in a compactor's listing -- written meanwhile, or named with an earlier time
  by another replica's clock or a slow PUT -- is not named, so readers apply it after the snapshot: file names
  order the replay, but a snapshot never claims a range of names.
* Listings are not atomic (a listing under way may miss a file created or removed meanwhile), so removal waits:
  the files a generation folded, and the snapshots older than it, are removed only once this process has seen
  that generation (or a newer one of the same line) for ``memory_compact_grace_s`` (60 s; monotonic clock, no
  clock is compared across replicas). A listing shorter than that which misses a removed file therefore shows
  a snapshot that holds it (one present since before the listing began is removed only a grace after its
  successor appeared). A file or snapshot removed between a listing and its read makes the reader list again.
* Crashes: a snapshot's temp file is never listed as one (readers ignore it; a compaction removes one older
  than 10 minutes); a snapshot is on disk before its name is; a compactor that dies after publishing leaves
  the files it folded, which readers skip and the next sweep removes.
* Resets: a compaction publishes only while the snapshot it was folded on (or the first file it folded) is
  still there; locally its temp file lives in the owner's folder, so a reset that removes the folder makes the
  publish fail, and the reset removes the folder again if a snapshot landed in it meanwhile. In this process
  a reset waits for a compaction under way. On S3 a reset on another replica that lands between a compaction's
  check and its PUT is seen after the PUT and the snapshot removed again; a read in those milliseconds may
  still see the memories the reset removed (as a replica's cache may for ``memory_refresh_s`` after any reset
  on another replica).

Search: the owner's memories as a corpus (one session of one turn per memory), scored by the service's
first stage (the embed stage's method: BM25 views and the dense leg); ``filters`` then apply (``AND`` /
``OR`` / ``NOT`` lists; a field's value, ``"*"`` for present, or operators ``eq ne gt gte lt lte in nin
contains icontains``; fields ``id`` / ``ids``, ``user_id``, ``agent_id``, ``run_id``, ``role``,
``created_at``, ``updated_at``, ``memory``, ``metadata`` (a mapping) or any other name: a metadata key),
then ``threshold`` (on the first stage's score) and ``limit``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..data.model import Session
from ..store import storage
from .auth import Principal
from .config import ID_RE
from .core import ApiError
from .index import DENSE_METHODS, Corpus, build_lexical

log = logging.getLogger("memsifter.service")

ROOT = "mem0"
EID_PREFIX = uuid.uuid4().hex[:16]   # events' ids: this process's random prefix and a counter
_eids = itertools.count(1)
KINDS = ("user", "agent", "run")
OPS = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains", "icontains")


class Mem0Error(ApiError):
    """A 4xx of this API (answered as every route's: ``{"detail": ...}``)."""


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def text_hash(text: str) -> str:
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def owner_of(user_id: str | None, agent_id: str | None, run_id: str | None) -> tuple[str, str]:
    """(kind, id) of the owner: the user, else the agent, else the run; a 422 without any."""
    for kind, v in zip(KINDS, (user_id, agent_id, run_id)):
        if v:
            if not ID_RE.match(v):
                raise Mem0Error(422, f"{kind}_id: not a valid id (letters, digits and _.:@+=-, at most 200)")
            return kind, v
    raise Mem0Error(422, "one of user_id, agent_id or run_id is required")


def owner_of_memory(memory_id: str) -> tuple[str, str]:
    key, sep, rest = memory_id.partition("~")
    kind, _, oid = key.partition("-")
    if not sep or kind not in KINDS or not ID_RE.match(oid or "") or not rest.isalnum():
        raise Mem0Error(404, f"no memory '{memory_id[:80]}'")
    return kind, oid


@dataclass
class Owner:
    """One owner's memories (the log replayed) and each memory's history."""

    kind: str
    oid: str
    files: list[str] = field(default_factory=list)
    memories: dict[str, dict] = field(default_factory=dict)
    history: dict[str, list[dict]] = field(default_factory=dict)
    checked_at: float = 0.0
    version: int = 0
    corpus: Corpus | None = None
    corpus_version: int = -1
    seen: set = field(default_factory=set)   # eids applied (an event file read again changes nothing)
    by_key: dict = field(default_factory=dict)   # scope_hash -> a memory id (find_same without a scan)
    # the snapshot this state starts from ("": none; ``files`` are the event files applied after it), its id,
    # the event files it folded (skipped when listed), when this process first saw it (time.monotonic) and
    # how many folded files and older snapshots the last listing still showed (removed by the next sweep)
    base: str = ""
    base_id: str = ""
    skip: frozenset = frozenset()
    based_at: float = 0.0
    litter: int = 0

    def __post_init__(self) -> None:
        if self.memories and not self.by_key:
            for mid, m in self.memories.items():
                self.by_key.setdefault(self.scope_hash(m), mid)

    def copy(self) -> "Owner":
        """A copy to change beside this one, while readers keep using this one. Its containers are new; the
        memory records and history lists inside are shared until :meth:`apply` changes one, which replaces it
        first (copy on write): a copy costs the containers only, not every record (237 ms for 44,000 memories
        when each record was copied, and every read after a write copied)."""
        return Owner(self.kind, self.oid, list(self.files), dict(self.memories), dict(self.history),
                     self.checked_at, self.version, seen=set(self.seen), by_key=dict(self.by_key), base=self.base,
                     base_id=self.base_id, skip=self.skip, based_at=self.based_at, litter=self.litter)

    @classmethod
    def from_snapshot(cls, kind: str, oid: str, name: str, head: dict, body: dict, based_at: float) -> "Owner":
        """The state a snapshot holds (:func:`compact`): the memories, histories, eids and index by content of
        the log it folded, as the replay left them."""
        return cls(kind, oid, [], body["memories"], body["history"], 0.0, int(body["version"]),
                   seen=set(body["seen"]), by_key={tuple(k[:4]): k[4] for k in body["by_key"]}, base=name,
                   base_id=str(head["id"]), skip=_folded(head), based_at=based_at)

    @property
    def prefix_key(self) -> str:
        return f"{self.kind}-{self.oid}"

    def scope_hash(self, rec: dict) -> tuple:
        return (rec.get("agent_id"), rec.get("run_id"), rec.get("user_id"), rec["hash"])

    def find_same(self, rec: dict) -> dict | None:
        mid = self.by_key.get(self.scope_hash(rec))
        return self.memories.get(mid) if mid is not None else None

    def _unindex(self, m: dict) -> None:
        key = self.scope_hash(m)
        if self.by_key.get(key) == m["id"]:
            del self.by_key[key]
            for other in self.memories.values():   # another memory of the same content (after an UPDATE)
                if other is not m and self.scope_hash(other) == key:
                    self.by_key[key] = other["id"]
                    break

    def apply(self, ev: dict) -> bool:
        """Replay one event; False when it changes nothing (an ADD of content already there, an event
        applied before)."""
        mid, kind = ev["id"], ev["event"]
        eid = ev.get("eid")
        if eid is not None:
            if eid in self.seen:
                return False
            self.seen.add(eid)
        if kind == "ADD":
            if mid in self.memories or self.find_same(ev):
                return False
            self.memories[mid] = {k: ev.get(k) for k in ("id", "memory", "hash", "metadata", "user_id", "agent_id",
                                                         "run_id", "role")}
            self.memories[mid].update(created_at=ev["at"], updated_at=None)
            self.by_key[self.scope_hash(ev)] = mid
        elif kind == "UPDATE":
            m = self.memories.get(mid)
            if m is None:
                return False
            m = self.memories[mid] = dict(m)   # the record may be shared with the owner this one was copied from
            self._unindex(m)
            m.update(memory=ev["memory"], hash=ev["hash"], updated_at=ev["at"])
            if ev.get("metadata") is not None:
                m["metadata"] = ev["metadata"]
            self.by_key.setdefault(self.scope_hash(m), mid)
        elif kind == "DELETE":
            m = self.memories.pop(mid, None)
            if m is None:
                return False
            self._unindex(m)
        self.version += 1
        h = self.history[mid] = list(self.history.get(mid, ()))   # shared with the owner copied from: replaced
        h.append({"id": f"{mid}.{len(h) + 1}", "memory_id": mid, "old_memory": ev.get("old_memory"),
                  "new_memory": ev.get("memory") if kind != "DELETE" else None, "event": kind,
                  "created_at": ev["at"], "updated_at": ev["at"] if kind != "ADD" else None,
                  "is_deleted": kind == "DELETE", "role": ev.get("role")})
        return True


def owner_prefix(state: str, kind: str, oid: str) -> str:
    return storage.join(state, ROOT, f"{kind}-{oid}")


def read_log(state: str, owner: Owner) -> Owner:
    """``owner`` with what the log holds that it has not applied (blocking): nothing read when nothing is new;
    the event files written since it was read, when its snapshot is still the newest (each read once); moved
    to a newer snapshot without reading it when the snapshot folded exactly the files ``owner`` applied after
    its own (fast-forward: a replica that kept up parses only the snapshot's header line); else the newest
    snapshot's state and the event files after it (a new one if the log was reset: no snapshot, files gone).
    A file listed but removed before it was read (a compaction's sweep) means the listing is old: listed again.
    """
    prefix = owner_prefix(state, owner.kind, owner.oid)
    for _ in range(READ_TRIES):
        try:
            return _read_log(prefix, owner)
        except _Gone:
            continue
    raise storage.StorageError(f"{prefix}: files kept being removed while they were read ({READ_TRIES} tries)")


def _read_log(prefix: str, owner: Owner) -> Owner:
    evs, snaps, _ = _list(prefix)
    newest = snaps[-1][1] if snaps else ""
    cur, data = owner, None

    def load() -> Owner:
        nonlocal data
        if not newest:
            return Owner(owner.kind, owner.oid)
        data = data or _read(prefix, newest)
        head, body = _parse_snapshot(data)
        return Owner.from_snapshot(owner.kind, owner.oid, newest, head, body,
                                  _observe(prefix, snaps[-1][0], str(head["id"])))
    if newest != owner.base:
        if newest:
            data = _read(prefix, newest)
            head, _ = _parse_snapshot(data, body=False)
            mine = head["folded"].get(str(snaps[-1][0]), [])
            if head.get("base") == owner.base and head.get("base_id") == owner.base_id and \
                    owner.files[:len(mine)] == mine:   # fast-forward: this state is the snapshot's, plus files after
                cur = owner.copy()
                cur.files = owner.files[len(mine):]
                cur.base, cur.base_id, cur.skip = newest, str(head["id"]), _folded(head)
                cur.based_at = _observe(prefix, snaps[-1][0], cur.base_id)
            else:
                cur = load()
        else:
            cur = load()   # the snapshots are gone: the owner was reset
    todo = [n for n in evs if n not in cur.skip]
    if todo[:len(cur.files)] != cur.files:   # a file appeared among those applied (a late one), or one went (reset)
        cur = load()
        todo = [n for n in evs if n not in cur.skip]
    elif len(todo) > len(cur.files) and cur is owner:
        cur = owner.copy()
    for name in todo[len(cur.files):]:
        for ev in json.loads(_read(prefix, name)):
            cur.apply(ev)
        cur.files.append(name)
    cur.litter = len(evs) - len(todo) + max(0, len(snaps) - 1)
    cur.checked_at = time.time()
    return cur


# --------------------------------------------------------------------------- snapshots (compaction)
SNAP_FORMAT = 1
COMPACT_FILES = 256       # ServeConfig.memory_compact_files: fold past this many event files after the snapshot
COMPACT_GRACE_S = 60.0    # ServeConfig.memory_compact_grace_s: what a snapshot folded is removed this long after
STALE_TMP_S = 600.0       # a snapshot's temp file older than this is a dead compactor's: removed
READ_TRIES = 8
CHAIN = 8                 # a snapshot names its last CHAIN generations (gen, id): its line since a reset
_SNAP = re.compile(r"^snap-(\d{10})\.json$")


class _Gone(Exception):
    """A file listed was removed before it was read."""


def snapshot_name(gen: int) -> str:
    return f"snap-{gen:010d}.json"


def _snapshot_gen(name: str) -> int:
    m = _SNAP.match(name) if name.startswith("snap-") else None
    return int(m.group(1)) if m else 0


def _is_event(name: str) -> bool:
    return name.startswith("ev-") and name.endswith(".json")


def _list(prefix: str) -> tuple[list[str], list[tuple[int, str]], list[str]]:
    """The owner's event files (sorted), snapshots ((generation, name), oldest first) and snapshot temp files."""
    names = storage.list_files(prefix, recursive=False)
    return (sorted(n for n in names if _is_event(n)),
            sorted((g, n) for n in names if (g := _snapshot_gen(n))),
            [n for n in names if n.startswith("snap-") and n.endswith(".tmp")])


def _read(prefix: str, name: str) -> bytes:
    try:
        return storage.read_bytes(storage.join(prefix, name))
    except storage.StorageError as e:
        if isinstance(e.__cause__, FileNotFoundError) or str(e).endswith(": not found"):
            raise _Gone(name) from e
        raise


def _parse_snapshot(data: bytes, body: bool = True) -> tuple[dict, dict | None]:
    """A snapshot's header (first line: generation, id, what it folded) and, with ``body``, its state."""
    head_raw, _, rest = data.partition(b"\n")
    head = json.loads(head_raw)
    if not isinstance(head, dict) or head.get("format") != SNAP_FORMAT or not isinstance(head.get("folded"), dict):
        raise ValueError(f"not a mem0 snapshot (format {SNAP_FORMAT})")
    return head, (json.loads(rest) if body else None)


def _folded(head: dict) -> frozenset:
    return frozenset(n for names in head["folded"].values() for n in names)


def _snapshot_bytes(owner: Owner, head: dict) -> bytes:
    body = {"memories": owner.memories, "history": owner.history, "seen": list(owner.seen),
            "by_key": [[*k, mid] for k, mid in owner.by_key.items()], "version": owner.version}
    return json.dumps(head).encode("utf-8") + b"\n" + json.dumps(body).encode("utf-8")


# owner prefix -> [(generation, snapshot id, when this process first saw it: time.monotonic())]
_observed: dict[str, list[tuple[int, str, float]]] = {}
_observed_lock = threading.Lock()


def _observe(prefix: str, gen: int, sid: str) -> float:
    """When this process first saw the owner's snapshot ``(gen, sid)`` (now, if this is the first time). A
    generation not above those seen, under another id, is a new line (the owner was reset): the old is
    forgotten."""
    now_ = time.monotonic()
    with _observed_lock:
        seen = _observed.setdefault(prefix, [])
        for g, i, t in seen:
            if g == gen and i == sid:
                return t
        if any(g >= gen for g, _, _ in seen):
            seen.clear()
        seen.append((gen, sid, now_))
        del seen[:-CHAIN]
        return now_


def _ripe(prefix: str, chain: list, grace_s: float) -> int:
    """The newest generation of this line (``chain``: a snapshot's last generations and ids) that this process
    saw at least ``grace_s`` ago; 0 if none."""
    line = {(int(g), str(i)) for g, i in chain}
    now_ = time.monotonic()
    with _observed_lock:
        return max((g for g, i, t in _observed.get(prefix, ()) if (g, i) in line and now_ - t >= grace_s), default=0)


def compact(state: str, kind: str, oid: str, max_files: int = COMPACT_FILES,
            grace_s: float = COMPACT_GRACE_S) -> dict:
    """Fold the owner's log into a snapshot when more than ``max_files`` event files follow the newest one
    (0: never), then sweep: remove the event files and older snapshots that a snapshot this process saw at
    least ``grace_s`` ago holds (blocking; see *Snapshots* in the module's docstring for why this is safe).
    Returns ``{"snapshot": the name published or None, "folded": event files folded, "removed": files removed}``.
    """
    prefix = owner_prefix(state, kind, oid)
    out: dict[str, Any] = {"snapshot": None, "folded": 0, "removed": 0}
    for _ in range(3):
        try:
            _compact(prefix, kind, oid, max_files, grace_s, out)
            break
        except _Gone:   # swept by another compactor while read: what it published is newer
            continue
    return out


def compact_backlog(state: str, max_files: int = COMPACT_FILES, grace_s: float = COMPACT_GRACE_S,
                    stop: threading.Event | None = None, progress: Any = None) -> dict:
    """Fold, at a replica's start, every owner whose log has more than ``max_files`` event files (blocking):
    what :meth:`Mem0API._maintain` would otherwise start on the first read of each such owner, while the
    replica serves. A state never folded (written before compaction existed, or with ``memory_compact_files=0``)
    then costs its start-up, not its first minutes of traffic. An owner with few files is only listed; one that
    fails is left to the background path (logged, never raised: the replica serves its log as it is).
    ``progress(done, total)`` is called after each owner. Returns owners listed, folded, event files folded and
    seconds."""
    t0 = time.time()
    out = {"owners": 0, "folded_owners": 0, "folded_files": 0, "failed": 0, "seconds": 0.0}
    if not max_files:
        return out
    root = storage.join(state, ROOT)
    owners = [d for d in storage.list_dirs(root) if _owner_dir(d)]   # none (no error) before the first write
    out["owners"] = len(owners)
    for i, d in enumerate(owners):
        if stop is not None and stop.is_set():
            break
        kind, _, oid = d.partition("-")
        try:
            events, _, _ = _list(owner_prefix(state, kind, oid))
            if len(events) > max_files:
                r = compact(state, kind, oid, max_files, grace_s)
                if r["snapshot"]:
                    out["folded_owners"] += 1
                    out["folded_files"] += r["folded"]
        except Exception as e:  # noqa: BLE001 - the background path tries again on the owner's first read
            out["failed"] += 1
            from ..security.redact import redact

            log.warning("mem0: %s: folding its log at start failed (left to the background): %s: %s", d,
                        type(e).__name__, redact(str(e)))
        if progress is not None:
            progress(i + 1, len(owners))
    out["seconds"] = round(time.time() - t0, 3)
    return out


def _compact(prefix: str, kind: str, oid: str, max_files: int, grace_s: float, out: dict) -> None:
    evs, snaps, tmps = _list(prefix)
    gen, base = snaps[-1] if snaps else (0, "")
    data = _read(prefix, base) if base else None
    head: dict = _parse_snapshot(data, body=False)[0] if data else {"id": "", "folded": {}, "chain": []}
    if base:
        _observe(prefix, gen, str(head["id"]))
    folded = {g: list(names) for g, names in head["folded"].items()}
    skip = _folded(head) if base else frozenset()
    todo = [n for n in evs if n not in skip]
    chain = list(head.get("chain") or [])
    if max_files and len(todo) > max_files:
        owner = Owner.from_snapshot(kind, oid, base, head, _parse_snapshot(data)[1], 0.0) if data else Owner(kind, oid)
        for name in todo:
            for ev in json.loads(_read(prefix, name)):
                owner.apply(ev)
        sid, present = uuid.uuid4().hex, set(evs)
        kept = {g: [n for n in names if n in present] for g, names in folded.items()}
        new_folded = {g: names for g, names in kept.items() if names}
        new_folded[str(gen + 1)] = todo
        new_chain = (chain + [[gen + 1, sid]])[-CHAIN:]
        new_head = {"format": SNAP_FORMAT, "gen": gen + 1, "id": sid, "base": base, "base_id": head["id"],
                    "folded": new_folded, "chain": new_chain, "memories": len(owner.memories),
                    "events": len(owner.seen), "at": now()}
        name = snapshot_name(gen + 1)
        if not _publish(prefix, name, _snapshot_bytes(owner, new_head), base or todo[0], grace_s):
            return   # another compactor published this generation (it sweeps), or the owner was reset
        _observe(prefix, gen + 1, sid)
        out.update(snapshot=name, folded=len(todo))
        snaps.append((gen + 1, name))
        folded, chain = new_folded, new_chain
    ripe = _ripe(prefix, chain, grace_s) if chain else 0
    doomed = [n for g, names in folded.items() if int(g) <= ripe for n in names] if ripe else []
    doomed += [n for g, n in snaps if g < ripe]
    if tmps and not storage.is_s3(prefix):
        folder = storage.resolve(prefix)[1]
        for n in tmps:
            try:
                if time.time() - os.stat(os.path.join(folder, n)).st_mtime > STALE_TMP_S:
                    doomed.append(n)
            except FileNotFoundError:
                pass
    present = set(evs) | {n for _, n in snaps} | set(tmps)
    for n in doomed:
        if n in present and _remove(prefix, n):
            out["removed"] += 1


def _remove(prefix: str, name: str) -> bool:
    """One file of the owner's folder removed; False if it was gone (another compactor's sweep)."""
    uri = storage.join(prefix, name)
    if storage.is_s3(prefix):
        storage.delete(uri)
        return True
    path = storage.resolve(uri)[1]
    storage.check_no_symlink(path)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _publish(prefix: str, name: str, data: bytes, evidence: str | None, grace_s: float) -> bool:
    """Create the snapshot ``name`` only if no file of that name exists (the generation is one compactor's)
    and ``evidence`` (the snapshot it was folded on, else the first event file it folded) is still there (no
    reset removed the folder meanwhile); whole and on disk when it is listed. False when not created.

    Locally: a temp file in the owner's folder (never creating the folder: a reset removed it), fsync'd,
    then ``link(2)`` to the name (fails if it exists; fails if a reset removed the temp file with the folder),
    then the folder fsync'd. S3: a conditional PUT (``If-None-Match: *``); if the evidence is gone after it
    (a reset meanwhile) and less than ``grace_s`` passed (nobody may have swept what it folded), removed."""
    uri = storage.join(prefix, name)
    if storage.is_s3(prefix):
        from ..store.lease import _S3Store

        if evidence and not storage.exists(storage.join(prefix, evidence)):
            return False
        t0 = time.monotonic()
        if _S3Store(uri).create(data) is None:
            return False
        if evidence and not storage.exists(storage.join(prefix, evidence)):
            if time.monotonic() - t0 < grace_s:
                storage.delete(uri)
            return False
        return True
    _, path = storage.resolve(uri)
    storage.check_no_symlink(path)
    folder = os.path.dirname(path)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:   # the folder is gone: a reset
        return False
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if evidence and not os.path.exists(os.path.join(folder, evidence)):
            return False
        try:
            os.link(tmp, path)
        except (FileExistsError, FileNotFoundError):   # the generation is taken; the temp file went with a reset
            return False
        _fsync_dir(folder)
        return True
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def event_name() -> str:
    return f"ev-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json"


# --------------------------------------------------------------------------- group commit
WAL = "_wal"
CHECKPOINT_BYTES = 8 << 20      # a journal segment is checkpointed past this size ...
CHECKPOINT_S = 30.0             # ... or this age
FILES_EVERY_S = 0.2             # journalled events written to event files at most this often


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs(path: str) -> None:
    """Every file written on ``path``'s filesystem on disk (``syncfs(2)``; ``sync(2)`` where it is missing)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    os.sync()


def _write_local(path: str, data: bytes) -> None:
    """A file, atomically (temp file + rename), without an fsync of its own."""
    storage.check_no_symlink(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _owner_dir(name: str) -> bool:
    kind, _, oid = name.partition("-")
    return kind in KINDS and bool(ID_RE.match(oid))


class Committer:
    """Group commit of one process's writes to a state (one per state and process: :meth:`of`).

    The writes that arrive while a batch is being written form the next batch, written by one thread
    call; a write's caller awaits its batch (acknowledged = on disk).

    * ``s3://`` state: the batch's event files PUT in parallel (each durable when its PUT returns).
    * Local state: a write-ahead journal, ``<state>/mem0/_wal/<segment>.log`` (one segment per process,
      held with ``flock``): the batch's records appended, then one ``fdatasync``: the batch is on disk
      and acknowledged. A background thread then writes each owner's journalled events as one event
      file (file creation, not the fsync, is what a disk does a few hundred of per second: one file per
      owner and pass, whatever the number of adds), without an fsync of its own. Until then the events
      are *pending*: every read of the owner in this process applies them (:meth:`pending_of`), and an
      event file read again later changes nothing (events carry an ``eid``, applied once). A checkpoint
      (the segment past :data:`CHECKPOINT_BYTES` or :data:`CHECKPOINT_S`, and before a reset) starts a
      new segment, writes what is pending, syncs the filesystem and removes the old segments. Segments no
      live process holds (it died) are recovered before this process's first read or write: the events
      missing from their owner's files written as one file per owner.
    """

    _all: dict[str, "Committer"] = {}
    _all_lock = threading.Lock()

    @classmethod
    def of(cls, state: str) -> "Committer":
        key = state if storage.is_s3(state) else os.path.realpath(storage.resolve(state)[1])
        with cls._all_lock:
            c = cls._all.get(key)
            if c is None:
                c = cls._all[key] = cls(state)
            return c

    def __init__(self, state: str):
        self.state = state
        self.local = not storage.is_s3(state)
        self.root = storage.resolve(storage.join(state, ROOT))[1] if self.local else ""
        self.wal_dir = os.path.join(self.root, WAL) if self.local else ""
        # per event loop: (owner dir, events, file name, caller) waiting for the next batch, and its task
        self._queues: dict[Any, list[tuple[str, list[dict], str, asyncio.Future]]] = {}
        self._tasks: dict[Any, asyncio.Task] = {}
        self._seg_lock = threading.Lock()        # the segment: a batch's append and sync, a rotation
        self._lock = threading.Lock()            # pending (held briefly: readers on the event loop take it)
        self._wake = threading.Condition(self._lock)
        self._start_lock = threading.Lock()
        self._files_lock = threading.Lock()    # one pass of event files at a time (a checkpoint waits for it)
        self._started = False
        self._writer: threading.Thread | None = None
        self.pending: dict[str, list[dict]] = {}  # owner dir -> events journalled, not yet in an event file
        self.fd: int | None = None
        self.segment = ""
        self.size = 0
        self.opened = 0.0
        self.old: list[tuple[int, str]] = []
        self.recovered = 0
        self.batches = self.writes = self.files = 0
        self.failed: BaseException | None = None

    # ------------------------------------------------------------------ the callers' side (event loop)
    async def write(self, owner_dir: str, events: list[dict]) -> str | None:
        """``events`` of the owner ``<state>/mem0/<owner_dir>`` on disk when this returns; the name of their
        event file when it is written now (``s3://``), None when it is journalled (local)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        name = None if self.local else event_name()
        self._queues.setdefault(loop, []).append((owner_dir, events, name or "", fut))
        if loop not in self._tasks:
            self._tasks[loop] = loop.create_task(self._run(loop))
        await fut
        return name

    async def _run(self, loop: Any) -> None:
        try:
            while True:
                batch = self._queues.pop(loop, [])
                if not batch:
                    return
                try:
                    errors = await asyncio.to_thread(self._commit, [q[:3] for q in batch])
                except BaseException as e:  # noqa: BLE001 - every caller of the batch gets it
                    errors = [e] * len(batch)
                for (*_, fut), err in zip(batch, errors):
                    if not fut.done():
                        fut.set_result(None) if err is None else fut.set_exception(err)
        finally:
            self._tasks.pop(loop, None)

    async def ready(self) -> None:
        """Before this process's first read or write: what a dead process journalled is in place."""
        if not self._started:
            await asyncio.to_thread(self.start)

    def pending_of(self, owner_dir: str) -> list[dict]:
        with self._lock:
            return list(self.pending.get(owner_dir, ()))

    async def checkpoint(self) -> None:
        """Every write so far in an event file on disk, and no journal segment refers to it any more
        (before a reset removes a folder: nothing may write it again)."""
        await self.ready()
        if self.local:
            await asyncio.to_thread(self._checkpoint)

    # ------------------------------------------------------------------ the threads' side
    def start(self) -> None:
        with self._start_lock:
            if self._started:
                return
            if self.local:
                storage.check_no_symlink(self.wal_dir)
                os.makedirs(self.wal_dir, exist_ok=True)
                self.recovered = self._recover()
                with self._seg_lock:
                    self._open_segment()
                self._writer = threading.Thread(target=self._materialize_loop, name="mem0-files", daemon=True)
                self._writer.start()
            self._started = True

    def _commit(self, items: list[tuple[str, list[dict], str]]) -> list[BaseException | None]:
        self.start()
        errors: list[BaseException | None] = [None] * len(items)
        for i, (d, _, _) in enumerate(items):
            if not _owner_dir(d):
                errors[i] = ValueError(f"not an owner's folder: {d[:100]!r}")
        ok = [it for it, e in zip(items, errors) if e is None]
        if not self.local:
            from concurrent.futures import ThreadPoolExecutor

            def put(item: tuple[str, list[dict], str]) -> None:
                storage.write_atomic(storage.join(self.state, ROOT, item[0], item[2]),
                                     json.dumps(item[1]).encode("utf-8"))
            with ThreadPoolExecutor(max(1, min(16, len(ok)))) as pool:
                futs = iter([pool.submit(put, it) for it in ok])
            for i, e in enumerate(errors):
                if e is None:
                    errors[i] = next(futs).exception()
            self.batches += 1
            self.writes += len(items)
            return errors
        buf = b"".join(b'{"f": ' + json.dumps(d).encode() + b', "d": ' + json.dumps(ev).encode("utf-8") + b"}\n"
                       for d, ev, _ in ok)
        with self._seg_lock:   # appended and pending before a rotation can start: a checkpoint sees both
            view = memoryview(buf)
            while view:
                view = view[os.write(self.fd, view):]
            os.fdatasync(self.fd)
            self.size += len(buf)
            with self._lock:
                for d, ev, _ in ok:
                    self.pending.setdefault(d, []).extend(ev)
                self.batches += 1
                self.writes += len(items)
                self._wake.notify()
        return errors

    def _open_segment(self) -> None:
        """A new segment (the caller holds the segment lock); the current one joins ``old``."""
        import fcntl

        path = os.path.join(self.wal_dir, f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.log")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for d in (self.wal_dir, self.root):   # the segment findable after a power cut
            _fsync_dir(d)
        if self.fd is not None:
            self.old.append((self.fd, self.segment))
        self.fd, self.segment, self.size, self.opened = fd, path, 0, time.time()

    def _materialize(self) -> None:
        """Write what is pending: one event file per owner (then it is no longer pending)."""
        with self._files_lock:
            with self._lock:   # a copy: the batch thread appends to the lists meanwhile
                todo = {d: list(events) for d, events in self.pending.items()}
            failed: dict[str, list[dict]] = {}
            for d, events in todo.items():
                try:
                    _write_local(os.path.join(self.root, d, event_name()), json.dumps(events).encode("utf-8"))
                    self.files += 1
                except Exception as e:  # noqa: BLE001 - kept pending (and journalled); retried on the next pass
                    failed[d] = events
                    self.failed = e
            with self._lock:   # what was written is no longer pending (only appended to: its head), the rest is
                for d, events in todo.items():
                    if d not in failed:
                        rest = self.pending[d][len(events):]
                        if rest:
                            self.pending[d] = rest
                        else:
                            del self.pending[d]
            if failed:
                raise RuntimeError(f"mem0: event files not written (kept in the journal): {self.failed}")

    def _checkpoint(self) -> None:
        with self._seg_lock:
            if self.size:
                self._open_segment()
            old, self.old = self.old, []
        if not old:
            return
        self._materialize()   # everything the old segments hold is pending or written by now
        _syncfs(self.root)
        for fd, path in old:
            os.unlink(path)
            os.close(fd)
        _fsync_dir(self.wal_dir)

    def _materialize_loop(self) -> None:
        while True:
            with self._lock:
                while not self.pending and not (self.size and time.time() - self.opened > CHECKPOINT_S):
                    self._wake.wait(CHECKPOINT_S / 3)
                due = self.size > CHECKPOINT_BYTES or (self.size and time.time() - self.opened > CHECKPOINT_S)
            try:
                self._checkpoint() if due else self._materialize()
            except Exception:  # noqa: BLE001 - the journal still holds it; the next pass retries
                time.sleep(1.0)
            time.sleep(FILES_EVERY_S)   # what comes meanwhile goes into the same files

    def _recover(self) -> int:
        """Replay the segments of dead processes: each owner's events missing from its event files
        written as one file; returns the events written again."""
        import fcntl

        fixed = 0
        for name in sorted(os.listdir(self.wal_dir)):
            if not name.endswith(".log"):
                continue
            path = os.path.join(self.wal_dir, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:   # a live process's segment
                    continue
                journalled: dict[str, list[dict]] = {}
                with open(path, "rb") as f:
                    for line in f.read().split(b"\n"):
                        try:
                            rec = json.loads(line)
                            d, events = rec["f"], rec["d"]
                        except (ValueError, KeyError, TypeError):
                            break   # a torn tail: that batch was never acknowledged
                        if isinstance(d, str) and _owner_dir(d) and isinstance(events, list):
                            journalled.setdefault(d, []).extend(e for e in events if isinstance(e, dict))
                for d, events in journalled.items():
                    folder = os.path.join(self.root, d)
                    have = _logged_eids(folder)
                    missing = [e for e in events if e.get("eid") not in have]
                    if missing:
                        _write_local(os.path.join(folder, event_name()), json.dumps(missing).encode("utf-8"))
                        fixed += len(missing)
                _syncfs(self.root)
                os.unlink(path)
            finally:
                os.close(fd)
        _fsync_dir(self.wal_dir)
        return fixed


def _logged_eids(folder: str) -> set:
    """The eids an owner's log holds on a local disk: its newest snapshot's and those of the event files it did
    not fold. An event file that cannot be parsed (torn by a power cut) is removed (its events are rewritten
    from the journal); one removed meanwhile (a compaction's sweep) means the listing is old: listed again."""
    for _ in range(READ_TRIES):
        names = os.listdir(folder) if os.path.isdir(folder) else []
        snaps = sorted((g, n) for n in names if (g := _snapshot_gen(n)))
        have: set = set()
        skip: frozenset = frozenset()
        try:
            if snaps:
                with open(os.path.join(folder, snaps[-1][1]), "rb") as f:
                    head, body = _parse_snapshot(f.read())
                have.update(body["seen"])
                skip = _folded(head)
            for n in names:
                if _is_event(n) and n not in skip:
                    try:
                        with open(os.path.join(folder, n), "rb") as f:
                            have.update(e.get("eid") for e in json.loads(f.read()))
                    except FileNotFoundError:
                        raise
                    except (OSError, ValueError, AttributeError):
                        os.unlink(os.path.join(folder, n))   # torn by the power cut: rewritten from the journal
            return have
        except FileNotFoundError:
            continue
    raise storage.StorageError(f"{folder}: files kept being removed while they were read ({READ_TRIES} tries)")


# --------------------------------------------------------------------------- filters
def _value(m: dict, name: str) -> Any:
    if name in ("id", "memory_id"):
        return m.get("id")
    if name in ("user_id", "agent_id", "run_id", "role", "created_at", "updated_at", "memory", "hash"):
        return m.get(name)
    return (m.get("metadata") or {}).get(name)


def _test(v: Any, cond: Any) -> bool:
    if isinstance(cond, dict):
        return all(_op(v, op, arg) for op, arg in cond.items())
    if cond == "*":
        return v is not None
    return v == cond


def _cmp(v: Any, arg: Any) -> tuple[Any, Any] | None:
    if v is None:
        return None
    if isinstance(v, (int, float)) and isinstance(arg, (int, float)):
        return v, arg
    return str(v), str(arg)


def _op(v: Any, op: str, arg: Any) -> bool:
    if op not in OPS:
        raise Mem0Error(422, f"filters: unknown operator '{str(op)[:40]}' (known: {', '.join(OPS)})")
    if op == "eq":
        return v == arg
    if op == "ne":
        return v != arg
    if op in ("in", "nin"):
        if not isinstance(arg, list):
            raise Mem0Error(422, f"filters: '{op}' takes a list")
        return (v in arg) == (op == "in")
    if op in ("contains", "icontains"):
        if v is None:
            return False
        s, a = str(v), str(arg)
        return a in s if op == "contains" else a.lower() in s.lower()
    pair = _cmp(v, arg)
    if pair is None:
        return False
    a, b = pair
    return {"gt": a > b, "gte": a >= b, "lt": a < b, "lte": a <= b}[op]


def matches(m: dict, filters: Any) -> bool:
    if filters is None:
        return True
    if not isinstance(filters, dict):
        raise Mem0Error(422, "filters: expected a mapping")
    for key, cond in filters.items():
        if key in ("AND", "OR", "NOT"):
            if not isinstance(cond, list) or not all(isinstance(c, dict) for c in cond):
                raise Mem0Error(422, f"filters.{key}: expected a list of mappings")
            got = [matches(m, c) for c in cond]
            ok = all(got) if key == "AND" else any(got) if key == "OR" else not any(got)
        elif key == "ids":
            if not isinstance(cond, list):
                raise Mem0Error(422, "filters.ids: expected a list of memory ids")
            ok = m.get("id") in cond
        elif key == "metadata":
            if not isinstance(cond, dict):
                raise Mem0Error(422, "filters.metadata: expected a mapping")
            ok = all(_test((m.get("metadata") or {}).get(k), c) for k, c in cond.items())
        else:
            ok = _test(_value(m, key), cond)
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------- the API's logic
class Mem0API:
    """The routes' logic over a :class:`~memsifter.service.core.RetrievalService` (its state, encoder,
    first stage, locks and limits)."""

    def __init__(self, service: Any):
        self.svc = service
        self._owners: dict[tuple[str, str], Owner] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._committer: Committer | None = None
        self._compactions: dict[tuple[str, str], asyncio.Task] = {}   # an owner's compaction under way
        self._compact_after: dict[tuple[str, str], float] = {}        # none before this (one failed; monotonic)
        self._sweep_after: dict[tuple[str, str], float] = {}          # no sweep alone before this

    def _state(self) -> str:
        return self.svc._need_state()

    @property
    def committer(self) -> Committer:
        if self._committer is None:
            self._committer = Committer.of(self._state())
        return self._committer

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _held(self, kind: str, oid: str) -> Owner:
        """The owner's memories for a write (the caller holds its lock): the cached ones when read within
        ``memory_refresh_s``, else the log re-read. A stale cache cannot lose or duplicate a write: events
        are only ever added, and the replay drops an ADD whose content is already there."""
        cur = self._owners.get((kind, oid))
        if cur is not None and time.time() - cur.checked_at < self.svc.cfg.memory_refresh_s:
            return cur
        await self.committer.ready()
        pending = self.committer.pending_of(f"{kind}-{oid}")
        new = self._with_pending(await asyncio.to_thread(read_log, self._state(), cur or Owner(kind, oid)), pending)
        self._owners[(kind, oid)] = new
        self._maintain(new)
        return new

    def _with_pending(self, owner: Owner, pending: list[dict]) -> Owner:
        """``owner`` with this process's writes that are on disk in the journal, not yet in an event file:
        ``pending``, taken *before* the log was listed (an event that left it meanwhile is in a file listed)."""
        todo = [e for e in pending if e.get("eid") not in owner.seen]
        if todo:
            owner = owner.copy()
            for ev in todo:
                owner.apply(ev)
        return owner

    async def owner(self, kind: str, oid: str, fresh: bool = False) -> Owner:
        """The owner's memories, re-read from the store when older than ``memory_refresh_s`` (other
        replicas' writes)."""
        state = self._state()
        key = (kind, oid)
        cur = self._owners.get(key)
        if cur and not fresh and time.time() - cur.checked_at < self.svc.cfg.memory_refresh_s:
            return cur
        await self.committer.ready()
        async with self._lock(key):
            cur = self._owners.get(key) or Owner(kind, oid)
            pending = self.committer.pending_of(cur.prefix_key)
            new = self._with_pending(await asyncio.to_thread(read_log, state, cur), pending)
            self._owners[key] = new
            self._maintain(new)
            return new

    def _maintain(self, owner: Owner) -> None:
        """Start a compaction of the owner in the background (:func:`compact`) when more than
        ``memory_compact_files`` event files follow its snapshot, or what a snapshot folded is still listed
        ``memory_compact_grace_s`` after this process first saw it; one at a time per owner, none for a minute
        after one failed. Called with the owner's lock held (a reset waits for the one under way)."""
        cfg = self.svc.cfg
        limit = getattr(cfg, "memory_compact_files", COMPACT_FILES)
        grace = getattr(cfg, "memory_compact_grace_s", COMPACT_GRACE_S)
        key = (owner.kind, owner.oid)
        now_ = time.monotonic()
        if not limit or key in self._compactions or now_ < self._compact_after.get(key, 0.0):
            return
        fold = len(owner.files) > limit
        sweep = not fold and owner.litter > 0 and now_ - owner.based_at >= grace and \
            now_ >= self._sweep_after.get(key, 0.0)
        if not (fold or sweep):
            return
        if sweep:   # (one that removed nothing is not tried again at once)
            self._sweep_after[key] = now_ + max(1.0, grace / 4)
        task = asyncio.get_running_loop().create_task(self._compact(key, limit, grace))
        self._compactions[key] = task
        task.add_done_callback(lambda _t: self._compactions.pop(key, None))

    async def _compact(self, key: tuple[str, str], limit: int, grace: float) -> None:
        try:
            out = await asyncio.to_thread(compact, self._state(), key[0], key[1], limit, grace)
            if out["snapshot"]:
                log.info("mem0: %s-%s: %d event files folded into %s", key[0], key[1], out["folded"],
                         os.path.basename(str(out["snapshot"])))
        except Exception as e:  # noqa: BLE001 - the log stays as it is, readable; tried again later
            self._compact_after[key] = time.monotonic() + 60.0
            from ..security.redact import redact

            log.warning("mem0: %s-%s: compaction failed (the log is kept as it is): %s: %s", key[0], key[1],
                        type(e).__name__, redact(str(e)))

    @staticmethod
    def public(m: dict, score: float | None = None) -> dict:
        out = {k: m.get(k) for k in ("id", "memory", "hash", "metadata", "created_at", "updated_at", "user_id",
                                     "agent_id", "run_id", "role")}
        if score is not None:
            out["score"] = score
        return out

    async def add(self, p: Principal, messages: list[dict], user_id: str | None, agent_id: str | None,
                  run_id: str | None, metadata: dict | None, infer: bool | None = None) -> dict:
        """mem0's add: each message one memory, stored as sent; with ``extract`` configured and ``infer``
        not false, the facts an LLM finds in the messages, added to or changing the owner's memories
        (:mod:`memsifter.service.extract`)."""
        kind, oid = owner_of(user_id, agent_id, run_id)
        p.require("write", oid)
        self._state()   # 503 without a state store
        lim = self.svc.cfg.limits
        if len(messages) > lim.max_sessions_per_append:
            raise Mem0Error(413, f"messages: {len(messages)} in one request, at most {lim.max_sessions_per_append} "
                            "(limits.max_sessions_per_append)")
        for i, msg in enumerate(messages):
            if len(msg["content"]) > lim.max_turn_chars:
                raise Mem0Error(413, f"messages[{i}].content: {len(msg['content'])} characters, at most "
                                f"{lim.max_turn_chars} (limits.max_turn_chars)")
        settings = getattr(self.svc.cfg, "extract", None)
        if settings is not None and infer is not False:
            return await self._add_inferred(settings, kind, oid, messages, user_id, agent_id, run_id, metadata)
        return {"results": await self._add_as_sent(kind, oid, [(m["content"], m.get("role")) for m in messages],
                                                   user_id, agent_id, run_id, metadata)}

    async def _add_as_sent(self, kind: str, oid: str, texts: list[tuple[str, str | None]], user_id: str | None,
                           agent_id: str | None, run_id: str | None, metadata: dict | None) -> list[dict]:
        """``texts`` ((text, role) pairs) added, each one memory; the same content twice is one."""
        lim = self.svc.cfg.limits
        async with self._lock((kind, oid)):
            owner = await self._held(kind, oid)
            if len(owner.memories) + len(texts) > lim.max_user_sessions:
                raise Mem0Error(413, f"{kind} '{oid}' would hold more than {lim.max_user_sessions} memories "
                                "(limits.max_user_sessions)")
            at = now()
            events, results = [], []
            here: dict[tuple, dict] = {}   # this request's own messages: the same content twice is one memory
            for text, role in texts:
                if not text.strip():
                    continue
                ev = self._add_event(kind, oid, text, role, metadata, user_id, agent_id, run_id, at)
                same = owner.find_same(ev) or here.get(owner.scope_hash(ev))
                if same is not None:
                    results.append({"id": same["id"], "memory": same["memory"], "event": "NONE"})
                    continue
                here[owner.scope_hash(ev)] = ev
                events.append(ev)
                results.append({"id": ev["id"], "memory": text, "event": "ADD"})
            if events:
                await self._write(owner, events)
        return results

    @staticmethod
    def _add_event(kind: str, oid: str, text: str, role: str | None, metadata: dict | None, user_id: str | None,
                   agent_id: str | None, run_id: str | None, at: str) -> dict:
        return {"event": "ADD", "id": f"{kind}-{oid}~{uuid.uuid4().hex}", "memory": text, "hash": text_hash(text),
                "metadata": metadata, "user_id": user_id, "agent_id": agent_id, "run_id": run_id, "role": role,
                "at": at}

    # ------------------------------------------------------------------ adds with fact extraction
    def _extractor(self, settings: Any) -> Any:
        from .extract import Extractor

        ex = getattr(self, "_ex", None)
        if ex is None or ex.settings is not settings:
            ex = self._ex = Extractor(settings)
        return ex

    async def _similar(self, owner: Owner, facts: list[str], k: int) -> list[dict]:
        """The owner's memories shown to the model: all of them up to ``k``, else the most similar to each
        fact by the first stage (in turn, until ``k``)."""
        mems = list(owner.memories.values())
        if len(mems) <= k:
            return mems
        corpus = await self._corpus(owner)
        ranked = [(await self.svc.first_stage(self.svc.state, corpus, f))[0] for f in facts]
        out: dict[str, dict] = {}
        for rank in range(len(mems)):
            for order in ranked:
                if rank < len(order) and len(out) < k:
                    m = owner.memories.get(corpus.sessions[order[rank]].session_id)
                    if m is not None:
                        out.setdefault(m["id"], m)
            if len(out) >= k:
                break
        return list(out.values())

    async def _add_inferred(self, settings: Any, kind: str, oid: str, messages: list[dict], user_id: str | None,
                            agent_id: str | None, run_id: str | None, metadata: dict | None) -> dict:
        from .extract import Malformed

        ex = self._extractor(settings)
        lim = self.svc.cfg.limits
        info: dict[str, Any] = {"status": "ok", "llm_calls": 1}
        try:
            facts = await ex.facts(messages, lim.max_turn_chars)
            info["facts"] = facts
            ops = [{"event": "ADD", "ref": None, "text": f} for f in facts]
            stored: list[dict] = []
            if facts:
                owner = await self.owner(kind, oid)
                stored = await self._similar(owner, facts, settings.similar) if owner.memories else []
            if stored:
                info["llm_calls"] = 2
                ops, dropped = await ex.decisions([m["memory"] for m in stored], facts, lim.max_turn_chars)
                if dropped:
                    info["ignored"] = dropped
        except Malformed as e:
            info = {"status": "fallback", "llm_calls": info["llm_calls"],
                    "detail": f"{e}; the messages were stored as sent"}
            results = await self._add_as_sent(kind, oid, [(m["content"], m.get("role")) for m in messages],
                                              user_id, agent_id, run_id, metadata)
            return {"results": results, "extraction": info}
        async with self._lock((kind, oid)):
            owner = await self._held(kind, oid)
            at = now()
            events, results = [], []
            trial = Owner(kind, oid, memories={k: dict(v) for k, v in owner.memories.items()})
            for op in ops:
                ref = stored[int(op["ref"])]["id"] if op["ref"] is not None else None
                m = trial.memories.get(ref) if ref else None
                event = op["event"]
                if event == "UPDATE" and m is None:   # gone meanwhile: the fact is added
                    event = "ADD"
                if event == "ADD":
                    if len(trial.memories) >= lim.max_user_sessions:
                        raise Mem0Error(413, f"{kind} '{oid}' would hold more than {lim.max_user_sessions} "
                                        "memories (limits.max_user_sessions)")
                    ev = self._add_event(kind, oid, op["text"], "user", metadata, user_id, agent_id, run_id, at)
                    if trial.find_same(ev) is not None:
                        continue
                    results.append({"id": ev["id"], "memory": op["text"], "event": "ADD"})
                elif event == "UPDATE":
                    if m["memory"] == op["text"]:
                        continue
                    ev = {"event": "UPDATE", "id": ref, "memory": op["text"], "hash": text_hash(op["text"]),
                          "old_memory": m["memory"], "metadata": None, "role": m.get("role"), "at": at}
                    results.append({"id": ref, "memory": op["text"], "event": "UPDATE", "previous_memory": m["memory"]})
                elif event == "DELETE" and m is not None:
                    ev = {"event": "DELETE", "id": ref, "old_memory": m["memory"], "role": m.get("role"), "at": at}
                    results.append({"id": ref, "memory": m["memory"], "event": "DELETE"})
                else:
                    continue
                trial.apply(ev)
                events.append(ev)
            if events:
                await self._write(owner, events)
        return {"results": results, "extraction": info}

    async def _memory(self, p: Principal, memory_id: str, action: str) -> tuple[Owner, dict]:
        kind, oid = owner_of_memory(memory_id)
        p.require(action, oid)
        owner = await self.owner(kind, oid, fresh=True)
        m = owner.memories.get(memory_id)
        if m is None:
            raise Mem0Error(404, f"no memory '{memory_id[:80]}'")
        return owner, m

    async def get(self, p: Principal, memory_id: str) -> dict:
        _, m = await self._memory(p, memory_id, "read")
        return self.public(m)

    async def list(self, p: Principal, user_id: str | None, agent_id: str | None, run_id: str | None) -> dict:
        kind, oid = owner_of(user_id, agent_id, run_id)
        p.require("read", oid)
        owner = await self.owner(kind, oid)
        scope = {k: v for k, v in (("agent_id", agent_id), ("run_id", run_id), ("user_id", user_id)) if v}
        return {"results": [self.public(m) for m in owner.memories.values() if matches(m, scope)]}

    async def _write(self, owner: Owner, events: list[dict]) -> Owner:
        """``events`` written (one event file, on disk when this returns: :class:`Committer`), then applied
        to a copy of ``owner`` that replaces it."""
        for ev in events:
            ev["eid"] = f"{EID_PREFIX}{next(_eids):x}"
        name = await self.committer.write(owner.prefix_key, events)
        for ev in events:   # in place (the caller holds the owner's lock; a reader iterates without awaiting)
            owner.apply(ev)
        if name:
            owner.files.append(name)
        self._owners[(owner.kind, owner.oid)] = owner
        return owner

    async def update(self, p: Principal, memory_id: str, text: str, metadata: dict | None) -> dict:
        kind, oid = owner_of_memory(memory_id)
        p.require("write", oid)
        if len(text) > self.svc.cfg.limits.max_turn_chars:
            raise Mem0Error(413, f"text: {len(text)} characters, at most {self.svc.cfg.limits.max_turn_chars}")
        async with self._lock((kind, oid)):
            owner = await self._held(kind, oid)
            m = owner.memories.get(memory_id)
            if m is None:
                raise Mem0Error(404, f"no memory '{memory_id[:80]}'")
            if m["memory"] != text or (metadata is not None and metadata != m.get("metadata")):
                owner = await self._write(owner, [{"event": "UPDATE", "id": memory_id, "memory": text, "hash": text_hash(text),
                                           "old_memory": m["memory"], "metadata": metadata, "role": m.get("role"),
                                           "at": now()}])
            return {"message": "Memory updated successfully!", **self.public(owner.memories[memory_id])}

    async def delete(self, p: Principal, memory_id: str) -> dict:
        kind, oid = owner_of_memory(memory_id)
        p.require("write", oid)
        async with self._lock((kind, oid)):
            owner = await self._held(kind, oid)
            m = owner.memories.get(memory_id)
            if m is None:
                raise Mem0Error(404, f"no memory '{memory_id[:80]}'")
            await self._write(owner, [{"event": "DELETE", "id": memory_id, "old_memory": m["memory"],
                                       "role": m.get("role"), "at": now()}])
        return {"message": "Memory deleted successfully"}

    async def delete_all(self, p: Principal, user_id: str | None, agent_id: str | None, run_id: str | None) -> dict:
        kind, oid = owner_of(user_id, agent_id, run_id)
        p.require("write", oid)
        scope = {k: v for k, v in (("agent_id", agent_id), ("run_id", run_id), ("user_id", user_id)) if v}
        async with self._lock((kind, oid)):
            owner = await self._held(kind, oid)
            at = now()
            events = [{"event": "DELETE", "id": m["id"], "old_memory": m["memory"], "role": m.get("role"), "at": at}
                      for m in owner.memories.values() if matches(m, scope)]
            if events:
                await self._write(owner, events)
        return {"message": "All relevant memories deleted", "deleted": len(events)}

    async def reset(self, p: Principal, user_id: str | None, agent_id: str | None, run_id: str | None) -> dict:
        kind, oid = owner_of(user_id, agent_id, run_id)
        p.require("write", oid)
        async with self._lock((kind, oid)):
            task = self._compactions.get((kind, oid))
            if task is not None:   # none starts while the lock is held; the one under way publishes before
                await asyncio.wait([task])
            await self.committer.checkpoint()   # no journal record left that would write the folder again
            await asyncio.to_thread(self._delete_owner, kind, oid)
            self._owners.pop((kind, oid), None)
        return {"message": f"Reset all memories of {kind} '{oid}'"}

    def _delete_owner(self, kind: str, oid: str) -> None:
        prefix = owner_prefix(self._state(), kind, oid)
        for attempt in range(5):   # a compaction of another replica may publish into it meanwhile: removed again
            try:
                storage.delete(prefix)
                break
            except storage.StorageError:
                if attempt == 4:
                    raise
                time.sleep(0.05)
        if self.committer.local:   # the removal on disk before the answer
            parent = storage.resolve(storage.join(self._state(), ROOT))[1]
            if os.path.isdir(parent):
                _fsync_dir(parent)

    async def history(self, p: Principal, memory_id: str) -> list[dict]:
        kind, oid = owner_of_memory(memory_id)
        p.require("read", oid)
        owner = await self.owner(kind, oid, fresh=True)
        h = owner.history.get(memory_id)
        if not h:
            raise Mem0Error(404, f"no memory '{memory_id[:80]}'")
        return list(h)

    async def _corpus(self, owner: Owner) -> Corpus | None:
        version = owner.version
        if owner.corpus is not None and owner.corpus_version == version:
            return owner.corpus
        mems = list(owner.memories.values())
        if not mems:
            return None
        st = self.svc.state
        sessions = [Session(m["id"], [{"role": m.get("role") or "user", "content": m["memory"]}], m["created_at"][:10])
                    for m in mems]
        dates = [s.date for s in sessions]

        def build() -> Corpus:
            if st.settings.method in DENSE_METHODS:
                st.units.ensure(sessions, urgent=True)
            lex = build_lexical(sessions, dates, st.settings.method, st.settings.turn_words, st.settings.stem)
            return Corpus(f"{owner.kind}-{owner.oid}", sessions, dates, lex, "memory")
        corpus = await asyncio.to_thread(build)
        owner.corpus, owner.corpus_version = corpus, version
        return corpus

    async def search(self, p: Principal, query: str, user_id: str | None, agent_id: str | None,
                     run_id: str | None, filters: dict | None, limit: int, threshold: float | None) -> dict:
        kind, oid = owner_of(user_id, agent_id, run_id)
        p.require("read", oid)
        self.svc._check_query(query, "query")
        if limit < 1 or limit > self.svc.cfg.limits.max_topk:
            raise Mem0Error(422, f"limit: {limit} is outside 1..{self.svc.cfg.limits.max_topk} (limits.max_topk)")
        owner = await self.owner(kind, oid)
        scope = {k: v for k, v in (("agent_id", agent_id), ("run_id", run_id), ("user_id", user_id)) if v}
        matches({}, filters) if filters else None   # a malformed filter is a 422 even on an empty memory
        corpus = await self._corpus(owner)
        if corpus is None:
            return {"results": []}
        st = self.svc.state
        order, scores = await self.svc.first_stage(st, corpus, query)
        self.svc.metrics.queries.labels("mem0").inc()
        out = []
        for i in order:
            m = owner.memories.get(corpus.sessions[i].session_id)
            if m is None or not matches(m, scope) or not matches(m, filters):
                continue
            score = self.svc.score_value(scores[i])
            if threshold is not None and score < threshold:
                continue
            out.append(self.public(m, score))
            if len(out) >= limit:
                break
        return {"results": out}
