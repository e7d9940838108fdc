"""The ``evaluate`` stage's Markdown report (``report.md``) of a report (:mod:`memsifter.retrieval.scoring`'s
numbers): tables of retrieval and answers with n and 95% intervals, the reference rows, LongMemEval's own
metrics and judge, the answer methods side by side with their cost."""

from __future__ import annotations

from .metrics import BOOTSTRAP_RESAMPLES, INPUT_ORDER_NOTE


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
