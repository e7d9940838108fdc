"""Small real runs of the CPU stages, shared by the fault and kill tests (tests/test_faults.py,
tests/test_kill.py): import (shipped LoCoMo sample), synth, evaluate, prepare-rl, merge.

``setup_inputs(root, local_tmp, tokenizer)`` puts every input under ``root`` and returns the stage
configs, in the order they run; ``output_hashes(manifest)`` is what must be identical across runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from memsifter.retrieval import rankings
from memsifter.store import storage
from memsifter.data.model import read_dataset

SAMPLES = Path(__file__).resolve().parents[1] / "memsifter" / "samples"
STAGE_NAMES = ("import", "synth", "evaluate", "prepare-rl", "merge")


def tiny_model(path: str, seed: int) -> None:
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(*s, generator=g).to(torch.bfloat16)
               for n, s in {"model.embed.weight": (32, 8), "model.layers.0.w": (8, 8), "lm_head.weight": (32, 8)}.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["TinyForCausalLM"], "hidden_size": 8, "torch_dtype": "bfloat16"}, f)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"version": "t", "vocab": {"a": 0}}, f)


def setup_inputs(root: str, local_tmp: str, tokenizer: str) -> list[tuple[str, dict]]:
    """Upload raw inputs under ``root``; the (stage, config) list of the chain."""
    src = storage.join(root, "raw", "locomo_dev2.json.gz")
    storage.copy_file(str(SAMPLES / "locomo_dev2.json.gz"), src)
    models = []
    for i in range(2):
        local = os.path.join(local_tmp, f"m{i}")
        tiny_model(local, i)
        models.append(storage.join(root, "models", f"m{i}"))
        storage.upload_dir(local, models[-1])
    synth = storage.join(root, "synth")
    return [
        ("import", {"format": "locomo", "source": src, "output": storage.join(root, "import"), "limit": 12}),
        ("synth", {"output": synth, "questions": 8, "sessions_per_question": 8, "seed": 3}),
        ("evaluate", {"output": storage.join(root, "evaluate"), "input": synth,
                      "rankings": [storage.join(root, "rk", "reverse.parquet")], "curve_max_k": 5}),
        ("prepare-rl", {"output": storage.join(root, "rl"), "datasets": [synth], "tokenizer": tokenizer,
                        "shard_rows": 2, "seed": 7, "recipe": {"train": {"synth": 5}, "test": {"synth": 2}}}),
        ("merge", {"output": storage.join(root, "merged"), "inputs": models, "dtype": "float32"}),
    ]


def before_stage(name: str, cfg: dict) -> None:
    """Inputs a stage needs that come from an earlier one (the rankings evaluate scores)."""
    if name == "evaluate":
        ds = read_dataset(cfg["input"])
        rows = [{"question_id": q.question_id, "ranked_session_ids": list(reversed(q.haystack_session_ids)),
                 "scores": None, "method": "reverse", "status": "ok", "reason": None, "raw_response": None}
                for q in ds.questions]
        storage.write_bytes(cfg["rankings"][0], storage.parquet_bytes(rankings.rankings_table(rows)))


def output_hashes(manifest: dict) -> dict[str, str]:
    return {name: meta["sha256"] for name, meta in manifest["files"].items()}


def stored_hashes(uri: str) -> dict[str, str]:
    """sha256 of every file of a published output, read back from the store (not the manifest)."""
    m = storage.read_manifest(uri)
    return {name: storage.sha256_bytes(storage.read_bytes(storage.join(uri, name))) for name in m["files"]}
