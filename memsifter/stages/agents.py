"""Stage ``agents``: answer every question with the memory agents (issue 33) over any OpenAI-compatible endpoint.

The agents (:mod:`memsifter.agents`) are methods of answering, side by side with the chat stage's (no
memory, the first stage, rankers, the oracle): ``agent:search`` searches the question's haystack through
the memory service (``memsifter serve``: ``POST /u/<question id>/retrieve``, real HTTP, ``search_url``),
``agent:memory`` reads the haystack one chunk at a time keeping bounded notes, ``agent:memory+recall``
may also recall an earlier memory state. Each agent is written once (:mod:`memsifter.agents.base`: an
episode is a generator of LLM requests); this stage drives the episodes with the working LLM.

* Requests: each :class:`~memsifter.agents.base.Request`'s messages, stop strings and ``max_tokens`` go to
  ``/chat/completions`` through the chat client of :mod:`memsifter.models.llm` (its endpoint check, its
  credentials handling, retries with backoff on 429/5xx/timeouts, ``Retry-After``). Episodes run
  concurrently across questions, at most ``endpoint.concurrency`` at once; one episode's requests are
  sequential (each depends on the previous reply). The replies and their usage (prompt and completion
  tokens, as the server counts them) are cached under ``<output>/_work/llm-cache/agents/``, so an episode
  that is re-run replays what was already answered.
* Cost per question, measured: LLM calls, searches, chunks read, recalls, prompt tokens (tokens read,
  from the server's usage; where a server sends none, the prompt counted with ``tokenizer`` or the agents'
  estimate), completion tokens and seconds. ``tokenizer`` is also what the agents count their budgets with.
* Outputs: ``answers.parquet`` with the chat stage's columns (``evaluate`` scores it as it scores chat's)
  plus the cost columns, and ``traces.jsonl`` (per question and method: the steps of the episode and
  every call's tokens and seconds) for inspection.
* Finished episodes are saved in batches under ``<output>/_work/agents-<config hash>/``; a re-run runs
  only the rest. A failed episode (a request that failed after its retries, a search that failed) is not
  saved; the stage refuses to publish when more than ``max_failed_fraction`` of the episodes failed.
* Time budgets: an episode fails once it has taken ``episode_timeout_s`` (default 900 s) over all its LLM
  calls and searches, and every episode still running when the stage has taken ``stage_timeout_s``
  (default a day) fails too; each request waits only for what is left, so a server that trickles its
  reply (a byte every few seconds, no read timeout ever firing) cannot hold the stage.
* Nothing is started here: ``agent:search`` needs ``search_url`` (a running memory service whose index
  holds the dataset's questions); without one the stage refuses it, one line naming the field. On
  Kubernetes the chart fills ``search_url`` with its RayService's URL when ``serve.enabled``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import math
import os
import random
import threading
import time
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, field_validator

from ..errors import ConfigError, MemsifterError
from ..data.model import Dataset, Question, read_dataset
from ..models import registry as models
from ..models.llm import ChatClient, LLMEndpoint, ResponseCache, _retryable, request_key, retry_after
from ..retrieval import rankings
from ..retrieval.metrics import exact_match, token_f1
from ..security.redact import bare_url, redact, redact_known, redact_obj, url_auth
from ..stage import StageConfig, config_hash, runtime_field, stage, uri_field
from ..store import storage
from ..store import hooks

log = logging.getLogger(__name__)

METHODS = ("agent:search", "agent:memory", "agent:memory+recall")
TRACE_FILE = "traces.jsonl"
COST_COLUMNS = ("llm_calls", "searches", "chunks", "recalls", "prompt_tokens", "completion_tokens", "seconds",
                "format_ok")


def _agent_endpoint() -> LLMEndpoint:
    return LLMEndpoint(temperature=0.0)


from ..agents.search import check_search_url, search_key  # noqa: E402 - one place, used by train too


class AgentsConfig(StageConfig):
    input: str = uri_field("published dataset", stage=("import", "synth"))
    embeddings: str | None = uri_field(
        "embed output: the first stage's order of each question's sessions; the memory agents read its top "
        "sessions where a haystack is too long to read whole (memsifter.agents.memory.chunks_for), else the "
        "haystack in chronological order", None, stage="embed")
    methods: list[Literal["agent:search", "agent:memory", "agent:memory+recall"]] = Field(
        default_factory=lambda: list(METHODS), min_length=1,
        description="the agents to answer with: agent:search (searches the memory service), agent:memory "
        "(reads the haystack chunk by chunk, keeping notes), agent:memory+recall (and may recall earlier notes)")
    endpoint: LLMEndpoint = Field(default_factory=_agent_endpoint,
                                  description="the working LLM (temperature 0 unless set: greedy episodes)")
    search_url: str | None = Field(
        None, description="base URL of the memory service (memsifter serve), e.g. http://127.0.0.1:8000; "
        "agent:search searches each question's haystack there (corpus = the question id). Needed for "
        "agent:search; on Kubernetes the chart sets it to its RayService's URL when serve.enabled",
        json_schema_extra={"runtime": True, "serve_url": True})
    search_api_key_env: str | None = runtime_field(
        None, "name of the env var holding the memory service's API key (null: anonymous access)")
    agent_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per method, keyword arguments of its agent (its budgets: turns, "
        "search top-k, memory and chunk tokens; see memsifter.agents.search / memsifter.agents.memory), e.g. "
        "{'agent:search': {max_turns: 3}}; a memory agent's max_chunks: the sessions it reads per question at "
        "most (memsifter.agents.memory.chunks_for; a longer haystack: the first stage's top ones)")
    max_questions: int | None = Field(None, ge=1, description="answer only the first N questions (budget: "
                                      "questions x methods x LLM calls)")
    tokenizer: str | None = Field(None, description="tokenizer the agents count their budgets with (hub id, "
                                  "directory or a name of `memsifter models list`); default: the agents' estimate "
                                  "(memsifter.agents.base.approx_tokens)")
    shard_size: int = runtime_field(16, "episodes per saved partial-results file", ge=1)
    max_failed_fraction: float = runtime_field(
        0.0, "publish only if at most this fraction of the episodes failed (after retries); default 0: any "
        "failed episode fails the stage, nothing is published and a re-run runs only the failed ones", ge=0, le=1)
    retry_backoff_s: float = runtime_field(1.0, "first retry delay (doubles, with jitter)", gt=0)
    episode_timeout_s: float = runtime_field(
        900.0, "seconds one episode may take over all its LLM calls and searches; past it the episode fails "
        "(a server that trickles its reply byte by byte is not waited for)", gt=0, le=86400)
    stage_timeout_s: float = runtime_field(
        86400.0, "seconds all episodes together may take; episodes still running past it fail", gt=0, le=7 * 86400)

    @field_validator("endpoint", mode="before")
    @classmethod
    def _greedy(cls, v: Any) -> Any:
        """An endpoint given without a temperature samples greedily (the agents' default), not at the chat
        endpoint's 0.6."""
        if isinstance(v, dict) and "temperature" not in v:
            return {**v, "temperature": 0.0}
        return v

    @field_validator("search_url")
    @classmethod
    def _bare(cls, v: str | None) -> str | None:
        """A ``user:password@`` in the URL is taken out here: never stored, sent as the search's auth."""
        return bare_url(v)

    @field_validator("agent_options")
    @classmethod
    def _known_methods(cls, v: dict) -> dict:
        bad = [k for k in v if k not in METHODS]
        if bad:
            raise ValueError(f"unknown method {bad[0]!r} (known: {', '.join(METHODS)})")
        for m, opts in v.items():
            for key, why in (("count_tokens", "set tokenizer"), ("recall", "the method says it")):
                if key in opts:
                    raise ValueError(f"{m}: {key} is not an option here ({why})")
        return v

    def preflight(self) -> None:
        """Where the requests go and their keys, checked before anything starts (one line, exit 2): the
        endpoint (nothing leaves the machine for a server the user did not name), ``search_url`` for
        agent:search and its key variable, and each agent's options."""
        self.endpoint.check("endpoint")
        if "agent:search" in self.methods:
            if not self.search_url:
                raise ConfigError("search_url is not set: agent:search searches the memory service (memsifter "
                                  "serve); set search_url (e.g. --set search_url=http://127.0.0.1:8000) or leave "
                                  "agent:search out of methods")
            check_search_url(self.search_url)
            search_key(self.search_api_key_env)
        for m in self.methods:
            make_agent(m, self.agent_options.get(m, {}), None)


# --------------------------------------------------------------------------- agents
CHUNKS_OPTION = "max_chunks"   # a memory agent's option that goes to chunks_for, not to the agent


def make_agent(method: str, options: dict, count_tokens: Any = None) -> Any:
    """The agent of ``method`` built with its ``agent_options``; a bad option is one line naming it.
    ``count_tokens`` (tokens of a text, from ``tokenizer``) is what the agent counts its budgets with
    (default: the agents' own estimate)."""
    from ..agents.base import registry

    kw = {k: v for k, v in options.items() if not (k == CHUNKS_OPTION and method != "agent:search")}
    chunks = options.get(CHUNKS_OPTION)
    if method != "agent:search" and chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool)
                                                             or chunks < 1):
        raise ConfigError(f"agent_options.{method}.{CHUNKS_OPTION}: expected an integer >= 1, got {chunks!r}")
    if count_tokens is not None:
        kw.setdefault("count_tokens", count_tokens)
    try:
        return registry()[method](**kw)
    except ValueError as e:   # a budget the agent refuses (its worst case does not fit its context)
        raise ConfigError(f"agent_options.{method}: {' '.join(str(e).split())}") from None
    except TypeError as e:    # an option the agent does not take, or one of the wrong type
        if "argument" not in str(e) and "not supported" not in str(e):
            raise
        raise ConfigError(f"agent_options.{method}: {' '.join(str(e).split())}") from None


# --------------------------------------------------------------------------- the endpoint
class EpisodeFailed(Exception):
    """A request of an episode that failed after its retries (one line, redacted)."""


class Budget:
    """When an episode must end: its own budget (``episode_timeout_s``) or the stage's
    (``stage_timeout_s``), whichever comes first. Each LLM call and search waits only for what is left
    of it, so a server that trickles a byte every few seconds (no read timeout fires) cannot hold an
    episode, or the stage, past its budget."""

    def __init__(self, config: "AgentsConfig", stage_deadline: float):
        start = time.time()
        self.deadline = min(start + config.episode_timeout_s, stage_deadline)
        self.why = ("its time budget (episode_timeout_s = %g s)" % config.episode_timeout_s
                    if start + config.episode_timeout_s <= stage_deadline
                    else "the stage's time budget (stage_timeout_s = %g s)" % config.stage_timeout_s)

    def left(self, doing: str) -> float:
        left = self.deadline - time.time()
        if left <= 0:
            raise EpisodeFailed(f"episode over {self.why} {doing}")
        return left

    def call(self, fn: Any, doing: str) -> Any:
        """``fn()`` in a daemon thread, waited for at most what is left (a blocking read cannot be
        interrupted; the thread ends when its connection does)."""
        box: dict = {}

        def go() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the episode's thread
                box["error"] = e
        t = threading.Thread(target=go, daemon=True, name="agent-budgeted-call")
        t.start()
        t.join(self.left(doing))
        if t.is_alive():
            raise EpisodeFailed(f"episode over {self.why} {doing}")
        if "error" in box:
            raise box["error"]
        return box["value"]


class AgentClient:
    """Sends agents' requests to one endpoint from many episode threads.

    The chat client's OpenAI client (:meth:`memsifter.models.llm.ChatClient._client`: the endpoint check,
    credentials in the URL as a header) lives on one event loop in a helper thread; an episode thread
    hands it a request and waits for the reply (:meth:`complete`). Each reply is cached with its usage
    (JSON in a :class:`~memsifter.models.llm.ResponseCache`), keyed as the chat client keys requests
    (model, messages, sampling parameters with the request's stop strings and max_tokens)."""

    def __init__(self, endpoint: LLMEndpoint, cache: ResponseCache, backoff_s: float = 1.0,
                 counter: Any = None, max_backoff_s: float = 30.0):
        self.endpoint, self.cache, self.counter = endpoint, cache, counter
        self.chat = ChatClient(endpoint, cache, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self.stats = self.chat.stats
        self.stats.update({"counted_prompts": 0})
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agents-llm", daemon=True)
        self.thread.start()
        self.client = asyncio.run_coroutine_threadsafe(self._make_client(), self.loop).result()

    async def _make_client(self) -> Any:
        self.sem = asyncio.Semaphore(self.endpoint.concurrency)
        return self.chat._client()

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.client.close(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.cache.flush()

    def params(self, req: Any) -> dict:
        return self.endpoint.params(max_tokens=req.max_tokens, stop=list(req.stop) or None)

    def complete(self, req: Any, budget: Budget | None = None) -> Any:
        """The reply to one request (:class:`~memsifter.agents.base.Reply`), or :class:`EpisodeFailed`
        (also once ``budget`` is spent: the request is cancelled)."""
        from ..agents.base import Reply

        fut = asyncio.run_coroutine_threadsafe(self._one(list(req.messages), self.params(req)), self.loop)
        try:
            rec = fut.result(None if budget is None else budget.left("waiting for the LLM"))
        except cf.TimeoutError:
            fut.cancel()
            raise EpisodeFailed(f"episode over {budget.why} waiting for the LLM") from None
        prompt = rec.get("prompt_tokens") or 0
        if rec.get("prompt_tokens") is None and self.counter is not None:  # a server that sends no usage
            prompt = self.counter.chat_prompt_tokens(list(req.messages))
            with self._lock:
                self.stats["counted_prompts"] += 1
        return Reply(rec["text"], prompt_tokens=int(prompt), completion_tokens=int(rec.get("completion_tokens") or 0),
                     finish_reason=rec.get("finish_reason"), stop_reason=rec.get("stop_reason"),
                     stop_reported="stop_reason" in rec)

    async def _one(self, messages: list[dict], params: dict) -> dict:
        key = request_key(self.endpoint.model, messages, params)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats["cached"] += 1
            return {**json.loads(hit), "cached": True}
        last = ""
        for attempt in range(self.endpoint.max_retries + 1):
            try:
                async with self.sem:
                    self.stats["requests"] += 1
                    resp = await self.client.chat.completions.create(model=self.endpoint.model, messages=messages,
                                                                     **params)
                choice = resp.choices[0]
                usage = getattr(resp, "usage", None)
                text = redact_known(choice.message.content or "", self.endpoint.secrets())  # echoed keys
                rec = {"text": text, "finish_reason": choice.finish_reason,
                       "prompt_tokens": getattr(usage, "prompt_tokens", None) if usage else None,
                       "completion_tokens": getattr(usage, "completion_tokens", None) if usage else None}
                extra = getattr(choice, "model_extra", None) or {}
                if "stop_reason" in extra:   # vLLM: the stop string that ended it, None for end-of-sequence
                    rec["stop_reason"] = extra["stop_reason"]
                self.cache.put(key, json.dumps(rec, ensure_ascii=False))
                return rec
            except Exception as e:  # noqa: BLE001 - classified below, as the chat client does
                last = redact(f"{type(e).__name__}: {str(e)[:2000]}", self.endpoint.secrets())[:300]
                last += f" (model {self.endpoint.model} at {self.endpoint.display_url()})"
                if not _retryable(e) or attempt == self.endpoint.max_retries:
                    break
                self.stats["retries"] += 1
                delay = min(self.chat.max_backoff_s, self.chat.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
                wait = retry_after(e)
                if wait is not None:
                    delay = min(max(delay, wait), self.endpoint.timeout_s)
                await asyncio.sleep(delay)
        self.stats["failed"] += 1
        raise EpisodeFailed(last)


class Counter:
    """Tokens as the agents count them: a Hugging Face tokenizer's (``tokenizer``; exact; calls serialised,
    the episode threads share it) or the agents' own estimate (:func:`memsifter.agents.base.approx_tokens`).
    ``count`` is what the agents count their budgets with (None: their default); ``chat_prompt_tokens`` the
    tokens read by a request whose server sends no usage."""

    def __init__(self, tokenizer: Any = None):
        from ..agents.base import approx_tokens, hf_counter

        self.tokenizer, self._lock = tokenizer, threading.Lock()
        if tokenizer is None:
            self.count, self._text = None, approx_tokens
            return
        from ..retrieval.context import TokenCounter

        plain, self._chat = hf_counter(tokenizer), TokenCounter(tokenizer)

        def count(text: str) -> int:
            with self._lock:
                return plain(text)
        self.count = self._text = count

    def chat_prompt_tokens(self, messages: list[dict]) -> int:
        if self.tokenizer is None:
            return sum(self._text(str(m.get("content") or "")) for m in messages)
        with self._lock:
            return self._chat.chat_prompt_tokens(messages)


# --------------------------------------------------------------------------- tasks
def _first_stage(uri: str | None) -> dict[str, list[str]]:
    if not uri:
        return {}
    return {r["question_id"]: r["ranked_session_ids"] or [] for r in rankings.read_rankings(uri)}


def make_task(method: str, ds: Dataset, q: Question, config: AgentsConfig, order: list[str] | None,
              seen: list[str], budget: Budget | None = None) -> tuple[Any, Any]:
    """The agent's view of one question and what to close after its episode: its haystack to search (the
    memory service, scoped to the question: corpus = its id) or its sections to read
    (:func:`memsifter.agents.memory.chunks_for`); ``seen`` collects the session ids shown to the agent."""
    from ..agents.base import Task

    task = Task(question_id=q.question_id, question=q.question, question_date=q.question_date)
    if method == "agent:search":
        from ..agents.search import http_search

        base = http_search(config.search_url, q.question_id, api_key_env=config.search_api_key_env)

        def search(query: str, k: int):  # noqa: ANN202
            hits = (list(base(query, k)) if budget is None
                    else budget.call(lambda: list(base(query, k)), "waiting for the memory service"))
            seen.extend(h.session_id for h in hits)
            return hits
        task.search = search
        return task, getattr(base, "close", None)
    from ..agents.memory import chunks_for

    kw: dict[str, Any] = {"first_stage_order": order}
    if config.agent_options.get(method, {}).get(CHUNKS_OPTION) is not None:
        kw["max_chunks"] = config.agent_options[method][CHUNKS_OPTION]
    task.sessions = list(chunks_for(ds, q, **kw))
    seen.extend(s.session_id for s in task.sessions)
    return task, None


def one_line(e: BaseException, secrets: list[str]) -> str:
    text = str(e) if isinstance(e, (EpisodeFailed, MemsifterError)) else f"{type(e).__name__}: {e}"
    return " ".join(redact(text, secrets).split())[:400]


def run_episode(method: str, agent: Any, task: Any, client: AgentClient,
                budget: Budget | None = None) -> tuple[Any, list[dict], float]:
    """One episode to its end (:func:`memsifter.agents.base.drive`) within ``budget``; its result, each
    call's record and its seconds."""
    from ..agents.base import drive

    calls: list[dict] = []

    def complete(req: Any) -> Any:
        t = time.time()
        r = client.complete(req, budget)
        calls.append({"kind": req.kind, "continues": req.continues, "prompt_tokens": r.prompt_tokens,
                      "completion_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
                      "seconds": round(time.time() - t, 3)})
        return r

    t0 = time.time()
    res = drive(agent.episode(task), complete)
    return res, calls, time.time() - t0


ROW_SCHEMA = pa.schema([
    ("question_id", pa.string()), ("method", pa.string()), ("dataset", pa.string()), ("question_type", pa.string()),
    ("question", pa.string()), ("gold_answer", pa.string()), ("answer", pa.string()), ("raw_response", pa.string()),
    ("status", pa.string()), ("reason", pa.string()), ("ranking_status", pa.string()), ("exact_match", pa.float64()),
    ("f1", pa.float64()), ("judge", pa.float64()), ("context_session_ids", pa.list_(pa.string())),
    ("context_tokens", pa.int64()), ("llm_calls", pa.int64()), ("searches", pa.int64()), ("chunks", pa.int64()),
    ("recalls", pa.int64()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
    ("seconds", pa.float64()), ("format_ok", pa.bool_())])


def _last_reply(res: Any) -> str | None:
    for s in reversed(res.steps or []):
        for k in ("reply", "text", "response"):
            if isinstance(s, dict) and isinstance(s.get(k), str):
                return s[k]
    return None


@stage("agents", AgentsConfig, family="chat", gpus=0, help="Answer with memory agents: EM/F1 and cost")
def run(config: AgentsConfig, out: storage.Publication) -> dict:
    ds = read_dataset(config.input)
    if config.max_questions:
        ds.questions = ds.questions[:config.max_questions]
    order = _first_stage(config.embeddings)
    tok = config.tokenizer
    if tok and tok.startswith("s3://"):
        tok = models.fetch_s3(tok, weights=False)
    if tok:
        from ..retrieval.context import load_tokenizer

        counter = Counter(load_tokenizer(models.resolve(tok)))
    else:
        counter = Counter()
    agents = {m: make_agent(m, config.agent_options.get(m, {}), counter.count) for m in config.methods}
    if "agent:search" in config.methods:
        # the search client's HTTP library, imported here once: a first import racing in the episode
        # threads is seen half-initialised by the other threads (the OpenAI client looks for it)
        import httpx  # noqa: F401
    secrets = config.endpoint.secrets() + ([os.environ[config.search_api_key_env]]
                                           if config.search_api_key_env and os.environ.get(config.search_api_key_env)
                                           else [])
    if config.search_url:
        secrets += [c for c in (url_auth(config.search_url) or ()) if c]

    work = storage.join(out.work, f"agents-{config_hash(config)}")
    done = {(r["method"], r["question_id"]): r for r in rankings.read_partials(work)}
    todo = [(m, q) for m in config.methods for q in ds.questions if (m, q.question_id) not in done]
    total = len(config.methods) * len(ds.questions)
    log.info("agents: %d questions x %d method(s), %d answered before (resumed), %d to run", len(ds.questions),
             len(config.methods), len(done), len(todo))
    failed: dict[tuple[str, str], str] = {}
    shards = len({r.get("_shard") for r in done.values()})
    t0 = time.time()
    stage_deadline = t0 + config.stage_timeout_s
    client = AgentClient(config.endpoint, ResponseCache(storage.join(out.work, "llm-cache", "agents")),
                         config.retry_backoff_s, counter)
    from ..stage import progress_bar

    bar = progress_bar(total=len(todo), desc=f"agents {config.endpoint.model}", unit="episode",
                       disable=not todo, mininterval=1.0)

    def one(method: str, q: Question) -> dict:
        seen: list[str] = []
        budget = Budget(config, stage_deadline)
        task, close = make_task(method, ds, q, config, order.get(q.question_id), seen, budget)
        try:
            res, calls, secs = run_episode(method, agents[method], task, client, budget)
        finally:
            if close is not None:
                close()
        ans = res.answer
        trace = {"question_id": q.question_id, "method": method, "answer": ans, "format_ok": bool(res.format_ok),
                 "seconds": round(secs, 3), "steps": res.steps, "calls": calls}
        return {"question_id": q.question_id, "method": method, "answer": ans,
                "raw_response": _last_reply(res), "context_session_ids": list(dict.fromkeys(seen)),
                "llm_calls": res.llm_calls, "searches": res.searches, "chunks": res.chunks, "recalls": res.recalls,
                "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
                "seconds": round(secs, 3), "format_ok": bool(res.format_ok),
                "trace": json.dumps(redact_obj(trace, secrets), ensure_ascii=False, default=str), "_shard": -1}

    pending: list[dict] = []

    def save() -> None:
        nonlocal shards, pending
        if not pending:
            return
        rows = [{**r, "_shard": shards} for r in pending]
        rankings.write_partial(work, shards, rows)
        done.update({(r["method"], r["question_id"]): r for r in rows})
        shards += 1
        pending = []
        hooks.checkpoint("saved", done=shards)

    try:
        with cf.ThreadPoolExecutor(max_workers=max(1, config.endpoint.concurrency),
                                   thread_name_prefix="agent-episode") as pool:
            futs = {pool.submit(one, m, q): (m, q.question_id) for m, q in todo}
            for fut in cf.as_completed(futs):
                key = futs[fut]
                try:
                    pending.append(fut.result())
                except Exception as e:  # noqa: BLE001 - one episode fails, the others go on
                    failed[key] = one_line(e, secrets)
                    log.debug("agents: %s [%s] failed: %s", key[1], key[0], failed[key])
                bar.update(1)
                if len(pending) >= config.shard_size:
                    save()
        save()
    finally:
        bar.close()
        client.close()
    seconds = time.time() - t0
    if len(failed) > config.max_failed_fraction * total:
        (fm, fq), ferr = next(iter(failed.items()))
        raise MemsifterError(f"agents: {len(failed)} of {total} episodes failed, nothing published to {out.uri} "
                             f"(max_failed_fraction = {config.max_failed_fraction:g}); first: {fq} [{fm}]: {ferr}; "
                             "episodes that finished are kept under _work/: re-run to retry the failed ones")

    out_rows, traces = [], []
    for m in config.methods:
        for q in ds.questions:
            d = done.get((m, q.question_id))
            ok = d is not None
            ans = d["answer"] if ok else None
            row = {"question_id": q.question_id, "method": m, "dataset": q.dataset, "question_type": q.question_type,
                   "question": q.question, "gold_answer": q.answer, "answer": ans,
                   "raw_response": d.get("raw_response") if ok else None, "status": "ok" if ok else "error",
                   "reason": None if ok else failed.get((m, q.question_id)), "ranking_status": None,
                   "exact_match": exact_match(ans or "", q.answer) if ok else None,
                   "f1": token_f1(ans or "", q.answer) if ok else None, "judge": None,
                   "context_session_ids": list(d.get("context_session_ids") or []) if ok else [],
                   "context_tokens": None}
            for c in COST_COLUMNS:
                row[c] = d.get(c) if ok else None
            out_rows.append(row)
            if ok:
                traces.append(d["trace"])
    out.write_table("answers.parquet", pa.Table.from_pylist(out_rows, schema=ROW_SCHEMA))
    out.write_text(TRACE_FILE, "".join(t + "\n" for t in traces))

    def mean(key: str, rows: list[dict]) -> float | None:
        vals = [float(r[key]) for r in rows if r[key] is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    per_method = {}
    for m in config.methods:
        rs = [r for r in out_rows if r["method"] == m and r["status"] == "ok"]
        per_method[m] = {"kind": "agent", "source": None, "ranking_status": {}, "answered": len(rs),
                         "exact_match": mean("exact_match", rs), "f1": mean("f1", rs),
                         **{c: mean(c, rs) for c in COST_COLUMNS}}
    return {"questions": len(ds.questions), "episodes": total, "answered": total - len(failed), "failed": len(failed),
            "resumed": total - len(todo), "model": config.endpoint.model, "methods": per_method,
            "client": dict(client.stats), "seconds": round(seconds, 2),
            "tokens": "server usage" + ("" if not client.stats["counted_prompts"] else
                                        f"; {client.stats['counted_prompts']} prompt(s) counted with "
                                        + ("the tokenizer" if tok else "the agents' estimate") + " (no usage sent)")}
