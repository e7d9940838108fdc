"""What a running stage records under its output's ``_work/`` for ``memsifter status``
(:mod:`memsifter.status` reads them): ``failure.json``, why the last attempt failed (error, traceback, the
last log lines), written by :meth:`memsifter.stage.Stage.run` when an attempt raises and removed when one
publishes; ``progress.json``, how far the running attempt is, written by the stages' progress bars
(:func:`progress_bar`, :func:`report_progress`). Best effort: a record that cannot be written never
fails the stage.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from ..security.redact import redact
from . import storage

log = logging.getLogger("memsifter.stage")


FAILURE = "failure.json"   # under <output>/_work/: the last failed attempt, for `memsifter status`


class _LogTail(logging.Handler):
    """The last log lines of a stage's run (all loggers, INFO and up), kept for its failure record."""

    def __init__(self, keep: int = 40):
        super().__init__(logging.INFO)
        from collections import deque

        self._lines: Any = deque(maxlen=keep)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(redact(self.format(record))[:2000])
        except Exception:  # noqa: BLE001 - a log line must never fail the stage
            pass

    def lines(self) -> list[str]:
        return list(self._lines)


def record_failure(output: str, stage_name: str, config_hash_: str, exc: BaseException, tail: list[str]) -> None:
    """Archive why an attempt failed under ``<output>/_work/failure.json`` (best effort): the pods
    and their logs may be gone when someone asks ``memsifter status``."""
    import socket
    import traceback

    from .lease import run_id

    rec = {"stage": stage_name, "config_hash": config_hash_, "failed_at": storage.utcnow(), "run_id": run_id(),
           "host": socket.gethostname(), "pid": os.getpid(), "error": redact(f"{type(exc).__name__}: {exc}")[:4000],
           "traceback": redact("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))[-6000:],
           "log_tail": tail}
    try:
        storage.write_bytes(storage.join(output, storage.WORK, FAILURE), json.dumps(rec, indent=2).encode())
    except Exception as e:  # noqa: BLE001 - the original error is what the user must see
        log.debug("could not archive the failure of %s: %s", output, e)


PROGRESS = "progress.json"   # under <output>/_work/: how far the running attempt is, for `memsifter status`
PROGRESS_EVERY = 10.0        # seconds between two writes of it
_progress: dict = {}         # the stage running in this process: output, stage, time of the last write


def report_progress(desc: str, unit: str, done: int, total: int | None, started: float) -> None:
    """Record how far the running stage is (``done`` of ``total`` ``unit``s since ``started``, the
    epoch time its count began) in ``<output>/_work/progress.json``, at most every
    :data:`PROGRESS_EVERY` seconds and when the count completes; ``memsifter status`` shows it with the
    rate and ETA. The progress bars of the stages call it (:func:`progress_bar`,
    :class:`memsifter.models.raypool.Progress`); outside a stage it does nothing. Best effort: a write
    that fails never fails the stage."""
    cur = _progress
    if not cur:
        return
    now = time.time()
    if now - cur.get("last", 0.0) < PROGRESS_EVERY and not (total is not None and done >= total):
        return
    cur["last"] = now
    from .lease import run_id

    rec = {"stage": cur["stage"], "run_id": run_id(), "pid": os.getpid(), "desc": desc, "unit": unit,
           "done": int(done), "total": None if total is None else int(total), "started": round(started, 3),
           "updated": round(now, 3)}
    try:
        storage.write_bytes(storage.join(cur["output"], storage.WORK, PROGRESS), json.dumps(rec).encode())
    except Exception as e:  # noqa: BLE001
        log.debug("could not record the progress of %s: %s", cur["output"], e)


def progress_bar(**kw: Any) -> Any:
    """A tqdm bar (``kw`` as tqdm takes them) that also records its count with :func:`report_progress`,
    on a terminal or not (a bar that is disabled still counts)."""
    from tqdm import tqdm

    class _Bar(tqdm):
        def __init__(self, **a: Any) -> None:
            self._count, self._t0 = 0, time.time()
            self._what = (str(a.get("desc") or ""), str(a.get("unit") or "it"))
            super().__init__(**a)

        def update(self, n: float | None = 1) -> bool | None:
            self._count += int(n or 0)
            report_progress(*self._what, self._count, self.total, self._t0)
            return super().update(n)

    return _Bar(**kw)


def clear_failure(output: str) -> None:
    try:
        uri = storage.join(output, storage.WORK, FAILURE)
        if storage.exists(uri):
            storage.delete(uri)
    except Exception as e:  # noqa: BLE001
        log.debug("could not clear the failure record of %s: %s", output, e)
