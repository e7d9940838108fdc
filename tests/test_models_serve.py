"""`memsifter models serve`: the local OpenAI-compatible vLLM server (CPU build) a user starts by name or
directory, as the demo does, so `run rank --engine endpoint` and `run chat` can use it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from memsifter.testing.servers import free_port

EXE = [sys.executable, "-m", "memsifter.cli", "models", "serve"]


def test_serve_refuses_what_is_not_a_model_in_one_line(tmp_path):
    for name in ("no-such-model", str(tmp_path / "missing-dir")):
        p = subprocess.run([*EXE, name], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert name in p.stderr and p.stdout == ""


@pytest.mark.slow
def test_serve_answers_openai_requests_and_stops_cleanly(tiny_model_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([*EXE, tiny_model_dir, "--port", str(port), "--served-name", "tiny",
                             "--max-model-len", "1024"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        first = proc.stdout.readline()   # printed once the server answers
        assert first.startswith(f"serving tiny at http://127.0.0.1:{port}/v1"), first + proc.stderr.read(2000)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.load(r)["data"]] == ["tiny"]
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["choices"][0]["message"]["content"] is not None
    finally:
        proc.send_signal(signal.SIGTERM)   # `kill`, a container stop: a clean stop like Ctrl-C
        rc = proc.wait(60)
    assert rc == 0
    # the vLLM process went with it: the port is free again
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
        except OSError:
            break
        time.sleep(1)
    else:
        pytest.fail("the vLLM server outlived `models serve`")
