"""The Ray Serve application: a CPU deployment holding the first stage (and the HTTP ingress), a ranker
deployment (a GPU each on a cluster) that batches requests with ``@serve.batch``.

``build_app(args)`` is the application builder a Serve config names: ``import_path:
memsifter.service.app:build_app`` with ``args`` = a :class:`~memsifter.service.config.ServeConfig` as a
mapping. In a RayService's ``serveConfigV2``::

    applications:
      - name: memsifter
        route_prefix: /
        import_path: memsifter.service.app:build_app
        args:
          index: s3://bucket/run/embed
          state: s3://bucket/serve-state
          auth: {keys: {MEMSIFTER_KEY_TRAINER: {read: ["*"]}}}
          ranker: {model: zstanjj/MemSifter-4B-Thinking, engine: vllm, context_limit: 32768}

``FirstStage`` replicas autoscale between ``min_replicas`` and ``max_replicas`` on ``target_ongoing_requests``
(each holds the whole index: memory, not CPU, bounds how many fit a node); the ranker's between its own.
A replica reports healthy once its index is loaded (its constructor); a failed reload keeps it serving the
index it has.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve

from .config import ServeConfig, load_config

log = logging.getLogger("memsifter.service")
APP_NAME = "memsifter"


@serve.deployment(name="Ranker")
class RankerDeployment:
    """The ranker (:class:`memsifter.service.ranker.RankerCore`); concurrent requests share engine calls."""

    def __init__(self, settings: dict):
        from .config import RankerSettings
        from .ranker import RankerCore

        s = RankerSettings.model_validate(settings)
        self.core = RankerCore(s)
        self.rank.set_max_batch_size(s.max_batch_size)
        self.rank.set_batch_wait_timeout_s(s.batch_wait_timeout_s)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def rank(self, items: list) -> list[dict]:   # RankRequest objects (memsifter.retrieval.ranker)
        return await self.core.rank_many(items)


@serve.deployment(name="FirstStage")
@serve.ingress()
class FirstStageDeployment:
    """The HTTP ingress and the first stage (:class:`memsifter.service.core.RetrievalService`)."""

    def __init__(self, config: dict, ranker: Any = None):
        from .core import RetrievalService
        from .logs import install_redaction

        cfg = ServeConfig.model_validate(config)
        self.service = RetrievalService(cfg, ranker=self._remote(ranker) if ranker is not None else None)
        install_redaction(self.service.secrets)

    @staticmethod
    def _remote(handle: Any):  # noqa: ANN205
        async def call(item: dict) -> dict:
            return await handle.rank.remote(item)
        return call

    def __serve_build_asgi_app__(self):  # noqa: ANN204
        from .http import make_app

        return make_app(self.service)

    def check_health(self) -> None:
        if self.service.state is None:
            raise RuntimeError("no index loaded")

    def __del__(self) -> None:
        svc = getattr(self, "service", None)
        if svc is not None:
            svc.close()


def deployments(cfg: ServeConfig) -> Any:
    """The bound application of ``cfg``."""
    ranker = None
    if cfg.ranker is not None:
        r = cfg.ranker
        ranker = RankerDeployment.options(
            ray_actor_options={"num_cpus": r.num_cpus, "num_gpus": r.num_gpus},
            autoscaling_config={"min_replicas": r.min_replicas, "max_replicas": r.max_replicas,
                                "target_ongoing_requests": r.max_batch_size},
            max_ongoing_requests=4 * r.max_batch_size,
        ).bind(r.model_dump(mode="json"))
    scaling: dict[str, Any] = ({"num_replicas": cfg.min_replicas} if cfg.min_replicas == cfg.max_replicas else
                               {"autoscaling_config": {"min_replicas": cfg.min_replicas,
                                                       "max_replicas": cfg.max_replicas,
                                                       "target_ongoing_requests": cfg.target_ongoing_requests}})
    return FirstStageDeployment.options(
        ray_actor_options={"num_cpus": cfg.num_cpus}, max_ongoing_requests=1024,
        health_check_period_s=10, health_check_timeout_s=60, graceful_shutdown_timeout_s=20, **scaling,
    ).bind(cfg.model_dump(mode="json"), ranker)


def build_app(args: dict) -> Any:
    """Serve application builder (``import_path: memsifter.service.app:build_app``): ``args`` is a
    :class:`~memsifter.service.config.ServeConfig` mapping; a bad one is one line naming the field."""
    return deployments(load_config(dict(args or {}), "serve args"))
