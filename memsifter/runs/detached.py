"""One detached-run helper: a long command (a GPU driver) started from a committed config, in its own
session so that it outlives the shell (or the device call) that started it, then polled, waited for and
its results collected into an output folder, from any later call.

    python -m memsifter.runs.detached start benchmarks/gpu/configs/dapo_4b.yaml [--set KEY=VALUE] [-- ARGS]
    python -m memsifter.runs.detached poll  benchmarks/gpu/configs/dapo_4b.yaml          # state as JSON
    python -m memsifter.runs.detached wait  benchmarks/gpu/configs/dapo_4b.yaml --out "$OUT" --max-s 540
    python -m memsifter.runs.detached stop  benchmarks/gpu/configs/dapo_4b.yaml

The config (:class:`DetachedRunConfig`, YAML) names the command, its scratch folder ``work`` and what
comes back: ``collect`` (globs under the run folder copied to ``--out``), ``archive`` (the run folder as
one ``.tar.gz``, less ``exclude``), ``show`` (files whose tail ``wait`` prints). ``--set KEY=VALUE``
changes a setting for this start (the value is YAML), ``-- ARGS`` are appended to the command.

The run folder is ``<work>/detached``: ``driver.log`` (the command's output), ``run.json`` (its argv,
state, exit code, times) and ``pid`` (of the supervisor, a small process that runs the command and
records how it ended). States: ``starting``, ``running``, ``done`` (exit 0), ``failed`` (exit != 0),
``stopped`` (``stop``), ``died`` (the supervisor is gone without recording an end: the machine or
someone killed it); ``none``: never started. ``wait`` exits 0 when the run is done or still running when
``--max-s`` passes, 1 when it failed, died, was stopped or never started; ``poll`` exits 0; bad input
(a config that does not parse) exits 2 naming the file.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ._supervise import _read, _write

RUNNING = ("starting", "running")
ENDED = ("done", "failed", "stopped", "died")


class DetachedRunConfig(BaseModel):
    """A detached run: what to start and what to bring back."""

    model_config = ConfigDict(extra="forbid")

    name: str
    command: list[str] = Field(min_length=1, description="argv; {python}: this Python, {dir}: the run folder, "
                                                         "{work}: work")
    work: str = Field(description="the run's scratch folder; its own files go to <work>/detached")
    cwd: str | None = Field(None, description="the command's folder (None: the one `start` is called from)")
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables, {dir}/{work} "
                                "substituted (never secrets: those are inherited from the caller's environment)")
    clear: list[str] = Field(default_factory=list, description="globs under the run folder removed at start")
    before_collect: list[str] = Field(default_factory=list, description="argv run (in cwd, {dir}/{work}/{python} "
                                      "substituted) before collecting: a driver that copies its partial results "
                                      "into the run folder")
    collect: list[str] = Field(default_factory=list, description="globs under the run folder copied to --out")
    archive: str | None = Field("logs.tar.gz", description="the run folder as one .tar.gz in --out (None: none)")
    exclude: list[str] = Field(default_factory=list, description="globs left out of the archive")
    show: list[str] = Field(default_factory=list, description="files whose tail `wait` prints, before driver.log")

    @property
    def dir(self) -> str:
        return os.path.join(self.work, "detached")


class BadConfig(ValueError):
    pass


def _set(doc: dict, key: str, value: str) -> None:
    import yaml

    parts = key.split(".")
    for p in parts[:-1]:
        doc = doc.setdefault(p, {})
    doc[parts[-1]] = yaml.safe_load(value)


def load(path: str, sets: list[str] | tuple[str, ...] = ()) -> DetachedRunConfig:
    """The config in ``path`` with ``KEY=VALUE`` settings applied; :class:`BadConfig` names the file and field."""
    import yaml

    try:
        doc = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError) as e:
        raise BadConfig(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise BadConfig(f"{path}: a mapping of settings expected")
    for s in sets:
        key, eq, value = s.partition("=")
        if not eq or not key:
            raise BadConfig(f"{path}: --set {s!r}: KEY=VALUE expected")
        try:
            _set(doc, key, value)
        except (yaml.YAMLError, AttributeError, TypeError) as e:
            raise BadConfig(f"{path}: --set {key}: {str(e).splitlines()[0]}") from None
    try:
        return DetachedRunConfig(**doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise BadConfig(f"{path}: {'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}") from None


def _subst(cfg: DetachedRunConfig, x: str) -> str:
    for k, v in {"{python}": sys.executable, "{dir}": cfg.dir, "{work}": cfg.work}.items():
        x = x.replace(k, v)
    return x


def argv(cfg: DetachedRunConfig, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command's argv: ``command`` and ``extra``, placeholders substituted."""
    return [_subst(cfg, x) for x in [*cfg.command, *extra]]


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pid(d: str) -> int | None:
    try:
        return int(open(os.path.join(d, "pid")).read())
    except (OSError, ValueError):
        return None


def poll(cfg: DetachedRunConfig) -> dict:
    """The run's record (``run.json``) with its state now: ``none`` when never started, ``died`` when the
    supervisor is gone without recording an end."""
    doc = _read(cfg.dir)
    if not doc:
        return {"name": cfg.name, "state": "none"}
    if doc.get("state") in RUNNING and not _alive(_pid(cfg.dir)):
        doc = {**doc, "state": "died"}
    if doc.get("started"):
        doc["elapsed_s"] = round((doc.get("ended") or time.time()) - doc["started"], 1)
    return doc


def start(cfg: DetachedRunConfig, extra: list[str] | tuple[str, ...] = ()) -> dict:
    """Start the command in its own session under a supervisor; refused while a run of ``cfg`` is going."""
    d = cfg.dir
    if poll(cfg)["state"] in RUNNING:
        raise SystemExit(f"{cfg.name}: a detached run is still going ({d}, pid {_pid(d)}); wait for it or stop it")
    os.makedirs(d, exist_ok=True)
    for pattern in ["run.json", "pid", "driver.log", *cfg.clear]:
        for p in glob.glob(os.path.join(d, pattern)):
            shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    _write(d, name=cfg.name, argv=argv(cfg, extra), cwd=os.path.abspath(cfg.cwd or os.getcwd()),
           env={k: _subst(cfg, v) for k, v in cfg.env.items()},
           state="starting", started=time.time())
    # the supervisor finds this package wherever `start` was called from; what it cannot do goes to driver.log
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
    with open(os.path.join(d, "driver.log"), "ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "memsifter.runs._supervise", d], stdin=subprocess.DEVNULL,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": path})
    with open(os.path.join(d, "pid"), "w") as f:
        f.write(str(p.pid))
    return poll(cfg)


def stop(cfg: DetachedRunConfig, grace_s: float = 30) -> dict:
    """SIGTERM to the run's process group (supervisor and command), SIGKILL after ``grace_s``."""
    pid = _pid(cfg.dir)
    if _alive(pid):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            t = time.time()
            while _alive(pid) and time.time() - t < grace_s:
                time.sleep(0.2)
            if not _alive(pid):
                break
        if _read(cfg.dir).get("state") in RUNNING:
            _write(cfg.dir, state="stopped", ended=time.time())
    return poll(cfg)


def collect(cfg: DetachedRunConfig, out: str) -> list[str]:
    """What comes back: each ``collect`` match copied into ``out``, the run folder as ``archive``."""
    d = cfg.dir
    os.makedirs(out, exist_ok=True)
    got = []
    if cfg.before_collect and os.path.isdir(d):
        env = {**os.environ, **{k: _subst(cfg, v) for k, v in cfg.env.items()}}
        with open(os.path.join(d, "collect.log"), "ab") as log:
            subprocess.run([_subst(cfg, x) for x in cfg.before_collect], cwd=_read(d).get("cwd") or cfg.cwd,
                           env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    for pattern in cfg.collect:
        for p in sorted(glob.glob(os.path.join(d, pattern))):
            if os.path.isfile(p):
                shutil.copy(p, out)
                got.append(os.path.join(out, os.path.basename(p)))
    if cfg.archive and os.path.isdir(d):
        dest = os.path.join(out, cfg.archive)

        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            rel = os.path.relpath(info.name, ".")
            name = os.path.basename(rel)
            if any(fnmatch.fnmatch(rel, x) or fnmatch.fnmatch(name, x) for x in cfg.exclude):
                return None
            return info

        with tarfile.open(dest + ".tmp", "w:gz") as tar:
            for entry in sorted(os.listdir(d)):
                tar.add(os.path.join(d, entry), arcname=entry, filter=keep)
        os.replace(dest + ".tmp", dest)
        got.append(dest)
    return got


def wait(cfg: DetachedRunConfig, out: str | None, max_s: float, poll_s: float = 5.0, tail: int = 6000) -> dict:
    """Poll until the run has ended or ``max_s`` passed; then collect into ``out`` (when given) and print
    the tails of ``show`` and ``driver.log``."""
    t = time.time()
    st = poll(cfg)
    while st["state"] in RUNNING and time.time() - t < max_s:
        time.sleep(min(poll_s, max(0.0, max_s - (time.time() - t))) or 0.01)
        st = poll(cfg)
    if out:
        st = {**st, "collected": collect(cfg, out)}
    for name in [*cfg.show, "driver.log"]:
        p = os.path.join(cfg.dir, name)
        if os.path.isfile(p):
            print(f"--- {name} (tail)\n" + open(p, errors="replace").read()[-tail:], flush=True)
    return st


def main(args: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if args is None else args)
    extra: list[str] = []
    if "--" in args:
        i = args.index("--")
        args, extra = args[:i], args[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m memsifter.runs.detached", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start", "poll", "wait", "stop", "collect"])
    ap.add_argument("config", help="a detached-run config (YAML)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for this call")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="wait/collect: where the results go ($OUT)")
    ap.add_argument("--max-s", type=float, default=540, help="wait: at most this long")
    ap.add_argument("--poll-s", type=float, default=5)
    a = ap.parse_args(args)
    try:
        cfg = load(a.config, a.set)
    except BadConfig as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if extra and a.action != "start":
        ap.error("arguments after -- are for start only")
    if a.action == "start":
        st = start(cfg, extra)
        print(f"started {cfg.name}: pid {_pid(cfg.dir)}; logs in {cfg.dir}", flush=True)
    elif a.action == "poll":
        st = poll(cfg)
    elif a.action == "stop":
        st = stop(cfg)
    elif a.action == "collect":
        if not a.out:
            ap.error("collect: --out (or $OUT) is needed")
        st = {**poll(cfg), "collected": collect(cfg, a.out)}
    else:
        st = wait(cfg, a.out, a.max_s, a.poll_s)
    print(json.dumps({k: v for k, v in st.items() if k != "env"}), flush=True)
    return 1 if st["state"] in ("failed", "stopped", "died", "none") and a.action != "poll" else 0


if __name__ == "__main__":
    sys.exit(main())
