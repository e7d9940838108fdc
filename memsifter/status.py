"""``memsifter status RUN [--watch]``: what each stage of a run is doing, from the store alone.

A run prefix (local or ``s3://``) holds one output per stage (``<run>/<stage>``, as ``memsifter
pipeline`` and the demo lay them out). For each, from what lies in the store (so it works after the
pods and their logs are gone):

- **running**: a live ``_LEASE`` (holder: run id, host, pid, since; how far: files of partial work
  saved under ``_work/``);
- **failed**: ``_work/failure.json``, which a stage writes when an attempt raises (error, time, run,
  host and the last log lines), newer than any published output;
- **published**: ``_SUCCESS`` (when, by which run, files, headline stats);
- **stale lease**: a ``_LEASE`` that expired (its run died; the next run takes it over);
- **not started**: a stage the run's plan (``<run>/_run/plan.json``, written by ``memsifter
  pipeline`` when it starts) names that has none of the above.

``--watch [SECONDS]`` redraws until every stage is published or failed; ``--json`` prints the states
as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime

from . import storage
from .errors import MemsifterError

PLAN = "plan.json"
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


def stage_state(out: str, name: str) -> dict:
    """The state of one stage output (see the module docstring)."""
    from .lease import LEASE, describe

    st: dict = {"stage": name, "output": out}
    lease = _read_json(storage.join(out, LEASE))
    manifest = None
    try:
        manifest = storage.try_manifest(out)
    except MemsifterError as e:
        st["problem"] = str(e)
    failure = _read_json(storage.join(out, storage.WORK, "failure.json"))
    now = time.time()
    if lease and float(lease.get("expires_at") or 0) > now:
        partial = [f for f in storage.list_files(storage.join(out, storage.WORK))
                   if f.endswith((".parquet", ".npy", ".jsonl")) and "/" in f]
        st.update(state="running", holder=describe(lease, now), partial_files=len(partial))
    elif failure and (manifest is None or _ts(failure.get("failed_at")) > _ts(manifest.get("published_at"))):
        st.update(state="failed", error=failure.get("error"), failed_at=failure.get("failed_at"),
                  run_id=failure.get("run_id"), host=failure.get("host"), log_tail=failure.get("log_tail") or [],
                  earlier_output_published=manifest is not None)
    elif manifest is not None:
        stats = manifest.get("stats") or {}
        st.update(state="published", published_at=manifest.get("published_at"), run_id=manifest.get("run_id"),
                  files=len(manifest.get("files") or {}),
                  headline={k: stats[k] for k in HEADLINE if isinstance(stats.get(k), (int, float))})
        if manifest.get("stage") and manifest["stage"] != name:
            st["stage"] = manifest["stage"]
    elif lease:
        st.update(state="stale lease", holder=describe(lease, now))
    else:
        st.update(state="not started")
    return st


def run_status(run: str) -> dict:
    """States of every stage of a run, in the plan's order (then any other output found)."""
    from .stage import available_stages

    run = run.rstrip("/")
    if not storage.exists(run) and not storage.list_files(run):
        raise MemsifterError(f"{run}: nothing there (no run was started under this prefix)")
    plan = _read_json(storage.join(run, "_run", PLAN)) or {}
    planned = [(s["stage"], s["output"]) for s in plan.get("stages") or []
               if isinstance(s, dict) and s.get("stage") and s.get("output")]
    found = [d for d in storage.list_dirs(run) if not d.startswith("_")]
    seen = {o.rstrip("/") for _, o in planned}
    order = available_stages()
    extra = sorted((d for d in found if storage.join(run, d) not in seen),
                   key=lambda d: (order.index(d) if d in order else len(order), d))
    stages = [stage_state(o, n) for n, o in planned] + [stage_state(storage.join(run, d), d) for d in extra]
    stages = [s for s in stages if s["state"] != "not started" or s["output"] in seen]
    return {"run": run, "planned": bool(planned), "stages": stages}


def render(report: dict) -> str:
    lines = [f"run {report['run']}" + ("" if report["planned"] else " (no plan.json: stages found in the store)")]
    for s in report["stages"]:
        head = f"  {s['stage']:<11} {s['state']:<12}"
        if s["state"] == "published":
            hl = ", ".join(f"{k} {v}" for k, v in s.get("headline", {}).items())
            lines.append(f"{head} {s['published_at']} by {s['run_id']}, {s['files']} files" + (f"; {hl}" if hl else ""))
        elif s["state"] == "running":
            lines.append(f"{head} {s['holder']}; {s['partial_files']} partial-work files saved")
        elif s["state"] == "failed":
            lines.append(f"{head} {s['failed_at']} (run {s['run_id']}, host {s['host']}): {s['error']}"
                         + (" [an earlier output stays published]" if s.get("earlier_output_published") else ""))
            lines += [f"  {'':<11} | {ln}" for ln in s["log_tail"][-5:]]
        elif s["state"] == "stale lease":
            lines.append(f"{head} {s['holder']} (the run died; the next run takes it over)")
        else:
            lines.append(head.rstrip())
        if s.get("problem"):
            lines.append(f"  {'':<11} ! {s['problem']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from .cli import plain

    p = argparse.ArgumentParser(prog="memsifter status", description=plain(__doc__))
    p.add_argument("run", help="run prefix (local path or s3://bucket/prefix)")
    p.add_argument("--watch", nargs="?", const=5.0, type=float, metavar="SECONDS",
                   help="redraw every SECONDS (default 5) until every stage is published or failed")
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
        busy = [s for s in report["stages"] if s["state"] in ("running", "not started", "stale lease")]
        if not args.watch or not busy:
            return 1 if any(s["state"] == "failed" for s in report["stages"]) else 0
        time.sleep(args.watch)
        if not sys.stdout.isatty() and not args.json:
            print()


if __name__ == "__main__":
    sys.exit(main())
