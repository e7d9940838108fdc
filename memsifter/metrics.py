"""Retrieval metrics over session ids with binary relevance (MEMSIFTER.md §7).

Default NDCG@k uses the ideal ranking of min(|gold|, k) hits on top. The original code divides DCG by
|gold| and truncates gold to k; that is offered as ``variant="original"``, never the default.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

KS = (1, 5, 10)


def _dcg(hits: Sequence[bool]) -> float:
    return sum(1.0 / math.log2(i + 2) for i, h in enumerate(hits) if h)


def recall_any(ranked: Sequence[str], gold: Iterable[str], k: int) -> float:
    g = set(gold)
    return float(any(r in g for r in ranked[:k])) if g else 0.0


def recall_all(ranked: Sequence[str], gold: Iterable[str], k: int) -> float:
    g = set(gold)
    return float(g <= set(ranked[:k])) if g else 0.0


def precision(ranked: Sequence[str], gold: Iterable[str], k: int) -> float:
    g = set(gold)
    return sum(1 for r in ranked[:k] if r in g) / k


def ndcg(ranked: Sequence[str], gold: Sequence[str], k: int, variant: str = "standard") -> float:
    g = set(gold)
    if not g:
        return 0.0
    hits = [r in g for r in ranked[:k]]
    if variant == "standard":
        ideal = _dcg([True] * min(len(g), k))
        return _dcg(hits) / ideal
    if variant == "original":
        # The original: gold truncated to k, DCG divided by |gold| (not by the ideal DCG).
        gk = set(list(gold)[:k])
        return _dcg([r in gk for r in ranked[:k]]) / len(gk)
    raise ValueError(f"unknown NDCG variant '{variant}' (standard, original)")


def dcg_over_gold(ranked: Sequence[str], gold: Sequence[str], k: int = 10) -> float:
    """DCG@k divided by |gold|: the cheap 'dcg' reward and the anchor-curriculum score."""
    g = set(gold)
    return _dcg([r in g for r in ranked[:k]]) / len(g) if g else 0.0


def mrr(ranked: Sequence[str], gold: Iterable[str]) -> float:
    g = set(gold)
    for i, r in enumerate(ranked):
        if r in g:
            return 1.0 / (i + 1)
    return 0.0


def question_metrics(ranked: Sequence[str], gold: Sequence[str], ks: Sequence[int] = KS,
                     variant: str = "standard") -> dict[str, float]:
    out: dict[str, float] = {}
    for k in ks:
        out[f"recall_any@{k}"] = recall_any(ranked, gold, k)
        out[f"recall_all@{k}"] = recall_all(ranked, gold, k)
        out[f"ndcg@{k}"] = ndcg(ranked, gold, k, variant)
        out[f"precision@{k}"] = precision(ranked, gold, k)
    out["mrr"] = mrr(ranked, gold)
    return out


def mean_metrics(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    if not rows:
        return {}
    keys = rows[0].keys()
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


# --------------------------------------------------------------------------- uncertainty
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_LEVEL = 0.95
BOOTSTRAP_SEED = 0


def bootstrap_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, level: float = BOOTSTRAP_LEVEL,
                 seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (one value per question): the questions
    are resampled with replacement ``resamples`` times and the ``level`` interval of the resampled
    means is returned as (low, high). Seeded, so a report states the same interval every time it is
    built. A mean over 2 questions then reads as what it is (a wide interval), not as a result.

    One value, or all values equal, gives the degenerate interval (v, v); the interval always holds
    the mean (the percentile interval does except in degenerate cases, where it is widened to it).
    Raises ValueError on no values (there is no mean to bound)."""
    import numpy as np

    x = np.asarray(list(values), dtype=float)
    if x.size == 0:
        raise ValueError("bootstrap_ci: no values")
    mean = float(x.mean())
    if x.size == 1 or bool(np.all(x == x[0])):
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    step = max(1, (1 << 22) // x.size)   # resamples per chunk: at most ~4M indices in memory at once
    for i in range(0, resamples, step):
        k = min(step, resamples - i)
        means[i:i + k] = x[rng.integers(0, x.size, size=(k, x.size))].mean(axis=1)
    alpha = (1.0 - level) / 2
    lo, hi = (float(v) for v in np.quantile(means, [alpha, 1.0 - alpha]))
    return min(lo, mean), max(hi, mean)


def mean_interval(values: Sequence[float], digits: int = 4) -> dict | None:
    """``{"n", "ci_low", "ci_high"}`` of :func:`bootstrap_ci` (rounded to ``digits``), None for no values."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    lo, hi = bootstrap_ci(vals)
    return {"n": len(vals), "ci_low": round(lo, digits), "ci_high": round(hi, digits)}


# --------------------------------------------------------------------------- answer metrics
_ARTICLES = {"a", "an", "the"}


def normalize_answer(text: str) -> str:
    """SQuAD-style: lower case, drop punctuation and articles, fold white space."""
    text = str(text).lower()
    text = "".join(ch if ch.isalnum() or ch.isspace() else " " for ch in text)
    return " ".join(w for w in text.split() if w not in _ARTICLES)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p and not g:
        return 1.0
    if not p or not g:
        return 0.0
    counts: dict[str, int] = {}
    for w in g:
        counts[w] = counts.get(w, 0) + 1
    common = 0
    for w in p:
        if counts.get(w, 0) > 0:
            counts[w] -= 1
            common += 1
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)
