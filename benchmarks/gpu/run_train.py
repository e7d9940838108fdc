#!/usr/bin/env python3
"""A real DAPO run of our train stage on one GPU, then resume from S3, collect and merge.

    source benchmarks/gpu/install.sh && python3 benchmarks/gpu/run_train.py --out "$OUT"    # in the foreground, or:
    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/train.yaml [-- --steps 4]
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/train.yaml --out "$OUT"

On a GPU host staged as README.md here says. Every step goes through the ``memsifter`` CLI, as a user
runs it; the object store is a SeaweedFS (``weed mini``) started here:

1. ``data synth`` -> ``run prepare-rl`` (short histories) on S3;
2. a small Qwen3-shaped model with random weights and its tokenizer (built here);
3. ``run train`` (verl 0.9.1 DAPO: FSDP actor, vLLM async rollout, ``reward.mode=dcg``) for
   ``--steps`` optimizer steps with a checkpoint save, uploaded to S3 by our callback;
4. ``run train`` again with more steps on an *empty* local dir: it must resume from S3;
5. ``run collect`` (verl model_merger) and ``run merge`` on those checkpoints; the merged model loads
   and generates.

Writes ``train.md`` (table) and the logs into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=32768,
             rope_theta=1000000.0, tie_word_embeddings=True)


def sh(cmd: list[str], log: str, env: dict | None = None, check: bool = True) -> tuple[int, float]:
    print(f"\n$ {' '.join(cmd)}   (log: {os.path.basename(log)})", flush=True)
    t = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or os.environ.copy(), cwd=ROOT)
    dt = time.time() - t
    tail = open(log, errors="replace").read().splitlines()[-25:]
    print(f"  -> exit {p.returncode} in {dt:.1f}s", flush=True)
    if p.returncode != 0:
        print("\n".join("  | " + line for line in tail), flush=True)
        if check:
            raise SystemExit(f"failed: {' '.join(cmd)}")
    return p.returncode, dt


def ms(*args: str) -> list[str]:
    return [sys.executable, "-m", "memsifter.cli", *args]


def write_yaml(path: str, data: dict) -> str:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def verl_steps(log: str) -> list[dict]:
    """verl's console logger lines 'step:N - key:value - ...' as dicts. A line repeated word for word is one step:
    on a Ray cluster of two raylets the driver's log shows each of verl's step lines twice."""
    rows, seen = [], set()
    for line in open(log, errors="replace"):
        m = re.search(r"step:(\d+) - (.*)$", line)
        if not m or m.group(0) in seen:
            continue
        seen.add(m.group(0))
        row = {"step": int(m.group(1))}
        for kv in m.group(2).split(" - "):
            k, _, v = kv.partition(":")
            try:
                row[k.strip()] = float(v)
            except ValueError:
                pass
        rows.append(row)
    return rows


KEYS = ["critic/score/mean", "critic/rewards/mean", "acc/mean", "response_length/mean", "timing_s/step",
        "timing_s/gen", "timing_s/update_actor", "timing_s/save_checkpoint", "perf/throughput",
        "perf/total_num_tokens", "actor/pg_loss", "actor/grad_norm"]


def write_table(a, rows: list, ckpts: dict) -> str:
    """``train.md``: one line per verl step of each run (rollout tok/s = responses' tokens / timing_s/gen)."""
    lines = ["| run | exit | wall s | step | " + " | ".join(KEYS) + " | rollout tok/s |",
             "|---|---|---|---|" + "---|" * len(KEYS) + "---|"]
    for name, rc, dt, steps_ in rows:
        for r in steps_ or [{"step": "-"}]:
            gen_tok = r.get("response_length/mean", 0) * a.batch * a.n
            tps = f"{gen_tok / r['timing_s/gen']:.0f}" if r.get("timing_s/gen") else "-"
            vals = [f"{r[k]:.4g}" if k in r else "-" for k in KEYS]
            lines.append(f"| {name} | {rc} | {dt:.0f} | {r['step']} | " + " | ".join(vals) + f" | {tps} |")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    with open(f"{a.out}/train.md", "w") as f:
        f.write(text + "\n\ncheckpoints: " + json.dumps(ckpts) + "\n")
    return text


def prepare(a, run: str, model: str) -> None:
    """Synthetic data, a random model with a tokenizer trained on that data, prepare-rl."""
    from memsifter.store import storage
    from memsifter.data.model import read_dataset
    from memsifter.models.tiny import build_random_model

    sh(ms("data", "synth", f"{run}/synth", "--questions", "48", "--sessions", "12", "--seed", "0"),
       f"{a.out}/synth.log")
    # the tokenizer is trained on the data's own text: an untrained one (byte-level pieces) made
    # every history ~4x longer, and prepare-rl skipped 94 of 96 rows as over the prompt budget
    ds = read_dataset(f"{run}/synth")
    corpus = [t_["content"] for s_ in ds.sessions.values() for t_ in s_.turns] + [q.question for q in ds.questions]
    t = time.time()
    build_random_model(model, SMALL, corpus=corpus, tokenizer_vocab=4000, dtype="bfloat16")
    print(f"model {model} in {time.time() - t:.1f}s", flush=True)
    cfg = write_yaml(f"{a.work}/prepare_rl.yaml", {
        "output": f"{run}/rl", "datasets": [f"{run}/synth"], "tokenizer": model,
        "recipe": {"train": {"synth": 40}, "test": {"synth": 8}},
        "history_budget_tokens": a.prompt - 512, "max_prompt_tokens": a.prompt, "shard_rows": 2000})
    sh(ms("run", "prepare-rl", "--config", cfg), f"{a.out}/prepare_rl.log")
    rl = storage.read_manifest(f"{run}/rl")
    print("prepare-rl:", json.dumps(rl.get("stats", {}))[:800], flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-train")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--more-steps", type=int, default=2, help="steps of the resumed run")
    ap.add_argument("--batch", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=3072)
    ap.add_argument("--phase", default="all", choices=["all", "first", "resume", "collect"])
    ap.add_argument("--no-resume", action="store_true", help="with --phase all: skip the resumed run")
    ap.add_argument("--extra", nargs="*", default=[], help="extra verl overrides")
    ap.add_argument("--dry-run", action="store_true", help="compose the verl config only (runs on a CPU machine)")
    ap.add_argument("--table-from", nargs=4, metavar=("LOG", "NAME", "EXIT", "WALL_S"),
                    help="only rebuild train.md from a run's verl log, with the run's name, exit status and "
                         "wall seconds as the driver printed them (when the call was cut off before the table)")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    if a.table_from:
        log, name, rc, wall = a.table_from
        os.makedirs(a.out, exist_ok=True)
        write_table(a, [(name, rc, float(wall), verl_steps(log))], {})
        return
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    from memsifter.store import storage
    from memsifter.testing.servers import seaweedfs

    with seaweedfs(workdir=os.path.join(a.work, "weed")) as s3:
        os.environ.update(s3.env())
        storage.ensure_bucket("s3://memsifter/")
        run = "s3://memsifter/gpu"
        model = os.path.join(a.work, "model")
        # 1-2: data and model; a later phase (resume, collect) reuses the first phase's when it was
        # prepared to the end with the same arguments (the marker is written last)
        marker = os.path.join(a.work, "prepared.json")
        want = {"prompt": a.prompt, "model": SMALL}
        have = (os.path.exists(marker) and json.load(open(marker)) == want
                and storage.exists(storage.join(f"{run}/rl", storage.MANIFEST)))
        if a.phase in ("all", "first") or not have:
            if os.path.exists(marker):
                os.remove(marker)
            # a fresh model: checkpoints of an earlier run in the kept SeaweedFS dir would be resumed
            for stale in ("rl", "train", "collect", "merged"):
                storage.delete(f"{run}/{stale}")
            prepare(a, run, model)
            with open(marker, "w") as f:
                json.dump(want, f)

        def train_cfg(total: int, local: str) -> str:
            return write_yaml(f"{a.work}/train_{total}.yaml", {
                "output": f"{run}/train", "data": f"{run}/rl", "model": model,
                "nnodes": 1, "n_gpus_per_node": 1, "experiment_name": "gpu-proof",
                "reward": {"mode": "dcg"}, "local_dir": local, "keep_local_checkpoints": 2,
                "verl": {  # verl's names, over the platform's DAPO recipe
                    "data": {"max_prompt_length": a.prompt, "max_response_length": a.response,
                             "train_batch_size": a.batch, "gen_batch_size": a.batch},
                    # a random model never writes a valid ranking: every group would be
                    # filtered as zero-variance and the run would only generate
                    "algorithm": {"filter_groups": {"enable": False}},
                    "actor_rollout_ref": {
                        "actor": {"ppo_mini_batch_size": a.batch, "ulysses_sequence_parallel_size": 1,
                                  "fsdp_config": {"param_offload": False, "optimizer_offload": False},
                                  "optim": {"lr_warmup_steps": 0}},
                        "rollout": {"n": a.n, "tensor_model_parallel_size": 1, "gpu_memory_utilization": 0.4}},
                    "reward": {"reward_kwargs": {"overlong_buffer_cfg": {"len": a.response // 4}}},
                    "trainer": {"save_freq": a.steps, "test_freq": -1, "total_training_steps": total}},
                "extra_overrides": list(a.extra),
            })

        rows = []
        if a.dry_run:
            sh(ms("run", "train", "--config", train_cfg(a.steps, f"{a.work}/pod1"), "--dry-run"), f"{a.out}/dry.log")
            print(open(f"{a.out}/dry.log").read()[-1500:])
            return
        if a.phase in ("all", "first"):
            # 3: first run, fresh
            shutil.rmtree(f"{a.work}/pod1", ignore_errors=True)
            rc, dt1 = sh(ms("run", "train", "--config", train_cfg(a.steps, f"{a.work}/pod1")), f"{a.out}/train1.log",
                         check=False)
            rows.append(("train (fresh)", rc, dt1, verl_steps(f"{a.out}/train1.log")))
            if rc != 0:
                raise SystemExit("train run 1 failed")
        if a.phase == "resume" or (a.phase == "all" and not a.no_resume):
            # 4: resume from S3 on an empty local dir
            shutil.rmtree(f"{a.work}/pod2", ignore_errors=True)
            rc, dt2 = sh(ms("run", "train", "--config", train_cfg(a.steps + a.more_steps, f"{a.work}/pod2")),
                         f"{a.out}/train2.log", check=False)
            rows.append(("train (resumed)", rc, dt2, verl_steps(f"{a.out}/train2.log")))
        ckpts = storage.read_json(f"{run}/train/checkpoints.json") if storage.exists(f"{run}/train/checkpoints.json") else {}
        print("checkpoints in S3:", ckpts, flush=True)
        steps = [str(s) for s in ckpts.get("steps", [])]
        if a.phase in ("all", "collect") and steps:
            sh(ms("run", "collect", "--checkpoints", f"{run}/train", "--output", f"{run}/collect"), f"{a.out}/collect.log")
            sh(ms("run", "merge", "--checkpoints", f"{run}/collect", "--steps", *steps, "--output", f"{run}/merged"),
               f"{a.out}/merge.log")
            local = storage.download_dir(f"{run}/merged", f"{a.work}/merged")
            import torch
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(local, dtype=torch.bfloat16).cuda()
            g = m.generate(torch.tensor([[5, 6, 7]], device="cuda"), max_new_tokens=4, do_sample=False)
            print(f"merged model of steps {steps} loads and generates: {g.tolist()}", flush=True)
        write_table(a, rows, ckpts)


if __name__ == "__main__":
    main()
