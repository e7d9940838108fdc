"""Scoring of rankings and answers: what the ``evaluate`` stage reports and what the demo shows of a first
stage before evaluate runs, with this one code (MEMSIFTER.md §7; the report's contents: :mod:`memsifter.stages.
evaluate`).

- Rankings: every rankings file a URI stands for (:func:`expand_rankings`), scored against the dataset's gold
  sessions (:func:`score_all_rankings`: per method the means overall, per type and per dataset with n and 95%
  bootstrap intervals, the recall curves, the row status counts and, for a re-ranker, its order change
  against the order it was given); :func:`retrieval_stats` is the manifest's ``retrieval`` of them.
- Answers: :func:`score_answers` (EM, F1, LoCoMo's F1, the judges), the reference rows
  (:func:`add_references`), the cost per question (:func:`answer_cost`) and every answer method on the same
  questions (:func:`side_by_side`).
"""

from __future__ import annotations

import logging
import os

from . import benchmark_metrics as bm
from . import rankings
from ..data.model import Dataset, read_dataset
from ..errors import NotPublishedError
from ..store import storage
from .metrics import exact_match, mean_interval, mean_metrics, order_change_summary, question_metrics, token_f1

log = logging.getLogger("memsifter.stages.evaluate")   # the evaluate stage's warnings, wherever it scores


def expand_rankings(uri: str) -> list[tuple[str, str]]:
    """(label hint, parquet URI) for every rankings file a URI stands for."""
    if uri.endswith(".parquet"):
        return [(os.path.basename(uri)[:-8], uri)]
    manifest = storage.read_manifest(uri)
    files = sorted(manifest.get("files", {}))
    per_method = [f for f in files if f.startswith("rankings_") and f.endswith(".parquet")]
    chosen = per_method or [f for f in files if f == rankings.RANKINGS_FILE]
    if not chosen:
        raise NotPublishedError(f"{uri}: stage {manifest.get('stage')} published no rankings")
    return [(f[:-8], storage.join(uri, f)) for f in chosen]


def summarize(rows: list[dict[str, float]]) -> dict:
    """Means of per-question metrics with their n and 95% bootstrap intervals (``ci``: metric ->
    ``{"n", "ci_low", "ci_high"}``)."""
    means = mean_metrics(rows)
    return {"n": len(rows), **{k: round(v, 4) for k, v in means.items()},
            "ci": {k: mean_interval([r[k] for r in rows]) for k in means}}


def _group_means(per_q: dict[str, dict], ds: Dataset, key) -> dict[str, dict]:
    groups: dict[str, list[dict]] = {}
    for q in ds.questions:
        if q.question_id in per_q:
            groups.setdefault(key(q) or "-", []).append(per_q[q.question_id])
    return {g: summarize(rs) for g, rs in sorted(groups.items())}


def _score(rows: list[dict], ds: Dataset, ks: list[int], max_k: int, variant: str) -> tuple[dict, dict[str, dict]]:
    """The summary of one rankings file and its per-question metrics (question id -> metrics)."""
    per_q = rankings.per_question_metrics(rows, ds.questions, ks, variant)
    status: dict[str, int] = {}
    for r in rows:
        status[r["status"]] = status.get(r["status"], 0) + 1
    missing = [q.question_id for q in ds.questions if rankings.eligible(q)
               and q.question_id not in {r["question_id"] for r in rows}]
    by_id = {r["question_id"]: r for r in rows}
    curve: dict[str, list] = {"recall_any": [], "recall_all": [], "recall_any_ci": [], "recall_all_ci": []}
    eligible = [q for q in ds.questions if q.question_id in per_q]
    for k in range(1, max_k + 1):
        ms = [question_metrics(by_id[q.question_id]["ranked_session_ids"] or [], q.gold_session_ids, [k])
              for q in eligible]
        for name in ("recall_any", "recall_all"):
            vals = [m[f"{name}@{k}"] for m in ms]
            curve[name].append(round(sum(vals) / max(1, len(vals)), 4))
            ci = mean_interval(vals)
            curve[f"{name}_ci"].append([ci["ci_low"], ci["ci_high"]] if ci else None)
    whole = summarize(list(per_q.values()))
    summary = {"n": len(per_q), "missing_questions": len(missing), "status": status,
               "overall": {k: v for k, v in whole.items() if k not in ("n", "ci")}, "ci": whole["ci"],
               "by_type": _group_means(per_q, ds, lambda q: q.question_type),
               "by_dataset": _group_means(per_q, ds, lambda q: q.dataset), "curve": curve,
               "longmemeval": longmemeval_retrieval(rows, ds, ks)}
    return summary, per_q


def longmemeval_retrieval(rows: list[dict], ds: Dataset, ks: list[int]) -> dict | None:
    """LongMemEval's own session-level retrieval metrics (recall_any@k, recall_all@k, ndcg_any@k) over the
    LongMemEval questions its evaluation counts (:mod:`memsifter.retrieval.benchmark_metrics`): means with
    n and intervals, overall and per question type; None without such questions."""
    per_q, relevant = bm.lme_retrieval_per_question(rows, ds.questions, ds.sessions, ks)
    if not per_q:
        return None
    whole = summarize(list(per_q.values()))
    return {"n": whole["n"], "relevant": relevant, "questions": "non-abstention, with a relevant session",
            "overall": {k: v for k, v in whole.items() if k not in ("n", "ci")}, "ci": whole["ci"],
            "by_type": _group_means(per_q, ds, lambda q: q.question_type)}


def score_rankings(rows: list[dict], ds: Dataset, ks: list[int], max_k: int, variant: str) -> dict:
    return _score(rows, ds, ks, max_k, variant)[0]


def question_sets(per_method: dict[str, dict[str, dict]], changes: dict[str, dict[str, dict]] | None = None) -> dict:
    """Whether every method was scored on the same questions; when not, each method's n, how many
    questions all of them ranked, and every method scored on those (``on_common``; a re-ranker with a
    known input also with its order change on them, ``input_order``)."""
    sets = {label: set(pq) for label, pq in per_method.items()}
    same = len({frozenset(s) for s in sets.values()}) <= 1
    out: dict = {"same": same, "per_method": {label: len(s) for label, s in sets.items()}}
    if same:
        return out
    common = set.intersection(*sets.values())
    out["common"] = len(common)
    if common:
        out["on_common"] = {label: summarize([pq[q] for q in sorted(common)]) for label, pq in per_method.items()}
        for label, ch in (changes or {}).items():
            out["on_common"][label]["input_order"] = order_change_summary([ch[q] for q in sorted(common) if q in ch])
    return out


def input_order_entry(rows: list[dict], ds: Dataset,
                      given: rankings.RankerInput) -> tuple[dict | None, dict[str, dict]]:
    """A re-ranker's order change against the order it was given (``input_order`` of its report entry:
    :func:`memsifter.retrieval.metrics.order_change_summary` plus ``compared_over``) and the per-question changes
    behind it. The input's URI is left out: it is in the rank output's manifest (``embeddings``), and a
    report must not differ between two runs of one pipeline under different prefixes."""
    changes = rankings.order_changes(rows, ds.questions, given)
    summary = order_change_summary(list(changes.values()))
    if summary is None:
        return None, changes
    over = "shown sessions" if any(q in given.shown for q in changes) else f"top {given.k}"
    return {**summary, "compared_over": over}, changes


def fallback_note(status: dict[str, int]) -> str | None:
    """``all fallback`` / ``mostly fallback (k/n)`` for rankings whose rows are not the method's own
    output (the stage fell back to the first stage's order, or the engine failed), else None."""
    n = sum(status.values())
    bad = status.get("fallback", 0) + status.get("error", 0)
    if not n or not bad:
        return None
    if bad == n:
        return f"all fallback ({bad}/{n})"
    return f"mostly fallback ({bad}/{n})" if bad * 2 >= n else None


ANSWER_METRICS = ("exact_match", "f1", "locomo_f1", "judge", "lme_judge")


def _answer_values(rs: list[dict], k: str) -> list[float]:
    """One metric's values over the answered rows (a metric a row has no value for is left out)."""
    return [r[k] for r in rs if r["status"] == "ok" and r.get(k) is not None]


def score_answers(rows: list[dict]) -> dict:
    """Means over the answered rows (``overall``, per type, per dataset), each metric's n and 95%
    bootstrap interval beside them (``ci``; None where no row has a value)."""
    def summary(rs: list[dict], with_ci: bool) -> dict:
        out: dict = {"n": len(rs), "answered": sum(1 for r in rs if r["status"] == "ok")}
        for k in ANSWER_METRICS:
            vals = _answer_values(rs, k)
            out[k] = round(sum(vals) / len(vals), 4) if vals else None
        if with_ci:
            out["ci"] = {k: mean_interval(_answer_values(rs, k)) for k in ANSWER_METRICS}
        return out

    def groups(key: str) -> dict:
        g: dict[str, list[dict]] = {}
        for r in rows:
            g.setdefault(r.get(key) or "-", []).append(r)
        return {k: summary(v, True) for k, v in sorted(g.items())}
    return {"overall": summary(rows, False), "ci": {k: mean_interval(_answer_values(rows, k)) for k in ANSWER_METRICS},
            "by_type": groups("question_type"), "by_dataset": groups("dataset")}


def locomo_scores(rows: list[dict], qmap: dict) -> None:
    """Each answered LoCoMo row's ``locomo_f1``: LoCoMo's own QA score for its category
    (:func:`memsifter.retrieval.benchmark_metrics.locomo_qa_score`); None for other rows."""
    for r in rows:
        q = qmap.get(r.get("question_id"))
        cat = bm.locomo_category(q) if q is not None else None
        r["locomo_f1"] = (bm.locomo_qa_score(r.get("answer"), q.answer, cat)
                          if cat is not None and r["status"] == "ok" else None)


# --------------------------------------------------------------------------- reference rows
CONSTANT = "constant answer"


REFERENCE_KINDS = ("none", "random", "oracle", "constant")


REFERENCE_KIND_OF_LABEL = {"no memory": "none", "random sessions": "random", "oracle (gold sessions)": "oracle"}


REFERENCE_METRICS = ("f1", "locomo_f1")


def _per_question(rows: list[dict], metric: str) -> dict[str, float]:
    return {r["question_id"]: float(r[metric]) for r in rows if r["status"] == "ok" and r.get(metric) is not None}


def add_references(report: dict, rows_by_label: dict[str, list[dict]], ds: Dataset) -> dict:
    """The reference rows of the answer table and every other method's difference to the strongest one.

    The constant answer is one more row (``constant answer``, kind ``constant``): per metric (our F1,
    LoCoMo's F1) the best constant answer chosen on the other half of the answered questions
    (:func:`memsifter.retrieval.benchmark_metrics.constant_answer`; LoCoMo's candidates include its
    "Not mentioned in the conversation"), scored on this half. The references are it and the chat
    baselines present (no memory, random sessions, gold sessions); per metric the strongest is the one
    with the highest mean, and every other row gets ``vs_reference``: its mean per-question difference to
    that reference over the questions both answered, with a 95% paired bootstrap interval."""
    answered = set().union(*(_per_question(rs, "f1") for rs in rows_by_label.values()))
    qs = [q for q in ds.questions if q.question_id in answered]
    const_f1 = bm.constant_answer(qs, lambda c, q: token_f1(c, q.answer))
    locomo = [q for q in qs if bm.locomo_category(q) is not None]
    const_lo = bm.constant_answer(locomo, lambda c, q: bm.locomo_qa_score(c, q.answer, bm.locomo_category(q)),
                                  extra_candidates=lambda q: [bm.LOCOMO_NOT_MENTIONED])
    rows = []
    for q in qs:
        if q.question_id not in const_f1["per_question"]:
            continue
        c = const_f1["answer_of"][q.question_id]
        rows.append({"question_id": q.question_id, "status": "ok", "dataset": q.dataset,
                     "question_type": q.question_type, "answer": c, "exact_match": exact_match(c, q.answer),
                     "f1": const_f1["per_question"][q.question_id],
                     "locomo_f1": const_lo["per_question"].get(q.question_id), "judge": None, "lme_judge": None})
    rows_by_label = dict(rows_by_label)
    if rows:
        report["answers"][CONSTANT] = {
            "source": None, "model": None, "method": CONSTANT, "kind": "constant", "ranking_status": {},
            "fallback": None, "retrieval": None, "retrieval_on": None, **score_answers(rows),
            "cost": {"llm_calls": None, "prompt_tokens": None, "seconds": None, "tokens": None},
            "constant": {"f1": {"chosen": const_f1["chosen"], "split": const_f1["split"]},
                         "locomo_f1": {"chosen": const_lo["chosen"], "split": const_lo["split"]}}}
        rows_by_label[CONSTANT] = rows
    refs = [label for label, a in report["answers"].items() if a.get("kind") in REFERENCE_KINDS]
    strongest: dict[str, str] = {}
    for metric in REFERENCE_METRICS:
        scored = [(report["answers"][r]["overall"].get(metric), r) for r in refs]
        scored = [(v, r) for v, r in scored if v is not None]
        if scored:
            strongest[metric] = max(scored, key=lambda t: t[0])[1]
    for label, a in report["answers"].items():
        if label in refs:
            continue
        vs = {}
        for metric, ref in strongest.items():
            d = bm.paired_difference(_per_question(rows_by_label[label], metric),
                                     _per_question(rows_by_label[ref], metric))
            if d:
                vs[metric] = {"reference": ref, **d}
        a["vs_reference"] = vs
    return {"labels": refs, "strongest": strongest,
            "constant": (report["answers"].get(CONSTANT) or {}).get("constant")}


COST_KEYS = ("llm_calls", "prompt_tokens", "seconds")


def _cost_stat(vals: list) -> dict | None:
    vals = [float(v) for v in vals if v is not None]
    return {"mean": round(sum(vals) / len(vals), 2), "n": len(vals)} if vals else None


def answer_cost(rs: list[dict], tokens: str | None) -> dict:
    """Cost per answered question: LLM calls, tokens read (prompt tokens) and seconds, each ``{"mean", "n"}``
    or None where the rows do not record it. A chat row is one request (its judge's aside); an agents
    row carries its own counts (``llm_calls``, ``prompt_tokens``, ``seconds``). ``tokens`` says how the
    tokens were counted."""
    ok = [r for r in rs if r["status"] == "ok"]
    return {"llm_calls": _cost_stat([r["llm_calls"] if "llm_calls" in r else 1 for r in ok]),
            "prompt_tokens": _cost_stat([r.get("prompt_tokens") for r in ok]),
            "seconds": _cost_stat([r.get("seconds") for r in ok]), "tokens": tokens}


def side_by_side(rows_by_label: dict[str, list[dict]], costs: dict[str, dict]) -> dict:
    """Every answer method (chat's contexts and the agents) on the questions all of them answered: EM and
    F1 with n and 95% bootstrap intervals, and the cost per question, over exactly those questions.
    ``same``: every method answered the same questions (else ``per_method`` gives each one's n and only
    the common ones are compared)."""
    answered = {label: {r["question_id"] for r in rs if r["status"] == "ok"} for label, rs in rows_by_label.items()}
    same = len({frozenset(a) for a in answered.values()}) <= 1
    common = set.intersection(*answered.values()) if answered else set()
    out: dict = {"same": same, "questions": len(common), "per_method": {k: len(v) for k, v in answered.items()},
                 "methods": {}}
    for label, rs in rows_by_label.items():
        on = [r for r in rs if r["status"] == "ok" and r["question_id"] in common]
        entry: dict = {"n": len(on)}
        for k in ("exact_match", "f1"):
            vals = _answer_values(on, k)
            entry[k] = round(sum(vals) / len(vals), 4) if vals else None
        entry["ci"] = {k: mean_interval(_answer_values(on, k)) for k in ("exact_match", "f1")}
        entry["cost"] = answer_cost(on, costs.get(label, {}).get("tokens"))
        out["methods"][label] = entry
    return out


ANSWER_RETRIEVAL = ("recall_any@5", "ndcg@10")


def answer_retrieval(method: str, info: dict, ds: Dataset, ks: list[int], variant: str,
                     per_method: dict[str, dict], answered: set[str]) -> tuple[dict | None, dict | None]:
    """recall_any@5 / NDCG@10 of the context an answer method used, over the questions it answered (so
    that F1 and retrieval beside it are over the same questions), and ``{"n", "ci"}`` of those means:
    the per-question metrics of the rankings of the same label, else its source scored here; the
    oracle's are 1 by construction; no memory has none."""
    if info.get("kind") == "none":
        return None, None
    if info.get("kind") == "oracle":
        return {"recall_any@5": 1.0, "ndcg@10": 1.0, "note": "gold sessions"}, None
    per_q = per_method.get(method)
    if per_q is None and info.get("source"):
        try:
            per_q = rankings.per_question_metrics(rankings.read_rankings(info["source"]), ds.questions, ks, variant)
        except Exception as e:  # noqa: BLE001 - the report still shows the answers
            log.warning("evaluate: cannot score the rankings behind %s (%s): %s", method, info["source"], e)
            return None, None
    if per_q is None:
        return None, None
    rows = [per_q[q] for q in sorted(answered) if q in per_q]
    if not rows:
        return {k: None for k in ANSWER_RETRIEVAL}, {"n": 0, "ci": {}}
    s = summarize(rows)
    return {k: s.get(k) for k in ANSWER_RETRIEVAL}, {"n": s["n"], "ci": {k: s["ci"].get(k) for k in ANSWER_RETRIEVAL}}


def score_all_rankings(uris: list[str], ds: Dataset, ks: list[int], max_k: int,
                       variant: str) -> tuple[dict[str, dict], dict[str, dict[str, dict]], dict[str, dict[str, dict]]]:
    """Every rankings file the URIs stand for, scored: (label -> report entry with its ``fallback`` note and,
    for a rank output, its ``input_order``; label -> question id -> metrics; re-ranker label -> question id ->
    its order change)."""
    retrieval: dict[str, dict] = {}
    per_method: dict[str, dict[str, dict]] = {}   # label -> question id -> metrics
    changes: dict[str, dict[str, dict]] = {}      # re-ranker label -> question id -> its order change
    for uri in uris:
        given, given_error = None, None
        try:  # a rank stage output: the first-stage order it was given and the sessions it was shown
            given = rankings.ranker_input(uri)
        except Exception as e:  # noqa: BLE001 - the report still scores it, and says why the input is unknown
            given_error = f"{type(e).__name__}: {e}"
            log.warning("evaluate: cannot read the input order of %s: %s", uri, given_error)
        for hint, path in expand_rankings(uri):
            rows = rankings.read_rankings(path)
            label = (rows[0].get("method") if rows else None) or hint
            if label in retrieval:
                label = f"{label} ({uri.rstrip('/').rsplit('/', 1)[-1]})"
            summary, per_method[label] = _score(rows, ds, ks, max_k, variant)
            retrieval[label] = {"source": path, **summary}
            if given is not None:
                retrieval[label]["input_order"], changes[label] = input_order_entry(rows, ds, given)
            elif given_error:
                retrieval[label]["input_order"] = {"error": given_error[:300]}
            retrieval[label]["fallback"] = fallback_note(retrieval[label]["status"])
    return retrieval, per_method, changes


def retrieval_stats(input: str, uris: list[str], ks: list[int] | None = None, max_k: int = 20,
                    variant: str = "standard") -> dict:
    """The ``retrieval`` part of the stats this stage publishes, for these rankings alone, computed here and
    written nowhere: what the demo shows of the first stage as soon as embed is done, before evaluate runs
    (the same scoring, so the same numbers as evaluate's)."""
    retrieval, _, _ = score_all_rankings(uris, read_dataset(input), ks or [1, 5, 10], max_k, variant)
    return stat_retrieval(retrieval)


STAT_METRICS = ("recall_any@5", "ndcg@10", "mrr")


def stat_retrieval(retrieval: dict[str, dict]) -> dict:
    """The manifest's ``retrieval``: each method's headline means with n and intervals, status, fallback and
    order change."""
    return {k: {**_stat_means(v["overall"], v), "status": v["status"], "fallback": v.get("fallback"),
                "input_order": _stat_input_order(v.get("input_order")),
                "longmemeval": _stat_longmemeval(v.get("longmemeval"))} for k, v in retrieval.items()}


LME_STAT_METRICS = ("recall_any@5", "recall_all@5", "ndcg_any@5", "recall_all@10", "ndcg_any@10")


def _stat_longmemeval(lme: dict | None) -> dict | None:
    """The manifest's copy of LongMemEval's own retrieval metrics of a method (its n and relevance rule)."""
    if not lme:
        return None
    return {"n": lme["n"], "relevant": lme["relevant"],
            **{m: lme["overall"][m] for m in LME_STAT_METRICS if m in lme["overall"]}}


def _stat_means(means: dict, summary: dict) -> dict:
    """The manifest's copy of a method's headline means, with their n and intervals (what a screen such
    as the demo's shows without reading report.json)."""
    return {**{m: means.get(m) for m in STAT_METRICS}, "n": summary.get("n"),
            "ci": {m: (summary.get("ci") or {}).get(m) for m in STAT_METRICS}}


def _stat_input_order(io: dict | None) -> dict | None:
    if not io:
        return None
    return {k: io.get(k) for k in ("n", "changed", "changed_share", "tau_mean", "returns_input_order", "ci",
                                   "compared_over", "error") if k in io}


def stat_question_sets(qs: dict) -> dict:
    out = {k: v for k, v in qs.items() if k != "on_common"}
    if qs.get("on_common"):
        out["on_common"] = {label: {**_stat_means(c, c), "input_order": _stat_input_order(c.get("input_order"))}
                            for label, c in qs["on_common"].items()}
    return out
