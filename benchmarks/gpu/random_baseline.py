#!/usr/bin/env python3
"""The reference issue 17's targets are measured against: a *random valid ranking of the same shown
sessions*, scored the way the rank stage publishes a ranking.

For each held-out rank config of a GPU run (``results/<run>/configs/rank-*-<part>.yaml``), this rebuilds
the ranker's prompts with the rank stage's own code (same dataset, first stage, tokenizer, budget and
condensing, so the same sessions are shown), then draws ``--draws`` random permutations of the shown
ids per question; each permutation's first ``top_k`` ids are the head, completed in first-stage order
(:func:`memsifter.retrieval.rankings.complete_ranking`), exactly as a valid answer is. Reported: mean NDCG@10
and recall_any@5 over the eligible questions (mean over draws, and their spread), next to the first
stage's order through the same code (which must reproduce the run's first-stage row: a check that the
prompts are the run's). No model runs here; CPU only.

    .venv/bin/python benchmarks/gpu/random_baseline.py benchmarks/gpu/results/2026-11-24-h100-m1 \
        --data .gpu/ranker/data
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from memsifter.models import registry as models
from memsifter.retrieval import rankings  # noqa: E402
from memsifter.retrieval.context import TokenCounter, load_tokenizer  # noqa: E402
from memsifter.data.model import read_dataset  # noqa: E402
from memsifter.retrieval.prompting import RANKER_PROMPTS, load_prompt  # noqa: E402
from memsifter.stage import validate_config  # noqa: E402
from memsifter.stages import rank as rank_stage  # noqa: E402


def shown_sets(cfg: dict) -> tuple[list, list]:
    config = validate_config("rank", cfg, source=cfg["output"])
    ds = read_dataset(config.input)
    if config.limit:
        ds.questions = ds.questions[:config.limit]
    emb = {r["question_id"]: r for r in rankings.read_rankings(config.embeddings)}
    counter = TokenCounter(load_tokenizer(models.resolve(config.tokenizer or config.model)))
    style = rank_stage.resolve_style(config, counter.tokenizer)
    template = load_prompt(config.prompt, RANKER_PROMPTS[style], ("history", "current"))
    return rank_stage.build_prompts(config, ds, emb, counter, template), ds.questions


def score(rows: list[dict], questions: list) -> dict:
    s = rankings.summarize(rows, questions)
    return {"questions": s["questions_scored"], "ndcg@10": s["ndcg@10"], "recall_any@5": s["recall_any@5"]}


def baseline(cfg: dict, draws: int = 50, seed: int = 0) -> dict:
    """For one rank config (a dict as the rank stage takes it): the first stage's and a random valid
    ranking's figures over the same shown sessions."""
    cfg = {**cfg, "output": cfg.get("output") or "/tmp/unused"}
    prompts, questions = shown_sets(cfg)
    top_k = cfg.get("top_k", 10)
    first = [{"question_id": p.question_id, "ranked_session_ids": p.fallback, "status": "ok"} for p in prompts]
    rng = random.Random(seed)
    runs = []
    for _ in range(draws):
        rows = []
        for p in prompts:
            ids = list(p.id_map)
            rng.shuffle(ids)
            rows.append({"question_id": p.question_id, "status": "ok",
                         "ranked_session_ids": rankings.complete_ranking(ids[:top_k], p.fallback)})
        runs.append(score(rows, questions))
    shown = [len(p.id_map) for p in prompts if not p.skipped]
    nd = [d["ndcg@10"] for d in runs]
    rc = [d["recall_any@5"] for d in runs]
    return {"shown_sessions_mean": round(statistics.mean(shown), 2), "shown_sessions_min": min(shown),
            "shown_sessions_max": max(shown), "first_stage": score(first, questions),
            "random_valid": {"questions": runs[0]["questions"], "draws": draws,
                             "ndcg@10": round(statistics.mean(nd), 4), "ndcg@10_sd": round(statistics.pstdev(nd), 4),
                             "recall_any@5": round(statistics.mean(rc), 4),
                             "recall_any@5_sd": round(statistics.pstdev(rc), 4)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a results folder with configs/rank-*.yaml")
    ap.add_argument("--data", required=True, help="where the run's datasets are here (replaces the "
                    "folder part of each config's input and embeddings)")
    ap.add_argument("--draws", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the table as JSON here (default: <run>/random_baseline.json)")
    a = ap.parse_args()
    out: dict[str, dict] = {}
    seen = set()
    for path in sorted(glob.glob(os.path.join(a.run, "configs", "rank-*.yaml"))):
        cfg = yaml.safe_load(open(path))
        part = os.path.basename(cfg["input"].rstrip("/"))
        key = (part, cfg.get("context_limit"), cfg.get("session_tokens"), cfg.get("top_k", 10))
        if key in seen:
            continue
        seen.add(key)
        cfg["input"] = os.path.join(a.data, part)
        cfg["embeddings"] = os.path.join(a.data, os.path.basename(cfg["embeddings"].rstrip("/")))
        out[part] = {"config": os.path.basename(path), **baseline(cfg, a.draws, a.seed)}
    print(f"{'part':<16} {'shown (mean, min-max)':>22} {'first stage NDCG@10':>20} {'random valid NDCG@10':>21} "
          f"{'± sd':>7} {'random recall_any@5':>20}")
    for part, r in out.items():
        rv = r["random_valid"]
        print(f"{part:<16} {r['shown_sessions_mean']:>10} ({r['shown_sessions_min']}-{r['shown_sessions_max']}){'':>5} "
              f"{r['first_stage']['ndcg@10']:>20.3f} {rv['ndcg@10']:>21.3f} {rv['ndcg@10_sd']:>7.3f} "
              f"{rv['recall_any@5']:>20.3f}")
    dest = a.out or os.path.join(a.run, "random_baseline.json")
    with open(dest, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"written {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
