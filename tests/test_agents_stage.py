"""The ``agents`` stage (issue 33): the memory agents answering a dataset's questions over real HTTP.

The working LLM here is :class:`ScriptedLLM`, a real OpenAI-compatible HTTP server on loopback that
answers each agent request with a well-formed, scripted reply (it reads which protocol a request speaks
from its prompt, cuts its reply at the request's stop strings as OpenAI servers do, and reports usage).
It stands in for an LLM because the point of these tests is the stage's plumbing: requests with the
agent's messages, stop strings and max_tokens, concurrent episodes, the search over the real memory
service, cost columns, resume, refusals, and evaluate's side-by-side report. The agents with a real
model (vLLM on the CPU serving SmolLM2) are tested in tests/test_agents.py.

The search agent searches the real memory service (``memsifter serve``'s app under uvicorn on loopback,
over the LoCoMo sample imported and embedded by the real stages), through real HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from memsifter import samples
from memsifter.agents.base import approx_tokens
from memsifter.data.model import read_dataset
from memsifter.errors import MemsifterError
from memsifter.retrieval.metrics import exact_match, token_f1
from memsifter.stage import get_stage
from memsifter.store import storage

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = 3
SECRET = "sk-" + "agents-test-0123456789abcdef"  # built at run time: no key-shaped literal in the repository
CHAT_COLUMNS = ["question_id", "method", "dataset", "question_type", "question", "gold_answer", "answer",
                "raw_response", "status", "reason", "ranking_status", "exact_match", "f1", "judge",
                "context_session_ids", "context_tokens"]
COST_COLUMNS = ["llm_calls", "searches", "chunks", "recalls", "prompt_tokens", "completion_tokens", "seconds",
                "format_ok"]


# --------------------------------------------------------------------------- the scripted LLM
class ScriptedLLM:
    """An OpenAI-compatible ``/v1/chat/completions`` on 127.0.0.1 whose replies follow the agents'
    protocols: the search agent searches once with the question and then answers; the memory agents
    write notes per part (with recall: a recall query on part 2) and answer from them; anything else
    (the chat stage's prompt) gets an answer. It answers a question's gold answer when the question is in
    ``knows``, else "not sure". Usage: a token is a whitespace-separated word (+3 per message).

    Records every request (its messages, stop, max_tokens, the key it came with) and the most requests
    it had in flight at once; ``fail`` (a set of question texts) answers those with HTTP 400;
    ``usage=False`` leaves usage out of the responses."""

    def __init__(self, knows: dict[str, str], delay: float = 0.03):
        self.knows, self.delay = knows, delay
        self.requests: list[dict] = []
        self.fail: set[str] = set()
        self.usage = True
        self.answers_cut = False   # answers end at max_tokens, inside <answer> (finish_reason "length")
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # noqa: ANN002
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                status, out = outer.answer(body, self.headers.get("Authorization"))
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def question_of(text: str) -> str:
        m = re.search(r"Question(?: \(asked on [^)]*\))?: (.*)", text)
        return m.group(1).strip() if m else ""

    def reply(self, messages: list[dict]) -> str:
        first, last = messages[0]["content"], messages[-1]["content"]
        q = self.question_of(first) or self.question_of(last)
        answer = f"<answer>{self.knows.get(q, 'not sure')}</answer>"
        if "<search> and </search>" in first:   # the search agent
            if len(messages) == 1:
                return f"<think>I should look this up.</think>\n<search>{q}</search>\nand more text"
            return f"<think>The conversations say it.</think>\n{answer}"
        part = re.search(r"Part (\d+) of (\d+)", last)
        if part and "<memory> and </memory>" in last:
            return f"<memory>- notes after part {part.group(1)}</memory> trailing"
        if part and "<update> and </update>" in last:
            recall = "<recall>notes after part 1</recall>" if part.group(1) == "2" else ""
            return f"<update>- notes after part {part.group(1)}</update>{recall} trailing"
        return answer

    def answer(self, body: dict, auth: str | None) -> tuple[int, dict]:
        with self.lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(self.delay)
            messages = body["messages"]
            q = self.question_of(messages[0]["content"]) or self.question_of(messages[-1]["content"])
            text = self.reply(messages)
            stops = body.get("stop") or []
            cut = [text.index(s) for s in stops if s in text]
            if cut:
                text = text[:min(cut)]
            words = text.split()
            finish = "stop"
            if self.answers_cut and text.startswith("<answer>"):
                finish = "length"
            if len(words) > body["max_tokens"]:
                text, finish = " ".join(words[:body["max_tokens"]]), "length"
            prompt = sum(len(m["content"].split()) + 3 for m in messages)
            completion = len(text.split())
            with self.lock:
                self.requests.append({"question": q, "messages": messages, "stop": stops,
                                      "max_tokens": body["max_tokens"], "auth": auth, "prompt_tokens": prompt,
                                      "temperature": body.get("temperature")})
            if q in self.fail:
                return 400, {"error": {"message": "scripted failure", "type": "invalid_request_error"}}
            out = {"id": "x", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                "finish_reason": finish}]}
            if self.usage:
                out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                "total_tokens": prompt + completion}
            return 200, out
        finally:
            with self.lock:
                self.inflight -= 1


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def locomo(tmp_path_factory):
    """The LoCoMo sample's first questions, imported by the real stage (one conversation: 19 sessions)."""
    root = tmp_path_factory.mktemp("agents-data")
    data = str(root / "data")
    get_stage("import").run({"output": data, "format": "locomo", "source": samples.path(samples.LOCOMO),
                             "limit": QUESTIONS})
    return {"root": root, "data": data, "ds": read_dataset(data)}


@pytest.fixture(scope="module")
def service(locomo):
    """The memory service over the sample, embedded by the real embed stage; real HTTP on loopback."""
    import ray

    from memsifter.models.raypool import ensure_ray
    from memsifter.service.config import ServeConfig
    from memsifter.service.local import free_port, local_server

    started = not ray.is_initialized()
    ensure_ray()
    index = str(locomo["root"] / "embed")
    try:
        get_stage("embed").run({"output": index, "input": locomo["data"], "model": "all-MiniLM-L6-v2"})
    finally:
        if started:
            ray.shutdown()
    cfg = ServeConfig.model_validate({"index": index, "dataset": locomo["data"], "port": free_port(),
                                      "precompute_units": False, "reload_poll_s": 0,
                                      "auth": {"anonymous": {"read": ["*"], "write": ["*"]}}})
    with local_server(cfg) as (url, _svc):
        yield {"url": url, "index": index}


@pytest.fixture
def llm(locomo):
    qs = locomo["ds"].questions
    server = ScriptedLLM({q.question: q.answer for q in qs[:2]})   # knows the first two questions
    yield server
    server.close()


def agents_config(locomo, llm, out, **kw) -> dict:
    cfg = {"output": str(out), "input": locomo["data"],
           "endpoint": {"base_url": llm.url, "model": "scripted", "api_key_env": "AGENTS_TEST_KEY",
                        "concurrency": 4, "max_retries": 0},
           "shard_size": 2}
    cfg.update(kw)
    return cfg


def read_rows(out) -> list[dict]:
    return storage.read_parquet(os.path.join(str(out), "answers.parquet")).to_pylist()


def everything_written(root) -> str:
    text = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                text.append(fh.read().decode("utf-8", "replace"))
    return "\n".join(text)


# --------------------------------------------------------------------------- tests
def test_memory_agents_end_to_end_resume_and_cost(locomo, llm, tmp_path, monkeypatch, caplog):
    """Both memory agents over every session of each question: one request per part with the agent's
    stop strings and max_tokens, the episodes concurrent (at most endpoint.concurrency), the answers
    scored, the cost per question measured (calls, chunks, recalls, tokens as the server counts them),
    traces written, the key sent and never written. A failed episode fails the stage (one line, nothing
    published); the re-run runs only that question's episodes."""
    monkeypatch.setenv("AGENTS_TEST_KEY", SECRET)
    ds = locomo["ds"]
    hard = ds.questions[2].question
    llm.fail = {hard}
    out = tmp_path / "agents"
    cfg = agents_config(locomo, llm, out, methods=["agent:memory", "agent:memory+recall"])
    from memsifter.errors import MemsifterError

    with pytest.raises(MemsifterError) as e:
        get_stage("agents").run(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "2 of 6 episodes failed" in msg and "nothing published" in msg
    assert SECRET not in msg and not (out / "_SUCCESS").exists()
    first = len(llm.requests)
    llm.fail = set()
    m = get_stage("agents").run(cfg)
    again = llm.requests[first:]
    assert {r["question"] for r in again} == {hard}, "the re-run asked only the failed question"
    assert m["stats"]["resumed"] == 4 and m["stats"]["failed"] == 0

    rows = read_rows(out)
    assert list(rows[0])[:len(CHAT_COLUMNS)] == CHAT_COLUMNS and list(rows[0])[len(CHAT_COLUMNS):] == COST_COLUMNS
    assert [(r["method"], r["question_id"]) for r in rows] == [
        (meth, q.question_id) for meth in ("agent:memory", "agent:memory+recall") for q in ds.questions]
    for r in rows:
        q = ds.question(r["question_id"])
        n = len(q.haystack_session_ids)
        assert r["status"] == "ok" and r["format_ok"] is True
        assert r["answer"] == (q.answer if q.question != hard else "not sure")
        assert r["exact_match"] == exact_match(r["answer"], q.answer) and r["f1"] == token_f1(r["answer"], q.answer)
        assert r["chunks"] == n and r["llm_calls"] == n + 1 and r["searches"] == 0
        assert r["recalls"] == (1 if r["method"] == "agent:memory+recall" else 0)
        assert r["context_session_ids"] == q.haystack_session_ids
        assert r["seconds"] > 0 and r["completion_tokens"] > 0
        assert r["raw_response"].startswith("<answer>")
    # tokens read = what the server counted for that episode's requests: its parts, then the answer (the
    # two memory agents end with the same notes, so their answer prompts are the same)
    for q in ds.questions:
        reqs = llm.requests[first:] if q.question == hard else llm.requests[:first]
        reqs = [x for x in reqs if x["question"] == q.question]
        answers = {x["prompt_tokens"] for x in reqs if "Answer from the notes alone" in x["messages"][0]["content"]}
        assert len(answers) == 1
        answer_tokens = answers.pop()
        for meth, marker in (("agent:memory", "<memory> and </memory>"),
                             ("agent:memory+recall", "<update> and </update>")):
            parts = [x["prompt_tokens"] for x in reqs if marker in x["messages"][0]["content"]]
            row = next(r for r in rows if r["method"] == meth and r["question_id"] == q.question_id)
            assert len(parts) == len(q.haystack_session_ids)
            assert row["prompt_tokens"] == sum(parts) + answer_tokens
    # what each request carried: the agent's stop strings and max_tokens, temperature 0, the key
    chunk = [x for x in llm.requests if "Part " in x["messages"][-1]["content"]]
    assert {tuple(x["stop"]) for x in chunk} == {("</memory>",), ("</recall>",)}
    assert {x["max_tokens"] for x in chunk} == {768 + 64}
    assert {x["temperature"] for x in llm.requests} == {0.0}
    assert {x["auth"] for x in llm.requests} == {f"Bearer {SECRET}"}
    assert 2 <= llm.max_inflight <= 4
    # traces: one line per episode, a step per call
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == len(rows)
    for t in traces:
        row = next(r for r in rows if r["method"] == t["method"] and r["question_id"] == t["question_id"])
        assert len(t["steps"]) == len(t["calls"]) == row["llm_calls"]
        assert sum(c["prompt_tokens"] for c in t["calls"]) == row["prompt_tokens"]
        assert [c["kind"] for c in t["calls"]] == ["chunk"] * row["chunks"] + ["answer"]
    assert SECRET not in everything_written(out) and SECRET not in caplog.text
    # published: the same config is skipped; forced, the saved episodes are not asked again
    before = len(llm.requests)
    assert get_stage("agents").run(cfg).get("skipped")
    get_stage("agents").run(cfg, force=True)
    assert len(llm.requests) == before and read_rows(out) == rows


def test_prompt_tokens_counted_when_the_server_sends_no_usage(locomo, llm, tmp_path):
    """A server without usage: tokens read are the prompts as the agents count them (their estimate)."""
    llm.usage = False
    out = tmp_path / "agents"
    get_stage("agents").run(agents_config(locomo, llm, out, methods=["agent:memory"], max_questions=1))
    (row,) = read_rows(out)
    want = sum(sum(approx_tokens(m["content"]) for m in x["messages"]) for x in llm.requests)
    assert row["prompt_tokens"] == want and row["llm_calls"] == len(llm.requests)


def test_search_agent_over_the_real_memory_service_and_evaluate_side_by_side(locomo, service, llm, tmp_path):
    """agent:search searches each question's haystack in the memory service (real HTTP); the chat stage
    answers the same questions with no memory, the first stage and the oracle; evaluate reports every
    method on the same questions, with the cost per question, in report.json, report.md and a plot."""
    ds = locomo["ds"]
    out = tmp_path / "agents"
    m = get_stage("agents").run(agents_config(locomo, llm, out, search_url=service["url"],
                                              embeddings=service["index"]))
    assert m["stats"]["failed"] == 0 and set(m["stats"]["methods"]) == {"agent:search", "agent:memory",
                                                                       "agent:memory+recall"}
    rows = read_rows(out)
    search = [r for r in rows if r["method"] == "agent:search"]
    assert len(search) == len(ds.questions)
    for r in search:
        q = ds.question(r["question_id"])
        assert r["searches"] == 1 and r["llm_calls"] == 2 and r["format_ok"] is True
        assert r["answer"] == (q.answer if q.question in llm.knows else "not sure")
        hits = r["context_session_ids"]
        assert 1 <= len(hits) <= 3 and set(hits) <= set(q.haystack_session_ids)
    sreqs = [x for x in llm.requests if "<search> and </search>" in x["messages"][0]["content"]]
    first = [x for x in sreqs if len(x["messages"]) == 1]
    later = [x for x in sreqs if len(x["messages"]) == 3]
    assert len(first) == len(later) == len(ds.questions)
    assert {tuple(x["stop"]) for x in first} == {("</search>", "</answer>")} and {x["max_tokens"] for x in first} == {256}
    for x in later:   # the observation: the sessions the service returned, as the agent shows them
        assert x["messages"][1]["content"].endswith("</search>")
        obs = x["messages"][2]["content"]
        assert obs.startswith("<information>") and "conversation of" in obs

    chat = tmp_path / "chat"
    get_stage("chat").run({"output": str(chat), "input": locomo["data"], "rankings": service["index"],
                           "baselines": ["none", "oracle"], "context_tokens": 3000,
                           "endpoint": {"base_url": llm.url, "model": "scripted", "api_key_env": None,
                                        "max_tokens": 32}})
    ev = tmp_path / "eval"
    em = get_stage("evaluate").run({"output": str(ev), "input": locomo["data"], "rankings": [service["index"]],
                                    "answers": [str(chat), str(out)]})
    assert "answer_f1_and_cost.png" in em["files"]
    assert (ev / "answer_f1_and_cost.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((ev / "report.json").read_text())
    side = report["side_by_side"]
    chat_methods = [r["method"] for r in read_rows(chat)]
    labels = list(dict.fromkeys(chat_methods)) + ["agent:search", "agent:memory", "agent:memory+recall"]
    assert set(side["methods"]) == set(labels) and side["questions"] == len(ds.questions) and side["same"]
    for label, s in side["methods"].items():
        assert s["n"] == len(ds.questions)
        agent = label.startswith("agent:")
        rs = [r for r in (rows if agent else read_rows(chat)) if r["method"] == label]
        assert s["f1"] == pytest.approx(sum(r["f1"] for r in rs) / len(rs), abs=1e-4)
        cost = s["cost"]
        assert cost["llm_calls"]["mean"] == pytest.approx(sum(r["llm_calls"] for r in rs) / len(rs) if agent else 1.0)
        assert cost["llm_calls"]["n"] == len(rs)
        assert cost["prompt_tokens"]["mean"] == pytest.approx(sum(r["prompt_tokens"] for r in rs) / len(rs), abs=0.01)
        if agent:
            assert cost["seconds"]["mean"] > 0
        else:   # chat answers in batches: no time per question
            assert cost["seconds"] is None
    md = (ev / "report.md").read_text()
    table = md[md.index("## Side by side"):]
    at = [table.index(f"| {label} | {len(ds.questions)} |") for label in labels]
    assert at == sorted(at), "the table lists chat's methods, then the agents, in the order given"
    assert "LLM calls" in table and "tokens read" in table and "seconds" in table


def test_bad_configs_are_one_line_exit_2(locomo, tmp_path):
    """The stage's refusals from the command line: one line naming the field, exit 2, nothing started."""
    base = {"output": str(tmp_path / "out"), "input": locomo["data"],
            "endpoint": {"base_url": "http://127.0.0.1:9/v1", "api_key_env": None}}
    cases = [
        ({}, "search_url"),                                                          # agent:search needs it
        ({"search_url": "ftp://x"}, "search_url"),
        ({"methods": ["agent:memory"], "agent_options": {"agent:memroy": {}}}, "agent_options"),
        ({"methods": ["agent:memory"], "agent_options": {"agent:memory": {"chunk_tokens": 9000}}}, "agent_options"),
        ({"methods": ["agent:memory"], "agent_options": {"agent:memory": {"turns": 3}}}, "agent_options"),
        ({"methods": ["agent:search"], "search_url": "http://127.0.0.1:9",
          "search_api_key_env": "AGENTS_TEST_UNSET_VAR"}, "AGENTS_TEST_UNSET_VAR"),
        ({"methods": ["agent:nope"]}, "methods"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "AGENTS_TEST_UNSET_VAR"}
    for extra, word in cases:
        f = tmp_path / "cfg.yaml"
        f.write_text(yaml.safe_dump({**base, **extra}))
        p = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "agents", "--config", str(f)],
                           capture_output=True, text=True, env=env, timeout=120)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2, (extra, p.stderr)
        assert word in p.stderr, (extra, p.stderr)
        if "invalid config for stage 'agents'" in lines[0]:   # a validation error: the header, then the field
            assert len(lines) == 2 and lines[1].strip().startswith(word.split(":")[0]), (extra, p.stderr)
        else:
            assert len(lines) == 1, (extra, p.stderr)
        assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- issue 41 probes
class TricklingServer:
    """A memory service that answers over real HTTP on 127.0.0.1, one byte every ``every`` seconds: each
    read gets a byte long before any read timeout, so only an overall budget ends the wait."""

    def __init__(self, every: float = 1.0):
        self.every, self.conns, self.stop = every, [], threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        reply = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{"result": [[]]}' + b" " * 24
        try:
            conn.recv(65536)
            for b in reply:
                if self.stop.wait(self.every):
                    return
                conn.sendall(bytes([b]))
        except OSError:
            return

    def close(self) -> None:
        self.stop.set()
        for c in [self.sock, *self.conns]:
            with contextlib.suppress(OSError):
                c.close()


@pytest.fixture
def trickling():
    server = TricklingServer()
    yield server
    server.close()


@pytest.mark.parametrize("budget,says", [({"episode_timeout_s": 2}, "its time budget (episode_timeout_s = 2 s)"),
                                         ({"stage_timeout_s": 3}, "the stage's time budget (stage_timeout_s = 3 s)")],
                         ids=["episode", "stage"])
def test_trickling_memory_service_ends_within_the_time_budget(locomo, llm, trickling, tmp_path, budget, says):
    """issue 41: the agents stage against a memory service that trickles a byte every 5 s was still running
    at 591 s. Each episode, and the stage, has a time budget: past it the episode fails (here: every one,
    so nothing is published), and the stage ends in about the budget."""
    out = tmp_path / "out"
    cfg = agents_config(locomo, llm, out, methods=["agent:search"], search_url=trickling.url,
                        search_api_key_env=None, **budget)
    cfg["endpoint"]["concurrency"] = 1
    t0 = time.time()
    with pytest.raises(MemsifterError) as e:
        get_stage("agents").run(cfg)
    took = time.time() - t0
    assert took < 40, took   # three 2 s episodes and the stage's start-up; the trickle alone would take ~110 s each
    msg = str(e.value)
    assert f"{QUESTIONS} of {QUESTIONS} episodes failed" in msg and says in msg, msg
    assert "waiting for the memory service" in msg and not (out / "_SUCCESS").exists()


def test_never_closed_answer_is_malformed(locomo, llm, tmp_path, monkeypatch):
    """issue 41: a reply cut at max_tokens inside <answer> (finish_reason "length") was closed on the
    model's behalf and counted as a well-formed answer. Over real HTTP: the scripted LLM's answers, ended
    by "length" before their </answer>, are no answer and not format_ok."""
    monkeypatch.setenv("AGENTS_TEST_KEY", SECRET)
    out = tmp_path / "out"
    llm.answers_cut = True
    get_stage("agents").run(agents_config(locomo, llm, out, methods=["agent:memory"]))
    rows = read_rows(out)
    assert len(rows) == QUESTIONS
    assert all(r["format_ok"] is False and r["answer"] is None for r in rows), rows
    assert all(r["raw_response"].startswith("<answer>") and "</answer>" not in r["raw_response"] for r in rows)


def test_chart_wires_the_memory_service_url_into_the_agents_stage():
    """On Kubernetes agent:search reaches the chart's RayService: with serve.enabled the agents stage's
    ConfigMap gets search_url = KubeRay's Service of that RayService (<name>-serve-svc, port 8000) unless
    its config sets one; otherwise its config is exactly what `memsifter pipeline` wires. Without serve
    nothing is filled in (the stage then refuses agent:search, naming search_url)."""
    from memsifter import pipeline
    from memsifter_dev.k8s import chart

    from memsifter.k8s.plan import chart_plan

    def values(serve: bool, agents_cfg: dict | None = None) -> dict:
        spec = {"run": "s3://bkt/runs/r1", "stages": {
            "import": {"format": "locomo", "source": "s3://bkt/raw/locomo.json"}, "embed": {},
            "agents": dict(agents_cfg or {})}}
        return {"run": {"id": "r1"}, "s3": {"bucket": "bkt"}, "pipeline": chart_plan(spec), "serve": {"enabled": serve}}

    def rendered(v: dict) -> tuple[dict, list[dict]]:
        docs = chart.render_docs([], values=v, namespace="mem")
        # a stage's ConfigMap holds its config document as `<stage>.yaml` beside the run's S3 settings
        cms = {st: yaml.safe_load(d["data"][f"{st}.yaml"]) for d in docs
               if d.get("kind") == "ConfigMap" and (st := d["metadata"]["labels"].get("memsifter.io/stage"))}
        return cms, docs

    local = dict(pipeline.wire({"run": "s3://bkt/runs/r1", "stages": {
        "import": {"format": "locomo", "source": "s3://bkt/raw/locomo.json"}, "embed": {}, "agents": {}}}))["agents"]
    cms, docs = rendered(values(True))
    (svc,) = [d for d in docs if d.get("kind") == "RayService"]
    url = f"http://{svc['metadata']['name']}-serve-svc.mem.svc:8000"
    assert cms["agents"] == {**local, "search_url": url}
    assert "search_url" not in cms["embed"] and "search_url" not in cms["import"]
    cms, _ = rendered(values(True, {"search_url": "http://elsewhere:8000"}))
    assert cms["agents"]["search_url"] == "http://elsewhere:8000"
    cms, docs = rendered(values(False))
    assert cms["agents"] == local and not [d for d in docs if d.get("kind") == "RayService"]


def test_evaluate_compares_methods_only_on_the_questions_all_of_them_answered(tmp_path):
    """An agent that failed on a question, beside an older chat output that recorded no tokens: the side by
    side table says the question sets differ, compares every method on the common questions only, and
    shows what was not recorded as '-' (the plot names the methods it cannot place)."""
    import pyarrow as pa

    from memsifter.data.model import Dataset, Question, Session

    sessions = {f"s{i}": Session(f"s{i}", [{"role": "user", "content": f"text {i}"}], f"2024-01-0{i + 1}")
                for i in range(3)}
    qs = [Question(f"q{i}", "d", f"question {i}?", f"answer {i}", list(sessions), [f"s{i}"], question_type="t")
          for i in range(3)]
    data, chat, agents = str(tmp_path / "data"), str(tmp_path / "chat"), str(tmp_path / "agents")
    pub = storage.Publication(data, "synth", {}, "x", "test")
    Dataset(sessions, qs).write(pub)
    pub.publish({})
    base = {"dataset": "d", "question_type": "t", "judge": None}
    chat_rows = [{**base, "question_id": q.question_id, "method": "no memory", "answer": q.answer, "status": "ok",
                  "exact_match": 1.0, "f1": 1.0} for q in qs]
    agent_rows = [{**base, "question_id": q.question_id, "method": "agent:search", "answer": "x" if i < 2 else None,
                   "status": "ok" if i < 2 else "error", "exact_match": 0.0 if i < 2 else None,
                   "f1": 0.5 if i < 2 else None, "llm_calls": 3 if i < 2 else None,
                   "prompt_tokens": 1000 * (i + 1) if i < 2 else None, "seconds": 2.0 if i < 2 else None}
                  for i, q in enumerate(qs)]
    for uri, name, rows in ((chat, "chat", chat_rows), (agents, "agents", agent_rows)):
        pub = storage.Publication(uri, name, {"endpoint": {"model": "m"}}, "x", "test")
        pub.write_table("answers.parquet", pa.Table.from_pylist(rows))
        pub.publish({})
    ev = tmp_path / "eval"
    m = get_stage("evaluate").run({"output": str(ev), "input": data, "answers": [chat, agents]})
    side = json.loads((ev / "report.json").read_text())["side_by_side"]
    assert not side["same"] and side["questions"] == 2 and side["per_method"] == {"no memory": 3, "agent:search": 2}
    nm, ag = side["methods"]["no memory"], side["methods"]["agent:search"]
    assert nm["n"] == ag["n"] == 2 and nm["f1"] == 1.0 and ag["f1"] == 0.5
    assert nm["cost"]["llm_calls"] == {"mean": 1.0, "n": 2} and nm["cost"]["prompt_tokens"] is None
    assert ag["cost"] == {"llm_calls": {"mean": 3.0, "n": 2}, "prompt_tokens": {"mean": 1500.0, "n": 2},
                          "seconds": {"mean": 2.0, "n": 2}, "tokens": "server usage"}
    assert m["stats"]["side_by_side"]["methods"]["agent:search"]["prompt_tokens"] == 1500.0
    md = (ev / "report.md").read_text()
    assert "the methods answered different question sets" in md
    assert "| no memory | 2 | 1.000 [1.00, 1.00] | 1.000 [1.00, 1.00] | 1.00 (n=2) | - | - | - |" in md
    assert "| agent:search | 2 |" in md and "1,500 (n=2)" in md
    assert "answer_f1_and_cost.png" in m["files"]
