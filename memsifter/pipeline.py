"""``memsifter pipeline``: run import/synth → embed → rank → chat → evaluate under one run prefix.

A pipeline config (YAML/JSON, local or s3://)::

    run: s3://bucket/runs/lme-s          # every output under here: <run>/<stage>
    ray: {address: null, num_cpus: null}  # default: $RAY_ADDRESS, else a local Ray cluster
    stages:                               # in this order; leave a stage out to skip it
      import: {format: longmemeval, source: s3://bucket/raw/longmemeval_s.json}
      embed: {model: BAAI/bge-m3}
      rank: {model: zstanjj/MemSifter-4B-Thinking}
      chat: {endpoint: {base_url: https://api.openai.com/v1, model: gpt-4o-mini}}
      evaluate: {}

Each stage's section is that stage's config (``memsifter run STAGE --schema``); the pipeline fills
in ``output`` (``<run>/<stage>``) and the URIs that connect the stages (``input``, ``embeddings``,
``rankings``, ``answers``) unless given. Instead of ``import``/``synth`` a top-level ``dataset: URI``
names an already-published dataset. Stages whose output is already published with the same config
are skipped (the stage registry's manifest check), so re-running a pipeline after a crash redoes
only what is missing; stages resume their own partial work (``<output>/_work``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from typing import Callable

from . import storage
from .errors import ConfigError
from .stage import get_stage, load_config_file, parse_value, set_path, validate_config

log = logging.getLogger(__name__)

ORDER = ("import", "synth", "embed", "rank", "chat", "evaluate")
DATA_STAGES = ("import", "synth")


def wire(spec: dict, run: str | None = None) -> list[tuple[str, dict]]:
    """The ordered (stage, config dict) list with outputs and connecting URIs filled in."""
    run = (run or spec.get("run") or "").rstrip("/")
    if not run:
        raise ConfigError("pipeline: no run prefix (set 'run:' in the config or pass --run)")
    stages = spec.get("stages") or {}
    if not isinstance(stages, dict):
        raise ConfigError("pipeline: 'stages' must be a mapping of stage name -> config")
    unknown = [s for s in stages if s not in ORDER]
    if unknown:
        raise ConfigError(f"pipeline: unknown stage(s) {unknown} (known: {', '.join(ORDER)})")
    data_stages = [s for s in DATA_STAGES if s in stages]
    if len(data_stages) > 1:
        raise ConfigError("pipeline: give either 'import' or 'synth', not both")
    out: dict[str, str] = {}
    dataset = spec.get("dataset")
    plan = []
    for name in ORDER:
        if name not in stages:
            continue
        cfg = copy.deepcopy(stages[name] or {})
        cfg.setdefault("output", storage.join(run, name))
        if name in DATA_STAGES:
            dataset = cfg["output"]
        else:
            if not dataset:
                raise ConfigError(f"pipeline: stage {name} needs a dataset: add an 'import' or 'synth' stage "
                                  "or a top-level 'dataset: URI'")
            cfg.setdefault("input", dataset)
        if name == "rank":
            if "embed" not in out and "embeddings" not in cfg:
                raise ConfigError("pipeline: rank needs an embed stage (or rank.embeddings)")
            cfg.setdefault("embeddings", out.get("embed"))
        if name == "chat":
            src = out.get("rank") or out.get("embed")
            if src is None and "rankings" not in cfg:
                raise ConfigError("pipeline: chat needs a rank or embed stage (or chat.rankings)")
            cfg.setdefault("rankings", src)
            if "embed" in out:
                cfg.setdefault("embeddings", out["embed"])
        if name == "evaluate":
            cfg.setdefault("rankings", [out[s] for s in ("embed", "rank") if s in out])
            cfg.setdefault("answers", [out["chat"]] if "chat" in out else [])
        out[name] = cfg["output"]
        plan.append((name, cfg))
    if not plan:
        raise ConfigError("pipeline: no stages")
    return plan


def run_pipeline(spec: dict, *, run: str | None = None, force: list[str] | tuple = (),
                 replace: list[str] | tuple = (),
                 until: str | None = None, before: Callable[[str, dict], None] | None = None,
                 echo: Callable[[str], None] = print, steal_lease: bool = False) -> dict:
    """Run the stages in order; returns {stage: manifest}. ``before(name, cfg)`` may edit a config
    just before its stage runs (the demo fills in the URL of a server that was still starting).

    One pipeline per run prefix: the run lease ``<run>/_run/_LEASE`` (the same one the Kubernetes
    driver takes) refuses a second pipeline or driver of the run while this one lives."""
    from . import lease

    plan = wire(spec, run)
    for name, cfg in plan:  # validate everything before running anything
        validate_config(name, cfg, source=f"pipeline stage '{name}'")
    root = (run or spec.get("run")).rstrip("/")
    storage.ensure_bucket(root)
    with lease.hold(storage.join(root, "_run"), purpose="pipeline", steal=steal_lease):
        # what `memsifter status` lists as "not started" until each stage shows up in the store
        storage.write_bytes(storage.join(root, "_run", "plan.json"), json.dumps(
            {"run": root, "run_id": lease.run_id(), "started_at": storage.utcnow(),
             "stages": [{"stage": n, "output": c["output"]} for n, c in plan]}, indent=2).encode())
        return _run_plan(spec, plan, run=run, force=force, replace=replace, until=until, before=before,
                         echo=echo, steal_lease=steal_lease)


def _run_plan(spec: dict, plan: list, *, run, force, replace, until, before, echo, steal_lease) -> dict:  # noqa: ANN001
    ray_cfg = spec.get("ray") or {}
    needs_ray = any(n in ("embed", "rank") for n, _ in plan)
    started_ray = False
    if needs_ray:
        import os

        import ray

        if ray_cfg.get("address"):
            os.environ["RAY_ADDRESS"] = ray_cfg["address"]
        if not ray.is_initialized():
            from .embedding import ensure_ray

            ensure_ray(ray_cfg.get("num_cpus"))
            started_ray = True
    results: dict[str, dict] = {}
    summary = {"run": (run or spec.get("run")).rstrip("/"), "stages": {}}
    try:
        for name, cfg in plan:
            if before:
                before(name, cfg)
            config = validate_config(name, cfg, source=f"pipeline stage '{name}'")
            t0 = time.time()
            manifest = get_stage(name).run(config, force=name in force, replace=name in replace,
                                           steal_lease=steal_lease)
            secs = time.time() - t0
            state = "skipped (already published)" if manifest.get("skipped") else f"done in {secs:.1f}s"
            echo(f"[pipeline] {name:<8} {state}: {config.output}")
            results[name] = manifest
            summary["stages"][name] = {"output": config.output, "skipped": bool(manifest.get("skipped")),
                                       "seconds": round(secs, 2), "config_hash": manifest.get("config_hash")}
            if until and name == until:
                break
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    storage.write_bytes(storage.join(summary["run"], "pipeline.json"),
                        json.dumps(summary, indent=2, sort_keys=True).encode())
    return results


def apply_sets(spec: dict, sets: list[str]) -> dict:
    spec = copy.deepcopy(spec)
    for s in sets or []:
        if "=" not in s:
            raise ConfigError(f"--set {s}: expected key=value")
        k, v = s.split("=", 1)
        set_path(spec, k.strip(), parse_value(v))
    return spec


def main(argv: list[str] | None = None) -> int:
    from .cli import plain, setup_logging

    p = argparse.ArgumentParser(prog="memsifter pipeline", description=plain(__doc__))
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd, help_ in (("run", "run the stages in order"), ("show", "print the wired stage configs")):
        sp = sub.add_parser(cmd, help=help_)
        sp.add_argument("--config", required=True, help="pipeline YAML/JSON (local path or s3://)")
        sp.add_argument("--run", help="run prefix (overrides 'run:' in the config)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any field, e.g. stages.rank.model=... or run=s3://b/p")
        if cmd == "run":
            sp.add_argument("--force", nargs="+", default=[], metavar="STAGE",
                            help="re-run these stages with the same config")
            sp.add_argument("--replace", nargs="+", default=[], metavar="STAGE",
                            help="let these stages replace an output published with a different config")
            sp.add_argument("--until", choices=ORDER, help="stop after this stage")
            sp.add_argument("--steal-lease", action="store_true",
                            help="take over the run's and the stages' leases from a dead run")
            sp.add_argument("-v", "--verbose", action="count", default=0)
            sp.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    spec = apply_sets(load_config_file(args.config), args.set)
    if args.cmd == "show":
        for name, cfg in wire(spec, args.run):
            print(f"# {name}\n{json.dumps(validate_config(name, cfg).model_dump(mode='json'), indent=2)}")
        return 0
    setup_logging(-1 if args.quiet else args.verbose)
    results = run_pipeline(spec, run=args.run, force=args.force, replace=args.replace, until=args.until,
                           steal_lease=args.steal_lease)
    if "evaluate" in results:
        out = results["evaluate"].get("config", {}).get("output") or ""
        print(f"report: {storage.join(out, 'report.md')}")
        print(json.dumps(results["evaluate"].get("stats", {}), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
