"""Where the train stage's work runs: the Ray nodes and the resources verl asks for.

:func:`wait_for_gpu_nodes` waits until the GPU nodes joined the cluster, :func:`on_every_node` runs a
function once on every alive node (locally without Ray; the staging of inputs and the upload of each
checkpoint use it), and :func:`placement_request` states the placement groups verl's
``ResourcePoolManager`` makes, to check against the chart's worker groups.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("memsifter.stages.train")   # the train stage's warnings


def _ray_connected() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def on_every_node(fn: Any, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` once on every alive Ray node (num_cpus=0: GPU nodes' CPUs are reserved);
    locally when Ray is not initialised. Returns the results."""
    if not _ray_connected():
        return [fn(*args)]
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_retries=2)(fn)
    refs = [remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(*args)
            for n in ray.nodes() if n.get("Alive")]
    return ray.get(refs)


def wait_for_gpu_nodes(nnodes: int, gpus_per_node: int, timeout: float) -> int:
    import ray

    deadline = time.time() + timeout
    while True:
        n = sum(1 for node in ray.nodes()
                if node.get("Alive") and node.get("Resources", {}).get("GPU", 0) >= gpus_per_node)
        if n >= nnodes or time.time() > deadline:
            if n < nnodes:
                log.warning("only %d of %d GPU nodes joined within %.0fs; staging on those", n, nnodes, timeout)
            return n
        time.sleep(5)


def placement_request(config: Any) -> dict:
    """The Ray resources verl asks for, to check against the chart's worker groups.

    verl's ``ResourcePoolManager`` makes one STRICT_PACK placement group per node with
    ``n_gpus_per_node`` bundles of ``{"CPU": 3, "GPU": 1}`` (max_colocate_count = 3); the task runner,
    reward-loop workers and agent-loop workers are plain actors placed on any node with CPUs.
    """
    n, g = config.nnodes, config.n_gpus_per_node
    bundle = {"CPU": 3, "GPU": 1}
    return {
        "nnodes": n, "gpus_per_node": g, "total_gpus": n * g,
        "placement_groups": [{"strategy": "STRICT_PACK", "bundles": [dict(bundle) for _ in range(g)]}
                             for _ in range(n)],
        "per_gpu_node": {"GPU": g, "CPU": 3 * g},
        "cpu_actors": {"task_runner": 1, "reward_loop_workers": 8, "agent_loop_workers": 8},
    }
