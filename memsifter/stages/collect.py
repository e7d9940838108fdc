"""Stage ``collect``: verl FSDP checkpoints -> Hugging Face model directories (MEMSIFTER.md §6).

Reads ``global_step_<N>/actor/`` of a training run (the ``train`` output, or directly its
``checkpoints/`` prefix; local or s3://), for the chosen steps (default: every complete one), and
converts each with verl's own merger::

    python -m verl.model_merger merge --backend fsdp --local_dir …/global_step_N/actor --target_dir …

Only what the merger needs is downloaded (``model_world_size_*_rank_*.pt``, ``fsdp_config.json``,
``huggingface/``), not the optimizer state. Steps must be complete (``train`` writes
``_COMPLETE.json`` after all ranks' shards are in S3) unless ``require_complete`` is false.

Output: ``global_step_<N>/`` per step (config, safetensors, tokenizer): the same directory names as
train and merge use. A LoRA run (``train``'s ``verl.actor_rollout_ref.model.lora_rank > 0``) is
exported as the adapter: ``global_step_<N>/adapter/`` (PEFT layout, bf16, ``base_model_name_or_path`` =
the train stage's ``model`` as the user gave it, e.g. ``smollm2-135m-instruct``), which every stage taking a model
accepts (:func:`memsifter.models.registry.resolve` merges it onto its base); the whole weights verl's merger
writes beside it are the untouched base and are dropped, unless ``merged: true`` asks for the base
with the adapter merged in (written as the step's model files). Each converted step is kept under ``<output>/_work/global_step_<N>/`` with a
``_DONE`` marker, so a crashed run converts only the steps it had not finished.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from pydantic import Field

from ..store import storage
from ..training.checkpoints import BASE_RECORD, CHECKPOINTS, COMPLETE_MARKER, complete_steps, step_of
from ..errors import InputError
from ..stage import StageConfig, runtime_field, stage, uri_field

log = logging.getLogger(__name__)
DONE = "_DONE"
NEEDED = re.compile(r"^(model_world_size_\d+_rank_\d+\.pt|fsdp_config\.json|huggingface/.+|lora_train_meta\.json)$")


class CollectConfig(StageConfig):
    checkpoints: str = uri_field("train output (or its checkpoints/ prefix) holding global_step_<N>/actor",
                                 stage="train")
    steps: list[int] = Field(default_factory=list, description="steps to convert (default: every complete step)")
    require_complete: bool = Field(True, description="only steps marked complete by train (_COMPLETE.json)")
    trust_remote_code: bool = False
    merged: bool = Field(False, description="LoRA runs: also write the base with the adapter merged in "
                         "(default: the adapter alone)")
    base_model: str | None = Field(None, description="LoRA runs: the adapter's base as recorded in it "
                                   "(default: the train output's `model`)")
    local_dir: str | None = runtime_field(None, "scratch directory for shards and conversion (default: tmp)")
    in_process: bool = runtime_field(False, "run verl's merger in this process (no interpreter start-up; "
                                     "default: `python -m verl.model_merger` in a subprocess)")


def checkpoint_root(uri: str) -> str:
    """``<uri>/checkpoints`` when it holds steps (a train output), else ``uri`` itself."""
    inner = storage.join(uri, CHECKPOINTS)
    if any(step_of(d) is not None for d in storage.list_dirs(inner)):
        return inner
    return uri


def available_steps(root: str, require_complete: bool) -> list[int]:
    if require_complete:
        return complete_steps(root)
    return sorted(s for s in (step_of(d) for d in storage.list_dirs(root)) if s is not None)


def _merge_in_process(args: list[str]) -> None:
    import argparse

    from verl.model_merger.base_model_merger import generate_config_from_args
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    ns = argparse.Namespace(operation="merge", backend="fsdp", local_dir=args[0], target_dir=args[1],
                            tie_word_embedding=False, trust_remote_code=args[2] == "1", is_value_model=False,
                            use_cpu_initialization=False, hf_upload_path=None, private=False)
    merger = FSDPModelMerger(generate_config_from_args(ns))
    merger.merge_and_save()
    merger.cleanup()


TRAIN_CONFIG = BASE_RECORD   # the train stage's record beside the checkpoints (its ``model``), if present
LORA_META = "lora_train_meta.json"   # verl writes it into the actor checkpoint of a LoRA (PEFT) actor


def train_base_model(uri: str) -> str | None:
    """The ``model`` of the train run whose output (or checkpoints prefix) ``uri`` is, if readable."""
    for cand in (uri, uri.rstrip("/").rsplit("/", 1)[0]):
        try:
            cfg = storage.read_manifest(cand).get("config") or {}
        except Exception:  # noqa: BLE001 - not a published train output
            continue
        if cfg.get("model"):
            return str(cfg["model"])
    return None


def base_model_of(root: str, step: int, given: str | None, train_uri: str | None = None) -> str | None:
    """The base a LoRA step's adapter names: ``given`` (the config's ``base_model``), else the published train
    output's ``model``, else the checkpoint's own record: the train config saved beside the checkpoints
    (``train_config.json``'s ``model``), or an HF adapter config in the step's actor checkpoint. None: no source
    names it (a run stopped before publishing, and nothing saved with its checkpoints)."""
    import json

    if given:
        return given
    if train_uri and (model := train_base_model(train_uri)):
        return model
    actor = storage.join(root, f"global_step_{step}", "actor")
    for uri, key in ((storage.join(root, TRAIN_CONFIG), "model"),
                     (storage.join(actor, "huggingface", "adapter_config.json"), "base_model_name_or_path"),
                     (storage.join(actor, "lora_adapter", "adapter_config.json"), "base_model_name_or_path")):
        if storage.exists(uri):
            try:
                value = json.loads(storage.read_bytes(uri)).get(key)
            except (ValueError, AttributeError) as e:
                raise InputError(f"not a JSON object ({e})", file=uri) from None
            if value:
                return str(value)
    return None


def export_adapter(target: str, base_ref: str | None, merged: bool) -> dict | None:
    """Turn verl's ``lora_adapter/`` beside the (unmerged) base weights into ``adapter/`` (bf16, base
    named); drop the base weights or replace them with the merged model. None: not a LoRA run."""
    src = os.path.join(target, "lora_adapter")
    if not os.path.isdir(src):
        return None
    import json

    import torch
    from safetensors.torch import load_file, save_file

    dest = os.path.join(target, "adapter")
    os.makedirs(dest, exist_ok=True)
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              os.path.join(dest, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["base_model_name_or_path"] = base_ref or cfg.get("base_model_name_or_path")
    if not cfg["base_model_name_or_path"]:   # the registry refuses an adapter that names no base
        raise InputError("a LoRA adapter that names no base model: give base_model", file=target,
                         field="base_model")
    cfg.setdefault("task_type", "CAUSAL_LM")
    with open(os.path.join(dest, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.rmtree(src)
    whole = [f for f in os.listdir(target) if os.path.isfile(os.path.join(target, f))]
    if merged:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, dest).merge_and_unload()
        for f in whole:
            if f.endswith(".safetensors") or f.endswith(".bin") or f.endswith(".index.json"):
                os.remove(os.path.join(target, f))
        model.save_pretrained(target, safe_serialization=True)
    else:
        for f in whole:  # the base's weights and files: the adapter is the result
            os.remove(os.path.join(target, f))
    size = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))
    return {"rank": cfg.get("r"), "alpha": cfg.get("lora_alpha"), "bytes": size, "merged": merged,
            "base": cfg["base_model_name_or_path"]}


def convert_step(actor_uri: str, target_dir: str, scratch: str, trust_remote_code: bool = False,
                 in_process: bool = False) -> list[str]:
    """Download one ``…/actor`` prefix's model shards and run verl's FSDP merger into ``target_dir``."""
    local = os.path.join(scratch, "actor")
    files = [f for f in storage.list_files(actor_uri) if NEEDED.match(f)]
    if "fsdp_config.json" not in files:
        raise InputError("no fsdp_config.json (not a verl FSDP actor checkpoint)", file=actor_uri)
    for rel in files:
        dest = os.path.join(local, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        storage.copy_file(storage.join(actor_uri, rel), dest)
    if in_process:
        _merge_in_process([local, target_dir, "1" if trust_remote_code else "0"])
    else:
        cmd = [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", local,
               "--target_dir", target_dir]
        if trust_remote_code:
            cmd.append("--trust-remote-code")
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-10:])
            raise RuntimeError(f"verl.model_merger failed for {actor_uri}:\n{tail}")
    shutil.rmtree(local, ignore_errors=True)
    out = sorted(os.listdir(target_dir))
    if "config.json" not in out or not any(f.endswith(".safetensors") for f in out):
        raise RuntimeError(f"verl.model_merger wrote no model for {actor_uri} (files: {out})")
    return out


@stage("collect", CollectConfig, family="train",
       help="Convert verl FSDP checkpoints of chosen steps to Hugging Face directories (verl.model_merger)")
def run(config: CollectConfig, out: storage.Publication) -> dict:
    root = checkpoint_root(config.checkpoints)
    avail = available_steps(root, config.require_complete)
    steps = sorted(set(config.steps)) or avail
    if not steps:
        raise InputError(f"no {'complete ' if config.require_complete else ''}checkpoints "
                         f"(global_step_<N>/ with {COMPLETE_MARKER})", file=root)
    missing = [s for s in steps if s not in avail]
    if missing:
        raise InputError(f"steps {missing} are not available ({'complete ' if config.require_complete else ''}"
                         f"steps: {avail or 'none'})", file=root)
    per_step: dict[str, dict] = {}
    for s in steps:
        name = f"global_step_{s}"
        work = storage.join(out.work, name)
        if storage.exists(storage.join(work, DONE)):
            log.info("collect: step %d already converted (%s)", s, work)
        else:
            t0 = time.time()
            base = base_model_of(root, s, config.base_model, config.checkpoints)
            if not base and LORA_META in storage.list_files(storage.join(root, name, "actor")):   # a LoRA actor
                raise InputError(f"a LoRA checkpoint that names no base model (no published train output, no "
                                 f"{TRAIN_CONFIG} beside the checkpoints, no adapter config in the actor): give "
                                 "base_model, the model the run trained", file=storage.join(root, name),
                                 field="base_model")
            scratch = tempfile.mkdtemp(prefix=f"collect-{s}-", dir=config.local_dir)
            try:
                target = os.path.join(scratch, "hf")
                convert_step(storage.join(root, name, "actor"), target, scratch, config.trust_remote_code,
                             config.in_process)
                lora = export_adapter(target, base, config.merged)
                if lora:
                    log.info("collect: step %d is a LoRA adapter (rank %s, %.1f MiB)", s, lora["rank"],
                             lora["bytes"] / 2 ** 20)
                storage.delete(work)
                storage.upload_dir(target, work)
                storage.write_bytes(storage.join(work, DONE), b"ok\n")
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            log.info("collect: step %d converted in %.1fs", s, time.time() - t0)
        files = [f for f in storage.list_files(work) if f != DONE]
        nbytes = 0
        for rel in files:
            out.add_file(f"{name}/{rel}", storage.join(work, rel))  # any URI: copy_file streams it
            nbytes += out.files[f"{name}/{rel}"]["bytes"]
        per_step[name] = {"files": len(files), "bytes": nbytes,
                          "adapter_bytes": sum(out.files[f"{name}/{r}"]["bytes"] for r in files
                                               if r.startswith("adapter/")) or None}
    return {"checkpoint_root": root, "steps": steps, "converted": per_step}
