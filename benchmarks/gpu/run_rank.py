#!/usr/bin/env python3
"""The rank stage on a GPU: our engine settings vs the original's, a Hugging Face baseline, the ok path.

    source benchmarks/gpu/install.sh && python3 benchmarks/gpu/run_rank.py --inputs .gpu/inputs --out "$OUT"

Inputs (built on a CPU machine by ``prepare_inputs.sh``): a LongMemEval_S-shaped dataset whose
haystacks are longer than the 131,072-token budget (dev30's sessions, each question's haystack
followed by its neighbour's) and its embed-stage rankings (the pre-filter order).

Model: a randomly initialised Qwen3 of Qwen3-4B's shape (36 layers, hidden 2560, 32/8 heads,
vocab 151,936) in bf16, with a BPE tokenizer trained on the dataset's text, vocabulary padded to the
model's (speed depends on shape and token counts, not on weight values).

Runs, each a ``memsifter run rank`` (engine ``vllm``: Ray Data LLM on a local Ray head):
- ``ours``: the stage's defaults (vLLM's chunked prefill and batching, all prompts in flight),
  ``max_tokens`` fixed with ``ignore_eos``; and the same with ``max_tokens=1`` (prefill alone);
- ``original``: the original release's engine settings: one sequence at a time
  (``max_num_seqs=1``, Ray Data batch 1), ``max_num_batched_tokens=133120``;
- ``ok path``: ``constrained_output`` (vLLM structured outputs, a regex over the shown ids, through
  Ray Data LLM's sampling params) so the random model writes a valid ``<ranking>``;
- Hugging Face ``generate`` (bf16, SDPA) on the first ``--hf-prompts`` prompts, same ``max_tokens``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


class GpuMem:
    """Peak GPU memory in use (nvidia-smi, whole device) while a block runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, int(out.split()[0]))
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.5)

    def __enter__(self) -> "GpuMem":
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def write_yaml(path: str, data: dict) -> str:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def rank_run(name: str, a, model: str, extra: dict, vllm: dict) -> dict:
    from memsifter import storage

    out = os.path.join(a.work, f"rank-{name}")
    cfg = {"input": os.path.join(a.inputs, "lme131k"), "embeddings": os.path.join(a.inputs, "lme131k-embed"),
           "output": out, "model": model, "temperature": 0.6, "seed": 0, "shard_size": 64,
           "vllm": {"max_model_len": 131072 + 2048, "gpu_memory_utilization": 0.85,
                    **({"enforce_eager": True} if a.eager else {}), **vllm}, **extra}
    path = write_yaml(os.path.join(a.work, f"rank-{name}.yaml"), cfg)
    log = os.path.join(a.out, f"rank-{name}.log")
    cmd = [sys.executable, "-m", "memsifter.cli", "run", "rank", "--config", path, "--force"]
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t = time.time()
    left = a.deadline - time.time()
    if left < 60:
        print(f"skipped {name}: {left:.0f}s left before the deadline", flush=True)
        return {"name": name, "rc": "skipped", "wall": 0.0}
    with GpuMem() as mem, open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
            subprocess.run(["ray", "stop", "--force"], capture_output=True)
    wall = time.time() - t
    if rc != 0:
        print(open(log, errors="replace").read()[-4000:], flush=True)
        return {"name": name, "rc": rc, "wall": wall}
    m = storage.read_manifest(out)
    st = m["stats"]
    res = {"name": name, "rc": rc, "wall": wall, "gen_s": st["seconds"]["generation"],
           "busy_s": st["seconds"].get("engine_busy"), "vllm_log_throughput": vllm_throughput(log),
           "questions": st["questions"], "status": st["status"], "tokens": st.get("engine_tokens"),
           "gpu_mib": mem.peak, "not_ok": st.get("not_ok_reasons")}
    print(json.dumps(res), flush=True)
    return res


def vllm_throughput(log: str) -> dict:
    """The engine's own periodic stats lines (peak prompt / generation tokens/s), where it logs them."""
    import re

    pre, gen = [], []
    for line in open(log, errors="replace"):
        m = re.search(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s", line)
        if m:
            pre.append(float(m.group(1)))
            gen.append(float(m.group(2)))
    return {"lines": len(pre), "prompt_tok_s_max": max(pre, default=None), "gen_tok_s_max": max(gen, default=None)}


def hf_baseline(a, model: str, n: int, max_tokens: int) -> dict:
    """transformers generate, bf16 + SDPA, one prompt at a time (a 131k-token batch of several does not
    fit), the stage's exact prompts (re-built from the rank output's prompts.parquet)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memsifter import storage
    from memsifter.context import TokenCounter
    from memsifter.data.model import read_dataset
    from memsifter.rankings import read_rankings
    from memsifter.prompting import load_prompt
    from memsifter.stages.rank import RankConfig, build_prompt

    tok = AutoTokenizer.from_pretrained(model)
    cfg = RankConfig(input=os.path.join(a.inputs, "lme131k"), embeddings=os.path.join(a.inputs, "lme131k-embed"),
                     output="/tmp/unused", model=model, max_tokens=max_tokens,
                     vllm={"max_model_len": 131072 + 2048})
    ds = read_dataset(cfg.input)
    emb = {r["question_id"]: r for r in read_rankings(cfg.embeddings)}
    tmpl = load_prompt(None, "ranker.txt", ("history", "current"))
    counter = TokenCounter(tok)
    qs = ds.questions[:n]
    prompts = [build_prompt(cfg, ds, q, emb.get(q.question_id), counter, tmpl) for q in qs]
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    torch.cuda.reset_peak_memory_stats()
    times, ptoks = [], []
    for i, p in enumerate(prompts):
        ids = tok.apply_chat_template(p.messages, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"].cuda()
        torch.cuda.synchronize()
        t = time.time()
        with torch.no_grad():
            # prefill alone (one token), then the full generation
            m.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            t_pre = time.time() - t
            t = time.time()
            out = m.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True,
                             temperature=0.6)
        torch.cuda.synchronize()
        times.append((t_pre, time.time() - t))
        ptoks.append(ids.shape[1])
        print(f"hf: prompt {i}: {ids.shape[1]} tokens, prefill {t_pre:.2f}s, full {times[-1][1]:.2f}s "
              f"({out.shape[1] - ids.shape[1]} new)", flush=True)
    full = sum(t for _, t in times)
    pre = sum(t for t, _ in times)
    return {"name": "hf-generate", "prompts": n, "prompt_tokens": sum(ptoks), "full_s": full, "prefill_s": pre,
            "gpu_mib_torch_peak": torch.cuda.max_memory_allocated() / 2**20}


def hf_child(a, model: str, path: str) -> None:
    res = hf_baseline(a, model, a.hf_prompts, a.max_tokens)
    with open(path, "w") as f:
        json.dump(res, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", default=os.path.join(ROOT, ".gpu", "inputs"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-rank")
    ap.add_argument("--questions", type=int, default=2, help="questions in the speed runs")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=1)
    ap.add_argument("--runs", default="ours,hf,original", help="any of ours,prefill,original,ok,hf (in this order)")
    ap.add_argument("--budget-s", type=float, default=570, help="stop starting/kill runs after this many seconds")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile/CUDA graphs (faster start)")
    a = ap.parse_args()
    a.deadline = time.time() + a.budget_s
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    runs = a.runs.split(",")
    from memsifter.data.model import read_dataset
    from memsifter.tiny import QWEN3_4B, build_random_model

    model = os.path.join(a.work, "qwen3-4b-shape")
    t = time.time()
    ds = read_dataset(os.path.join(a.inputs, "lme131k"))
    corpus = [t_["content"] for s in ds.sessions.values() for t_ in s.turns]
    if not os.path.exists(os.path.join(model, "config.json")):
        # in a child process: the CUDA memory it takes must be free before the engines start
        import multiprocessing as mp

        p = mp.get_context("spawn").Process(target=build_random_model, args=(model, QWEN3_4B, corpus),
                                            kwargs={"tokenizer_vocab": 32000, "dtype": "bfloat16", "device": "cuda"})
        p.start()
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"building the model failed ({p.exitcode})")
    print(f"model built in {time.time() - t:.1f}s", flush=True)
    sub = {"limit": a.questions}
    speed = {"max_tokens": a.max_tokens, "ignore_eos": True, **sub}
    results: list[dict] = []
    hf = None

    def save() -> None:
        with open(os.path.join(a.out, "rank.json"), "w") as f:
            json.dump({"results": results, "hf": hf, "args": {k: v for k, v in vars(a).items()}}, f, indent=2)

    for r in runs:
        if r == "ours":
            results.append(rank_run("ours", a, model, speed, {"batch_size": a.questions}))
        elif r == "prefill":
            results.append(rank_run("ours-prefill", a, model, {**speed, "max_tokens": 1}, {"batch_size": a.questions}))
        elif r == "original":
            results.append(rank_run("original", a, model, speed,
                                    {"batch_size": 1, "max_num_seqs": 1, "max_num_batched_tokens": 133120}))
        elif r == "ok":
            results.append(rank_run("ok-path", a, model, {"constrained_output": True, "max_tokens": 64, **sub},
                                    {"batch_size": a.questions}))
        elif r == "hf" and a.deadline - time.time() < 60:
            print("skipped hf: under 60 s left before the deadline", flush=True)
        elif r == "hf":
            # in a child process, so that its CUDA memory is free again for the engines that follow
            import multiprocessing as mp

            path = os.path.join(a.work, "hf.json")
            if os.path.exists(path):
                os.remove(path)
            p = mp.get_context("spawn").Process(target=hf_child, args=(a, model, path))
            p.start()
            p.join(timeout=max(1.0, a.deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join()
                print("hf baseline: killed at the deadline", flush=True)
            elif os.path.exists(path):
                hf = json.load(open(path))
            else:
                print(f"hf baseline failed (exit {p.exitcode})", flush=True)
        save()
    # table
    lines = ["| run | prompts | pipeline s (incl. engine start) | engine busy s | prompts/s (busy) | prompt tok | "
             "gen tok | tok/s in+out (busy) | vLLM log peak prompt / gen tok/s | peak GPU MiB | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("rc"):
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | - | - | exit {r['rc']} |")
            continue
        tk = r.get("tokens") or {}
        n = sum(r["status"].values())
        tot = (tk.get("prompt_tokens", 0) + tk.get("generated_tokens", 0))
        busy = r.get("busy_s") or r["gen_s"]
        vt = r.get("vllm_log_throughput") or {}
        mark = "" if r.get("busy_s") else " (no busy time: pipeline)"
        lines.append(f"| {r['name']}{mark} | {n} | {r['gen_s']:.1f} | {busy:.1f} | {n / busy:.4f} | {tk.get('prompt_tokens')} | "
                     f"{tk.get('generated_tokens')} | {tot / busy:.0f} | {vt.get('prompt_tok_s_max')} / "
                     f"{vt.get('gen_tok_s_max')} | {r['gpu_mib']} | {r['status']} |")
    if hf:
        lines.append(f"| hf-generate (first {hf['prompts']}) | {hf['prompts']} | - | {hf['full_s']:.1f} | "
                     f"{hf['prompts'] / hf['full_s']:.4f} | {hf['prompt_tokens']} | {hf['prompts'] * a.max_tokens} | "
                     f"{(hf['prompt_tokens'] + hf['prompts'] * a.max_tokens) / hf['full_s']:.0f} | "
                     f"prefill {hf['prompt_tokens'] / hf['prefill_s']:.0f} / decode "
                     f"{hf['prompts'] * (a.max_tokens - 1) / max(1e-9, hf['full_s'] - hf['prefill_s']):.1f} | "
                     f"{hf['gpu_mib_torch_peak']:.0f} (torch) | prefill {hf['prefill_s']:.1f}s |")
    by = {r["name"]: r for r in results if not r.get("rc")}
    def busy(r: dict) -> float:
        return r.get("busy_s") or r["gen_s"]

    if "ours" in by and "ours-prefill" in by:
        o, p = by["ours"], by["ours-prefill"]
        pre_tps = p["tokens"]["prompt_tokens"] / busy(p)
        dec_s = max(1e-9, busy(o) - busy(p))
        lines.append(f"\nours: prefill {pre_tps:.0f} tok/s (max_tokens=1 run); decode "
                     f"{(o['tokens']['generated_tokens'] - p['tokens']['generated_tokens']) / dec_s:.0f} tok/s "
                     f"(difference of the two runs)")
    if "ours" in by and "original" in by:
        lines.append(f"ours vs original engine settings: {busy(by['original']) / busy(by['ours']):.2f}x prompts/s "
                     f"(engine busy time; pipeline incl. start: {by['original']['gen_s'] / by['ours']['gen_s']:.2f}x)")
    if "ours" in by and hf:
        per_hf = hf["full_s"] / hf["prompts"]
        per_ours = busy(by["ours"]) / sum(by["ours"]["status"].values())
        lines.append(f"ours vs HF generate (engine busy time per prompt; HF from its first {hf['prompts']} "
                     f"prompt(s), one at a time): {per_hf / per_ours:.2f}x prompts/s")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    with open(os.path.join(a.out, "rank.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
