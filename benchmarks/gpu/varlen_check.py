"""Which variable-length attention can verl 0.9.1's remove-padding (and so Ulysses sequence parallelism) use on
this GPU host? Issue 43 item 6. Run on the host, after `source benchmarks/gpu/install.sh`, with a candidate's
wheels on PYTHONPATH (e.g. flash-attn-4, CuTe DSL: `stage.py extra flash-attn-4==… nvidia-cutlass-dsl==…`):

    python3 benchmarks/gpu/varlen_check.py --out $OUT [--lengths 3000,5000,8192,1800] [--long 65536]

What it checks, each row on its own (a failing candidate is a row with its error, not a crash):
- ``kernel``: the candidate's varlen function, forward and backward, on Qwen3-4B's attention shape (32 query heads,
  8 key/value heads, head dim 128, bf16, causal) over packed sequences, against PyTorch's scaled-dot-product
  attention run on each sequence alone (max abs error of the output and of dq, dk, dv, scaled by the reference's
  largest magnitude);
- ``transformers``: the same packed batch through ``transformers.modeling_flash_attention_utils._flash_attention_forward``
  with ``position_ids`` (what verl's remove-padding calls, and what its Ulysses patch wraps), named by the
  ``attn_implementation`` verl is given;
- ``model``: a 2-layer Qwen3 (random weights) loaded with that ``attn_implementation``: logits of the packed rows
  (one row, position_ids restarting per sequence, verl's layout) against each sequence alone with SDPA;
- ``speed``: forward + backward seconds and TFLOP/s of each available varlen path (the candidate, PyTorch's own
  ``torch.nn.attention.varlen.varlen_attn``) and of SDPA per sequence, on the same packed batch, and at ``--long``
  tokens in one sequence.
Writes ``varlen_check.json`` (every row) and prints one line a row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: memsifter's patch for FA4

H_Q, H_KV, D = 32, 8, 128  # Qwen3-4B


def flops_causal(lengths: list[int]) -> float:
    # forward 2 matmuls (QK^T, PV) of 2*L*L*D each per head, halved by the causal mask; backward 2.5x forward
    fwd = sum(2 * 2 * L * L * D * H_Q / 2 for L in lengths)
    return fwd * 3.5


def packed(lengths, device, dtype, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, H_Q, D, generator=g).to(device, dtype)
    k = torch.randn(T, H_KV, D, generator=g).to(device, dtype)
    v = torch.randn(T, H_KV, D, generator=g).to(device, dtype)
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lengths)), dtype=torch.int32, device=device)
    return q, k, v, cu


def sdpa_each(q, k, v, lengths):
    import torch
    import torch.nn.functional as F

    outs, s = [], 0
    for L in lengths:
        qi, ki, vi = (t[s:s + L].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        s += L
    return torch.cat(outs)


def fa4_fn():
    from flash_attn.cute import flash_attn_varlen_func

    def f(q, k, v, cu, max_len):
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        return out[0] if isinstance(out, tuple) else out
    return f


def torch_varlen_fn():
    """PyTorch's own varlen attention (FlashAttention inside torch). Causal is ``window_size=(-1, 0)`` in newer
    releases, ``is_causal=True`` in the first ones; GQA is ``enable_gqa`` where it exists, else K/V repeated."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}

    def f(q, k, v, cu, max_len):
        rep = q.shape[1] // k.shape[1]
        kw = dict(causal)
        if rep > 1 and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)
    return f


CANDIDATES = {"flash_attn_4": fa4_fn, "torch_varlen_attn": torch_varlen_fn}


def check_kernel(name, make, lengths, device):
    import torch

    fn = make()
    q, k, v, cu = packed(lengths, device, torch.bfloat16)
    qs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    rs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    t0 = time.time()
    out = fn(*qs, cu, max(lengths))
    g = torch.randn_like(out)
    out.backward(g)
    torch.cuda.synchronize()
    first_s = time.time() - t0  # includes a JIT compile where the candidate compiles at run time
    ref = sdpa_each(*rs, lengths)
    ref.backward(g)
    errs = {}
    for nm, a, b in [("out", out, ref), ("dq", qs[0].grad, rs[0].grad), ("dk", qs[1].grad, rs[1].grad),
                     ("dv", qs[2].grad, rs[2].grad)]:
        errs[nm] = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
    return {"first_call_s": round(first_s, 2), "rel_err": {k2: round(v2, 5) for k2, v2 in errs.items()},
            "ok": all(e < 0.02 for e in errs.values())}


def time_path(fn, lengths, device, repeats=5):
    import torch

    q, k, v, cu = packed(lengths, device, torch.bfloat16, seed=1)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, cu, max(lengths))
    g = torch.randn_like(out)
    out.backward(g)
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(q, k, v, cu, max(lengths)).backward(g)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    s = sorted(ts)[len(ts) // 2]
    return {"tokens": sum(lengths), "fwd_bwd_s": round(s, 5), "tflops": round(flops_causal(lengths) / s / 1e12, 1)}


def check_transformers(impl, name, make, lengths, device):
    import torch
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    q, k, v, cu = packed(lengths, device, torch.bfloat16, seed=2)
    pos = torch.cat([torch.arange(L, device=device) for L in lengths]).unsqueeze(0)
    out = _flash_attention_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, sum(lengths),
                                   is_causal=True, position_ids=pos, attn_implementation=impl)
    ref = sdpa_each(q, k, v, lengths)
    err = float((out[0].float() - ref.float()).abs().max() / ref.float().abs().max())
    return {"implementation": impl, "rel_err": round(err, 5), "ok": err < 0.02}


def check_model(impl, lengths, device):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=1024, hidden_size=H_Q * D // 4, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=H_Q // 4, num_key_value_heads=H_KV // 4, head_dim=D,
                      max_position_embeddings=max(lengths) + 1)
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(cfg).to(device, torch.bfloat16).eval()
    ids = [torch.randint(0, 1024, (L,), device=device) for L in lengths]
    out = {}
    with torch.no_grad():
        m.config._attn_implementation = "sdpa"
        ref = torch.cat([m(input_ids=i.unsqueeze(0)).logits[0] for i in ids])
        m.set_attn_implementation(impl) if hasattr(m, "set_attn_implementation") else None
        m.config._attn_implementation = impl
        pos = torch.cat([torch.arange(L, device=device) for L in lengths]).unsqueeze(0)
        got = m(input_ids=torch.cat(ids).unsqueeze(0), position_ids=pos).logits[0]
    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    out.update({"implementation": impl, "rel_err": round(err, 5), "ok": err < 0.05})
    return out


def row(rows, kind, name, f):
    try:
        r = {"check": kind, "name": name, **f()}
    except Exception as e:  # a candidate that fails is a row with its error
        r = {"check": kind, "name": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}",
             "trace": traceback.format_exc()[-1500:]}
    rows.append(r)
    print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)


def table(rows: list[dict]) -> list[str]:
    """Markdown lines of a ``varlen_check.json``: the host, each correctness row, each speed row."""
    env = next(r for r in rows if r["check"] == "env")
    out = [f"- host: {env['device']} (sm_{''.join(map(str, env['capability']))}), torch {env['torch']} (CUDA "
           f"{env['cuda']}), transformers {env['transformers']}; flash-attn 2 installed: "
           f"{env['is_flash_attn_2_available']}, flash-attn-4 installed: {env['is_flash_attn_4_available']}",
           "", "| check | path | result | error against SDPA per sequence (max abs, relative) |", "|---|---|---|---|"]
    for r in rows:
        if r["check"] in ("kernel", "transformers", "model", "patch"):
            err = r.get("rel_err")
            err = (", ".join(f"{k} {v:.4f}" for k, v in err.items()) if isinstance(err, dict)
                   else f"logits {err:.4f}" if r["check"] == "model" and err is not None
                   else f"out {err:.4f}" if err is not None else "")
            res = "ok" if r.get("ok") else "fails: " + r.get("error", "").split("\n")[0][:90]
            out.append(f"| {r['check']} | {r['name']} | {res} | {err} |")
    out += ["", "| path | tokens (packed sequences) | forward + backward ms | TFLOP/s (causal, 3.5x forward) |",
            "|---|---:|---:|---:|"]
    for r in rows:
        if r["check"] == "speed" and r.get("fwd_bwd_s") is not None:
            out.append(f"| {r['name']} | {r['tokens']:,} | {r['fwd_bwd_s'] * 1e3:.2f} | {r['tflops']:.1f} |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--lengths", default="3000,5000,8192,1800")
    ap.add_argument("--long", type=int, default=65536, help="one sequence this long for the speed rows (0: none)")
    ap.add_argument("--candidates", default="flash_attn_4,torch_varlen_attn")
    ap.add_argument("--table", metavar="JSON", help="print the tables of a varlen_check.json and stop")
    ap.add_argument("--site", action="append", default=[],
                    help="a folder of installed candidate wheels (pip --target), added as a site dir: its .pth files "
                         "count (nvidia-cutlass-dsl puts its packages on the path through one)")
    a = ap.parse_args(argv)
    if a.table:
        print("\n".join(table(json.load(open(a.table)))))
        return 0
    import site

    for d in a.site:
        site.addsitedir(d)
        sys.path.remove(d)
        sys.path.insert(0, d)
    import torch
    import transformers
    from transformers.utils import import_utils as iu

    device = torch.device("cuda")
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = [{"check": "env", "torch": torch.__version__, "cuda": torch.version.cuda,
             "device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
             "transformers": transformers.__version__,
             "is_flash_attn_2_available": iu.is_flash_attn_2_available(),
             "is_flash_attn_4_available": getattr(iu, "is_flash_attn_4_available", lambda: None)()}]
    print(json.dumps(rows[0]), flush=True)
    names = [c for c in a.candidates.split(",") if c]
    for n in names:
        row(rows, "kernel", n, lambda n=n: check_kernel(n, CANDIDATES[n], lengths, device))
    if "flash_attn_4" in names:
        # first as transformers calls FA4 by itself, then with memsifter's patch (what every train process gets:
        # memsifter.training.verl_patches.install_fa4, imported by `import verl` in the run's Ray workers)
        for tag in ("flash_attn_4", "flash_attn_4+memsifter"):
            if tag.endswith("+memsifter"):
                import transformers.modeling_flash_attention_utils as fau

                from memsifter.training import verl_patches

                row(rows, "patch", tag, lambda: {"ok": verl_patches.install_fa4()})
                fau._loaded_implementation = None  # transformers caches the function it imported first
            row(rows, "transformers", tag, lambda: check_transformers("flash_attention_4", "flash_attn_4",
                                                                      fa4_fn, lengths, device))
            row(rows, "model", tag, lambda: check_model("flash_attention_4", lengths, device))
    for n in names:
        row(rows, "speed", n, lambda n=n: time_path(CANDIDATES[n](), lengths, device))
        if a.long:
            row(rows, "speed", n, lambda n=n: time_path(CANDIDATES[n](), [a.long], device, repeats=3))
    row(rows, "speed", "sdpa_each", lambda: time_path(lambda q, k, v, cu, m: sdpa_each(q, k, v, lengths),
                                                     lengths, device))
    if a.long:
        row(rows, "speed", "sdpa_each", lambda: time_path(lambda q, k, v, cu, m: sdpa_each(q, k, v, [a.long]),
                                                         [a.long], device, repeats=3))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "varlen_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if any(r.get("ok") for r in rows if r["check"] == "kernel") else 1


if __name__ == "__main__":
    sys.exit(main())
