"""Environment defaults for the vLLM engines our stages start (rank's Ray Data LLM engines, verl's
rollout servers in train).

Found on a real GPU run (benchmarks/gpu, H100, vllm 0.24.0): vLLM's GPU sampler imports FlashInfer
whenever ``VLLM_USE_FLASHINFER_SAMPLER`` is not ``0``, so an install without the optional
``flashinfer-python`` package (a minimal or air-gapped one) fails at engine start with
``ModuleNotFoundError: No module named 'flashinfer'``. When FlashInfer is not importable we turn
that sampler off (vLLM's PyTorch/Triton top-k/top-p sampler is used instead); a value the user set
is never overridden.
"""

from __future__ import annotations

import importlib.util
import os


def engine_env() -> dict[str, str]:
    env: dict[str, str] = {}
    if "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and importlib.util.find_spec("flashinfer") is None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env
