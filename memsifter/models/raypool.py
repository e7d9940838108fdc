"""One Ray instance per process for the stages that use Ray (embed's actor pool, rank's vLLM engines):
join ``RAY_ADDRESS`` or start a local instance once (:func:`ensure_ray`), the cluster's GPUs, progress
lines for long Ray Data jobs, and :func:`session`, which a pipeline wraps around its stages so they share
one instance that ends with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Iterator

log = logging.getLogger(__name__)

_SESSION: dict = {"num_cpus": None}
_QUIET = {"on": False}


def set_quiet(quiet: bool) -> None:
    """``-q`` (the CLI's :func:`memsifter.console.setup_logging`): a Ray instance started from now on keeps
    its own lines off the terminal (:func:`ensure_ray`)."""
    _QUIET["on"] = bool(quiet)


def _quiet_ray() -> dict:
    """``ray.init`` arguments and environment that keep Ray off the terminal at ``-q``: the workers'
    output stays in the session's log files (``log_to_driver=False``), the ``ray`` and Ray Data loggers
    print errors only (Ray Data re-reads ``RAY_DATA_LOG_LEVEL`` whenever it reconfigures its logging),
    and the C++ core worker inside this process logs fatal errors only (``RAY_BACKEND_LOG_LEVEL``: its
    error-level lines, e.g. about actor constructor arguments, went straight to stderr). Settings the
    user exported are kept."""
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return {"log_to_driver": False, "logging_level": logging.ERROR}


def ensure_ray(num_cpus: int | None = None) -> None:
    """Join ``RAY_ADDRESS`` when set, else start (once) a local Ray instance (``num_cpus``: default the
    enclosing :func:`session`'s)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env_vars = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME",
                                           "VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM")
                if k in os.environ}
    kw: dict = {"log_to_driver": True, "ignore_reinit_error": True}
    if _QUIET["on"]:
        kw.update(_quiet_ray())
    # Inside a Ray job (a RayJob's entrypoint) the job's own runtime env applies; adding ours there
    # would conflict with keys the job already sets.
    if env_vars and not os.environ.get("RAY_JOB_ID") and not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        kw["runtime_env"] = {"env_vars": env_vars}
    with _init_output_aside() if _QUIET["on"] else contextlib.nullcontext():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], **kw)
        else:
            # address="local": a new local instance, never a cluster another process started here
            ray.init(address="local", num_cpus=num_cpus if num_cpus is not None else _SESSION["num_cpus"],
                     include_dashboard=False, **kw)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
    except Exception:  # noqa: BLE001 - cosmetic
        pass
    if _QUIET["on"]:   # ray.init configured the ray logger anew
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def _init_output_aside() -> Iterator[None]:
    """At ``-q``, what ``ray.init`` writes to file descriptor 2 (its C++ core worker announces its log
    level there, whatever that level is) goes to ``<Ray session>/logs/memsifter-ray-init.err`` instead
    of the terminal; if ``ray.init`` fails, it is written to stderr after all (it says why)."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    ok = False
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
            ok = True
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read()
            if not ok:
                os.write(2, text)
            elif text:
                with contextlib.suppress(Exception):   # best effort: a log file, not the run
                    import ray

                    logs = ray._private.worker._global_node.get_logs_dir_path()
                    with open(os.path.join(logs, "memsifter-ray-init.err"), "ab") as f:
                        f.write(text)


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


class Progress:
    """Texts embedded, texts/s and ETA: a tqdm bar on a terminal, a log line every ``every`` seconds
    otherwise (pod logs), both only once a run has lasted ``after`` seconds."""

    def __init__(self, total: int, every: float = 15.0, after: float = 3.0, desc: str = "embed",
                 unit: str = "text"):
        self.total, self.every, self.after, self.desc, self.unit = total, every, after, desc, unit
        self.done, self.t0, self.last = 0, time.time(), time.time()
        self.bar = None
        self.tty = sys.stderr.isatty()

    def update(self, n: int) -> None:
        from ..stage import report_progress

        self.done += n
        report_progress(self.desc, self.unit, self.done, self.total, self.t0)   # for `memsifter status`
        now = time.time()
        if now - self.t0 < self.after and self.done < self.total:
            return
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=self.done - n, unit=self.unit, desc=self.desc,
                                dynamic_ncols=True, smoothing=0.1)
            self.bar.update(n)
        elif now - self.last >= self.every or self.done >= self.total:
            self.last = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        el = (now or time.time()) - self.t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.desc}: {self.done}/{self.total} {self.unit}s, {rate:.1f} {self.unit}s/s, "
                f"elapsed {el:.0f} s, ETA {eta:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def session(address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """For the stages run inside the block: join the Ray cluster at ``address`` (it becomes
    ``RAY_ADDRESS``) or, when a stage first needs Ray, start a local instance with ``num_cpus``; an
    instance started inside the block is shut down at its end. Stages that never call
    :func:`ensure_ray` start nothing."""
    if address:
        os.environ["RAY_ADDRESS"] = address
    was_up = _ray_up()
    prev = _SESSION["num_cpus"]
    _SESSION["num_cpus"] = num_cpus
    try:
        yield
    finally:
        _SESSION["num_cpus"] = prev
        if not was_up and _ray_up():
            import ray

            ray.shutdown()


def _ray_up() -> bool:
    ray = sys.modules.get("ray")   # not imported yet: not initialised either
    return bool(ray is not None and ray.is_initialized())
