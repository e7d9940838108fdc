"""Training metrics that survive the pod: verl's per-step metric lines, parsed, saved, plotted.

verl's console logger prints one line per step on the trainer's driver, which Ray forwards to the
``main_ppo`` process the train stage starts::

    (TaskRunnerV1 pid=4932) step:2 - global_seqlen/min:78324.0 - actor/entropy:8.90 - critic/score/mean:-1.0 - …

The train stage reads that process's output line by line (echoing it), turns each metric line into a
record ``{"step": N, "<metric>": value, …}`` (:func:`parse_line`), and :class:`MetricsSink` keeps them
in ``<output>/_work/metrics.jsonl``, rewritten every few steps, so the curves outlive the pod and a
resumed run continues them (a step seen again replaces the older record). At the end the stage
publishes ``metrics.jsonl``, ``training_curves.png`` (:func:`plot`) and a summary in its stats.
"""

from __future__ import annotations

import io
import json
import math
import re
import time

from ..store import storage

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"(?:^|\s)step:(\d+)\s+-\s+(.*)$")
_ITEM = re.compile(r"^\s*([A-Za-z0-9_@./\-]+):(\S+)\s*$")
_NUMPY = re.compile(r"^np\.\w+\((.*)\)$")  # verl prints validation values as np.float64(0.55)

# (title, candidate keys in order of preference, or a prefix ending in '/')
PANELS = (
    ("reward (mean score)", ("critic/score/mean", "critic/rewards/mean")),
    ("valid-format rate", ("reward/valid/mean", "critic/valid/mean", "val-aux/valid", "~format_ok")),
    ("validation (reward)", ("val-core/",)),
    ("validation NDCG@10 (held-out)", ("~ndcg10",)),
    ("response length (tokens)", ("response_length/mean",)),
    ("step time (s)", ("timing_s/step",)),
    ("rollout tokens/s", ("perf/throughput",)),
    # collapse: the token entropy falls and dynamic sampling discards ever more zero-variance groups
    ("actor token entropy", ("actor/entropy",)),
    ("groups discarded by dynamic sampling", ("training/filter_groups/evicted_samples",)),
)


def parse_line(line: str) -> dict | None:
    """The metrics of one verl console line (``step:N - key:value - …``), else None."""
    m = _STEP.search(_ANSI.sub("", line).rstrip())
    if not m:
        return None
    rec: dict = {"step": int(m.group(1))}
    for part in m.group(2).split(" - "):
        im = _ITEM.match(part)
        if not im:
            continue
        raw = im.group(2)
        wrapped = _NUMPY.match(raw)
        try:
            v = float(wrapped.group(1) if wrapped else raw)
        except ValueError:
            continue
        if math.isfinite(v):
            rec[im.group(1)] = v
    return rec if len(rec) > 1 else None


def read_jsonl(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
    return out


class MetricsSink:
    """Per-step records, kept in ``uri`` (JSONL), merged with what an earlier attempt saved there; ``offset`` is
    added to each step (a run that goes on from step ``offset`` of another GPU count numbers its steps from 1)."""

    def __init__(self, uri: str | None, flush_every_s: float = 30.0, offset: int = 0):
        self.uri, self.flush_every_s, self.offset = uri, flush_every_s, offset
        self.records: dict[int, dict] = {}
        self._dirty, self._last = False, time.time()
        if uri and storage.exists(uri):
            for rec in read_jsonl(storage.read_text(uri)):
                self.records[rec["step"]] = rec

    def feed(self, line: str) -> dict | None:
        rec = parse_line(line)
        if rec:
            if self.offset:
                rec = {**rec, "step": rec["step"] + self.offset}
            self.records[rec["step"]] = rec
            self._dirty = True
            if time.time() - self._last >= self.flush_every_s:
                self.flush()
        return rec

    def flush(self) -> None:
        self._last = time.time()
        if not (self.uri and self._dirty):
            return
        storage.write_bytes(self.uri, self.jsonl().encode())
        self._dirty = False

    def sorted(self) -> list[dict]:
        return [self.records[k] for k in sorted(self.records)]

    def jsonl(self) -> str:
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.sorted())


def _series(records: list[dict], keys: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for key in keys:
        if key.startswith("~"):  # every key containing the text (e.g. the reward's extra metrics)
            names = sorted({k for r in records for k in r if key[1:] in k})
        elif key.endswith("/"):
            names = sorted({k for r in records for k in r if k.startswith(key)})
        else:
            names = [key] if any(key in r for r in records) else []
        for n in names:
            out[n] = [(r["step"], r[n]) for r in records if n in r]
        if out and not key.endswith("/") and not key.startswith("~"):
            break
    return out


def summary(records: list[dict]) -> dict:
    """First/last value of each plotted metric, the step count and the mean step time."""
    out: dict = {"steps": len(records), "last_step": records[-1]["step"] if records else None}
    for title, keys in PANELS:
        for name, pts in _series(records, keys).items():
            out[name] = {"first": round(pts[0][1], 4), "last": round(pts[-1][1], 4), "n": len(pts)}
    return out


def plot(records: list[dict], title: str = "training") -> bytes:
    """One PNG: a panel per metric family that the records hold (reward, valid format, validation,
    response length, step time, throughput)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(t, s) for t, keys in PANELS if (s := _series(records, keys))]
    n = max(1, len(panels))
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no metric lines yet", ha="center", va="center")
    for ax, (t, series) in zip(axes.flat, panels):
        for name, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if len(series) > 1 or t == "validation":
            ax.legend(fontsize=6)
    return _png(fig, title)


def plot_sft(records: list[dict], title: str = "sft") -> bytes:
    """The sft stage's curves: training loss and learning rate per step; evaluation loss, valid-format
    rate and NDCG@10 (beside the first stage's) per evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    ev = [r for r in records if r.get("kind") == "eval"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    panels = [("training loss", train, ["loss"]), ("learning rate", train, ["lr"]),
              ("eval loss", ev, ["eval_loss"]),
              ("eval: valid format, NDCG@10", ev, ["valid_format", "ndcg@10", "first_stage_ndcg@10"])]
    for ax, (t, rs, keys) in zip(axes, panels):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rs if r.get(k) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=k,
                        ls="--" if k.startswith("first_stage") else "-")
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=6)
    return _png(fig, title)


def _png(fig, title: str) -> bytes:
    """A finished figure (suptitle, tight layout) as PNG bytes; the figure is closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()
