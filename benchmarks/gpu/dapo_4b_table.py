#!/usr/bin/env python3
"""The table of ``run_dapo_4b.py``'s runs, from the raw files it wrote (``runs.jsonl``, ``steps.jsonl``):

    python3 benchmarks/gpu/dapo_4b_table.py benchmarks/gpu/results/2026-11-26-h100-4b-dapo   # -> table.md, table.json

Per step: step, rollout (generation), old log-prob and actor-update seconds (verl's ``timing_s/*``), rollout
tokens/s (generated tokens of all samples / generation seconds; and the unique prompts' tokens / generation
seconds), peak GPU memory (verl's actor process: allocated / reserved; the whole device by nvidia-smi over the
run, which includes vLLM), and the actor update's MFU:

    model FLOPs of the update = 3 x sum over rows of [2 (N_body + N_lm_head) L + 2 layers q_dim L^2]

(forward + backward = 3 forward passes; 2 FLOPs per weight per token, the LM head over every position as the
actor computes it; causal attention QK^T and AV = 4 q_dim L^2 / 2 per layer; gradient checkpointing's
recomputation not counted, as MFU does not count it; a LoRA run's frozen weights get no gradient: 2 forward passes,
not 3), with L = mean prompt + mean response length of the step
and rows = prompts x samples, over the update's seconds, against the bf16 matmul peak measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_rank import model_params  # noqa: E402  (imports run_embed: standard library only at import)

sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from memsifter.models.tiny import QWEN3_4B  # noqa: E402


def train_flops(cfg: dict, lengths: list[float], lora: bool = False) -> float:
    """Model FLOPs of one forward + backward over rows of these lengths (see the module's docstring). With a LoRA
    adapter the frozen weights get no gradient: the backward computes only the activations' gradients (one
    forward's FLOPs; the adapter's own are under 2% of the model's), so 2 forward passes, not 3."""
    p = model_params(cfg)
    fwd = sum(2 * (p["body"] + p["lm_head"]) * L + 2 * p["layers"] * p["q_dim"] * L * L for L in lengths)
    return (2 if lora else 3) * fwd


def lora_rank(run: dict) -> int:
    """The LoRA rank a run trained with: its record's, else its committed config file's (0: full fine-tuning)."""
    if "lora_rank" in run:
        return run["lora_rank"] or 0
    import yaml

    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), run.get("config", ""))
    if not os.path.isfile(path):
        return 0
    v = (yaml.safe_load(open(path)) or {}).get("verl", {})
    return (v.get("actor_rollout_ref", {}).get("model", {}) or {}).get("lora_rank", 0) or 0


def step_row(run: dict, st: dict, cfg: dict = QWEN3_4B) -> dict:
    """One table row of a verl step record ``st`` of run ``run`` (its config facts, peak, device)."""
    rows = run["batch"] * run["n"]
    prompt, resp = st.get("prompt_length/mean"), st.get("response_length/mean")
    gen, upd = st.get("timing_s/gen"), st.get("timing_s/update_actor")
    # verl times a checkpoint's save inside the step: the step's training seconds leave it out (its own column)
    step_s, ckpt = st.get("timing_s/step"), st.get("timing_s/save_checkpoint")
    lora = lora_rank(run)
    out = {"run": run.get("run"), "tag": run["tag"], "gpus": run["gpus"], "step": st["step"], "rows": rows,
           "lora_rank": lora, "nodes": run.get("nodes") or 1,
           "prompt_mean": prompt, "response_mean": resp, "checkpoint_s": ckpt,
           "step_s": step_s - ckpt if step_s is not None and ckpt else step_s, "gen_s": gen,
           "old_log_prob_s": st.get("timing_s/old_log_prob"), "update_s": upd,
           "rollout_gen_tok_s": rows * resp / gen if gen and resp is not None else None,
           "rollout_prompt_tok_s": run["batch"] * prompt / gen if gen and prompt is not None else None,
           # verl 0.9.1 logs the actor's memory as actor/perf/*; earlier versions as perf/*
           "mem_alloc_gb": st.get("actor/perf/max_memory_allocated_gb", st.get("perf/max_memory_allocated_gb")),
           "mem_reserved_gb": st.get("actor/perf/max_memory_reserved_gb", st.get("perf/max_memory_reserved_gb")),
           "host_mem_gb": st.get("actor/perf/cpu_memory_used_gb", st.get("perf/cpu_memory_used_gb")),
           "verl_mfu_actor": st.get("perf/mfu/actor")}
    peak = run.get("matmul_peak_flops")
    if upd and peak and prompt is not None and resp is not None:
        flops = train_flops(cfg, [prompt + resp] * rows, lora=lora > 0)
        # MFU per GPU: the update's FLOPs over its seconds and every GPU's peak
        out.update(update_flops=flops, update_tflops_s=flops / upd / 1e12, mfu=flops / upd / (peak * run["gpus"]))
    return out


def after_first(rs: list[dict]) -> list[dict]:
    """A run's steps after the first it logged (which carries the warm-up; a run resumed from a checkpoint starts
    past step 1), or all of them where it logged one."""
    first = min((r["step"] for r in rs), default=None)
    return [r for r in rs if r["step"] != first] or rs


PHASES = (("step_s", "step"), ("gen_s", "rollout"), ("old_log_prob_s", "old log-prob"), ("update_s", "actor update"))


def scaling(rows: list[dict]) -> list[dict]:
    """Scaling efficiency of each phase of every multi-GPU run against each one-GPU run of the same prompt budget
    (``base``: that run's name, None for an unnamed one), from rows measured with the same work per step:
    t(1 GPU) / (g x t(g GPUs)), the phase's seconds averaged over the steps after the first (which carries the
    warm-up) where a run logged more than one."""
    def mean_phase(rs: list[dict], key: str) -> float | None:
        later = after_first(rs)
        vals = [r[key] for r in later if r.get(key)]
        return sum(vals) / len(vals) if vals else None

    def by_run(pred) -> dict:
        out: dict = {}
        for r in rows:
            if pred(r):
                out.setdefault((r.get("run"), r["tag"], r["gpus"], r.get("lora_rank", 0)), []).append(r)
        return out

    ones, manys = by_run(lambda r: r["gpus"] == 1), by_run(lambda r: r["gpus"] > 1)
    out = []
    for (name, tag, g, lora), many in manys.items():
        for (base, btag, _, blora), one in ones.items():
            if btag != tag or blora != lora:  # the same recipe: full fine-tuning, or LoRA of one rank
                continue
            row = {"tag": tag, "gpus": g, "run": name, "base": base}
            for key, _ in PHASES:
                t1, tg = mean_phase(one, key), mean_phase(many, key)
                row[key] = {"1": t1, str(g): tg, "speedup": t1 / tg if t1 and tg else None,
                            "efficiency": t1 / (g * tg) if t1 and tg else None}
            out.append(row)
    return out


def resize_events(text: str) -> dict | None:
    """A train log's resume at another GPU count, timed from its log lines: the step it went on from, the GPU
    processes that wrote it and the run's, the seconds collecting that step's weights (to the stage's "staged"
    line) and from there until verl was ready to fit; None where the run did not resize."""
    import re
    from datetime import datetime

    def secs(hms: str) -> int:
        h, m, s = map(int, hms.split(":"))
        return 3600 * h + 60 * m + s

    m = re.search(r"^(\d\d:\d\d:\d\d) INFO .*step (\d+) was written by (\d+) GPU processes and this run has "
                  r"(\d+): collecting", text, re.M)
    if not m:
        return None
    out = {"from_step": int(m.group(2)), "written_by_gpus": int(m.group(3)), "gpus": int(m.group(4)),
           "collect_s": None, "start_to_ready_s": None}
    staged = re.search(r"^(\d\d:\d\d:\d\d) INFO .*staged on \d+ node", text, re.M)
    ready = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+:all initialize finished, ready to fit", text)
    if staged:
        out["collect_s"] = (secs(staged.group(1)) - secs(m.group(1))) % 86400
        if ready:
            t_ready = datetime.strptime(ready.group(1), "%Y-%m-%d %H:%M:%S")
            out["start_to_ready_s"] = (secs(t_ready.strftime("%H:%M:%S")) - secs(staged.group(1))) % 86400
    return out


def _unfinished(path: str, name: str | None) -> tuple[list[dict], list[dict]]:
    """A run whose driver had not ended when its files were collected (the machine's time was up): its facts
    from the detached run's ``run.json`` (the driver's argv) and the config files, its steps from the train logs
    written so far, the matmul peak from the driver's log; ``exit`` is None."""
    import re

    import run_dapo_4b
    from run_train import verl_steps

    info = json.load(open(os.path.join(path, "run.json")))
    a = run_dapo_4b.build_parser().parse_args(info["argv"][2:])
    text = open(os.path.join(path, "driver.log"), errors="replace").read()
    m = re.search(r"matmul peak ([0-9.]+) TFLOP/s on (.+)", text)
    runs, steps = [], []
    for cfg in [c for c in a.configs.split(",") if c]:
        facts = run_dapo_4b.config_facts(os.path.join(run_dapo_4b.ROOT, cfg))
        tag = f"{facts['prompt'] // 1024}k"
        log = os.path.join(path, f"train-{run_dapo_4b.run_tag(facts)}.log")
        if not os.path.exists(log):
            continue
        mine = [{**facts, "tag": tag, "run": name, **r} for r in verl_steps(log)]
        steps += mine
        runs.append({**facts, "tag": tag, "run": name, "exit": None, "wall_s": None, "steps_logged": len(mine),
                     "resize": resize_events(open(log, errors="replace").read()),
                     "gpu_peak_mib_nvidia_smi": None, "matmul_peak_flops": float(m.group(1)) * 1e12 if m else None,
                     "device": m.group(2).strip() if m else "?", "dynamic_sampling": a.dynamic_sampling,
                     "cuda_visible_devices": info.get("env", {}).get("CUDA_VISIBLE_DEVICES"),
                     "overrides": [x for s_ in a.set for x in ("--set", s_)]})
    return runs, steps


def load(folder: str) -> tuple[list[dict], list[dict]]:
    """The runs and steps of ``folder``, and of each of its sub-folders (runs side by side on one host, each
    collected into a folder named after it: its rows carry that name as ``run``)."""
    def jl(path: str, name: str | None) -> list[dict]:
        # a row repeated word for word is one row: steps.jsonl of a two-raylet run written before the driver
        # dropped verl's step lines that the cluster's log shows twice
        lines = list(dict.fromkeys(x.strip() for x in open(path) if x.strip())) if os.path.exists(path) else []
        rows = [json.loads(x) for x in lines]
        return [{**r, "run": name} if name else r for r in rows]

    def one(path: str, name: str | None) -> tuple[list[dict], list[dict]]:
        if os.path.exists(os.path.join(path, "runs.jsonl")):
            return jl(os.path.join(path, "runs.jsonl"), name), jl(os.path.join(path, "steps.jsonl"), name)
        if os.path.exists(os.path.join(path, "run.json")):
            return _unfinished(path, name)
        return [], []

    runs, steps = one(folder, None)
    for sub in sorted(os.listdir(folder)):
        if os.path.isdir(os.path.join(folder, sub)):
            r, s_ = one(os.path.join(folder, sub), sub)
            runs, steps = runs + r, steps + s_
    return runs, steps


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def label(run: dict) -> str:
    """A run's name in the table: its prompt budget (and LoRA rank), and the name it ran under side by side."""
    rank = lora_rank(run)
    tag = f"{run['tag']} LoRA r{rank}" if rank else run["tag"]
    if (run.get("nodes") or 1) > 1:
        tag += f" {run['nodes']} nodes"
    return f"{tag} ({run['run']})" if run.get("run") else tag


def device_peaks(run: dict) -> str:
    """nvidia-smi's peak GiB of each GPU the run used (``a / b`` for two), or of the one it read."""
    per = run.get("gpu_peak_mib_per_gpu") or [run.get("gpu_peak_mib_nvidia_smi")]
    return " / ".join("-" if m is None else f"{m / 1024:.1f}" for m in per)


def table(runs: list[dict], steps: list[dict]) -> tuple[str, list[dict]]:
    rows = []
    lines = ["| prompt | GPUs | step | rows × (prompt + response) tokens | step s | rollout s | old log-prob s | "
             "actor update s | rollout gen tok/s | rollout prompt tok/s | actor TFLOP/s | actor MFU | "
             "verl's MFU (datasheet peak) | GPU mem alloc / reserved GB (actor) | device peak GiB (nvidia-smi) | "
             "host mem GB (actor) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for run in runs:
        mine = [s for s in steps if s.get("tag") == run["tag"] and s.get("config") == run["config"]
                and s.get("run") == run.get("run")]
        if not mine:
            lines.append(f"| {label(run)} | {run['gpus']} | - | no step logged (exit {run['exit']}, "
                         f"{fmt(run['wall_s'], '.0f')} s) | | | | | | | | | | | {device_peaks(run)} | |")
            continue
        for st in mine:
            r = step_row(run, st)
            rows.append(r)
            shape = (f"{r['rows']} × ({fmt(r['prompt_mean'], ',.0f')} + {fmt(r['response_mean'], '.0f')})")
            lines.append(
                f"| {label(run)} | {r['gpus']} | {r['step']} | {shape} | {fmt(r['step_s'])}"
                + (f" (+ {r['checkpoint_s']:.1f} checkpoint)" if r.get("checkpoint_s") else "") + f" | {fmt(r['gen_s'])} | "
                f"{fmt(r['old_log_prob_s'])} | {fmt(r['update_s'])} | {fmt(r['rollout_gen_tok_s'], ',.0f')} | "
                f"{fmt(r['rollout_prompt_tok_s'], ',.0f')} | {fmt(r.get('update_tflops_s'), '.0f')} | "
                f"{fmt(r.get('mfu') and 100 * r['mfu'])}% | {fmt(r['verl_mfu_actor'] and 100 * r['verl_mfu_actor'])}% | "
                f"{fmt(r['mem_alloc_gb'])} / {fmt(r['mem_reserved_gb'])} | {device_peaks(run)} | "
                f"{fmt(r['host_mem_gb'])} |")
    p = model_params(QWEN3_4B)
    head = [f"- model: Qwen3-4B's architecture ({(p['body'] + p['lm_head']) / 1e9:.2f}B matmul weights with the tied "
            f"LM head), **random weights** (speed and memory depend on shape and tokens, not on weight values)"]
    for run in runs:
        extra = [o for o in run.get("overrides", []) if o != "--set" and o.startswith("verl.actor_rollout_ref")]
        ended = (f"exit {run['exit']}, {run['wall_s']:.0f} s wall (verl start included)" if run["exit"] is not None
                 else "**not finished** when collected (the machine's time ended; steps from its log)")
        head.append(f"- {label(run)}: `{run['config']}`{' with ' + ', '.join(f'`{o}`' for o in extra) if extra else ''}, "
                    f"{ended}, {run['steps_logged']} step(s), "
                    f"{'GPUs ' + run['cuda_visible_devices'] + ', ' if run.get('cuda_visible_devices') else ''}dynamic sampling "
                    f"{'on' if run.get('dynamic_sampling') else 'off'}; device {run['device']}, bf16 matmul peak "
                    f"{fmt(run.get('matmul_peak_flops') and run['matmul_peak_flops'] / 1e12)} TFLOP/s")
    for run in runs:
        rz = run.get("resize")
        if rz:
            head.append(f"- {label(run)} went on from step {rz['from_step']}, written by {rz['written_by_gpus']} GPU "
                        f"processes, on {rz['gpus']}: collecting that step's weights took {fmt(rz['collect_s'], '.0f')} s, "
                        f"verl's start from them until ready to fit {fmt(rz['start_to_ready_s'], '.0f')} s")
    text = "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"
    sc = scaling(rows)
    if sc:
        text += ("\nScaling against one GPU (same prompts and samples per step; seconds averaged over the steps after "
                 "the first where a run logged more; efficiency = t1 / (GPUs x tN)):\n\n| prompt | GPUs | "
                 + " | ".join(f"{name} s (1 → N), speedup, efficiency" for _, name in PHASES) + " |\n|---|---:|"
                 + "---|" * len(PHASES) + "\n")
        for r in sc:
            cells = []
            for key, _ in PHASES:
                c = r[key]
                cells.append(f"{fmt(c['1'])} → {fmt(c[str(r['gpus'])])}, {fmt(c['speedup'], '.2f')}x, "
                             f"{fmt(c['efficiency'] and 100 * c['efficiency'], '.0f')}%")
            text += (f"| {r['tag']}: {r['run'] or '-'} vs {r['base'] or '-'} | {r['gpus']} | " + " | ".join(cells)
                     + " |\n")
    text += cost_lines(runs, rows)
    return text, rows


def cost(runs: list[dict], rows: list[dict], steps: int = 100) -> list[dict]:
    """What a run of ``steps`` steps of each measured recipe takes: its steady step seconds (mean over the steps
    after the first where it logged more), hours and GPU-hours for ``steps`` steps, the start-up (the train
    stage's wall time less its logged steps: verl, Ray and vLLM start, model load, teardown), peak memory."""
    out = []
    for run in runs:
        mine = [r for r in rows if r.get("run") == run.get("run") and r["tag"] == run["tag"] and r["gpus"] == run["gpus"]]
        later = after_first(mine)
        st = [r["step_s"] for r in later if r.get("step_s")]
        if not st:
            continue
        step_s = sum(st) / len(st)
        first_only = later[0]["step"] if len(later) == len(mine) else None  # one step logged: its number
        start = (run["wall_s"] - sum(r["step_s"] + (r.get("checkpoint_s") or 0) for r in mine if r.get("step_s"))
                 if run.get("wall_s") else None)
        per = run.get("gpu_peak_mib_per_gpu") or ([run["gpu_peak_mib_nvidia_smi"]] if run.get("gpu_peak_mib_nvidia_smi") else [])
        extra = [o for o in run.get("overrides", []) if o.startswith("verl.actor_rollout_ref")]
        config = os.path.basename(run["config"]) + (f" + {len(extra)} actor setting(s)" if extra else "")
        out.append({"run": label(run), "config": config, "gpus": run["gpus"], "prompts_x_samples": f"{run['batch']} x {run['n']}",
                    "step_s": step_s, "first_step_only": first_only, "hours": steps * step_s / 3600, "gpu_hours": steps * step_s * run["gpus"] / 3600,
                    "start_s": start, "device_peak_gib": max(per) / 1024 if per else None,
                    "host_gb": max((r["host_mem_gb"] for r in mine if r.get("host_mem_gb")), default=None)})
    return out


def cost_lines(runs: list[dict], rows: list[dict], steps: int = 100) -> str:
    c = cost(runs, rows, steps)
    if not c:
        return ""
    lines = [f"\n{steps} steps of each recipe as measured (steady step: the mean after the first step where a run "
             "logged more; start-up: the train stage's wall time less its steps):\n",
             f"| run | config | GPUs | prompts × samples a step | steady step s | {steps} steps h | GPU-hours | start-up s | "
             "device peak GiB (largest GPU) | host GB (actor) |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in c:
        step = fmt(r["step_s"]) + (f" (step {r['first_step_only']} only)" if r["first_step_only"] else "")
        lines.append(f"| {r['run']} | `{r['config']}` | {r['gpus']} | {r['prompts_x_samples']} | {step} | {fmt(r['hours'], '.2f')} | "
                     f"{fmt(r['gpu_hours'], '.2f')} | {fmt(r['start_s'], '.0f')} | {fmt(r['device_peak_gib'])} | "
                     f"{fmt(r['host_gb'])} |")
    return "\n".join(lines) + "\n"


H100_MIB = 81559  # memory.total of an H100 80GB HBM3 in nvidia-smi


def plot(runs: list[dict], rows: list[dict], path: str) -> None:
    """Steady step seconds (split into rollout, old log-prob, actor update and the rest) and device peak memory
    of each run, labelled by prompt budget, GPU count and run name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = cost(runs, rows)
    if not c:
        return
    names = [f"{r['run']}\n{r['gpus']} GPU" for r in c]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottoms = [0.0] * len(c)
    for key, name in PHASES[1:]:
        vals = []
        for r in c:
            mine = [x for x in rows if label({**x, "run": x.get("run")}) == r["run"] and x["gpus"] == r["gpus"]]
            later = after_first(mine)
            v = [x[key] for x in later if x.get(key)]
            vals.append(sum(v) / len(v) if v else 0.0)
        ax1.bar(names, vals, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax1.bar(names, [max(0.0, r["step_s"] - b) for r, b in zip(c, bottoms)], bottom=bottoms, label="other")
    ax1.set_ylabel("steady step, s")
    ax1.set_title("DAPO step of the Qwen3-4B-shaped model")
    ax1.legend(fontsize=8)
    ax2.bar(names, [r["device_peak_gib"] or 0 for r in c], color="tab:gray")
    ax2.axhline(H100_MIB / 1024, color="tab:red", linestyle="--", linewidth=1,
                label=f"H100 80GB: {H100_MIB / 1024:.1f} GiB (nvidia-smi total)")
    ax2.set_ylabel("device peak GiB (largest GPU, nvidia-smi)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    a = ap.parse_args()
    runs, steps = load(a.folder)
    if not runs:
        raise SystemExit(f"{a.folder}: no runs.jsonl")
    text, rows = table(runs, steps)
    with open(os.path.join(a.folder, "table.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.folder, "table.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot(runs, rows, os.path.join(a.folder, "steps.png"))
    print(text)


if __name__ == "__main__":
    main()
