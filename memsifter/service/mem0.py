"""A mem0-compatible memory API beside the native one, on the same state store and first stage (issue 46).

A mem0 client points its base URL at ``<service>/mem0``: ``POST /memories`` (``messages`` with
``user_id`` / ``agent_id`` / ``run_id`` and ``metadata``), ``GET /memories`` (list), ``GET|PUT|DELETE
/memories/{memory_id}``, ``GET /memories/{memory_id}/history``, ``DELETE /memories`` (all of an owner),
``POST /search`` (``filters``, ``limit``, ``threshold``) and ``POST /reset`` (an owner's memories and
history). No LLM is called: each message is one memory, stored as sent.

Owner and tenancy. A memory belongs to its ``user_id``, else its ``agent_id``, else its ``run_id`` (the
*owner*); an API key's grant is checked against the owner's id (read: list, get, history, search; write:
add, update, delete, reset). A memory id names its owner (``<kind>-<owner>~<random>``), so that a get or
a delete by id is authorised before anything is read.

Storage, under ``<state>/mem0/<kind>-<owner>/``: an append-only log of event files
(``ev-<time_ns>-<random>.json``, each one atomic write, done before the call returns: an add, update or
delete is durable and searchable when its answer arrives). The owner's memories are the log replayed in
name order: ``ADD`` (ignored when a memory of the same content and scope exists: the same content twice
is one memory, also when two replicas race), ``UPDATE`` (the text replaced; the old one stays in the
history) and ``DELETE``. ``POST /reset`` removes the owner's folder.

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
import json
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

ROOT = "mem0"
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

    def copy(self) -> "Owner":
        """A copy to change beside this one (a reader in flight keeps iterating the original)."""
        return Owner(self.kind, self.oid, list(self.files), {k: dict(v) for k, v in self.memories.items()},
                     {k: list(v) for k, v in self.history.items()}, self.checked_at, self.version)

    @property
    def prefix_key(self) -> str:
        return f"{self.kind}-{self.oid}"

    def scope_hash(self, rec: dict) -> tuple:
        return (rec.get("agent_id"), rec.get("run_id"), rec.get("user_id"), rec["hash"])

    def find_same(self, rec: dict) -> dict | None:
        key = self.scope_hash(rec)
        for m in self.memories.values():
            if self.scope_hash(m) == key:
                return m
        return None

    def apply(self, ev: dict) -> bool:
        """Replay one event; False when it changes nothing (an ADD of content already there)."""
        mid, kind = ev["id"], ev["event"]
        if kind == "ADD":
            if mid in self.memories or self.find_same(ev):
                return False
            self.memories[mid] = {k: ev.get(k) for k in ("id", "memory", "hash", "metadata", "user_id", "agent_id",
                                                         "run_id", "role")}
            self.memories[mid].update(created_at=ev["at"], updated_at=None)
        elif kind == "UPDATE":
            m = self.memories.get(mid)
            if m is None:
                return False
            m.update(memory=ev["memory"], hash=ev["hash"], updated_at=ev["at"])
            if ev.get("metadata") is not None:
                m["metadata"] = ev["metadata"]
        elif kind == "DELETE":
            if self.memories.pop(mid, None) is None:
                return False
        self.version += 1
        h = self.history.setdefault(mid, [])
        h.append({"id": f"{mid}.{len(h) + 1}", "memory_id": mid, "old_memory": ev.get("old_memory"),
                  "new_memory": ev.get("memory") if kind != "DELETE" else None, "event": kind,
                  "created_at": ev["at"], "updated_at": ev["at"] if kind != "ADD" else None,
                  "is_deleted": kind == "DELETE", "role": ev.get("role")})
        return True


def owner_prefix(state: str, kind: str, oid: str) -> str:
    return storage.join(state, ROOT, f"{kind}-{oid}")


def read_log(state: str, owner: Owner) -> Owner:
    """``owner`` with the event files it has not read (blocking); a new one if the log was reset."""
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


def write_events(state: str, owner: Owner, events: list[dict]) -> str:
    name = f"ev-{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.json"
    storage.write_atomic(storage.join(owner_prefix(state, owner.kind, owner.oid), name),
                         json.dumps(events).encode("utf-8"))
    return name


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

    def _state(self) -> str:
        return self.svc._need_state()

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
        new = await asyncio.to_thread(read_log, self._state(), cur or Owner(kind, oid))
        self._owners[(kind, oid)] = new
        return new

    async def owner(self, kind: str, oid: str, fresh: bool = False) -> Owner:
        """The owner's memories, re-read from the store when older than ``memory_refresh_s`` (other
        replicas' writes)."""
        state = self._state()
        key = (kind, oid)
        cur = self._owners.get(key)
        if cur and not fresh and time.time() - cur.checked_at < self.svc.cfg.memory_refresh_s:
            return cur
        async with self._lock(key):
            cur = self._owners.get(key) or Owner(kind, oid)
            new = await asyncio.to_thread(read_log, state, cur)
            self._owners[key] = new
            return new

    @staticmethod
    def public(m: dict, score: float | None = None) -> dict:
        out = {k: m.get(k) for k in ("id", "memory", "hash", "metadata", "created_at", "updated_at", "user_id",
                                     "agent_id", "run_id", "role")}
        if score is not None:
            out["score"] = score
        return out

    async def add(self, p: Principal, messages: list[dict], user_id: str | None, agent_id: str | None,
                  run_id: str | None, metadata: dict | None) -> dict:
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
        async with self._lock((kind, oid)):
            owner = await self._held(kind, oid)
            if len(owner.memories) + len(messages) > lim.max_user_sessions:
                raise Mem0Error(413, f"{kind} '{oid}' would hold more than {lim.max_user_sessions} memories "
                                "(limits.max_user_sessions)")
            at = now()
            events, results = [], []
            trial = Owner(kind, oid, memories=dict(owner.memories))   # what this request's messages add up to
            for msg in messages:
                text = msg["content"]
                if not text.strip():
                    continue
                ev = {"event": "ADD", "id": f"{kind}-{oid}~{uuid.uuid4().hex}", "memory": text,
                      "hash": text_hash(text), "metadata": metadata, "user_id": user_id, "agent_id": agent_id,
                      "run_id": run_id, "role": msg.get("role"), "at": at}
                same = trial.find_same(ev)
                if same is not None:
                    results.append({"id": same["id"], "memory": same["memory"], "event": "NONE"})
                    continue
                trial.apply(ev)
                events.append(ev)
                results.append({"id": ev["id"], "memory": text, "event": "ADD"})
            if events:
                await self._write(owner, events)
        return {"results": results}

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
        """``events`` written (one atomic file), then applied to a copy of ``owner`` that replaces it."""
        name = await asyncio.to_thread(write_events, self._state(), owner, events)
        new = owner.copy()
        for ev in events:
            new.apply(ev)
        new.files.append(name)
        self._owners[(owner.kind, owner.oid)] = new
        return new

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
            await asyncio.to_thread(storage.delete, owner_prefix(self._state(), kind, oid))
            self._owners.pop((kind, oid), None)
        return {"message": f"Reset all memories of {kind} '{oid}'"}

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
