"""Issue 41 item 1: no credential a run knows reaches a published file, its scratch, its manifest or a log,
even from a server that echoes the caller's ``Authorization`` header in its answers; a URL's
``user:password@`` is stripped before the config is stored and sent as the request's auth; a publish
that still holds a secret is refused.

Real parts: the rank, chat and agents stages run in-process against a real HTTP server on 127.0.0.1
(``http.server`` in a thread) that plays an OpenAI-compatible endpoint answering 200 with the request's
``Authorization`` header in every reply, and the memory service's ``POST /retrieve`` (mocked here: the real
service needs Ray and an embed run, and what is probed is the client's credentials, not retrieval) echoing
its caller's header in the documents it returns. Keys are random per test and of no known token shape,
in variables not named like secrets, so only the run's knowledge of them can hide them. No key-shaped
literal is committed."""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import logging
import os
import secrets
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from memsifter.data.model import read_dataset
from memsifter.errors import MemsifterError
from memsifter.retrieval import rankings
from memsifter.stage import get_stage
from memsifter.store import storage

KEY_ENV, SEARCH_KEY_ENV = "PROBE_LLM_CRED", "PROBE_MEMORY_CRED"   # not named like secrets on purpose


class EchoServer:
    """``/v1/chat/completions`` answering 200 with the request's Authorization header in the reply (the
    search agent's first turn gets a search; other requests a ranking and an answer), and ``/retrieve``
    returning one document that quotes its Authorization header. Records each request's path and header."""

    def __init__(self):
        self.requests: list[tuple[str, str | None]] = []
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                auth = self.headers.get("Authorization")
                me.requests.append((self.path, auth))
                if self.path.endswith("/retrieve"):
                    self._send({"result": [[{"document": {"id": "s-echo", "contents":
                                                          f"session s-echo\nthe caller sent {auth}"},
                                             "score": 1.0}]]})
                    return
                msgs = body.get("messages") or [{"content": ""}]
                if "<search> and </search>" in msgs[0]["content"] and len(msgs) == 1:
                    text = "<search>what did I say</search>"
                else:
                    text = f"you sent {auth} <ranking>0</ranking> <answer>fine, {auth}</answer>"
                cut = [text.index(s) for s in body.get("stop") or [] if s in text]
                text = text[:min(cut)] if cut else text
                self._send({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": text}}],
                            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def echo():
    srv = EchoServer()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A synth dataset, the first stage's order (embed) and a given ranking (chat's input)."""
    root = tmp_path_factory.mktemp("cred")
    d = str(root / "data")
    get_stage("synth").run({"output": d, "questions": 2, "sessions_per_question": 3, "seed": 5})
    ds = read_dataset(d)
    for name, stage in (("embed", "embed"), ("given", "rank")):
        pub = storage.Publication(str(root / name), stage, {}, "fake", "test")
        rankings.write_rankings(pub, [{
            "question_id": q.question_id, "ranked_session_ids": list(q.haystack_session_ids), "scores": None,
            "method": f"{stage}:fake", "status": "ok", "reason": None, "raw_response": None} for q in ds.questions])
        pub.publish({})
    return {"data": d, "embed": str(root / "embed"), "given": str(root / "given"), "ds": ds}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def text_of(path: Path) -> str:
    """A file's bytes as text, gunzipped when gzip, and for a parquet file its decoded rows too."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    out = raw.decode("utf-8", errors="replace")
    if raw[:4] == b"PAR1":
        out += json.dumps(storage.read_parquet(str(path)).to_pylist(), default=str)
    return out


def config_for(stage: str, data: dict, out: str, base_url: str, search_url: str, tiny_model_dir: str) -> dict:
    endpoint = {"base_url": base_url, "model": "m", "max_retries": 0, "api_key_env": KEY_ENV}
    if stage == "rank":
        return {"output": out, "input": data["data"], "embeddings": data["embed"], "model": tiny_model_dir,
                "engine": "endpoint", "endpoint": endpoint, "context_limit": 1500, "max_tokens": 16}
    if stage == "chat":
        return {"output": out, "input": data["data"], "rankings": data["given"], "endpoint": endpoint,
                "retry_backoff_s": 0.01}
    return {"output": out, "input": data["data"], "methods": ["agent:search"], "endpoint": endpoint,
            "search_url": search_url, "search_api_key_env": SEARCH_KEY_ENV, "shard_size": 1}


@pytest.mark.parametrize("stage", ["rank", "chat", "agents"])
@pytest.mark.parametrize("in_url", [False, True], ids=["key", "password-in-url"])
def test_echoed_credentials_reach_no_file_manifest_or_log(stage, in_url, data, echo, tiny_model_dir, tmp_path,
                                                           monkeypatch, caplog):
    """Every answer quotes the caller's Authorization header. The stage publishes; no key, password or
    Basic (base64) form is in any file under its output (scratch and cache included, parquet decoded,
    gzip opened) or any log record; the answers keep their text with the credential masked; the
    manifest's URLs are bare; the servers did get the credentials (Bearer key, or Basic for a URL's
    user:password)."""
    key, search_key = "k" + secrets.token_hex(16), "m" + secrets.token_hex(16)
    pw, search_pw = "pw" + secrets.token_hex(10), "sp" + secrets.token_hex(10)
    monkeypatch.setenv(KEY_ENV, key)
    monkeypatch.setenv(SEARCH_KEY_ENV, search_key)
    for v in ("OPENAI_BASE_URL", "MEMSIFTER_LLM_BASE_URL"):
        monkeypatch.delenv(v, raising=False)
    host = f"127.0.0.1:{echo.port}"
    base_url, search_url = f"http://{host}/v1", f"http://{host}"
    sec = {"key": key, "search key": search_key}
    if in_url:
        base_url, search_url = f"http://alice:{pw}@{host}/v1", f"http://bob:{search_pw}@{host}"
        sec.update({"password": pw, "search password": search_pw, "basic": b64(f"alice:{pw}"),
                    "search basic": b64(f"bob:{search_pw}")})
    out = str(tmp_path / stage)
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore", "openai", "memsifter"):
        caplog.set_level(logging.DEBUG, logger=name)

    m = get_stage(stage).run(config_for(stage, data, out, base_url, search_url, tiny_model_dir))

    # the credentials went where they belong: to the servers, as the request's auth
    llm_auth = {a for p, a in echo.requests if p.endswith("/chat/completions")}
    assert llm_auth == {f"Basic {b64(f'alice:{pw}')}" if in_url else f"Bearer {key}"}, llm_auth
    if stage == "agents":
        search_auth = {a for p, a in echo.requests if p.endswith("/retrieve")}
        assert search_auth == {f"Basic {b64(f'bob:{search_pw}')}" if in_url else f"Bearer {search_key}"}, search_auth
    # ... and nowhere else
    manifest = json.loads(Path(out, "_SUCCESS").read_text())
    assert manifest["config"]["endpoint"]["base_url"] == f"http://{host}/v1"
    if stage == "agents":
        assert manifest["config"]["search_url"] == f"http://{host}"
    table = "rankings.parquet" if stage == "rank" else "answers.parquet"
    rows = storage.read_parquet(os.path.join(out, table)).to_pylist()
    assert rows and all("you sent" in r["raw_response"] and "***" in r["raw_response"] for r in rows), rows[0]
    texts = {str(p): text_of(p) for p in Path(out).rglob("*") if p.is_file()}
    assert any("_work" in p for p in texts), "the scratch (cache, partial results) is checked too"
    texts["logs"] = "\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records)
    texts["manifest returned"] = json.dumps(m, default=str)
    for where, text in texts.items():
        for name, value in sec.items():
            assert value not in text, f"{name} leaked into {where}"


def test_a_password_in_the_url_is_never_kept_in_the_config(echo, monkeypatch):
    """Stripped when the config is parsed: the model, its dump and its repr hold the bare URL; the client
    still authenticates with it."""
    from memsifter.models.llm import ChatClient, LLMEndpoint
    from memsifter.stages.agents import AgentsConfig

    pw = "pw" + secrets.token_hex(10)
    ep = LLMEndpoint(base_url=f"http://alice:{pw}@127.0.0.1:{echo.port}/v1", model="m", api_key_env=None,
                     max_retries=0)
    assert ep.base_url == f"http://127.0.0.1:{echo.port}/v1"
    assert pw not in repr(ep) and pw not in json.dumps(ep.model_dump(mode="json"))
    [c] = ChatClient(ep).complete_many([[{"role": "user", "content": "hi"}]])
    assert echo.requests[-1][1] == f"Basic {b64(f'alice:{pw}')}" and pw not in c.text and "***" in c.text
    cfg = AgentsConfig(output="o", input="i", search_url=f"http://bob:{pw}@127.0.0.1:9/")
    assert cfg.search_url == "http://127.0.0.1:9/" and pw not in json.dumps(cfg.model_dump(mode="json"))


def _planted_key() -> str:
    return "sk" + "-" + "proj" + "-" + secrets.token_hex(12) + "AbCd" + secrets.token_hex(4)


@pytest.mark.parametrize("plant", ["known-in-gzip", "known-in-binary-column", "token-shape-in-gzip",
                                   "known-in-copied-file", "known-in-large-copied-file"])
def test_a_publish_that_still_holds_a_secret_is_refused(plant, tmp_path, monkeypatch):
    """What the redactor cannot reach (inside a gzip file, a binary column, a file copied in as it is;
    one past the scanner's size limit is searched block by block) is found by the scan before anything
    moves: the publish is refused with one line naming the file and what was found (never the value);
    nothing is published, the staged files are removed."""
    from memsifter.security import redact, secretscan

    out = tmp_path / "out"
    value = "cred" + secrets.token_hex(16) if plant.startswith("known") else _planted_key()
    if plant.startswith("known"):
        redact.remember(value)   # a credential of this run (read from its variable or its URL)
    pub = storage.Publication(str(out), "probe", {"note": "plain"}, "fake", "test")
    pub.write_table("clean.parquet", pa.table({"a": ["nothing to see"]}))
    if plant.endswith("copied-file"):
        if plant.startswith("known-in-large"):
            monkeypatch.setattr(secretscan, "MAX_BYTES", 1024)
        src = tmp_path / "weights.bin"
        src.write_bytes(os.urandom(20 << 20) + value.encode() + os.urandom(100))   # past one 8 MiB block
        pub.add_file("planted/weights.bin", str(src))
    elif plant == "known-in-binary-column":
        pub.write_table("planted.parquet", pa.table({"blob": pa.array([f"x {value} y".encode()], pa.binary())}))
    else:
        pub.write_bytes("planted.json.gz", gzip.compress(json.dumps({"k": value}).encode()))
    with pytest.raises(MemsifterError) as e:
        pub.publish({})
    msg = str(e.value)
    assert "\n" not in msg and "planted" in msg and "refus" in msg and value not in msg, msg
    pub.abort()
    assert not [p for p in out.rglob("*") if p.is_file()]   # no manifest, no journal, no file, no staged file


def test_a_known_credential_is_redacted_from_every_column_and_the_manifest(tmp_path):
    """Redaction first (the publish goes on): a run's credential in a string column, a nested list, a
    JSON file, the stats or the config is masked, also as its base64 and percent-encoded forms."""
    from urllib.parse import quote

    from memsifter.security import redact

    pw = "p@ss/" + secrets.token_hex(8)
    redact.remember(pw, f"carol:{pw}")
    forms = [pw, quote(pw, safe=""), b64(f"carol:{pw}")]
    out = tmp_path / "out"
    pub = storage.Publication(str(out), "probe", {"url": f"http://h/?p={quote(pw, safe='')}"}, "fake", "test")
    pub.write_table("t.parquet", pa.table({"s": [f"a {f} b" for f in forms],
                                           "l": [[f] for f in forms], "n": [1, 2, 3]}))
    pub.write_json("j.json", {"said": forms})
    pub.write_text("t.txt", " ".join(forms))
    m = pub.publish({"echo": f"Basic {b64(f'carol:{pw}')}"})
    rows = storage.read_parquet(str(out / "t.parquet")).to_pylist()
    assert [r["s"] for r in rows] == ["a *** b"] * 3 and [r["l"] for r in rows] == [["***"]] * 3
    assert [r["n"] for r in rows] == [1, 2, 3]
    for p in out.rglob("*"):
        if p.is_file():
            t = text_of(p)
            assert not any(f in t for f in forms), p
    assert m["files"]["t.parquet"]["rows"] == 3


def test_the_cli_log_handler_masks_every_credential_the_run_knows(capsys):
    """The CLI's log lines (stderr) and a stage's failure record pass through the redaction: a
    credential the run read, quoted as it is or in its Basic form, is masked."""
    from memsifter.console import setup_logging
    from memsifter.security import redact
    from memsifter.stage import _LogTail

    value = "cred" + secrets.token_hex(12)
    redact.remember(value, f"dave:{value}")
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    tail = _LogTail()
    try:
        setup_logging(0)
        root.addHandler(tail)
        logging.getLogger("memsifter.probe").warning("the server said %s, then %s", value, b64(f"dave:{value}"))
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "the server said ***" in err and value not in err and b64(f"dave:{value}") not in err, err
    assert tail.lines() and all(value not in ln and "***" in ln for ln in tail.lines())
