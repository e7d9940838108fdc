"""Stage ``evaluate``: one report for any number of rankings and answer files (MEMSIFTER.md §7).

Every retrieval method is scored the same way from its ``rankings.parquet`` against the dataset's
gold sessions (binary relevance; questions without gold and abstention questions excluded):
recall_any@k, recall_all@k, NDCG@k, precision@k, MRR, overall, per question type and per dataset,
plus the row status counts (ok / fallback / error). An ``embed`` output contributes one entry per
method it computed (``rankings_<method>.parquet``). Answer files (``chat`` outputs) give exact match,
token F1 and the judge score per context the chat stage answered with (its ``method``: a ranker, a
first-stage method, no memory, the gold-session oracle), overall / per type / per dataset, with that
method's recall_any@5 / NDCG@10 beside it. A method whose rankings are all or mostly fallbacks is
marked as such in the JSON, the Markdown table and ``answer_f1_by_method.png``.

Every mean comes with its n and a 95% bootstrap interval (:func:`memsifter.retrieval.metrics.bootstrap_ci`:
1,000 resamples of the questions, seeded): ``ci`` beside ``overall`` and in each ``by_type`` /
``by_dataset`` group (``{"n", "ci_low", "ci_high"}`` per metric), ``recall_any_ci`` / ``recall_all_ci``
beside the curves, in the Markdown tables as ``mean [low, high]`` and as error bars / bands in the
plots, so that a mean over two questions does not read like a result.

A re-ranker's NDCG cannot say whether it re-ranked: one that hands back the order it was given scores
exactly its input's. So every rank stage output also gets ``input_order``: against the first-stage
order it was given (its config's ``embeddings``), over the sessions it was shown (its
``prompts.parquet``; else the top ``top_k``), the share of questions whose order it changed and its mean
Kendall τ to that order, with n and intervals (:func:`memsifter.retrieval.metrics.order_change_summary`). One that
changed no question's order is reported as "returns its input order" in the JSON
(``returns_input_order``), the Markdown tables and the manifest's stats, never as a learned ranking.
Answer metrics sit beside the retrieval of the same answered questions (``retrieval``, with
``retrieval_on``: their n and intervals), not beside everything the method ranked.

Methods are never compared on different questions silently: ``question_sets`` says whether every
method was scored on the same questions; when not, the report says so above the tables, gives every
method's n, and scores every method again on the questions all of them ranked (``on_common``).

Answer files of the ``agents`` stage (the memory agents: ``agent:search``, ``agent:memory``,
``agent:memory+recall``) are scored the same way, beside chat's methods. ``side_by_side`` puts every
answer method on the questions all of them answered (EM and F1 with n and intervals) with its cost per
question, each a mean with its n: LLM calls (a chat answer is one request), tokens read (prompt tokens
over all calls: the agents' from the server's usage, chat's ``prompt_tokens`` as its tokenizer counts
the prompt) and seconds (an agent's episode; chat answers in batches and records none: ``-``).

The benchmarks' own metrics sit beside ours, named as such (:mod:`memsifter.retrieval.benchmark_metrics`):
every answered LoCoMo row gets ``locomo_f1`` (LoCoMo's QA score for its category: stems, the multi-hop comma
split, adversarial abstention), averaged like F1 (overall, per type = per category, with intervals); every
rankings entry gets ``longmemeval`` (recall_any@k, recall_all@k, ndcg_any@k as LongMemEval computes them over
its non-abstention questions); with ``lme_judge`` (an OpenAI-compatible endpoint; off by default) every
answered LongMemEval row is judged with LongMemEval's prompt for its type (``lme_judge`` per row,
``longmemeval_judge`` per method: accuracy, task-averaged, abstention; verdicts in
``longmemeval_judge.parquet``).

Every answer table has reference rows (``references``): chat's no memory, random sessions and gold sessions
where it answered with them, and the ``constant answer`` row, the best constant answer per metric chosen on
the other half of the answered questions and scored on this half
(:func:`memsifter.retrieval.benchmark_metrics.constant_answer`). Every other row has ``vs_reference``: its
mean per-question difference to the strongest reference (per metric, the highest mean) over the questions
both answered, with a 95% paired bootstrap interval.

Outputs: ``report.json``, ``report.md``, ``recall_curve.png`` (recall@k, k = 1..``curve_max_k``, of
every method; written when there are rankings), ``answer_f1_by_method.png``,
``answer_f1_by_type.png`` (written when there are answers: a plot with no data is not written) and
``answer_f1_and_cost.png`` (F1 against tokens read per question, one point per method, on the same
questions; written when some method recorded its tokens), ``longmemeval_judge.parquet`` (with ``lme_judge``).
On the terminal, ``memsifter run evaluate`` prints the tables ``memsifter demo`` prints (:func:`terminal_summary`;
``--json``: the manifest's stats as JSON).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from typing import Literal

from pydantic import Field

from ..testing import faults
from ..retrieval import rankings
from ..store import storage
from ..data.model import Dataset, read_dataset
from ..errors import NotPublishedError
from ..retrieval.metrics import (BOOTSTRAP_RESAMPLES, INPUT_ORDER_NOTE, exact_match, mean_interval, mean_metrics,
                                 order_change_summary, question_metrics, token_f1)
from ..retrieval import benchmark_metrics as bm
from ..errors import MemsifterError
from ..models.llm import ChatClient, LLMEndpoint, ResponseCache
from ..stage import StageConfig, stage, uri_field

log = logging.getLogger(__name__)


class EvaluateConfig(StageConfig):
    input: str = uri_field("published dataset", stage=("import", "synth"))
    rankings: list[str] = uri_field("rankings to score: stage outputs (embed, rank) or parquet files",
                                    default_factory=list, stage=("embed", "rank"), wire="all")
    answers: list[str] = uri_field("answer files to score: chat outputs (no memory, first stage, rankers, oracle) "
                                   "and agents outputs (the memory agents), side by side",
                                   default_factory=list, stage=("chat", "agents"), wire="all")
    ks: list[int] = Field(default_factory=lambda: [1, 5, 10], description="cut-offs")
    curve_max_k: int = Field(20, ge=1, description="largest k of the recall curves")
    ndcg_variant: Literal["standard", "original"] = Field(
        "standard", description="standard NDCG, or the original's DCG/|gold| (compatibility)")
    lme_judge: LLMEndpoint | None = Field(
        None, description="LongMemEval's own answer judge: the OpenAI-compatible endpoint that judges every "
        "LongMemEval answer with LongMemEval's prompt for its question type (temperature 0, 10 tokens; "
        "'yes' in the reply = correct); off when unset")

    def preflight(self) -> None:
        """Where the judge's requests go and their key, checked before anything starts (one line, exit 2)."""
        if self.lme_judge:
            self.lme_judge.check("lme_judge")


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


def _changed_cell(io: dict | None) -> str:
    """``changed/n (share)``, with **returns its input order** for a ranker that changed none; '–' for a
    method without an input order (a first stage), the reason where its input could not be read."""
    if not io:
        return "–"
    if io.get("error"):
        return f"input order unknown ({io['error'][:80]})"
    cell = f"{io['changed']}/{io['n']} ({io['changed_share']:.0%})"
    return cell + (f" — **{INPUT_ORDER_NOTE}**" if io["returns_input_order"] else "")


def _tau_cell(io: dict | None) -> str:
    if not io or io.get("error"):
        return "–"
    return _fmt_ci(io.get("tau_mean"), (io.get("ci") or {}).get("tau_mean"))


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


LME_JUDGE_FILE = "longmemeval_judge.parquet"


def judge_longmemeval(endpoint: LLMEndpoint, rows_by_label: dict[str, list[dict]], qmap: dict,
                      out: storage.Publication) -> dict:
    """LongMemEval's judge over every answered LongMemEval row of every method: each row gets ``lme_judge``
    (1.0 / 0.0) and ``abstention``; the verdicts (prompt kind, raw reply) go to ``longmemeval_judge.parquet``.
    Requests are cached under ``_work/llm-cache/lme-judge`` (a re-run asks only what is missing); a
    request that fails after its retries fails the stage, nothing published."""
    import pyarrow as pa

    todo = []
    for label, rs in rows_by_label.items():
        for r in rs:
            q = qmap.get(r.get("question_id"))
            r["lme_judge"] = None
            if q is None or not bm.is_longmemeval(q) or r["status"] != "ok":
                continue
            r["abstention"] = bool("_abs" in q.question_id or q.abstention)
            prompt = bm.lme_judge_prompt(q, r.get("answer"))
            if prompt is not None:
                todo.append((label, r, q, prompt))
    client = ChatClient(endpoint, ResponseCache(storage.join(out.work, "llm-cache", "lme-judge")))
    comps = client.complete_many([[{"role": "user", "content": p}] for _, _, _, p in todo], temperature=0.0,
                                 max_tokens=bm.LME_JUDGE_MAX_TOKENS) if todo else []
    failed = [(label, r["question_id"], c.error) for (label, r, _, _), c in zip(todo, comps) if not c.ok]
    if failed:
        from ..security.redact import redact

        label, qid, err = failed[0]
        raise MemsifterError(f"evaluate: {len(failed)} of {len(todo)} LongMemEval judge requests to "
                             f"{endpoint.display_url()} failed, nothing published; first: {qid} [{label}]: "
                             f"{' '.join(redact(err or 'failed', endpoint.secrets()).split())[:300]}")
    verdicts = []
    for (label, r, q, _), c in zip(todo, comps):
        r["lme_judge"] = bm.lme_judge_label(c.text)
        verdicts.append({"method": label, "question_id": q.question_id, "question_type": q.question_type,
                         "prompt": bm.lme_judge_kind(q), "reply": c.text, "correct": r["lme_judge"]})
    schema = pa.schema([("method", pa.string()), ("question_id", pa.string()), ("question_type", pa.string()),
                        ("prompt", pa.string()), ("reply", pa.string()), ("correct", pa.float64())])
    out.write_table(LME_JUDGE_FILE, pa.Table.from_pylist(verdicts, schema=schema))
    return {"model": endpoint.model, "judged": len(verdicts), "file": LME_JUDGE_FILE, "temperature": 0.0,
            "max_tokens": bm.LME_JUDGE_MAX_TOKENS, "client": client.stats}


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


def _cost_cell(c: dict | None) -> str:
    if not c:
        return "-"
    m = c["mean"]
    return (f"{m:,.0f}" if m >= 100 else f"{m:.2f}") + f" (n={c['n']})"


def _fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _fmt_ci(mean, ci: dict | None) -> str:
    """``mean [low, high]`` (the 95% bootstrap interval), or the mean alone where there is none."""
    if mean is None or not ci:
        return _fmt(mean)
    return f"{_fmt(mean)} [{ci['ci_low']:.2f}, {ci['ci_high']:.2f}]"


def _cell(group: dict | None, metric: str) -> str:
    return "–" if not group else _fmt_ci(group.get(metric), (group.get("ci") or {}).get(metric))


def diff_cell(d: dict | None) -> str:
    """``+0.012 [-0.01, 0.03]``: a mean paired difference to the strongest reference with its interval."""
    return "–" if not d else f"{d['diff']:+.3f} [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]"


def reference_notes(report: dict) -> list[str]:
    """What the reference rows are, which constant answers were chosen on which questions, and which
    reference each *ΔF1 vs ref* is against."""
    refs = report.get("references") or {}
    if not refs:
        return []
    out = ["Reference rows: *no memory*, *random sessions* (the haystack in a seeded random order, filled like a "
           "ranking) and *oracle (gold sessions)* where chat answered with them, and *constant answer*: one answer "
           "for every question, chosen on the other half of the answered questions (never on the questions it is "
           "scored on): the candidate (a gold answer of that half; for LoCoMo F1 also \"Not mentioned in the "
           "conversation\") with the best mean on that half, then scored on this half."]
    for metric, what in (("f1", "F1"), ("locomo_f1", "LoCoMo F1")):
        chosen = ((refs.get("constant") or {}).get(metric) or {})
        for ds, picks in (chosen.get("chosen") or {}).items():
            split = (chosen.get("split") or {}).get(ds, "")
            out.append(f"Constant for {what}, {ds} (halves {split}): " + "; ".join(
                f"half {p['half']}: \"{p['answer'][:40]}\" (chosen on {p['chosen_on']} questions)" for p in picks)
                + ".")
    strongest = refs.get("strongest") or {}
    if strongest:
        out.append("*ΔF1 vs ref*: each other row's mean per-question F1 difference to the strongest reference ("
                   + ", ".join(f"{m}: {r}" for m, r in strongest.items()) + ") over the questions both answered, "
                   "with its 95% paired bootstrap interval. *LoCoMo F1*: LoCoMo's own QA score "
                   "(task_eval/evaluation.py: Porter stems, multi-hop split at commas, adversarial: abstains or not).")
    return out


def longmemeval_retrieval_lines(report: dict) -> list[str]:
    """LongMemEval's own retrieval metrics of every method that ranked LongMemEval questions."""
    rows = {label: r["longmemeval"] for label, r in report["retrieval"].items() if r.get("longmemeval")}
    if not rows:
        return []
    ks = report.get("ks") or [5, 10]
    cols = [f"{m}@{k}" for k in ks for m in ("recall_any", "recall_all", "ndcg_any")]
    rel = next(iter(rows.values()))["relevant"]
    lines = ["### LongMemEval's own retrieval metrics", "",
             "As LongMemEval's evaluation computes them (session level): over its non-abstention questions with a "
             f"relevant session (relevant: answer sessions with {rel}); its NDCG (*ndcg_any*) weighs ranks 1 and 2 "
             "the same.", "", "| method | n | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['n']} | " + " | ".join(_cell(r, c) for c in cols) + " |")
    return lines + [""]


def longmemeval_judge_lines(report: dict) -> list[str]:
    """LongMemEval's judge accuracy of every answer method that answered LongMemEval questions."""
    j = report.get("longmemeval_judge")
    rows = {label: a["longmemeval_judge"] for label, a in report["answers"].items() if a.get("longmemeval_judge")}
    if not j or not rows:
        return []
    lines = ["### LongMemEval's judge", "",
             f"LongMemEval's own judge prompts per question type (and for abstention questions), judge model "
             f"{j['model']}, temperature 0, {j['max_tokens']} tokens; correct when the reply contains \"yes\" "
             f"(verdicts: `{j['file']}`).", "",
             "| method | n | accuracy | task-averaged | abstention |", "|---|---|---|---|---|"]
    for label, s in rows.items():
        ab = s["abstention"]
        lines.append(f"| {label} | {s['n']} | {_fmt(s['accuracy'])} | {_fmt(s['task_averaged'])} | "
                     + (f"{_fmt(ab['accuracy'])} (n={ab['n']})" if ab["n"] else "–") + " |")
    return lines + [""]


def markdown(report: dict, ks: list[int], written_plots: list[str] | None = None) -> str:
    lines = ["# MemSifter evaluation report", ""]
    d = report["dataset"]
    lines += [f"Dataset: `{d['uri']}` — {d['questions']} questions "
              f"({d['scored_for_retrieval']} with gold sessions, abstention excluded), "
              f"by dataset: {', '.join(f'{k} {v}' for k, v in d['by_dataset'].items())}.", "",
              f"Every mean is shown as `mean [low, high]`: its 95% bootstrap interval ({BOOTSTRAP_RESAMPLES:,} "
              "resamples of the questions, seeded); n is the number of questions it is over.", ""]
    qs = report.get("question_sets") or {}
    if report["retrieval"]:
        if qs and not qs["same"]:
            per = ", ".join(f"{label} {n}" for label, n in qs["per_method"].items())
            lines += [f"**The methods were scored on different question sets** (n per method: {per}): the rows "
                      "of the tables below are not comparable with each other. "
                      + (f"They are compared on the {qs['common']} questions every method ranked under "
                         "\"On common questions\"." if qs.get("common") else
                         "No question was ranked by every method."), ""]
        cols = [f"{m}@{k}" for k in ks for m in ("recall_any", "recall_all", "ndcg")] + ["mrr"]
        lines += ["## Retrieval", ""]
        if any(r.get("input_order") for r in report["retrieval"].values()):
            lines += ["*order changed vs input*: the questions on which a re-ranker's order of the sessions it was "
                      "shown differs from the order it was given (the first stage's, its `embeddings`); *τ vs "
                      "input*: its mean Kendall τ to that order. A ranker that changed no question's order "
                      f"**{INPUT_ORDER_NOTE}**: its metrics are those of its input, not of a learned ranking.", ""]
        lines += ["| method | n | ok / fallback / error | " + " | ".join(cols)
                  + " | order changed vs input | τ vs input |", "|---|---|---|" + "---|" * (len(cols) + 2)]
        for label, r in report["retrieval"].items():
            st = r["status"]
            shown = label + (f" — **{r['fallback']}**" if r.get("fallback") else "")
            lines.append(f"| {shown} | {r['n']} | {st.get('ok', 0)} / {st.get('fallback', 0)} / {st.get('error', 0)} | "
                         + " | ".join(_fmt_ci(r["overall"].get(c), r.get("ci", {}).get(c)) for c in cols)
                         + f" | {_changed_cell(r.get('input_order'))} | {_tau_cell(r.get('input_order'))} |")
        lines.append("")
        k5 = 5 if 5 in ks else ks[-1]
        if qs.get("on_common"):
            lines += [f"### On common questions: the {qs['common']} questions every method ranked", "",
                      f"| method | n | recall_any@{k5} | recall_all@{k5} | ndcg@10 | mrr | order changed vs input "
                      "| τ vs input |", "|---|---|---|---|---|---|---|---|"]
            for label, c in qs["on_common"].items():
                lines.append(f"| {label} | {c['n']} | " + " | ".join(
                    _cell(c, m) for m in (f"recall_any@{k5}", f"recall_all@{k5}", "ndcg@10", "mrr"))
                    + f" | {_changed_cell(c.get('input_order'))} | {_tau_cell(c.get('input_order'))} |")
            lines.append("")
        lines += longmemeval_retrieval_lines(report)
        for group, title in (("by_type", "question type"), ("by_dataset", "dataset")):
            keys = sorted({g for r in report["retrieval"].values() for g in r[group]})
            if len(keys) < 2 and group == "by_dataset":
                continue
            lines += [f"### recall_any@{k5} / NDCG@10 by {title} (n questions each)", "",
                      f"| {title} | " + " | ".join(report["retrieval"]) + " |",
                      "|---|" + "---|" * len(report["retrieval"])]
            for g in keys:
                cells = []
                for r in report["retrieval"].values():
                    m = r[group].get(g)
                    cells.append("–" if not m else
                                 f"n={m['n']}: {_cell(m, f'recall_any@{k5}')} / {_cell(m, 'ndcg@10')}")
                lines.append(f"| {g} | " + " | ".join(cells) + " |")
            lines.append("")
    if report["answers"]:
        models_ = sorted({a.get("model") or "?" for a in report["answers"].values()})
        lines += ["## Answers by retrieval method", "",
                  f"Working LLM: {', '.join(models_)}. Each row answers the same questions with the memory "
                  "that method retrieved (no memory and the gold-session oracle bound what retrieval can do). "
                  "A method marked *fallback* did not produce its own rankings for those questions: its "
                  "answers used the first stage's order instead. Exact match, F1 and judge are means over "
                  "the answered questions; recall_any@5 and NDCG@10 are over the same answered questions "
                  "(those with gold sessions: *retrieval n*), not over everything the method ranked.", "",
                  *reference_notes(report), "",
                  "| context (method) | n | answered | exact match | F1 | LoCoMo F1 | ΔF1 vs ref | judge | "
                  "retrieval n | recall_any@5 | NDCG@10 | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, a in report["answers"].items():
            o, rt, ci = a["overall"], a.get("retrieval") or {}, a.get("ci") or {}
            on = a.get("retrieval_on") or {}
            rci = on.get("ci") or {}
            note = ("**" + a["fallback"] + "**") if a.get("fallback") else rt.get("note", "")
            io = (report["retrieval"].get(a.get("method") or label) or {}).get("input_order")
            if io and io.get("returns_input_order"):
                note = (note + "; " if note else "") + f"**{INPUT_ORDER_NOTE}**"
            lines.append(f"| {label} | {o['n']} | {o['answered']} | "
                         f"{_fmt_ci(o['exact_match'], ci.get('exact_match'))} | "
                         f"{_fmt_ci(o['f1'], ci.get('f1'))} | {_fmt_ci(o.get('locomo_f1'), ci.get('locomo_f1'))} | "
                         f"{diff_cell((a.get('vs_reference') or {}).get('f1'))} | "
                         f"{_fmt_ci(o['judge'], ci.get('judge'))} | {on.get('n', '–')} | "
                         f"{_fmt_ci(rt.get('recall_any@5'), rci.get('recall_any@5'))} | "
                         f"{_fmt_ci(rt.get('ndcg@10'), rci.get('ndcg@10'))} | {note} |")
        lines.append("")
        for label, a in report["answers"].items():
            lines += [f"### {label}: F1 by question type", "",
                      "| type | n | answered | EM | F1 | LoCoMo F1 | judge |", "|---|---|---|---|---|---|---|"]
            for t, o in a["by_type"].items():
                lines.append(f"| {t} | {o['n']} | {o['answered']} | {_cell(o, 'exact_match')} | {_cell(o, 'f1')} | "
                             f"{_cell(o, 'locomo_f1')} | {_cell(o, 'judge')} |")
            lines.append("")
        lines += longmemeval_judge_lines(report)
    sbs = report.get("side_by_side") or {}
    if sbs.get("methods"):
        lines += ["## Side by side on the same questions", "",
                  f"Every answer method on the {sbs['questions']} questions all of them answered"
                  + ("" if sbs["same"] else " (**the methods answered different question sets**: n per method "
                     + ", ".join(f"{k} {v}" for k, v in sbs["per_method"].items()) + "; only the common ones are "
                     "compared here)")
                  + ". Cost per question, mean (n): *LLM calls* (a chat answer is one request; its judge aside), "
                  "*tokens read* (prompt tokens over all calls: the agents' from the server's usage, chat's as its "
                  "tokenizer counts its prompt), *seconds* (an agent's episode, wall clock; chat answers in batches: "
                  "-). `-`: not recorded.", "",
                  "| method | n | exact match | F1 | LLM calls | tokens read | seconds | tokens counted by |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, e in sbs["methods"].items():
            c, ci = e["cost"], e.get("ci") or {}
            lines.append(f"| {label} | {e['n']} | {_fmt_ci(e['exact_match'], ci.get('exact_match'))} | "
                         f"{_fmt_ci(e['f1'], ci.get('f1'))} | {_cost_cell(c['llm_calls'])} | "
                         f"{_cost_cell(c['prompt_tokens'])} | {_cost_cell(c['seconds'])} | {c.get('tokens') or '-'} |")
        lines.append("")
    if written_plots:
        lines += ["Plots (error bars and bands: 95% bootstrap intervals; n in the legends): "
                  + ", ".join(f"`{p}`" for p in written_plots) + ".", ""]
    return "\n".join(lines)


def terminal_summary(manifest: dict) -> list[str]:
    """What ``memsifter run evaluate`` prints (``--json``: the stats instead): the tables ``memsifter demo``
    prints (:func:`memsifter.demo.screen`: the first stage, the rankers beside it, the answers, the agents
    with their cost), read from this output's stats and the manifests of the stages it scored, then where
    the report and the plots are."""
    from .. import demo

    cfg = manifest.get("config") or {}
    out = cfg.get("output") or ""
    res: dict[str, dict] = {"evaluate": manifest}
    for uri in [*cfg.get("rankings", []), *cfg.get("answers", [])]:   # the first stage's default, the
        if uri.endswith(".parquet"):                                  # rankers' n, the agents' format counts
            continue
        with contextlib.suppress(Exception):
            m = storage.read_manifest(uri)
            key = {"embed": "embed", "rank": "rank"}.get(m.get("stage"), uri.rstrip("/").rsplit("/", 1)[-1])
            res.setdefault(key, m)
    name = "evaluate"
    with contextlib.suppress(Exception):   # the datasets its questions come from
        name = "+".join(json.loads(storage.read_text(storage.join(out, "report.json")))["dataset"]["by_dataset"])
    stats = manifest.get("stats") or {}
    agents = any(k.startswith("agent:") for k in ((stats.get("side_by_side") or {}).get("methods") or {}))
    if agents:
        res[demo.AGENTS_EVAL] = manifest
    lines = [ln for part in ("first", "evaluate") + (("agents",) if agents else ())
             for ln in demo.screen({name: res}, part)]
    files = [f for f in (manifest.get("files") or {}) if f.endswith(".png")]
    lines += ["", f"report {storage.join(out, 'report.md')} (every metric by type and dataset; the stats: --json)"]
    if files:
        lines.append(f"plots  {', '.join(storage.join(out, f) for f in sorted(files))}")
    return lines


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _f1_n(a: dict) -> int:
    """How many answers an F1 mean is over (the answered rows with an F1)."""
    ci = (a.get("ci") or {}).get("f1")
    return ci["n"] if ci else 0


def _yerr(means: list, cis: list) -> list[list[float]]:
    """Asymmetric error bars (below, above) of means from their intervals; 0 where there is none."""
    lo = [0.0 if m is None or not c else max(0.0, m - c["ci_low"]) for m, c in zip(means, cis)]
    hi = [0.0 if m is None or not c else max(0.0, c["ci_high"] - m) for m, c in zip(means, cis)]
    return [lo, hi]


def recall_curve_figure(report: dict, max_k: int):
    """recall_any@k and recall_all@k of every method, with 95% bootstrap bands; each method's n in the
    legend, and the title says when the methods were scored on different question sets."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ks = list(range(1, max_k + 1))
    for i, (label, r) in enumerate(report["retrieval"].items()):
        shown = f"{label} (n={r['n']})"
        for ax, name in zip(axes, ("recall_any", "recall_all")):
            ax.plot(ks, r["curve"][name], marker="o", ms=3, label=shown, color=f"C{i % 10}")
            band = r["curve"].get(f"{name}_ci") or []
            if band and all(b is not None for b in band):
                ax.fill_between(ks, [b[0] for b in band], [b[1] for b in band], color=f"C{i % 10}", alpha=0.15)
    qs = report.get("question_sets") or {}
    differ = bool(qs) and not qs.get("same", True)
    for ax, t in zip(axes, ("recall_any@k", "recall_all@k")):
        ax.set_title(t + (" — question sets DIFFER (n per method)" if differ else ""), fontsize=9)
        ax.set_xlabel("k")
        ax.set_xticks([k for k in ks if k == 1 or k % max(1, max_k // 10) == 0])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle("shaded: 95% bootstrap interval over questions", fontsize=8)
    return fig


def f1_by_type_figure(report: dict):
    """Answer F1 per question type and method, with 95% bootstrap error bars; every bar carries its
    value (a 0.00 bar is drawn as its label and a marker on the axis, not left invisible), the legend
    each method's n and the ticks each type's n."""
    plt = _pyplot()
    types = sorted({t for a in report["answers"].values() for t in a["by_type"]})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * max(1, len(types))), 4))
    n = max(1, len(report["answers"]))
    width = 0.8 / n
    for i, (label, a) in enumerate(report["answers"].items()):
        groups = [a["by_type"].get(t, {}) for t in types]
        means = [g.get("f1") for g in groups]
        cis = [(g.get("ci") or {}).get("f1") for g in groups]
        xs = [x + i * width for x in range(len(types))]
        vals = [m or 0.0 for m in means]
        ax.bar(xs, vals, width=width, label=f"{label} (n={_f1_n(a)})", color=f"C{i % 10}", edgecolor="black",
               linewidth=0.5, yerr=_yerr(means, cis), capsize=2, error_kw={"elinewidth": 0.8})
        for x, m in zip(xs, means):
            if m is not None and m == 0:
                ax.plot([x], [0.0], marker="_", ms=max(6, 40 * width), mew=2.5, color=f"C{i % 10}", clip_on=False)
            ax.text(x, (m or 0.0) + 0.015, "n/a" if m is None else f"{m:.2f}", ha="center", va="bottom", fontsize=6)
    counts = {}
    for t in types:
        ns = {a["by_type"][t]["n"] for a in report["answers"].values() if t in a["by_type"]}
        counts[t] = str(min(ns)) if len(ns) == 1 else f"{min(ns)}–{max(ns)}"
    ax.set_xticks([x + (n - 1) * width / 2 for x in range(len(types))])
    ax.set_xticklabels([f"{t}\n(n={counts[t]})" for t in types], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("token F1")
    ax.set_ylim(0, 1.1)
    ax.set_title("answer F1 by question type (error bars: 95% bootstrap interval)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside the bars, never over them
    return fig


def f1_by_method_figure(report: dict):
    """Answer F1 per method with 95% bootstrap error bars and n; fallback methods hatched."""
    plt = _pyplot()
    labels = list(report["answers"])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * max(1, len(labels))), 4))
    top = 0.0
    for x, label in enumerate(labels):
        a = report["answers"][label]
        f1 = a["overall"].get("f1")
        ci = (a.get("ci") or {}).get("f1")
        fb = a.get("fallback")
        ax.bar(x, f1 or 0.0, color="lightgray" if fb else f"C{x % 10}", hatch="//" if fb else None,
               edgecolor="black", yerr=_yerr([f1], [ci]), capsize=3)
        if f1 is not None and f1 == 0:
            ax.plot([x], [0.0], marker="_", ms=20, mew=2.5, color="black", clip_on=False)
        y = max(f1 or 0.0, ci["ci_high"] if ci else 0.0)
        top = max(top, y)
        ax.text(x, y + 0.01, ("n/a" if f1 is None else f"{f1:.3f}") + f"\nn={_f1_n(a)}" + (f"\n{fb}" if fb else ""),
                ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("answer token F1")
    ax.set_ylim(0, min(1.1, max(0.1, top * 1.35)))
    models_ = sorted({a.get("model") or "?" for a in report["answers"].values()})
    ax.set_title(f"answer F1 by retrieval method (working LLM: {', '.join(models_)}; hatched = fallback; "
                 "error bars: 95% bootstrap interval)", fontsize=9)
    return fig


MARKERS = "osD^vPX*h<>p"   # one shape per method, so that two methods drawn on one spot both show


def _token_ticks(lo: float, hi: float) -> list[float]:
    """Tick values of a log token axis: 1, 2, 5 × powers of ten within [lo, hi] (at most 8 of them)."""
    import math

    ticks = [m * 10 ** e for e in range(int(math.floor(math.log10(lo))), int(math.ceil(math.log10(hi))) + 1)
             for m in (1, 2, 5) if lo <= m * 10 ** e <= hi]
    while len(ticks) > 8:
        ticks = ticks[::2]
    return ticks


def _tokens_label(v: float, _pos=None) -> str:  # noqa: ANN001
    return f"{v / 1000:g}k" if v >= 1000 else f"{v:g}"


def f1_and_cost_figure(report: dict):
    """Answer F1 (95% bootstrap error bars) against tokens read per question, one point per method, on the
    questions every method answered (``side_by_side``); methods whose tokens are not recorded are named
    in the title instead. Every method is visible: its own colour and marker shape and its number beside
    the point and in the legend; points that would cover each other are set side by side (a few points
    apart, their values unchanged). The token axis is logarithmic when the means span more than 20x, with
    1/2/5 ticks written as plain numbers (500, 1k, 2k)."""
    import matplotlib.ticker as mticker
    from matplotlib.transforms import offset_copy

    plt = _pyplot()
    sbs = report["side_by_side"]
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    unknown, pts = [], []
    for i, (label, e) in enumerate(sbs["methods"].items()):
        tok = e["cost"].get("prompt_tokens")
        if tok is None or e.get("f1") is None:
            unknown.append(label)
            continue
        pts.append((i, label, e, max(1.0, tok["mean"]), (e.get("ci") or {}).get("f1")))
    xs = [x for _, _, _, x, _ in pts]
    top = max([0.1] + [max(e["f1"], ci["ci_high"] if ci else 0.0) for _, _, e, _, ci in pts])
    ax.set_ylim(-0.04 * top * 1.3, top * 1.3)   # room below 0 so that a 0.0 point is not cut in half
    log = bool(xs) and max(xs) / min(xs) > 20
    if xs:
        lo, hi = min(xs), max(xs)
        ax.set_xlim(lo / 1.6, hi * 1.6) if log else ax.set_xlim(0, hi * 1.15)
    if log:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(mticker.FixedLocator(_token_ticks(*ax.get_xlim())))
        ax.xaxis.set_major_formatter(mticker.FuncFormatter(_tokens_label))
        ax.xaxis.set_minor_formatter(mticker.NullFormatter())
    else:
        ax.xaxis.set_major_formatter(mticker.FuncFormatter(_tokens_label))
    # points within 14 pixels of each other on the page (chains of them) are set side by side, 14 points apart
    px = [ax.transData.transform((x, e["f1"])) for _, _, e, x, _ in pts]
    group = list(range(len(pts)))
    for k in range(len(pts)):
        for j in range(k):
            if abs(px[k][0] - px[j][0]) < 14 and abs(px[k][1] - px[j][1]) < 14:
                old, new = group[k], group[j]
                group = [new if g == old else g for g in group]
    shifts: list[float] = []
    for k in range(len(pts)):
        members = sorted((j for j in range(len(pts)) if group[j] == group[k]), key=lambda j: (px[j][0], j))
        shifts.append(14.0 * (members.index(k) - (len(members) - 1) / 2))
    for k, ((i, label, e, x, ci), dx) in enumerate(zip(pts, shifts), 1):
        tr = offset_copy(ax.transData, fig=fig, x=dx, y=0, units="points")
        ax.errorbar([x], [e["f1"]], yerr=_yerr([e["f1"]], [ci]), fmt=MARKERS[(k - 1) % len(MARKERS)], ms=7,
                    capsize=3, color=f"C{i % 10}", mec="black", mew=0.5, transform=tr,
                    label=f"{k}  {label} (n={e['n']})")
        ax.annotate(str(k), (x, e["f1"]), xycoords=tr, xytext=(5, 4), textcoords="offset points", ha="left",
                    va="bottom", fontsize=7, fontweight="bold")
    ax.set_xlabel("tokens read per question (prompt tokens over all LLM calls, mean" + (", log scale)" if log else ")"))
    ax.set_ylabel("answer token F1")
    ax.grid(alpha=0.3)
    ax.grid(alpha=0.12, which="minor")
    title = f"answer F1 vs tokens read, on the same {sbs['questions']} questions (error bars: 95% bootstrap)"
    if any(shifts):
        title += "\npoints on one spot are set side by side (values unchanged)"
    if unknown:
        title += "\ntokens not recorded (not shown): " + ", ".join(unknown)
    ax.set_title(title, fontsize=8)
    if xs:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plots(report: dict, max_k: int) -> dict[str, bytes]:
    """The plots that have data: the recall curves when there are rankings, the answer plots when there
    are answers (a plot of nothing is not written)."""
    plt = _pyplot()
    figs = {}
    if report["retrieval"]:
        figs["recall_curve.png"] = recall_curve_figure(report, max_k)
    if report["answers"]:
        figs["answer_f1_by_method.png"] = f1_by_method_figure(report)
        figs["answer_f1_by_type.png"] = f1_by_type_figure(report)
    sbs = report.get("side_by_side") or {}
    if any(e["cost"].get("prompt_tokens") and e.get("f1") is not None for e in (sbs.get("methods") or {}).values()):
        figs["answer_f1_and_cost.png"] = f1_and_cost_figure(report)
    out = {}
    for name, fig in figs.items():
        out[name] = _png(fig)
        plt.close(fig)
    return out


ANSWER_RETRIEVAL = ("recall_any@5", "ndcg@10")


def _answer_retrieval(method: str, info: dict, ds: Dataset, config: EvaluateConfig, per_method: dict[str, dict],
                      answered: set[str]) -> tuple[dict | None, dict | None]:
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
            per_q = rankings.per_question_metrics(rankings.read_rankings(info["source"]), ds.questions, config.ks,
                                                  config.ndcg_variant)
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
    return _stat_retrieval(retrieval)


@stage("evaluate", EvaluateConfig, family="chat", gpus=0,
       help="Score rankings and answers: JSON + Markdown report and PNG plots")
def run(config: EvaluateConfig, out: storage.Publication) -> dict:
    ds = read_dataset(config.input)
    report: dict = {"dataset": {"uri": config.input, "questions": len(ds.questions),
                                "scored_for_retrieval": sum(1 for q in ds.questions if rankings.eligible(q)),
                                "by_dataset": ds.summary()["questions_by_dataset"]},
                    "ks": config.ks, "ndcg_variant": config.ndcg_variant, "retrieval": {}, "answers": {}}
    report["retrieval"], per_method, changes = score_all_rankings(config.rankings, ds, config.ks,
                                                                  config.curve_max_k, config.ndcg_variant)
    rows_by_label: dict[str, list[dict]] = {}
    qmap = {q.question_id: q for q in ds.questions}
    for uri in config.answers:
        path = uri if uri.endswith(".parquet") else storage.published_file(uri, "answers.parquet")
        model, meta, tokens = None, {}, None
        if not uri.endswith(".parquet"):
            m = storage.read_manifest(uri)
            model = (m.get("config", {}).get("endpoint") or {}).get("model")
            meta = (m.get("stats") or {}).get("methods") or {}
            tokens = ("server usage" if m.get("stage") == "agents" else
                      f"tokenizer {m['config']['tokenizer']}" if (m.get("config") or {}).get("tokenizer") else
                      "estimate (4 characters a token)")
        rows = storage.read_parquet(path).to_pylist()
        by_method: dict[str, list[dict]] = {}
        for r in rows:  # one chat output answers with one or more contexts (methods)
            by_method.setdefault(r.get("method") or "chat", []).append(r)
        for method, rs in by_method.items():
            label = method
            if label in report["answers"]:
                label = f"{label} ({uri.rstrip('/').rsplit('/', 1)[-1]})"
            locomo_scores(rs, qmap)
            info = meta.get(method) or {}
            status = info.get("ranking_status") or {}
            if not status:  # rows carry the status of the ranking each context came from
                for r in rs:
                    if r.get("ranking_status"):
                        status[r["ranking_status"]] = status.get(r["ranking_status"], 0) + 1
            retrieval, retrieval_on = _answer_retrieval(
                method, info, ds, config, per_method,
                {r["question_id"] for r in rs if r["status"] == "ok" and r.get("question_id")})
            cost = answer_cost(rs, tokens if any(r.get("prompt_tokens") is not None for r in rs) else None)
            kind = info.get("kind") or REFERENCE_KIND_OF_LABEL.get(method) or ("rankings" if status else None)
            report["answers"][label] = {"source": path, "model": model, "method": method, "kind": kind,
                                        "ranking_status": status, "fallback": fallback_note(status),
                                        "retrieval": retrieval, "retrieval_on": retrieval_on, "cost": cost}
            rows_by_label[label] = rs
    if config.lme_judge and rows_by_label:
        report["longmemeval_judge"] = judge_longmemeval(config.lme_judge, rows_by_label, qmap, out)
    for label, rs in rows_by_label.items():
        report["answers"][label].update(score_answers(rs))
        summary = bm.lme_judge_summary(rs) if config.lme_judge else None
        if summary:
            report["answers"][label]["longmemeval_judge"] = summary
    if rows_by_label:
        report["references"] = add_references(report, rows_by_label, ds)
    report["question_sets"] = question_sets(per_method, changes)
    report["side_by_side"] = side_by_side(rows_by_label, {k: v["cost"] for k, v in report["answers"].items()})
    out.write_json("report.json", report)
    faults.checkpoint("saved", done=1)
    figures = plots(report, config.curve_max_k)
    out.write_text("report.md", markdown(report, config.ks, list(figures)))
    for name, data in figures.items():
        out.write_bytes(name, data)
    return {"retrieval": _stat_retrieval(report["retrieval"]),
            "question_sets": _stat_question_sets(report["question_sets"]),
            "side_by_side": {**{k: v for k, v in report["side_by_side"].items() if k != "methods"},
                             "methods": {k: {"n": v["n"], "exact_match": v["exact_match"], "f1": v["f1"],
                                             "ci": v["ci"], **{c: (v["cost"].get(c) or {}).get("mean")
                                                               for c in COST_KEYS}}
                                         for k, v in report["side_by_side"]["methods"].items()}},
            "answers": {k: {**v["overall"], "ci": {m: (v.get("ci") or {}).get(m) for m in ("exact_match", "f1",
                                                                                         "locomo_f1")},
                            "retrieval": v.get("retrieval"), "retrieval_on": v.get("retrieval_on"),
                            "fallback": v.get("fallback"), "model": v.get("model"), "kind": v.get("kind"),
                            "vs_reference": v.get("vs_reference"),
                            "longmemeval_judge": {m: (v.get("longmemeval_judge") or {}).get(m)
                                                  for m in ("n", "accuracy", "task_averaged")}
                            if v.get("longmemeval_judge") else None}
                        for k, v in report["answers"].items()},
            "references": {k: v for k, v in (report.get("references") or {}).items() if k != "constant"} or None,
            "report": storage.join(config.output, "report.md")}


STAT_METRICS = ("recall_any@5", "ndcg@10", "mrr")


def _stat_retrieval(retrieval: dict[str, dict]) -> dict:
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


def _stat_question_sets(qs: dict) -> dict:
    out = {k: v for k, v in qs.items() if k != "on_common"}
    if qs.get("on_common"):
        out["on_common"] = {label: {**_stat_means(c, c), "input_order": _stat_input_order(c.get("input_order"))}
                            for label, c in qs["on_common"].items()}
    return out
