"""The tables a run's results are shown in on a terminal: what ``memsifter demo`` prints as each stage finishes
and ``memsifter run evaluate`` prints of its output (:func:`screen`): the first stage, the rankers beside it, the
answers of the working LLM with each context and its reference rows, the memory agents beside chat's contexts with
their cost. Every line fits :data:`TABLE_WIDTH`; every mean comes with its n and 95% bootstrap interval.

``results`` maps a dataset's name to the manifests of its stages, by section name: ``embed``, ``rank``,
``evaluate`` and, for the agents, :data:`AGENTS` / :data:`AGENTS_TRAINED` (the agents stages) and
:data:`AGENTS_EVAL` (the evaluate instance that scores them beside chat) — the names the demo's pipeline gives
them.
"""

from __future__ import annotations

import textwrap

TABLE_WIDTH = 120   # every line printed fits a terminal this wide (long labels wrap within their column)
AGENTS = "agents"                 # the memory agents' section: <run>/agents
AGENTS_TRAINED = "agents-trained" # the same agents with a trained adapter: <run>/agents-trained
AGENTS_EVAL = "evaluate-agents"   # the evaluate instance scoring chat's contexts and the agents side by side


def agent_label(method: str, options: dict | None = None) -> str:
    """What an agent row is, in words; ``options``: the agents stage's ``agent_options`` (method -> budgets), whose
    memory budgets the label states. A row of the trained adapter's section comes labelled
    ``agent:… (agents-trained)`` by evaluate."""
    method, _, src = method.partition(" (")
    who = "trained adapter" if src.rstrip(")") == AGENTS_TRAINED else "untrained"
    if method == "agent:search":
        return f"{method} ({who}; searches the memory service)"
    o = (options or {}).get(method) or {}
    if o.get("max_chunks") is None or o.get("memory_tokens") is None:
        return f"{method} ({who}; reads the first stage's top sessions)"
    return (f"{method} ({who}; reads the first stage's top {o['max_chunks']} sessions, "
            f"{o['memory_tokens']}-token notes)")


def _f(v) -> str:  # noqa: ANN001
    return f"{v:.3f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _fci(m: dict, key: str) -> str:
    """``mean [low, high]`` of a metric from evaluate's stats (its 95% bootstrap interval), the mean
    alone where the stats carry no interval."""
    ci = (m.get("ci") or {}).get(key)
    return _f(m.get(key)) + (f" [{ci['ci_low']:.2f}, {ci['ci_high']:.2f}]" if ci else "")


def _adapter(label: str) -> bool:
    """Whether a ranker's method (``rank:<model>[+structured]``) names a LoRA adapter of the model registry (one
    this platform trained)."""
    from ..models import registry

    m = registry.lookup(label.partition(":")[2].partition("+")[0])
    return m is not None and m.kind == "adapter"


def ranker_label(label: str, input_order: dict | None) -> str:
    """What a ranker is, in words: the trained adapter or the untrained base, and ``returns its input
    order`` where evaluate measured that it changed no question's order."""
    from .metrics import INPUT_ORDER_NOTE

    kind = "trained adapter" if _adapter(label) else "untrained ranker"
    same = bool(input_order and input_order.get("returns_input_order"))
    return f"{label} ({kind}" + (f"; {INPUT_ORDER_NOTE})" if same else ")")


def _changed(io: dict | None) -> str:
    if not io or io.get("n") is None:
        return "-"
    return f"{io['changed']}/{io['n']} ({io['changed_share']:.0%})"


def _table(header: list[tuple[str, str]], rows: list[list[str]], width: int | None = None) -> list[str]:
    """Text columns as wide as their widest cell (labels here are long and honest); alignment ``<`` left, ``>``
    right, ``w`` left and wrappable. With ``width`` (the screen): a first column whose cells are all one value
    (the dataset of a table printed per dataset) is left out, the paragraph above naming it; the widest
    wrappable column is narrowed until a line fits, its cells wrapping between words onto continuation lines
    (indented by two) whose other cells are blank; and a table that does not fit even so is printed as two or
    more tables one under the other, each with the label columns (those up to the first wrappable one) and
    as many of the others, in order, as fit."""
    if width and rows and len({r[0] for r in rows}) == 1:
        header, rows = header[1:], [r[1:] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _) in enumerate(header)]
    wrap = [i for i, (_, a) in enumerate(header) if a == "w"]
    floor = {i: max([len(w) + (2 if k else 0) for r in rows for k, w in enumerate(r[i].split())]
                    + [len(header[i][0])]) for i in wrap}   # a continuation line is indented by two
    while width and sum(widths) + len(widths) - 1 > width:
        i = max((j for j in wrap if widths[j] > floor[j]), key=lambda j: widths[j], default=None)
        if i is None:
            break
        widths[i] -= 1
    if width and sum(widths) + len(widths) - 1 > width and wrap and wrap[0] + 1 < len(header):
        key = list(range(wrap[0] + 1))
        rest = list(range(len(key), len(header)))
        used = sum(widths[i] + 1 for i in key)

        def fits(cols: list[int]) -> bool:
            return used + sum(widths[j] + 1 for j in cols) - 1 <= width
        halves = [(rest[:k], rest[k:]) for k in range(1, len(rest)) if fits(rest[:k]) and fits(rest[k:])]
        if halves:   # two tables as even as they can be
            chunks = list(min(halves, key=lambda h: max(sum(widths[j] for j in c) for c in h)))
        else:        # else as many columns in each as fit, in order
            chunks = [[]]
            for i in rest:
                if chunks[-1] and not fits(chunks[-1] + [i]):
                    chunks.append([])
                chunks[-1].append(i)
        if len(chunks) > 1:
            out: list[str] = []
            for chunk in chunks:
                cols = key + chunk
                out += ([""] if out else []) + _table([header[i] for i in cols], [[r[i] for i in cols] for r in rows],
                                                      width)
            return out

    def lines(cells: list[str]) -> list[str]:
        parts = [textwrap.wrap(c, w, subsequent_indent="  ", break_on_hyphens=False) or [""]
                 if a == "w" and len(c) > w else [c]
                 for c, w, (_, a) in zip(cells, widths, header)]
        return [" ".join((p[k] if k < len(p) else "").rjust(w) if a == ">" else
                         (p[k] if k < len(p) else "").ljust(w)
                         for p, w, (_, a) in zip(parts, widths, header)).rstrip()
                for k in range(max(len(p) for p in parts))]
    return [ln for r in [[h for h, _ in header]] + rows for ln in lines(r)]


def _wrap_text(text: str, width: int | None) -> list[str]:
    """A paragraph as lines of at most ``width`` characters (one line when ``width`` is None)."""
    return textwrap.wrap(text, width) if width else [text]


RANKERS_INTRO = ("Rankers, beside the first stage on the same questions (the ones they ranked); Δ NDCG: against "
                 "the first stage's order the ranker was given (its input); changed: the questions on which its "
                 "order changed against that order of the shown sessions; τ: its mean Kendall τ to it (1 = its "
                 "input order); mean [95% bootstrap interval]:")


def first_stage_table(results: dict[str, dict], first_stage: bool = True, rankers: bool = True,
                      width: int | None = None) -> list[str]:
    """Per dataset, every first-stage method on all its questions with its gain over plain dense (``first_stage``);
    then every ranker beside the first stage on the questions the rankers ranked (the same n), with how
    often it changed the order it was given (the first stage's) and its mean Kendall τ to it (``rankers``).
    Every mean has its n and 95% bootstrap interval. ``width``: lines fit it (:func:`_table`)."""
    first: list[list[str]] = []
    ranked: list[list[str]] = []
    unknown: list[str] = []   # datasets whose evaluate output has no order change (written by an older memsifter)
    for ds, res in results.items():
        ev = (res["evaluate"].get("stats") or {})
        retr = ev.get("retrieval") or {}
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")
        n_first = ((res.get("embed") or {}).get("stats") or {}).get("questions")
        n_rank = ((res.get("rank") or {}).get("stats") or {}).get("questions")
        default = f"embed:{primary}" if primary else None

        def named(label: str) -> str:
            return label + (" (default)" if label == default else "")

        dense = next((m for k, m in retr.items() if k.endswith(":dense")), None)
        for label, m in retr.items():
            if label.startswith("rank:"):
                continue
            nd = m.get("ndcg@10")
            gain = (f"{nd - dense['ndcg@10']:+.3f}" if dense and nd is not None and dense.get("ndcg@10") is not None
                    else "")
            shown = named(label) + (f" [{m['fallback']}]" if m.get("fallback") else "")
            n = m.get("n", n_first)
            first.append([ds, shown, str(n if n is not None else ""), _fci(m, "recall_any@5"), _fci(m, "ndcg@10"),
                          gain])
        ranker_labels = [k for k in retr if k.startswith("rank:")]
        if not ranker_labels:
            continue
        # the rankers' questions: every method scored on the questions all of them ranked (evaluate's
        # on_common) when the sets differ, else each method's own scores (then they are the same questions)
        same_q = (ev.get("question_sets") or {}).get("on_common") or retr
        base = same_q.get(default) if default else None
        for label in [k for k in same_q if not k.startswith("rank:")] + ranker_labels:
            m = same_q.get(label) or retr.get(label) or {}
            full = retr.get(label) or {}
            io = m.get("input_order") or full.get("input_order")
            nd = m.get("ndcg@10")
            rank = label.startswith("rank:")
            if rank and not io and ds not in unknown:
                unknown.append(ds)
            # a difference only between means over the same questions (the same n)
            same_n = bool(base) and m.get("n") is not None and base.get("n") == m.get("n")
            gain = (f"{nd - base['ndcg@10']:+.3f}" if rank and same_n and nd is not None
                    and base.get("ndcg@10") is not None else "input" if label == default else "")
            shown = ranker_label(label, io) if rank else named(label)
            if full.get("fallback"):
                shown += f" [{full['fallback']}]"
            n = m.get("n", n_rank if rank else None)
            ranked.append([ds, shown, str(n if n is not None else ""), _fci(m, "recall_any@5"), _fci(m, "ndcg@10"),
                           gain, _changed(io) if rank else "-",
                           _fci({"tau_mean": io.get("tau_mean"), "ci": io.get("ci")}, "tau_mean")
                           if rank and io and io.get("n") is not None else "-"])
    lines = (_table([("dataset", "<"), ("method", "w"), ("n", ">"), ("recall_any@5", "<"), ("NDCG@10", "<"),
                     ("Δ NDCG", ">")], first, width) if first_stage else [])
    if ranked and rankers:
        if first_stage:
            lines += ["", *_wrap_text(RANKERS_INTRO, width), ""]
        lines += _table([("dataset", "<"), ("method", "w"), ("n", ">"), ("recall_any@5", "<"), ("NDCG@10", "<"),
                         ("Δ NDCG", ">"), ("changed", ">"), ("τ vs input", "<")], ranked, width)
    if unknown and rankers:
        lines += ["", *_wrap_text(f"({', '.join(unknown)}: this evaluate output predates the order-change report, "
                                  "and its rankers and first stage may be over different questions; `memsifter demo "
                                  "--force` re-runs it)", width)]
    return lines


REFERENCE_ROWS = ("no memory", "constant answer", "random sessions")


def _context_order(label: str) -> tuple[int, int, str]:
    """Answer methods in the screen's order: the references (no memory, the constant answer, random sessions),
    dense, the first stage, rankers, the oracle, agents; within a group by name (agents: in the order they ran),
    so that a re-run, which reads the stats back from the manifests, prints the rows in the same order."""
    ref = next((i for i, r in enumerate(REFERENCE_ROWS) if label.startswith(r)), None)
    group = (0 if ref is not None else 1 if label.endswith(":dense") else
             2 if label.startswith("embed:") else 3 if label.startswith("rank:") else
             5 if label.startswith("agent:") else 4)
    return group, ref or 0, "" if group == 5 else label


def answers_table(results: dict[str, dict], width: int | None = None) -> list[str]:
    """Per dataset with answers: F1 / EM of the working LLM with each context (n answered, 95% interval),
    and that context's retrieval on the same answered questions (its own n: those with gold sessions).
    ``width``: lines fit it (:func:`_table`)."""
    rows: list[list[str]] = []
    refs_named: list[str] = []
    for ds, res in results.items():
        stats = res["evaluate"].get("stats") or {}
        a = stats.get("answers") or {}
        if not a:
            continue
        retr = stats.get("retrieval") or {}
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")

        for label in sorted(a, key=_context_order):
            m = a[label]
            rt = m.get("retrieval") or {}
            on = m.get("retrieval_on") or {}
            if label.startswith("rank:"):
                shown = ranker_label(label, (retr.get(label) or {}).get("input_order"))
            else:
                shown = label + (" (default first stage)" if primary and label == f"embed:{primary}" else "")
            note = m.get("fallback") or rt.get("note") or ""
            n = (m.get("ci") or {}).get("f1", {}) or {}
            vs = (m.get("vs_reference") or {}).get("f1")
            if vs and vs["reference"] not in refs_named:
                refs_named.append(vs["reference"])
            rows.append([ds, shown, str(n.get("n", m.get("answered", m.get("n", "")))), _fci(m, "f1"),
                         _f(m.get("locomo_f1")),
                         f"{vs['diff']:+.2f} [{vs['ci_low']:+.2f},{vs['ci_high']:+.2f}]" if vs else "-",
                         _f(m.get("exact_match")), str(on.get("n", "-")),
                         _fci({**rt, "ci": on.get("ci")}, "recall_any@5") if rt else "-",
                         _fci({**rt, "ci": on.get("ci")}, "ndcg@10") if rt else "-", note])
    if not rows:
        return []
    return _table([("dataset", "<"), ("context", "w"), ("n", ">"), ("F1 [95% CI]", "<"), ("LoCoMo", ">"),
                   ("ΔF1 vs ref", "<"), ("EM", ">"), ("ret. n", ">"), ("recall_any@5", "<"), ("NDCG@10", "<"),
                   ("note", "w")], rows, width) + (textwrap.wrap(
        f"LoCoMo: LoCoMo's own QA F1 (stemmed, per category) over the LoCoMo questions. ΔF1 vs ref: F1 minus the "
        f"strongest reference's "
        f"({', '.join(refs_named)}) on the same questions, 95% paired bootstrap interval; the constant answer is "
        "chosen on the other half of the questions (report.md names it).", width or 120) if refs_named else [])


def _cost(v, fmt: str) -> str:  # noqa: ANN001
    return "-" if v is None else format(v, fmt)


def agents_table(results: dict[str, dict], width: int | None = None) -> list[str]:
    """Per dataset run with ``--agents``: every answer method (chat's contexts, the agents) on the questions all
    of them answered (evaluate's side by side), F1 / EM with n and 95% interval, and the cost per question
    over those questions: LLM calls, tokens read (prompt tokens of all calls) and seconds (an agent's
    episode; chat answers in batches and records none), and each agent's well-formed episodes."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for ds, res in results.items():
        stats = (res.get(AGENTS_EVAL) or {}).get("stats") or {}
        sbs = stats.get("side_by_side") or {}
        methods = sbs.get("methods") or {}
        if not methods:
            continue
        retr = stats.get("retrieval") or {}
        primary = ((res.get("embed") or {}).get("stats") or {}).get("primary")
        def own(section: str) -> dict:
            return (res.get(section) or {}).get("stats") or {}

        cached = sum((own(x).get("client") or {}).get("cached") or 0 for x in (AGENTS, AGENTS_TRAINED))
        if cached:
            notes.append(f"({ds}: {cached} of the agents' LLM calls were replayed from the agents stage's response "
                         "cache (a re-run): their seconds are not the model's)")
        for label in sorted(methods, key=_context_order):
            m = methods[label]
            method, _, src = label.partition(" (")  # the trained adapter's rows: "agent:… (agents-trained)"
            section = AGENTS_TRAINED if src.rstrip(")") == AGENTS_TRAINED else AGENTS
            if label.startswith("agent:"):
                shown = agent_label(label, ((res.get(section) or {}).get("config") or {}).get("agent_options"))
            elif label.startswith("rank:"):
                shown = ranker_label(label, (retr.get(label) or {}).get("input_order"))
            else:
                shown = label + (" (default first stage)" if primary and label == f"embed:{primary}" else "")
            o = (own(section).get("methods") or {}).get(method) or {}
            ok = (f"{round(o['format_ok'] * o['answered'])}/{o['answered']}"
                  if o.get("format_ok") is not None and o.get("answered") else "-")
            rows.append([ds, shown, str(m.get("n", "")), _fci(m, "f1"), _fci(m, "exact_match"),
                         _cost(m.get("llm_calls"), ".1f"), _cost(m.get("prompt_tokens"), ",.0f"),
                         _cost(m.get("seconds"), ",.1f"), ok])
        if not sbs.get("same", True):
            per = ", ".join(f"{k} {v}" for k, v in sorted((sbs.get("per_method") or {}).items(),
                                                          key=lambda kv: _context_order(kv[0])))
            notes.append(f"({ds}: questions answered per method: {per}; every method compared on the "
                         f"{sbs.get('questions')} questions all of them answered)")
    if not rows:
        return []
    return _table([("dataset", "<"), ("method", "w"), ("n", ">"), ("F1 [95% CI]", "<"), ("EM [95% CI]", "<"),
                   ("calls", ">"), ("tokens", ">"), ("seconds", ">"), ("well-formed", ">")],
                  rows, width) + ([""] + [ln for n in notes for ln in _wrap_text(n, width)] if notes else [])


INDENT = "  "   # table lines are indented by this under their paragraph


def screen(results: dict[str, dict], part: str) -> list[str]:
    """What the demo prints of ``part`` once its stage is done, every line at most :data:`TABLE_WIDTH` wide:
    ``first`` the first-stage table (after embed: ``results``' evaluate stats may hold only ``retrieval``),
    ``evaluate`` the rankers beside the first stage and the answers, ``agents`` the agents beside chat's
    contexts. ``memsifter run evaluate`` prints the same (:func:`memsifter.stages.evaluate.terminal_summary`)."""
    width = TABLE_WIDTH - len(INDENT)
    out: list[str] = []

    def section(intro: str, lines: list[str]) -> None:
        if lines:
            out.extend(["", *_wrap_text(intro, TABLE_WIDTH), ""] + [(INDENT + ln).rstrip() for ln in lines])

    names = ", ".join(results)
    if part == "first":
        section(f"First-stage retrieval ({names}): every method on all its questions, the default marked; n = "
                "questions with gold sessions, mean [95% bootstrap interval]; Δ NDCG: against plain dense "
                "retrieval:", first_stage_table(results, rankers=False, width=width))
    elif part == "evaluate":
        section(f"{RANKERS_INTRO[:-1]} ({names}):", first_stage_table(results, first_stage=False, width=width))
        models_ = sorted({a["model"] for res in results.values()
                          for a in (((res.get("evaluate") or {}).get("stats") or {}).get("answers") or {}).values()
                          if a.get("model")})
        llm = f" ({', '.join(models_)})" if models_ else ""
        section(f"Answers of the working LLM{llm} with each context ({names}), on the same "
                "questions: token F1 [95% bootstrap interval] / exact match against the gold answer, n answered; "
                "recall_any@5 / NDCG@10 of that context on the same answered questions (ret. n: those with gold "
                "sessions):", answers_table(results, width=width))
    elif part == "agents":
        section(f"Memory agents beside the working LLM's contexts ({names}), on the questions all of them "
                "answered: F1 / EM with n and [95% bootstrap interval]; cost per question: LLM calls, tokens read "
                "(prompt tokens of all its calls: the agents' as the server counts them, chat's prompt as its "
                "tokenizer counts it), seconds (an agent's episode, wall clock, episodes running side by side; "
                "chat answers in batches: -); well-formed: episodes whose every reply followed the agent's "
                "format:", agents_table(results, width=width))
    return out
