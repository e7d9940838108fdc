"""collect: real verl FSDP checkpoints (FSDP2, gloo, world size 2, CPU) -> Hugging Face via verl.model_merger."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from memsifter.store import storage
from memsifter.errors import InputError
from memsifter.stage import get_stage
from memsifter.stages.train import COMPLETE_MARKER, TRACKER, sync_checkpoint

STEPS = (2, 4)

# Run under torchrun: shard the tiny model with FSDP2 over a 2-process gloo mesh named like verl's
# ("fsdp"), and save it with verl's own FSDPCheckpointManager into verl's layout
# (<root>/global_step_N/actor/…, data.pt, latest_checkpointed_iteration.txt), as the trainer does.
FSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    model_dir, root, steps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=None,
                                processing_class=AutoTokenizer.from_pretrained(model_dir),
                                checkpoint_config={"save_contents": ["model", "optimizer", "extra"],
                                                   "load_contents": ["model", "optimizer", "extra"]})
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.0 + 0.01 * step)  # "training": each step scales every weight
        step_dir = os.path.join(root, f"global_step_{step}")
        mgr.save_checkpoint(os.path.join(step_dir, "actor"), global_step=step)
        if rank == 0:
            torch.save({"dataloader": step}, os.path.join(step_dir, "data.pt"))
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(step))
        dist.barrier()
    dist.destroy_process_group()
""")


def make_fsdp_checkpoints(model_dir: str, root: str, steps=STEPS) -> str:
    """Write real FSDP checkpoints of the tiny model for ``steps`` (once per directory)."""
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(root, ".done")):
            return root
        script = os.path.join(root, "make_fsdp.py")
        with open(script, "w") as f:
            f.write(FSDP_SCRIPT)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", str(_free_port()), script, model_dir, root,
                            ",".join(map(str, steps))], capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        open(os.path.join(root, ".done"), "w").close()
    return root


def _free_port() -> int:
    from memsifter.testing.servers import free_port

    return free_port()


def expected_weights(model_dir: str, step: int, steps=STEPS) -> dict[str, torch.Tensor]:
    """The tiny model's weights after the scalings up to ``step``, as the merger writes them (bf16)."""
    base = load_file(os.path.join(model_dir, "model.safetensors"))
    factor = 1.0
    for s in steps:
        if s <= step:
            factor *= 1.0 + 0.01 * s
    return {k: (v.float() * factor).to(torch.bfloat16) for k, v in base.items()}


@pytest.fixture(scope="session")
def fsdp_root(tiny_model_dir, tmp_path_factory):
    return make_fsdp_checkpoints(tiny_model_dir, str(tmp_path_factory.getbasetemp() / "fsdp-ckpt"))


def test_fsdp_checkpoint_has_verls_layout(fsdp_root):
    actor = os.path.join(fsdp_root, "global_step_2", "actor")
    names = set(os.listdir(actor))
    assert {"model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt", "optim_world_size_2_rank_0.pt",
            "extra_state_world_size_2_rank_1.pt", "fsdp_config.json", "huggingface"} <= names
    assert json.load(open(os.path.join(actor, "fsdp_config.json")))["world_size"] == 2
    shard = torch.load(os.path.join(actor, "model_world_size_2_rank_0.pt"), weights_only=False)
    assert type(next(iter(shard.values()))).__name__ == "DTensor"  # really sharded
    assert open(os.path.join(fsdp_root, TRACKER)).read() == "4"


def test_collect_converts_chosen_steps_from_s3(s3_env, s3_root, fsdp_root, tiny_model_dir):
    train_out = storage.join(s3_root, "train")
    ckpt = storage.join(train_out, "checkpoints")
    for s in STEPS:  # what the train stage's checkpoint callback does after each save
        sync_checkpoint(os.path.join(fsdp_root, f"global_step_{s}"), ckpt, s)
    assert storage.exists(storage.join(ckpt, "global_step_4", COMPLETE_MARKER))
    out = storage.join(s3_root, "collect")
    m = get_stage("collect").run({"output": out, "checkpoints": train_out, "steps": [4]})
    assert m["stats"]["steps"] == [4]
    files = set(m["files"])
    assert {"global_step_4/config.json", "global_step_4/model.safetensors", "global_step_4/tokenizer.json"} <= files
    assert not any("optim" in f or f.startswith("global_step_2") for f in files)
    local = storage.download_dir(storage.join(out, "global_step_4"), str(os.path.join(fsdp_root, "..", "dl4")))
    got = load_file(os.path.join(local, "model.safetensors"))
    exp = expected_weights(tiny_model_dir, 4)
    assert set(got) == set(exp)
    for k in exp:
        torch.testing.assert_close(got[k].float(), exp[k].float(), rtol=1e-2, atol=1e-3)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(local)  # a loadable Hugging Face model


def test_collect_refuses_incomplete_and_unknown_steps(tmp_path, fsdp_root):
    from memsifter.stages.collect import available_steps

    # fsdp_root is a local run without the S3 sync: no step carries the completion marker
    with pytest.raises(InputError, match=r"no complete checkpoints"):
        get_stage("collect").run({"output": str(tmp_path / "c"), "checkpoints": fsdp_root})
    with pytest.raises(InputError, match=r"steps \[7\] are not available \(steps: \[2, 4\]\)"):
        get_stage("collect").run({"output": str(tmp_path / "c"), "checkpoints": fsdp_root, "steps": [7],
                                  "require_complete": False})
    assert available_steps(fsdp_root, require_complete=False) == [2, 4]
    assert not os.path.exists(tmp_path / "c" / "_SUCCESS")


def lora_step(src_root: str, dest_root: str, step: int = 4) -> str:
    """A copy of ``src_root``'s step as a stopped LoRA run leaves it: verl's ``lora_train_meta.json`` in the actor
    checkpoint (verl writes it for a PEFT actor), the completion marker, and no published train output above."""
    import shutil

    from memsifter.training.checkpoints import mark_complete

    shutil.copytree(os.path.join(src_root, f"global_step_{step}"), os.path.join(dest_root, f"global_step_{step}"))
    with open(os.path.join(dest_root, f"global_step_{step}", "actor", "lora_train_meta.json"), "w") as f:
        json.dump({"r": 16, "lora_alpha": 32, "task_type": "CAUSAL_LM"}, f)
    mark_complete(dest_root, step)
    return dest_root


def test_collect_refuses_a_lora_checkpoint_whose_base_nothing_names(tmp_path, fsdp_root, capsys):
    """A GRPO run stopped at its deadline publishes no train output, so no manifest names its model: collect
    exported its adapter with ``base_model_name_or_path: null`` (2026-11-27), which the registry refuses. Now it
    refuses in one line before converting anything (exit 2 from the CLI), and says how to name the base."""
    from memsifter.cli import main

    root = lora_step(fsdp_root, str(tmp_path / "train" / "checkpoints"))
    out = tmp_path / "collect"
    with pytest.raises(InputError, match=r"global_step_4.*field 'base_model'.*names no base model"):
        get_stage("collect").run({"output": str(out), "checkpoints": str(tmp_path / "train")})
    assert not (out / "_SUCCESS").exists() and not (out / "_work" / "global_step_4").exists()
    capsys.readouterr()
    assert main(["run", "collect", "--checkpoints", root, "--output", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if " INFO " not in ln]   # the lease's log line
    assert len(err) == 1 and "names no base model" in err[0], err


def test_collect_takes_the_base_from_the_checkpoints_own_record(tmp_path, fsdp_root):
    """Where no train manifest names the model, the checkpoint's own record does: the train config saved beside
    the checkpoints (its ``model``), else an HF adapter config in the step's actor checkpoint; the config's
    ``base_model`` comes first, the published train output's ``model`` next."""
    from memsifter.stages.collect import TRAIN_CONFIG, base_model_of

    root = lora_step(fsdp_root, str(tmp_path / "ckpt"))
    assert base_model_of(root, 4, None) is None
    hf = os.path.join(root, "global_step_4", "actor", "huggingface", "adapter_config.json")
    with open(hf, "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": "smollm2-135m-instruct"}, f)
    assert base_model_of(root, 4, None) == "smollm2-135m-instruct"
    with open(os.path.join(root, TRAIN_CONFIG), "w") as f:
        json.dump({"model": "/models/base", "output": "s3://x/train"}, f)
    assert base_model_of(root, 4, None) == "/models/base"
    assert base_model_of(root, 4, "given") == "given"
