"""A small Python client of ``memsifter serve`` (standard library only).

:class:`MemoryClient` has the methods a mem0 user knows, over the service's mem0-compatible API
(``<url>/mem0``): ``add``, ``get_all``, ``get``, ``update``, ``delete``, ``delete_all``, ``history``,
``search``, ``reset``; and the native routes: ``retrieve`` (Search-R1's ``/retrieve``), ``append_sessions``
and ``search_sessions``. The key is read from an environment variable (default ``MEMSIFTER_API_KEY``) or
given; an error answer raises :class:`MemsifterHTTPError` with the service's one-line detail::

    from memsifter.client import MemoryClient

    m = MemoryClient("http://127.0.0.1:8000")
    m.add([{"role": "user", "content": "I moved to Lisbon in May."}], user_id="alice")
    m.search("where do I live?", user_id="alice", limit=3)["results"]
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class MemsifterHTTPError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class MemoryClient:
    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 api_key_env: str = "MEMSIFTER_API_KEY", timeout: float = 60.0):
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(api_key_env)
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None, params: dict | None = None) -> Any:
        q = {k: v for k, v in (params or {}).items() if v is not None}
        url = self.url + path + ("?" + urllib.parse.urlencode(q) if q else "")
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            try:
                detail = json.loads(e.read()).get("detail", "")
            except Exception:  # noqa: BLE001 - not our JSON (a proxy's page)
                detail = e.reason
            raise MemsifterHTTPError(e.code, str(detail)) from None

    @staticmethod
    def _ids(user_id: str | None, agent_id: str | None, run_id: str | None) -> dict:
        return {"user_id": user_id, "agent_id": agent_id, "run_id": run_id}

    # ------------------------------------------------------------------ mem0's methods
    def add(self, messages: list[dict] | str, user_id: str | None = None, agent_id: str | None = None,
            run_id: str | None = None, metadata: dict | None = None) -> dict:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        body = {"messages": messages, **self._ids(user_id, agent_id, run_id), "metadata": metadata}
        return self._call("POST", "/mem0/memories", body)

    def get_all(self, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> dict:
        return self._call("GET", "/mem0/memories", params=self._ids(user_id, agent_id, run_id))

    def get(self, memory_id: str) -> dict:
        return self._call("GET", f"/mem0/memories/{urllib.parse.quote(memory_id, safe='')}")

    def update(self, memory_id: str, text: str, metadata: dict | None = None) -> dict:
        return self._call("PUT", f"/mem0/memories/{urllib.parse.quote(memory_id, safe='')}",
                          {"text": text, "metadata": metadata})

    def delete(self, memory_id: str) -> dict:
        return self._call("DELETE", f"/mem0/memories/{urllib.parse.quote(memory_id, safe='')}")

    def delete_all(self, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> dict:
        return self._call("DELETE", "/mem0/memories", params=self._ids(user_id, agent_id, run_id))

    def history(self, memory_id: str) -> list[dict]:
        return self._call("GET", f"/mem0/memories/{urllib.parse.quote(memory_id, safe='')}/history")

    def search(self, query: str, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None,
               filters: dict | None = None, limit: int = 100, threshold: float | None = None) -> dict:
        body = {"query": query, **self._ids(user_id, agent_id, run_id), "filters": filters, "limit": limit,
                "threshold": threshold}
        return self._call("POST", "/mem0/search", body)

    def reset(self, user_id: str | None = None, agent_id: str | None = None, run_id: str | None = None) -> dict:
        return self._call("POST", "/mem0/reset", params=self._ids(user_id, agent_id, run_id))

    # ------------------------------------------------------------------ the native routes
    def retrieve(self, queries: list[str], corpus_id: str, topk: int | None = None, return_scores: bool = True) -> dict:
        body = {"queries": queries, "return_scores": return_scores, **({"topk": topk} if topk else {})}
        return self._call("POST", f"/u/{urllib.parse.quote(corpus_id, safe='')}/retrieve", body)

    def append_sessions(self, user_id: str, sessions: list[dict]) -> dict:
        return self._call("POST", "/memories", {"user_id": user_id, "sessions": sessions})

    def search_sessions(self, user_id: str, query: str, top_k: int = 10) -> dict:
        return self._call("POST", "/search", {"user_id": user_id, "query": query, "top_k": top_k})

    def health(self) -> dict:
        return self._call("GET", "/healthz")
