"""The trained agents' adapter answering in ONE call: is the agents' gain search and reading, or answer style?

The memory agents' SFT adapter (``smollm2-135m-memsifter-agents``) beat the base model answering from the first
stage's sessions (held-out F1 0.166 searching, 0.099 reading, against 0.053). The base answers in prose and token
F1 punishes prose, so part of that gain may be the short answers the adapter learned, not the searching. This
control gives the adapter the base's own one-call contexts (the chat stage: no memory, the first stage's top
sessions, the gold sessions; the same prompt, budget and greedy decoding as the base rows) on the same held-out
questions, and scores everything in ONE ``evaluate``:

- the GPU run's answers (``--answers``: ``chat-base``, ``agents-base``, ``agents-sft`` parquet files of
  ``benchmarks/gpu/results/2026-11-26-h100-agents-sft/answers``);
- this run's ``chat-sft`` output: the adapter served by ``memsifter models serve`` (vLLM on the CPU).

The held-out questions are the ones the GPU run answered (read from its chat rows); the first stage is rebuilt
here with the same stage and flags, and the contexts are checked to be the same sessions as the base rows had.
Paired differences (the same questions), overall and per dataset, come with 95% bootstrap intervals. Writes
``report.md`` (evaluate's), ``paired.json``, ``one_call.md`` and the adapter's per-question answers
(``chat-sft.parquet``: what recomputes every figure) into ``--out``. On 2 CPU cores vLLM reads about 270 prompt tokens/s at this length: the
first stage's 6,000-token contexts of all 260 questions would take 1.6 hours, hence ``--every`` and ``--baselines``.

    python benchmarks/bench_agents_one_call.py --lme ../shared/data/longmemeval_s_train348.json.gz \\
        --locomo ../shared/data/locomo_dev2.json.gz \\
        --answers benchmarks/gpu/results/2026-11-26-h100-agents-sft/answers \\
        --out benchmarks/results/agents-one-call-2026-11-26 --every 2 --baselines none
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))
from run_agents import Server, bm25, publish_questions  # noqa: E402
from run_train import ROOT, ms, sh, write_yaml  # noqa: E402

sys.path.insert(0, ROOT)

ADAPTER = "smollm2-135m-memsifter-agents"
# the base rows' labels in the GPU run's chat output -> the same context for the adapter
CHAT_METHODS = {"no memory": "none", "embed:bm25": "first stage", "oracle (gold sessions)": "oracle"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def heldout(a, ids: list[str]) -> str:
    """The GPU run's held-out questions, imported here and published as one dataset, with its BM25 first stage."""
    from memsifter.data.model import read_dataset
    from memsifter.store import storage

    out = os.path.join(a.work, "heldout")
    if storage.exists(f"{out}/_SUCCESS"):
        return out
    parts = []
    for fmt, src, name in (("longmemeval", a.lme, "longmemeval_s"), ("locomo", a.locomo, "locomo")):
        dst = os.path.join(a.work, name)
        sh(ms("run", "import", "--format", fmt, "--source", src, "--output", dst, "--dataset-name", name, "-q"),
           f"{a.out}/import-{name}.log")
        parts.append(read_dataset(dst))
    split = None
    if getattr(a, "split", None):   # the GPU run's split.json: the questions must be its held-out split's
        with open(a.split) as f:
            split = json.load(f)
    publish_questions(parts, ids, out, "the GPU run's held-out questions", split)
    bm25(a, out)  # the GPU driver's first stage: BM25 alone
    return out


def paired(rows: dict[str, dict[str, float]], a: str, b: str) -> dict:
    """F1 of ``a`` minus ``b`` on the questions both answered: mean, 95% bootstrap interval, n."""
    from memsifter.retrieval.metrics import bootstrap_ci

    common = sorted(set(rows[a]) & set(rows[b]))
    d = [rows[a][q] - rows[b][q] for q in common]
    lo, hi = bootstrap_ci(d, resamples=2000)
    return {"a": a, "b": b, "n": len(d), "diff": round(sum(d) / len(d), 4), "ci": [round(lo, 4), round(hi, 4)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lme", required=True, help="LongMemEval_S file the GPU run used")
    ap.add_argument("--locomo", required=True, help="LoCoMo file the GPU run used")
    ap.add_argument("--answers", required=True, help="the GPU run's answers/ (chat-base, agents-base, agents-sft)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="scratch (default OUT/_work; a re-run skips what is published)")
    ap.add_argument("--split", default=None, help="the GPU run's split.json (run_agents.py copies it to its --out): "
                    "its held-out questions are checked against it (memsifter.data.splits); runs before split.json "
                    "existed (2026-11-26) have none")
    ap.add_argument("--model", default=ADAPTER, help="the adapter (registry name or directory)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None, help="only the first N held-out questions (a quick look)")
    ap.add_argument("--every", type=int, default=1, help="every Nth held-out question (in the GPU run's order: "
                    "both datasets keep their share); the CPU's prefill sets the budget")
    ap.add_argument("--baselines", default="none,oracle", help="one-call contexts besides the first stage's "
                    "(comma-separated of none, oracle; empty for the first stage alone)")
    a = ap.parse_args()
    a.out = os.path.abspath(a.out)
    a.work = os.path.abspath(a.work or os.path.join(a.out, "_work"))
    os.makedirs(a.work, exist_ok=True)
    import pyarrow as pa
    import pyarrow.parquet as pq

    from memsifter.store import storage

    base_chat = os.path.join(os.path.abspath(a.answers), "chat-base.parquet")
    for n in ("chat-base", "agents-base", "agents-sft"):
        if not os.path.isfile(os.path.join(os.path.abspath(a.answers), f"{n}.parquet")):
            ap.error(f"--answers {a.answers}: {n}.parquet is missing (the GPU run's answers/)")
    for flag, path in (("--lme", a.lme), ("--locomo", a.locomo)):
        if not os.path.isfile(path):
            ap.error(f"{flag} {path}: no such file")
    gpu = pq.read_table(base_chat).to_pylist()
    ids = list(dict.fromkeys(r["question_id"] for r in gpu))[::a.every][:a.limit]
    gpu = [r for r in gpu if r["question_id"] in set(ids)]
    t0 = time.time()
    data = heldout(a, ids)
    times = {"data": round(time.time() - t0, 1)}

    out = os.path.join(a.work, "chat-sft")
    if not storage.exists(f"{out}/_SUCCESS"):
        port = free_port()
        t = time.time()
        srv = Server(ms("models", "serve", a.model, "--port", str(port), "--max-model-len", "8192",
                        "--served-name", "agent"), f"{a.out}/vllm.log", port, "/v1/models", timeout=900)
        times["server start"] = round(time.time() - t, 1)
        try:
            t = time.time()
            cfg = write_yaml(f"{a.work}/chat-sft.yaml", {  # the GPU driver's answer_chat, with the adapter
                "input": data, "rankings": f"{data}-embed", "output": out,
                "baselines": [b for b in a.baselines.split(",") if b],
                "endpoint": {"base_url": f"http://127.0.0.1:{port}/v1", "model": "agent", "api_key_env": None,
                             "concurrency": a.concurrency, "timeout_s": 900, "temperature": 0.0, "max_tokens": 64},
                "context_tokens": 6144, "max_failed_fraction": 0.02})
            sh(ms("run", "chat", "--config", cfg), f"{a.out}/chat-sft.log")
            times["answers"] = round(time.time() - t, 1)
        finally:
            srv.stop()

    # the same contexts as the base rows? (the first stage is rebuilt here, not copied)
    mine = {(r["method"], r["question_id"]): r for r in storage.read_parquet(
        storage.published_file(out, "answers.parquet")).to_pylist()}
    same = {m: [0, 0] for m in CHAT_METHODS}
    for r in gpu:
        o = mine.get((r["method"], r["question_id"]))
        if o is None or r["method"] not in same:
            continue
        same[r["method"]][1] += 1
        same[r["method"]][0] += list(o["context_session_ids"] or []) == list(r["context_session_ids"] or [])

    # the GPU run's rows of these questions only (evaluate scores every row of a file it is given)
    answers = []
    for n in ("chat-base", "agents-base", "agents-sft"):
        t = pq.read_table(os.path.join(os.path.abspath(a.answers), f"{n}.parquet")).to_pylist()
        path = os.path.join(a.work, f"{n}.parquet")
        pq.write_table(pa.Table.from_pylist([r for r in t if r["question_id"] in set(ids)]), path)
        answers.append(path)
    answers.append(out)
    ev = os.path.join(a.work, "evaluate")
    cfg = write_yaml(f"{a.work}/evaluate.yaml", {"input": data, "rankings": [f"{data}-embed"], "answers": answers,
                                                 "output": ev})
    sh(ms("run", "evaluate", "--config", cfg, "--force"), f"{a.out}/evaluate.log")
    for f in ("report.md", "report.json", "answer_f1_and_cost.png", "answer_f1_by_method.png"):
        if storage.exists(f"{ev}/{f}"):
            storage.copy_file(f"{ev}/{f}", f"{a.out}/{f}")

    # per-question F1 of every row set, keyed the way the table names them
    f1: dict[str, dict[str, float]] = {}
    for name, path in (("base", answers[0]), ("sft", storage.published_file(out, "answers.parquet"))):
        for r in storage.read_parquet(path).to_pylist():
            if r["status"] == "ok" and r["method"] in CHAT_METHODS:
                f1.setdefault(f"chat {CHAT_METHODS[r['method']]}, {name}", {})[r["question_id"]] = r["f1"] or 0.0
    for name in ("agents-base", "agents-sft"):
        for r in pq.read_table(os.path.join(os.path.abspath(a.answers), f"{name}.parquet")).to_pylist():
            if r["question_id"] in set(ids):
                f1.setdefault(f"{r['method']}, {name.split('-')[1]}", {})[r["question_id"]] = r["f1"] or 0.0
    pairs = [paired(f1, x, y) for x, y in (
        ("chat first stage, sft", "chat first stage, base"),
        ("chat none, sft", "chat none, base"),
        ("chat oracle, sft", "chat oracle, base"),
        ("agent:search, sft", "chat first stage, sft"),
        ("agent:memory, sft", "chat first stage, sft"),
        ("agent:search, sft", "chat none, sft"),
        ("agent:memory, sft", "chat none, sft"),
    ) if x in f1 and y in f1]
    # per dataset too, from the per-question answers this run keeps beside its tables (chat-sft.parquet)
    dataset_of = {r["question_id"]: r["dataset"] for r in gpu}
    by_dataset = {d: [paired({k: {q: v for q, v in rows.items() if dataset_of.get(q) == d} for k, rows in f1.items()},
                             p["a"], p["b"]) for p in pairs]
                  for d in sorted(set(dataset_of.values()))}
    storage.copy_file(storage.published_file(out, "answers.parquet"), f"{a.out}/chat-sft.parquet")
    from memsifter.retrieval.metrics import bootstrap_ci

    means = {k: {"n": len(v), "f1": round(sum(v.values()) / len(v), 4),
                 "ci": [round(x, 4) for x in bootstrap_ci(list(v.values()))]} for k, v in f1.items()}
    result = {"questions": len(ids), "same_context_as_base": same, "times_s": times, "f1": means, "paired": pairs,
              "paired_by_dataset": by_dataset}
    with open(f"{a.out}/paired.json", "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| rows | n | F1 [95% CI] |", "|---|---:|---|"]
    lines += [f"| {k} | {v['n']} | {v['f1']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}] |" for k, v in sorted(means.items())]
    lines += ["", "| paired (same questions) | n | F1 difference [95% CI] |", "|---|---:|---|"]
    lines += [f"| {p['a']} − {p['b']} | {p['n']} | {p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] |"
              for p in pairs]
    for d, ps in by_dataset.items():
        lines += ["", f"| paired, {d} only | n | F1 difference [95% CI] |", "|---|---:|---|"]
        lines += [f"| {p['a']} − {p['b']} | {p['n']} | {p['diff']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] |"
                  for p in ps]
    lines += ["", "Contexts identical to the base rows' (rebuilt first stage): " +
              ", ".join(f"{m} {s[0]}/{s[1]}" for m, s in same.items()), "", f"Seconds: {json.dumps(times)}"]
    with open(f"{a.out}/one_call.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
