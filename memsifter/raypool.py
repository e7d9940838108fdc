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
    # Inside a Ray job (a RayJob's entrypoint) the job's own runtime env applies; adding ours there
    # would conflict with keys the job already sets.
    if env_vars and not os.environ.get("RAY_JOB_ID") and not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        kw["runtime_env"] = {"env_vars": env_vars}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **kw)
    else:
        ray.init(num_cpus=num_cpus if num_cpus is not None else _SESSION["num_cpus"],
                 include_dashboard=False, **kw)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
    except Exception:  # noqa: BLE001 - cosmetic
        pass


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


class Progress:
    """Texts embedded, texts/s and ETA: a tqdm bar on a terminal, a log line every ``every`` seconds
    otherwise (pod logs), both only once a run has lasted ``after`` seconds."""

    def __init__(self, total: int, every: float = 15.0, after: float = 3.0, desc: str = "embed"):
        self.total, self.every, self.after, self.desc = total, every, after, desc
        self.done, self.t0, self.last = 0, time.time(), time.time()
        self.bar = None
        self.tty = sys.stderr.isatty()

    def update(self, n: int) -> None:
        self.done += n
        now = time.time()
        if now - self.t0 < self.after and self.done < self.total:
            return
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=self.done - n, unit="text", desc=self.desc,
                                dynamic_ncols=True, smoothing=0.1)
            self.bar.update(n)
        elif now - self.last >= self.every or self.done >= self.total:
            self.last = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        el = (now or time.time()) - self.t0
        rate = self.done / el if el > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"{self.desc}: {self.done}/{self.total} texts, {rate:.1f} texts/s, "
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
