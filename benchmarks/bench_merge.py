"""Benchmark: streaming checkpoint averaging (``memsifter run merge``) vs the naive baseline.

The naive baseline is what the original script does: load N whole models, convert them to float32,
average, save. The streaming merge reads one tensor at a time from every input (ranged reads),
accumulates in float32 and writes the output shard as it goes.

Each variant runs in its own process; peak memory is the process's peak RSS (VmHWM) during the merge
minus its RSS before it (after imports), so both start from the same baseline. Same inputs, same run.

    python benchmarks/bench_merge.py                      # 2 and 4 models of ~128 MB (bf16)
    python benchmarks/bench_merge.py --n 2 4 8 --tensors 16 --rows 4096 --cols 2048
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
import torch
from safetensors.torch import load_file, save_file

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # MB

variant, inputs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
if variant == "streaming":
    from memsifter.stages.merge import merge_models
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS mark: measure the merge only
t0 = time.perf_counter()
if variant == "streaming":
    merge_models(inputs, [1 / len(inputs)] * len(inputs), "bfloat16", None, out_dir=out)
else:  # the original: N whole models in float32, then the average
    models = [{k: v.float() for k, v in load_file(os.path.join(p, "model.safetensors")).items()} for p in inputs]
    avg = {k: (sum(m[k] for m in models) / len(models)).to(torch.bfloat16) for k in models[0]}
    save_file(avg, os.path.join(out, "model.safetensors"))
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": status("VmHWM") - before}))
"""


def make_models(root: str, n: int, tensors: int, rows: int, cols: int) -> list[str]:
    import torch
    from safetensors.torch import save_file

    paths = []
    for i in range(n):
        d = os.path.join(root, f"m{i}")
        os.makedirs(d, exist_ok=True)
        g = torch.Generator().manual_seed(i)
        save_file({f"layers.{j}.weight": torch.randn(rows, cols, generator=g).to(torch.bfloat16)
                   for j in range(tensors)}, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"architectures": ["Bench"], "torch_dtype": "bfloat16"}, f)
        with open(os.path.join(d, "tokenizer.json"), "w") as f:
            json.dump({"v": 1}, f)
        paths.append(d)
    return paths


def run(variant: str, inputs: list[str], tmp: str) -> dict:
    out = tempfile.mkdtemp(dir=tmp, prefix=f"{variant}-")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", CHILD, variant, json.dumps(inputs), out], capture_output=True,
                       text=True, env=env, check=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4], help="numbers of models to average")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--tmp", default=None, help="scratch directory (default: system tmp)")
    args = ap.parse_args(argv)
    if not os.access("/proc/self/clear_refs", os.W_OK):
        print("needs Linux /proc/self/clear_refs to measure peak RSS", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="bench-merge-", dir=args.tmp)
    try:
        t0 = time.time()
        paths = make_models(tmp, max(args.n), args.tensors, args.rows, args.cols)
        model_mb = os.path.getsize(os.path.join(paths[0], "model.safetensors")) / 2 ** 20
        tensor_mb = args.rows * args.cols * 4 / 2 ** 20
        print(f"inputs: {max(args.n)} models of {model_mb:.0f} MB (bf16), {args.tensors} tensors of "
              f"{args.rows}x{args.cols} ({tensor_mb:.0f} MB in float32); made in {time.time() - t0:.1f}s\n")
        header = (f"{'N':>3} | {'streaming peak MB':>17} | {'naive peak MB':>13} | {'memory ratio':>12} | "
                  f"{'streaming s':>11} | {'naive s':>8} | {'time ratio':>10}")
        print(header)
        print("-" * len(header))
        for n in args.n:
            s = run("streaming", paths[:n], tmp)
            b = run("naive", paths[:n], tmp)
            print(f"{n:>3} | {s['peak_mb']:>17.1f} | {b['peak_mb']:>13.1f} | "
                  f"{b['peak_mb'] / max(s['peak_mb'], 1e-9):>11.1f}x | {s['seconds']:>11.2f} | "
                  f"{b['seconds']:>8.2f} | {b['seconds'] / max(s['seconds'], 1e-9):>9.2f}x")
        print("\nmemory ratio = naive / streaming peak RSS above the pre-merge baseline; time ratio = naive / "
              "streaming wall time.")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
