"""The benchmarks' own metrics, beside ours, and the reference rows of the answer tables.

Our headline answer metric is SQuAD-style token F1 (:func:`memsifter.retrieval.metrics.token_f1`) and our
headline retrieval figures are over every question with gold sessions. Neither can be put beside a
published number. This module computes what the benchmarks themselves compute (our own code, written
from the facts of their evaluation scripts):

**LoCoMo QA F1** (``snap-research/LoCoMo``, ``task_eval/evaluation.py``, ``eval_question_answering``):

* normalization: commas deleted first, then lower case, every ASCII punctuation character deleted (no
  space left in its place: ``"Sept-2023"`` becomes ``"sept2023"``), the words *a*, *an*, *the* and
  *and* removed, white space folded;
* every token Porter-stemmed (nltk's ``PorterStemmer``) before the token overlap F1 (no overlap: 0);
* per category (the source's integer ``category``, kept in ``extra["category"]`` by the importer):
  1 (multi-hop): prediction and gold split at commas; the mean over gold parts of the best F1 of any
  prediction part; 2, 4 (temporal, single-hop): the plain stemmed F1; 3 (open-domain): the gold cut at
  its first ``;`` before the F1; 5 (adversarial): 1 when the prediction contains *no information
  available* or *not mentioned* (case-insensitive), else 0 — the gold answer plays no part;
* overall: the mean over all questions of all categories (their ``evaluation_stats.py``).

LoCoMo's answer prompt differs from our chat prompt: it asks category 2 to use the conversation date
and offers category 5 a choice between the adversarial answer and "Not mentioned in the conversation".
Our chat stage asks every question the same way, so category 5 is scored on free answers.

**LongMemEval's retrieval metrics** (``xiaowu0162/LongMemEval``, ``src/retrieval/eval_utils.py`` and the
averaging in ``run_retrieval.py``), session level:

* the relevant sessions are the answer sessions holding a *user* turn flagged ``has_answer`` (an answer
  session without one is renamed ``noans`` there and is not relevant); the importer keeps the flags in
  ``extra["answer_turns"]``; a dataset that recorded no flags at all uses its gold sessions as they are;
* ``recall_any@k``: some relevant session in the top k; ``recall_all@k``: every one;
* ``ndcg_any@k``: DCG with the gain of rank r (1-based) 1 for r = 1 and 1/log2(r) after, so ranks 1 and
  2 weigh the same (our NDCG weighs rank r by 1/log2(r+1)), over the ideal DCG of the relevant
  sessions on top;
* averaged over the questions that are not abstention questions (``_abs`` in the id) and hold a
  relevant session.

**LongMemEval's judge** (``src/evaluation/evaluate_qa.py``): one yes/no prompt per question type and one
for abstention questions (``memsifter/prompts/longmemeval_judge_*.txt``, the reference's text, MIT
licence, so the verdicts compare with theirs), sent as one user message with temperature 0 and at
most 10 new tokens; the answer is correct when the reply contains ``yes`` (case-insensitive).
Accuracy overall, per type, averaged over types (*task-averaged*) and over abstention questions.

**Reference rows** for every answer table: :func:`constant_answer` (the best constant answer, chosen on
the other half of the questions: a disjoint split, so not tuned on the questions it is scored on) and
:func:`paired_difference` (a method's per-question difference to a reference, with a paired bootstrap
interval).
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from functools import lru_cache
from importlib import resources
from typing import Callable, Iterable, Sequence

from .metrics import bootstrap_ci

# --------------------------------------------------------------------------- LoCoMo QA F1
LOCOMO_CATEGORY = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
LOCOMO_ABSTAIN = ("no information available", "not mentioned")   # what category 5 credits
LOCOMO_NOT_MENTIONED = "Not mentioned in the conversation"       # the option LoCoMo's prompt offers category 5
_PUNCT = set(string.punctuation)
_LOCOMO_STOP = re.compile(r"\b(a|an|the|and)\b")


def locomo_normalize(text: str) -> str:
    """LoCoMo's answer normalization (commas, case, punctuation, a/an/the/and, white space)."""
    s = str(text).replace(",", "").lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    return " ".join(_LOCOMO_STOP.sub(" ", s).split())


@lru_cache(maxsize=1)
def _stemmer():
    from nltk.stem import PorterStemmer

    return PorterStemmer()


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _stemmer().stem(word)


def locomo_f1_single(prediction: str, gold: str) -> float:
    """Token F1 over Porter stems of the LoCoMo-normalized texts (0 without a common token)."""
    p = [_stem(w) for w in locomo_normalize(prediction).split()]
    g = [_stem(w) for w in locomo_normalize(gold).split()]
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


def locomo_f1_multi(prediction: str, gold: str) -> float:
    """Multi-hop: prediction and gold split at commas; the mean over gold parts of the best part F1."""
    preds = [p.strip() for p in str(prediction).split(",")]
    golds = [g.strip() for g in str(gold).split(",")]
    return sum(max(locomo_f1_single(p, g) for p in preds) for g in golds) / len(golds)


def locomo_qa_score(prediction: str, gold: str, category: int) -> float:
    """One LoCoMo question's score as LoCoMo's evaluation computes it for its category (1-5)."""
    prediction = "" if prediction is None else str(prediction)
    if category == 5:
        low = prediction.lower()
        return float(any(p in low for p in LOCOMO_ABSTAIN))
    if category == 1:
        return locomo_f1_multi(prediction, gold)
    if category == 3:
        gold = str(gold).split(";")[0].strip()
    if category in (2, 3, 4):
        return locomo_f1_single(prediction, gold)
    raise ValueError(f"LoCoMo category {category!r}: expected 1-5")


def locomo_category(q) -> int | None:
    """The LoCoMo category of a question (``extra["category"]`` of a LoCoMo import), None for others."""
    c = (q.extra or {}).get("category")
    if not str(q.dataset or "").lower().startswith("locomo") or c is None:
        return None
    try:
        c = int(c)
    except (TypeError, ValueError):
        return None
    return c if c in LOCOMO_CATEGORY else None


# --------------------------------------------------------------------------- LongMemEval retrieval
def lme_dcg(relevances: Sequence[float], k: int) -> float:
    """LongMemEval's DCG@k: the first gain as it is, the gain at 0-based index i >= 1 divided by log2(i + 1)."""
    r = list(relevances)[:k]
    return (r[0] + sum(x / math.log2(i + 1) for i, x in enumerate(r) if i >= 1)) if r else 0.0


def lme_retrieval(ranked: Sequence[str], relevant: Iterable[str], k: int) -> dict[str, float]:
    """recall_any@k, recall_all@k and ndcg_any@k of one question as LongMemEval computes them."""
    rel = set(relevant)
    top = list(ranked)[:k]
    got = set(top)
    ideal = lme_dcg([1.0] * len(rel), k)
    actual = lme_dcg([1.0 if s in rel else 0.0 for s in top], k)
    return {f"recall_any@{k}": float(any(s in got for s in rel)), f"recall_all@{k}": float(all(s in got for s in rel)),
            f"ndcg_any@{k}": actual / ideal if ideal else 0.0}


def is_longmemeval(q) -> bool:
    return str(q.dataset or "").lower().startswith("longmemeval")


def lme_relevant(q, sessions: dict, flags_recorded: bool = True) -> list[str] | None:
    """The sessions LongMemEval counts as relevant for a question, None when it leaves the question out
    (an abstention question, or none relevant). With ``flags_recorded`` (the dataset kept the
    ``has_answer`` flags) an answer session counts only when one of its user turns is flagged."""
    if "_abs" in q.question_id or q.abstention:
        return None
    if not flags_recorded:
        return list(q.gold_session_ids) or None
    flags = (q.extra or {}).get("answer_turns") or {}
    out = []
    for sid in q.gold_session_ids:
        turns = sessions[sid].turns if sid in sessions else []
        if any(0 <= i < len(turns) and turns[i].get("role") == "user" for i in flags.get(sid, [])):
            out.append(sid)
    return out or None


def lme_retrieval_per_question(rows: list[dict], questions: list, sessions: dict, ks: Sequence[int]
                               ) -> tuple[dict[str, dict[str, float]], str]:
    """Question id -> LongMemEval's metrics at every k, over the LongMemEval questions it counts that
    the rankings hold; and how the relevant sessions were taken (``has_answer user turns`` or
    ``gold sessions (no has_answer flags recorded)``)."""
    lme = [q for q in questions if is_longmemeval(q)]
    flags = any("answer_turns" in (q.extra or {}) for q in lme)
    by_id = {r["question_id"]: r for r in rows}
    out: dict[str, dict[str, float]] = {}
    for q in lme:
        rel = lme_relevant(q, sessions, flags)
        if rel is None or q.question_id not in by_id:
            continue
        ranked = by_id[q.question_id].get("ranked_session_ids") or []
        m: dict[str, float] = {}
        for k in ks:
            m.update(lme_retrieval(ranked, rel, k))
        out[q.question_id] = m
    return out, ("has_answer user turns" if flags else "gold sessions (no has_answer flags recorded)")


# --------------------------------------------------------------------------- LongMemEval judge
LME_JUDGE_KIND = {"single-session-user": "default", "single-session-assistant": "default",
                  "multi-session": "default", "temporal-reasoning": "temporal",
                  "knowledge-update": "knowledge_update", "single-session-preference": "preference"}
LME_JUDGE_MAX_TOKENS = 10


def lme_judge_kind(q) -> str | None:
    """Which of LongMemEval's judge prompts a question gets (``abstention`` for ``_abs`` ids), None for a
    question type the reference has no prompt for."""
    if "_abs" in q.question_id or q.abstention:
        return "abstention"
    return LME_JUDGE_KIND.get(q.question_type or "")


@lru_cache(maxsize=None)
def lme_judge_template(kind: str) -> str:
    return resources.files("memsifter.prompts").joinpath(f"longmemeval_judge_{kind}.txt").read_text(encoding="utf-8")


def lme_judge_prompt(q, response: str) -> str | None:
    """The judge's user message for one answer (the question, its gold answer or rubric / explanation,
    the response), None where the reference has no prompt for the question's type."""
    from .prompting import fill

    kind = lme_judge_kind(q)
    if kind is None:
        return None
    return fill(lme_judge_template(kind).rstrip("\n"), question=q.question, answer=q.answer,
                response="" if response is None else str(response))


def lme_judge_label(reply: str | None) -> float | None:
    """The reference's verdict: correct when the reply contains ``yes`` anywhere (case-insensitive)."""
    return None if reply is None else float("yes" in reply.strip().lower())


def lme_judge_summary(rows: list[dict], key: str = "lme_judge") -> dict | None:
    """Accuracy over the judged rows (``key`` not None): overall, per question type, averaged over the
    types (task-averaged) and over abstention questions (``abstention`` true in the row)."""
    judged = [r for r in rows if r.get(key) is not None]
    if not judged:
        return None
    by_type: dict[str, list[float]] = {}
    for r in judged:
        by_type.setdefault(r.get("question_type") or "-", []).append(r[key])
    abst = [r[key] for r in judged if r.get("abstention")]
    return {"n": len(judged), "accuracy": round(sum(r[key] for r in judged) / len(judged), 4),
            "task_averaged": round(sum(sum(v) / len(v) for v in by_type.values()) / len(by_type), 4),
            "by_type": {t: {"n": len(v), "accuracy": round(sum(v) / len(v), 4)} for t, v in sorted(by_type.items())},
            "abstention": {"n": len(abst), "accuracy": round(sum(abst) / len(abst), 4) if abst else None}}


# --------------------------------------------------------------------------- reference rows
def split_halves(questions: list) -> tuple[dict[str, int], dict[str, str]]:
    """Two disjoint halves of the questions per dataset (question id -> 0 / 1) and how each dataset was
    split. Questions that share a haystack (a LoCoMo conversation) stay together: with two or more
    haystacks the haystacks alternate between the halves in order of first appearance (``by
    conversation``); a dataset of one haystack is cut into its first and second half of questions
    (``by question``)."""
    fold: dict[str, int] = {}
    how: dict[str, str] = {}
    by_ds: dict[str, list] = {}
    for q in questions:
        by_ds.setdefault(q.dataset or "-", []).append(q)
    for ds, qs in by_ds.items():
        groups: dict[tuple, list] = {}
        for q in qs:
            groups.setdefault(tuple(sorted(q.haystack_session_ids)), []).append(q)
        if len(groups) >= 2:
            for i, members in enumerate(groups.values()):
                for q in members:
                    fold[q.question_id] = i % 2
            how[ds] = "by conversation" if len(groups) < len(qs) else "by question (one haystack each)"
        else:
            half = (len(qs) + 1) // 2
            for i, q in enumerate(qs):
                fold[q.question_id] = 0 if i < half else 1
            how[ds] = "by question (one conversation)"
    return fold, how


def constant_answer(questions: list, score: Callable[[str, object], float | None],
                    extra_candidates: Callable[[object], Sequence[str]] | None = None) -> dict:
    """The best constant answer, cross-fitted: for each dataset and half (:func:`split_halves`), the
    candidate with the highest mean ``score(candidate, question)`` over the *other* half's questions
    (candidates: the other half's gold answers, plus ``extra_candidates(question)`` of its questions;
    ties: the first candidate), then scored on this half. So every question is scored with a constant
    chosen on questions disjoint from it. ``score`` returns None for a question it does not apply to
    (left out). Returns ``{"per_question": {id: score}, "answer_of": {id: the constant}, "chosen":
    {dataset: [{"half", "answer", "chosen_on", "mean_on_choice"}]}, "split": {dataset: how}}``."""
    fold, how = split_halves(questions)
    out: dict = {"per_question": {}, "answer_of": {}, "chosen": {}, "split": how}
    by_ds: dict[str, list] = {}
    for q in questions:
        by_ds.setdefault(q.dataset or "-", []).append(q)
    for ds, qs in by_ds.items():
        for half in (0, 1):
            test = [q for q in qs if fold[q.question_id] == half]
            train = [q for q in qs if fold[q.question_id] != half]
            train = [q for q in train if score(q.answer, q) is not None]
            if not test or not train:
                continue
            cands = list(dict.fromkeys([q.answer for q in train if str(q.answer).strip()]
                                       + [c for q in train for c in (extra_candidates(q) if extra_candidates else [])]))
            best, best_mean = None, -1.0
            for c in cands:
                m = sum(score(c, q) for q in train) / len(train)
                if m > best_mean:
                    best, best_mean = c, m
            if best is None:
                continue
            out["chosen"].setdefault(ds, []).append({"half": half, "answer": best, "chosen_on": len(train),
                                                     "mean_on_choice": round(best_mean, 4)})
            for q in test:
                s = score(best, q)
                if s is not None:
                    out["per_question"][q.question_id] = float(s)
                    out["answer_of"][q.question_id] = best
    return out


def paired_difference(method: dict[str, float], reference: dict[str, float], digits: int = 4) -> dict | None:
    """A method's mean per-question difference to a reference over the questions both scored, with its
    95% paired bootstrap interval (the same questions resampled for both: :func:`bootstrap_ci` of the
    per-question differences). None when they share no question."""
    common = sorted(set(method) & set(reference))
    if not common:
        return None
    diffs = [method[q] - reference[q] for q in common]
    lo, hi = bootstrap_ci(diffs)
    return {"n": len(common), "diff": round(sum(diffs) / len(diffs), digits), "ci_low": round(lo, digits),
            "ci_high": round(hi, digits)}
