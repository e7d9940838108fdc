"""Fault points: the places where a crash matters, and the hooks that see them.

The runtime marks those places and nothing else: ``hooks.checkpoint("write")`` (a file the storage
layer wrote), ``"publish-start"``, ``"publish-move"`` (after each file moved into place),
``"publish-commit"`` (every file in place, ``_SUCCESS`` not yet written), ``"saved"`` with ``done=n`` (a
unit of resumable work saved) and ``"stage-start"`` / ``"stage-end"`` (sent by
:meth:`memsifter.stage.Stage.run`, which keep :func:`current_stage`). Each point is handed to the
hooks registered with :func:`register`; with none it does nothing.

The crash-resume tests' fault injection (``MEMSIFTER_KILL_AT``, ``MEMSIFTER_PAUSE_AT``,
``MEMSIFTER_CRASH_AFTER``: :mod:`memsifter.testing.faults`) is such a hook: the testing package
registers it when imported. A process started with one of those variables set (a stage run as its own
process, killed part-way) gets it at its first fault point, by name (:data:`FAULT_HOOKS`): the runtime
never imports it otherwise.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any, Callable

Hook = Callable[..., None]

# The variables of the crash-resume fault injection, and the module that registers it.
FAULT_ENV = ("MEMSIFTER_KILL_AT", "MEMSIFTER_PAUSE_AT", "MEMSIFTER_CRASH_AFTER")
FAULT_HOOKS = "memsifter.testing.faults"

_hooks: list[Hook] = []
_lock = threading.Lock()
_stages: list[str] = []               # the stages running in this process, innermost last


def register(hook: Hook) -> Hook:
    """Call ``hook(point, **ctx)`` at every fault point from now on (once, however often registered)."""
    with _lock:
        if hook not in _hooks:
            _hooks.append(hook)
    return hook


def unregister(hook: Hook) -> None:
    with _lock:
        if hook in _hooks:
            _hooks.remove(hook)


def current_stage() -> str:
    """The innermost stage running in this process ("" outside a stage)."""
    return _stages[-1] if _stages else ""


def checkpoint(point: str, **ctx: Any) -> None:
    """A fault point (see the module docstring). ``ctx``: ``stage`` (default: the running stage),
    ``done`` (units saved)."""
    if point == "stage-start":
        _stages.append(str(ctx.get("stage", "")))
    elif point == "stage-end":
        if _stages:
            _stages.pop()
        return
    if any(os.environ.get(k) for k in FAULT_ENV):
        importlib.import_module(FAULT_HOOKS)   # registers itself on import (once per process)
    for hook in list(_hooks):
        hook(point, **ctx)
