#!/usr/bin/env python3
"""The DAPO recipe at a real model's shape (issue 43 item 1): the train stage, run with a committed example
config per prompt length, on a randomly initialised model of Qwen3-4B's exact architecture.

    source benchmarks/gpu/install.sh
    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/dapo_4b.yaml    # the committed run config
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/dapo_4b.yaml --out "$OUT" --max-s 540  # again
    # afterwards, anywhere: python3 benchmarks/gpu/dapo_4b_table.py RESULTS_DIR

What runs on the host, every step a ``memsifter`` CLI call against a SeaweedFS started here:

1. the bf16 matmul peak (8192^3) of this GPU, which the table's MFU divides by;
2. ``run synth``: long synthetic histories; a random Qwen3-4B-shaped model (``memsifter.models.tiny.QWEN3_4B``:
   hidden 2560, 36 layers, 32/8 heads of 128, intermediate 9728, vocab 151,936, tied embeddings) with a
   tokenizer trained on that text;
3. per config: ``run prepare-rl`` with the config's prompt budget, then ``memsifter run train --config FILE``
   with only the run's own locations set on the command line (``--set output=... data=... model=...
   local_dir=...``), the step count, and dynamic sampling off (``--no-dynamic-sampling``, default on: a random
   model scores every sample alike, so every group would be discarded and no update would run);
4. the verl step lines of each run -> ``steps.jsonl``; the run's facts (device, peak, wall time, exit, peak
   GPU memory of the whole device by nvidia-smi) -> ``runs.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_train import ROOT, ms, sh, verl_steps, write_yaml  # noqa: E402

sys.path.insert(0, ROOT)

RUN = "s3://memsifter/dapo4b"


def config_facts(path: str) -> dict:
    """What the table needs from an example config: prompt/response budgets, prompts per step, samples each."""
    import yaml

    cfg = yaml.safe_load(open(path))
    v = cfg.get("verl", {})
    d, ar = v.get("data", {}), v.get("actor_rollout_ref", {})
    return {"config": os.path.relpath(os.path.abspath(path), ROOT), "prompt": d["max_prompt_length"],
            "response": d["max_response_length"], "batch": d["train_batch_size"], "n": ar["rollout"]["n"],
            "gpus": cfg.get("nnodes", 1) * cfg.get("n_gpus_per_node", 1), "nodes": cfg.get("nnodes", 1)}


def rl_recipe(prompt: int, rows: int) -> dict:
    """prepare-rl's recipe for a prompt budget's data: ``rows`` train rows and the test rows beside them.

    The synthetic haystacks share their filler sessions (synth draws them from 333 distinct texts), and prepare-rl's
    split lets the split asking for the fewest questions choose first and cuts the texts it shows out of the other
    splits' haystacks. With 2 test rows chosen first a train question kept ~33 sessions, ~7k prompt tokens: the 8k
    runs' 6.5k-token prompts, and a 64k config would get the same. Past 8k the test split asks for as many rows as
    train, so train (listed first) chooses first and keeps its whole haystack (800 sessions, ~160k tokens: 64k
    prompts of 64.8-65.0k tokens); the 8k data and the 32k data of one step (2 rows, so train chose first already)
    stay as they were."""
    return {"train": {"synth": rows}, "test": {"synth": max(2, rows) if prompt > 8192 else 2}}


def random_4b(model: str, corpus: list[str]) -> str:
    """The random Qwen3-4B-shaped model (``memsifter.models.tiny.QWEN3_4B``, bf16) with a tokenizer trained on
    ``corpus`` in ``model``, built once, in a child: the CUDA memory it takes must be free before verl (or a
    vLLM engine: ``run_serve_ranked.py``) starts."""
    from memsifter.models.tiny import QWEN3_4B, build_random_model
    from run_rank import spawn

    if not os.path.exists(os.path.join(model, "config.json")):
        if spawn(build_random_model, (model, QWEN3_4B, corpus, 32000, "bfloat16", "cuda")) != 0:
            raise SystemExit("building the model failed")
    return model


def prepare(a) -> tuple[str, dict]:
    """Synthetic data (one dataset for every prompt length) and the random model with its tokenizer."""
    from memsifter.data.model import read_dataset
    from memsifter.store import storage
    from run_rank import peak_child, spawn

    model = os.path.join(a.work, "qwen3-4b-shape")
    if not storage.exists(f"{RUN}/synth/_SUCCESS"):
        sh(ms("run", "synth", "--output", f"{RUN}/synth", "--set", f"questions={a.questions}",
              "--set", f"sessions_per_question={a.sessions}", "--set", "turns_per_session=6", "--set", "seed=0"),
           f"{a.out}/synth.log")
    t = time.time()
    if not os.path.exists(os.path.join(model, "config.json")):
        ds = read_dataset(f"{RUN}/synth")
        random_4b(model, [t_["content"] for s in list(ds.sessions.values())[:3000] for t_ in s.turns])
    print(f"model ready in {time.time() - t:.1f}s", flush=True)
    peak_path = os.path.join(a.work, "peak.json")
    if not os.path.exists(peak_path):
        spawn(peak_child, (peak_path,), timeout=120)
    pk = json.load(open(peak_path)) if os.path.exists(peak_path) else {"peak": None, "device": "?"}
    print(f"matmul peak {pk['peak'] and pk['peak'] / 1e12:.1f} TFLOP/s on {pk['device']}", flush=True)
    return model, pk


def run_tag(facts: dict) -> str:
    """A run's name: its prompt budget (``8k``), and its GPU count when more than one (``8k-2gpu``)."""
    tag = f"{facts['prompt'] // 1024}k"
    nodes = facts.get("nodes", 1)
    if nodes > 1:  # 8k-2x2gpu: 2 nodes of 2 GPUs
        return f"{tag}-{nodes}x{facts['gpus'] // nodes}gpu"
    return tag if facts["gpus"] == 1 else f"{tag}-{facts['gpus']}gpu"


def train_args(a, tag: str, model: str, run: str | None = None) -> list[str]:
    """What the driver sets on ``memsifter run train --config FILE``: the run's own locations (``run``, default
    ``tag``: the data of prompt budget ``tag``), its length, no checkpoint, ``--set`` extras; dynamic sampling
    off unless ``--dynamic-sampling``."""
    run = run or tag
    sets = [f"output={RUN}/train-{run}", f"data={RUN}/rl-{tag}", f"model={model}", f"local_dir={a.work}/pod-{run}",
            f"verl.trainer.total_training_steps={a.steps}", "verl.trainer.save_freq=-1", *a.set]
    if not a.dynamic_sampling:
        sets.append("verl.algorithm.filter_groups.enable=false")
    return [x for s in sets for x in ("--set", s)]


def own_gpus(gpus: int, visible: str | None = None) -> str | None:
    """The GPUs a config of ``gpus`` GPUs runs on: the first ``gpus`` of ``CUDA_VISIBLE_DEVICES`` (the driver's
    own), so that the GPUs a smaller config leaves free can take another run and its memory peaks are its own;
    unchanged (None: unset) where it names no more than that."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [x.strip() for x in (visible or "").split(",") if x.strip()]
    return ",".join(ids[:gpus]) if ids else None


def ray_node_commands(ids: list[str], nodes: int, port: int, cpus_per_gpu: int = 8) -> list[tuple[dict, list[str]]]:
    """``ray start`` of each node of a Ray cluster of ``nodes`` raylets on this host, as KubeRay's head pod and
    worker pods run it: (env, argv), the head first; the GPUs ``ids`` split evenly, each raylet seeing only its
    own (``CUDA_VISIBLE_DEVICES``: Ray numbers a node's GPUs from it). Ray's folders follow ``RAY_TMPDIR``."""
    if nodes < 1 or len(ids) % nodes:
        raise ValueError(f"{len(ids)} GPU(s) do not split over {nodes} node(s)")
    per = len(ids) // nodes
    common = ["--num-gpus", str(per), "--num-cpus", str(cpus_per_gpu * per), "--node-ip-address", "127.0.0.1",
              "--disable-usage-stats"]
    out = []
    for i in range(nodes):
        # a raylet joining a head is refused where RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is 0 (set by the tests'
        # servers, memsifter.testing.servers.RAY_ENV); Linux's default is 1
        env = {"CUDA_VISIBLE_DEVICES": ",".join(ids[i * per:(i + 1) * per]), "RAY_AUTH_MODE": "disabled",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        where = (["--head", "--port", str(port), "--include-dashboard", "false"] if i == 0
                 else ["--address", f"127.0.0.1:{port}"])
        out.append((env, ["ray", "start", *where, *common]))
    return out


def start_ray_nodes(ids: list[str], nodes: int) -> str:
    """Start the raylets of :func:`ray_node_commands` one after another; returns the cluster's address."""
    from memsifter.testing.servers import free_port

    port = free_port()
    for env, argv in ray_node_commands(ids, nodes, port):
        print(f"$ CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {' '.join(argv)}", flush=True)
        p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
        if p.returncode:
            raise RuntimeError(f"{' '.join(argv[:3])} failed (exit {p.returncode}): "
                               + " | ".join((p.stderr or p.stdout).strip().splitlines()[-5:]))
    return f"127.0.0.1:{port}"


def train_command(path: str, sets: list[str], f: dict, keep_output: bool) -> list[str]:
    """The train stage's command line; on a config of several nodes, behind the entrypoint a RayJob runs it with
    (``memsifter k8s await-capacity --nodes N --gpus-per-node G -- ...``: it waits for the nodes, then execs)."""
    cmd = ms("run", "train", "--config", path, *sets, *(["--replace"] if keep_output else []))
    if f.get("nodes", 1) > 1:
        per = f["gpus"] // f["nodes"]
        cmd = ms("k8s", "await-capacity", "--nodes", str(f["nodes"]), "--gpus-per-node", str(per), "--timeout",
                 "600", "--", *cmd)
    return cmd


def one(a, path: str, model: str, pk: dict) -> None:
    from memsifter.store import storage
    from run_rank import GpuMem

    f = config_facts(path)
    tag, name = f"{f['prompt'] // 1024}k", run_tag(f)
    rl, out = f"{RUN}/rl-{tag}", f"{RUN}/train-{a.output_tag or name}"
    if not storage.exists(f"{rl}/_SUCCESS"):
        rows = f["batch"] * a.max_steps
        cfg = write_yaml(f"{a.work}/prepare_rl_{tag}.yaml", {
            "output": rl, "datasets": [f"{RUN}/synth"], "tokenizer": model,
            "recipe": rl_recipe(f["prompt"], rows),
            "history_budget_tokens": f["prompt"] - 1024, "max_prompt_tokens": f["prompt"], "shard_rows": 2000})
        sh(ms("run", "prepare-rl", "--config", cfg), f"{a.out}/prepare_rl_{tag}.log")
    stats = storage.read_manifest(rl).get("stats", {})
    sets = train_args(a, tag, model, a.output_tag or name)
    shutil.rmtree(f"{a.work}/pod-{a.output_tag or name}", ignore_errors=True)
    if not a.keep_output:
        storage.delete(out)
    log = f"{a.out}/train-{name}.log"
    gpus = own_gpus(f["gpus"])
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {})}
    print(f"{name}: GPUs {gpus or 'all'}", flush=True)
    if f.get("nodes", 1) > 1:  # a Ray cluster of several raylets here (KubeRay's pods), the stage joins it
        env["RAY_ADDRESS"] = start_ray_nodes((gpus or ",".join(map(str, range(f["gpus"])))).split(","), f["nodes"])
    with GpuMem(visible=gpus) as mem:
        # --keep-output: this config goes on from the output's checkpoints even where an earlier config finished
        # and published it (--replace keeps the checkpoints; without it a published output of another config is
        # refused in one line)
        rc, dt = sh(train_command(path, sets, f, a.keep_output), log, env=env, check=False)
    steps = verl_steps(log)
    with open(f"{a.out}/steps.jsonl", "a") as fh:
        for r in steps:
            fh.write(json.dumps({**f, "tag": tag, **r}) + "\n")
    with open(f"{a.out}/runs.jsonl", "a") as fh:
        fh.write(json.dumps({**f, "tag": tag, "exit": rc, "wall_s": round(dt, 1), "steps_logged": len(steps),
                             "gpu_peak_mib_nvidia_smi": mem.peak, "gpu_peak_mib_per_gpu": mem.peaks,
                             "cuda_visible_devices": gpus, "matmul_peak_flops": pk["peak"],
                             "device": pk["device"], "dynamic_sampling": a.dynamic_sampling,
                             "prepare_rl_stats": stats, "overrides": sets}) + "\n")
    if storage.exists(f"{out}/metrics.jsonl"):
        storage.copy_file(f"{out}/metrics.jsonl", f"{a.out}/metrics-{name}.jsonl")


def stop_own_ray() -> None:
    """Stop what is left of the Ray cluster a train run started: with ``RAY_TMPDIR`` set (runs side by side on
    one host, each on its own GPUs), only the processes under that folder; else every Ray process here."""
    tmp = os.environ.get("RAY_TMPDIR")
    if tmp:
        from memsifter.testing.servers import _kill_matching

        _kill_matching(os.path.join(tmp, "ray"))
    else:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, check=False)


def main_run(a) -> None:
    if os.environ.get("RAY_TMPDIR"):  # Ray writes its address file there before it makes the folder
        os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    from memsifter.store import storage
    from memsifter.testing.servers import seaweedfs

    with seaweedfs(workdir=os.path.join(a.work, "weed")) as s3:
        os.environ.update(s3.env())
        storage.ensure_bucket("s3://memsifter/")
        model, pk = prepare(a)
        for path, n in zip(a.configs, a.steps_each):
            t = time.time()
            one(argparse.Namespace(**{**vars(a), "steps": n}), path, model, pk)
            print(f"[{time.strftime('%H:%M:%S')}] {path}: {time.time() - t:.0f}s", flush=True)
            stop_own_ray()
    print("] done", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run"], help="run here (detached: benchmarks/gpu/configs/dapo_4b.yaml)")
    ap.add_argument("--configs", default="memsifter/configs/train_4b_8k_1gpu.yaml,memsifter/configs/train_4b_32k_1gpu.yaml")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-dapo4b")
    ap.add_argument("--steps", default="2", help="training steps of each config: one number for all, or one per "
                    "config (2,4)")
    ap.add_argument("--questions", type=int, default=None, help="synthetic questions (default: enough for every "
                    "config's steps: batch x steps train rows, its test rows (rl_recipe) and 2 to spare, at least 20)")
    ap.add_argument("--sessions", type=int, default=800, help="haystack sessions per synthetic question")
    ap.add_argument("--set", action="append", default=[], help="one more train setting KEY=VALUE (all configs)")
    ap.add_argument("--output-tag", default=None, help="the train output's name (default: the prompt budget and GPU "
                    "count, e.g. 8k-2gpu): two runs with one tag share the output, e.g. to resume at another size")
    ap.add_argument("--keep-output", action="store_true", help="keep the train output of an earlier run (its "
                    "checkpoints: the train stage resumes from them; default: start clean)")
    ap.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=False,
                    help="keep the configs' dynamic sampling (a random model then discards every group)")
    return ap


def resolve(a: argparse.Namespace) -> argparse.Namespace:
    """The parsed arguments with ``configs`` as absolute paths and ``steps_each`` (one count per config)."""
    a.configs = [os.path.abspath(c) for c in a.configs.split(",") if c]
    each = [int(x) for x in str(a.steps).split(",") if x.strip()]
    if len(each) == 1:
        each = each * len(a.configs)
    if len(each) != len(a.configs) or min(each, default=0) < 1:
        print(f"run_dapo_4b: --steps {a.steps}: one count >= 1, or one per config ({len(a.configs)})", file=sys.stderr)
        raise SystemExit(2)
    a.steps_each, a.max_steps = each, max(each)
    if a.questions is None:  # one synthetic question makes one RL row; too few rows end verl's epoch early
        recipes = [rl_recipe(f["prompt"], f["batch"] * a.max_steps) for f in map(config_facts, a.configs)]
        need = max((sum(n for split in r.values() for n in split.values()) for r in recipes), default=0)
        a.questions = max(20, need + 2)
    return a


def main() -> None:
    main_run(resolve(build_parser().parse_args()))


if __name__ == "__main__":
    main()
