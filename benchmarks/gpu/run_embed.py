#!/usr/bin/env python3
"""Embed stage on a GPU: the stage's ``Embedder`` against a plain bf16 baseline and the original.

    source benchmarks/gpu/install.sh && python3 benchmarks/gpu/run_embed.py --out "$OUT"

Workload: the real LongMemEval_S dev30 sessions (``.gpu/inputs/dev30``, built by prepare_inputs.py;
``--inputs .gpu/inputs/full``: every session of the training split, ``prepare_inputs.py --full``),
each rendered as the embed stage renders it, plus the questions. Encoder: bge-m3's shape (XLM-RoBERTa,
24 layers, hidden 1024, 16 heads, FFN 4096, 8194 positions) with random weights and a BPE tokenizer
trained on the data (bge-m3's weights cannot be downloaded; speed depends on shape and token counts).

Rows, all in this process, in this order (each after a warm-up on a few batches):

- ``original``   : fp32, batch 256 in input order, padded (the original release's settings); when batch
                   256 runs out of memory, batch 32 on the first ``--original-texts`` texts;
- ``plain-bf16`` : Hugging Face model in bf16, SDPA, length-sorted batches under a padded-token budget;
- ``stage-padded``: the stage's ``Embedder`` with the packed path off (``MEMSIFTER_EMBED_PACKED=0``),
                   i.e. the stage before this change (fp16, its default 16,384-token plan);
- ``stage``      : the stage's ``Embedder`` as shipped (packed, varlen FlashAttention, the batch
                   tokenized on several threads), at token budgets ``--budgets``; ``stage+compile`` the
                   same with ``MEMSIFTER_EMBED_COMPILE=1``;
- ``gpu-only``   : the packed forward on ids tokenized beforehand (the GPU's share of ``stage``);
- ``pipeline``   : ``embedding.embed_missing`` as the embed stage calls it (Ray Data actor, the
                   stage's default plan, a local store), texts/s including the actor's model load.

Tokenization: the stage rows run with ``TOKENIZERS_PARALLELISM=false`` (the chart's setting; the
stage tokenizes on its own threads), the plain baseline with it on (its fastest). ``--profile``
writes the CUDA kernel time table of one packed batch to ``embed_profile.txt``.

Reported: sessions/s (texts/s), real tokens/s, model FLOP utilisation (matmul FLOPs of the real
tokens / time / the bf16 peak measured here with an 8192^3 matmul, and the same against the H100 SXM
datasheet's dense bf16 figure), peak GPU memory, and the cosine agreement of every row's vectors with
``plain-bf16``'s.

Repeats (issue 20): every timed row runs ``--repeats`` times after its warm-up (the ``pipeline`` row each
time from an empty store, so each repeat includes the Ray Data actor's start and model load); the table
gives the median and the spread (min-max). ``--baseline-limit N`` runs the in-process rows (plain,
stage, gpu-only, compile) on the first N distinct texts (hash order: a random sample) while
``pipeline`` embeds all of them, so that a run over the full set (``--inputs .gpu/inputs/full``: 14,178
sessions, ~37M tokens) stays under ~10 minutes; rates (texts/s) are compared. ``--budget-s`` stops starting repeats that
would not finish in time (the table says how many ran).

    # issue 20, item 1 (~540 s, estimated from the 2026-11-23 rates): the Ray Data path on
    # >= 10,000 real sessions (--limit counts texts in hash order: 10,400 texts ~ 10,150 sessions + questions)
    python3 benchmarks/gpu/run_embed.py --out $OUT --inputs .gpu/inputs/full --rows plain,compile,gpu-only,pipeline \
        --budgets 131072 --repeats 3 --limit 10400 --baseline-limit 1000 --budget-s 560
    # all 14,178 sessions: ~150 s a pipeline repeat; run the pipeline alone, 3 repeats (~520 s)
    python3 benchmarks/gpu/run_embed.py --out $OUT --inputs .gpu/inputs/full --rows plain,pipeline \
        --repeats 3 --baseline-limit 300 --budget-s 560
    # CPU smoke
    .venv/bin/python benchmarks/gpu/run_embed.py --tiny --work /tmp/ge --out /tmp/ge/out --limit 60 \
        --rows plain,stage,gpu-only,pipeline --budgets 4096 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


# NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100, H100 SXM column): BF16 Tensor
# Core 1,979 TFLOPS "with sparsity"; dense is half of it: 989.4 TFLOP/s. (H100 PCIe: 756 dense.)
H100_SXM_BF16_DENSE_FLOPS = 989e12


def matmul_peak(torch, device: str = "cuda", n: int | None = None, iters: int = 20) -> float:
    """FLOP/s of a square matmul: bf16 8192^3 on CUDA (the peak MFU divides by); on a CPU (smoke runs)
    a float32 1024^3 one, only so that the table's MFU column is a number."""
    cuda = device == "cuda"
    n = n or (8192 if cuda else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    iters = iters if cuda else 5
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t)


def spread(xs: list[float]) -> dict:
    """Median and min/max of repeated measurements (``n`` = how many)."""
    v = sorted(float(x) for x in xs)
    if not v:
        return {"n": 0, "median": float("nan"), "min": float("nan"), "max": float("nan")}
    m = len(v) // 2
    med = v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2
    return {"n": len(v), "median": med, "min": v[0], "max": v[-1]}


def fmt_spread(d: dict, f: str = "{:.2f}") -> str:
    """``median (min-max)``; a single value alone."""
    if not d.get("n"):
        return "-"
    if d["n"] == 1:
        return f.format(d["median"])
    return f"{f.format(d['median'])} ({f.format(d['min'])}-{f.format(d['max'])})"


def rate_row(name: str, secs: list[float], texts: int, tokens: int, flops: float, peak: float,
             **extra) -> dict:
    """A table row from repeated timings: seconds / texts/s / tokens/s / MFU (measured peak and datasheet)
    as median and min-max (the rates' spread comes from the seconds' spread)."""
    s = spread(secs)
    inv = {"n": s["n"], "median": 1 / s["median"], "min": 1 / s["max"], "max": 1 / s["min"]} if s["n"] else s

    def scale(k: float) -> dict:
        return {**inv, **{q: inv[q] * k for q in ("median", "min", "max")}}
    return {"name": name, "texts": texts, "tokens": tokens, "repeats": s["n"], "seconds_all": list(secs),
            "seconds": s["median"], "seconds_spread": s, "texts_s": texts / s["median"],
            "texts_s_spread": scale(texts), "tokens_s": tokens / s["median"],
            "mfu": flops / s["median"] / peak, "mfu_spread": scale(flops / peak),
            "mfu_datasheet": flops / s["median"] / H100_SXM_BF16_DENSE_FLOPS, **extra}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", default=os.path.join(ROOT, ".gpu", "inputs", "dev30"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-embed")
    ap.add_argument("--budgets", default="16384,65536,131072", help="packed real-token budgets per batch")
    ap.add_argument("--plain-budget", type=int, default=65536, help="padded-token budget of plain-bf16")
    ap.add_argument("--original-texts", type=int, default=384)
    ap.add_argument("--max-length", type=int, default=8192)
    ap.add_argument("--rows", default="original,plain,stage-padded,stage,gpu-only,compile,pipeline")
    ap.add_argument("--profile", action="store_true", help="CUDA kernel table of one packed batch")
    ap.add_argument("--limit", type=int, default=None, help="first N distinct texts only (smoke runs)")
    ap.add_argument("--tiny", action="store_true", help="2-layer encoder, CPU allowed (smoke test)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per row (median, min-max)")
    ap.add_argument("--baseline-limit", type=int, default=None,
                    help="in-process rows on the first N texts only (pipeline: all); rates are compared")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no repeat that would end after this many seconds from the start")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    t_start = time.time()

    def time_left() -> float:
        return float("inf") if a.budget_s is None else a.budget_s - (time.time() - t_start)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    rows_wanted = a.rows.split(",")

    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from bench_embed_gpu import build_encoder
    from memsifter.models import embedding
    from memsifter.data.model import read_dataset
    from memsifter.models.packed import flops_per_text
    from memsifter.retrieval.render import render_session
    from memsifter.testing.servers import env_vars

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ds = read_dataset(a.inputs)
    texts = sorted({embedding.text_hash(t): t for t in
                    [render_session(s.turns) for s in ds.sessions.values()] + [q.question for q in ds.questions]
                    }.items())[:a.limit]
    model_dir = os.path.join(a.work, "bge-m3-shape" + ("-tiny" if a.tiny else ""))
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_encoder(model_dir, [t for _, t in texts][:3000], a.tiny)
    print(f"encoder built in {time.perf_counter() - t0:.0f}s", flush=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = AutoModel.from_pretrained(model_dir).config
    t0 = time.perf_counter()
    with env_vars({"TOKENIZERS_PARALLELISM": "true"}):  # batched: the fast tokenizer's own thread pool
        ids = {}
        for i in range(0, len(texts), 1024):
            chunk = texts[i:i + 1024]
            enc = tok([t for _, t in chunk], truncation=True, max_length=a.max_length)["input_ids"]
            ids.update(zip([h for h, _ in chunk], enc))
    print(f"tokenized {len(texts)} texts in {time.perf_counter() - t0:.1f}s", flush=True)
    lens = {h: len(v) for h, v in ids.items()}
    n_sess = len({embedding.text_hash(render_session(s.turns)) for s in ds.sessions.values()} & set(lens))
    total_tokens = sum(lens.values())
    flops = {h: flops_per_text(cfg, n) for h, n in lens.items()}
    print(f"{len(texts)} distinct texts ({n_sess} sessions + questions), {total_tokens:,} tokens, "
          f"session mean {np.mean([lens[h] for h in (embedding.text_hash(render_session(s.turns)) for s in ds.sessions.values()) if h in lens]):.0f} "
          f"tokens, max {max(lens.values())}", flush=True)
    all_texts = texts
    base_texts = texts[:a.baseline_limit] if a.baseline_limit else texts
    peak = matmul_peak(torch, dev)
    print(f"{'bf16' if dev == 'cuda' else 'cpu fp32'} matmul peak measured: {peak / 1e12:.2f} TFLOP/s "
          f"({100 * peak / H100_SXM_BF16_DENSE_FLOPS:.1f}% of the H100 SXM datasheet's dense bf16 "
          f"{H100_SXM_BF16_DENSE_FLOPS / 1e12:.0f})", flush=True)
    results: list[dict] = []
    vectors: dict[str, dict[str, np.ndarray]] = {}

    def timed(name: str, batches: list[list[tuple[str, str]]], encode, note: str = "",
              repeats: int | None = None) -> None:
        out = {}
        secs_all: list[float] = []
        try:
            for b in batches[:2]:  # warm-up (kernels, allocator, compile); an OOM here is a result too
                encode([t for _, t in b])
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for rep in range(repeats or a.repeats):
                if secs_all and time_left() < secs_all[-1] * 1.1:
                    print(f"{name}: repeat {rep + 1} skipped ({time_left():.0f}s left)", flush=True)
                    break
                t = time.perf_counter()
                for b in batches:
                    v = encode([t_ for _, t_ in b])
                    if rep == 0:
                        out.update(zip([h for h, _ in b], v))
                if dev == "cuda":
                    torch.cuda.synchronize()
                secs_all.append(time.perf_counter() - t)
                print(f"{name}: repeat {rep + 1}: {secs_all[-1]:.2f}s", flush=True)
        except torch.OutOfMemoryError as e:
            results.append({"name": name, "error": f"OOM: {str(e).splitlines()[0][:120]}", "note": note})
            print(f"{name}: out of memory ({note})", flush=True)
            torch.cuda.empty_cache()
            return
        hs = [h for b in batches for h, _ in b]
        r = rate_row(name, secs_all, len(hs), sum(lens[h] for h in hs), sum(flops[h] for h in hs), peak,
                     peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan"),
                     batches=len(batches), note=note)
        results.append(r)
        vectors[name] = out
        print(json.dumps(r), flush=True)

    def hf_encoder(dtype):
        m = AutoModel.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(dev).eval()

        def enc(batch):
            with torch.inference_mode():
                e = tok(batch, truncation=True, max_length=a.max_length, padding=True, return_tensors="pt").to(dev)
                v = m(**e).last_hidden_state[:, 0]
                return torch.nn.functional.normalize(v.float(), dim=-1).cpu().numpy()
        return m, enc

    if "original" in rows_wanted:
        m, enc = hf_encoder(torch.float32)
        unsorted = base_texts  # input (hash) order: no length sorting
        b256 = [unsorted[i:i + 256] for i in range(0, len(unsorted), 256)]
        timed("original (fp32, batch 256)", b256[:2], enc, "first 512 texts", repeats=1)
        if results[-1].get("error"):
            sub = unsorted[:a.original_texts]
            timed("original (fp32, batch 32)", [sub[i:i + 32] for i in range(0, len(sub), 32)], enc,
                  f"first {len(sub)} texts", repeats=1)
        del m
        torch.cuda.empty_cache() if dev == "cuda" else None

    if "plain" in rows_wanted:
        m, enc = hf_encoder(torch.bfloat16 if dev == "cuda" else torch.float32)
        plan = embedding.plan_batches(base_texts, a.max_length, tokens_per_batch=a.plain_budget, max_batch_size=256)
        with env_vars({"TOKENIZERS_PARALLELISM": "true"}):  # the baseline at its best: Rust's own pool
            timed("plain-bf16 (HF, sorted, SDPA)", plan, enc, f"padded budget {a.plain_budget}")
        del m
        torch.cuda.empty_cache() if dev == "cuda" else None
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in the chart: the stage uses its own threads

    def real_token_plan(bud: int) -> list[list[tuple[str, str]]]:
        order = sorted(base_texts, key=lambda x: (-lens[x[0]], x[0]))
        plan, cur, n = [], [], 0
        for it in order:
            if cur and n + lens[it[0]] > bud:
                plan.append(cur)
                cur, n = [], 0
            cur.append(it)
            n += lens[it[0]]
        plan.append(cur)
        return plan

    def profile(e, batch) -> None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof_ctx

        try:
            b_ids = [ids[h] for h, _ in batch]
            e.packed.encode_ids(b_ids)
            torch.cuda.synchronize()
            with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                t = time.perf_counter()
                e.packed.encode_ids(b_ids)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            avg = p.key_averages()
            key = "device_time_total" if hasattr(avg[0], "device_time_total") else "cuda_time_total"
            table = avg.table(sort_by=key, row_limit=18, max_name_column_width=70)
            head = (f"one packed batch: {len(b_ids)} texts, {sum(map(len, b_ids)):,} tokens, "
                    f"wall {wall * 1000:.1f} ms under the profiler\n")
            with open(os.path.join(a.out, "embed_profile.txt"), "w") as f:
                f.write(head + table + "\n")
            print(head + table, flush=True)
        except Exception as ex:  # noqa: BLE001 - the profile is a diagnostic, never the run's end
            print(f"profile failed: {ex!r}", flush=True)

    def stage_rows(prefix: str, budgets: list[int], env: dict[str, str], gpu_only: bool = False,
                   timed_rows: bool = True) -> None:
        with env_vars(env):
            spec = embedding.ModelSpec.resolve(model_dir, pooling="cls", max_length=a.max_length)
            e = embedding.Embedder(spec, device=dev)
            print(f"{prefix}: dtype {next(e.model.parameters()).dtype}, packed={e.packed is not None}"
                  f"{', compiled' if e.packed is not None and e.packed.compiled else ''}", flush=True)
            for bud in budgets if timed_rows else []:
                if e.packed is not None:  # real tokens: plan with the exact lengths
                    plan = real_token_plan(bud)
                else:
                    plan = embedding.plan_batches(base_texts, a.max_length, tokens_per_batch=bud)
                timed(f"{prefix} (budget {bud})", plan, e.encode,
                      f"packed real tokens, {embedding.tokenizer_threads()} tokenizer threads"
                      if e.packed is not None else "padded tokens, stage default plan")
            if gpu_only and e.packed is not None:
                by_text = {t: ids[h] for h, t in base_texts}
                timed(f"gpu-only{' (compiled)' if e.packed.compiled else ''}: packed forward, ids tokenized "
                      f"beforehand (budget {budgets[-1]})",
                      real_token_plan(budgets[-1]),
                      lambda b: e.packed.encode_ids([by_text[t] for t in b]).cpu().numpy(), "no tokenization")
            if a.profile and e.packed is not None and dev == "cuda":
                profile(e, real_token_plan(budgets[-1])[len(real_token_plan(budgets[-1])) // 2])
            del e
        torch.cuda.empty_cache() if dev == "cuda" else None

    def pipeline_row() -> None:
        """The stage's own path: Ray Data actor pool, default plan (batch_defaults), local store; every
        repeat from an empty store, so each includes the actor's start and model load (the Ray
        cluster itself is started once, before the first)."""
        import shutil

        spec = embedding.ModelSpec.resolve(model_dir, pooling="cls", max_length=a.max_length)
        t0 = time.perf_counter()
        embedding.ensure_ray()
        ray_start = time.perf_counter() - t0
        secs, firsts, walls, st, store = [], [], [], {}, None
        for rep in range(a.repeats):
            if secs and time_left() < walls[-1] * 1.1:
                print(f"pipeline: repeat {rep + 1} skipped ({time_left():.0f}s left)", flush=True)
                break
            store_dir = os.path.join(a.work, "store")
            shutil.rmtree(store_dir, ignore_errors=True)
            store = embedding.EmbeddingStore(store_dir, spec)
            try:
                t0 = time.perf_counter()
                st = embedding.embed_missing(store, all_texts, workers=1)
                walls.append(time.perf_counter() - t0)
            except Exception as ex:  # noqa: BLE001 - report, keep the other rows
                results.append({"name": "pipeline", "error": repr(ex)[:200], "note": "embed_missing"})
                return
            secs.append(st["embed_seconds"])
            firsts.append(st["first_batch_seconds"])
            print(f"pipeline: repeat {rep + 1}: {secs[-1]:.2f}s (first batch {firsts[-1]:.2f}s, "
                  f"call wall {walls[-1]:.2f}s)", flush=True)
        store.load()
        fb = spread(firsts)
        # steady rate: the texts after the first batch over the time after it (excludes actor start)
        # (meaningless when Ray Data hands the batches back in one burst: then left out)
        steady = spread([st["embedded"] / (s - f) for s, f in zip(secs, firsts) if s - f > 0.05 * s])
        r = rate_row("pipeline: embed_missing (Ray Data actor, default plan, incl. actor start + model load)",
                     secs, st["embedded"], total_tokens, sum(flops.values()), peak, peak_gib=float("nan"),
                     batches=st["batches_run"], first_batch_s=fb, call_wall_s=spread(walls),
                     ray_init_s=ray_start,
                     note=f"plan {st['tokens_per_batch']} tokens / {st['max_batch_size']} texts; first batch back "
                          f"after {fmt_spread(fb)} s; Ray init {ray_start:.1f}s once, not counted")
        r["steady_texts_s_upper"] = steady  # all texts / time after the first batch: an upper bound
        results.append(r)
        vectors[r["name"]] = {h: store.get(h) for h, _ in all_texts if h in store}
        print(json.dumps({k: v for k, v in r.items() if k != "seconds_all"}), flush=True)

    budgets = [int(x) for x in a.budgets.split(",")]
    if "stage-padded" in rows_wanted:
        stage_rows("stage-padded", [16384], {"MEMSIFTER_EMBED_PACKED": "0"})
    # gpu-only: the packed forward alone, after each of the stage rows asked for (compiled after
    # "compile", as shipped); asked for alone, it runs uncompiled without the stage's timed rows
    gpu_only = "gpu-only" in rows_wanted
    if "stage" in rows_wanted or (gpu_only and "compile" not in rows_wanted):
        stage_rows("stage", budgets, {"MEMSIFTER_EMBED_PACKED": "1", "MEMSIFTER_EMBED_COMPILE": "0"},
                   gpu_only=gpu_only, timed_rows="stage" in rows_wanted)
    if "compile" in rows_wanted:
        stage_rows("stage+compile", budgets[-1:], {"MEMSIFTER_EMBED_PACKED": "1", "MEMSIFTER_EMBED_COMPILE": "1"},
                   gpu_only=gpu_only)
    if "pipeline" in rows_wanted:
        pipeline_row()

    # agreement with plain-bf16
    base_name = next((r["name"] for r in results if r["name"].startswith("plain")), None)
    for r in results:
        v = vectors.get(r["name"])
        if v and base_name and r["name"] != base_name:
            base = vectors[base_name]
            common = [h for h in v if h in base]
            cos = np.array([float(np.dot(v[h], base[h])) for h in common])
            r["cos_min"], r["cos_mean"] = float(cos.min()), float(cos.mean())
    ref = next((r for r in results if r["name"].startswith("plain") and not r.get("error")), None)
    base_note = (f"; in-process rows on the first {len(base_texts)} texts (hash order), pipeline on all"
                 if len(base_texts) < len(all_texts) else "")
    lines = [(f"device: {torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu'}; "
             f"{'bf16' if dev == 'cuda' else 'cpu fp32'} matmul peak measured in this call "
             f"{peak / 1e12:.2f} TFLOP/s = {100 * peak / H100_SXM_BF16_DENSE_FLOPS:.1f}% of the H100 SXM datasheet's "
             f"dense bf16 {H100_SXM_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s; inputs {os.path.basename(a.inputs.rstrip('/'))}: "
             f"{n_sess} sessions + {len(texts) - n_sess} questions, {total_tokens:,} tokens{base_note}; "
             f"repeats {a.repeats}: median (min-max)"),
             "",
             ("| row | texts | repeats | seconds | texts/s | tokens/s | MFU (measured peak) | MFU (datasheet 989) | "
              "peak GPU GiB | vs plain-bf16 (texts/s) | cos min vs plain |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("error"):
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | - | - | {r['error']} ({r['note']}) |")
            continue
        ratio = f"{r['texts_s'] / ref['texts_s']:.2f}x" if ref else "-"
        pct = {**r["mfu_spread"], **{q: 100 * r["mfu_spread"][q] for q in ("median", "min", "max")}}
        lines.append(f"| {r['name']} | {r['texts']} | {r['repeats']} | {fmt_spread(r['seconds_spread'])} | "
                     f"{fmt_spread(r['texts_s_spread'], '{:.1f}')} | {r['tokens_s']:,.0f} | "
                     f"{fmt_spread(pct, '{:.1f}')}% | {100 * r['mfu_datasheet']:.1f}% | {r['peak_gib']:.1f} | "
                     f"{ratio} | {r.get('cos_min', float('nan')):.5f} |")
    for r in results:
        if r.get("first_batch_s"):
            lines.append(f"\npipeline: first batch back after {fmt_spread(r['first_batch_s'])} s (actor start, model "
                         f"load, first batch); all texts / time after it: "
                         f"{fmt_spread(r['steady_texts_s_upper'], '{:.1f}')} texts/s; Ray init {r['ray_init_s']:.1f}s "
                         f"(once, not in the row)")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    with open(os.path.join(a.out, "embed.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "embed.json"), "w") as f:
        json.dump({"results": results, "peak_flops": peak, "args": vars(a)}, f, indent=2)


if __name__ == "__main__":
    main()
