"""The service in this process on a background thread (uvicorn, real HTTP on loopback): for notebooks,
tests and the benchmark's in-process runs. ``memsifter serve --no-ray`` runs the same app in the
foreground."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

from .config import ServeConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(cfg: ServeConfig, ranker: Any = None, service: Any = None) -> Iterator[tuple[str, Any]]:
    """Yields (base URL, the :class:`~memsifter.service.core.RetrievalService`); stops the server after."""
    import uvicorn

    from .core import RetrievalService
    from .http import make_app
    from .logs import install_redaction

    svc = service or RetrievalService(cfg, ranker=ranker)
    install_redaction(svc.secrets)
    server = uvicorn.Server(uvicorn.Config(make_app(svc), host=cfg.host, port=cfg.port, log_level="warning",
                                           access_log=False, lifespan="off"))
    t = threading.Thread(target=server.run, name="memsifter-serve-http", daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started:
        if not t.is_alive() or time.time() > deadline:
            raise RuntimeError(f"the service did not start on {cfg.host}:{cfg.port}")
        time.sleep(0.02)
    try:
        yield f"http://{cfg.host}:{cfg.port}", svc
    finally:
        server.should_exit = True
        t.join(10)
        svc.close()
