"""The ``evaluate`` stage's plots of a report (:mod:`memsifter.retrieval.scoring`'s numbers): recall curves,
answer F1 by method and by type, F1 against tokens read; error bars and bands are the 95% bootstrap
intervals, n in the legends."""

from __future__ import annotations

import io
import logging

log = logging.getLogger("memsifter.stages.evaluate")


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
