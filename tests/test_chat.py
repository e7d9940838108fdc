"""chat: a real vLLM OpenAI-compatible server, §5 context assembly, answer extraction, retries
through a faulty proxy (429/500), cache and resume."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading
import urllib.request
from collections import Counter

import pytest

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import read_dataset
from memsifter.retrieval.render import render_session
from memsifter.stage import get_stage
from memsifter.retrieval.context import TokenCounter, load_tokenizer
from memsifter.retrieval.prompting import load_prompt
from memsifter.stages.chat import (ApproxCounter, ChatConfig, build_messages, context_order, extract_answer,
                                   random_order)


@pytest.mark.parametrize("text,expected", [
    ("<think>hmm</think>The answer: <answer> Biscuit </answer>", "Biscuit"),
    ("<answer>a</answer> then <answer>b</answer>", "b"),
    ("<think>x <answer>no</answer></think> plain reply", "plain reply"),
    ("<answer>unterminated", "unterminated"),
    ("  just text  ", "just text"),
    ("", ""),
    (None, ""),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatdata")
    data = str(root / "data")
    get_stage("synth").run({"output": data, "questions": 5, "sessions_per_question": 8, "seed": 2})
    ds = read_dataset(data)
    ranked = str(root / "rank")
    pub = storage.Publication(ranked, "rank", {}, "fake", "test")
    # rank order: gold first, then the rest newest first
    rankings.write_rankings(pub, [{
        "question_id": q.question_id, "ranked_session_ids": q.gold_session_ids + [
            s for s in reversed(q.haystack_session_ids) if s not in q.gold_session_ids],
        "scores": None, "method": "rank:fake", "status": "ok", "reason": None, "raw_response": "x"}
        for q in ds.questions])
    pub.publish({})
    return data, ranked, ds


def test_context_assembly_budget_and_order(chat_data):
    data, ranked, ds = chat_data
    q = ds.questions[0]
    order = context_order(q, q.gold_session_ids[:1], list(reversed(q.haystack_session_ids)))
    assert order[0] == q.gold_session_ids[0] and sorted(order) == sorted(q.haystack_session_ids)
    counter = ApproxCounter()
    sizes = [counter.count(render_session(ds.sessions[s].turns)) + 8 for s in q.haystack_session_ids]
    budget = counter.count(q.question) + sizes[q.haystack_session_ids.index(order[0])] + sorted(sizes)[0] + 3
    cfg = ChatConfig(output="x", input=data, rankings=ranked, context_tokens=budget)
    msgs, shown, used = build_messages(cfg, ds, q, order, counter, "H:{history}\nQ:{current}\nD:{date}")
    assert order[0] in shown and used <= budget - counter.count(q.question)
    assert shown == [s for s in q.haystack_session_ids if s in set(shown)]  # chronological
    text = msgs[0]["content"]
    assert text.startswith("H:<session0>") and f"Q:{q.question}" in text and f"D:{q.question_date}" in text


@pytest.mark.parametrize("context_tokens", [700, 1200, 2500])
@pytest.mark.parametrize("tokenizer", ["approx", "tiny"])
def test_context_tokens_bound_the_whole_prompt_as_rank_counts_it(chat_data, tiny_model_dir, tokenizer,
                                                                context_tokens):
    """chat's window is the rank stage's (memsifter.retrieval.window): ``context_tokens`` bounds the whole prompt
    (template, question, date, headers, sessions) as the chat template counts it, not only the memory;
    a baseline's order is what it shows (none: nothing, oracle: only the gold sessions)."""
    import math

    from memsifter.retrieval.context import TokenCounter, load_tokenizer
    from memsifter.retrieval.prompting import default_prompt

    data, ranked, ds = chat_data
    counter = ApproxCounter() if tokenizer == "approx" else TokenCounter(load_tokenizer(tiny_model_dir))

    def whole(msgs):  # what the model is sent, counted as the budget says
        if tokenizer == "approx":
            return math.ceil(sum(len(m["content"]) for m in msgs) / 4)
        return counter.chat_prompt_tokens(msgs)

    cfg = ChatConfig(output="x", input=data, rankings=ranked, context_tokens=context_tokens)
    template = default_prompt("chat.txt")
    shown_any = 0
    for q in ds.questions:
        order = context_order(q, [], list(reversed(q.haystack_session_ids)))
        msgs, shown, _ = build_messages(cfg, ds, q, order, counter, template)
        assert whole(msgs) <= context_tokens or not shown, (q.question_id, whole(msgs))
        shown_any += len(shown)
        assert build_messages(cfg, ds, q, [], counter, template)[1] == []
        gold = [s for s in q.haystack_session_ids if s in set(q.gold_session_ids)]
        assert set(build_messages(cfg, ds, q, gold, counter, template)[1]) <= set(gold)
    assert shown_any > 0


def test_chat_real_vllm_server(chat_data, vllm_endpoint, tiny_model_dir, tmp_path):
    data, ranked, ds = chat_data
    out = str(tmp_path / "chat")
    cfg = {"output": out, "input": data, "rankings": ranked, "tokenizer": tiny_model_dir,
           "endpoint": {"base_url": vllm_endpoint, "model": "tiny", "max_tokens": 24, "concurrency": 4},
           "judge": {"base_url": vllm_endpoint, "model": "tiny", "max_tokens": 4, "temperature": 0},
           "context_tokens": 1500, "shard_size": 2}
    m = get_stage("chat").run(cfg)
    st = m["stats"]
    assert st["answered"] == len(ds.questions) and st["failed"] == 0
    assert st["client"]["requests"] == len(ds.questions)
    rows = storage.read_parquet(os.path.join(out, "answers.parquet")).to_pylist()
    assert [r["question_id"] for r in rows] == [q.question_id for q in ds.questions]
    for r, q in zip(rows, ds.questions):
        assert r["status"] == "ok" and r["raw_response"] is not None
        assert r["answer"] == extract_answer(r["raw_response"])
        assert 0 <= r["f1"] <= 1 and r["exact_match"] in (0.0, 1.0) and r["judge"] in (0.0, 1.0)
        assert r["gold_answer"] == q.answer
        assert q.gold_session_ids[0] in r["context_session_ids"]  # ranked first, so always included
        assert 0 < r["context_tokens"] <= 1500
    assert set(st["by_type"]) == {q.question_type for q in ds.questions}
    # Cached: a forced re-run without the saved partial answers sends no request.
    for rel in storage.list_files(os.path.join(out, "_work")):
        if rel.startswith("chat-"):
            os.remove(os.path.join(out, "_work", rel))
    m2 = get_stage("chat").run(cfg, force=True)
    for c in ("client", "judge_client"):
        assert m2["stats"][c]["requests"] == 0 and m2["stats"][c]["cached"] == len(ds.questions)
    rows2 = storage.read_parquet(os.path.join(out, "answers.parquet")).to_pylist()
    assert rows2 == rows


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 that answers 429, then 500, to the first attempts of most chat
    requests before forwarding them to the real server; counts what it forwarded."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.attempts: Counter = Counter()
        self.forwarded: Counter = Counter()
        self.faults = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                key = hashlib.sha256(body).hexdigest()
                with proxy.lock:
                    n = proxy.attempts[key]
                    proxy.attempts[key] += 1
                fault = int(key, 16) % 4 != 0 and n < 2   # ~3/4 of the requests fail twice first
                if fault:
                    with proxy.lock:
                        proxy.faults += 1
                    code = 429 if n == 0 else 500
                    self._send(code, json.dumps({"error": {"message": f"injected {code}"}}).encode())
                    return
                req = urllib.request.Request(proxy.upstream + self.path.replace("/v1", "", 1), data=body,
                                             headers={"Content-Type": "application/json"}, method="POST")
                with urllib.request.urlopen(req, timeout=120) as r:
                    data = r.read()
                    code = r.status
                with proxy.lock:
                    proxy.forwarded[key] += 1
                self._send(code, data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_chat_survives_429_and_500(chat_data, vllm_endpoint, tmp_path):
    data, ranked, ds = chat_data
    proxy = FaultyProxy(vllm_endpoint)
    try:
        out = str(tmp_path / "chat")
        m = get_stage("chat").run({
            "output": out, "input": data, "rankings": ranked,
            "endpoint": {"base_url": proxy.url, "model": "tiny", "max_tokens": 16, "concurrency": 3,
                         "max_retries": 4},
            "context_tokens": 1200, "retry_backoff_s": 0.05, "shard_size": 2})
    finally:
        proxy.close()
    st = m["stats"]
    assert proxy.faults >= 2 and st["client"]["retries"] == proxy.faults
    assert st["answered"] == len(ds.questions) and st["failed"] == 0
    rows = storage.read_parquet(os.path.join(out, "answers.parquet")).to_pylist()
    assert sorted(r["question_id"] for r in rows) == sorted(q.question_id for q in ds.questions)
    assert all(r["status"] == "ok" for r in rows)
    # every distinct request reached the model exactly once
    assert len(proxy.forwarded) == len(ds.questions) and set(proxy.forwarded.values()) == {1}


def test_chat_refuses_to_publish_when_requests_fail(chat_data, tmp_path):
    data, ranked, ds = chat_data
    out = str(tmp_path / "chat")
    from memsifter.errors import MemsifterError
    from memsifter.testing.servers import free_port

    with pytest.raises(MemsifterError, match="failed"):
        get_stage("chat").run({"output": out, "input": data, "rankings": ranked, "retry_backoff_s": 0.01,
                               "endpoint": {"base_url": f"http://127.0.0.1:{free_port()}/v1", "model": "m",
                                            "max_retries": 1, "timeout_s": 5}})
    assert not storage.exists(os.path.join(out, "_SUCCESS"))


def test_chat_answers_with_every_context_side_by_side(chat_data, vllm_endpoint, tiny_model_dir, tmp_path):
    """One chat stage answers the same questions with the ranker's context, a compared rankings file
    and both baselines (no memory: empty history; oracle: the gold sessions only); rows and stats per
    method; the ranking status of each context is carried to evaluate."""
    data, ranked, ds = chat_data
    rev = str(tmp_path / "reverse.parquet")  # a second method: newest first, every row a fallback
    storage.write_bytes(rev, storage.parquet_bytes(rankings.rankings_table([{
        "question_id": q.question_id, "ranked_session_ids": list(reversed(q.haystack_session_ids)), "scores": None,
        "method": "embed:reverse", "status": "fallback", "reason": "x", "raw_response": None} for q in ds.questions])))
    out = str(tmp_path / "chat")
    cfg = {"output": out, "input": data, "rankings": ranked, "compare": [rev], "baselines": ["none", "oracle", "random"],
           "tokenizer": tiny_model_dir, "limit": 3,
           "endpoint": {"base_url": vllm_endpoint, "model": "tiny", "max_tokens": 8, "concurrency": 4},
           "context_tokens": 1500}
    m = get_stage("chat").run(cfg)
    st = m["stats"]
    assert list(st["methods"]) == ["rank:fake", "embed:reverse", "no memory", "oracle (gold sessions)",
                                   "random sessions"]
    assert st["methods"]["embed:reverse"]["ranking_status"] == {"fallback": len(ds.questions)}
    assert st["client"]["requests"] == 5 * 3 and st["questions"] == 3
    rows = storage.read_parquet(os.path.join(out, "answers.parquet")).to_pylist()
    assert len(rows) == 15 and all(r["status"] == "ok" for r in rows)
    by = {(r["method"], r["question_id"]): r for r in rows}
    for q in ds.questions[:3]:
        assert by[("no memory", q.question_id)]["context_session_ids"] == []
        assert by[("oracle (gold sessions)", q.question_id)]["context_session_ids"] == \
            [s for s in q.haystack_session_ids if s in q.gold_session_ids]
        assert by[("rank:fake", q.question_id)]["ranking_status"] == "ok"
        assert by[("embed:reverse", q.question_id)]["ranking_status"] == "fallback"
        # random sessions: the window of the seeded shuffle of the haystack, shown chronologically
        shown = by[("random sessions", q.question_id)]["context_session_ids"]
        _, want, _ = build_messages(ChatConfig(**cfg), ds, q, random_order(q, 0), TokenCounter(load_tokenizer(
            tiny_model_dir)), load_prompt(None, "chat.txt", ("history", "current")))
        assert shown and shown == want and set(shown) <= set(q.haystack_session_ids)
    # evaluate reads the per-method answers and marks the all-fallback context
    ev = get_stage("evaluate").run({"output": str(tmp_path / "eval"), "input": data, "rankings": [ranked],
                                    "answers": [out]})
    a = ev["stats"]["answers"]
    assert a["embed:reverse"]["fallback"] == f"all fallback ({len(ds.questions)}/{len(ds.questions)})"
    assert a["rank:fake"]["fallback"] is None and a["no memory"]["retrieval"] is None
    assert a["random sessions"]["kind"] == "random" and a["constant answer"]["kind"] == "constant"
    assert set(ev["stats"]["references"]["labels"]) == {"no memory", "oracle (gold sessions)", "random sessions",
                                                        "constant answer"}
    assert a["rank:fake"]["vs_reference"]["f1"]["n"] == 3


def test_retry_after_is_honoured_and_failures_name_the_endpoint(vllm_endpoint):
    """A 429 with `Retry-After: 2` in front of the real server: the client waits 2 s (its own backoff
    is 10 ms), then gets the answer; a dead endpoint's error names the URL and the model."""
    import time as _time

    from memsifter.models.llm import ChatClient, LLMEndpoint

    upstream = vllm_endpoint.rstrip("/")
    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls.append(_time.time())
            if len(calls) == 1:
                data = json.dumps({"error": {"message": "slow down"}}).encode()
                self.send_response(429)
                self.send_header("Retry-After", "2")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            req = urllib.request.Request(upstream + self.path.replace("/v1", "", 1), data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=120) as r:
                data = r.read()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = ChatClient(LLMEndpoint(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="tiny",
                                        max_tokens=4), backoff_s=0.01)
        [c] = client.complete_many([[{"role": "user", "content": "hi"}]])
        assert c.ok and len(calls) == 2 and calls[1] - calls[0] >= 1.9
        assert client.stats["retry_after"] == 1
    finally:
        srv.shutdown()
        srv.server_close()
    dead = ChatClient(LLMEndpoint(base_url="http://127.0.0.1:9/v1", model="some-model", max_retries=0))
    [c] = dead.complete_many([[{"role": "user", "content": "hi"}]])
    assert not c.ok and "http://127.0.0.1:9/v1" in c.error and "some-model" in c.error


def test_chat_cli_shows_progress_not_one_line_per_request(chat_data, vllm_endpoint, tmp_path):
    """`memsifter run chat` at the default verbosity: a progress bar (requests/s), no `HTTP Request`
    line per request (openai >= 3 logs them under `httpx2`)."""
    import subprocess
    import sys

    data, ranked, ds = chat_data
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "chat", "--input", data, "--rankings", ranked,
                        "--output", str(tmp_path / "chat"), "--set", f"endpoint.base_url={vllm_endpoint}",
                        "--set", "endpoint.model=tiny", "--set", "endpoint.max_tokens=4"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "HTTP Request" not in p.stderr and "chat tiny" in p.stderr and "req/s" in p.stderr, p.stderr[-2000:]
