#!/usr/bin/env python3
"""The train stage on 1 and 2 GPUs of one host (issue 35): FSDP sharding, rollout TP 1 and 2, LoRA and full
fine-tuning, kill and resume from S3, a resume on another GPU count, collect of sharded checkpoints.

    source benchmarks/gpu/install.sh
    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/multigpu.yaml [-- --steps 4]
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/multigpu.yaml --out "$OUT"   # as often as needed

Every step is a ``memsifter`` CLI call, as a user runs it, against a SeaweedFS started here. The model is a
random Qwen3 of SmolLM2-135M's size (hidden 576, 30 layers, MLP 1536, vocabulary 49,152) but with 8 query
and 4 KV heads: SmolLM2-135M itself has 9 and 3, which vLLM cannot split over 2 GPUs (heads must divide by
the tensor parallel size). Speed depends on shape and token counts, not on weight values; a random model
writes no valid ranking, so dynamic sampling is off (as in run_train.py).

Runs (each ``run train`` on a fresh output, the same data and recipe, ``--steps`` steps):
1. ``1gpu-full-tp1``: the baseline, one GPU;
2. ``2gpu-full-tp1``: FSDP over 2 GPUs; killed once its step-2 checkpoint is complete in S3, then run again
   on an empty local dir: it must resume from S3 (step 2) and finish;
3. the same output on 1 GPU: refused in one line (verl resumes only on the world size that wrote it);
4. ``2gpu-lora-tp2``: LoRA, FSDP over 2 GPUs, vLLM rollout with tensor parallel 2;
5. ``run collect`` + ``run merge`` of runs 2 and 4 (checkpoints sharded over 2 ranks); the merged models
   load and generate.
Writes ``multigpu.md`` (per step: step time, generation time, rollout tokens/s; the 2-GPU / 1-GPU ratios),
``multigpu.json`` and the logs into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_train import ROOT, ms, sh, verl_steps, write_yaml  # noqa: E402

sys.path.insert(0, ROOT)

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=8192,
             rope_theta=100000.0, tie_word_embeddings=True)
RUN = "s3://memsifter/mg"


def train_cfg(a, name: str, gpus: int, tp: int, lora: int, total: int) -> str:
    return write_yaml(f"{a.work}/{name}-{gpus}-{total}.yaml", {
        "output": f"{RUN}/{name}", "data": f"{RUN}/rl", "model": f"{a.work}/model",
        "nnodes": 1, "n_gpus_per_node": gpus, "experiment_name": name,
        "reward": {"mode": "dcg"}, "local_dir": f"{a.work}/pods/{name}-{gpus}-{time.time():.0f}",
        "keep_local_checkpoints": 2,
        "verl": {
            "data": {"max_prompt_length": a.prompt, "max_response_length": a.response,
                     "train_batch_size": a.batch, "gen_batch_size": a.batch},
            "algorithm": {"filter_groups": {"enable": False}},
            "actor_rollout_ref": {
                "model": {"lora_rank": lora, **({"lora_alpha": 32} if lora else {})},
                "actor": {"ppo_mini_batch_size": a.batch, "ulysses_sequence_parallel_size": 1,
                          "fsdp_config": {"param_offload": False, "optimizer_offload": False},
                          "optim": {"lr_warmup_steps": 0, **({"lr": 1e-5} if lora else {})}},
                "rollout": {"n": a.n, "tensor_model_parallel_size": tp, "gpu_memory_utilization": 0.4,
                            "enforce_eager": True}},
            "reward": {"reward_kwargs": {"overlong_buffer_cfg": {"len": a.response // 4}}},
            "trainer": {"save_freq": 2, "test_freq": -1, "total_training_steps": total}},
    })


def prepare(a) -> None:
    from memsifter.data.model import read_dataset
    from memsifter.models.tiny import build_random_model

    sh(ms("data", "synth", f"{RUN}/synth", "--questions", "96", "--sessions", "12", "--seed", "0"), f"{a.out}/synth.log")
    ds = read_dataset(f"{RUN}/synth")
    corpus = [t["content"] for s in ds.sessions.values() for t in s.turns] + [q.question for q in ds.questions]
    build_random_model(f"{a.work}/model", SHAPE, corpus=corpus, tokenizer_vocab=4000, dtype="bfloat16")
    cfg = write_yaml(f"{a.work}/prepare_rl.yaml", {
        "output": f"{RUN}/rl", "datasets": [f"{RUN}/synth"], "tokenizer": f"{a.work}/model",
        "recipe": {"train": {"synth": 88}, "test": {"synth": 8}},
        "history_budget_tokens": a.prompt - 512, "max_prompt_tokens": a.prompt, "shard_rows": 2000})
    sh(ms("run", "prepare-rl", "--config", cfg), f"{a.out}/prepare_rl.log")


def kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue


def train_until_checkpoint(a, cfg: str, log: str, ckpt: str, step: int, timeout: float) -> dict:
    """Start ``run train``, kill its whole process group once ``step`` is complete in S3."""
    from memsifter.training.checkpoints import complete_steps

    t = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(ms("run", "train", "--config", cfg), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                             start_new_session=True)
        seen: list[int] = []
        while time.time() - t < timeout and p.poll() is None:
            time.sleep(3)
            try:
                seen = complete_steps(ckpt)
            except Exception:  # noqa: BLE001 - not there yet
                seen = []
            if step in seen:
                break
        killed_at = time.time() - t
        finished = p.poll()
        kill_group(p)
    subprocess.run(["ray", "stop", "--force"], capture_output=True)
    return {"killed_after_s": round(killed_at, 1), "complete_steps_when_killed": seen,
            "exit_before_kill": finished}


def rows(name: str, rc, wall: float, log: str, a) -> list[dict]:
    out = []
    for r in verl_steps(log):
        gen_tok = r.get("response_length/mean", 0) * a.batch * a.n
        out.append({"run": name, "rc": rc, "wall_s": round(wall, 1), "step": r["step"],
                    "step_s": r.get("timing_s/step"), "gen_s": r.get("timing_s/gen"),
                    "update_s": r.get("timing_s/update_actor"), "save_s": r.get("timing_s/save_checkpoint"),
                    "rollout_tok_s": gen_tok / r["timing_s/gen"] if r.get("timing_s/gen") else None,
                    "throughput": r.get("perf/throughput"), "response_len": r.get("response_length/mean")})
    return out


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def report(a, res: dict) -> None:
    steps = res["steps"]
    lines = ["| run | step | step s | gen s | update s | rollout tok/s | verl throughput (tok/s/GPU) |",
             "|---|---|---|---|---|---|---|"]
    for r in steps:
        f = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        lines.append(f"| {r['run']} | {r['step']} | {f(r['step_s'])} | {f(r['gen_s'])} | {f(r['update_s'])} | "
                     f"{f(r['rollout_tok_s'])} | {f(r['throughput'])} |")
    # steady steps only (the first step of a run pays warm-up)
    by = {}
    for r in steps:
        if r["step"] == min(x["step"] for x in steps if x["run"] == r["run"]):
            continue
        by.setdefault(r["run"], []).append(r)
    summary = {k: {"step_s": median([x["step_s"] for x in v]), "rollout_tok_s": median([x["rollout_tok_s"] for x in v])}
               for k, v in by.items()}
    res["summary"] = summary
    base = summary.get("1gpu-full-tp1")
    lines += ["", "median over steps after the first | step s | rollout tok/s | step speed-up vs 1 GPU | rollout vs 1 GPU",
              "|---|---|---|---|---|"]
    for k, v in summary.items():
        sp = (base["step_s"] / v["step_s"]) if base and v["step_s"] and base["step_s"] else None
        rt = (v["rollout_tok_s"] / base["rollout_tok_s"]) if base and v["rollout_tok_s"] and base["rollout_tok_s"] else None
        lines.append(f"| {k} | {v['step_s']} | {v['rollout_tok_s']} | {'-' if sp is None else f'{sp:.2f}x'} | "
                     f"{'-' if rt is None else f'{rt:.2f}x'} |")
    lines += ["", "events:"] + [f"- {e}" for e in res["events"]]
    text = "\n".join(lines)
    with open(f"{a.out}/multigpu.md", "w") as f:
        f.write(text + "\n")
    with open(f"{a.out}/multigpu.json", "w") as f:
        json.dump(res, f, indent=2, default=str)
    print(text, flush=True)


def main_run(a) -> None:
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    from memsifter.store import storage
    from memsifter.testing.servers import seaweedfs

    res: dict = {"steps": [], "events": [], "args": vars(a)}

    def event(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
        res["events"].append(msg)
        report(a, res)

    with seaweedfs(workdir=os.path.join(a.work, "weed")) as s3:
        os.environ.update(s3.env())
        storage.ensure_bucket("s3://memsifter/")
        t = time.time()
        if storage.exists(f"{RUN}/rl/_SUCCESS") and os.path.exists(f"{a.work}/model/config.json"):
            event("data and model of an earlier invocation reused")
        else:
            prepare(a)
            event(f"prepared data and model in {time.time() - t:.0f}s")
        plan = [("1gpu-full-tp1", 1, 1, 0), ("2gpu-full-tp1", 2, 1, 0), ("2gpu-lora-tp2", 2, 2, 16)]
        for name, gpus, tp, lora in plan:
            log = f"{a.out}/{name}.log"
            if a.only and name not in a.only:
                if os.path.exists(log):  # a run of an earlier invocation (same --work): its steps in the table
                    res["steps"] += rows(name, "earlier", 0.0, log, a)
                continue
            if name == "2gpu-full-tp1":
                ckpt = f"{RUN}/{name}/checkpoints"
                k = train_until_checkpoint(a, train_cfg(a, name, gpus, tp, lora, a.steps), log, ckpt, 2, 900)
                res["steps"] += rows(f"{name} (killed)", "killed", k["killed_after_s"], log, a)
                event(f"{name}: killed after {k['killed_after_s']}s with complete steps {k['complete_steps_when_killed']}")
                # the same output on another GPU count: refused before anything starts
                rc, dt = sh(ms("run", "train", "--config", train_cfg(a, name, 1, 1, lora, a.steps)),
                            f"{a.out}/{name}-on-1gpu.log", check=False)
                last = [x for x in open(f"{a.out}/{name}-on-1gpu.log", errors="replace").read().splitlines() if x.strip()]
                event(f"{name} resumed on 1 GPU: exit {rc} in {dt:.1f}s: {last[-1][:400] if last else ''}")
                log = f"{a.out}/{name}-resumed.log"
                # the same world size (2 FSDP ranks) with the rollout over both GPUs: the rollout's tensor
                # parallel size is not part of the checkpoint
                tp = a.resume_tp
                name_run = f"{name} (resumed, rollout TP {tp})"
            else:
                name_run = name
            rc, dt = sh(ms("run", "train", "--config", train_cfg(a, name, gpus, tp, lora, a.steps)), log, check=False)
            man = storage.read_manifest(f"{RUN}/{name}") if rc == 0 else {}
            res["steps"] += rows(name_run, rc, dt, log, a)
            event(f"{name_run}: exit {rc} in {dt:.0f}s; resumed_from {man.get('stats', {}).get('resumed_from')}; "
                  f"complete steps {man.get('stats', {}).get('complete_steps')}")
            subprocess.run(["ray", "stop", "--force"], capture_output=True)
        for name in ("2gpu-full-tp1", "2gpu-lora-tp2"):
            if (a.only and name not in a.only) or a.no_collect:
                continue
            ck = f"{RUN}/{name}/checkpoints"
            if not storage.exists(storage.join(f"{RUN}/{name}", "checkpoints.json")):
                event(f"{name}: no checkpoints to collect")
                continue
            steps = [str(s) for s in storage.read_json(f"{RUN}/{name}/checkpoints.json")["steps"]]
            files = [f for f in storage.list_files(storage.join(ck, f"global_step_{steps[-1]}")) if "world_size" in f]
            rc1, _ = sh(ms("run", "collect", "--checkpoints", f"{RUN}/{name}", "--output", f"{RUN}/{name}-collect"),
                        f"{a.out}/{name}-collect.log", check=False)
            rc2, _ = sh(ms("run", "merge", "--checkpoints", f"{RUN}/{name}-collect", "--steps", steps[-1],
                           "--output", f"{RUN}/{name}-merged"), f"{a.out}/{name}-merge.log", check=False)
            gen = None
            if rc1 == 0 and rc2 == 0:
                import torch
                from transformers import AutoModelForCausalLM

                local = storage.download_dir(f"{RUN}/{name}-merged", f"{a.work}/{name}-merged")
                m = AutoModelForCausalLM.from_pretrained(local, dtype=torch.bfloat16).cuda()
                gen = m.generate(torch.tensor([[5, 6, 7]], device="cuda"), max_new_tokens=4, do_sample=False).tolist()
                del m
            event(f"{name}: checkpoint files of step {steps[-1]}: {sorted(files)[:8]}; collect exit {rc1}, "
                  f"merge exit {rc2}; merged model generates {gen}")
    event("done")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["run"], help="run here (detached: benchmarks/gpu/configs/multigpu.yaml)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-multigpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--resume-tp", type=int, default=2, help="rollout TP of the resumed 2-GPU run")
    ap.add_argument("--no-collect", action="store_true")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    main_run(a)


if __name__ == "__main__":
    main()
