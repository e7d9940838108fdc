"""``memsifter k8s await-capacity``: ask the Ray autoscaler for GPU nodes, wait, then run a command.

A training RayJob starts with only its head pod (GPU worker group: ``minReplicas: 0``). The KubeRay
autoscaler adds worker pods only for *pending demand*, and verl checks that every GPU it wants is
already in the cluster before it creates its placement groups. This command, run as the RayJob's
entrypoint before the stage, records the demand with ``ray.autoscaler.sdk.request_resources`` (one
bundle per node: ``gpus_per_node`` GPUs and ``cpus_per_gpu`` CPUs each, the shape of verl's STRICT_PACK
placement groups), waits until ``nodes`` such nodes are alive, and then ``exec``s the command. The
request stays in force, so the autoscaler does not scale the nodes down while the stage stages data
between its own resource requests; the cluster is deleted with the RayJob.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Sequence

log = logging.getLogger(__name__)


def node_bundles(nodes: int, gpus_per_node: int, cpus_per_gpu: float) -> list[dict]:
    return [{"GPU": float(gpus_per_node), "CPU": float(cpus_per_gpu * gpus_per_node)} for _ in range(nodes)]


def gpu_nodes(gpus_per_node: int, cpus: float) -> int:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")
               and n.get("Resources", {}).get("GPU", 0) >= gpus_per_node
               and n.get("Resources", {}).get("CPU", 0) >= cpus)


def await_capacity(nodes: int, gpus_per_node: int, cpus_per_gpu: float = 3.0, timeout: float = 1800,
                   poll: float = 5.0, address: str | None = None) -> int:
    """Request the nodes and wait for them; returns how many are there. Raises TimeoutError."""
    import ray
    from ray.autoscaler.sdk import request_resources

    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    try:
        bundles = node_bundles(nodes, gpus_per_node, cpus_per_gpu)
        request_resources(bundles=bundles)
        log.info("requested %d node(s) of %d GPU(s) and %.0f CPU(s) from the autoscaler", nodes, gpus_per_node,
                 cpus_per_gpu * gpus_per_node)
        deadline = time.time() + timeout
        have = -1
        while True:
            n = gpu_nodes(gpus_per_node, cpus_per_gpu * gpus_per_node)
            if n != have:
                log.info("%d of %d GPU node(s) alive", n, nodes)
                have = n
            if n >= nodes:
                return n
            if time.time() > deadline:
                raise TimeoutError(
                    f"only {n} of {nodes} GPU node(s) with {gpus_per_node} GPUs joined within {timeout:.0f}s: "
                    f"check the GPU node pool (nodeSelector/tolerations in the chart's gpuPool), GPU quota, and "
                    f"the autoscaler's log (kubectl logs <head pod> -c autoscaler)")
            time.sleep(poll)
    finally:
        if connected_here:
            ray.shutdown()


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="memsifter k8s await-capacity",
                                description="Request GPU nodes from the Ray autoscaler, wait for them, then exec "
                                            "the command after --")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--cpus-per-gpu", type=float, default=3.0,
                   help="CPUs per GPU in each node bundle (verl: max_colocate_count = 3)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--poll", type=float, default=5.0)
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nodes > 0:
        try:
            await_capacity(args.nodes, args.gpus_per_node, args.cpus_per_gpu, args.timeout, args.poll,
                           args.address)
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if not cmd:
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
    return 0  # not reached
