"""Fault injection for tests of crash-resume, a hook of the runtime's fault points
(:mod:`memsifter.store.hooks`).

Production modules mark the places where a crash matters (``hooks.checkpoint("publish-move")``,
``hooks.checkpoint("saved", done=n)``) and nothing else; this module, registered as a hook when it is
imported (the runtime imports it by name in a process started with one of the variables below),
decides from the environment whether anything happens there. Without any of the variables it does
nothing. :func:`checkpoint` is the hook (looked up at each point, so a test may replace it).

* ``MEMSIFTER_KILL_AT=<stage>:<point>:<n>``: SIGKILL this process the n-th time ``point`` is reached
  while ``stage`` runs. Points: ``write`` (any file the storage layer writes: work shards, staged
  files), ``publish-start``, ``publish-move`` (after each file moved into place), ``publish-commit``
  (every file in place, ``_SUCCESS`` not yet written).
* ``MEMSIFTER_PAUSE_AT=<stage>:<point>:<seconds>``: sleep there (widens a window for a race test).
* ``MEMSIFTER_CRASH_AFTER=<stage>:<n>``: raise :class:`InjectedCrash` once the n-th unit of resumable
  work (an embedding shard, a batch of rankings or answers) is saved: the ``saved`` point, ``done=n``.

The object-store fault proxy of the storage tests is :mod:`memsifter.testing.faultproxy`.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from ..errors import StorageError
from ..store import hooks
from ..store.hooks import FAULT_ENV as ENV, current_stage

_kill_counts: dict[str, int] = {}


class InjectedCrash(RuntimeError):
    """Raised at a ``saved`` checkpoint by ``MEMSIFTER_CRASH_AFTER`` (tests of crash-resume)."""


def checkpoint(point: str, **ctx: Any) -> None:
    """A place where a test may inject a fault (see the module docstring); a no-op unless one of the
    fault variables is set. ``ctx``: ``stage`` (default: the running stage), ``done`` (units saved)."""
    env = {k: os.environ.get(k, "") for k in ENV}
    if not any(env.values()):
        return
    stage = str(ctx.get("stage") or current_stage())
    pause = env["MEMSIFTER_PAUSE_AT"]
    if pause and pause.rsplit(":", 2)[:2] == [stage, point]:
        time.sleep(float(pause.rsplit(":", 1)[1]))
    if point == "saved":
        _crash_after(env["MEMSIFTER_CRASH_AFTER"], stage, int(ctx.get("done", 0)))
    spec = env["MEMSIFTER_KILL_AT"]
    if spec:
        _kill_at(spec, stage, point)


def _crash_after(spec: str, stage: str, done: int) -> None:
    if not spec or ":" not in spec:
        return
    name, n = spec.rsplit(":", 1)
    if name == stage and done >= int(n):
        raise InjectedCrash(f"injected crash in stage {stage} after {done} saved units "
                            f"(MEMSIFTER_CRASH_AFTER={spec})")


def _kill_at(spec: str, stage: str, point: str) -> None:
    try:
        want_stage, where, n = spec.rsplit(":", 2)
        n_i = int(n)
    except ValueError:
        raise StorageError(f"MEMSIFTER_KILL_AT={spec!r}: expected <stage>:<point>:<n>") from None
    if where != point or want_stage != stage:
        return
    _kill_counts[point] = _kill_counts.get(point, 0) + 1
    if _kill_counts[point] >= n_i:
        os.kill(os.getpid(), signal.SIGKILL)


@hooks.register
def _inject(point: str, **ctx: Any) -> None:
    checkpoint(point, **ctx)   # the module's checkpoint at call time (tests replace it)
