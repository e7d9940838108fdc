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


# --------------------------------------------------------------------------- order change against the input
# A re-ranker is given an order (the first stage's) and returns one. Its NDCG alone cannot say whether it
# re-ranked: a ranker that hands back the order it was given scores exactly the first stage's NDCG (the
# shipped trained adapter did, on every held-out question). These say what it did to its input.

INPUT_ORDER_NOTE = "returns its input order"


def kendall_tau(order: Sequence[str], reference: Sequence[str]) -> float | None:
    """Kendall tau-a between two orders over the items both hold (no ties: every item once): 1 for the
    same order, -1 for the reverse; None when fewer than 2 items are shared (nothing to compare)."""
    import numpy as np

    pos = {s: i for i, s in enumerate(reference)}
    ranks = np.asarray([pos[s] for s in dict.fromkeys(order) if s in pos])
    n = ranks.size
    if n < 2:
        return None
    # pairs (i < j) that the reference orders the same way: one vectorized comparison (a ranker shown
    # hundreds of sessions makes ~10^5 pairs per question)
    concordant = int(np.triu(ranks[:, None] < ranks[None, :], k=1).sum())
    pairs = n * (n - 1) // 2
    return (2 * concordant - pairs) / pairs


def order_change(ranked: Sequence[str], input_order: Sequence[str], shown: Sequence[str] | None = None,
                 k: int = 10) -> dict:
    """What a ranker did to one question's input order: ``changed`` (1.0 when its order of the compared
    sessions differs from the input's, else 0.0) and ``tau`` (Kendall tau between the two, None when
    fewer than 2 sessions are compared), ``compared`` (how many).

    The compared sessions are those the ranker was shown (``shown``, where the rank stage recorded it:
    only those could it reorder), else the union of both orders' top ``k``, so that a session promoted
    into the top k from below counts as a change."""
    over = set(shown) if shown else set(list(ranked)[:k]) | set(list(input_order)[:k])
    mine = [s for s in dict.fromkeys(ranked) if s in over]
    given = [s for s in dict.fromkeys(input_order) if s in over]
    common = set(mine) & set(given)
    mine, given = [s for s in mine if s in common], [s for s in given if s in common]
    return {"changed": float(mine != given), "tau": kendall_tau(mine, given), "compared": len(mine)}


def order_change_summary(changes: Sequence[dict], digits: int = 4) -> dict | None:
    """Over questions (one :func:`order_change` each): ``n``, ``changed`` (questions whose order the ranker
    changed), ``changed_share``, ``tau_mean`` (over the questions with a tau; None if none has one), their
    95% bootstrap intervals (``ci``) and ``returns_input_order``: True when it changed no question's
    order (then tau is 1 wherever defined), the ranker being the identity of its input. None for no
    questions."""
    if not changes:
        return None
    flags = [float(c["changed"]) for c in changes]
    taus = [c["tau"] for c in changes if c.get("tau") is not None]
    changed = int(round(sum(flags)))
    return {"n": len(flags), "changed": changed, "changed_share": round(sum(flags) / len(flags), digits),
            "tau_mean": round(sum(taus) / len(taus), digits) if taus else None,
            "ci": {"changed_share": mean_interval(flags, digits), "tau_mean": mean_interval(taus, digits)},
            "returns_input_order": changed == 0}


def order_change_note(summary: dict | None) -> str:
    """The plain words for a ranker's order change: ``returns its input order (changed 0 of n)`` for a
    ranker that changed nothing, else ``changed the order of k of n questions``; '' when unknown."""
    if not summary:
        return ""
    if summary["returns_input_order"]:
        return f"{INPUT_ORDER_NOTE} (changed 0 of {summary['n']} questions)"
    return f"changed the order of {summary['changed']} of {summary['n']} questions"


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
