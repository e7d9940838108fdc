"""The HTTP surface: one FastAPI app over a :class:`~memsifter.service.core.RetrievalService`, the same under
Ray Serve (``serve.ingress``) and plain uvicorn.

Routes: ``POST /retrieve`` and ``POST /u/{corpus_id}/retrieve`` (Search-R1's request and response),
``POST /memories``, ``POST /search``, ``DELETE /memories/{user_id}``, ``GET /healthz`` (liveness),
``GET /readyz`` (readiness), ``GET /metrics`` (Prometheus), ``GET /docs`` (OpenAPI). With keys configured
(or no anonymous grant), a request without a valid key is 401 on every path but the probes and the API
description (:data:`memsifter.service.auth.PUBLIC_PATHS`), before any route runs. Every error is ``{"detail": "<one line>"}`` with its status:
401 (no or unknown key), 403 (outside the key's grant), 404, 409, 413 (a bound: body size, queries per
request, sessions per append), 422 (a field: its path and what is wrong, never the value sent), 500
(``internal error`` and an id to find the server's log line). No response carries a traceback: every
exception is caught inside the app, before Serve's proxy or uvicorn could format one.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from .auth import Forbidden, Unauthorized, is_public
from .config import ID_PATTERN, ID_RE as ID_FULL
from .core import ApiError, RetrievalService
from .metrics import CONTENT_TYPE

ROLE_PATTERN = r"^[^<>\x00-\x1f\x7f]{1,64}$"


def _unicode(v: str) -> str:
    """A string that UTF-8 can encode: JSON lets a lone surrogate (``\\ud800``) through, no store or model
    takes one, so it is a 422 here rather than a failure later."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (a lone surrogate, e.g. \\ud800)") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]


# --------------------------------------------------------------------------- bodies
class RetrieveRequest(BaseModel):
    """Search-R1's request, plus an optional corpus and mode."""

    queries: list[Text] = Field(description="queries, answered in order")
    topk: int | None = Field(None, description="documents per query (default: the service's, Search-R1's 3)")
    return_scores: bool = Field(False, description="entries as {document, score}; else bare documents")
    corpus_id: str | None = Field(None, pattern=ID_PATTERN, description="the haystack to search (a published "
                                  "question id or a user id); default: the key's only corpus or the service's")
    mode: Literal["first_stage", "ranked"] = "first_stage"


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Text = Field(pattern=ROLE_PATTERN, description="speaker (a tag name when rendered: no <, > or controls)")
    content: Text


class SessionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str | None = Field(None, pattern=ID_PATTERN, description="default: s-<content hash>")
    date: Text | None = Field(None, max_length=200)
    turns: list[Turn] = Field(min_length=1)


class MemoriesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str = Field(pattern=ID_PATTERN)
    sessions: list[SessionIn] = Field(min_length=1)


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str = Field(pattern=ID_PATTERN, description="a user id (their memories) or a published corpus id")
    query: Text
    top_k: int = 10
    mode: Literal["first_stage", "ranked"] = "first_stage"


# --------------------------------------------------------------------------- mem0-compatible bodies
class Mem0Message(BaseModel):
    role: Text = Field("user", pattern=ROLE_PATTERN)
    content: Text


class Mem0Owner(BaseModel):
    """mem0's scoping ids (other fields a mem0 client may send are ignored)."""

    user_id: str | None = Field(None, pattern=ID_PATTERN)
    agent_id: str | None = Field(None, pattern=ID_PATTERN)
    run_id: str | None = Field(None, pattern=ID_PATTERN)


class Mem0AddRequest(Mem0Owner):
    messages: list[Mem0Message] = Field(min_length=1, description="each message is one memory, stored as sent")
    metadata: dict | None = None
    infer: bool | None = Field(None, description="with the service's `extract` endpoint configured: false stores the messages as sent, anything else extracts facts; without it no LLM is called")


class Mem0UpdateRequest(BaseModel):
    text: Text | None = Field(None, description="the new text (mem0's field; `memory` and `data` are accepted)")
    memory: Text | None = None
    data: Text | None = None
    metadata: dict | None = None


class Mem0SearchRequest(Mem0Owner):
    query: Text
    filters: dict | None = None
    limit: int = 100
    threshold: float | None = None


# --------------------------------------------------------------------------- errors
class FastJSON(JSONResponse):
    """JSON rendered by orjson when it is installed (documents are large; FastAPI's encoder walks them)."""

    def render(self, content: Any) -> bytes:
        try:
            import orjson
        except ImportError:
            return super().render(content)
        return orjson.dumps(content)


def _error(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def _where(loc: tuple) -> str:
    parts = [str(x) for x in loc if x not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def validation_message(exc: RequestValidationError) -> str:
    msgs = []
    for err in exc.errors()[:5]:
        msg = str(err.get("msg", "invalid"))
        if err.get("type") == "json_invalid":
            msg = "invalid JSON"
        elif err.get("type") == "string_pattern_mismatch":
            msg = "not a valid id or value (see /docs for the allowed characters)"
        msgs.append(f"{_where(tuple(err.get('loc', ())))}: {msg}")
    return "; ".join(msgs)


class SafeRoute(APIRoute):
    """A route whose every exception becomes a JSON error (see the module docstring)."""

    def get_route_handler(self):  # noqa: ANN201
        inner = super().get_route_handler()
        path = self.path

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except (RequestValidationError, StarletteHTTPException):
                raise
            except ApiError as e:
                return _error(e.status, e.message)
            except Unauthorized as e:
                return _error(401, str(e), {"WWW-Authenticate": "Bearer"})
            except Forbidden as e:
                return _error(403, str(e))
            except Exception as e:  # noqa: BLE001 - logged with its traceback, answered without it
                svc: RetrievalService = request.app.state.service
                rid = svc.log_error(f"{request.method} {path}", e)
                return _error(500, f"internal error (id {rid}); the server's log has the details")
        return handler


def _header(headers: dict, name: bytes) -> str | None:
    v = headers.get(name)
    return v.decode("latin-1") if v is not None else None


class Guard:
    """Outermost ASGI middleware: body-size bounds (413 before or while the body is read), per-route
    metrics, and a last catch so that nothing escapes as a traceback."""

    def __init__(self, app: Any, service: RetrievalService, routes: list | None = None,
                 fast: "FastRoutes | None" = None):
        self.app, self.service, self.routes, self.fast = app, service, routes or [], fast

    def route_name(self, scope: dict) -> str:
        """The route template of a request answered before routing (a 401, a 413): the metrics' label."""
        from starlette.routing import Match

        for r in self.routes:
            try:
                if r.matches(scope)[0] == Match.FULL:
                    return getattr(r, "path", "other")
            except Exception:  # noqa: BLE001 - a route that cannot say: not this one
                continue
        return "other"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        svc, path = self.service, scope.get("path", "")
        lim = svc.cfg.limits
        limit = lim.max_memory_body_bytes if path.rstrip("/") in ("/memories", "/mem0/memories") else lim.max_body_bytes
        started = {"v": False, "code": 500, "over": False}
        t0 = time.perf_counter()

        async def reply(status: int, detail: str, extra: list | None = None) -> None:
            body = json.dumps({"detail": detail}).encode()
            started["v"], started["code"] = True, status
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()), *(extra or [])]})
            await send({"type": "http.response.body", "body": body})

        async def send_(msg: dict) -> None:
            if started["over"]:   # the body went over the bound while the app read it: our 413, not its answer
                if msg["type"] == "http.response.start" and not started["v"]:
                    await reply(413, too_big)
                return
            if msg["type"] == "http.response.start":
                started["v"], started["code"] = True, msg["status"]
            await send(msg)

        too_big = f"request body larger than {limit} bytes (limits.{'max_memory_body_bytes' if limit != lim.max_body_bytes else 'max_body_bytes'})"
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        try:
            if not is_public(path):   # who may ask is settled before any route (or a 404/405) answers
                try:
                    svc.principal(_header(headers, b"authorization"), _header(headers, b"x-api-key"))
                except Unauthorized as e:
                    await reply(401, str(e), [(b"www-authenticate", b"Bearer")])
                    return
            if length is not None and (not length.isdigit() or int(length) > limit):
                await reply(413 if length.isdigit() else 400, too_big if length.isdigit() else "bad Content-Length")
                return
            seen = {"n": 0}

            async def receive_() -> dict:
                msg = await receive()
                if msg["type"] == "http.request":
                    seen["n"] += len(msg.get("body", b""))
                    if seen["n"] > limit:
                        started["over"] = True
                        raise ApiError(413, too_big)
                return msg
            fast = self.fast.match(scope) if self.fast is not None and scope.get("method") == "POST" else None
            if fast is not None:
                await self.fast.serve(fast, scope, receive_, send_, self.app, svc)
            else:
                await self.app(scope, receive_, send_)
        except ApiError as e:
            if not started["v"]:
                await reply(e.status, e.message)
        except Exception as e:  # noqa: BLE001 - never a traceback to the client
            rid = svc.log_error(f"{scope.get('method')} {path}", e)
            if not started["v"]:
                await reply(500, f"internal error (id {rid}); the server's log has the details")
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or self.route_name(scope)
            code = started["code"]
            svc.metrics.requests.labels(name, str(code)).inc()
            svc.metrics.latency.labels(name).observe(time.perf_counter() - t0)
            if code >= 400:
                svc.metrics.errors.labels(name, "client" if code < 500 else "server").inc()


class FastRoutes:
    """The hot routes (``POST /retrieve``, ``POST /u/{corpus_id}/retrieve``, ``POST /mem0/memories``) answered
    without FastAPI's request machinery: under load (32 searchers and 8 writers on 2 cores, issue 46) its
    per-request work (the middleware stack, routing, resolving the header and path parameters one by one,
    the body read through ``Request``) was about a sixth of the event loop's time.

    Only a well-formed request takes this path: a JSON body (``Content-Type: application/json``) that the
    route's own model accepts, a valid path id, at most one ``Authorization`` and one ``X-API-Key`` header.
    It is parsed as FastAPI parses it (``json.loads``, then the model in Python mode), the route's own endpoint
    function is called with the same arguments, and its answer is rendered as FastAPI renders it: the same
    bytes. Anything else (a body to reject, a header given twice, another content type) goes, with the body
    already read, to the full app, which answers it exactly as before (its 422 naming the field, ...).
    Errors the endpoint raises are answered as :class:`SafeRoute` answers them. ``served`` counts the requests
    answered here."""

    def __init__(self) -> None:
        self.exact: dict[str, tuple] = {}    # route path -> (route, model, call)
        self.corpus: tuple | None = None     # /u/{corpus_id}/retrieve
        self.served = 0

    def add(self, route: Any, model: type, call: Any) -> None:
        if "{" in route.path:
            self.corpus = (route, model, call)
        else:
            self.exact[route.path] = (route, model, call)

    def match(self, scope: dict) -> tuple | None:
        """(route, model, call, path params) of a POST to a fast route, else None."""
        try:
            from starlette._utils import get_route_path

            path = get_route_path(scope)
        except ImportError:   # another starlette: only where no prefix is mounted
            if scope.get("root_path"):
                return None
            path = scope.get("path", "")
        hit = self.exact.get(path)
        if hit is not None:
            return (*hit, {})
        if self.corpus is not None and path.startswith("/u/") and path.endswith("/retrieve"):
            cid = path[3:-9]
            if cid and "/" not in cid and ID_FULL.fullmatch(cid):
                return (*self.corpus, {"corpus_id": cid})
        return None

    async def serve(self, hit: tuple, scope: dict, receive: Any, send: Any, app: Any, svc: RetrievalService) -> None:
        route, model, call, params = hit
        messages: list[dict] = []
        chunks: list[bytes] = []
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        kwargs = self._arguments(scope, model, messages, b"".join(chunks))
        if kwargs is None:   # the full app answers it, from the body as read
            replay = iter(messages)

            async def receive_again() -> dict:
                for m in replay:
                    return m
                return await receive()
            await app(scope, receive_again, send)
            return
        scope["route"] = route   # the metrics' label, as routing sets it
        scope.setdefault("path_params", {}).update(params)
        kwargs.update(params)
        try:
            out = await call(**kwargs)
            if not isinstance(out, Response):
                out = await self._render(route, out)
        except ApiError as e:
            out = _error(e.status, e.message)
        except Unauthorized as e:
            out = _error(401, str(e), {"WWW-Authenticate": "Bearer"})
        except Forbidden as e:
            out = _error(403, str(e))
        except Exception as e:  # noqa: BLE001 - as SafeRoute: logged with its traceback, answered without it
            rid = svc.log_error(f"{scope.get('method')} {route.path}", e)
            out = _error(500, f"internal error (id {rid}); the server's log has the details")
        self.served += 1
        await out(scope, receive, send)

    @staticmethod
    def _arguments(scope: dict, model: type, messages: list[dict], body: bytes) -> dict | None:
        if not messages or messages[-1]["type"] != "http.request" or not body:
            return None
        ctype = auth = key = None
        for name, value in scope.get("headers") or ():
            if name == b"content-type":
                if ctype is not None:
                    return None
                ctype = value
            elif name == b"authorization":
                if auth is not None:
                    return None
                auth = value.decode("latin-1")
            elif name == b"x-api-key":
                if key is not None:
                    return None
                key = value.decode("latin-1")
        if ctype is None or ctype.split(b";", 1)[0].strip().lower() != b"application/json":
            return None
        try:
            data = json.loads(body)
            parsed = model.model_validate(data)
        except Exception:  # noqa: BLE001 - not well-formed: the full app says why
            return None
        return {"body": parsed, "authorization": auth, "x_api_key": key}

    @staticmethod
    async def _render(route: APIRoute, content: Any) -> Response:
        """A returned value rendered as FastAPI renders it for the route (its response field, else
        ``jsonable_encoder``)."""
        from fastapi.encoders import jsonable_encoder
        from fastapi.routing import serialize_response

        if route.response_field is None:
            return JSONResponse(jsonable_encoder(content))
        raw = await serialize_response(field=route.response_field, response_content=content,
                                       include=route.response_model_include, exclude=route.response_model_exclude,
                                       by_alias=route.response_model_by_alias,
                                       exclude_unset=route.response_model_exclude_unset,
                                       exclude_defaults=route.response_model_exclude_defaults,
                                       exclude_none=route.response_model_exclude_none, dump_json=True)
        return Response(content=raw, media_type="application/json")


DESCRIPTION = """\
Memory retrieval over an embed stage's publication (memsifter). `POST /retrieve` is Search-R1's retrieval
server API: a Search-R1 or verl search-tool client works unchanged (point its URL at `/retrieve` for the
default corpus or `/u/{corpus_id}/retrieve`). Keys: `Authorization: Bearer <key>` or `X-API-Key`."""


# The API's description page, self-contained (no CDN: it works offline and in a closed cluster): it reads
# /openapi.json and lists every route with its parameters, request body and answers.
DOCS_HTML = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>memsifter retrieval service: API</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:980px;padding:0 1em;color:#222}
h1{font-size:1.5em}.op{border:1px solid #ccc;border-radius:6px;margin:.8em 0;padding:.6em .9em}
.m{display:inline-block;min-width:4.5em;font-weight:bold;font-family:monospace}.GET{color:#2a7}.POST{color:#27c}
.PUT{color:#c80}.DELETE{color:#c33}code,pre{font-family:ui-monospace,monospace;background:#f6f6f6}
pre{padding:.5em;overflow:auto;max-height:22em}summary{cursor:pointer}
</style></head><body>
<h1 id="title">memsifter retrieval service</h1><div id="desc"></div>
<p>Keys: <code>Authorization: Bearer &lt;key&gt;</code> or <code>X-API-Key: &lt;key&gt;</code>.
The machine-readable description: <a href="openapi.json">openapi.json</a>.</p>
<div id="ops">loading openapi.json ...</div>
<script>
const base = location.pathname.replace(/\/docs\/?$/, "");
function esc(s){return String(s).replace(/[&<>"]/g,c=>({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));}
function resolve(spec, s, depth){
  if(!s||depth>6) return s; if(s.$ref){return resolve(spec, spec.components.schemas[s.$ref.split("/").pop()], depth+1);}
  const o = Array.isArray(s)?[]:{}; for(const k in s){o[k]=(typeof s[k]==="object")?resolve(spec,s[k],depth+1):s[k];} return o;}
fetch(base + "/openapi.json").then(r=>r.json()).then(spec=>{
  document.getElementById("title").textContent = spec.info.title + " " + spec.info.version;
  document.getElementById("desc").textContent = spec.info.description || "";
  let html = "";
  for(const [path, ops] of Object.entries(spec.paths)){
    for(const [method, op] of Object.entries(ops)){
      const M = method.toUpperCase();
      html += `<div class="op"><span class="m ${M}">${M}</span> <code>${esc(path)}</code> ${esc(op.summary||"")}`;
      const params = (op.parameters||[]).filter(p=>p.in!=="header");
      if(params.length){html += "<ul>"+params.map(p=>`<li><code>${esc(p.name)}</code> (${esc(p.in)}${p.required?", required":""})</li>`).join("")+"</ul>";}
      const body = op.requestBody && op.requestBody.content && op.requestBody.content["application/json"];
      if(body){html += `<details><summary>request body</summary><pre>${esc(JSON.stringify(resolve(spec, body.schema, 0), null, 2))}</pre></details>`;}
      html += `<details><summary>answers</summary><pre>${esc(Object.keys(op.responses||{}).join(", "))}</pre></details></div>`;
    }
  }
  document.getElementById("ops").innerHTML = html;
}).catch(e=>{document.getElementById("ops").textContent = "could not read openapi.json: " + e;});
</script></body></html>
"""


def make_app(service: RetrievalService) -> FastAPI:
    """The FastAPI app of ``service`` (wrapped in :class:`Guard`)."""
    app = FastAPI(title="memsifter retrieval service", version=__version__, description=DESCRIPTION,
                  docs_url=None, redoc_url=None)
    app.router.route_class = SafeRoute
    app.state.service = service
    fast = app.state.fast = FastRoutes()
    app.add_middleware(Guard, service=service, routes=app.router.routes, fast=fast)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    def who(authorization: str | None, x_api_key: str | None):  # noqa: ANN202
        return service.principal(authorization, x_api_key)

    @app.post("/retrieve", summary="Search-R1 retrieval: top-k sessions per query")
    async def retrieve(body: RetrieveRequest, authorization: str | None = Header(None),
                       x_api_key: str | None = Header(None)) -> Response:
        return FastJSON(await service.retrieve(who(authorization, x_api_key), body.queries, body.topk,
                                               body.return_scores, body.corpus_id, body.mode))

    @app.post("/u/{corpus_id}/retrieve", summary="Search-R1 retrieval in one corpus named by the URL")
    async def retrieve_in(body: RetrieveRequest, corpus_id: str = Path(pattern=ID_PATTERN),
                          authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> Response:
        if body.corpus_id and body.corpus_id != corpus_id:
            raise ApiError(422, "corpus_id: the body names another corpus than the URL")
        return FastJSON(await service.retrieve(who(authorization, x_api_key), body.queries, body.topk,
                                               body.return_scores, corpus_id, body.mode))

    @app.post("/memories", summary="append sessions to a user's memory")
    async def add_memories(body: MemoriesRequest, authorization: str | None = Header(None),
                           x_api_key: str | None = Header(None)) -> dict:
        return await service.add_memories(who(authorization, x_api_key), body.user_id,
                                          [s.model_dump() for s in body.sessions])

    @app.post("/search", summary="a user's sessions for one query (first_stage or ranked)")
    async def search(body: SearchRequest, authorization: str | None = Header(None),
                     x_api_key: str | None = Header(None)) -> Response:
        return FastJSON(await service.search(who(authorization, x_api_key), body.user_id, body.query, body.top_k,
                                             body.mode))

    @app.delete("/memories/{user_id}", summary="delete a user's memories")
    async def delete_memories(user_id: str = Path(pattern=ID_PATTERN), authorization: str | None = Header(None),
                              x_api_key: str | None = Header(None)) -> dict:
        return await service.delete_memories(who(authorization, x_api_key), user_id)

    # ------------------------------------------------------------------ mem0-compatible (base URL: /mem0)
    from fastapi import Query

    from .mem0 import Mem0API

    m0 = app.state.mem0 = Mem0API(service)
    tags = ["mem0-compatible (base URL /mem0)"]

    def qid():  # noqa: ANN202 - one Query per parameter (FastAPI binds a shared one to a single name)
        return Query(None, pattern=ID_PATTERN)

    @app.post("/mem0/memories", tags=tags, summary="add: each message one memory (no LLM), durable on return")
    async def m0_add(body: Mem0AddRequest, authorization: str | None = Header(None),
                     x_api_key: str | None = Header(None)) -> dict:
        return await m0.add(who(authorization, x_api_key), [m.model_dump() for m in body.messages], body.user_id,
                            body.agent_id, body.run_id, body.metadata, infer=body.infer)

    @app.get("/mem0/memories", tags=tags, summary="list an owner's memories")
    async def m0_list(user_id: str | None = qid(), agent_id: str | None = qid(), run_id: str | None = qid(),
                      authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> dict:
        return await m0.list(who(authorization, x_api_key), user_id, agent_id, run_id)

    @app.delete("/mem0/memories", tags=tags, summary="delete an owner's memories (their history stays)")
    async def m0_delete_all(user_id: str | None = qid(), agent_id: str | None = qid(), run_id: str | None = qid(),
                            authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> dict:
        return await m0.delete_all(who(authorization, x_api_key), user_id, agent_id, run_id)

    @app.get("/mem0/memories/{memory_id}", tags=tags, summary="one memory")
    async def m0_get(memory_id: str = Path(max_length=300), authorization: str | None = Header(None),
                     x_api_key: str | None = Header(None)) -> dict:
        return await m0.get(who(authorization, x_api_key), memory_id)

    @app.put("/mem0/memories/{memory_id}", tags=tags, summary="replace a memory's text (recorded in its history)")
    async def m0_update(body: Mem0UpdateRequest, memory_id: str = Path(max_length=300),
                        authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> dict:
        text = body.text if body.text is not None else body.memory if body.memory is not None else body.data
        if text is None or not text.strip():
            raise ApiError(422, "text: the memory's new text is required")
        return await m0.update(who(authorization, x_api_key), memory_id, text, body.metadata)

    @app.delete("/mem0/memories/{memory_id}", tags=tags, summary="delete one memory")
    async def m0_delete(memory_id: str = Path(max_length=300), authorization: str | None = Header(None),
                        x_api_key: str | None = Header(None)) -> dict:
        return await m0.delete(who(authorization, x_api_key), memory_id)

    @app.get("/mem0/memories/{memory_id}/history", tags=tags, summary="a memory's changes, oldest first")
    async def m0_history(memory_id: str = Path(max_length=300), authorization: str | None = Header(None),
                         x_api_key: str | None = Header(None)) -> list:
        return await m0.history(who(authorization, x_api_key), memory_id)

    @app.post("/mem0/search", tags=tags, summary="an owner's memories for a query: filters, limit, threshold")
    async def m0_search(body: Mem0SearchRequest, authorization: str | None = Header(None),
                        x_api_key: str | None = Header(None)) -> Response:
        return FastJSON(await m0.search(who(authorization, x_api_key), body.query, body.user_id, body.agent_id,
                                        body.run_id, body.filters, body.limit, body.threshold))

    @app.post("/mem0/reset", tags=tags, summary="reset an owner: memories and history removed")
    async def m0_reset(user_id: str | None = qid(), agent_id: str | None = qid(), run_id: str | None = qid(),
                       authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> dict:
        return await m0.reset(who(authorization, x_api_key), user_id, agent_id, run_id)

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        from fastapi.responses import HTMLResponse

        return HTMLResponse(DOCS_HTML)

    @app.get("/healthz", summary="liveness: status (ok, or loading until ready) and, with a key, what is loaded")
    async def healthz(authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> dict:
        try:
            who(authorization, x_api_key)
        except Unauthorized:   # a probe without a key: the status only
            return service.health(detail=False)
        return service.health()

    @app.get("/readyz", summary="readiness: 200 once the index, the encoder and every unit vector are loaded, "
             "else 503")
    async def readyz() -> Response:
        ready, why = service.readiness()
        return JSONResponse({"status": "ready" if ready else "loading", **({"detail": why} if why else {})},
                            status_code=200 if ready else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics(authorization: str | None = Header(None), x_api_key: str | None = Header(None)) -> Response:
        who(authorization, x_api_key)
        service._update_gauges()
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)

    # the hot routes, also answered without FastAPI's request machinery (FastRoutes)
    posts = {r.path: r for r in app.router.routes if isinstance(r, APIRoute) and "POST" in r.methods}
    fast.add(posts["/retrieve"], RetrieveRequest, retrieve)
    fast.add(posts["/u/{corpus_id}/retrieve"], RetrieveRequest, retrieve_in)
    fast.add(posts["/mem0/memories"], Mem0AddRequest, m0_add)
    return app
