"""The real SmolLM2-135M-Instruct as a ranker, on CPU: where an untrained 135M model stands (issue 16).

All through the platform: `memsifter run import` of the shipped samples, `memsifter run embed`
(all-MiniLM-L6-v2, the stage's default first stage), then `memsifter run rank --engine endpoint`
against one vLLM (CPU) OpenAI-compatible server of `smollm2-135m-instruct`, once per variant. Every
variant ranks the same questions; per question the table compares, over the sessions the ranker was
shown (`prompts.parquet`):

- the model's free generation (no prefill), free generation after a `<ranking>` prefill (the direct
  prompt's default), and structured outputs (`<ranking>` forced by regex):
  valid-format rate, NDCG@10 of the model's own ranking (invalid = 0, as the reward counts it) and of
  the published ranking (invalid -> the first stage's order, the stage's fallback);
- a random valid ranking of the shown sessions (mean of 20 seeds);
- the first stage's order of the shown sessions, and its full-haystack NDCG@10.

Session views: whole sessions vs `session_tokens` caps (a longer session shows its turns that share
most words with the question), at the same context limit: more, shorter sessions fit.

    python benchmarks/bench_ranker.py --locomo 20 --lme 10 --out /tmp/bench-ranker
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def sh(args: list[str], log: str) -> None:
    with open(log, "a") as f:
        r = subprocess.run([sys.executable, "-m", "memsifter.cli", *args, "-q"], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): memsifter {' '.join(args)}; log {log}")


def ndcg10(ranked: list[str], gold: list[str]) -> float:
    from memsifter.retrieval.metrics import question_metrics

    return question_metrics(ranked, gold, [10])["ndcg@10"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--locomo", type=int, default=20, help="first LoCoMo questions of the shipped sample (conv-26)")
    p.add_argument("--lme", type=int, default=10, help="LongMemEval_S dev questions")
    p.add_argument("--context-limit", type=int, default=3000)
    p.add_argument("--caps", default="none,384", help="session_tokens values to compare ('none' = whole)")
    p.add_argument("--out", default="/tmp/bench-ranker")
    a = p.parse_args()
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(k, v)
    from memsifter.models import registry as models
    from memsifter.retrieval import rankings
    from memsifter import samples
    from memsifter.store import storage
    from memsifter.data.model import read_dataset
    from memsifter.testing.servers import vllm_server

    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "bench.log")
    model = models.resolve("smollm2-135m-instruct")
    sets = []
    if a.locomo:
        sets.append(("locomo", "locomo", "locomo_dev2.json.gz", [], a.locomo))
    if a.lme:
        sets.append(("longmemeval", "longmemeval", "longmemeval_s_dev30.json.gz", [], a.lme))
    t0 = time.time()
    for name, fmt, sample, _, n in sets:
        d = os.path.join(a.out, name)
        sh(["run", "import", "--format", fmt, "--source", samples.path(sample), "--output", d, "--limit", str(n)], log)
        sh(["run", "embed", "--input", d, "--output", d + "-embed", "--model", "all-MiniLM-L6-v2"], log)
    print(f"[bench] data + first stage in {time.time() - t0:.0f}s", flush=True)
    caps = [None if c == "none" else int(c) for c in a.caps.split(",")]
    results: dict = {}
    with vllm_server(model, "smollm2", extra_args=["--max-model-len", "8192"],
                     log_path=os.path.join(a.out, "vllm.log")) as url:
        for name, _, _, _, n in sets:
            d = os.path.join(a.out, name)
            ds = read_dataset(d)
            qs = [q for q in ds.questions[:n] if rankings.eligible(q)]  # the first n (rank --limit n)
            emb = {r["question_id"]: r["ranked_session_ids"] for r in rankings.read_rankings(d + "-embed")}
            for cap in caps:
                for output in ("free", "free+prefill", "structured"):
                    structured = output == "structured"
                    tag = f"{name}-cap{cap or 'none'}-{output}"
                    out = os.path.join(a.out, tag)
                    t1 = time.time()
                    args = ["run", "rank", "--input", d, "--limit", str(n), "--embeddings", d + "-embed", "--output", out,
                            "--model", "smollm2-135m-instruct", "--context-limit", str(a.context_limit),
                            "--engine", "endpoint", "--set", f"endpoint.base_url={url}",
                            "--set", "endpoint.model=smollm2", "--set", "endpoint.concurrency=4"]
                    if cap:
                        args += ["--session-tokens", str(cap)]
                    if structured:
                        args += ["--constrained-output"]
                    if output == "free":
                        args += ["--answer-prefix", ""]  # no '<ranking>' prefill
                    sh(args, log)
                    secs = time.time() - t1
                    rows = {r["question_id"]: r for r in rankings.read_rankings(out)}
                    shown = {r["question_id"]: r["shown_session_ids"]
                             for r in storage.read_parquet(storage.published_file(out, "prompts.parquet")).to_pylist()}
                    own, pub, rnd, first_shown, first_full, valid, nshown = [], [], [], [], [], 0, []
                    for q in qs:
                        r, sh_ids = rows[q.question_id], shown[q.question_id]
                        nshown.append(len(sh_ids))
                        first = [s for s in emb[q.question_id] if s in set(sh_ids)]
                        ok = r["status"] == "ok"
                        valid += ok
                        head = r["ranked_session_ids"][:10] if ok else []
                        own.append(ndcg10(head, q.gold_session_ids))
                        pub.append(ndcg10(r["ranked_session_ids"], q.gold_session_ids))
                        rnd.append(sum(ndcg10(random.Random(s).sample(sh_ids, len(sh_ids)), q.gold_session_ids)
                                       for s in range(20)) / 20)
                        first_shown.append(ndcg10(first, q.gold_session_ids))
                        first_full.append(ndcg10(emb[q.question_id], q.gold_session_ids))
                    mean = lambda xs: round(sum(xs) / max(1, len(xs)), 3)  # noqa: E731
                    results[tag] = {"dataset": name, "cap": cap, "output": output, "n": len(qs),
                                    "valid": round(valid / len(qs), 3), "ndcg_own": mean(own), "ndcg_published": mean(pub),
                                    "ndcg_random_shown": mean(rnd), "ndcg_first_stage_shown": mean(first_shown),
                                    "ndcg_first_stage_full": mean(first_full), "sessions_shown": mean(nshown),
                                    "seconds": round(secs, 1)}
                    print(f"[bench] {tag}: {json.dumps(results[tag])}", flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("\n| dataset | session view | sessions shown | output | valid format | NDCG@10 model (invalid = 0) | "
          "NDCG@10 published (fallback = first stage) | random valid ranking of shown | first stage, shown | "
          "first stage, full haystack | seconds |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results.values():
        print(f"| {r['dataset']} (n={r['n']}) | {'whole' if not r['cap'] else '≤' + str(r['cap']) + ' tokens'} | "
              f"{r['sessions_shown']} | {r['output']} | {r['valid']:.0%} | "
              f"{r['ndcg_own']:.3f} | {r['ndcg_published']:.3f} | {r['ndcg_random_shown']:.3f} | "
              f"{r['ndcg_first_stage_shown']:.3f} | {r['ndcg_first_stage_full']:.3f} | {r['seconds']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
