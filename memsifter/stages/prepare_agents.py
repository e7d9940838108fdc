"""Stage ``prepare-agents``: training data for the memory agents (issue 33): verl RL rows and SFT
warm-start traces, both built by the agents' own code (:mod:`memsifter.agents`).

Inputs: published datasets, ``embeddings`` (embed outputs: each question's first-stage order, and the
settings and vectors of the first stage the memory service serves), a recipe like prepare-rl's (per
split, ``{dataset: count}``), ``agents`` (any of ``agent:search``, ``agent:memory``,
``agent:memory+recall``).

Questions. Used: those with gold sessions, a non-empty answer, not abstention (LongMemEval ``_abs``), not
adversarial (LoCoMo category 5) and not of ``skip_question_types`` (LongMemEval's
``single-session-preference``, whose gold answer is a rubric, not an answer). Held-out disjointness: the one split of the training stages (:func:`memsifter.data.splits.choose`): no question
in two splits; with ``group_by_haystack`` (default) no conversation either (questions over the same session texts,
a LoCoMo conversation, go to one split; with LoCoMo's two sample conversations, one held out, one trained on); and
no session text: a later split's haystacks lose the texts an earlier split holds, and a question whose gold
session is such a text is left out. The split is published as ``split.json`` and summarised in the manifest's
``split`` stats (seed, question ids, conversations, session hash counts); ``sft`` checks it.

RL rows (verl parquet, ``train_00000.parquet`` ..., ``test.parquet`` and one file per other split):
one row per (question, agent)::

    agent_name    memsifter_search | memsifter_memory | memsifter_memory_recall (the verl agent loop:
                  :data:`memsifter.agents.verl_names.LOOPS`)
    data_source   "memsifter_agent" (:data:`memsifter.agents.verl_names.DATA_SOURCE`: the reward scores it
                  as an agent episode)
    prompt        the episode's first request's chat messages (what verl tokenizes and filters by length)
    ability       "memory_agent"
    reward_model  {style: "rule", ground_truth: gold answer}
    extra_info    split, index, question_id, question, question_date, dataset, answer, method,
                  corpus_id (the memory service's corpus of the question: its question id),
                  sessions (memory agents: the chunks read, [{session_id, date, text}], chronological;
                  [] for the search agent), haystack_sessions, chunk_source ("haystack": every session;
                  "first_stage": the top ``max_chunks`` of the first stage), gold_session_ids,
                  gold_in_chunks, group, agent_options (JSON of the agent constructor's kwargs)

The loop rebuilds the Task from ``extra_info``: ``Task(question_id, question, question_date,
sessions=[Session(**s) for s in sessions])`` for the memory agents, ``search=http_search(url,
corpus_id)`` for the search agent.

SFT traces (``sft_train.jsonl``, ``sft_test.jsonl``, ...; JSON lines, uncompressed: the store records
each published file's size and hash as written): each episode driven by the agent's ``oracle``
through :func:`memsifter.agents.base.requests_of`, the same generator that serves the model. The
search agent's searches are answered in process by the memory service's own scoring
(:func:`memsifter.service.index.score_corpus` over the question's haystack, with the embed output's
method, settings and stored vectors; ``bm25`` over the haystack for a question no embed output
covers), returned as the service's ``/retrieve`` documents read by the same parser
:func:`memsifter.agents.search.http_search` uses. One record per trajectory: a search episode is one
record (its turns continue one conversation), a memory episode one record per chunk request plus one
for the answer request. Record::

    messages     chat messages; the last is the assistant reply, earlier assistant messages are
                 replies too (trained), user messages are prompts and observations (masked)
    method, question_id, dataset, split, kind ("search" / "answer" / "chunk": the last request's kind),
    step (trajectory number in the episode), steps, stop (the last request's stop strings),
    max_tokens, answer (gold), evidence_seen (an evidence turn is in the trajectory's messages),
    variant (agent:search: which opening query, 0 = the keywords; ``search_traces``)

An episode gives traces only when the oracle's episode parses to the gold answer with every reply
well formed, and the model could have known: some evidence turn
(:func:`memsifter.agents.memory.gold_evidence`) is shown in it (a search hit, a chunk read); else it
is counted, not written (``skipped``). ``max_plain_chunks`` bounds the chunk records of a memory
episode whose section holds no evidence (the notes are copied unchanged): all evidence chunks and the
answer are kept, plus that many plain ones (seeded choice); null keeps all.

Manifest stats: the split (above), rows and traces per split and method, skipped episodes by reason, chunk counts, gold in
the chunks, prompt and trace tokens (``tokenizer``), bytes, seconds.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from typing import Any, Callable, Literal, Sequence

import pyarrow as pa
from pydantic import Field, field_validator

from ..agents.verl_names import DATA_SOURCE, LOOPS
from ..data.model import Dataset, Question
from ..errors import ConfigError, InputError
from ..stage import StageConfig, stage, uri_field
from ..store import storage
from ..data import splits
from ..data.recipe import load_datasets, load_recipe
from ..data.splits import read_rows, shard_sizes  # noqa: F401 (read_rows: this output's rows, for callers)

log = logging.getLogger(__name__)

AGENT_NAMES = {method: name for name, method in LOOPS.items()}   # the verl agent loops' names
Method = Literal["agent:search", "agent:memory", "agent:memory+recall"]
SEARCH_METHODS = ("auto", "zsum", "cascade", "bm25", "bm25_dated", "bm25_window")

TURN = pa.struct([("role", pa.string()), ("content", pa.string())])
SESSION = pa.struct([("session_id", pa.string()), ("date", pa.string()), ("text", pa.string())])
EXTRA_INFO = pa.struct([
    ("split", pa.string()), ("index", pa.int64()), ("question_id", pa.string()), ("question", pa.string()),
    ("question_date", pa.string()), ("dataset", pa.string()), ("answer", pa.string()), ("method", pa.string()),
    ("corpus_id", pa.string()), ("sessions", pa.list_(SESSION)), ("haystack_sessions", pa.int64()),
    ("chunk_source", pa.string()), ("gold_session_ids", pa.list_(pa.string())), ("gold_in_chunks", pa.bool_()),
    ("group", pa.string()), ("agent_options", pa.string()),
])
ROW_SCHEMA = pa.schema([
    ("data_source", pa.string()), ("agent_name", pa.string()), ("prompt", pa.list_(TURN)), ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", EXTRA_INFO),
])


class PrepareAgentsConfig(StageConfig):
    datasets: list[str] = uri_field("published datasets (import/synth outputs)", min_length=1,
                                    stage=("import", "synth"))
    embeddings: list[str] = uri_field(
        "embed outputs covering the questions: their first-stage order picks a memory agent's chunks on "
        "haystacks longer than max_chunks, and the search oracle scores with their method, settings and "
        "vectors (the memory service's first stage)", [], stage="embed")
    recipe: dict[str, dict[str, int]] = Field(
        description="per split, {dataset: count}; or the URI of a YAML/JSON file holding that mapping")
    agents: list[Method] = Field(["agent:search", "agent:memory", "agent:memory+recall"], min_length=1,
                                 description="agents to prepare rows and traces for")
    agent_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per agent method, constructor kwargs (e.g. {'agent:search': {topk: 3}}); "
        "recorded in each row's extra_info.agent_options so the verl loop builds the same agent")
    group_by_haystack: bool = Field(True, description="questions sharing a haystack (a LoCoMo conversation) go to "
                                    "one split only: the held-out split is disjoint by conversation")
    skip_question_types: list[str] = Field(["single-session-preference"], description="question types left out "
                                           "(LongMemEval's preference questions have rubrics as answers)")
    max_chunks: int = Field(20, ge=1, description="memory agents read at most this many sessions: the whole "
                            "haystack when it is not longer (LoCoMo: 19), else the first stage's top max_chunks in "
                            "chronological order (LongMemEval_S: ~48 sessions; needs embeddings)")
    search_method: Literal[SEARCH_METHODS] = Field(
        "auto", description="first-stage method of the search oracle (auto: the embed output's primary, as the "
        "memory service serves it); questions no embed output covers are searched with bm25")
    traces: bool = Field(True, description="also write the SFT traces")
    search_traces: int = Field(1, ge=1, le=4, description="agent:search episodes per question for the traces, each "
                               "opening with another query (memsifter.agents.search.query_variants: the keywords, "
                               "the question, the keywords' second half, their first half); identical ones kept once")
    search_retry: bool = Field(False, description="the search oracle searches again with the next query while its "
                               "hits show no evidence turn (up to the agent's max_turns), so a first search that "
                               "missed still gives a trace, one that searches again")
    max_plain_chunks: int | None = Field(4, ge=0, description="chunk records per memory episode whose section "
                                         "holds no evidence (notes copied unchanged), beside every evidence chunk "
                                         "and the answer; null: all")
    tokenizer: str | None = Field("smollm2-135m-instruct", description="tokenizer (and chat template) counting "
                                  "prompt and trace tokens for the stats; null: no counts")
    seed: int = 0
    shard_rows: int = Field(2000, gt=0, description="train rows per parquet file at most")

    @field_validator("recipe", mode="before")
    @classmethod
    def _recipe(cls, v: Any) -> Any:
        return load_recipe(v)

    @field_validator("agent_options")
    @classmethod
    def _options(cls, v: dict) -> dict:
        for k, opts in v.items():
            if k not in AGENT_NAMES:
                raise ValueError(f"agent_options: unknown agent '{k}' (known: {', '.join(AGENT_NAMES)})")
            if "count_tokens" in opts or "recall" in opts:
                raise ValueError(f"agent_options.{k}: count_tokens and recall are not options here")
        return v


# --------------------------------------------------------------------------- inputs
def usable(q: Question, skip_types: Sequence[str]) -> str | None:
    """Why a question gives no agent data (None: it does)."""
    if q.abstention:
        return "abstention"
    if q.extra.get("adversarial") or q.extra.get("no_answer"):
        return "adversarial"
    if not (q.answer or "").strip():
        return "no_answer"
    if not q.gold_session_ids:
        return "no_gold"
    if q.question_type in skip_types:
        return "question_type"
    return None


def group_of(q: Question, by_haystack: bool, sessions: dict) -> str:
    """The question's group in the split (:func:`memsifter.data.splits.group_key`: its haystack's texts)."""
    return splits.group_key(q, sessions) if by_haystack else q.question_id


# --------------------------------------------------------------------------- search in process
class Searcher:
    """The memory service's first stage over one question's haystack, in this process: the corpus is
    built as :meth:`memsifter.service.index.PublishedIndex.load` builds it, scored by
    :func:`memsifter.service.index.score_corpus` with the embed output's settings (and its stored vectors,
    the model loaded only when a vector is missing), and each hit read from the ``/retrieve`` document
    the service would send, with the search agent's own reader."""

    def __init__(self, embeddings: list[str], method: str):
        from ..service import index as ix
        from ..service.config import ServeConfig

        self.ix = ix
        self.settings: dict[str, Any] = {}
        for uri in embeddings:
            manifest = storage.read_manifest(uri)
            try:
                self.settings[uri] = ix.embed_settings(ServeConfig(index=uri, method=method), manifest)
            except ConfigError as e:
                raise InputError(str(e), file=uri, field="embeddings") from None
        d = ix.EMBED_DEFAULTS
        self.fallback = ix.EmbedSettings(method="bm25", query_instruction="", turn_words=d["turn_words"],
                                         stem=d["stem"], rrf_k=d["rrf_k"], zsum_k=d["zsum_k"],
                                         cascade_k=d["cascade_k"], spec=None, store="")  # type: ignore[arg-type]
        self._dense: dict[str, tuple[Any, Any, Any]] = {}

    def dense(self, uri: str) -> tuple[Any, Any, Any]:
        """(vectors, encoder, units) of an embed output (loaded once)."""
        if uri not in self._dense:
            ix, st = self.ix, self.settings[uri]
            vectors = ix.Vectors(st.spec, st.store, None)
            vectors.load()
            encoder = ix.Encoder(st.spec)
            self._dense[uri] = (vectors, encoder, ix.Units(vectors, encoder, st.turn_words))
        return self._dense[uri]

    def for_question(self, ds: Dataset, q: Question, source: str | None) -> tuple[Callable, str]:
        """The question's :data:`memsifter.agents.base.Search` and the method it scores with."""
        from ..agents.base import Hit
        from ..agents.search import _title
        from ..retrieval.render import render_session
        from ..models import embedding

        ix = self.ix
        st = self.settings.get(source) if source else None
        st = st or self.fallback
        hay = list(q.haystack_session_ids)
        sess = [ds.sessions[s] for s in hay]
        dates = [q.date_of(s, ds.sessions) for s in hay]
        corpus = ix.Corpus(q.question_id, sess, dates,
                           ix.build_lexical(sess, dates, st.method, st.turn_words, st.stem), "published", q.question)
        dense = st.method in ix.DENSE_METHODS

        def search(query: str, k: int) -> list:
            qv, units = None, None
            if dense:
                vectors, encoder, units = self.dense(source)  # type: ignore[arg-type]
                text = st.query_instruction + query
                qv = vectors.published_vector(embedding.text_hash(text))
                if qv is None:
                    qv = encoder.encode([text])[0]
            scores = ix.score_corpus(corpus, query, qv, units, st)
            hits = []
            for i in ix.order_of(scores)[:k]:
                s = corpus.sessions[i]
                contents = ix.corpus_title(s, corpus.dates[i]) + "\n" + render_session(s.turns)
                date, text = _title(contents)
                x = float(scores[i])
                x = x if math.isfinite(x) else (-1e30 if x < 0 else 1e30)
                hits.append(Hit(session_id=s.session_id, text=text, score=x, date=date))
            return hits

        return search, st.method


# --------------------------------------------------------------------------- episodes
class Builder:
    def __init__(self, config: PrepareAgentsConfig, ds: Dataset, orders: dict[str, tuple[str, list[str]]]):
        from ..agents import base

        self.config, self.ds, self.orders = config, ds, orders
        self.classes = base.registry()
        self.agents = {m: self.classes[m](**config.agent_options.get(m, {})) for m in config.agents}
        self.searcher = Searcher(config.embeddings, config.search_method) \
            if "agent:search" in config.agents else None
        self.search_methods: dict[str, int] = {}

    def chunks(self, q: Question) -> tuple[list, str]:
        from ..agents.memory import chunks_for

        order = self.orders.get(q.question_id)
        if len(q.haystack_session_ids) > self.config.max_chunks and order is None:
            raise InputError(f"question '{q.question_id}': {len(q.haystack_session_ids)} haystack sessions, more "
                             f"than max_chunks={self.config.max_chunks}, and no embed output ranks it: add its "
                             f"embed output to 'embeddings' or raise max_chunks", field="embeddings")
        chunks = chunks_for(self.ds, q, order[1] if order else None, max_chunks=self.config.max_chunks)
        return chunks, ("first_stage" if len(chunks) < len(q.haystack_session_ids) else "haystack")

    def task(self, q: Question, method: str, search: bool = True) -> tuple[Any, dict]:
        """The agent's Task for ``q`` and what a row records of it; ``search=False``: a search scope that
        refuses (a row needs only the first request, which searches nothing)."""
        from ..agents.base import Task

        info: dict[str, Any] = {"sessions": [], "chunk_source": None, "gold_in_chunks": None}
        if method == "agent:search" and not search:
            def refuse(query: str, k: int) -> list:
                raise RuntimeError("prepare-agents: a row's first request searched")
            return Task(q.question_id, q.question, q.question_date, search=refuse), info
        if method == "agent:search":
            order = self.orders.get(q.question_id)
            assert self.searcher is not None
            search, how = self.searcher.for_question(self.ds, q, order[0] if order else None)
            how = f"{how} (embed output)" if order else f"{how} (no embed output covers it)"
            self.search_methods[how] = self.search_methods.get(how, 0) + 1
            return Task(q.question_id, q.question, q.question_date, search=search), info
        chunks, source = self.chunks(q)
        gold = set(q.gold_session_ids)
        info.update(sessions=[{"session_id": c.session_id, "date": c.date, "text": c.text} for c in chunks],
                    chunk_source=source, gold_in_chunks=any(c.session_id in gold for c in chunks))
        return Task(q.question_id, q.question, q.question_date, sessions=chunks), info

    def row(self, q: Question, method: str, split: str, index: int) -> dict:
        task, info = self.task(q, method, search=False)
        gen = self.agents[method].episode(task)
        first = next(gen)
        gen.close()
        return {
            "data_source": DATA_SOURCE, "agent_name": AGENT_NAMES[method],
            "prompt": [{"role": m["role"], "content": m["content"]} for m in first.messages],
            "ability": "memory_agent",
            "reward_model": {"style": "rule", "ground_truth": q.answer},
            "extra_info": {
                "split": split, "index": index, "question_id": q.question_id, "question": q.question,
                "question_date": q.question_date, "dataset": q.dataset, "answer": q.answer, "method": method,
                "corpus_id": q.question_id, "sessions": info["sessions"],
                "haystack_sessions": len(q.haystack_session_ids), "chunk_source": info["chunk_source"],
                "gold_session_ids": list(q.gold_session_ids), "gold_in_chunks": info["gold_in_chunks"],
                "group": group_of(q, self.config.group_by_haystack, self.ds.sessions),
                "agent_options": json.dumps(self.config.agent_options.get(method, {}), sort_keys=True),
            },
        }

    def traces(self, q: Question, method: str, split: str) -> tuple[list[dict], str | None]:
        """The oracle's trajectories of one question's episodes as records, or ([], why it gives none). The search
        agent gives one episode per opening query (``search_traces``; ``search_retry``: searching again while the
        evidence is not shown), identical trajectories once; the memory agents one episode."""
        from ..agents.memory import gold_evidence
        from ..agents.search import query_variants

        evidence = gold_evidence(self.ds, q)
        if method != "agent:search":
            return self._episode(q, method, split, evidence, None)
        variants = query_variants(q.question)
        records: list[dict] = []
        seen: set[str] = set()
        first_why = None
        for i in range(min(self.config.search_traces, len(variants))):
            queries = variants[i:] + variants[:i] if self.config.search_retry else [variants[i]]
            recs, why = self._episode(q, method, split, evidence, queries)
            first_why = first_why or why
            for r in recs:
                key = json.dumps(r["messages"], sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    records.append({**r, "variant": i})
        return (records, None) if records else ([], first_why)

    def _episode(self, q: Question, method: str, split: str, evidence: list[str],
                 queries: list[str] | None) -> tuple[list[dict], str | None]:
        """One oracle episode's trajectories as records, or ([], why it gives none)."""
        from ..agents.base import close_stop, requests_of

        task, _ = self.task(q, method)
        agent = self.agents[method]
        oracle = (agent.oracle(task, q.answer, evidence) if queries is None
                  else agent.oracle(task, q.answer, evidence, queries=queries))
        pairs, res = requests_of(agent.episode(task), oracle)
        if not res.format_ok or (res.answer or "").strip() != q.answer.strip():
            return [], "oracle_not_gold"
        trajectories: list[list[tuple[Any, str]]] = []
        for req, reply in pairs:
            if req.continues:
                prev, prev_reply = trajectories[-1][-1] if trajectories else (None, "")
                n = len(prev.messages) if prev else 0
                if prev is None or req.messages[:n] != prev.messages or req.messages[n:n + 1] != [
                        {"role": "assistant", "content": close_stop(prev_reply, prev.stop)}]:
                    raise RuntimeError(f"{method}: question {q.question_id}: a continuing request does not extend "
                                       f"the previous one with its reply (memsifter.agents.base.Request.continues)")
                trajectories[-1].append((req, reply))
            else:
                trajectories.append([(req, reply)])
        records = []
        for k, traj in enumerate(trajectories):
            last, reply = traj[-1]
            messages = [{"role": m["role"], "content": m["content"]} for m in last.messages]
            messages.append({"role": "assistant", "content": close_stop(reply, last.stop)})
            shown = "".join(m["content"] for m in messages if m["role"] == "user")
            records.append({"messages": messages, "method": method, "question_id": q.question_id,
                            "dataset": q.dataset, "split": split, "kind": last.kind, "step": k,
                            "steps": len(trajectories), "stop": list(last.stop), "max_tokens": last.max_tokens,
                            "answer": q.answer, "evidence_seen": any(e in shown for e in evidence)})
        if not any(r["evidence_seen"] for r in records):
            return [], "evidence_not_shown"
        if method != "agent:search" and self.config.max_plain_chunks is not None:
            plain = [i for i, r in enumerate(records) if r["kind"] == "chunk" and not r["evidence_seen"]]
            rng = random.Random(f"{self.config.seed}:{method}:{q.question_id}")
            drop = set(plain) - set(rng.sample(plain, min(len(plain), self.config.max_plain_chunks)))
            records = [r for i, r in enumerate(records) if i not in drop]
        return records, None


# --------------------------------------------------------------------------- the stage
def _token_counter(ref: str | None) -> Callable[[list[dict]], int] | None:
    if not ref:
        return None
    from transformers import AutoTokenizer

    from ..models import registry as models

    tok = AutoTokenizer.from_pretrained(models.resolve(ref) or ref)

    def count(messages: list[dict]) -> int:
        return len(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    return count


def _summary(values: list[int]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    return {"mean": round(sum(v) / len(v), 1), "p95": v[min(len(v) - 1, int(0.95 * len(v)))], "max": v[-1]}


@stage("prepare-agents", PrepareAgentsConfig, family="train",
       help="Memory-agent data: verl rows per (question, agent) with agent_name, and oracle SFT traces")
def run(config: PrepareAgentsConfig, out: storage.Publication) -> dict:
    t0 = time.time()
    ds = load_datasets(config.datasets)
    orders = splits.load_orders(config.embeddings, "embeddings")
    known = sorted({q.dataset for q in ds.questions})
    for split, entries in config.recipe.items():
        for name in entries:
            if name not in known:
                raise InputError(f"recipe {split}: no questions of dataset '{name}' in the inputs "
                                 f"(datasets present: {', '.join(known)})", field=f"recipe.{split}")
    skipped: dict[str, int] = {}
    pool = []
    for q in ds.questions:
        why = usable(q, config.skip_question_types)
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            pool.append(q)
    plan = splits.choose(pool, ds.sessions, config.recipe, config.seed, by_group=config.group_by_haystack)
    chosen, shortfall, stranded = plan.chosen, plan.shortfall, plan.stranded
    for split, qs in chosen.items():
        if not qs and sum(config.recipe[split].values()) > 0:
            raise InputError(f"recipe {split}: no usable question (skipped: {skipped}); a 0-row parquet is not "
                             f"readable by verl", field=f"recipe.{split}")
    builder = Builder(config, ds, orders)
    count = _token_counter(config.tokenizer)

    files: dict[str, list[str]] = {}
    rows_n: dict[str, dict[str, int]] = {}
    prompt_tokens: list[int] = []
    chunks_n: list[int] = []
    gold_in: list[bool] = []
    row_bytes = 0
    t_rows = time.time()
    for split, qs in chosen.items():
        items = [(q, m) for q in qs for m in config.agents]
        if split == "train":
            random.Random(f"{config.seed}:shuffle").shuffle(items)
            sizes = shard_sizes(len(items), config.shard_rows)
            names = [f"train_{i:05d}.parquet" for i in range(len(sizes))]
        else:
            sizes, names = [len(items)], [f"{split}.parquet"]
        files[split] = names
        rows_n[split] = {m: len(qs) for m in config.agents}
        start = 0
        for name, size in zip(names, sizes):
            rows = []
            for j, (q, m) in enumerate(items[start:start + size]):
                r = builder.row(q, m, split, start + j)
                rows.append(r)
                if count:
                    prompt_tokens.append(count(r["prompt"]))
                if m != "agent:search":
                    chunks_n.append(len(r["extra_info"]["sessions"]))
                    gold_in.append(bool(r["extra_info"]["gold_in_chunks"]))
            table = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
            out.write_table(name, table)
            row_bytes += out.files[name]["bytes"]
            start += size
    rows_s = time.time() - t_rows

    trace_files: dict[str, str] = {}
    traces_n: dict[str, dict[str, int]] = {}
    kinds: dict[str, int] = {}
    trace_skips: dict[str, dict[str, int]] = {}
    trace_tokens: list[int] = []
    trace_bytes = 0
    t_traces = time.time()
    if config.traces:
        for split, qs in chosen.items():
            lines: list[str] = []
            per: dict[str, int] = {}
            for q in qs:
                for m in config.agents:
                    recs, why = builder.traces(q, m, split)
                    if why:
                        trace_skips.setdefault(m, {})[why] = trace_skips.setdefault(m, {}).get(why, 0) + 1
                        continue
                    per[m] = per.get(m, 0) + len(recs)
                    for r in recs:
                        kinds[f"{m}/{r['kind']}"] = kinds.get(f"{m}/{r['kind']}", 0) + 1
                        if count:
                            trace_tokens.append(count(r["messages"]))
                        lines.append(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
            name = f"sft_{split}.jsonl"
            out.write_bytes(name, "".join(lines).encode("utf-8"), rows=len(lines))
            trace_bytes += out.files[name]["bytes"]
            trace_files[split] = name
            traces_n[split] = per
    traces_s = time.time() - t_traces
    out.write_json("questions.json", {split: [q.question_id for q in qs] for split, qs in chosen.items()})
    out.write_json(splits.SPLIT_FILE, plan.document())
    groups = {s: len({group_of(q, config.group_by_haystack, ds.sessions) for q in qs}) for s, qs in chosen.items()}
    return {
        "questions": {split: len(qs) for split, qs in chosen.items()}, "groups": groups, "split": plan.summary(),
        "rows": {split: sum(v.values()) for split, v in rows_n.items()}, "rows_by_method": rows_n, "files": files,
        "agent_names": {m: AGENT_NAMES[m] for m in config.agents},
        "shortfall": shortfall, "skipped_questions": skipped, "stranded_in_taken_groups": stranded,
        "search_oracle_methods": builder.search_methods,
        "chunks": _summary(chunks_n), "gold_in_chunks": round(sum(gold_in) / len(gold_in), 4) if gold_in else None,
        "prompt_tokens": _summary(prompt_tokens), "row_bytes": row_bytes,
        "traces": {"files": trace_files, "records": traces_n, "kinds": kinds, "skipped_episodes": trace_skips,
                   "tokens": _summary(trace_tokens), "bytes": trace_bytes},
        "seconds": {"rows": round(rows_s, 1), "traces": round(traces_s, 1), "total": round(time.time() - t0, 1)},
    }


def read_traces(uri: str, split: str = "train") -> list[dict]:
    """The SFT trace records of one split of a published prepare-agents output."""
    manifest = storage.read_manifest(uri)
    name = (manifest["stats"].get("traces") or {}).get("files", {}).get(split)
    if not name:
        return []
    text = storage.read_text(storage.published_file(uri, name))
    return [json.loads(line) for line in text.splitlines() if line.strip()]
