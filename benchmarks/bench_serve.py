#!/usr/bin/env python3
"""memsifter serve under load (issue 32): first-stage mode against a dense-only baseline, in one run.

    .venv/bin/python benchmarks/bench_serve.py                          # load levels 1, 8, 32, 128 (25 s each)
    .venv/bin/python benchmarks/bench_serve.py --soak-minutes 10        # and the soak at 32 clients
    .venv/bin/python benchmarks/bench_serve.py --levels 8 --seconds 10 --servers local,baseline   # quick

Data (read-only, ../shared/data; the script says so and exits 0 when it is absent): the 348 LongMemEval_S
training items. Under ``--work`` (default ``.cache/serve-bench``; finished work is reused): the dataset
imported by the platform, the embed stage's output (all-MiniLM-L6-v2, the default zsum first stage), and
the service's state with the unit vectors of every session (the first run embeds them here: timed and
reported; later runs read them). Corpora: the 348 questions' haystacks (corpus id = question id);
queries: each corpus's own question, in a fixed shuffled order.

Servers, one at a time, each a separate process on 127.0.0.1 (so the load generator's CPU is not theirs):

- ``baseline``: a minimal FastAPI server doing only what Search-R1's retriever does with FAISS flat:
  the query embedded (same model, one request at a time, torch on min(2, cores) threads: what it ran
  with before the service's default became the cores but one), a dense dot product over the corpus's unit
  vectors (the same vectors the service's dense leg reads), max per session, top-k, the same documents
  and JSON. Defined below (``--baseline-server``).
- ``serve``: ``memsifter serve`` on Ray Serve (the proxy, then the FirstStage replica): the full fusion
  (two BM25 views + the dense leg over the lexical top 15, z-scored), ``reuse_query_vectors: false`` so
  every query goes through the model as in the baseline.
- ``local``: the same app under uvicorn without Ray (``memsifter serve --no-ray``): the Serve overhead.

Load: ``--levels`` concurrent clients (asyncio + aiohttp, one connection each), each posting
``{"queries": [q], "topk": 3, "return_scores": true}`` to ``/u/{id}/retrieve`` back to back for
``--seconds`` after ``--warmup`` seconds, at most ``--max-requests`` per level. Every answer is checked
(status 200, 3 documents). Reported per server and level: requests, errors, queries/s, p50 / p90 / p99
latency. Identity: before the load, every question's full order from the service's code in this process
against ``rankings.parquet`` (stored query vectors, the service's default), and its top 10 with fresh
query vectors.

Soak (``--soak-minutes``, 0 = off): the Ray Serve server at ``--soak-clients`` clients; the RSS of the
server's processes every ``--rss-every`` seconds; at half time the index is published again (same files,
a new ``_SUCCESS``: what re-running the embed stage does), which the server reloads while serving
(``reload_poll_s`` 5 s). Reported: requests, errors (any non-200 or malformed answer), RSS first/last/max,
the reload seen by ``/healthz``.

``--queries sample``: each corpus searched with each of the 30 questions of the shipped LongMemEval sample (mixed
lengths) instead of its own question, in every mode. ``BENCH_SERVE_SET`` (environment): more options
for the memsifter servers (``--set KEY=VALUE ...``; not the baseline; split like a shell line), recorded in the ``--writes`` report's command.

``--mode ranked`` (issue 46 item 5): every load request asks for ``mode: "ranked"`` (the first stage, then the
ranker over its top candidates); give the memsifter servers a ranker through ``BENCH_SERVE_SET`` (e.g.
``--set ranker.model=smollm2-135m-instruct --set ranker.engine=vllm``; ``benchmarks/gpu/run_serve_ranked.py`` on a GPU).
Each answer says whether the ranker ranked it (``ranker[i].status``: ``ok``) or the first stage answered
(``fallback``, with the reason: no ranker, a timeout, an unparsable answer); per level the report counts
both (``ranked``, ``fallback``, the reasons), so a rate of fallbacks is never read as a rate of rankings.
``--sample N``: the data are the first N questions of the LongMemEval sample shipped with memsifter (no
shared/ data needed; what the GPU driver uses), the identity check skipped.

Output (``--out``): ``serve.json`` (every number, the machine), ``serve.md`` (the tables), ``serve.png``
(queries/s and p99 by clients; RSS over the soak).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
from fastapi import Request   # at module level: the baseline route's annotation is resolved from here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "data")
TRAIN = "longmemeval_s_train348.json.gz"
TOPK = 3
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- preparation
def prepare(work: str, source: str) -> dict:
    """Import + embed (skipped when published), then every session's unit vectors into the state."""
    from memsifter.stage import get_stage

    data, index, state = (os.path.join(work, n) for n in ("data", "embed", "state"))
    out = {"data": data, "index": index, "state": state}
    t0 = time.time()
    m = get_stage("import").run({"output": data, "format": "longmemeval", "source": source})
    out["import_seconds"] = round(time.time() - t0, 1)
    t0 = time.time()
    from memsifter.store import storage

    held = storage.try_manifest(index) if os.path.exists(index) else None
    if held and held.get("stage") == "embed" and held["config"].get("model") == "all-MiniLM-L6-v2" \
            and held.get("stats", {}).get("primary") == "zsum":
        m = {"skipped": True, "stats": held["stats"]}   # an earlier run's (its input may be written another way)
    else:
        m = get_stage("embed").run({"output": index, "input": data, "model": "all-MiniLM-L6-v2"})
    out["embed_stage"] = {"skipped": bool(m.get("skipped")), "seconds_this_run": round(time.time() - t0, 1),
                          **{k: m["stats"].get(k) for k in ("texts", "embedded", "embed_seconds", "texts_per_second",
                                                            "questions", "sessions")}}
    from memsifter.service.config import ServeConfig
    from memsifter.service.index import Encoder, PublishedIndex, Units

    cfg = ServeConfig(index=index, dataset=data, state=state)
    t0 = time.time()
    idx = PublishedIndex.load(cfg)
    out["index_load_seconds"] = round(time.time() - t0, 1)
    enc = Encoder(idx.settings.spec)
    units = Units(idx.vectors, enc, idx.settings.turn_words)
    t0 = time.time()
    done = {"n": 0, "t": time.time()}

    def progress(n: int) -> None:
        done["n"] += n
        if time.time() - done["t"] > 30:
            done["t"] = time.time()
            log(f"unit vectors: {done['n']} texts embedded, {done['n'] / (time.time() - t0):.1f}/s")
    n = units.ensure(idx.sessions.values(), chunk=256, progress=progress)
    secs = time.time() - t0
    out["units"] = {"sessions": len(idx.sessions), "unit_vectors": units.count(), "embedded_this_run": n,
                    "seconds_this_run": round(secs, 1), "texts_per_second": round(n / secs, 1) if n else None}
    log(f"unit vectors of {len(idx.sessions)} sessions ready: {units.count()} units, {n} embedded now in {secs:.0f}s")
    out["identity"] = identity(cfg, idx)
    return out


def identity(cfg, idx) -> dict:
    """Every question through the service's code (no HTTP) against the stage's rankings.parquet."""
    from memsifter.retrieval import rankings
    from memsifter.service.core import RetrievalService

    rows = {r["question_id"]: r for r in rankings.read_rankings(cfg.index)}
    out = {}
    for reuse in (True, False):
        svc = RetrievalService(cfg.model_copy(update={"reuse_query_vectors": reuse, "reload_poll_s": 0}),
                               start_threads=False)
        st = svc.state
        st.units_ready = True
        full = top10 = 0

        async def run() -> None:
            nonlocal full, top10
            for qid, c in st.index.corpora.items():
                order, _ = await svc.first_stage(st, c, c.question)
                ids = [c.sessions[i].session_id for i in order]
                full += ids == rows[qid]["ranked_session_ids"]
                top10 += ids[:10] == rows[qid]["ranked_session_ids"][:10]
        asyncio.run(run())
        out["stored_query_vectors" if reuse else "fresh_query_vectors"] = {
            "questions": len(st.index.corpora), "full_order_identical": full, "top10_identical": top10}
        svc.close()
    log(f"identity: {out}")
    return out


# --------------------------------------------------------------------------- the baseline server
def baseline_app(index: str, data: str, state: str):  # noqa: ANN201
    """Search-R1's retriever, minimal: embed the query, dot product over the corpus's unit vectors, max per
    session, top-k; the same documents as the service (title line + the session as the rank stage
    renders it)."""
    from fastapi import FastAPI

    from memsifter.service.config import ServeConfig
    from memsifter.service.index import Encoder, PublishedIndex, Units, corpus_title
    from memsifter.retrieval.render import render_session

    idx = PublishedIndex.load(ServeConfig(index=index, dataset=data, state=state), lexical=False)
    idx.vectors.load()
    enc = Encoder(idx.settings.spec, max(1, min(2, os.cpu_count() or 1)))   # the threads it always had
    enc.encode(["warm-up"], urgent=True)   # ready = warm, as the service's /readyz
    units = Units(idx.vectors, enc, idx.settings.turn_words)
    flat = {}
    for cid, c in idx.corpora.items():
        mats = [units.matrix(s) for s in c.sessions]
        owner = np.repeat(np.arange(len(mats)), [len(m) for m in mats])
        flat[cid] = (np.concatenate(mats), np.searchsorted(owner, np.arange(len(mats))), c)
    app = FastAPI()

    @app.post("/u/{cid}/retrieve")
    async def retrieve(cid: str, request: Request) -> dict:
        body = await request.json()
        k = body.get("topk") or 3
        mat, starts, c = flat[cid]
        qv = (await asyncio.to_thread(enc.encode, body["queries"], 64, True))
        result = []
        for v in qv:
            best = np.maximum.reduceat(mat @ v, starts)
            top = np.argsort(-best, kind="stable")[:k]
            docs = [{"id": c.sessions[i].session_id,
                     "contents": corpus_title(c.sessions[i], c.dates[i]) + "\n" + render_session(c.sessions[i].turns)}
                    for i in top]
            result.append([{"document": d, "score": float(best[i])} for d, i in zip(docs, top)]
                          if body.get("return_scores") else docs)
        return {"result": result}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "corpora": len(flat), "units_ready": True}
    return app


# --------------------------------------------------------------------------- servers
def proc_tree_rss(pid: int) -> int:
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


class Server:
    def __init__(self, kind: str, prep: dict, port: int, logdir: str, reload_poll_s: float = 0, write: bool = False):
        self.kind, self.port = kind, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(logdir, f"server-{kind}.log")
        env = {**os.environ, **ENV}
        env.pop("RAY_ADDRESS", None)
        common = ["--index", prep["index"], "--dataset", prep["data"], "--state", prep["state"], "--port", str(port),
                  "--set", "reuse_query_vectors=false", "--set", f"reload_poll_s={reload_poll_s}",
                  "--set", "auth.anonymous={read: ['*']%s}" % (", write: ['*']" if write else ""), "-q", *shlex.split(os.environ.get("BENCH_SERVE_SET", ""))]
        if kind == "baseline":
            cmd = [sys.executable, os.path.abspath(__file__), "--baseline-server", "--port", str(port),
                   "--work", os.path.dirname(prep["index"])]
        elif kind == "serve":
            cmd = [sys.executable, "-m", "memsifter.service.cli", *common]
        else:
            cmd = [sys.executable, "-m", "memsifter.service.cli", "--no-ray", *common]
        self.logf = open(self.log_path, "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 1800) -> dict:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited ({self.proc.returncode}); log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=5) as r:
                    h = json.loads(r.read())
                # ready as /readyz means it (units embedded, mem0 logs folded at start); a server before that
                # field answers units_ready only
                if h.get("ready", h.get("units_ready")) and h.get("units_ready", True):
                    h["ready_seconds"] = round(time.time() - self.t0, 1)
                    return h
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.kind} server not ready in {timeout}s; log: {self.log_path}")

    def health(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(self.url + "/healthz", timeout=30) as r:
            return json.loads(r.read())

    def rss(self) -> int:
        return proc_tree_rss(self.proc.pid)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self.logf.close()


# --------------------------------------------------------------------------- load
def workload(data: str, seed: int = 0, queries: str = "own") -> list[tuple[str, str]]:
    """(corpus id, query) pairs in a fixed shuffled order: each corpus with its own question (``own``), or with
    each of the 30 questions of the shipped LongMemEval sample (``sample``: queries of mixed lengths, as many
    users' are, whatever the corpora; with ``--sample 3`` the own questions are three of alike length)."""
    from memsifter.data.model import read_dataset

    ds = read_dataset(data)
    if queries == "sample":
        import gzip
        from importlib import resources

        with gzip.open(str(resources.files("memsifter").joinpath("samples", "longmemeval_s_dev30.json.gz")), "rt") as f:
            texts = [q["question"] for q in json.load(f)]
        items = [(q.question_id, t) for q in ds.questions for t in texts]
    else:
        items = [(q.question_id, q.question) for q in ds.questions]
    random.Random(seed).shuffle(items)
    return items


MODES = ("first_stage", "ranked")


def request_body(query: str, mode: str = "first_stage") -> dict:
    """One load request's JSON: ``mode`` is sent only when it is not the service's default (first_stage), so
    the first-stage benchmark's requests are the ones it always sent."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    body = {"queries": [query], "topk": TOPK, "return_scores": True}
    if mode != "first_stage":
        body["mode"] = mode
    return body


def ranker_outcome(answer: dict) -> tuple[str, str | None]:
    """A ranked answer's outcome from its ``ranker`` field (one entry per query): ``ranked`` (status ok),
    ``fallback`` (the first stage answered; with the reason) or ``unmarked`` (no ranker field: a server that
    ignores the mode, e.g. the baseline)."""
    info = answer.get("ranker")
    if not info:
        return "unmarked", None
    st = info[0] or {}
    if st.get("status") == "ok":
        return "ranked", None
    return "fallback", str(st.get("reason") or st.get("status"))[:120]


async def load(url: str, items: list[tuple[str, str]], clients: int, seconds: float, warmup: float,
               max_requests: int, on_tick=None, per_request: bool = False, mode: str = "first_stage") -> dict:
    import aiohttp

    lat: list[float] = []
    errors: dict[str, int] = {}
    outcomes = {"ranked": 0, "fallback": 0, "unmarked": 0}
    reasons: dict[str, int] = {}
    counter = {"next": 0, "sent": 0}
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds

    async def client(i: int, session) -> None:
        while True:
            now = time.perf_counter()
            if now >= t_end or counter["sent"] >= max_requests:
                return
            counter["sent"] += now >= t_measure
            qid, q = items[counter["next"] % len(items)]
            counter["next"] += 1
            t0 = time.perf_counter()
            outcome = None
            try:
                async with session.post(f"{url}/u/{qid}/retrieve", json=request_body(q, mode)) as r:
                    body = await r.read()
                    ok = r.status == 200
                    if ok:
                        answer = json.loads(body)
                        res = answer["result"]
                        ok = len(res) == 1 and len(res[0]) == TOPK and "contents" in res[0][0]["document"]
                        if ok and mode == "ranked":
                            outcome = ranker_outcome(answer)
                    why = "bad answer" if r.status == 200 else f"HTTP {r.status}"
            except Exception as e:  # noqa: BLE001 - counted
                ok, why = False, type(e).__name__
            t1 = time.perf_counter()
            if t0 >= t_measure and t1 <= t_end:
                if ok:
                    lat.append(t1 - t0)
                    if outcome:
                        outcomes[outcome[0]] += 1
                        if outcome[1]:
                            reasons[outcome[1]] = reasons.get(outcome[1], 0) + 1
                else:
                    errors[why] = errors.get(why, 0) + 1
            elif not ok and t0 >= t_start:
                errors[why] = errors.get(why, 0) + 1
            if on_tick:
                on_tick()

    conn = aiohttp.TCPConnector(limit=clients, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    elapsed = min(time.perf_counter(), t_end) - t_measure
    a = np.array(lat) if lat else np.zeros(1)
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": len(lat), "errors": sum(errors.values()),
            "error_kinds": errors, "qps": round(len(lat) / elapsed, 2) if elapsed > 0 else 0.0,
            "p50_ms": round(float(np.percentile(a, 50)) * 1000, 1), "p90_ms": round(float(np.percentile(a, 90)) * 1000, 1),
            "p99_ms": round(float(np.percentile(a, 99)) * 1000, 1), "mean_ms": round(float(a.mean()) * 1000, 1),
            **({"mode": mode, **outcomes, "ranked_per_s": round(outcomes["ranked"] / elapsed, 2) if elapsed > 0 else 0.0,
                "fallback_reasons": reasons} if mode != "first_stage" else {}),
            **({"latencies_ms": [round(x * 1000, 3) for x in lat]} if per_request else {})}


def _stats(lat: list[float]) -> dict:
    a = np.array(lat) if lat else np.zeros(1)
    return {"p50_ms": round(float(np.percentile(a, 50)) * 1000, 1), "p99_ms": round(float(np.percentile(a, 99)) * 1000, 1),
            "max_ms": round(float(a.max()) * 1000, 1)}


async def write_load(url: str, clients: int, seconds: float, warmup: float, tag: str, dup_every: int = 10) -> dict:
    """``clients`` writers, each adding one new memory per request to its own user through the mem0-compatible
    API (``POST /mem0/memories``), every ``dup_every``-th request re-sending an earlier one (expected: the
    same memory, event NONE). Returns latencies, and per user the ids acknowledged as added."""
    import aiohttp

    lat: list[float] = []
    errors: dict[str, int] = {}
    acked: dict[str, set] = {}
    resent = {"n": 0, "none": 0}
    t_start = time.perf_counter()
    t_measure, t_end = t_start + warmup, t_start + warmup + seconds
    rng = random.Random(0)
    words = "trip cat garden piano nurse Lisbon tea bike sister novel coffee museum train recipe".split()

    async def client(i: int, session) -> None:
        user = f"{tag}-{i}"
        acked[user] = set()
        sent: list[str] = []
        n = 0
        while time.perf_counter() < t_end:
            n += 1
            dup = bool(sent) and n % dup_every == 0
            text = sent[rng.randrange(len(sent))] if dup else \
                f"note {n} of client {i}: " + " ".join(rng.choice(words) for _ in range(12))
            t0 = time.perf_counter()
            try:
                async with session.post(f"{url}/mem0/memories", json={"messages": [{"role": "user", "content": text}],
                                                                       "user_id": user}) as r:
                    body = json.loads(await r.read())
                    ok = r.status == 200
                    why = f"HTTP {r.status}"
            except Exception as e:  # noqa: BLE001 - counted
                ok, why, body = False, type(e).__name__, None
            t1 = time.perf_counter()
            if not ok:
                errors[why] = errors.get(why, 0) + 1
                continue
            ev = body["results"][0]
            if ev["event"] == "ADD":
                acked[user].add(ev["id"])
                sent.append(text)
            if dup:
                resent["n"] += 1
                resent["none"] += ev["event"] == "NONE"
            if t0 >= t_measure and t1 <= t_end:
                lat.append(t1 - t0)

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    return {"clients": clients, "seconds": seconds, "adds": len(lat), "errors": sum(errors.values()),
            "error_kinds": errors, "adds_per_s": round(len(lat) / seconds, 1), **_stats(lat),
            "resent": resent["n"], "resent_answered_as_the_same_memory": resent["none"],
            "latencies_ms": [round(x * 1000, 3) for x in lat],
            "acked": {u: sorted(v) for u, v in acked.items()}}


async def count_memories(url: str, acked: dict[str, list]) -> dict:
    """Every user's memories listed: acknowledged adds missing (lost) and memories of the same text (duplicated)."""
    import aiohttp

    lost = dup = total = 0
    async with aiohttp.ClientSession() as session:
        for user, ids in acked.items():
            async with session.get(f"{url}/mem0/memories", params={"user_id": user}) as r:
                got = json.loads(await r.read())["results"]
            have = {m["id"] for m in got}
            texts = [m["memory"] for m in got]
            lost += len(set(ids) - have)
            dup += len(texts) - len(set(texts))
            total += len(got)
    return {"memories": total, "acked": sum(len(v) for v in acked.values()), "lost": lost, "duplicated": dup}


def writes(prep: dict, items, clients: int, seconds: float, warmup: float, logdir: str) -> dict:
    """Issue 46's write targets: adds alone at ``clients``, counted, counted again after a restart; then
    searches at ``clients`` with ``clients // 4`` writers running; then the Search-R1-style baseline's
    searches at ``clients`` (no writes: it has none), all on this machine in this run."""
    out: dict = {}
    per = out["per_request"] = {}   # each measured request's latency (ms), in the order they ended
    server = Server("local", prep, free_port_(), logdir, write=True)
    try:
        out["first_ready_s"] = server.wait_ready()["ready_seconds"]   # on the state as the run found it
        w = asyncio.run(write_load(server.url, clients, seconds, warmup, f"w{int(time.time())}"))
        acked = w.pop("acked")
        out["adds"] = w
        per["adds"] = w.pop("latencies_ms")
        out["count"] = asyncio.run(count_memories(server.url, acked))
        log(f"adds at {clients} clients: {w['adds_per_s']} adds/s p50 {w['p50_ms']} ms p99 {w['p99_ms']} ms "
            f"errors {w['errors']}; {out['count']}")
    finally:
        server.stop()
    server = Server("local", prep, free_port_(), logdir, write=True)
    try:
        # seconds from the restart to ready: the index, the units and (memory_compact_at_start) the mem0 logs
        # folded, on the state as the adds left it
        out["restart_ready_s"] = server.wait_ready()["ready_seconds"]
        out["count_after_restart"] = asyncio.run(count_memories(server.url, acked))
        log(f"after a restart: {out['count_after_restart']}")

        async def mixed() -> tuple[dict, dict]:
            return await asyncio.gather(load(server.url, items, clients, seconds, warmup, 10**9, per_request=True),
                                        write_load(server.url, max(1, clients // 4), seconds, warmup, "mixed"))
        s, w2 = asyncio.run(mixed())
        w2.pop("acked")
        out["search_with_adds"], out["adds_during_search"] = s, w2
        per["search_with_adds"], per["adds_during_search"] = s.pop("latencies_ms"), w2.pop("latencies_ms")
        log(f"search at {clients} clients with {w2['clients']} writers: {s['qps']} q/s p99 {s['p99_ms']} ms "
            f"errors {s['errors']}; adds p99 {w2['p99_ms']} ms")
    finally:
        server.stop()
    server = Server("baseline", prep, free_port_(), logdir)
    try:
        server.wait_ready()
        out["baseline_search"] = asyncio.run(load(server.url, items, clients, seconds, warmup, 10**9, per_request=True))
        per["baseline_search"] = out["baseline_search"].pop("latencies_ms")
        b = out["baseline_search"]
        log(f"baseline search at {clients} clients: {b['qps']} q/s p99 {b['p99_ms']} ms")
    finally:
        server.stop()
    out["search_qps_over_baseline"] = round(out["search_with_adds"]["qps"] / max(out["baseline_search"]["qps"], 1e-9), 2)
    return out


def free_port_() -> int:
    from memsifter.service.local import free_port

    return free_port()


def writes_report(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    per = res["writes"].pop("per_request", None)
    if per is not None:   # beside the summary: each phase's per-request latencies (ms)
        with open(os.path.join(out, "requests.json"), "w") as f:
            json.dump(per, f)
    with open(os.path.join(out, "writes.json"), "w") as f:
        json.dump(res, f, indent=2)
    w = res["writes"]
    a, s, b, d = w["adds"], w["search_with_adds"], w["baseline_search"], w["adds_during_search"]
    end = res["machine"].get("loadavg_end")   # runs before 2026-11-27-2 did not record it
    lines = [f"# memsifter serve: writes and searches under load ({res['date']}, {res['machine'].get('cores')} CPUs, "
             f"load average at start {res['machine'].get('loadavg')}" + (f", at the end {end}" if end else "") + ")", "",
             f"Command: `{res['command']}`", "",
             "| measure | clients | per s | p50 ms | p99 ms | errors | target |", "|---|---|---|---|---|---|---|",
             f"| adds (mem0 API, no LLM) | {a['clients']} | {a['adds_per_s']} | {a['p50_ms']} | {a['p99_ms']} | "
             f"{a['errors']} | p99 <= 50 ms |",
             f"| search, adds running | {s['clients']} | {s['qps']} | {s['p50_ms']} | {s['p99_ms']} | {s['errors']} | "
             "p99 <= 250 ms |",
             f"| adds during that search | {d['clients']} | {d['adds_per_s']} | {d['p50_ms']} | {d['p99_ms']} | "
             f"{d['errors']} | |",
             f"| baseline search (Search-R1-style) | {b['clients']} | {b['qps']} | {b['p50_ms']} | {b['p99_ms']} | "
             f"{b['errors']} | |", "",
             f"Search throughput over the baseline: {w['search_qps_over_baseline']}x (target >= 1.5x). "
             f"Counted after the adds: {w['count']}; after a restart: {w['count_after_restart']}. "
             f"Re-sent adds answered as the same memory: {a['resent_answered_as_the_same_memory']}/{a['resent']}."]
    with open(os.path.join(out, "writes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def run_levels(server: Server, items, levels, seconds, warmup, max_requests, mode: str = "first_stage") -> list[dict]:
    out = []
    for c in levels:
        r = asyncio.run(load(server.url, items, c, seconds, warmup, max_requests, mode=mode))
        r["rss_mb"] = round(server.rss() / 2**20)
        ranked = f"  ranked {r['ranked']} fallback {r['fallback']}" if mode == "ranked" else ""
        log(f"{server.kind:8s} clients {c:4d}: {r['qps']:7.1f} q/s  p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms"
            f"  errors {r['errors']}  rss {r['rss_mb']} MB{ranked}")
        out.append(r)
    return out


def republish(uri: str) -> None:
    from memsifter.store import storage

    m = storage.read_manifest(uri)
    pub = storage.Publication(uri, m["stage"], m["config"], m["config_hash"], m["code_version"])
    for name in m["files"]:
        pub.add_file(name, storage.join(uri, name))
    pub.publish(m.get("stats"))


def soak(prep: dict, items, minutes: float, clients: int, rss_every: float, port: int, logdir: str) -> dict:
    server = Server("serve", prep, port, logdir, reload_poll_s=5)
    try:
        h0 = server.wait_ready()
        log(f"soak: server ready in {h0['ready_seconds']}s; {minutes} min at {clients} clients")
        seconds = minutes * 60
        rss: list[tuple[float, int]] = []
        state = {"last": 0.0, "reloaded": False, "t0": time.time(), "reload_at": None}

        def tick() -> None:
            now = time.time()
            if now - state["last"] >= rss_every:
                state["last"] = now
                rss.append((round(now - state["t0"], 1), server.rss()))
            if not state["reloaded"] and now - state["t0"] >= seconds / 2:
                state["reloaded"] = True
                state["reload_at"] = round(now - state["t0"], 1)
                import threading

                threading.Thread(target=republish, args=(prep["index"],), daemon=True).start()
        r = asyncio.run(load(server.url, items, clients, seconds, 5, 10**9, on_tick=tick))
        h1 = server.health()
        mb = [v / 2**20 for _, v in rss]
        after = [v for t, v in rss if t >= 60] or [v for _, v in rss]
        out = {**r, "minutes": minutes, "reload_at_s": state["reload_at"], "reloads_seen": h1.get("reloads"),
               "rss": [[t, round(v / 2**20, 1)] for t, v in rss], "rss_first_mb": round(after[0] / 2**20, 1),
               "rss_last_mb": round(mb[-1], 1), "rss_max_mb": round(max(mb), 1),
               "rss_growth": round(mb[-1] / (after[0] / 2**20) - 1, 4)}
        log(f"soak: {out['requests']} requests, {out['errors']} errors, reloads {out['reloads_seen']}, RSS "
            f"{out['rss_first_mb']} -> {out['rss_last_mb']} MB (max {out['rss_max_mb']})")
        return out
    finally:
        server.stop()


# --------------------------------------------------------------------------- report
def machine() -> dict:
    import psutil

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    gpu = None
    try:   # the GPU's name where there is one (the ranked mode's GPU runs); nothing on a CPU machine
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False,
                           timeout=30)
        gpu = ", ".join(x.strip() for x in q.stdout.splitlines() if x.strip()) or None if q.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            **({"gpu": gpu} if gpu else {}),
            "python": platform.python_version(), "platform": platform.platform(),
            "load_avg_at_start": list(os.getloadavg())}


def report(res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serve.json"), "w") as f:
        json.dump(res, f, indent=2)
    mode = res["args"].get("mode") or "first_stage"
    data = (f"the first {res['args']['sample']} questions of the shipped LongMemEval sample" if res["args"].get("sample")
            else "LongMemEval_S train348")
    lines = [f"# memsifter serve, {mode.replace('_', '-')} mode, {data} ({res['date']})", "",
             f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores (shared), "
             f"{res['machine']['memory_gb']} GB; load average at start {res['machine']['load_avg_at_start']}"
             + (f"; GPU {res['machine']['gpu']}" if res["machine"].get("gpu") else "") + ".", "",
             f"Each level: {res['args']['seconds']} s after {res['args']['warmup']} s warm-up, topk {TOPK}, one query "
             "per request, every query embedded by the server.", ""]
    if res.get("server_sets"):
        lines += [f"Memsifter servers' options (BENCH_SERVE_SET): `{' '.join(res['server_sets'])}`.", ""]
    ranked = mode == "ranked"
    if ranked:
        lines += ["Ranked mode: every request asks for `mode: ranked`; *ranked* = answers the ranker ordered "
                  "(`ranker[0].status` ok), *fallback* = answers the first stage gave instead (the reasons below); "
                  "queries/s and latencies count both.", "",
                  "| server | clients | queries/s | ranked | fallback | ranked/s | p50 ms | p90 ms | p99 ms | errors |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| server | clients | queries/s | p50 ms | p90 ms | p99 ms | errors | ratio to baseline q/s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["clients"]: r["qps"] for r in res["levels"].get("baseline", [])}
    reasons: dict[str, int] = {}
    for kind, rows in res["levels"].items():
        for r in rows:
            if ranked:
                lines.append(f"| {kind} | {r['clients']} | {r['qps']:.1f} | {r.get('ranked', 0)} | {r.get('fallback', 0)} | "
                             f"{r.get('ranked_per_s', 0):.1f} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | {r['p99_ms']:.1f} | "
                             f"{r['errors']} |")
                for why, n in (r.get("fallback_reasons") or {}).items():
                    reasons[f"{kind}: {why}"] = reasons.get(f"{kind}: {why}", 0) + n
                continue
            ratio = f"{r['qps'] / base[r['clients']]:.2f}" if base.get(r["clients"]) else "-"
            lines.append(f"| {kind} | {r['clients']} | {r['qps']:.1f} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | "
                         f"{r['p99_ms']:.1f} | {r['errors']} | {ratio} |")
    if reasons:
        lines += ["", "Fallback reasons (all levels): " + "; ".join(f"{why} ({n})" for why, n in
                                                                   sorted(reasons.items(), key=lambda x: -x[1])[:10]) + "."]
    if res.get("soak"):
        s = res["soak"]
        lines += ["", f"Soak (Ray Serve, {s['clients']} clients, {s['minutes']} min"
                  + (f", run {s['date']}" if s.get("date") else "") + f"): {s['requests']} requests, "
                  f"{s['errors']} errors, {s['qps']:.1f} q/s, p99 {s['p99_ms']:.1f} ms; index re-published at "
                  f"{s['reload_at_s']} s, reloads seen {s['reloads_seen']}; RSS {s['rss_first_mb']} -> "
                  f"{s['rss_last_mb']} MB (max {s['rss_max_mb']}), growth {100 * s['rss_growth']:.1f}%."]
    if res.get("soak", {}).get("note"):
        lines[-1] += f" Note: {res['soak']['note']}."
    pr = res.get("prepare", {})
    if pr.get("identity"):
        i = pr["identity"]
        lines += ["", "Identity with the embed stage's rankings.parquet (every question, the service's code): full order "
                  f"identical for {i['stored_query_vectors']['full_order_identical']}/{i['stored_query_vectors']['questions']} "
                  "with stored query vectors (the default), "
                  f"{i['fresh_query_vectors']['full_order_identical']}/{i['fresh_query_vectors']['questions']} with query "
                  "vectors computed by the service."]
    u = res.get("units_first_embedding") or (pr.get("units") if (pr.get("units") or {}).get("embedded_this_run") else None)
    if u:
        n, secs = u.get("texts", u.get("embedded_this_run")), u.get("seconds", u.get("seconds_this_run"))
        lines += ["", f"Unit vectors of every session (once, cached in the state): {n} texts embedded in {secs:.0f} s "
                  f"({n / secs:.1f} texts/s); index load (BM25 views of every corpus): {pr.get('index_load_seconds')} s."]
    for e in res.get("earlier_soaks", []):
        lines += ["", f"Earlier soak ({e['note']}): {e['requests']} requests, {e['errors']} errors, {e['qps']:.1f} q/s, "
                  f"p99 {e['p99_ms']:.1f} ms; reloads seen {e['reloads_seen']}; RSS {e['rss_first_mb']} -> "
                  f"{e['rss_last_mb']} MB (max {e['rss_max_mb']}), growth {100 * e['rss_growth']:.1f}%."]
    with open(os.path.join(out, "serve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n = 3 if res.get("soak") else 2
        fig, ax = plt.subplots(1, n, figsize=(5 * n, 4))
        for kind, rows in res["levels"].items():
            c = [r["clients"] for r in rows]
            ax[0].plot(c, [r["qps"] for r in rows], marker="o", label=kind)
            ax[1].plot(c, [r["p99_ms"] for r in rows], marker="o", label=kind)
        for a, t in zip(ax[:2], ("queries/s", "p99 latency (ms)")):
            a.set_xscale("log", base=2)
            a.set_xlabel("concurrent clients")
            a.set_title(t)
            a.legend()
        ax[1].axhline(250, color="grey", ls="--", lw=0.8)
        if res.get("soak"):
            s = res["soak"]
            ax[2].plot([t for t, _ in s["rss"]], [v for _, v in s["rss"]])
            if s.get("reload_at_s") is not None:
                ax[2].axvline(s["reload_at_s"], color="grey", ls="--", lw=0.8, label="re-published")
                ax[2].legend()
            ax[2].set_xlabel("seconds")
            ax[2].set_title("soak: server RSS (MB)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "serve.png"), dpi=110)
    except Exception as e:  # noqa: BLE001 - the numbers are written already
        log(f"plot skipped: {type(e).__name__}: {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=os.path.join(ROOT, ".cache", "serve-bench"))
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "serve-2026-11-26"))
    p.add_argument("--levels", default="1,8,32,128")
    p.add_argument("--seconds", type=float, default=25)
    p.add_argument("--warmup", type=float, default=3)
    p.add_argument("--max-requests", type=int, default=20000)
    p.add_argument("--servers", default="baseline,serve,local")
    p.add_argument("--soak-minutes", type=float, default=0)
    p.add_argument("--soak-clients", type=int, default=32)
    p.add_argument("--rss-every", type=float, default=10)
    p.add_argument("--skip-identity", action="store_true")
    p.add_argument("--soak-only", metavar="NOTE", help="only the soak, added to the --out results already there "
                   "(their soak, if any, kept under earlier_soaks with NOTE)")
    p.add_argument("--writes", type=int, metavar="CLIENTS", help="the write benchmark (issue 46) at CLIENTS: adds, "
                   "counts, a restart, searches with adds running, the baseline; written to --out/writes.{json,md} and "
                   "each measured request's latency to --out/requests.json")
    p.add_argument("--queries", choices=("own", "sample"), default="own",
                   help="each corpus searched with its own question (own) or with each of the shipped "
                        "sample's 30 questions (sample: mixed query lengths)")
    p.add_argument("--sample", type=int, metavar="N", help="data: the first N LongMemEval questions shipped with "
                   "memsifter (as `memsifter serve` uses them) instead of shared/'s 348")
    p.add_argument("--mode", choices=MODES, default="first_stage",
                   help="the mode every load request asks for (ranked: give the servers a ranker via BENCH_SERVE_SET; "
                        "answers are counted as ranked or fallback per level)")
    p.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    work = os.path.abspath(args.work)
    if args.baseline_server:
        import uvicorn

        app = baseline_app(os.path.join(work, "embed"), os.path.join(work, "data"), os.path.join(work, "state"))
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
        return 0
    if args.writes:
        if args.sample:
            from memsifter.service.cli import prepare_demo

            prepare_demo(work, args.sample, echo=log)
        prep = {k: os.path.join(work, k2) for k, k2 in (("data", "data"), ("index", "embed"), ("state", "state"))}
        logdir = os.path.join(work, "logs")
        os.makedirs(logdir, exist_ok=True)
        res = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": {**machine(), "loadavg": os.getloadavg()[0]},
               "command": (f"BENCH_SERVE_SET='{os.environ['BENCH_SERVE_SET']}' " if os.environ.get("BENCH_SERVE_SET")
                           else "") + "benchmarks/bench_serve.py " + " ".join(sys.argv[1:]), "args": vars(args)}
        res["writes"] = writes(prep, workload(prep["data"], queries=args.queries), args.writes, args.seconds,
                               args.warmup, logdir)
        res["machine"]["loadavg_end"] = os.getloadavg()[0]
        writes_report(res, args.out)
        return 0
    source = os.path.join(SHARED, TRAIN)
    if not os.path.exists(source) and not args.sample:
        print(f"bench_serve: {source} is absent (the project's shared/ data); nothing to measure")
        return 0
    from memsifter.service.local import free_port

    if args.soak_only:
        with open(os.path.join(args.out, "serve.json")) as f:
            res = json.load(f)
        if res.get("soak"):
            res.setdefault("earlier_soaks", []).append({**res.pop("soak"), "note": args.soak_only})
        prep = {k: os.path.join(work, k2) for k, k2 in (("data", "data"), ("index", "embed"), ("state", "state"))}
        logdir = os.path.join(work, "logs")
        os.makedirs(logdir, exist_ok=True)
        res["soak"] = soak(prep, workload(prep["data"], queries=args.queries), args.soak_minutes or 10, args.soak_clients, args.rss_every,
                           free_port(), logdir)
        res["soak"]["date"] = time.strftime("%Y-%m-%d %H:%M")
        report(res, args.out)
        return 0
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "args": vars(args), "levels": {}}
    if os.environ.get("BENCH_SERVE_SET"):
        res["server_sets"] = shlex.split(os.environ["BENCH_SERVE_SET"])
    t0 = time.time()
    if args.sample:   # the shipped sample: import + embed here (reused when published); the servers embed the units
        from memsifter.service.cli import prepare_demo

        prepare_demo(work, args.sample, echo=log)
    prep = prepare(work, source) if not (args.skip_identity or args.sample) else {
        "data": os.path.join(work, "data"), "index": os.path.join(work, "embed"), "state": os.path.join(work, "state")}
    res["prepare"] = {**prep, "seconds": round(time.time() - t0, 1)}
    items = workload(prep["data"], queries=args.queries)
    levels = [int(x) for x in args.levels.split(",") if x]
    logdir = os.path.join(work, "logs")
    os.makedirs(logdir, exist_ok=True)
    for kind in [k for k in args.servers.split(",") if k]:
        server = Server(kind, prep, free_port(), logdir)
        try:
            h = server.wait_ready()
            log(f"{kind}: ready in {h['ready_seconds']}s, RSS {server.rss() / 2**20:.0f} MB")
            res.setdefault("servers", {})[kind] = {"ready_seconds": h["ready_seconds"],
                                                  "rss_mb_ready": round(server.rss() / 2**20)}
            res["levels"][kind] = run_levels(server, items, levels, args.seconds, args.warmup, args.max_requests,
                                             args.mode)
        finally:
            server.stop()
        report(res, args.out)
    if args.soak_minutes > 0:
        res["soak"] = soak(prep, items, args.soak_minutes, args.soak_clients, args.rss_every, free_port(), logdir)
    report(res, args.out)
    log(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
