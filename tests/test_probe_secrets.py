"""Issue 30 probes: an endpoint's credentials never reach an output, a manifest, an error or a log; a
stage whose requests failed publishes nothing; chat sends nothing to an endpoint the user did not
name; tensor parallelism reaches the engine; a huge turn does not exhaust memory.

Real parts: the rank and chat stages run against a real HTTP server on 127.0.0.1 (``http.server`` in a
thread) that plays an OpenAI-compatible endpoint: it answers 401 echoing the request's Authorization
header in the error body (as hosted APIs do: "Incorrect API key provided: Bearer sk-…"), or a real
chat completion. The secrets are built at run time (no key-shaped literal is committed: the repo's
own secret scan would find it)."""

from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import read_dataset
from memsifter.errors import MemsifterError
from memsifter.stage import get_stage


class FakeLLM:
    """An OpenAI-compatible chat endpoint on 127.0.0.1. ``mode``: ``"401"`` answers every request 401
    with the Authorization header echoed in the body; ``"ok"`` answers with ``reply``; ``fail_if``
    (a substring of the request body) makes only matching requests 401."""

    def __init__(self, reply: str = "<ranking>0</ranking>"):
        self.mode, self.reply, self.fail_if = "401", reply, None
        self.requests: list[dict] = []
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                auth = self.headers.get("Authorization")
                me.requests.append({"auth": auth, "body": body})
                if me.mode == "401" or (me.fail_if and me.fail_if in body):
                    self._send(401, {"error": {"message": f"Incorrect API key provided: {auth}. You can find "
                                               "your API key at https://platform.example/account/api-keys.",
                                               "type": "invalid_request_error", "code": "invalid_api_key"}})
                    return
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": me.reply}}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def llm():
    srv = FakeLLM()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    data = str(root / "data")
    get_stage("synth").run({"output": data, "questions": 3, "sessions_per_question": 4, "seed": 3})
    ds = read_dataset(data)
    emb = str(root / "embed")
    pub = storage.Publication(emb, "embed", {}, "fake", "test")
    rankings.write_rankings(pub, [{
        "question_id": q.question_id, "ranked_session_ids": list(reversed(q.haystack_session_ids)), "scores": None,
        "method": "embed:dense", "status": "ok", "reason": None, "raw_response": None} for q in ds.questions])
    pub.publish({})
    return data, emb, ds


def make_secrets() -> dict[str, str]:
    """An API key in the OpenAI shape and a URL password, random per test (built, not written out)."""
    key = "sk" + "-" + "proj" + "-" + secrets.token_urlsafe(24).replace("-", "x").replace("_", "y") + "9Z"
    password = "pw" + secrets.token_hex(12)
    return {"key": key, "password": password,
            "basic": base64.b64encode(f"alice:{password}".encode()).decode()}


def text_of(path: Path) -> str:
    """A file's bytes as text, and for a parquet file its decoded rows too (pages may be compressed)."""
    raw = path.read_bytes()
    out = raw.decode("utf-8", errors="replace")
    if raw[:4] == b"PAR1":
        out += json.dumps(storage.read_parquet(str(path)).to_pylist(), default=str)
    return out


def assert_clean(texts: dict[str, str], sec: dict[str, str]) -> None:
    for where, text in texts.items():
        for name, value in sec.items():
            assert value not in text, f"{name} leaked into {where}: {text[:400]!r}"


def stage_config(stage: str, data, out: str, tiny_model_dir: str, tolerate: bool) -> dict:
    d, emb, _ = data
    common = {"output": out, "input": d, **({"max_failed_fraction": 1.0} if tolerate else {})}  # default: 0
    if stage == "rank":
        return {**common, "embeddings": emb, "model": tiny_model_dir, "engine": "endpoint",
                "endpoint": {"model": "m", "max_retries": 0}, "context_limit": 1500, "max_tokens": 16}
    rank_out = str(Path(out).parent / "given-rankings")
    if not storage.exists(storage.join(rank_out, "_SUCCESS")):
        pub = storage.Publication(rank_out, "rank", {}, "fake", "test")
        rankings.write_rankings(pub, [{
            "question_id": q.question_id, "ranked_session_ids": q.haystack_session_ids, "scores": None,
            "method": "rank:fake", "status": "ok", "reason": None, "raw_response": "x"} for q in data[2].questions])
        pub.publish({})
    return {**common, "rankings": rank_out, "endpoint": {"model": "m", "max_retries": 0}, "retry_backoff_s": 0.01}


@pytest.mark.parametrize("stage", ["rank", "chat"])
@pytest.mark.parametrize("userinfo", [True, False], ids=["password-in-url", "bearer-key"])
@pytest.mark.parametrize("tolerate", [False, True], ids=["fails", "publishes-errors"])
def test_no_secret_reaches_outputs_errors_or_logs(stage, userinfo, tolerate, data, tiny_model_dir, llm, tmp_path,
                                                  monkeypatch, caplog):
    """Every request is answered 401 with the credentials echoed. By default the stage fails with one
    line naming the output and the count, and publishes nothing; with ``max_failed_fraction: 1`` it
    publishes its error rows. Either way no secret is in any file under the output (parquet decoded),
    in the manifest, in the error or in any log record (DEBUG included)."""
    sec = make_secrets()
    if not userinfo:
        sec.pop("password"), sec.pop("basic")
    monkeypatch.setenv("OPENAI_API_KEY", sec["key"])
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    cred = f"alice:{sec['password']}@" if userinfo else ""
    monkeypatch.setenv("MEMSIFTER_LLM_BASE_URL", f"http://{cred}127.0.0.1:{llm.port}/v1")
    out = str(tmp_path / stage)
    caplog.set_level(logging.DEBUG)
    for name in ("httpx2", "httpcore2", "openai", "memsifter"):  # whatever an earlier CLI run set them to
        caplog.set_level(logging.DEBUG, logger=name)
    cfg = stage_config(stage, data, out, tiny_model_dir, tolerate)
    if tolerate:
        m = get_stage(stage).run(cfg)
        assert m["stats"]["questions"] == len(data[2].questions)
        table = "rankings.parquet" if stage == "rank" else "answers.parquet"
        rows = storage.read_parquet(os.path.join(out, table)).to_pylist()
        assert rows and all(r["status"] == "error" for r in rows)
        # redacted, not emptied: the reason still says what happened
        assert all("401" in r["reason"] and "AuthenticationError" in r["reason"] for r in rows), rows[0]["reason"]
        assert all("***" in r["reason"] for r in rows)
        error = ""
    else:
        with pytest.raises(MemsifterError) as e:
            get_stage(stage).run(cfg)
        error = str(e.value)
        assert "\n" not in error and out in error and "failed" in error and "401" in error, error
        assert f"{len(data[2].questions)} of {len(data[2].questions)}" in error
        assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    assert llm.requests, "the endpoint was called"
    if userinfo:  # the password still reaches the server, as the Basic header the URL stands for
        assert llm.requests[0]["auth"] == f"Basic {sec['basic']}"
    else:
        assert llm.requests[0]["auth"] == f"Bearer {sec['key']}"
    texts = {str(p): text_of(p) for p in Path(out).rglob("*") if p.is_file()}
    assert texts, "the output holds the failure record or the published files"
    texts["error"] = error
    texts["logs"] = "\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records)
    assert f"127.0.0.1:{llm.port}/v1/chat/completions" in texts["logs"]  # the client's request lines were seen
    assert_clean(texts, sec)


def test_failed_questions_are_retried_and_answers_that_arrived_are_kept(data, tiny_model_dir, llm, tmp_path,
                                                                          monkeypatch):
    """One question's request fails (401), the others get answers without a ranking (fallbacks, which
    are not errors): rank publishes nothing (a later run does not skip it as published); the next run
    asks only the failed question again and publishes, fallbacks included."""
    d, emb, ds = data
    monkeypatch.setenv("MEMSIFTER_LLM_BASE_URL", f"http://127.0.0.1:{llm.port}/v1")
    llm.mode, llm.fail_if, llm.reply = "ok", ds.questions[1].question, "I would rather not rank these."
    out = str(tmp_path / "rank")
    cfg = stage_config("rank", data, out, tiny_model_dir, tolerate=False)
    with pytest.raises(MemsifterError, match=rf"1 of {len(ds.questions)} questions failed"):
        get_stage("rank").run(cfg)
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    first = len(llm.requests)
    assert first == len(ds.questions)
    llm.fail_if = None
    m = get_stage("rank").run(cfg)
    assert not m.get("skipped") and m["stats"]["status"]["fallback"] == len(ds.questions)
    assert len(llm.requests) - first == 1 and ds.questions[1].question in llm.requests[-1]["body"]
    assert m["stats"]["resumed"] == len(ds.questions) - 1


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memsifter.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_chat_needs_a_named_endpoint_before_anything_starts(data, llm, tmp_path):
    """`memsifter run chat` with OPENAI_API_KEY set and no base URL anywhere: exit 2, one line naming
    endpoint.base_url, before any progress bar or request (the memory stays on the machine); a hosted
    URL without its key: the same, naming the variable. Nothing is published."""
    d = data[0]
    rank_out = stage_config("chat", data, str(tmp_path / "x"), "", False)["rankings"]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_BASE_URL", "MEMSIFTER_LLM_BASE_URL")}
    env["OPENAI_API_KEY"] = make_secrets()["key"]
    base = ["run", "chat", "-q", "--input", d, "--rankings", rank_out, "--set", "endpoint.max_retries=0",
            "--set", "endpoint.timeout_s=5"]
    cases = [
        (["--output", str(tmp_path / "c1")], env, "endpoint.base_url is not set"),
        (["--output", str(tmp_path / "c2"), "--set", "endpoint.base_url=https://llm.invalid/v1",
          "--set", "endpoint.api_key_env=PROBE_UNSET_KEY"], env, "PROBE_UNSET_KEY is not set"),
        (["--output", str(tmp_path / "c3"), "--set", "judge.base_url=https://llm.invalid/v1",
          "--set", "judge.api_key_env=PROBE_UNSET_KEY", "--set", f"endpoint.base_url=http://127.0.0.1:{llm.port}/v1"],
         env, "judge: LLM endpoint https://llm.invalid/v1"),
    ]
    for extra, e, want in cases:
        p = _cli(base + extra, e)
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(err) == 1 and want in err[0], p.stderr[-2000:]
        assert "Traceback" not in p.stderr and "req/s" not in p.stderr
        out = Path(extra[1])
        assert not out.exists() or not any(out.rglob("*"))   # checked before the lease: nothing written
    assert llm.requests == []


def _cases() -> list[tuple[str, str, str]]:
    """(case, text with a secret, the secret): built at run time, not committed as literals."""
    key = "sk" + "-" + "A1b2C3d4" * 4
    aws = "AKIA" + "ABCDEFGHIJ234567"
    hf = "hf" + "_" + "aBcDeFgHiJ" * 4
    return [
        ("url-password", "connect to https://bob:" + "Tr0ub4dor" + "@llm.example/v1 failed", "Tr0ub4dor"),
        ("url-token-user", "git clone https://" + "ghtoken123456" + "@git.example/x", "ghtoken123456"),
        ("bearer-echo", "Incorrect API key provided: Bearer " + key, key),
        ("basic-echo", "Authorization: Basic " + "Ym9iOlRyMHViNGRvcg==", "Ym9iOlRyMHViNGRvcg=="),
        ("bare-openai-key", "key " + key + " rejected", key),
        ("aws-key-id", "InvalidAccessKeyId: " + aws, aws),
        ("hf-token", "token=" + hf, hf),
        ("assignment", "api_key=" + "zq9Xw8Vu7T" + " password: '" + "hunter2hunter" + "'", "zq9Xw8Vu7T"),
    ]


@pytest.mark.parametrize("case,text,secret", _cases(), ids=[c[0] for c in _cases()])
def test_redact_removes_every_credential_shape(case, text, secret):
    from memsifter.security.redact import redact

    out = redact(text)
    assert secret not in out and "***" in out, out


def test_redact_keeps_ordinary_text_and_known_values(monkeypatch):
    from memsifter.security.redact import redact, redact_obj

    plain = ("AuthenticationError: Error code: 401 (model m at http://127.0.0.1:8000/v1); token limit "
             "exceeded; s3://bucket/key@v1; Basic usage")
    assert redact(plain) == plain and redact(None) is None
    monkeypatch.setenv("WORKING_LLM_API_KEY", "plain-words-key")  # a key of no known shape, by its variable
    assert redact("echo: plain-words-key") == "echo: ***"
    assert redact("x my-own-secret y", ["my-own-secret"]) == "x *** y"
    assert redact_obj({"reasons": {"echo plain-words-key": 2}}) == {"reasons": {"echo ***": 2}}


def test_tensor_parallel_size_reaches_the_engine():
    """vllm.tensor_parallel_size / pipeline_parallel_size are vLLM engine arguments of each replica
    (built without starting vLLM)."""
    from memsifter.stages.rank import RankConfig, engine_kwargs

    cfg = RankConfig(output="x", input="d", embeddings="e", model="m", context_limit=100, max_tokens=10,
                     vllm={"max_model_len": 200, "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    kw = engine_kwargs(cfg, on_gpu=True)
    assert kw["tensor_parallel_size"] == 2 and kw["pipeline_parallel_size"] == 2 and kw["max_model_len"] == 200
    # engine_kwargs still has the last word
    cfg2 = cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"engine_kwargs": {"tensor_parallel_size": 4}})})
    assert engine_kwargs(cfg2, on_gpu=False)["tensor_parallel_size"] == 4


def _peak_kib() -> int:
    import re

    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rss_kib() -> int:
    import re

    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_a_huge_turn_is_never_tokenized_whole(which, data, tiny_model_dir):
    """A 20 MB turn (the issue: 50 MB grew rank to 4.6 GB and aborted): rank's prompt builder and
    chat's context take seconds and < 500 MB more peak memory (the process's peak RSS, reset through
    /proc/self/clear_refs just before: the tokenizer allocates outside Python, where tracemalloc cannot
    see); the session is left out, the others are shown."""
    import time

    from memsifter.models import registry as models
    from memsifter.retrieval.context import TokenCounter, load_tokenizer
    from memsifter.errors import ConfigError
    from memsifter.retrieval.prompting import default_prompt
    from memsifter.stages.chat import ChatConfig, build_messages
    from memsifter.stages.rank import RankConfig, build_prompt

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as e:
        pytest.skip(f"peak RSS cannot be reset here ({e})")
    d, emb, _ = data
    tok = tiny_model_dir
    if which == "smollm2":
        try:
            tok = models.resolve("smollm2-135m-instruct")
        except ConfigError as e:
            pytest.skip(str(e))
    ds = read_dataset(d)  # a copy of its own: the turn is replaced in memory only
    q = ds.questions[0]
    big = q.haystack_session_ids[1]
    ds.sessions[big].turns[0]["content"] = "the quick brown fox jumps over the lazy dog 1234 " * 400_000  # 20 MB
    counter = TokenCounter(load_tokenizer(tok))
    cfg = RankConfig(output="x", input=d, embeddings=emb, model=tok, context_limit=3000, max_tokens=16,
                     vllm={"max_model_len": 4000})
    ccfg = ChatConfig(output="x", input=d, rankings=emb, context_tokens=3000)
    Path("/proc/self/clear_refs").write_text("5")
    before, t0 = _rss_kib(), time.time()
    p = build_prompt(cfg, ds, q, {"ranked_session_ids": list(q.haystack_session_ids)}, counter,
                     default_prompt("ranker.txt"))
    _, shown, _ = build_messages(ccfg, ds, q, list(q.haystack_session_ids), counter, "{history}{current}{date}")
    seconds, grew_mib = time.time() - t0, (_peak_kib() - before) // 1024
    assert seconds < 20 and grew_mib < 500, (seconds, grew_mib)
    assert big not in p.id_map and big not in shown and p.id_map and shown
