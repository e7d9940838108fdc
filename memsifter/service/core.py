"""The retrieval service without its transport: what every route does, callable from Ray Serve's
replica (:mod:`memsifter.service.app`), a plain uvicorn server (``memsifter serve --no-ray``) and tests.

State and concurrency. Everything a request reads is reached through one reference taken at its start
(:class:`State`: the published index, its settings, the encoder and the unit matrices); a reload builds a
new one beside it and swaps the reference, so a request in flight finishes on the index it started with
and none is dropped. Reloads, and the embedding of every session's units after a load, run on background
threads; the event loop only scores (about a millisecond a query) and waits. Query vectors are computed
in batches (:class:`MicroBatcher`): while one forward pass runs, the queries that arrive form the next.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from ..models import embedding
from ..data.model import Session, content_hash
from ..security.redact import redact
from ..retrieval.ranker import RankRequest
from ..retrieval.render import render_session
from . import memory as M
from .auth import Keys, Principal
from .config import ID_RE, ServeConfig
from .index import (DENSE_METHODS, Corpus, Encoder, PublishedIndex, Units, build_lexical, corpus_title,
                    manifest_digest, order_of, score_corpus)
from .metrics import ServiceMetrics

log = logging.getLogger("memsifter.service")
MODES = ("first_stage", "ranked")


class ApiError(Exception):
    """An error a client caused or may retry: its HTTP status and one line saying what to change."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


# --------------------------------------------------------------------------- batching
class MicroBatcher:
    """Calls ``fn(items) -> results`` (a coroutine function, or a blocking one: on a worker thread) for batches of concurrent
    :meth:`submit` calls: the first item goes at once, and items that arrive while a batch runs form
    the next (at most ``max_batch``), so one client waits for no one and many share forward passes."""

    def __init__(self, fn: Callable[[list], Sequence], max_batch: int, wait_s: float = 0.0,
                 observe: Callable[[int], None] | None = None):
        self.fn, self.max_batch, self.wait_s, self.observe = fn, max_batch, wait_s, observe
        self._queue: list[tuple[Any, asyncio.Future]] = []
        self._running = False

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((item, fut))
        if not self._running:
            self._running = True
            loop.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        try:
            while self._queue:
                if self.wait_s and len(self._queue) < self.max_batch:
                    await asyncio.sleep(self.wait_s)
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                if self.observe:
                    self.observe(len(batch))
                try:
                    items = [item for item, _ in batch]
                    results = (await self.fn(items) if asyncio.iscoroutinefunction(self.fn)
                               else await asyncio.to_thread(self.fn, items))
                except Exception as e:  # noqa: BLE001 - every waiter gets it
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                for (_, f), r in zip(batch, results):
                    if not f.done():
                        f.set_result(r)
        finally:
            self._running = False


def settle_heap() -> None:
    """After a load or reload: collect, then freeze what survived (the index, the model, the imported
    code: ``gc.freeze``), so that the cyclic collector's full collections walk only what requests and
    writes made since (before, each one walked the whole loaded heap with the event loop stopped: the
    longest pauses of a request under load). Frozen objects are still freed when their last reference
    goes; the next settle (a reload) unfreezes first, so an old index's cycles are collected then."""
    import gc

    gc.unfreeze()
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """After a reload: collect the old index (:func:`settle_heap`) and hand freed heap back to the OS (glibc
    keeps it otherwise, and the RSS of a long-running replica would grow by an index per reload)."""
    import ctypes

    settle_heap()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


def query_process(cfg: ServeConfig) -> bool:
    """Whether the query encoder runs in a process of its own (``query_encoder_process``; auto: where no GPU is
    seen, as the model then runs on the CPU that the event loop shares)."""
    v = getattr(cfg, "query_encoder_process", None)
    if v is not None:
        return bool(v)
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def _close_at_exit(ref: "weakref.ref[RetrievalService]") -> None:
    svc = ref()
    if svc is not None:
        svc.close(10.0)


# --------------------------------------------------------------------------- state
@dataclass
class State:
    """What one request reads, swapped whole on reload."""

    index: PublishedIndex
    encoder: Encoder
    units: Units
    units_ready: bool = False

    @property
    def settings(self):  # noqa: ANN201
        return self.index.settings

    def key(self) -> tuple:
        s = self.settings
        return (s.method, s.spec.key, s.turn_words, s.stem)


@dataclass
class MemoryCorpus:
    mem: M.UserMemory
    corpus: Corpus | None
    key: tuple


Ranker = Callable[[RankRequest], Awaitable[dict]]


class RetrievalService:
    """First stage (and ranker) over a published index plus user memories; see the module docstring.

    ``ranker``: an async callable taking one ranking request (see :mod:`memsifter.service.ranker`) and
    returning ``{ranked_session_ids, status, reason}``: a Serve deployment handle's method, or a local
    :class:`~memsifter.service.ranker.RankerCore` behind a :class:`MicroBatcher`; None: ``ranked``
    answers with the first stage, marked as a fallback."""

    def __init__(self, cfg: ServeConfig, ranker: Ranker | None = None, start_threads: bool = True):
        self.cfg = cfg
        self.keys = Keys(cfg.auth)
        self.secrets = self.keys.secrets()
        self.metrics = ServiceMetrics()
        self.ranker = ranker
        t0 = time.time()
        index = PublishedIndex.load(cfg, progress=lambda m: log.info("serve: %s", m))
        encoder = Encoder(index.settings.spec, cfg.torch_threads, cfg.query_pass_tokens, query_process(cfg))
        self.state = State(index, encoder, Units(index.vectors, encoder, index.settings.turn_words))
        self.metrics.reloads.labels("ok").inc()
        log.info("serve: index %s loaded in %.1fs: %d corpora, %d sessions, method %s", redact(cfg.index),
                 time.time() - t0, len(index.corpora), len(index.sessions), index.settings.method)
        self._batcher = MicroBatcher(self._encode_queries, cfg.query_batch, cfg.query_batch_wait_s,
                                     observe=lambda n: self.metrics.query_batch.observe(n))
        self._memories: dict[str, MemoryCorpus] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._stop = threading.Event()
        self._warm = threading.Event()
        self._folded = threading.Event()   # the mem0 state's backlog folded at start (memory_compact_at_start)
        self._fold_progress = (0, 0)
        self.fold_report: dict | None = None
        self.reloads = 0
        self._threads: list[threading.Thread] = []
        self._update_gauges()
        atexit.register(_close_at_exit, weakref.ref(self))
        if start_threads:
            self.start()

    # ------------------------------------------------------------------ background work
    def start(self) -> None:
        if self._threads:
            return
        t = threading.Thread(target=self._precompute, args=(self.state,), name="memsifter-units", daemon=True)
        t.start()
        self._threads.append(t)
        f = threading.Thread(target=self._fold_backlog, name="memsifter-fold", daemon=True)
        f.start()
        self._threads.append(f)
        if self.cfg.reload_poll_s > 0:
            w = threading.Thread(target=self._watch, name="memsifter-reload", daemon=True)
            w.start()
            self._threads.append(w)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the background work and wait for it (a forward pass in flight ends first): a process that
        exits after this, or whose interpreter exits with the service open (an ``atexit`` hook calls it),
        exits cleanly instead of aborting under a thread still inside the model."""
        self._stop.set()
        deadline = time.time() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.time()))
        st = self.state
        if st is not None:
            st.encoder.close()

    def _precompute(self, st: State) -> None:
        """Warm-up (the encoder loaded, one query through it), then every session's unit vectors: what
        :meth:`readiness` waits for, so that the first query costs what any query does."""
        if st.settings.method not in DENSE_METHODS:
            settle_heap()
            st.units_ready = True
            self._warm.set()
            return
        try:
            t0 = time.time()
            st.encoder.encode([st.settings.query_instruction + "warm-up"], urgent=True)
            log.info("serve: query encoder loaded and warm in %.1fs", time.time() - t0)
        except Exception as e:  # noqa: BLE001 - a query will say what is wrong
            log.error("serve: loading the query encoder failed: %s", redact(f"{type(e).__name__}: {e}", self.secrets))
            return
        if not self.cfg.precompute_units:
            settle_heap()
            self._warm.set()
            return
        self._warm.set()
        try:
            t0 = time.time()
            n = st.units.ensure(st.index.sessions.values(), chunk=16, stop=self._stop)
            if self._stop.is_set():
                return
            settle_heap()   # before ready: what a ready service answers from is frozen
            st.units_ready = True
            self._update_gauges()
            log.info("serve: unit vectors of %d sessions ready (%d embedded here) in %.1fs",
                     len(st.index.sessions), n, time.time() - t0)
        except Exception as e:  # noqa: BLE001 - queries still embed what they need
            log.error("serve: embedding the units failed: %s", redact(f"{type(e).__name__}: {e}", self.secrets))

    def _fold_backlog(self) -> None:
        """``memory_compact_at_start``: every mem0 owner with more than ``memory_compact_files`` event files
        folded into a snapshot before the replica is ready (:func:`memsifter.service.mem0.compact_backlog`), so
        that the folds of a state never compacted do not run on the serving cores during its first traffic."""
        cfg = self.cfg
        limit = getattr(cfg, "memory_compact_files", 0)
        try:
            if cfg.state and limit and getattr(cfg, "memory_compact_at_start", True):
                from .mem0 import compact_backlog

                def progress(done: int, total: int) -> None:
                    self._fold_progress = (done, total)

                self.fold_report = compact_backlog(cfg.state, limit, cfg.memory_compact_grace_s, stop=self._stop,
                                                   progress=progress)
                r = self.fold_report
                if r["owners"]:
                    log.info("serve: mem0 logs at start: %d owner(s) listed, %d folded (%d event files) in %.1fs",
                             r["owners"], r["folded_owners"], r["folded_files"], r["seconds"])
        except Exception as e:  # noqa: BLE001 - the state unreadable now: its owners fold on their first read
            log.error("serve: folding the mem0 logs at start failed: %s",
                      redact(f"{type(e).__name__}: {e}", self.secrets))
        finally:
            self._folded.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.reload_poll_s):
            try:
                self.reload_if_changed()
            except Exception as e:  # noqa: BLE001 - keep serving the index we have
                self.metrics.reloads.labels("error").inc()
                log.warning("serve: reload of %s failed, still serving the index of %s: %s", redact(self.cfg.index),
                            self.state.index.manifest.get("published_at"),
                            redact(f"{type(e).__name__}: {str(e)[:300]}", self.secrets))

    def reload_if_changed(self) -> bool:
        """Load the index again when its ``_SUCCESS`` changed (blocking; the old one serves meanwhile)."""
        digest = manifest_digest(self.cfg.index)
        if not digest or digest == self.state.index.digest:
            return False
        old = self.state
        index = PublishedIndex.load(self.cfg, previous=old.index)
        same = index.settings.spec.key == old.settings.spec.key and index.settings.turn_words == old.settings.turn_words
        encoder = old.encoder if same else Encoder(index.settings.spec, self.cfg.torch_threads, self.cfg.query_pass_tokens,
                                                   query_process(self.cfg))
        if not same and index.settings.method in DENSE_METHODS:   # warm before it serves
            encoder.encode([index.settings.query_instruction + "warm-up"], urgent=True)
        units = old.units if same else Units(index.vectors, encoder, index.settings.turn_words)
        units.vectors = index.vectors
        st = State(index, encoder, units)
        if index.settings.method in DENSE_METHODS and self.cfg.precompute_units:
            units.ensure(index.sessions.values(), chunk=128)
        st.units_ready = index.settings.method not in DENSE_METHODS or self.cfg.precompute_units
        self.state = st   # one reference swap: requests in flight keep the state they started with
        if encoder is not old.encoder:   # its query process, if any, is not needed any more
            old.encoder.close()
        del old
        release_memory()
        self.reloads += 1
        self.metrics.reloads.labels("ok").inc()
        self._update_gauges()
        log.info("serve: reloaded %s (published %s) in %.1fs, reused: %s", redact(self.cfg.index),
                 index.manifest.get("published_at"), index.load_seconds, index.reused)
        return True

    def _update_gauges(self) -> None:
        st = self.state
        self.metrics.corpora.labels("published").set(len(st.index.corpora))
        self.metrics.sessions.labels("published").set(len(st.index.sessions))
        mems = [m for m in list(self._memories.values()) if m.corpus]
        self.metrics.corpora.labels("memory").set(len(mems))
        self.metrics.sessions.labels("memory").set(sum(len(m.corpus) for m in mems))
        self.metrics.units.set(st.units.count())

    # ------------------------------------------------------------------ auth
    def principal(self, authorization: str | None, x_api_key: str | None) -> Principal:
        return self.keys.principal(authorization, x_api_key)

    # ------------------------------------------------------------------ first stage
    def _encode_queries(self, texts: list[str]) -> list[np.ndarray]:
        st = self.state
        return list(st.encoder.encode(texts, urgent=True))

    async def query_vector(self, st: State, query: str) -> np.ndarray:
        text = st.settings.query_instruction + query
        if self.cfg.reuse_query_vectors:
            v = st.index.vectors.published_vector(embedding.text_hash(text))
            if v is not None:
                return v
        return await self._batcher.submit(text)

    async def first_stage(self, st: State, corpus: Corpus, query: str) -> tuple[list[int], np.ndarray]:
        if not len(corpus):
            return [], np.zeros(0)
        qv = await self.query_vector(st, query) if st.settings.method in DENSE_METHODS else None
        ready = st.units_ready or all(s in st.units for s in corpus.sessions)
        if ready:
            scores = score_corpus(corpus, query, qv, st.units, st.settings)
        else:   # some units are not embedded yet: that blocks, off the event loop
            scores = await asyncio.to_thread(score_corpus, corpus, query, qv, st.units, st.settings)
        return order_of(scores), scores

    async def ranked(self, st: State, corpus: Corpus, query: str, order: list[int],
                     key: str) -> tuple[list[int], dict]:
        """The ranker's order over the first stage's top candidates (then the rest of the first stage's),
        or the first stage's order with why (``status: fallback``)."""
        if self.ranker is None:
            self.metrics.fallbacks.labels("no_ranker").inc()
            return order, {"status": "fallback", "reason": "no ranker is configured"}
        n = self.cfg.ranker.candidates if self.cfg.ranker else 50
        top = order[:n]
        chrono = sorted(top)
        req = RankRequest(question=query, key=key, sessions=[corpus.sessions[i] for i in chrono],
                          dates=[corpus.dates[i] for i in chrono], order=[corpus.sessions[i].session_id for i in top])
        try:
            row = await asyncio.wait_for(self.ranker(req), self.cfg.limits.ranker_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.fallbacks.labels("timeout").inc()
            return order, {"status": "fallback", "reason": f"ranker timed out after {self.cfg.limits.ranker_timeout_s:g}s"}
        except Exception as e:  # noqa: BLE001 - any ranker failure: the first stage answers
            self.metrics.fallbacks.labels("error").inc()
            why = redact(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}",
                         self.secrets)
            log.warning("serve: ranker failed, answering with the first stage: %s", why)
            return order, {"status": "fallback", "reason": f"ranker error: {why}"}
        if row.get("status") != "ok":
            self.metrics.fallbacks.labels(str(row.get("status"))).inc()
            return order, {"status": "fallback", "reason": f"ranker {row.get('status')}: {row.get('reason')}"}
        pos = {s.session_id: i for i, s in enumerate(corpus.sessions)}
        head = [pos[s] for s in row["ranked_session_ids"] if s in pos]
        seen = set(head)
        return head + [i for i in order if i not in seen], {"status": "ok", "reason": row.get("reason")}

    # ------------------------------------------------------------------ corpora
    def published(self, st: State, corpus_id: str) -> Corpus | None:
        return st.index.corpora.get(corpus_id)

    def _lock(self, user_id: str) -> asyncio.Lock:
        lock = self._locks.get(user_id)
        if lock is None:
            lock = self._locks[user_id] = asyncio.Lock()
        return lock

    def _need_state(self) -> str:
        if not self.cfg.state:
            raise ApiError(503, "user memories need a state store: start the service with state (a local dir or "
                           "s3:// URI)")
        return self.cfg.state

    async def _build_memory(self, st: State, mem: M.UserMemory) -> MemoryCorpus:
        sessions = list(mem.sessions)
        dates = [s.date for s in sessions]

        def build() -> Corpus:
            if st.settings.method in DENSE_METHODS:
                st.units.ensure(sessions)
            lex = build_lexical(sessions, dates, st.settings.method, st.settings.turn_words, st.settings.stem)
            return Corpus(mem.user_id, sessions, dates, lex, "memory")
        corpus = await asyncio.to_thread(build) if sessions else None
        return MemoryCorpus(mem, corpus, st.key())

    async def memory(self, st: State, user_id: str, fresh: bool = False) -> MemoryCorpus | None:
        """The user's memory as a corpus, re-read from the store when older than ``memory_refresh_s`` (appends
        of other replicas) or built for other settings (a reload); None without a state or any session."""
        if not self.cfg.state:
            return None
        cur = self._memories.get(user_id)
        if cur and not fresh and cur.key == st.key() and time.time() - cur.mem.checked_at < self.cfg.memory_refresh_s:
            return cur
        lock = self._lock(user_id)
        try:
            async with lock:
                cur = self._memories.get(user_id)
                if cur and not fresh and cur.key == st.key() and \
                        time.time() - cur.mem.checked_at < self.cfg.memory_refresh_s:
                    return cur
                mem = await asyncio.to_thread(M.read_segments, self.cfg.state, user_id, cur.mem if cur else None)
                if cur and cur.key == st.key() and mem.segments == cur.mem.segments:
                    cur.mem.checked_at = mem.checked_at
                    return cur
                built = await self._build_memory(st, mem)
                if built.corpus is None:   # no memories: nothing kept for an id anyone may ask about
                    self._memories.pop(user_id, None)
                    return None
                self._memories[user_id] = built
                self._update_gauges()
                return built
        finally:
            if user_id not in self._memories and not lock.locked() and not getattr(lock, "_waiters", None):
                self._locks.pop(user_id, None)

    async def corpus(self, st: State, corpus_id: str) -> Corpus:
        c = self.published(st, corpus_id)
        if c is not None:
            return c
        m = await self.memory(st, corpus_id)
        if m is None or m.corpus is None:
            raise ApiError(404, f"no corpus or user memory '{corpus_id}'")
        return m.corpus

    # ------------------------------------------------------------------ documents
    @staticmethod
    def document(corpus: Corpus, i: int) -> dict:
        s = corpus.sessions[i]
        return {"id": s.session_id, "contents": corpus_title(s, corpus.dates[i]) + "\n" + render_session(s.turns)}

    @staticmethod
    def score_value(x: float) -> float:
        x = float(x)
        return x if math.isfinite(x) else (-1e30 if x < 0 else 1e30)

    # ------------------------------------------------------------------ routes
    def _check_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ApiError(422, f"mode: expected one of {', '.join(MODES)}")

    def _check_query(self, q: str, where: str) -> None:
        if len(q) > self.cfg.limits.max_query_chars:
            raise ApiError(422, f"{where}: {len(q)} characters, at most {self.cfg.limits.max_query_chars} "
                           "(limits.max_query_chars)")
        if not q.strip():
            raise ApiError(422, f"{where}: empty query")

    def _check_topk(self, k: int, name: str) -> None:
        if k < 1 or k > self.cfg.limits.max_topk:
            raise ApiError(422, f"{name}: {k} is outside 1..{self.cfg.limits.max_topk} (limits.max_topk)")

    def resolve_corpus(self, principal: Principal, corpus_id: str | None) -> str:
        cid = corpus_id or principal.grant.single_read() or self.cfg.default_corpus
        if not cid:
            raise ApiError(400, "no corpus named: give corpus_id in the body or POST /u/{corpus_id}/retrieve")
        if not ID_RE.match(cid):
            raise ApiError(422, "corpus_id: not a valid id (letters, digits and _.:@+=-, at most 200)")
        principal.require("read", cid)
        return cid

    async def retrieve(self, principal: Principal, queries: list[str], topk: int | None, return_scores: bool,
                       corpus_id: str | None, mode: str = "first_stage") -> dict:
        """Search-R1's ``/retrieve``: per query, the top ``topk`` sessions of the corpus as documents."""
        self._check_mode(mode)
        if len(queries) > self.cfg.limits.max_queries:
            raise ApiError(413, f"queries: {len(queries)} in one request, at most {self.cfg.limits.max_queries} "
                           "(limits.max_queries)")
        if not queries:
            raise ApiError(422, "queries: empty list")
        for i, q in enumerate(queries):
            self._check_query(q, f"queries[{i}]")
        k = self.cfg.default_topk if topk is None else topk
        self._check_topk(k, "topk")
        cid = self.resolve_corpus(principal, corpus_id)
        st = self.state
        corpus = await self.corpus(st, cid)

        async def one(qi: int, q: str) -> tuple[list, dict | None]:
            order, scores = await self.first_stage(st, corpus, q)
            info = None
            if mode == "ranked":
                order, info = await self.ranked(st, corpus, q, order, f"{cid}:{qi}")
            self.metrics.queries.labels(mode).inc()
            docs = []
            for i in order[:k]:
                d = self.document(corpus, i)
                docs.append({"document": d, "score": self.score_value(scores[i])} if return_scores else d)
            return docs, info

        results = await asyncio.gather(*(one(i, q) for i, q in enumerate(queries)))
        out: dict[str, Any] = {"result": [docs for docs, _ in results]}
        if mode == "ranked":
            out["ranker"] = [info for _, info in results]
        return out

    async def search(self, principal: Principal, user_id: str, query: str, top_k: int, mode: str) -> dict:
        self._check_mode(mode)
        self._check_query(query, "query")
        self._check_topk(top_k, "top_k")
        principal.require("read", user_id)
        st = self.state
        corpus = await self.corpus(st, user_id)
        order, scores = await self.first_stage(st, corpus, query)
        info = {"status": "off", "reason": None}
        if mode == "ranked":
            order, info = await self.ranked(st, corpus, query, order, user_id)
        self.metrics.queries.labels(mode).inc()
        results = []
        for rank, i in enumerate(order[:top_k]):
            s = corpus.sessions[i]
            results.append({"session_id": s.session_id, "date": corpus.dates[i], "rank": rank + 1,
                            "score": self.score_value(scores[i]), "contents": self.document(corpus, i)["contents"]})
        return {"user_id": user_id, "mode": mode, "method": st.settings.method, "results": results, "ranker": info}

    async def add_memories(self, principal: Principal, user_id: str, sessions: list[dict]) -> dict:
        """Append sessions to a user's memory: persisted (one atomic segment) before the answer, indexed at
        once; a session id already in the memory is not added again (``duplicates``)."""
        principal.require("write", user_id)
        state = self._need_state()
        st = self.state
        if self.published(st, user_id) is not None:
            raise ApiError(409, f"'{user_id}' is a corpus of the published index (read only); choose another user_id")
        lim = self.cfg.limits
        if len(sessions) > lim.max_sessions_per_append:
            raise ApiError(413, f"sessions: {len(sessions)} in one request, at most {lim.max_sessions_per_append} "
                           "(limits.max_sessions_per_append)")
        incoming: list[Session] = []
        for n, s in enumerate(sessions):
            turns = [{"role": t["role"], "content": t["content"]} for t in s["turns"]]
            if len(turns) > lim.max_turns_per_session:
                raise ApiError(413, f"sessions[{n}].turns: {len(turns)} turns, at most {lim.max_turns_per_session}")
            for j, t in enumerate(turns):
                if len(t["content"]) > lim.max_turn_chars:
                    raise ApiError(413, f"sessions[{n}].turns[{j}].content: {len(t['content'])} characters, at most "
                                   f"{lim.max_turn_chars} (limits.max_turn_chars)")
            sid = s.get("session_id") or f"s-{content_hash(turns)[:16]}"
            incoming.append(Session(sid, turns, s.get("date")))
        async with self._lock(user_id):
            cur = self._memories.get(user_id)
            mem = await asyncio.to_thread(M.read_segments, state, user_id, cur.mem if cur else None)
            have = mem.ids()
            new, dup = [], []
            for s in incoming:
                if s.session_id in have:
                    dup.append(s.session_id)
                else:
                    have.add(s.session_id)
                    new.append(s)
            if len(mem.sessions) + len(new) > lim.max_user_sessions:
                raise ApiError(413, f"user '{user_id}' would hold {len(mem.sessions) + len(new)} sessions, at most "
                               f"{lim.max_user_sessions} (limits.max_user_sessions)")
            if new:
                if st.settings.method in DENSE_METHODS:   # vectors first: a crash leaves no half-indexed session
                    await asyncio.to_thread(st.units.ensure, new)
                name = await asyncio.to_thread(M.write_segment, state, user_id, new)
                mem.sessions.extend(new)
                mem.segments.append(name)
                self.metrics.appended.inc(len(new))
            self._memories[user_id] = await self._build_memory(st, mem)
        self._update_gauges()
        return {"user_id": user_id, "added": [s.session_id for s in new], "duplicates": dup,
                "sessions": len(mem.sessions)}

    async def delete_memories(self, principal: Principal, user_id: str) -> dict:
        principal.require("write", user_id)
        state = self._need_state()
        if self.published(self.state, user_id) is not None:
            raise ApiError(409, f"'{user_id}' is a corpus of the published index (read only)")
        async with self._lock(user_id):
            cur = self._memories.get(user_id)
            mem = await asyncio.to_thread(M.read_segments, state, user_id, cur.mem if cur else None)
            if not mem.segments:
                raise ApiError(404, f"no memories for user '{user_id}'")
            await asyncio.to_thread(M.delete_user, state, user_id)
            self._memories.pop(user_id, None)
        self._update_gauges()
        return {"user_id": user_id, "deleted": len(mem.sessions)}

    def readiness(self) -> tuple[bool, str | None]:
        """Ready = a query now costs what any query does: the index loaded, the query encoder loaded and
        warm, (``precompute_units``) every session's unit vectors built, and (``memory_compact_at_start``) the
        mem0 logs folded; else what is still loading."""
        st = self.state
        if not self._warm.is_set():
            return False, "loading the query encoder"
        if self.cfg.precompute_units and st.settings.method in DENSE_METHODS and not st.units_ready:
            return False, f"embedding the sessions' units ({st.units.count()} unit vectors so far)"
        if self._threads and not self._folded.is_set():
            done, total = self._fold_progress
            return False, f"folding the mem0 owners' logs ({done} of {total or '?'} owners)"
        return True, None

    def health(self, detail: bool = True) -> dict:
        """Liveness: ``status`` ok once ready, ``loading`` before (see :meth:`readiness`); with ``detail``
        (a caller with access) what is loaded."""
        st = self.state
        ready, _ = self.readiness()
        out = {"status": "ok" if ready else "loading", "ready": ready}
        if not detail:
            return out
        return {**out, **st.index.stats(), "units_ready": st.units_ready, "reloads": self.reloads,
                "memories_loaded": len(self._memories), "ranker": self.ranker is not None}

    def log_error(self, where: str, exc: BaseException) -> str:
        """Log an unexpected error (redacted, with its traceback: server side only); returns an id."""
        rid = f"{time.time_ns():x}"[-10:]
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        log.error("serve: %s failed (error id %s): %s", where, rid, redact(text, self.secrets))
        return rid
