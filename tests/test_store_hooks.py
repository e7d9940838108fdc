"""Fault points (memsifter.store.hooks): the runtime marks where a crash matters and hands each point to
the registered hooks; the crash-resume fault injection (memsifter.testing.faults) is one such hook, which
the runtime never imports unless a fault variable asks for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memsifter.store import hooks, storage
from test_stage_leaves import imported_modules

ROOT = Path(__file__).resolve().parents[1]

def test_no_runtime_module_imports_the_fault_injection():
    bad = []
    for path in sorted((ROOT / "memsifter").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("memsifter/testing/") or "faults" not in path.read_text():
            continue
        if hooks.FAULT_HOOKS in imported_modules(path):
            bad.append(rel)
    assert not bad, "runtime modules importing memsifter.testing.faults (use memsifter.store.hooks):\n" + \
        "\n".join(bad)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in hooks.FAULT_ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, cwd=ROOT)


def test_the_store_and_the_stage_runner_load_without_the_testing_package():
    """(The store and memsifter.stage imported memsifter.testing.faults before the hooks.)"""
    p = _python("import sys, memsifter.store.storage, memsifter.store.lease, memsifter.stage\n"
                "print(sorted(m for m in sys.modules if m.startswith('memsifter.testing')))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_a_fault_variable_loads_the_injection_at_the_first_point():
    """A process started with MEMSIFTER_CRASH_AFTER set (as the crash-resume tests start stages) gets
    the injection without importing it: the first fault point registers it."""
    p = _python("import sys\nfrom memsifter.store import hooks\n"
                "assert not any(m.startswith('memsifter.testing') for m in sys.modules)\n"
                "hooks.checkpoint('stage-start', stage='embed')\n"
                "try:\n    hooks.checkpoint('saved', done=2)\n"
                "except Exception as e:\n    print(type(e).__module__, type(e).__name__, e)\n",
                MEMSIFTER_CRASH_AFTER="embed:2")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("memsifter.testing.faults InjectedCrash injected crash in stage embed after 2"), \
        p.stdout


def test_a_registered_hook_sees_the_points_of_a_publish_in_order(tmp_path):
    seen: list[tuple[str, str]] = []

    def hook(point: str, **ctx) -> None:
        seen.append((point, hooks.current_stage()))
    hooks.register(hook)
    try:
        hooks.checkpoint("stage-start", stage="probe")
        pub = storage.Publication(str(tmp_path / "out"), "probe", {}, "h", "v")
        pub.write_text("a.txt", "a")
        pub.write_text("b.txt", "b")
        pub.publish()
        hooks.checkpoint("stage-end", stage="probe")
        hooks.checkpoint("write")   # outside a stage: no stage name
    finally:
        hooks.unregister(hook)
    points = [p for p, _ in seen]
    # two staged files, the journal, one move each, the commit, the manifest; stage-end is not handed on
    assert points == ["stage-start", "write", "write", "publish-start", "write", "publish-move", "publish-move",
                      "publish-commit", "write", "write"]
    assert all(stage == "probe" for _, stage in seen[:-1]) and seen[-1] == ("write", "")
    hooks.checkpoint("write")   # unregistered: not seen again
    assert seen[-1] == ("write", "") and len(seen) == len(points)


def test_a_hook_that_raises_stops_the_publish_before_success(tmp_path):
    """A hook's exception goes through the fault point (what a SIGKILL leaves behind, in-process): the
    output stays unpublished."""
    def crash(point: str, **ctx) -> None:
        if point == "publish-commit":
            raise KeyboardInterrupt("simulated kill")
    hooks.register(crash)
    try:
        pub = storage.Publication(str(tmp_path / "out"), "probe", {}, "h", "v")
        pub.write_text("a.txt", "a")
        with pytest.raises(KeyboardInterrupt):
            pub.publish()
    finally:
        hooks.unregister(crash)
    assert storage.try_manifest(str(tmp_path / "out")) is None
