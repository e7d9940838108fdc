"""``memsifter status RUN [--watch]``: what each stage of a run is doing, from the store alone.

A run prefix (local or ``s3://``) holds one output per stage (``<run>/<stage>``, as ``memsifter
pipeline`` and the demo lay them out). For each, from what lies in the store (so it works after the
pods and their logs are gone):

- **running**: a live ``_LEASE`` (holder: run id, host, pid, since; how far: files of partial work
  saved under ``_work/``, and the items done, rate and ETA its progress bar records in
  ``_work/progress.json``);
- **failed**: ``_work/failure.json``, which a stage writes when an attempt raises (error, time, run,
  host and the last log lines), newer than any published output;
- **published**: ``_SUCCESS`` (when, by which run, files, headline stats);
- **stale lease**: a ``_LEASE`` that expired, or whose holder ran on this host and its process is
  gone (its run died; the next run takes it over);
- **not started**: a stage the run's plan (``<run>/_run/plan.json``, written by ``memsifter
  pipeline`` when it starts) names that has none of the above.

Outputs under the run that its plan does not name (a mistyped command's) are listed after the run's
stages, marked as outside the plan, and do not count for the exit code. ``status`` of one stage's
output shows that stage. ``--watch [SECONDS]`` (at least 1) redraws until nothing runs any more (no stage
holds a live lease and no live pipeline or driver holds the run's ``_run/_LEASE``), then exits: 0 when every
stage is published, 1 when one failed or the run stopped before the end; ``--json`` prints the
states as JSON. Exit 1 without ``--watch`` means a stage of the run failed. Text read from the store is
printed with its control characters escaped (no terminal escape sequence from a store file reaches the
terminal).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime

from .console import printable
from .store import storage
from .errors import InputError, MemsifterError

PLAN = "plan.json"
MAX_WATCH = 86_400.0   # seconds between redraws at most
MIN_WATCH = 1.0        # ... and at least (a smaller --watch is raised to it: 1e-9 redrew 8,805 times in 6 s)
HEADLINE = ("questions", "sessions", "texts", "rows", "answered", "steps", "generated")


def _read_json(uri: str) -> dict | None:
    try:
        if not storage.exists(uri):
            return None
        data = json.loads(storage.read_text(uri))
        return data if isinstance(data, dict) else None
    except (MemsifterError, ValueError, OSError):
        return None


def _ts(v: str | None) -> float:
    if not v:
        return 0.0
    try:
        return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def lease_state(prefix: str, now: float | None = None) -> tuple[str | None, dict | None, str | None]:
    """(state, holder, problem) of ``<prefix>/_LEASE``: state None (no lease), "live", "stale" (its
    process on this host is gone: :func:`memsifter.store.lease.holder_state`) or "expired"; a ``_LEASE``
    that is not a lease is no lease, with the problem said."""
    from .store.lease import holder_state, read_holder

    try:
        holder = read_holder(prefix)
    except MemsifterError as e:
        return None, None, str(e)
    if not holder:
        return None, None, None
    state = holder_state(holder, now)
    if state == "malformed":
        return None, None, f"{storage.join(prefix, '_LEASE')}: not a lease ({holder.get('malformed') or 'malformed'})"
    return state, holder, None


def stage_state(out: str, name: str | None = None) -> dict:
    """The state of one stage output (see the module docstring); ``name`` None: the stage named by
    what lies there (manifest, failure record, lease)."""
    from .store.lease import describe

    st: dict = {"stage": name, "output": out}
    now = time.time()
    held, lease, problem = lease_state(out, now)
    manifest = None
    try:
        manifest = storage.try_manifest(out)
    except MemsifterError as e:
        problem = str(e)
    if problem:
        st["problem"] = problem
    failure = _read_json(storage.join(out, storage.WORK, "failure.json"))
    if name is None:
        purpose = str((lease or {}).get("purpose") or "")
        st["stage"] = ((manifest or {}).get("stage") or (failure or {}).get("stage")
                       or (purpose[len("stage "):] if purpose.startswith("stage ") else None) or "?")
    if held == "live":
        partial = [f for f in storage.list_files(storage.join(out, storage.WORK))
                   if f.endswith((".parquet", ".npy", ".jsonl")) and "/" in f]
        st.update(state="running", holder=describe(lease, now), partial_files=len(partial))
        prog = progress(out, lease, now)
        if prog:
            st["progress"] = prog
    elif failure and (manifest is None or _ts(failure.get("failed_at")) > _ts(manifest.get("published_at"))):
        st.update(state="failed", error=failure.get("error"), failed_at=failure.get("failed_at"),
                  run_id=failure.get("run_id"), host=failure.get("host"), log_tail=failure.get("log_tail") or [],
                  earlier_output_published=manifest is not None)
    elif manifest is not None:
        stats = manifest.get("stats") or {}
        st.update(state="published", published_at=manifest.get("published_at"), run_id=manifest.get("run_id"),
                  files=len(manifest.get("files") or {}),
                  headline={k: stats[k] for k in HEADLINE if isinstance(stats.get(k), (int, float))})
        if manifest.get("stage") and manifest["stage"] != st["stage"]:
            st["stage"] = manifest["stage"]
    elif lease:
        st.update(state="stale lease", holder=describe(lease, now), gone=held == "stale")
    else:
        st.update(state="not started")
    return st


def progress(out: str, holder: dict | None, now: float) -> dict | None:
    """How far the lease holder's attempt is, from ``<out>/_work/progress.json`` (the stages' progress
    bars write it: :func:`memsifter.stage.report_progress`): items done and total, rate per second, ETA
    in seconds and the age of the record; None without a record of this holder (run id and pid)."""
    from .stage import PROGRESS

    rec = _read_json(storage.join(out, storage.WORK, PROGRESS))
    if not rec or not holder or rec.get("run_id") != holder.get("run_id") or rec.get("pid") != holder.get("pid"):
        return None
    nums = [rec.get(k) for k in ("done", "started", "updated")]
    total = rec.get("total")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in nums) \
            or not (total is None or (isinstance(total, int) and not isinstance(total, bool))):
        return None
    done, started, updated = nums
    # a count finished within the clock's resolution still had a rate; a finished count has nothing left
    rate = done / max(updated - started, 1e-3) if updated >= started and done > 0 else None
    eta = (0.0 if total is not None and done >= total else
           (total - done) / rate if rate and total is not None else None)
    return {"desc": str(rec.get("desc") or ""), "unit": str(rec.get("unit") or "item"), "done": int(done),
            "total": total, "per_second": None if rate is None else round(rate, 3),
            "eta_seconds": None if eta is None else round(eta), "age_seconds": round(max(0.0, now - updated))}


def _span(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min" if s < 7200 else f"{s / 3600:.1f} h"


def _progress_text(p: dict) -> str:
    unit = p["unit"]
    units = unit + "s" if len(unit) > 3 and not unit.endswith("s") else unit   # questions, texts; q, req
    of = f"/{p['total']}" if p["total"] is not None else ""
    rate = f", {p['per_second']:.3g} {unit}/s" if p["per_second"] else ""
    eta = f", ETA {_span(p['eta_seconds'])}" if p["eta_seconds"] is not None else ""
    return f"{p['desc']}: {p['done']}{of} {units} done{rate}{eta} (as of {_span(p['age_seconds'])} ago)"


def _where(uri: str) -> tuple[str, str]:
    """A URI normalised for comparing (``./RUN/``, ``RUN`` and ``/abs/RUN`` are one place)."""
    from .stage import _location

    return _location(uri.rstrip("/") or uri)


def read_plan(run: str) -> tuple[dict | None, list[tuple[str, str]]]:
    """The run's plan and its (stage, output) list, each output moved under ``run`` when the plan
    names it under the run prefix the pipeline was given (a plan that recorded ``./RUN`` means the
    run asked about, from any directory). A plan of the wrong shape is one InputError naming the file
    and field (exit 2)."""
    uri = storage.join(run, "_run", PLAN)
    if not storage.exists(uri):
        return None, []
    try:
        plan = json.loads(storage.read_bytes(uri, limit=16 << 20))
    except ValueError as e:
        raise InputError(f"not JSON ({str(e)[:200]})", file=uri) from None
    if not isinstance(plan, dict):
        raise InputError(f"expected a JSON object, got {type(plan).__name__}", file=uri)
    stages = plan.get("stages") or []
    if not isinstance(stages, list):
        raise InputError(f"expected a list of {{stage, output}}, got {type(stages).__name__}", file=uri,
                         field="stages")
    base = plan.get("run") if isinstance(plan.get("run"), str) else None
    out: list[tuple[str, str]] = []
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            raise InputError(f"expected an object {{stage, output}}, got {type(s).__name__}", file=uri,
                             field=f"stages[{i}]")
        for key in ("stage", "output"):
            if not isinstance(s.get(key), str) or not s[key]:
                raise InputError(f"expected a string, got {type(s.get(key)).__name__}", file=uri,
                                 field=f"stages[{i}].{key}")
        output = s["output"].rstrip("/")
        if base:
            b = base.rstrip("/")
            if output.startswith(b + "/"):
                output = storage.join(run, output[len(b) + 1:])
        out.append((s["stage"], output))
    return plan, out


def _is_stage_output(uri: str) -> bool:
    from .store.lease import LEASE

    return any(storage.exists(storage.join(uri, *p)) for p in (
        (storage.MANIFEST,), (LEASE,), (storage.WORK, "failure.json")))


def run_status(run: str) -> dict:
    """States of every stage of a run, in the plan's order, then the outputs found under the run that
    the plan does not name (``in_plan`` False); for a single stage's output, that stage."""
    from .stage import available_stages

    run = run.rstrip("/") or run
    if not storage.exists(run) and not storage.list_files(run):
        raise MemsifterError(f"{run}: nothing there (no run was started under this prefix)")
    plan, planned = read_plan(run)
    if plan is None and _is_stage_output(run):
        return {"run": run, "planned": False, "single": True, "run_lease": None, "stages": [stage_state(run)]}
    found = [d for d in storage.list_dirs(run) if not d.startswith("_")]
    seen = {_where(o) for _, o in planned}
    order = available_stages()
    extra = sorted((d for d in found if _where(storage.join(run, d)) not in seen),
                   key=lambda d: (order.index(d) if d in order else len(order), d))
    stages = [{**stage_state(o, n), "in_plan": True} for n, o in planned]
    for d in extra:
        st = stage_state(storage.join(run, d), d)
        if st["state"] != "not started":
            stages.append({**st, "in_plan": not planned})
    held, _, _ = lease_state(storage.join(run, "_run"))
    return {"run": run, "planned": bool(planned), "run_lease": held, "stages": stages}


def finished(report: dict) -> bool:
    """Nothing runs any more: no stage holds a live lease and no live pipeline/driver holds the run."""
    return report.get("run_lease") != "live" and not any(s["state"] == "running" for s in report["stages"])


def exit_code(report: dict, watched: bool) -> int:
    """1 when a stage of the run failed (and, after ``--watch``, when the run stopped before every
    stage was published); outputs outside the plan do not count."""
    own = [s for s in report["stages"] if s.get("in_plan", True)]
    if any(s["state"] == "failed" for s in own):
        return 1
    return 1 if watched and any(s["state"] != "published" for s in own) else 0


def render(report: dict) -> str:
    if report.get("single"):
        lines = [f"stage output {report['run']}"]
    else:
        lines = [f"run {report['run']}" + ("" if report["planned"] else " (no plan.json: stages found in the store)")]
    outside = False
    for s in report["stages"]:
        if not s.get("in_plan", True) and not outside:
            outside = True
            lines.append(f"  not in the run's plan ({storage.join(report['run'], '_run', PLAN)}): outputs of "
                         f"other commands")
        head = f"  {s['stage']:<11} {s['state']:<12}"
        if s["state"] == "published":
            hl = ", ".join(f"{k} {v}" for k, v in s.get("headline", {}).items())
            lines.append(f"{head} {s['published_at']} by {s['run_id']}, {s['files']} files" + (f"; {hl}" if hl else ""))
        elif s["state"] == "running":
            lines.append(f"{head} {s['holder']}; {s['partial_files']} partial-work files saved")
            if s.get("progress"):
                lines.append(f"  {'':<11} {_progress_text(s['progress'])}")
        elif s["state"] == "failed":
            lines.append(f"{head} {s['failed_at']} (run {s['run_id']}, host {s['host']}): {s['error']}"
                         + (" [an earlier output stays published]" if s.get("earlier_output_published") else ""))
            lines += [f"  {'':<11} | {ln}" for ln in s["log_tail"][-5:]]
        elif s["state"] == "stale lease":
            why = "its process on this host is gone" if s.get("gone") else "the run died"
            lines.append(f"{head} {s['holder']} ({why}; the next run takes it over)")
        else:
            lines.append(head.rstrip())
        if s.get("problem"):
            lines.append(f"  {'':<11} ! {s['problem']}")
    return "\n".join(printable(ln) for ln in lines)   # store files may hold terminal escape sequences


def _watch_seconds(text: str) -> float:
    """argparse type of ``--watch``: a finite number of seconds in (0, 86400], raised to
    :data:`MIN_WATCH`."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(v) or not 0 < v <= MAX_WATCH:
        raise argparse.ArgumentTypeError(f"{text}: seconds between redraws must be > 0 and at most "
                                         f"{MAX_WATCH:.0f}")
    return max(v, MIN_WATCH)


def main(argv: list[str] | None = None) -> int:
    from .console import SuggestingParser, plain

    p = SuggestingParser(prog="memsifter status", description=plain(__doc__))
    p.add_argument("run", help="run prefix (local path or s3://bucket/prefix), or one stage's output")
    p.add_argument("--watch", nargs="?", const=5.0, type=_watch_seconds, metavar="SECONDS",
                   help=f"redraw every SECONDS (default 5, at least {MIN_WATCH:g}) until nothing runs any more")
    p.add_argument("--json", action="store_true", help="print the states as JSON")
    args = p.parse_args(argv)
    while True:
        report = run_status(args.run)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            if args.watch and sys.stdout.isatty():
                print("\033[2J\033[H", end="")
            print(render(report), flush=True)
        if not args.watch or finished(report):
            if args.watch and not args.json:
                left = [s["stage"] for s in report["stages"] if s.get("in_plan", True) and s["state"] != "published"]
                print(printable("nothing runs any more: "
                                + (f"not published: {', '.join(left)}" if left else "all published")))
            return exit_code(report, bool(args.watch))
        time.sleep(args.watch)
        if not sys.stdout.isatty() and not args.json:
            print()


if __name__ == "__main__":
    sys.exit(main())
