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
The scoring is :mod:`memsifter.retrieval.scoring` (the demo scores a first stage with it before evaluate
runs), the Markdown :mod:`memsifter.retrieval.report`, the plots :mod:`memsifter.retrieval.plots`; this module
reads the inputs, asks LongMemEval's judge and publishes. On the terminal, ``memsifter run evaluate`` prints the tables ``memsifter demo`` prints (:func:`terminal_summary`;
``--json``: the manifest's stats as JSON).
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Literal

from pydantic import Field

from ..store import hooks
from ..retrieval import rankings
from ..store import storage
from ..data.model import read_dataset
from ..retrieval import benchmark_metrics as bm
from ..retrieval.context import CHARS_PER_TOKEN
from ..errors import MemsifterError
from ..models.llm import ChatClient, LLMEndpoint, ResponseCache
from ..retrieval.plots import (  # noqa: F401 - the figures re-exported as this stage names them
    f1_and_cost_figure, f1_by_method_figure, f1_by_type_figure, plots, recall_curve_figure)
from ..retrieval.report import markdown
from ..retrieval.scoring import (  # noqa: F401 - the scoring re-exported as this stage names it
    COST_KEYS, REFERENCE_KIND_OF_LABEL, add_references, answer_cost, answer_retrieval, expand_rankings,
    fallback_note, locomo_scores, question_sets, retrieval_stats, score_all_rankings, score_answers, score_rankings,
    side_by_side, stat_question_sets, stat_retrieval)
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


def terminal_summary(manifest: dict) -> list[str]:
    """What ``memsifter run evaluate`` prints (``--json``: the stats instead): the tables ``memsifter demo``
    prints (:func:`memsifter.retrieval.screen.screen`: the first stage, the rankers beside it, the answers, the
    agents with their cost), read from this output's stats and the manifests of the stages it scored, then where
    the report and the plots are."""
    from ..retrieval import screen

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
        res[screen.AGENTS_EVAL] = manifest
    lines = [ln for part in ("first", "evaluate") + (("agents",) if agents else ())
             for ln in screen.screen({name: res}, part)]
    files = [f for f in (manifest.get("files") or {}) if f.endswith(".png")]
    lines += ["", f"report {storage.join(out, 'report.md')} (every metric by type and dataset; the stats: --json)"]
    if files:
        lines.append(f"plots  {', '.join(storage.join(out, f) for f in sorted(files))}")
    return lines


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
                      f"estimate ({CHARS_PER_TOKEN:g} characters a token)")
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
            retrieval, retrieval_on = answer_retrieval(
                method, info, ds, config.ks, config.ndcg_variant, per_method,
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
    hooks.checkpoint("saved", done=1)
    figures = plots(report, config.curve_max_k)
    out.write_text("report.md", markdown(report, config.ks, list(figures)))
    for name, data in figures.items():
        out.write_bytes(name, data)
    return {"retrieval": stat_retrieval(report["retrieval"]),
            "question_sets": stat_question_sets(report["question_sets"]),
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
