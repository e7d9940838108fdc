"""The first stage online: an embed stage's publication loaded as per-corpus indexes, scored per query with
the embed stage's own code (:func:`memsifter.retrieval.first_stage.score_haystack`).

What an embed output holds and what is read of it: ``_SUCCESS`` (its config: model, pooling, length,
dtype, query instruction, ``turn_words``, ``stem``, ``rrf_k``, ``zsum_k``, ``cascade_k``; its stats:
``primary`` and ``model_key``), the embedding store (``<config.store or output/_work/embeddings>/<model
key>/``: the question vectors and the unit vectors of the sessions it re-scored) and the dataset it read
(``config.input``: ``sessions.parquet`` + ``questions.parquet``). ``rankings*.parquet`` are not needed
to serve; a test compares the service's answers with them.

Corpora. A *corpus* is one haystack: the sessions a query is ranked over. A published dataset gives one
corpus per question, with the question's id as the corpus id (LongMemEval gives each question its own
haystack, with dates per question; LoCoMo's questions of one conversation share theirs, and identical
haystacks share one index). User memories (:mod:`memsifter.service.memory`) are corpora too, keyed by
user id.

Identity with the embed stage. For a question of the dataset, the service's order equals
``rankings.parquet``'s: the BM25 views are built from the same tokens with the same library
(:class:`memsifter.retrieval.first_stage.HaystackLexical`), the dense leg reads the unit vectors the stage stored
(sessions the stage never re-scored get theirs computed here, by the same model), and with
``reuse_query_vectors`` a query whose exact text the stage embedded gets that stored vector; fusion is
:func:`memsifter.retrieval.first_stage.rescored_scores`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..models import embedding
from ..store import storage
from ..data.model import Dataset, Session, read_dataset
from ..errors import ConfigError
from ..retrieval import first_stage as F
from .config import QUERY_PASS_TOKENS, ServeConfig

log = logging.getLogger(__name__)

SERVED = ("zsum", "cascade", "bm25", "bm25_dated", "bm25_window")
DENSE_METHODS = ("zsum", "cascade")
EMBED_DEFAULTS = {"query_instruction": "", "turn_words": 200, "stem": True, "rrf_k": 60, "zsum_k": F.ZSUM_K,
                  "cascade_k": 5, "pooling": "auto", "max_length": None, "dtype": "auto", "store": None}


def views_of(method: str) -> tuple[str, ...]:
    """The BM25 views a method reads."""
    return F.LEXICAL_LEGS if method in DENSE_METHODS else (method,)


# --------------------------------------------------------------------------- vectors
BULK_BATCH = 4


def length_groups(lengths: Sequence[int], call_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` (token counts) grouped for forward passes: groups of neighbours in length order,
    chosen so that ``call_tokens`` per pass plus each group's size x its longest length is least (exact: a
    shortest path over the sorted lengths). Queries of mixed lengths in one padded batch all run at the longest
    one's length; alike lengths stay one batch. A forward pass costs about its padded tokens plus a fixed part,
    ``call_tokens`` (the service's ``query_pass_tokens``): for all-MiniLM-L6-v2 on a CPU about 40, one ~22-token
    question taking about what 32 of them take per question in length groups twice over
    (benchmarks/bench_query_encoder.py); 0 gives every length its own pass, a large value one padded batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    best, start = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):   # group order[i:j], its longest is order[i]
            c = best[i] + call_tokens + (j - i) * lengths[order[i]]
            if c < best[j]:
                best[j], start[j] = c, i
    groups, j = [], n
    while j:
        groups.append(order[start[j]:j])
        j = start[j]
    return groups[::-1]


def encoder_threads(cores: int | None = None) -> int:
    """The query encoder's torch threads by default: the cores but one (the event loop's: HTTP, scoring,
    writes), at least 1, at most 2. On 2 cores a second torch thread competes with the event loop, and
    torch's threads spin while they wait for each other: a query's CPU time grew several-fold under load."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, min(2, cores - 1))


def encode_queries(model: embedding.Embedder, spec: embedding.ModelSpec, texts: list[str], batch_size: int,
                   pass_tokens: int) -> np.ndarray:
    """Vectors of a micro-batch of queries: ``batch_size`` at a time, each part in :func:`length_groups` (exact
    token counts, on this thread: the stage's tokenizer pool costs more than it saves here)."""
    out = np.zeros((len(texts), model.dim), dtype=np.float32)
    for part in range(0, len(texts), batch_size):
        lengths = [len(ids) for ids in model.tokenizer(texts[part:part + batch_size], truncation=True,
                                                        max_length=spec.max_length)["input_ids"]]
        for g in length_groups(lengths, pass_tokens):
            idx = [part + k for k in g]
            out[idx] = model.encode([texts[k] for k in idx])
    return out


def _query_worker(conn: Any, spec: embedding.ModelSpec, threads: int, pass_tokens: int) -> None:
    """The query encoder's process (:class:`QueryProcess`): the model loaded with ``threads`` torch threads, then
    each request (texts, batch size) answered with :func:`encode_queries`' vectors, until the pipe closes."""
    import signal

    import torch

    # Ctrl-C reaches the whole process group: the server stops, closes the pipe, and this process ends on EOF
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        model = embedding.Embedder(spec)
    except Exception as e:  # noqa: BLE001 - the parent says what failed
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", model.dim))
    while True:
        try:
            texts, batch_size = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", encode_queries(model, spec, texts, batch_size, pass_tokens))
        except Exception as e:  # noqa: BLE001 - this request fails, the process serves the next
            reply = ("error", f"{type(e).__name__}: {e}")
        conn.send(reply)


class QueryProcess:
    """The query encoder in a process of its own (``query_encoder_process``): the same model and computation
    (:func:`encode_queries`, the same torch threads), so the same vectors, but no GIL shared with the event
    loop. In one process the encoder thread needs the GIL back after each of a forward pass's ~100 operators,
    and the event loop holds it most of the time under load: on 2 cores, with 32 searchers and 8 writers, a
    pass of 16 queries took 210-225 ms of which 140 were its own CPU time (benchmarks/results/
    serve-writes-2026-11-28-fastroutes/README.md). Requests go one at a time over a pipe (the caller blocks
    without the GIL); a process that died is started again by the next request (:meth:`Encoder._worker`)."""

    def __init__(self, spec: embedding.ModelSpec, threads: int, pass_tokens: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")   # never fork a process that holds torch's and other threads
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_query_worker, args=(child, spec, threads, pass_tokens),
                                name="memsifter-query-encoder", daemon=True)
        self.proc.start()
        child.close()
        self._lock = threading.Lock()
        try:
            kind, info = self._conn.recv()
        except (EOFError, OSError):
            kind, info = "error", f"exit code {self.proc.exitcode}"
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the query encoder's process did not start: {info}")
        self.dim = int(info)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        with self._lock:
            try:
                self._conn.send((texts, batch_size))
                kind, out = self._conn.recv()
            except (EOFError, OSError) as e:
                raise RuntimeError(f"the query encoder's process ended (exit code {self.proc.exitcode})") from e
        if kind != "ok":
            raise RuntimeError(f"the query encoder's process: {out}")
        return out

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Encoder:
    """The embed stage's dense model in this process (loaded on first use), one forward pass at a time.
    With ``process``, queries (``urgent``) are encoded by the same model in a process of its own
    (:class:`QueryProcess`); the bulk work (sessions' units) stays here.

    Queries come first: a query's encode (``urgent``) waits for at most the one bulk batch in progress
    (:data:`BULK_BATCH` texts), never for the rest of a large append's or of the load's unit vectors, which
    yield the model between batches while a query waits."""

    def __init__(self, spec: embedding.ModelSpec, threads: int | None = None,
                 pass_tokens: int = QUERY_PASS_TOKENS, process: bool = False):
        self.spec, self.threads, self.pass_tokens, self.process = spec, threads, pass_tokens, process
        self._model: embedding.Embedder | None = None
        self._proc: QueryProcess | None = None
        self._proc_lock = threading.Lock()
        self._cv = threading.Condition()
        self._busy = False
        self._urgent = 0
        self.texts = 0

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def _worker(self) -> "QueryProcess":
        with self._proc_lock:
            if self._proc is None or not self._proc.alive():
                if self._proc is not None:
                    self._proc.close()
                self._proc = QueryProcess(self.spec, self.threads or encoder_threads(), self.pass_tokens)
            return self._proc

    def close(self) -> None:
        """Stop the query encoder's process (``process``), if one runs."""
        with self._proc_lock:
            if self._proc is not None:
                self._proc.close()
                self._proc = None

    @contextlib.contextmanager
    def _turn(self, urgent: bool) -> Iterator[None]:
        with self._cv:
            if urgent:
                self._urgent += 1
            try:
                while self._busy or (not urgent and self._urgent):
                    self._cv.wait()
            finally:
                if urgent:
                    self._urgent -= 1
            self._busy = True
        try:
            yield
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _load(self) -> embedding.Embedder:
        if self._model is None:
            import torch

            torch.set_num_threads(self.threads or encoder_threads())
            self._model = embedding.Embedder(self.spec)
        return self._model

    def encode(self, texts: Sequence[str], batch_size: int = 64, urgent: bool = False) -> np.ndarray:
        """Vectors of ``texts`` in order: ``urgent`` (a micro-batch of queries) in one turn of the model, in
        :func:`length_groups`; else length-bucketed batches as the stage plans them, :data:`BULK_BATCH` texts a
        turn."""
        texts = list(texts)
        if urgent and self.process:
            out = self._worker().encode(texts, batch_size)
            self.texts += len(texts)
            return out
        with self._turn(urgent):
            model = self._load()
        out = np.zeros((len(texts), model.dim), dtype=np.float32)
        items = [(str(i), t) for i, t in enumerate(texts)]
        if urgent:   # queries: a micro-batch in length groups (exact token counts), in one turn of the model
            with self._turn(True):
                out = encode_queries(model, self.spec, texts, batch_size, self.pass_tokens)
            self.texts += len(texts)
            return out
        batches = embedding.plan_batches(items, self.spec.max_length, max_batch_size=min(batch_size, BULK_BATCH))
        for b in batches:
            with self._turn(False):
                out[[int(i) for i, _ in b]] = model.encode([t for _, t in b])
        self.texts += len(texts)
        return out


class Vectors:
    """Vectors by text hash: the embed stage's store (read only), then the service's own (``<state>/
    embeddings``, written as shards like the stage's), then, without a state, memory."""

    def __init__(self, spec: embedding.ModelSpec, published: str, own: str | None):
        self.published = embedding.EmbeddingStore(published, spec)
        self.own = embedding.EmbeddingStore(own, spec) if own else None
        self.mem: dict[str, np.ndarray] = {}
        self.lock = threading.Lock()

    def load(self) -> None:
        self.published.load()
        if self.own is not None:
            self.own.load()

    def published_vector(self, h: str) -> np.ndarray | None:
        return self.published.get(h) if h in self.published else None

    def get(self, h: str) -> np.ndarray | None:
        if h in self.published:
            return self.published.get(h)
        if self.own is not None and h in self.own:
            return self.own.get(h)
        return self.mem.get(h)

    def add(self, hashes: list[str], vecs: np.ndarray) -> None:
        with self.lock:
            if self.own is not None:
                self.own.add_shard(hashes, vecs)
            else:
                for h, v in zip(hashes, vecs):
                    self.mem.setdefault(h, v.astype(np.float32))


class Units:
    """Per session (by content hash): the matrix of its :func:`~memsifter.retrieval.first_stage.cascade_units`'
    vectors, stacked as the stage stacks them (the dense leg's max-sim is then the same arithmetic)."""

    def __init__(self, vectors: Vectors, encoder: Encoder, turn_words: int):
        self.vectors, self.encoder, self.turn_words = vectors, encoder, turn_words
        self._mats: dict[str, np.ndarray] = {}
        self.lock = threading.Lock()
        self.embedded = 0

    def __contains__(self, s: Session) -> bool:
        return s.content_hash in self._mats

    def hashes(self, s: Session) -> list[str]:
        return [embedding.text_hash(t) for t in F.cascade_units(s.turns, self.turn_words)]

    def matrix(self, s: Session) -> np.ndarray:
        """The session's unit matrix, embedding what no store holds (blocking)."""
        m = self._mats.get(s.content_hash)
        if m is None:
            self.ensure([s], urgent=True)   # a query waits for it
            m = self._mats[s.content_hash]
        return m

    def ensure(self, sessions: Iterable[Session], chunk: int = 512,
               progress: Callable[[int], None] | None = None, urgent: bool = False,
               stop: threading.Event | None = None) -> int:
        """Build the matrices of ``sessions``, embedding missing units ``chunk`` texts at a time (so a
        query's own few units wait for at most one chunk). Returns how many texts were embedded."""
        todo = [s for s in {s.content_hash: s for s in sessions}.values() if s.content_hash not in self._mats]
        n = 0
        for i in range(0, len(todo), 64):
            if stop is not None and stop.is_set():   # the service is closing
                break
            group = todo[i:i + 64]
            texts: dict[str, str] = {}
            for s in group:
                for t in F.cascade_units(s.turns, self.turn_words):
                    h = embedding.text_hash(t)
                    if self.vectors.get(h) is None:
                        texts[h] = t
            items = sorted(texts.items())
            for j in range(0, len(items), chunk):
                if stop is not None and stop.is_set():
                    self.embedded += n
                    return n
                part = items[j:j + chunk]
                vecs = self.encoder.encode([t for _, t in part], urgent=urgent)
                self.vectors.add([h for h, _ in part], vecs)
                n += len(part)
                if progress:
                    progress(len(part))
            for s in group:
                mat = np.stack([self.vectors.get(h) for h in self.hashes(s)])
                with self.lock:
                    self._mats.setdefault(s.content_hash, mat)
        self.embedded += n
        return n

    def count(self) -> int:
        return sum(len(m) for m in list(self._mats.values()))


# --------------------------------------------------------------------------- corpora
@dataclass
class Corpus:
    """One haystack: its sessions in order (oldest first), each with its date, and its BM25 views."""

    corpus_id: str
    sessions: list[Session]
    dates: list[str | None]
    lexical: F.HaystackLexical | None
    kind: str = "published"                 # published | memory
    question: str | None = None             # a published corpus: its question
    version: int = 0

    @property
    def session_ids(self) -> list[str]:
        return [s.session_id for s in self.sessions]

    def __len__(self) -> int:
        return len(self.sessions)


def build_lexical(sessions: Sequence[Session], dates: Sequence[str | None], method: str, turn_words: int,
                  stem: bool) -> F.HaystackLexical | None:
    """The BM25 views ``method`` reads over ``sessions`` (tokens cached only while building)."""
    if not sessions:
        return None
    ids = [f"{i}" for i in range(len(sessions))]
    lex = F.Lexical(dict(zip(ids, sessions)), turn_words, stem)
    return lex.index(ids, list(dates), views_of(method))


@dataclass
class EmbedSettings:
    """What the service needs of the embed stage's config (its manifest)."""

    method: str
    query_instruction: str
    turn_words: int
    stem: bool
    rrf_k: int
    zsum_k: int
    cascade_k: int
    spec: embedding.ModelSpec
    store: str

    def ks(self) -> dict[str, int]:
        return {"cascade_k": self.cascade_k if self.method == "cascade" else 0,
                "zsum_k": self.zsum_k if self.method == "zsum" else 0, "rrf_k": self.rrf_k}


def embed_settings(cfg: ServeConfig, manifest: dict) -> EmbedSettings:
    if manifest.get("stage") != "embed":
        raise ConfigError(f"serve: index {cfg.index} is the output of stage '{manifest.get('stage')}', not embed: "
                          "name an embed stage's output")
    c = {**EMBED_DEFAULTS, **(manifest.get("config") or {})}
    method = cfg.method
    if method == "auto":
        method = (manifest.get("stats") or {}).get("primary") or "zsum"
    if method not in SERVED:
        raise ConfigError(f"serve: the index's primary method is '{method}', which the service does not serve "
                          f"(served: {', '.join(SERVED)}); set method to one of them")
    spec = embedding.ModelSpec.resolve(c["model"], c["pooling"], c["max_length"], c["dtype"])
    key = (manifest.get("stats") or {}).get("model_key")
    if key and key != spec.key and method in DENSE_METHODS:
        raise ConfigError(f"serve: the index's vectors are of model settings {key}, this machine resolves "
                          f"{c['model']!r} to {spec.key}: install the same model (same directory name and "
                          "settings) or re-run the embed stage here")
    store = c["store"] or storage.join(cfg.index, storage.WORK, "embeddings")
    return EmbedSettings(method=method, query_instruction=c["query_instruction"] or "",
                         turn_words=int(c["turn_words"]), stem=bool(c["stem"]), rrf_k=int(c["rrf_k"]),
                         zsum_k=int(c["zsum_k"]), cascade_k=int(c["cascade_k"]), spec=spec, store=store)


def dataset_uri(cfg: ServeConfig, manifest: dict) -> str:
    """The dataset to serve: the config's, else the embed stage's input (a relative path: from the
    working directory, else beside the index)."""
    if cfg.dataset:
        return cfg.dataset
    src = (manifest.get("config") or {}).get("input")
    if not src:
        raise ConfigError(f"serve: the index {cfg.index} names no input dataset; pass dataset")
    if storage.is_s3(src) or os.path.isabs(src) or storage.exists(storage.join(src, storage.MANIFEST)):
        return src
    if not storage.is_s3(cfg.index):
        beside = os.path.join(os.path.dirname(os.path.abspath(cfg.index.rstrip("/"))), src)
        if os.path.exists(os.path.join(beside, storage.MANIFEST)):
            return beside
    raise ConfigError(f"serve: the index's input dataset {src!r} is a relative path not found from here: pass "
                      "dataset (the import stage's output it was embedded from)")


def manifest_digest(uri: str) -> str | None:
    """sha256 of ``<uri>/_SUCCESS`` (None while absent: being re-published)."""
    m = storage.join(uri, storage.MANIFEST)
    try:
        return hashlib.sha256(storage.read_bytes(m)).hexdigest()
    except Exception:  # noqa: BLE001 - absent, or replaced while read: try again later
        return None


def corpus_title(session: Session, date: str | None) -> str:
    """The first line of a document's ``contents``: the session's date and id, on one line."""
    t = f"{date} | session {session.session_id}" if date else f"session {session.session_id}"
    return " ".join(t.split())


def corpus_key(sessions: Sequence[Session], dates: Sequence[str | None]) -> tuple:
    """What a corpus's BM25 views depend on: its sessions (ids and contents) and their dates, in order."""
    return tuple((s.session_id, s.content_hash) for s in sessions), tuple(dates)


@dataclass
class PublishedIndex:
    """One publication of the embed stage, loaded: settings, sessions, corpora. Immutable once built: a
    newer publication is loaded beside it and swapped in (:class:`memsifter.service.core.RetrievalService`)."""

    index: str
    digest: str
    manifest: dict
    settings: EmbedSettings
    dataset: str
    sessions: dict[str, Session]
    corpora: dict[str, Corpus]
    vectors: Vectors
    dataset_digest: str = ""
    loaded_at: float = field(default_factory=time.time)
    load_seconds: float = 0.0
    reused: str = "nothing"

    @classmethod
    def load(cls, cfg: ServeConfig, progress: Callable[[str], None] | None = None, lexical: bool = True,
             previous: "PublishedIndex | None" = None) -> "PublishedIndex":
        """The publication at ``cfg.index``. With ``previous`` (a reload), what did not change is shared
        with it, not built again: the dataset and every corpus when the dataset's ``_SUCCESS`` and the
        lexical settings are the same, else each corpus whose sessions, dates and contents are; the
        vectors when the store and model are (only new shards are read)."""
        t0 = time.time()
        digest = manifest_digest(cfg.index)
        manifest = storage.read_manifest(cfg.index)
        settings = embed_settings(cfg, manifest)
        ds_uri = dataset_uri(cfg, manifest)
        ds_digest = manifest_digest(ds_uri) or ""
        own = storage.join(cfg.state, "embeddings") if cfg.state else None
        vectors = Vectors(settings.spec, settings.store, own)
        if (previous is not None and previous.vectors.published.uri == vectors.published.uri
                and (previous.vectors.own.uri if previous.vectors.own else None) == (vectors.own.uri if vectors.own else None)):
            vectors = previous.vectors
        if settings.method in DENSE_METHODS:
            vectors.load()
        lex_key = (settings.method, settings.turn_words, settings.stem)
        prev_lex = previous is not None and lexical and (previous.settings.method, previous.settings.turn_words,
                                                         previous.settings.stem) == lex_key
        if prev_lex and ds_digest and previous.dataset == ds_uri and previous.dataset_digest == ds_digest:
            return cls(index=cfg.index, digest=digest or "", manifest=manifest, settings=settings, dataset=ds_uri,
                       sessions=previous.sessions, corpora=previous.corpora, vectors=vectors, dataset_digest=ds_digest,
                       load_seconds=round(time.time() - t0, 2), reused="dataset and corpora")
        ds: Dataset = read_dataset(ds_uri)
        shared: dict[tuple, F.HaystackLexical | None] = {}
        if prev_lex:
            for c in previous.corpora.values():
                shared.setdefault(corpus_key(c.sessions, c.dates), c.lexical)
        corpora: dict[str, Corpus] = {}
        for n, q in enumerate(ds.questions):
            hay = list(q.haystack_session_ids)
            dates = [q.date_of(s, ds.sessions) for s in hay]
            sess = [ds.sessions[s] for s in hay]
            key = corpus_key(sess, dates)
            if key not in shared:
                shared[key] = (build_lexical(sess, dates, settings.method, settings.turn_words, settings.stem)
                               if lexical else None)
            corpora[q.question_id] = Corpus(q.question_id, sess, dates, shared[key], "published", q.question)
            if progress and (n + 1) % 50 == 0:
                progress(f"BM25 views of {n + 1}/{len(ds.questions)} corpora")
        used = {s.session_id for c in corpora.values() for s in c.sessions}
        sessions = {k: v for k, v in ds.sessions.items() if k in used}
        return cls(index=cfg.index, digest=digest or "", manifest=manifest, settings=settings, dataset=ds_uri,
                   sessions=sessions, corpora=corpora, vectors=vectors, dataset_digest=ds_digest,
                   load_seconds=round(time.time() - t0, 2), reused="corpora with unchanged haystacks" if prev_lex else "nothing")

    def stats(self) -> dict[str, Any]:
        return {"index": self.index, "method": self.settings.method, "corpora": len(self.corpora),
                "sessions": len(self.sessions), "published_at": self.manifest.get("published_at"),
                "manifest_sha256": self.digest, "load_seconds": self.load_seconds, "reused": self.reused}


def score_corpus(corpus: Corpus, query: str, qv: np.ndarray | None, units: Units | None,
                 settings: EmbedSettings) -> np.ndarray:
    """The first-stage score of each of ``corpus``'s sessions for ``query`` (``qv``: its vector, for the
    dense methods): :func:`memsifter.retrieval.first_stage.score_haystack`, the embed stage's computation."""
    if corpus.lexical is None:
        return np.zeros(0)
    sessions = corpus.sessions

    def max_sim(i: int) -> float:
        return float((units.matrix(sessions[i]) @ qv).max())  # type: ignore[union-attr,operator]

    scores = F.score_haystack(query, corpus.lexical, max_sim, **settings.ks())
    return scores[settings.method]


def order_of(scores: np.ndarray) -> list[int]:
    """Indices by descending score, ties in haystack order (:func:`memsifter.retrieval.first_stage.order_by`)."""
    return F.order_by(scores)
