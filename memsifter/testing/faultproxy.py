"""A fault-injecting TCP proxy for an S3 server (tests of the storage layer under store faults).

:class:`FaultProxy` listens on 127.0.0.1 and forwards to the S3 server. It makes every client
connection carry one request (it rewrites the request's ``Connection`` header to ``close``), so each
request is one decision, drawn from a seeded RNG:

* ``reset``: read the request, then drop the connection with a TCP RST (no answer);
* ``reset_after``: forward the request, then drop the connection before the answer reaches the client
  (the request *was* executed: retries must be idempotent);
* ``stall``: hold the request ``stall_s`` seconds, then drop it (longer than the client's timeout);
* ``slow``: hold it ``slow_s`` seconds, then forward it;
* ``503``: answer ``503 SlowDown``; ``500``: answer ``500 InternalError``;
* ``hang`` (only when a plan names it): read the request and never answer, until
  :meth:`release_hung` or :meth:`stop` (a store that accepts connections and goes silent);
* during :meth:`outage` (N seconds) or while ``down`` is set, every connection is reset at once.

Counts of what it did are in :attr:`counts`. Runs in a background thread with its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

KINDS = ("reset", "reset_after", "stall", "slow", "503", "500")
EXTRA_KINDS = ("hang",)   # drawn only when a plan names them

_ERR = {"503": (b"503 Slow Down", b"SlowDown", b"Please reduce your request rate."),
        "500": (b"500 Internal Server Error", b"InternalError", b"We encountered an internal error.")}


@dataclass
class FaultPlan:
    rate: float = 0.0                     # share of requests that get a fault
    kinds: tuple[str, ...] = KINDS        # which faults, drawn uniformly
    seed: int = 0
    stall_s: float = 6.0
    slow_s: float = 1.0
    skip_first: int = 0                   # requests passed through untouched first


@dataclass
class FaultProxy:
    upstream_host: str
    upstream_port: int
    plan: FaultPlan = field(default_factory=FaultPlan)
    port: int = 0
    counts: dict = field(default_factory=dict)
    down: bool = False

    def __post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)
        self._down_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "faults": 0, **{k: 0 for k in KINDS + EXTRA_KINDS}, "outage": 0}
        self._hung: asyncio.Event | None = None

    # ------------------------------------------------------------------ control
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self.plan, self._rng = plan, random.Random(plan.seed)

    def outage(self, seconds: float) -> None:
        """Refuse everything for ``seconds`` from now."""
        self._down_until = time.monotonic() + seconds

    def release_hung(self) -> None:
        """Drop (reset) every connection held by ``hang``."""
        if self._loop is not None and self._hung is not None:
            self._loop.call_soon_threadsafe(self._hung.set)

    def reset_counts(self) -> dict:
        with self._lock:
            old = dict(self.counts)
            self.counts = {k: 0 for k in self.counts}
        return old

    def _decide(self) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            if self.down or time.monotonic() < self._down_until:
                self.counts["outage"] += 1
                self.counts["faults"] += 1
                return "outage"
            if self.counts["requests"] <= self.plan.skip_first or self._rng.random() >= self.plan.rate:
                return None
            kind = self._rng.choice(self.plan.kinds)
            self.counts[kind] += 1
            self.counts["faults"] += 1
            return kind

    # ------------------------------------------------------------------ the proxy
    @staticmethod
    def _rst(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind = self._decide()
        if kind == "outage":
            self._rst(writer)
            return
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        lines = head.split(b"\r\n")
        kept = [ln for ln in lines[1:] if ln and not ln.lower().startswith((b"connection:", b"keep-alive:"))]
        head = b"\r\n".join([lines[0], *kept, b"Connection: close", b"", b""])
        if kind == "hang":
            if self._hung is None or self._hung.is_set():
                self._hung = asyncio.Event()
            await self._hung.wait()
            self._rst(writer)
            return
        if kind in ("reset", "stall"):
            if kind == "stall":
                await asyncio.sleep(self.plan.stall_s)
            self._rst(writer)
            return
        if kind in _ERR:
            status, code, msg = _ERR[kind]
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + code + b"</Code><Message>" + msg
                    + b"</Message></Error>")
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()
            return
        if kind == "slow":
            await asyncio.sleep(self.plan.slow_s)
        try:
            up_r, up_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            self._rst(writer)
            return
        up_w.write(head)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()

        to_up = asyncio.ensure_future(pipe(reader, up_w))
        if kind == "reset_after":
            # wait for the server's answer to start (the request was executed), then drop it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(up_r.read(1), timeout=30)
            to_up.cancel()
            up_w.close()
            self._rst(writer)
            return
        await pipe(up_r, writer)
        to_up.cancel()
        up_w.close()
        with contextlib.suppress(Exception):
            writer.close()

    def start(self) -> "FaultProxy":
        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self.port or 0, limit=1 << 20))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return

        async def close() -> None:
            self._server.close()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def fault_proxy(endpoint: str, plan: FaultPlan | None = None):  # noqa: ANN201
    """A :class:`FaultProxy` in front of ``endpoint`` (``http://host:port``) for the block."""
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, port = hostport.rsplit(":", 1)
    proxy = FaultProxy(host, int(port), plan or FaultPlan()).start()
    try:
        yield proxy
    finally:
        proxy.stop()
