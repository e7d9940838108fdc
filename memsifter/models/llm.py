"""OpenAI-compatible chat client shared by the chat stage and the task reward.

* Endpoint settings: ``base_url`` and ``model`` in config; the API key is read from the environment
  variable named by ``api_key_env`` (a Kubernetes Secret reference in the cluster), never stored.
  The URL must be named (config or ``MEMSIFTER_LLM_BASE_URL`` / ``OPENAI_BASE_URL``): there is no
  built-in default, so nothing is sent to a hosted API unasked (:meth:`LLMEndpoint.check`).
* Credentials never leave in text: a password in the URL is taken out when the config is parsed (the
  config, its manifest and every message hold the bare URL, :func:`memsifter.security.redact.bare_url`) and
  sent as the request's Basic header; the key read from ``api_key_env`` is remembered for redaction; every
  error is passed through :func:`memsifter.security.redact.redact` and every answer through
  :func:`~memsifter.security.redact.redact_known` before it is cached or returned (servers echo the
  Authorization header, in error bodies and in answers).
* Bounded concurrency (asyncio semaphore), retries with exponential backoff and jitter on 429, 5xx,
  timeouts and connection errors; other 4xx fail at once.
* A request cache keyed by sha256 of (model, messages, sampling params): in memory, and optionally
  persisted as JSONL shards under a URI (local or s3://), so a re-run sends only what is missing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..store import storage
from ..security.redact import bare_url, redact, redact_known, remember, url_auth

log = logging.getLogger(__name__)


def http_url_ok(url: str) -> bool:
    """An http:// or https:// URL with a host and a valid port (if any)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
        return parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        return False


class LLMEndpoint(BaseModel):
    """Where and how to call an OpenAI-compatible chat model."""

    model_config = ConfigDict(extra="forbid")

    # Where and how to call are runtime settings (left out of stage config hashes, as out of the
    # request cache key): the same model behind another URL gives the same outputs.
    base_url: str | None = Field(None, description="OpenAI-compatible base URL, e.g. http://host:8000/v1; "
                                 "required, or env MEMSIFTER_LLM_BASE_URL / OPENAI_BASE_URL: nothing is sent "
                                 "to a server you did not name",
                                 json_schema_extra={"runtime": True})
    model: str = Field("gpt-4o-mini", description="model name served by the endpoint")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="name of the env var holding the API key "
                                    "(null: the server needs none; unset on a non-local URL is an error)",
                                    json_schema_extra={"runtime": True})
    temperature: float = Field(0.6, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int = Field(4096, gt=0, description="max new tokens per answer")
    seed: int | None = Field(None, description="sampling seed, if the server honours it")
    timeout_s: float = Field(300, gt=0, description="per-request timeout", json_schema_extra={"runtime": True})
    max_retries: int = Field(6, ge=0, description="retries on 429/5xx/timeouts", json_schema_extra={"runtime": True})
    concurrency: int = Field(16, ge=1, description="requests in flight at once", json_schema_extra={"runtime": True})

    @field_validator("base_url")
    @classmethod
    def _bare(cls, v: str | None) -> str | None:
        """A ``user:password@`` in the URL is taken out here: never stored, sent as the request's auth."""
        return bare_url(v)

    def resolved_base_url(self) -> str | None:
        """The base URL without credentials (a URL from the environment is stripped as the config's is)."""
        return bare_url(self.base_url or os.environ.get("MEMSIFTER_LLM_BASE_URL") or os.environ.get("OPENAI_BASE_URL"))

    def display_url(self) -> str:
        """The base URL as errors and logs may show it: without a password or token in it."""
        url = self.resolved_base_url()
        return redact(url, self.secrets()) if url else "(no base_url)"

    def secrets(self) -> list[str]:
        """What must never be shown of this endpoint: the API key and a password in its URL."""
        out = []
        if self.api_key_env and os.environ.get(self.api_key_env):
            out.append(os.environ[self.api_key_env])
        cred = url_auth(self.resolved_base_url())
        if cred:
            out += [f"{cred[0]}:{cred[1]}", *(c for c in cred if c)]
        return out

    def check(self, what: str = "endpoint") -> None:
        """Refuse, before anything starts, an endpoint that was never named or whose key is missing.

        Nothing leaves the machine unless the user says where it goes: the base URL comes from
        ``base_url`` or from ``MEMSIFTER_LLM_BASE_URL`` / ``OPENAI_BASE_URL`` set by the user, never
        from the OpenAI client's built-in default (a user's memory would be sent to api.openai.com
        just because ``OPENAI_API_KEY`` happens to be set). ``what`` names the config field."""
        from ..errors import ConfigError

        url = self.resolved_base_url()
        if not url:
            raise ConfigError(f"{what}.base_url is not set: name the OpenAI-compatible server the requests go to "
                              f"(e.g. --set {what}.base_url=http://127.0.0.1:8000/v1, or "
                              "https://api.openai.com/v1 to use OpenAI), or set MEMSIFTER_LLM_BASE_URL")
        if not http_url_ok(url):
            raise ConfigError(f"{what}.base_url = {redact(url, self.secrets())!r}: expected an http:// or https:// "
                              "URL with a host, e.g. http://127.0.0.1:8000/v1")
        self.api_key(what)

    def api_key(self, what: str = "endpoint") -> str:
        """The key from the environment variable ``api_key_env`` names. Local servers (vLLM on
        loopback) accept any key, and ``api_key_env: null`` says the server needs none; otherwise a
        missing variable is an error naming it, never a silent placeholder sent to a hosted API."""
        if not self.api_key_env:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if key:
            remember(key)   # redacted from every text of this process from now on
            return key
        url = self.resolved_base_url()
        if url and _loopback(url):
            return "EMPTY"
        from ..errors import ConfigError

        raise ConfigError(f"{what}: LLM endpoint {self.display_url()} (model {self.model}): the API key variable "
                          f"{self.api_key_env} is not set; set it (in Kubernetes: from a Secret) or set "
                          f"{what}.api_key_env: null for a server that needs no key")

    def params(self, **override: Any) -> dict:
        p: dict[str, Any] = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.top_p is not None:
            p["top_p"] = self.top_p
        if self.seed is not None:
            p["seed"] = self.seed
        p.update({k: v for k, v in override.items() if v is not None})
        return p


def _loopback(url: str) -> bool:
    from urllib.parse import urlparse

    host = (urlparse(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass
class Completion:
    text: str | None
    error: str | None = None
    cached: bool = False
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


def request_key(model: str, messages: Sequence[dict], params: dict) -> str:
    blob = json.dumps({"model": model, "messages": list(messages), "params": params}, sort_keys=True,
                      ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    """In-memory cache, optionally backed by JSONL shards under ``uri`` (append = new shard)."""

    def __init__(self, uri: str | None = None, flush_every: int = 64):
        self.uri, self.flush_every = uri, flush_every
        self._data: dict[str, str] = {}
        self._pending: dict[str, str] = {}
        self._lock = threading.Lock()
        if uri:
            for rel in storage.list_files(uri):
                if not rel.endswith(".jsonl"):
                    continue
                for line in storage.read_text(storage.join(uri, rel)).splitlines():
                    if line.strip():
                        rec = json.loads(line)
                        self._data[rec["key"]] = rec["text"]
            if self._data:
                log.info("LLM cache %s: %d cached responses", uri, len(self._data))

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> str | None:
        return self._data.get(key)

    def put(self, key: str, text: str) -> None:
        with self._lock:
            self._data[key] = text
            self._pending[key] = text
            if len(self._pending) >= self.flush_every:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if not self.uri or not self._pending:
            self._pending.clear()
            return
        body = "".join(json.dumps({"key": k, "text": v}, ensure_ascii=False) + "\n"
                       for k, v in self._pending.items())
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl"
        storage.write_bytes(storage.join(self.uri, name), body.encode("utf-8"))
        self._pending.clear()


def _retryable(exc: BaseException) -> bool:
    import openai

    if isinstance(exc, (openai.APITimeoutError, openai.APIConnectionError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, openai.APIStatusError):
        return exc.status_code == 429 or exc.status_code >= 500 or exc.status_code == 408
    return False


def retry_after(exc: BaseException) -> float | None:
    """Seconds a 429/503 answer asks the client to wait (``Retry-After``: seconds or an HTTP date;
    ``retry-after-ms``), else None."""
    headers = getattr(getattr(exc, "response", None), "headers", None)
    if not headers:
        return None
    try:
        ms = headers.get("retry-after-ms")
        if ms is not None:
            return max(0.0, float(ms) / 1000)
        v = headers.get("retry-after")
        if v is None:
            return None
        try:
            return max(0.0, float(v))
        except ValueError:
            from email.utils import parsedate_to_datetime

            return max(0.0, parsedate_to_datetime(v).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


class ChatClient:
    """Concurrent, retrying, caching chat completions against one endpoint."""

    def __init__(self, endpoint: LLMEndpoint, cache: ResponseCache | None = None,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        self.endpoint = endpoint
        self.cache = cache if cache is not None else ResponseCache()
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.stats = {"requests": 0, "cached": 0, "retries": 0, "failed": 0}

    def _client(self) -> Any:
        """The OpenAI client. Credentials in the URL (``http://user:password@host/v1``) are sent as the
        Basic ``Authorization`` header they stand for (as the HTTP library would, overriding the bearer
        key) while the client itself only knows the bare URL: its log lines ("HTTP Request: POST …")
        and errors then never carry the password."""
        import base64

        import openai

        self.endpoint.check()
        url = self.endpoint.resolved_base_url()
        cred = url_auth(url)
        headers = None
        if cred:
            token = base64.b64encode(f"{cred[0]}:{cred[1]}".encode()).decode()
            headers = {"Authorization": f"Basic {token}"}
        return openai.AsyncOpenAI(base_url=url, api_key=self.endpoint.api_key(), default_headers=headers,
                                  max_retries=0, timeout=self.endpoint.timeout_s)

    async def _one(self, client: Any, sem: asyncio.Semaphore, messages: Sequence[dict],
                   params: dict) -> Completion:
        key = request_key(self.endpoint.model, messages, params)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats["cached"] += 1
            return Completion(hit, cached=True)
        last = ""
        attempts = 0
        for attempt in range(self.endpoint.max_retries + 1):
            attempts = attempt + 1
            try:
                async with sem:
                    self.stats["requests"] += 1
                    resp = await client.chat.completions.create(model=self.endpoint.model,
                                                                messages=list(messages), **params)
                text = redact_known(resp.choices[0].message.content or "", self.endpoint.secrets())
                self.cache.put(key, text)
                return Completion(text, attempts=attempts)
            except Exception as e:  # noqa: BLE001 - classified below
                # Servers echo credentials in error bodies ("Incorrect API key provided: Bearer sk-…"):
                # redacted before the text can reach a log, a reason column or a manifest. Redacted
                # whole, then cut (a cut could split a secret and hide it from the patterns).
                last = redact(f"{type(e).__name__}: {str(e)[:2000]}", self.endpoint.secrets())[:300]
                last += f" (model {self.endpoint.model} at {self.endpoint.display_url()})"
                if not _retryable(e) or attempt == self.endpoint.max_retries:
                    break
                self.stats["retries"] += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
                wait = retry_after(e)
                if wait is not None:  # the server said when: honour it (bounded by the request timeout)
                    self.stats["retry_after"] = self.stats.get("retry_after", 0) + 1
                    delay = min(max(delay, wait), self.endpoint.timeout_s)
                await asyncio.sleep(delay)
        self.stats["failed"] += 1
        return Completion(None, error=last, attempts=attempts)

    async def acomplete_many(self, batch: Sequence[Sequence[dict]], progress: Any = None,
                             **params: Any) -> list[Completion]:
        p = self.endpoint.params(**params)
        sem = asyncio.Semaphore(self.endpoint.concurrency)
        client = self._client()
        try:
            async def run(i: int, msgs: Sequence[dict]) -> tuple[int, Completion]:
                c = await self._one(client, sem, msgs, p)
                if progress is not None:
                    progress.update(1)
                return i, c
            results = await asyncio.gather(*(run(i, m) for i, m in enumerate(batch)))
        finally:
            await client.close()
            self.cache.flush()
        out: list[Completion] = [Completion(None)] * len(batch)
        for i, c in results:
            out[i] = c
        return out

    def complete_many(self, batch: Sequence[Sequence[dict]], progress: Any = None,
                      **params: Any) -> list[Completion]:
        """Synchronous wrapper; safe to call from code that already runs an event loop."""
        return run_sync(lambda: self.acomplete_many(batch, progress, **params))


def run_sync(coro_fn: Any) -> Any:
    """Run ``coro_fn()`` to completion from sync code, even where an event loop already runs
    (then in a fresh loop on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro_fn())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["r"] = asyncio.run(coro_fn())
        except BaseException as e:  # noqa: BLE001
            box["e"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["r"]
