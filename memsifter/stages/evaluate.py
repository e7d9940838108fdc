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

Outputs: ``report.json``, ``report.md``, ``recall_curve.png`` (recall@k, k = 1..``curve_max_k``, of
every method), ``answer_f1_by_method.png`` and ``answer_f1_by_type.png``.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Literal

from pydantic import Field

from .. import faults, rankings, storage
from ..data.model import Dataset, read_dataset
from ..errors import NotPublishedError
from ..metrics import mean_metrics, question_metrics
from ..stage import StageConfig, stage, uri_field

log = logging.getLogger(__name__)


class EvaluateConfig(StageConfig):
    input: str = uri_field("published dataset", stage=("import", "synth"))
    rankings: list[str] = uri_field("rankings to score: stage outputs (embed, rank) or parquet files",
                                    default_factory=list, stage=("embed", "rank"), wire="all")
    answers: list[str] = uri_field("chat outputs to score", default_factory=list, stage="chat")
    ks: list[int] = Field(default_factory=lambda: [1, 5, 10], description="cut-offs")
    curve_max_k: int = Field(20, ge=1, description="largest k of the recall curves")
    ndcg_variant: Literal["standard", "original"] = Field(
        "standard", description="standard NDCG, or the original's DCG/|gold| (compatibility)")


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


def _group_means(per_q: dict[str, dict], ds: Dataset, key) -> dict[str, dict]:
    groups: dict[str, list[dict]] = {}
    for q in ds.questions:
        if q.question_id in per_q:
            groups.setdefault(key(q) or "-", []).append(per_q[q.question_id])
    return {g: {"n": len(rs), **{k: round(v, 4) for k, v in mean_metrics(rs).items()}}
            for g, rs in sorted(groups.items())}


def score_rankings(rows: list[dict], ds: Dataset, ks: list[int], max_k: int, variant: str) -> dict:
    per_q = rankings.per_question_metrics(rows, ds.questions, ks, variant)
    status: dict[str, int] = {}
    for r in rows:
        status[r["status"]] = status.get(r["status"], 0) + 1
    missing = [q.question_id for q in ds.questions if rankings.eligible(q)
               and q.question_id not in {r["question_id"] for r in rows}]
    by_id = {r["question_id"]: r for r in rows}
    curve = {"recall_any": [], "recall_all": []}
    eligible = [q for q in ds.questions if q.question_id in per_q]
    for k in range(1, max_k + 1):
        ms = [question_metrics(by_id[q.question_id]["ranked_session_ids"] or [], q.gold_session_ids, [k])
              for q in eligible]
        curve["recall_any"].append(round(sum(m[f"recall_any@{k}"] for m in ms) / max(1, len(ms)), 4))
        curve["recall_all"].append(round(sum(m[f"recall_all@{k}"] for m in ms) / max(1, len(ms)), 4))
    return {"n": len(per_q), "missing_questions": len(missing), "status": status,
            "overall": {k: round(v, 4) for k, v in mean_metrics(list(per_q.values())).items()},
            "by_type": _group_means(per_q, ds, lambda q: q.question_type),
            "by_dataset": _group_means(per_q, ds, lambda q: q.dataset), "curve": curve}


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


def score_answers(rows: list[dict]) -> dict:
    def summary(rs: list[dict]) -> dict:
        ok = [r for r in rs if r["status"] == "ok"]
        out = {"n": len(rs), "answered": len(ok)}
        for k in ("exact_match", "f1", "judge"):
            vals = [r[k] for r in ok if r.get(k) is not None]
            out[k] = round(sum(vals) / len(vals), 4) if vals else None
        return out

    def groups(key: str) -> dict:
        g: dict[str, list[dict]] = {}
        for r in rows:
            g.setdefault(r.get(key) or "-", []).append(r)
        return {k: summary(v) for k, v in sorted(g.items())}
    return {"overall": summary(rows), "by_type": groups("question_type"), "by_dataset": groups("dataset")}


def _fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown(report: dict, ks: list[int]) -> str:
    lines = ["# MemSifter evaluation report", ""]
    d = report["dataset"]
    lines += [f"Dataset: `{d['uri']}` — {d['questions']} questions "
              f"({d['scored_for_retrieval']} with gold sessions, abstention excluded), "
              f"by dataset: {', '.join(f'{k} {v}' for k, v in d['by_dataset'].items())}.", ""]
    if report["retrieval"]:
        cols = [f"{m}@{k}" for k in ks for m in ("recall_any", "recall_all", "ndcg")] + ["mrr"]
        lines += ["## Retrieval", "", "| method | n | ok / fallback / error | " + " | ".join(cols) + " |",
                  "|---|---|---|" + "---|" * len(cols)]
        for label, r in report["retrieval"].items():
            st = r["status"]
            shown = label + (f" — **{r['fallback']}**" if r.get("fallback") else "")
            lines.append(f"| {shown} | {r['n']} | {st.get('ok', 0)} / {st.get('fallback', 0)} / {st.get('error', 0)} | "
                         + " | ".join(_fmt(r["overall"].get(c)) for c in cols) + " |")
        lines.append("")
        for group, title in (("by_type", "question type"), ("by_dataset", "dataset")):
            keys = sorted({g for r in report["retrieval"].values() for g in r[group]})
            if len(keys) < 2 and group == "by_dataset":
                continue
            k5 = 5 if 5 in ks else ks[-1]
            lines += [f"### recall_any@{k5} / NDCG@10 by {title}", "",
                      f"| {title} | " + " | ".join(report["retrieval"]) + " |",
                      "|---|" + "---|" * len(report["retrieval"])]
            for g in keys:
                cells = []
                for r in report["retrieval"].values():
                    m = r[group].get(g)
                    cells.append("–" if not m else f"{_fmt(m.get(f'recall_any@{k5}'))} / {_fmt(m.get('ndcg@10'))}")
                lines.append(f"| {g} | " + " | ".join(cells) + " |")
            lines.append("")
    if report["answers"]:
        models_ = sorted({a.get("model") or "?" for a in report["answers"].values()})
        lines += ["## Answers by retrieval method", "",
                  f"Working LLM: {', '.join(models_)}. Each row answers the same questions with the memory "
                  "that method retrieved (no memory and the gold-session oracle bound what retrieval can do). "
                  "A method marked *fallback* did not produce its own rankings for those questions: its "
                  "answers used the first stage's order instead.", "",
                  "| context (method) | n | answered | exact match | F1 | judge | recall_any@5 | NDCG@10 | note |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for label, a in report["answers"].items():
            o, rt = a["overall"], a.get("retrieval") or {}
            lines.append(f"| {label} | {o['n']} | {o['answered']} | {_fmt(o['exact_match'])} | {_fmt(o['f1'])} | "
                         f"{_fmt(o['judge'])} | {_fmt(rt.get('recall_any@5'))} | {_fmt(rt.get('ndcg@10'))} | "
                         f"{('**' + a['fallback'] + '**') if a.get('fallback') else rt.get('note', '')} |")
        lines.append("")
        for label, a in report["answers"].items():
            lines += [f"### {label}: F1 by question type", "", "| type | n | EM | F1 | judge |", "|---|---|---|---|---|"]
            for t, o in a["by_type"].items():
                lines.append(f"| {t} | {o['n']} | {_fmt(o['exact_match'])} | {_fmt(o['f1'])} | {_fmt(o['judge'])} |")
            lines.append("")
    lines += ["Plots: `recall_curve.png`, `answer_f1_by_method.png`, `answer_f1_by_type.png`.", ""]
    return "\n".join(lines)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plots(report: dict, max_k: int) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ks = list(range(1, max_k + 1))
    for label, r in report["retrieval"].items():
        axes[0].plot(ks, r["curve"]["recall_any"], marker="o", ms=3, label=label)
        axes[1].plot(ks, r["curve"]["recall_all"], marker="o", ms=3, label=label)
    for ax, t in zip(axes, ("recall_any@k", "recall_all@k")):
        ax.set_title(t)
        ax.set_xlabel("k")
        ax.set_xticks([k for k in ks if k == 1 or k % max(1, max_k // 10) == 0])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    if report["retrieval"]:
        axes[1].legend(fontsize=8, loc="lower right")
    out["recall_curve.png"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * max(1, len({t for a in report["answers"].values() for t in a["by_type"]}))), 4))
    types = sorted({t for a in report["answers"].values() for t in a["by_type"]})
    n = max(1, len(report["answers"]))
    width = 0.8 / n
    for i, (label, a) in enumerate(report["answers"].items()):
        vals = [a["by_type"].get(t, {}).get("f1") or 0.0 for t in types]
        ax.bar([x + i * width for x in range(len(types))], vals, width=width, label=label)
    ax.set_xticks([x + (n - 1) * width / 2 for x in range(len(types))])
    ax.set_xticklabels(types, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("token F1")
    ax.set_ylim(0, 1.02)
    ax.set_title("answer F1 by question type" if types else "answer F1 by question type (no answers)")
    if report["answers"]:
        ax.legend(fontsize=8)
    out["answer_f1_by_type.png"] = _png(fig)
    plt.close(fig)

    labels = list(report["answers"])
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * max(1, len(labels))), 4))
    for x, label in enumerate(labels):
        a = report["answers"][label]
        f1 = a["overall"].get("f1") or 0.0
        fb = a.get("fallback")
        ax.bar(x, f1, color="lightgray" if fb else f"C{x % 10}", hatch="//" if fb else None, edgecolor="black")
        ax.text(x, f1 + 0.01, f"{f1:.3f}" + (f"\n{fb}" if fb else ""), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("answer token F1")
    top = max([a["overall"].get("f1") or 0.0 for a in report["answers"].values()] or [0.0])
    ax.set_ylim(0, min(1.02, max(0.1, top * 1.35)))
    models_ = sorted({a.get("model") or "?" for a in report["answers"].values()})
    ax.set_title(f"answer F1 by retrieval method (working LLM: {', '.join(models_)}; hatched = fallback)"
                 if labels else "answer F1 by retrieval method (no answers)", fontsize=9)
    out["answer_f1_by_method.png"] = _png(fig)
    plt.close(fig)
    return out


def _answer_retrieval(report: dict, method: str, info: dict, ds: Dataset, config: EvaluateConfig) -> dict | None:
    """recall_any@5 / NDCG@10 of the context an answer method used: the scored rankings of the same
    label, else its source scored here; the oracle's are 1 by construction; no memory has none."""
    if info.get("kind") == "none":
        return None
    if info.get("kind") == "oracle":
        return {"recall_any@5": 1.0, "ndcg@10": 1.0, "note": "gold sessions"}
    r = report["retrieval"].get(method)
    if r is None and info.get("source"):
        try:
            r = score_rankings(rankings.read_rankings(info["source"]), ds, config.ks, config.curve_max_k,
                               config.ndcg_variant)
        except Exception as e:  # noqa: BLE001 - the report still shows the answers
            log.warning("evaluate: cannot score the rankings behind %s (%s): %s", method, info["source"], e)
            return None
    if r is None:
        return None
    return {k: r["overall"].get(k) for k in ("recall_any@5", "ndcg@10")}


@stage("evaluate", EvaluateConfig, family="chat", gpus=0,
       help="Score rankings and answers: JSON + Markdown report and PNG plots")
def run(config: EvaluateConfig, out: storage.Publication) -> dict:
    ds = read_dataset(config.input)
    report: dict = {"dataset": {"uri": config.input, "questions": len(ds.questions),
                                "scored_for_retrieval": sum(1 for q in ds.questions if rankings.eligible(q)),
                                "by_dataset": ds.summary()["questions_by_dataset"]},
                    "ks": config.ks, "ndcg_variant": config.ndcg_variant, "retrieval": {}, "answers": {}}
    for uri in config.rankings:
        for hint, path in expand_rankings(uri):
            rows = rankings.read_rankings(path)
            label = (rows[0].get("method") if rows else None) or hint
            if label in report["retrieval"]:
                label = f"{label} ({uri.rstrip('/').rsplit('/', 1)[-1]})"
            report["retrieval"][label] = {"source": path, **score_rankings(
                rows, ds, config.ks, config.curve_max_k, config.ndcg_variant)}
    for uri in config.answers:
        path = uri if uri.endswith(".parquet") else storage.published_file(uri, "answers.parquet")
        model, meta = None, {}
        if not uri.endswith(".parquet"):
            m = storage.read_manifest(uri)
            model = (m.get("config", {}).get("endpoint") or {}).get("model")
            meta = (m.get("stats") or {}).get("methods") or {}
        rows = storage.read_parquet(path).to_pylist()
        by_method: dict[str, list[dict]] = {}
        for r in rows:  # one chat output answers with one or more contexts (methods)
            by_method.setdefault(r.get("method") or "chat", []).append(r)
        for method, rs in by_method.items():
            label = method
            if label in report["answers"]:
                label = f"{label} ({uri.rstrip('/').rsplit('/', 1)[-1]})"
            info = meta.get(method) or {}
            status = info.get("ranking_status") or {}
            if not status:  # rows carry the status of the ranking each context came from
                for r in rs:
                    if r.get("ranking_status"):
                        status[r["ranking_status"]] = status.get(r["ranking_status"], 0) + 1
            report["answers"][label] = {"source": path, "model": model, "method": method,
                                        "kind": info.get("kind") or ("rankings" if status else None),
                                        "ranking_status": status, "fallback": fallback_note(status),
                                        "retrieval": _answer_retrieval(report, method, info, ds, config),
                                        **score_answers(rs)}
    for label, r in report["retrieval"].items():
        r["fallback"] = fallback_note(r["status"])
    out.write_json("report.json", report)
    faults.checkpoint("saved", done=1)
    out.write_text("report.md", markdown(report, config.ks))
    for name, data in plots(report, config.curve_max_k).items():
        out.write_bytes(name, data)
    return {"retrieval": {k: {**{m: v["overall"].get(m) for m in ("recall_any@5", "ndcg@10", "mrr")},
                              "status": v["status"], "fallback": v.get("fallback")}
                          for k, v in report["retrieval"].items()},
            "answers": {k: {**v["overall"], "retrieval": v.get("retrieval"), "fallback": v.get("fallback"),
                            "model": v.get("model")} for k, v in report["answers"].items()},
            "report": storage.join(config.output, "report.md")}
