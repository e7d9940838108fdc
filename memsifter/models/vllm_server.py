"""The one launcher of vLLM's OpenAI-compatible server: the tests' and the demo's CPU servers
(``memsifter.testing.servers.vllm_server``), ``memsifter models serve`` and the GPU drivers
(``benchmarks/gpu``) all build their command line and environment here, from :class:`VllmServerConfig`.

    cfg = VllmServerConfig(model="/path/or/dir", served_name="tiny")      # CPU defaults
    with serve(cfg) as url:                                              # .../v1, ready on /v1/models
        ...
    srv = VllmServer(cfg).start(); srv.wait_ready(); ...; srv.stop()     # the same, by hand

The server runs in its own process group (stopping it stops every process it started), writes its
output to ``log_path`` (a temporary file when not given), and is ready when ``/v1/models`` answers
200. ``device="cpu"`` is vLLM's CPU build (float32, a small KV cache, ``cpu_engine_env``);
``device="gpu"`` the GPU build (bfloat16, ``engine_env``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field


class VllmServerConfig(BaseModel):
    """One vLLM OpenAI-compatible server."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="model directory (or a name vLLM resolves)")
    served_name: str = Field(description="the model name clients ask for")
    device: Literal["cpu", "gpu"] = "cpu"
    host: str = "127.0.0.1"
    port: int | None = Field(None, description="None: a free loopback port")
    dtype: str | None = Field(None, description="None: float32 on the CPU, bfloat16 on a GPU")
    max_model_len: int = 4096
    max_num_seqs: int = 16
    enforce_eager: bool = True
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="GPU only; None: vLLM's default")
    lora: bool = Field(False, description="serve LoRA adapters loaded at run time (--enable-lora, up to 4 of rank 16)")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM arguments (a later one wins)")
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the server")
    log_path: str | None = None
    timeout_s: float = 300
    poll_s: float = 1.0


def argv(cfg: VllmServerConfig, port: int | None = None) -> list[str]:
    """The server's command line (``port``: the one chosen when ``cfg.port`` is None)."""
    port = port or cfg.port
    if port is None:
        raise ValueError("vllm server: no port (set port, or start() picks a free one)")
    dtype = cfg.dtype or ("float32" if cfg.device == "cpu" else "bfloat16")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
           "--served-model-name", cfg.served_name, "--host", cfg.host, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.lora:
        cmd += ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"]
    return cmd + list(cfg.extra_args)


def environment(cfg: VllmServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ``base`` (default: this process's), the engine defaults for the device
    where ``base`` does not set them, then ``cfg.env``."""
    from .vllm_env import cpu_engine_env, engine_env

    env = dict(os.environ if base is None else base)
    if cfg.device == "cpu":
        for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                     "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
            env.setdefault(k, v)
        defaults = cpu_engine_env()
    else:
        defaults = engine_env()
    for k, v in defaults.items():
        env.setdefault(k, v)
    if cfg.lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.update(cfg.env)
    return env


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, where: str = "", poll_s: float = 1.0) -> None:
    """Until ``proc`` answers ``/v1/models`` on 127.0.0.1:``port``; an error naming ``where`` (e.g. its log)
    if it exits first or is not ready in ``timeout`` seconds."""
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}; {where}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        if time.time() > deadline:
            raise TimeoutError(f"vLLM server not ready in {timeout:.0f}s; {where}")
        time.sleep(poll_s)


class VllmServer:
    """A started server: ``start()``, ``wait_ready()``, ``url``, ``stop()``."""

    def __init__(self, cfg: VllmServerConfig):
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None
        self.port: int | None = cfg.port
        self.log_path = cfg.log_path
        self._log = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> "VllmServer":
        from ..testing.servers import free_port

        self.port = self.cfg.port or free_port()
        self.log_path = self.cfg.log_path or os.path.join(tempfile.mkdtemp(prefix="vllm-"), "server.log")
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.t0 = time.time()
        self.proc = subprocess.Popen(argv(self.cfg, self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=environment(self.cfg), start_new_session=True)
        return self

    def wait_ready(self) -> str:
        assert self.proc is not None, "start() first"
        try:
            wait_ready(self.proc, self.port, self.cfg.timeout_s, f"server {self.cfg.served_name}, log: {self.log_path}",
                       self.cfg.poll_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self, grace_s: float = 20) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``; the log closed."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


@contextlib.contextmanager
def serve(cfg: VllmServerConfig) -> Iterator[str]:
    """The server for the block; yields its base URL (…/v1) once ready, stopped on exit."""
    srv = VllmServer(cfg).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
