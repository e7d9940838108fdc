"""Environment defaults for the vLLM engines our stages start (rank's Ray Data LLM engines, verl's
rollout servers in train).

Found on a real GPU run (benchmarks/gpu, H100, vllm 0.24.0): vLLM's GPU sampler imports FlashInfer
whenever ``VLLM_USE_FLASHINFER_SAMPLER`` is not ``0``, so an install without the optional
``flashinfer-python`` package (a minimal or air-gapped one) fails at engine start with
``ModuleNotFoundError: No module named 'flashinfer'``. When FlashInfer is not importable we turn
that sampler off (vLLM's PyTorch/Triton top-k/top-p sampler is used instead); a value the user set
is never overridden.

On a small CPU-only machine vLLM (CPU backend, x86) reserves one core for its scheduler process and
binds its compute threads to the rest: on 2 cores that halves the compute. With
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` the same SmolLM2-135M server answered 16 distinct ~900-token
requests in 30.6 s instead of 55.0 s (medians of 3, 1.80x, ``benchmarks/bench_vllm_cpu.py``, 2 cores); the
scheduler is idle most of the time. :func:`cpu_engine_env` sets it on machines of at most 4 cores,
unless the user set it.

vLLM's CPU workers compute with OpenMP threads pinned one a core, and libgomp's threads spin while they wait
for each other. When anything else runs on those cores (the demo's embed stage while the server starts, a
second engine, another job), a spinning thread holds a core its partner needs, and each decode step waits on
the OS scheduler. :func:`cpu_engine_env` sets ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep while they wait)
unless the user set it; ``benchmarks/bench_vllm_cpu.py --compare wait`` measures both, on idle cores and with
busy processes beside the server (its results: ``benchmarks/README.md``).
"""

from __future__ import annotations

import importlib.util
import os


def engine_env() -> dict[str, str]:
    env: dict[str, str] = {}
    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and importlib.util.find_spec("flashinfer") is None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


def cpu_engine_env() -> dict[str, str]:
    """Environment for a vLLM engine on the CPU (see the module docstring)."""
    env = engine_env()
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ and len(os.sched_getaffinity(0)) <= 4:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if "OMP_WAIT_POLICY" not in os.environ:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env
