#!/usr/bin/env python3
"""Embed stage on a GPU: the stage's ``Embedder`` against a plain bf16 baseline and the original.

    source benchmarks/gpu/install.sh && python3 benchmarks/gpu/run_embed.py --out "$OUT"

Workload: the real LongMemEval_S dev30 sessions (``.gpu/inputs/dev30``, built by prepare_inputs.py),
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
tokens / time / the bf16 peak measured here with an 8192^3 matmul), peak GPU memory, and the cosine
agreement of every row's vectors with ``plain-bf16``'s.
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


def matmul_peak(torch) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * n / (time.perf_counter() - t)


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
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    rows_wanted = a.rows.split(",")

    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    from bench_embed_gpu import build_encoder
    from memsifter import embedding
    from memsifter.data.model import read_dataset
    from memsifter.packed import flops_per_text
    from memsifter.render import render_session
    from memsifter.testing import env_vars

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
    ids = {h: tok(t, truncation=True, max_length=a.max_length)["input_ids"] for h, t in texts}
    lens = {h: len(v) for h, v in ids.items()}
    n_sess = sum(1 for s in ds.sessions.values() if embedding.text_hash(render_session(s.turns)) in lens)
    total_tokens = sum(lens.values())
    flops = {h: flops_per_text(cfg, n) for h, n in lens.items()}
    print(f"{len(texts)} distinct texts ({n_sess} sessions + questions), {total_tokens:,} tokens, "
          f"session mean {np.mean([lens[h] for h in (embedding.text_hash(render_session(s.turns)) for s in ds.sessions.values()) if h in lens]):.0f} "
          f"tokens, max {max(lens.values())}", flush=True)
    peak = matmul_peak(torch) if dev == "cuda" else float("nan")
    print(f"bf16 matmul peak measured: {peak / 1e12:.0f} TFLOP/s", flush=True)
    results: list[dict] = []
    vectors: dict[str, dict[str, np.ndarray]] = {}

    def timed(name: str, batches: list[list[tuple[str, str]]], encode, note: str = "") -> None:
        out = {}
        try:
            for b in batches[:2]:  # warm-up (kernels, allocator, compile); an OOM here is a result too
                encode([t for _, t in b])
            if dev == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            for b in batches:
                v = encode([t_ for _, t_ in b])
                out.update(zip([h for h, _ in b], v))
            if dev == "cuda":
                torch.cuda.synchronize()
        except torch.OutOfMemoryError as e:
            results.append({"name": name, "error": f"OOM: {str(e).splitlines()[0][:120]}", "note": note})
            print(f"{name}: out of memory ({note})", flush=True)
            torch.cuda.empty_cache()
            return
        secs = time.perf_counter() - t
        hs = [h for b in batches for h, _ in b]
        toks = sum(lens[h] for h in hs)
        fl = sum(flops[h] for h in hs)
        r = {"name": name, "texts": len(hs), "tokens": toks, "seconds": secs, "texts_s": len(hs) / secs,
             "tokens_s": toks / secs, "mfu": fl / secs / peak if dev == "cuda" else float("nan"),
             "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan"),
             "batches": len(batches), "note": note}
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
        unsorted = texts  # input (hash) order: no length sorting
        b256 = [unsorted[i:i + 256] for i in range(0, len(unsorted), 256)]
        timed("original (fp32, batch 256)", b256[:2], enc, "first 512 texts")
        if results[-1].get("error"):
            sub = unsorted[:a.original_texts]
            timed("original (fp32, batch 32)", [sub[i:i + 32] for i in range(0, len(sub), 32)], enc,
                  f"first {len(sub)} texts")
        del m
        torch.cuda.empty_cache() if dev == "cuda" else None

    if "plain" in rows_wanted:
        m, enc = hf_encoder(torch.bfloat16 if dev == "cuda" else torch.float32)
        plan = embedding.plan_batches(texts, a.max_length, tokens_per_batch=a.plain_budget, max_batch_size=256)
        with env_vars({"TOKENIZERS_PARALLELISM": "true"}):  # the baseline at its best: Rust's own pool
            timed("plain-bf16 (HF, sorted, SDPA)", plan, enc, f"padded budget {a.plain_budget}")
        del m
        torch.cuda.empty_cache() if dev == "cuda" else None
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as in the chart: the stage uses its own threads

    def real_token_plan(bud: int) -> list[list[tuple[str, str]]]:
        order = sorted(texts, key=lambda x: (-lens[x[0]], x[0]))
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

    def stage_rows(prefix: str, budgets: list[int], env: dict[str, str], gpu_only: bool = False) -> None:
        with env_vars(env):
            spec = embedding.ModelSpec.resolve(model_dir, pooling="cls", max_length=a.max_length)
            e = embedding.Embedder(spec, device=dev)
            print(f"{prefix}: dtype {next(e.model.parameters()).dtype}, packed={e.packed is not None}"
                  f"{', compiled' if e.packed is not None and e.packed.compiled else ''}", flush=True)
            for bud in budgets:
                if e.packed is not None:  # real tokens: plan with the exact lengths
                    plan = real_token_plan(bud)
                else:
                    plan = embedding.plan_batches(texts, a.max_length, tokens_per_batch=bud)
                timed(f"{prefix} (budget {bud})", plan, e.encode,
                      f"packed real tokens, {embedding.tokenizer_threads()} tokenizer threads"
                      if e.packed is not None else "padded tokens, stage default plan")
            if gpu_only and e.packed is not None:
                by_text = {t: ids[h] for h, t in texts}
                timed(f"gpu-only: packed forward, ids tokenized beforehand (budget {budgets[-1]})",
                      real_token_plan(budgets[-1]),
                      lambda b: e.packed.encode_ids([by_text[t] for t in b]).cpu().numpy(), "no tokenization")
            if a.profile and e.packed is not None and dev == "cuda":
                profile(e, real_token_plan(budgets[-1])[len(real_token_plan(budgets[-1])) // 2])
            del e
        torch.cuda.empty_cache() if dev == "cuda" else None

    def pipeline_row() -> None:
        """The stage's own path: Ray Data actor pool, default plan (batch_defaults), local store."""
        import shutil

        store_dir = os.path.join(a.work, "store")
        shutil.rmtree(store_dir, ignore_errors=True)
        spec = embedding.ModelSpec.resolve(model_dir, pooling="cls", max_length=a.max_length)
        store = embedding.EmbeddingStore(store_dir, spec)
        embedding.ensure_ray()
        try:
            st = embedding.embed_missing(store, texts, workers=1)
        except Exception as ex:  # noqa: BLE001 - report, keep the other rows
            results.append({"name": "pipeline", "error": repr(ex)[:200], "note": "embed_missing"})
            return
        store.load()
        secs = st["embed_seconds"]
        r = {"name": "pipeline: embed_missing (Ray Data actor, default plan, incl. model load)",
             "texts": st["embedded"], "tokens": total_tokens, "seconds": secs, "texts_s": st["embedded"] / secs,
             "tokens_s": total_tokens / secs, "mfu": sum(flops.values()) / secs / peak if dev == "cuda" else float("nan"),
             "peak_gib": float("nan"), "batches": st["batches_run"],
             "note": f"plan {st['tokens_per_batch']} tokens / {st['max_batch_size']} texts; first batch back after "
                     f"{st['first_batch_seconds']} s"}
        results.append(r)
        vectors[r["name"]] = {h: store.get(h) for h, _ in texts if h in store}
        print(json.dumps(r), flush=True)

    budgets = [int(x) for x in a.budgets.split(",")]
    if "stage-padded" in rows_wanted:
        stage_rows("stage-padded", [16384], {"MEMSIFTER_EMBED_PACKED": "0"})
    if "stage" in rows_wanted:
        stage_rows("stage", budgets, {"MEMSIFTER_EMBED_PACKED": "1", "MEMSIFTER_EMBED_COMPILE": "0"},
                   gpu_only="gpu-only" in rows_wanted)
    if "compile" in rows_wanted:
        stage_rows("stage+compile", budgets[-1:], {"MEMSIFTER_EMBED_PACKED": "1", "MEMSIFTER_EMBED_COMPILE": "1"})
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
    lines = [f"device: {torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu'}; bf16 matmul peak "
             f"{peak / 1e12:.0f} TFLOP/s; {n_sess} dev30 sessions + {len(texts) - n_sess} questions, "
             f"{total_tokens:,} tokens",
             "",
             "| row | texts | seconds | texts/s | tokens/s | MFU | peak GPU GiB | vs plain-bf16 | cos min vs plain |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("error"):
            lines.append(f"| {r['name']} | - | - | - | - | - | - | - | {r['error']} ({r['note']}) |")
            continue
        ratio = f"{r['texts_s'] / ref['texts_s']:.2f}x" if ref else "-"
        lines.append(f"| {r['name']} | {r['texts']} | {r['seconds']:.2f} | {r['texts_s']:.1f} | {r['tokens_s']:,.0f} | "
                     f"{100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | {ratio} | {r.get('cos_min', float('nan')):.5f} |")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    with open(os.path.join(a.out, "embed.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "embed.json"), "w") as f:
        json.dump({"results": results, "peak_flops": peak, "args": vars(a)}, f, indent=2)


if __name__ == "__main__":
    main()
