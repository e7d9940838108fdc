"""Training checkpoints in a store: their layout, shared by the stage that writes them (``train``) and
those that read them (``collect``), and how the train stage writes and restores them.

``<train output>/checkpoints/global_step_<N>/`` holds verl's files for step N (``actor/…``, ``data.pt``);
``_COMPLETE.json`` in a step directory says every rank's shards of that step are in the store, and
``latest_checkpointed_iteration.txt`` at the root names the last complete step (verl's tracker file).

verl saves each step on local disk; :class:`S3CheckpointCallback` (verl's
``trainer.checkpoint_callback_class``) then has every node upload what it wrote
(:func:`upload_local_step`), checks the step is complete (:func:`missing_files`) and only then writes
the marker and the tracker (:func:`mark_complete`). A fresh pod resumes from the newest complete step
(:func:`restore_step`), on the world size that wrote it (:func:`check_resume_world_size`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

from ..errors import ConfigError
from ..store import storage
from .placement import on_every_node

log = logging.getLogger("memsifter.stages.train")   # the train stage's warnings
ENV_CHECKPOINT_URI = "MEMSIFTER_CHECKPOINT_URI"   # where S3CheckpointCallback uploads (the Ray job's env)
# Set by the train stage when a run goes on from a checkpoint of another GPU count (``resize_start``): verl numbers
# its steps from 1 again, the callback uploads step k as global_step_<offset + k>.
ENV_STEP_OFFSET = "MEMSIFTER_STEP_OFFSET"

CHECKPOINTS = "checkpoints"                       # under the train output
COMPLETE_MARKER = "_COMPLETE.json"                # in a step directory, written last
TRACKER = "latest_checkpointed_iteration.txt"     # verl's "last step" file, at the checkpoint root
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_of(name: str) -> int | None:
    """N of a ``global_step_<N>`` directory name, else None."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def complete_steps(ckpt_uri: str) -> list[int]:
    """Steps under a checkpoint root that carry the completion marker, ascending."""
    out = []
    for name in storage.list_dirs(ckpt_uri):
        s = step_of(name)
        if s is not None and storage.exists(storage.join(ckpt_uri, name, COMPLETE_MARKER)):
            out.append(s)
    return sorted(out)


def missing_files(files: dict[str, int]) -> list[str]:
    """What a ``global_step_N`` file listing (relative path -> size) lacks to be a complete checkpoint."""
    missing = []
    cfg = "actor/fsdp_config.json"
    if cfg not in files:
        return [cfg]
    ranks = [re.fullmatch(r"actor/model_world_size_(\d+)_rank_(\d+)\.pt", f) for f in files]
    sizes = {int(m.group(1)) for m in ranks if m}
    if len(sizes) != 1:
        return ["actor/model_world_size_*_rank_*.pt"]
    ws = sizes.pop()
    for kind in ("model", "optim", "extra_state"):
        present = any(f.startswith(f"actor/{kind}_world_size_{ws}_rank_") for f in files)
        if kind == "model" or present:
            missing += [f"actor/{kind}_world_size_{ws}_rank_{r}.pt" for r in range(ws)
                        if f"actor/{kind}_world_size_{ws}_rank_{r}.pt" not in files]
    if "actor/huggingface/config.json" not in files:
        missing.append("actor/huggingface/config.json")
    if "data.pt" not in files:
        missing.append("data.pt")
    return missing


def _sizes(uri: str) -> dict[str, int]:
    fs, root = storage.resolve(uri)
    import pyarrow.fs as pafs

    sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    infos = storage.retrying(lambda: fs.get_file_info(sel), uri)
    return {i.path[len(root):].lstrip("/"): i.size for i in infos if i.type == pafs.FileType.File}


def upload_local_step(local_step_dir: str, step_uri: str) -> list[tuple[str, int]]:
    """Upload the files of one node's ``global_step_N`` directory (skips identical-size objects)."""
    if not os.path.isdir(local_step_dir):
        return []
    remote = _sizes(step_uri)
    done = []
    for root, _, files in os.walk(local_step_dir):
        for f in sorted(files):
            full = os.path.join(root, f)
            rel = os.path.relpath(full, local_step_dir).replace(os.sep, "/")
            size = os.path.getsize(full)
            if remote.get(rel) != size:
                storage.copy_file(full, storage.join(step_uri, rel))
            done.append((rel, size))
    return done


BASE_RECORD = "train_config.json"   # beside the checkpoints: the model the run trains (its LoRA adapters' base)


def record_base(ckpt_uri: str, model: str, init_adapter: str | None = None) -> str:
    """Write ``<ckpt_uri>/train_config.json`` naming the run's base model before training starts, so that
    collect can name the base of a LoRA step of a run that never published (stopped at its deadline)."""
    uri = storage.join(ckpt_uri, BASE_RECORD)
    rec = {"model": model, **({"init_adapter": init_adapter} if init_adapter else {})}
    storage.write_bytes(uri, json.dumps(rec, indent=2).encode())
    return uri


def mark_complete(ckpt_uri: str, step: int) -> dict:
    """Write ``_COMPLETE.json`` for a step whose files are all in S3; raises if some are missing."""
    step_uri = storage.join(ckpt_uri, f"global_step_{step}")
    files = {k: v for k, v in _sizes(step_uri).items() if k != COMPLETE_MARKER}
    missing = missing_files(files)
    if missing:
        raise RuntimeError(f"checkpoint {step_uri} is incomplete: missing {missing[:5]}")
    marker = {"step": step, "files": files, "bytes": sum(files.values()), "completed_at": storage.utcnow()}
    storage.write_bytes(storage.join(step_uri, COMPLETE_MARKER), json.dumps(marker, indent=2).encode())
    storage.write_bytes(storage.join(ckpt_uri, TRACKER), str(step).encode())
    return marker


def checkpoint_world_size(ckpt_uri: str, step: int) -> int | None:
    """How many GPU processes wrote ``global_step_<step>`` (from its ``_COMPLETE.json`` file list)."""
    marker = storage.join(ckpt_uri, f"global_step_{step}", COMPLETE_MARKER)
    try:
        files = json.loads(storage.read_bytes(marker)).get("files") or {}
    except Exception:  # noqa: BLE001 - an unreadable marker: verl finds out
        return None
    sizes = {int(m.group(1)) for f in files if (m := re.fullmatch(r"actor/model_world_size_(\d+)_rank_\d+\.pt", f))}
    return sizes.pop() if len(sizes) == 1 else None


def check_resume_world_size(config: Any, ckpt_uri: str, step: int) -> None:
    """verl 0.9.1 reloads an FSDP checkpoint only on the world size that wrote it (every rank opens
    ``model_world_size_<W>_rank_<r>.pt``; another W dies in a Ray worker with FileNotFoundError after
    minutes of start-up). Refuse before anything starts, in one line, with the ways on."""
    written = checkpoint_world_size(ckpt_uri, step)
    now = config.nnodes * config.n_gpus_per_node
    if written is not None and written != now:
        raise ConfigError(
            f"train: the checkpoint to resume ({storage.join(ckpt_uri, f'global_step_{step}')}) was written by "
            f"{written} GPU processes and this run has nnodes x n_gpus_per_node = {now}; verl resumes an FSDP "
            f"checkpoint only on the same count: run on {written} GPUs, or `memsifter run collect` + `run merge` "
            f"that step and start a new run from the merged model (model: <merged>, another output), or set "
            f"verl.trainer.resume_mode: disable to start over")


def restore_step(ckpt_uri: str, step: int | None, local_root: str) -> int | None:
    """Make ``local_root`` resume from ``step`` (download it, write verl's tracker); None: from scratch."""
    tracker = os.path.join(local_root, TRACKER)
    if step is None:
        if os.path.exists(tracker):
            os.remove(tracker)  # S3 is the source of truth: no complete checkpoint there, start over
        return None
    step_uri = storage.join(ckpt_uri, f"global_step_{step}")
    local = os.path.join(local_root, f"global_step_{step}")
    for rel in storage.list_files(step_uri):
        if rel == COMPLETE_MARKER:
            continue
        dest = os.path.join(local, rel)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        storage.copy_file(storage.join(step_uri, rel), dest)
    os.makedirs(local_root, exist_ok=True)
    with open(tracker, "w") as f:
        f.write(str(step))
    return step


class S3CheckpointCallback:
    """verl ``trainer.checkpoint_callback_class``: upload each saved step from every node, then mark it.

    Duck-typed to ``verl.trainer.ppo.checkpoint_callback.CheckpointCallback`` (constructed with
    ``config=``, called with ``on_save(trainer=, global_step=, checkpoint_dir=, async_save=)`` on the
    trainer's driver after the workers saved). An exception here aborts training, on purpose: a run
    whose checkpoints cannot be stored should not continue silently.
    """

    def __init__(self, config: Any = None):
        self.config = config
        self.uri = os.environ.get(ENV_CHECKPOINT_URI)

    def on_save(self, trainer: Any = None, global_step: int = 0, checkpoint_dir: str = "",
                async_save: bool = False, **kwargs: Any) -> None:
        if not self.uri:
            log.warning("%s is not set: checkpoint %s stays on local disk only", ENV_CHECKPOINT_URI, checkpoint_dir)
            return
        if async_save:
            log.warning("async checkpoint save: step %s is uploaded when the next synchronous save happens",
                        global_step)
            return
        sync_checkpoint(checkpoint_dir, self.uri, int(global_step) + int(os.environ.get(ENV_STEP_OFFSET) or 0))


def sync_checkpoint(local_step_dir: str, ckpt_uri: str, step: int) -> dict:
    """Every node uploads what it wrote for ``step``; then the step is checked and marked complete."""
    step_uri = storage.join(ckpt_uri, f"global_step_{step}")
    t0 = time.time()
    uploaded = on_every_node(upload_local_step, local_step_dir, step_uri)
    marker = mark_complete(ckpt_uri, step)
    log.info("checkpoint step %d: %d files (%.1f MB) from %d node(s) in %.1fs -> %s", step, len(marker["files"]),
             marker["bytes"] / 1e6, sum(1 for u in uploaded if u), time.time() - t0, step_uri)
    return marker
