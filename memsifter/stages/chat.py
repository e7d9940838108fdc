"""Stage ``chat``: answer every question with the working LLM over the retrieved memory (MEMSIFTER.md §5).

* Endpoint: any OpenAI-compatible server (:class:`memsifter.models.llm.LLMEndpoint`: base URL, model, the
  *name* of the env var holding the API key), through :class:`memsifter.models.llm.ChatClient` (bounded
  concurrency, retries with backoff on 429/5xx/timeouts, a request cache under
  ``<output>/_work/llm-cache/`` so a re-run sends only what is missing).
* Context: the sessions of ``rankings`` in rank order (a ``rank`` output ranks its top ids first,
  then the rest by similarity), then any haystack session the rankings file leaves out, by
  similarity (``embeddings``) or chronologically; added while the whole prompt fits ``context_tokens``
  (the session window of :mod:`memsifter.retrieval.window`, the rank stage's builder and token-cost model);
  shown in chronological order (§2) in the prompt template (``{history}``, ``{current}``,
  ``{date}``; ``prompts/chat.txt`` by default).
* Several contexts side by side: the questions are answered with ``rankings`` (the stage's main
  answers), each of ``compare`` (more rankings files, e.g. dense and the default first stage) and the
  ``baselines`` (``none``: no memory; ``oracle``: the gold sessions only; ``random``: the haystack in a
  seeded random order, filled like a ranking). ``answers.parquet`` has a
  ``method`` column and the status of the ranking each context came from, so ``evaluate`` reports F1
  by method and marks a method whose rankings were fallbacks. ``session_tokens`` shows each session
  by its turns closest to the question (:func:`memsifter.retrieval.render.condense_session`).
* Tokens read per answer (``prompt_tokens``: the whole prompt as ``tokenizer`` counts it with the chat
  template, else the estimate of :func:`memsifter.retrieval.context.approx_tokens`), for ``evaluate``'s cost per question.
* Answer = the text inside the last ``<answer>…</answer>`` after any ``</think>``, else the whole
  reply. Per question: exact match and token F1 against the gold answer; optionally an LLM judge
  (yes/no, ``prompts/judge.txt``).
* Answers are saved in batches under ``<output>/_work/chat-<config hash>/``; failed requests are not
  saved, so a re-run retries only them. The stage refuses to publish when more than
  ``max_failed_fraction`` of the questions failed.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Literal

import pyarrow as pa
from pydantic import Field

from ..store import hooks
from ..models import registry as models
from ..retrieval import rankings
from ..store import storage
from ..retrieval.context import CHARS_PER_TOKEN, ApproxCounter, TokenCounter, load_tokenizer
from ..data.model import Dataset, Question, read_dataset
from ..errors import MemsifterError
from ..models.llm import ChatClient, LLMEndpoint, ResponseCache
from ..retrieval.metrics import exact_match, token_f1
from ..retrieval.prompting import extract_answer, fill, load_chat_prompt, load_prompt
from ..security.redact import redact
from ..stage import StageConfig, config_hash, runtime_field, stage, uri_field
from ..retrieval.window import OVER_BUDGET, PromptBuilder, answer_slots

log = logging.getLogger(__name__)


class ChatConfig(StageConfig):
    input: str = uri_field("published dataset", stage=("import", "synth"))
    rankings: str = uri_field("rankings to fill the context with (rank or embed output, or a rankings parquet)",
                              stage=("rank", "embed"))
    embeddings: str | None = uri_field("embed output: similarity order for sessions the rankings leave out",
                                       None, stage="embed")
    compare: list[str] = uri_field("more rankings to answer with, side by side: each the URI of a rank or "
                                   "embed stage's published directory or of a rankings parquet file (e.g. "
                                   "<embed>/rankings_dense.parquet); not wired by pipelines",
                                   default_factory=list, stage=("rank", "embed"), wire="none")
    baselines: list[Literal["none", "oracle", "random"]] = Field(
        default_factory=list, description="reference contexts answered too: none = no memory, oracle = the "
        "question's gold sessions (what memory retrieval can give at best), random = the question's haystack "
        "sessions in a random order (seeded by random_seed and the question id), filled like any ranking")
    random_seed: int = Field(0, description="seed of the random-sessions baseline's order")
    limit: int | None = Field(None, ge=1, description="answer only the first N questions (budget: questions x "
                              "methods x context tokens)")
    endpoint: LLMEndpoint = Field(default_factory=LLMEndpoint, description="the working LLM")
    tokenizer: str | None = Field(None, description="tokenizer for the budget (hub id, directory or a name of "
                                  f"`memsifter models list`); default: an estimate of {CHARS_PER_TOKEN:g} characters per "
                                  "token (memsifter.retrieval.context.approx_tokens)")
    prompt: str | None = uri_field("prompt template with {history}, {current} and {date} "
                                   "(default: memsifter/prompts/chat.txt)", None)
    context_tokens: int = Field(8192, gt=0, description="prompt tokens at most (template, question, date and "
                                "memory, costed as the rank stage's context_limit)")
    session_tokens: int | None = Field(None, gt=0, description="show each session in at most this many tokens: "
                                       "a longer one keeps the turns sharing the most words with the question, "
                                       "in order (more sessions fit a small working LLM); default: whole")
    stop_at_first_overflow: bool = Field(False, description="stop filling at the first session that does "
                                         "not fit (default: skip it and keep trying)")
    judge: LLMEndpoint | None = Field(None, description="optional LLM judge (yes/no correctness)")
    judge_prompt: str | None = uri_field("judge prompt with {question}, {answer}, {response}", None)
    shard_size: int = runtime_field(32, "answers per saved partial-results file", ge=1)
    max_failed_fraction: float = runtime_field(
        0.0, "publish only if at most this fraction of the requests failed (after retries); default 0: any "
        "failed request fails the stage, nothing is published and a re-run asks only the failed ones", ge=0, le=1)
    retry_backoff_s: float = runtime_field(1.0, "first retry delay (doubles, with jitter)", gt=0)

    def preflight(self) -> None:
        """Checks that need the environment, made before anything starts (not at validation: a pipeline
        validates every stage's config before an earlier stage has started the server this one calls).
        Where the requests go and their keys: nothing leaves the machine for an endpoint the user did
        not name (a ConfigError, one line, exit 2)."""
        self.endpoint.check("endpoint")
        if self.judge:
            self.judge.check("judge")


def context_order(q: Question, ranked: list[str], similar: list[str]) -> list[str]:
    hay = set(q.haystack_session_ids)
    order = [s for s in ranked if s in hay]
    seen = set(order)
    for s in list(similar) + list(q.haystack_session_ids):
        if s in hay and s not in seen:
            order.append(s)
            seen.add(s)
    return order


NO_MEMORY, ORACLE, RANDOM = "no memory", "oracle (gold sessions)", "random sessions"
BASELINE_LABELS = {"none": NO_MEMORY, "oracle": ORACLE, "random": RANDOM}


def random_order(q: Question, seed: int) -> list[str]:
    """The random-sessions baseline's order of a question's haystack: a shuffle seeded by ``seed`` and the
    question id (the same order on every run and machine, a different one per question)."""
    import random

    order = list(q.haystack_session_ids)
    random.Random(f"{seed}:{q.question_id}").shuffle(order)
    return order


def answer_methods(config: ChatConfig) -> list[dict]:
    """Every context the questions are answered with: ``rankings`` first (the stage's main answers),
    then ``compare``, then the baselines. Each: label (the rankings' own ``method``), source, the
    ranked ids per question and the rankings' status counts (a method whose rows are fallbacks
    answers with its fallback order, and is reported as such)."""
    out: list[dict] = []
    for uri in [config.rankings, *config.compare]:
        rows = rankings.read_rankings(uri)
        label = (rows[0].get("method") if rows else None) or uri.rstrip("/").rsplit("/", 1)[-1]
        if any(m["label"] == label for m in out):
            label = f"{label} ({uri.rstrip('/').rsplit('/', 1)[-1]})"
        status: dict[str, int] = {}
        for r in rows:
            status[r["status"]] = status.get(r["status"], 0) + 1
        out.append({"label": label, "source": uri, "kind": "rankings", "status": status,
                    "ranked": {r["question_id"]: r["ranked_session_ids"] or [] for r in rows},
                    "row_status": {r["question_id"]: r["status"] for r in rows}})
    for b in dict.fromkeys(config.baselines):
        out.append({"label": BASELINE_LABELS[b], "source": b, "kind": b, "status": {},
                    "ranked": {}, "row_status": {}})
    return out


def build_messages(config: ChatConfig, ds: Dataset, q: Question, order: list[str], counter, template: str
                   ) -> tuple[list[dict], list[str], int]:
    """The working LLM's prompt for one question: the session window (:mod:`memsifter.retrieval.window`, the
    rank stage's builder and token-cost model) of ``order``, listed chronologically. Returns the
    messages, the shown session ids and the tokens of the memory shown."""
    hay = q.haystack_session_ids
    builder = PromptBuilder(counter, template, limit=config.context_tokens, session_tokens=config.session_tokens,
                            stop_at_first_overflow=config.stop_at_first_overflow)
    w = builder.build(q.question, hay, ds.sessions, [q.date_of(s, ds.sessions) for s in hay], order,
                      key=q.question_id, slots=answer_slots(q.question_date))
    over = sum(1 for why in w.left_out.values() if why == OVER_BUDGET)
    if over:  # e.g. a 1 MB turn: never shown, whatever its rank
        log.warning("chat: question %s: %d session(s) larger than the memory budget (%d tokens) left out",
                    q.question_id, over, w.history_budget)
    return w.messages, w.session_ids, w.history_tokens


def cached_client(endpoint: LLMEndpoint, cache_uri: str, backoff_s: float = 1.0) -> ChatClient:
    """A ChatClient whose request cache persists under ``cache_uri``."""
    return ChatClient(endpoint, ResponseCache(cache_uri), backoff_s=backoff_s)


def judge_verdict(text: str | None) -> float | None:
    if text is None:
        return None
    t = extract_answer(text).strip().lower()
    if t.startswith("yes"):
        return 1.0
    if t.startswith("no"):
        return 0.0
    return 1.0 if re.search(r"\byes\b", t) and not re.search(r"\bno\b", t) else 0.0


@stage("chat", ChatConfig, family="chat", gpus=0,
       help="Answer questions with the working LLM over the ranked memory; EM / F1 (/ judge)")
def run(config: ChatConfig, out: storage.Publication) -> dict:
    ds = read_dataset(config.input)
    if config.limit:
        ds.questions = ds.questions[:config.limit]
    methods = answer_methods(config)
    similar = ({r["question_id"]: r["ranked_session_ids"] or [] for r in rankings.read_rankings(config.embeddings)}
               if config.embeddings else {})
    template = load_chat_prompt(config.prompt)
    judge_tpl = load_prompt(config.judge_prompt, "judge.txt", ("question", "answer", "response")) \
        if config.judge else None
    tok = config.tokenizer
    if tok and tok.startswith("s3://"):
        tok = models.fetch_s3(tok, weights=False)
    counter = TokenCounter(load_tokenizer(models.resolve(tok))) if tok else ApproxCounter()

    prepared = {}  # (method, question id) -> (messages, shown ids, context tokens)
    for m in methods:
        for q in ds.questions:
            if m["kind"] == "none":
                order: list[str] = []
            elif m["kind"] == "oracle":
                order = [s for s in q.haystack_session_ids if s in set(q.gold_session_ids)]
            elif m["kind"] == "random":
                order = random_order(q, config.random_seed)
            else:
                order = context_order(q, m["ranked"].get(q.question_id, []), similar.get(q.question_id, []))
            prepared[(m["label"], q.question_id)] = build_messages(config, ds, q, order, counter, template)

    work = storage.join(out.work, f"chat-{config_hash(config)}")
    done = {(r.get("method") or methods[0]["label"], r["question_id"]): r for r in rankings.read_partials(work)}
    todo = [(m["label"], q) for m in methods for q in ds.questions if (m["label"], q.question_id) not in done]
    log.info("chat: %d questions x %d method(s), %d answered before (resumed), %d to ask", len(ds.questions),
             len(methods), len(done), len(todo))
    client = cached_client(config.endpoint, storage.join(out.work, "llm-cache", "chat"), config.retry_backoff_s)
    jclient = (cached_client(config.judge, storage.join(out.work, "llm-cache", "judge"), config.retry_backoff_s)
               if config.judge else None)
    failed: dict[tuple[str, str], str] = {}
    secrets = config.endpoint.secrets() + (config.judge.secrets() if config.judge else [])
    shards = len({r.get("_shard") for r in done.values()})
    t0 = time.time()
    from ..stage import progress_bar

    bar = progress_bar(total=len(todo), desc=f"chat {config.endpoint.model}", unit="req", disable=not todo,
               mininterval=1.0)
    for chunk in storage.iter_chunks(todo, config.shard_size):
        comps = client.complete_many([prepared[(label, q.question_id)][0] for label, q in chunk], progress=bar)
        rows = []
        for (label, q), c in zip(chunk, comps):
            if not c.ok:
                failed[(label, q.question_id)] = redact(c.error or "failed", secrets)
                continue
            rows.append({"question_id": q.question_id, "method": label, "raw_response": c.text,
                         "answer": extract_answer(c.text), "judge_raw": None, "_shard": shards})
        if jclient and rows:
            qmap = {q.question_id: q for _, q in chunk}
            jmsgs = [[{"role": "user", "content": fill(judge_tpl, question=qmap[r["question_id"]].question,
                                                         answer=qmap[r["question_id"]].answer,
                                                         response=r["answer"])}] for r in rows]
            kept = []
            for r, jc in zip(rows, jclient.complete_many(jmsgs)):
                if not jc.ok:
                    failed[(r["method"], r["question_id"])] = redact(f"judge: {jc.error}", secrets)
                    continue
                kept.append({**r, "judge_raw": jc.text})
            rows = kept
        if rows:
            rankings.write_partial(work, shards, rows)
            done.update({(r["method"], r["question_id"]): r for r in rows})
            shards += 1
            hooks.checkpoint("saved", done=shards)
    bar.close()
    seconds = time.time() - t0
    total = len(ds.questions) * len(methods)
    if len(failed) > config.max_failed_fraction * total:
        (flabel, fqid), ferr = next(iter(failed.items()))
        ferr = " ".join(ferr.split())[:400]
        raise MemsifterError(f"chat: {len(failed)} of {total} requests failed, nothing published to {out.uri} "
                             f"(max_failed_fraction = {config.max_failed_fraction:g}); first: {fqid} [{flabel}]: "
                             f"{ferr}; answers that arrived are kept under _work/: re-run to retry the failed ones")

    out_rows = []
    for m in methods:
        for q in ds.questions:
            key = (m["label"], q.question_id)
            msgs, shown, ctx_tokens = prepared[key]
            d = done.get(key)
            ok = d is not None
            ans = d["answer"] if ok else None
            out_rows.append({
                "question_id": q.question_id, "method": m["label"], "dataset": q.dataset,
                "question_type": q.question_type, "question": q.question, "gold_answer": q.answer, "answer": ans,
                "raw_response": d["raw_response"] if ok else None, "status": "ok" if ok else "error",
                "reason": None if ok else failed.get(key),
                "ranking_status": m["row_status"].get(q.question_id),
                "exact_match": exact_match(ans, q.answer) if ok else None,
                "f1": token_f1(ans, q.answer) if ok else None,
                "judge": judge_verdict(d.get("judge_raw")) if ok and config.judge else None,
                "context_session_ids": shown, "context_tokens": ctx_tokens,
                "prompt_tokens": counter.chat_prompt_tokens(msgs),
            })
    schema = pa.schema([("question_id", pa.string()), ("method", pa.string()), ("dataset", pa.string()),
                        ("question_type", pa.string()),
                        ("question", pa.string()), ("gold_answer", pa.string()), ("answer", pa.string()),
                        ("raw_response", pa.string()), ("status", pa.string()), ("reason", pa.string()),
                        ("ranking_status", pa.string()), ("exact_match", pa.float64()), ("f1", pa.float64()), ("judge", pa.float64()),
                        ("context_session_ids", pa.list_(pa.string())), ("context_tokens", pa.int64()),
                        ("prompt_tokens", pa.int64())])
    out.write_table("answers.parquet", pa.Table.from_pylist(out_rows, schema=schema))
    main = methods[0]["label"]
    okr = [r for r in out_rows if r["status"] == "ok" and r["method"] == main]

    def mean(key: str, rows: list[dict]) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    by_type: dict[str, dict] = {}
    for t in sorted({r["question_type"] or "-" for r in okr}):
        rs = [r for r in okr if (r["question_type"] or "-") == t]
        by_type[t] = {"n": len(rs), "exact_match": mean("exact_match", rs), "f1": mean("f1", rs),
                      "judge": mean("judge", rs)}
    per_method = {}
    for m in methods:
        rs = [r for r in out_rows if r["method"] == m["label"] and r["status"] == "ok"]
        per_method[m["label"]] = {"source": m["source"], "kind": m["kind"], "ranking_status": m["status"],
                                  "answered": len(rs), "exact_match": mean("exact_match", rs), "f1": mean("f1", rs)}
    return {"questions": len(ds.questions), "answered": len(okr), "failed": len(failed),
            "resumed": total - len(todo),
            "model": config.endpoint.model, "method": main, "methods": per_method,
            "exact_match": mean("exact_match", okr), "f1": mean("f1", okr), "judge": mean("judge", okr),
            "by_type": by_type, "client": client.stats, "judge_client": jclient.stats if jclient else None,
            "seconds": round(seconds, 2),
            "context_tokens_mean": round(sum(r["context_tokens"] for r in out_rows) / max(1, len(out_rows)), 1)}
