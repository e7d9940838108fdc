"""``memsifter pipeline``: run stages in dependency order under one run prefix, from a dataset to a report
(import/synth → embed → rank → chat → evaluate) and on to a trained ranker (prepare-rl → sft → train →
collect → merge).

A pipeline config (YAML/JSON, local or s3://)::

    run: s3://bucket/runs/lme-s          # every output under here: <run>/<stage>
    ray: {address: null, num_cpus: null}  # default: $RAY_ADDRESS, else a local Ray cluster when a stage needs Ray
    stages:                               # any order; leave a stage out to skip it
      import: {format: longmemeval, source: s3://bucket/raw/longmemeval_s.json}
      embed: {model: BAAI/bge-m3}
      rank: {model: zstanjj/MemSifter-4B-Thinking}
      chat: {endpoint: {base_url: https://api.openai.com/v1, model: gpt-4o-mini}}
      evaluate: {}

Each stage's section is that stage's config (``memsifter run STAGE --schema``); the pipeline fills in
``output`` (``<run>/<stage>``) and, where the section leaves them out, the inputs that read another
stage's output. Both the order and that wiring come from the stages' own input declarations
(``uri_field(stage=...)`` in each stage module): a stage runs after every stage it reads from, and an
input takes the output of the first of its producers in the pipeline (every producer's, for inputs
such as evaluate's ``rankings``). Instead of ``import``/``synth`` a top-level ``dataset: URI`` names an
already-published dataset. ``--from STAGE`` / ``--until STAGE`` run a contiguous part of the order: the
inputs of its first stage come from its section or from the outputs the earlier stages of the config
published in the run. Stages whose output is already published with the same config are skipped (the
stage registry's manifest check), so re-running a pipeline after a crash redoes only what is missing;
stages resume their own partial work (``<output>/_work``).

The keys are checked before anything runs: an unknown key (``rey:``, ``datset:``, a stage's
``questoins:``) is one line with the nearest known key. ``memsifter pipeline schema`` prints the
config's JSON schema, generated from :class:`PipelineConfig` and the stage registry.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from . import storage
from .errors import ConfigError
from .stage import (
    available,
    config_hash,
    derive_needs,
    get_stage,
    load_config_file,
    parse_value,
    set_path,
    suggest,
    validate_config,
    wired_value,
)

log = logging.getLogger(__name__)


class RaySettings(BaseModel):
    """Where the stages that use Ray (embed, rank's vLLM engines) run."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="Ray cluster to join (it becomes RAY_ADDRESS); default: "
                                "$RAY_ADDRESS, else a local Ray instance started when a stage first needs Ray")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of that local instance (default: all)")


class PipelineConfig(BaseModel):
    """A pipeline config: the run prefix, optionally a published dataset and Ray settings, and one
    section per stage (that stage's own config, ``memsifter run STAGE --schema``)."""

    model_config = ConfigDict(extra="forbid")

    run: str | None = Field(None, description="run prefix (local path or s3://bucket/prefix): stage X publishes "
                            "to <run>/X; --run overrides it (one of the two is required)")
    dataset: str | None = Field(None, description="an already-published dataset (URI) that stands in for the "
                                "stages that start a pipeline (import, synth) when none of them is in 'stages'")
    ray: RaySettings = Field(default_factory=RaySettings, description=RaySettings.__doc__)
    stages: dict[str, dict[str, Any] | None] = Field(
        default_factory=dict, description="stage name -> that stage's config; left-out stages do not run, "
        "the order comes from the stages' inputs. 'output' and the inputs that read another stage's output "
        "are filled in where the section leaves them out")


def check_spec(spec: Any) -> None:
    """One ConfigError line for a pipeline config whose keys or shapes are wrong: an unknown key at the
    top, under ``ray`` or in ``stages`` (with the nearest known one: ``datset`` → ``dataset``), or a
    value of the wrong type. Stage sections are checked against their stage's config after wiring."""
    if not isinstance(spec, dict):
        raise ConfigError(f"pipeline: the config must be a mapping, got {type(spec).__name__}")
    for key in spec:
        if key not in PipelineConfig.model_fields:
            raise ConfigError(f"pipeline: unknown key '{key}'{suggest(key, PipelineConfig.model_fields)} (known: "
                              f"{', '.join(PipelineConfig.model_fields)}; see `memsifter pipeline schema`)")
    ray = spec.get("ray")
    if isinstance(ray, dict):
        for key in ray:
            if key not in RaySettings.model_fields:
                raise ConfigError(f"pipeline: unknown key 'ray.{key}'{suggest(key, RaySettings.model_fields)} "
                                  f"(known: {', '.join(RaySettings.model_fields)})")
    stages = spec.get("stages")
    if isinstance(stages, dict):
        known = available()
        for name in stages:
            if name not in known:
                raise ConfigError(f"pipeline: unknown stage '{name}'{suggest(name, known)} (known: "
                                  f"{', '.join(known)})")
    try:
        PipelineConfig.model_validate({k: v for k, v in spec.items() if k != "stages" or isinstance(v, dict)})
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"pipeline: {loc}: {err['msg']}") from None
    if "stages" in spec and spec["stages"] is not None and not isinstance(spec["stages"], dict):
        raise ConfigError("pipeline: 'stages' must be a mapping of stage name -> config")
    for name, section in (stages or {}).items():
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"pipeline: stages.{name}: must be a mapping (that stage's config), got "
                              f"{type(section).__name__}")


def _section_model(name: str) -> type[BaseModel]:
    """Stage ``name``'s config as a pipeline section: ``output`` and the inputs the pipeline wires
    are optional (it fills them in)."""
    cls = get_stage(name).config
    wired = {i.field for i in get_stage(name).inputs if i.stages}
    overrides: dict[str, Any] = {}
    for fname, f in cls.model_fields.items():
        if fname == "output" or fname in wired:
            what = "<run>/" + name if fname == "output" else "the output of " + " or ".join(
                next(i.stages for i in get_stage(name).inputs if i.field == fname))
            overrides[fname] = (f.annotation | None, Field(None, description=f"{f.description} (default: "
                                                                                f"{what})"))
    return create_model(f"{cls.__name__}Section", __base__=cls, **overrides)


def pipeline_schema() -> dict:
    """The JSON schema of a pipeline config: :class:`PipelineConfig` with ``stages`` spelled out, one
    property per registered stage holding that stage's config schema (:func:`_section_model`)."""
    fields: dict[str, Any] = {}
    for name, st in available().items():
        fields[name.replace("-", "_")] = (_section_model(name) | None, Field(None, alias=name, description=st.help))
    stages = create_model("PipelineStages", __config__=ConfigDict(extra="forbid"), **fields)
    model = create_model("PipelineConfigSchema", __base__=PipelineConfig,
                         stages=(stages, Field(default_factory=dict,
                                               description=PipelineConfig.model_fields["stages"].description)))
    schema = model.model_json_schema(by_alias=True)
    schema["title"] = "memsifter pipeline config"
    return schema


def _upstream(name: str, needs: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    todo = list(needs.get(name, []))
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += needs.get(n, [])
    return out


def wire(spec: dict, run: str | None = None) -> list[tuple[str, dict]]:
    """The (stage, config dict) list in pipeline order, with outputs and connecting inputs filled in."""
    check_spec(spec)
    run = (run or spec.get("run") or "").rstrip("/")
    if not run:
        raise ConfigError("pipeline: no run prefix (set 'run:' in the config or pass --run)")
    stages = spec.get("stages") or {}
    if not isinstance(stages, dict):
        raise ConfigError("pipeline: 'stages' must be a mapping of stage name -> config")
    known = available()
    needs = derive_needs(known)
    order = [n for n in known if n in stages]
    if not order:
        raise ConfigError("pipeline: no stages")
    cfgs = {n: copy.deepcopy(stages[n] or {}) for n in order}
    outputs = {}
    for name in order:
        cfgs[name].setdefault("output", storage.join(run, name))
        outputs[name] = cfgs[name]["output"]
    # a published dataset named at the top stands in for the stages that start a pipeline (they read
    # no other stage's output: import, synth) when none of them is in it
    roots = [n for n, st in known.items() if not any(i.stages for i in st.inputs)]
    if spec.get("dataset") and not any(r in outputs for r in roots):
        outputs.update({r: spec["dataset"] for r in roots})
    for name in order:
        cfg = cfgs[name]
        mine = {p: outputs[p] for p in needs[name] if p in outputs}
        for inp in get_stage(name).inputs:
            if inp.field in cfg:
                continue
            if inp.wire == "first":
                there = [p for p in inp.stages if p in mine]
                for a in there:
                    for b in there:
                        if a < b and mine[a] != mine[b] and a not in _upstream(b, needs) \
                                and b not in _upstream(a, needs):
                            raise ConfigError(f"pipeline: {name}.{inp.field} could read the output of {a} or "
                                              f"of {b}: keep one of them, or set stages.{name}.{inp.field}")
            value = wired_value(inp, mine)
            if value is not None:
                cfg[inp.field] = value
            elif inp.required and inp.stages:
                alt = ", or give a top-level 'dataset: URI'" if any(p in roots for p in inp.stages) else ""
                raise ConfigError(f"pipeline: stage {name} needs the output of {' or '.join(inp.stages)} "
                                  f"({name}.{inp.field}): add {'that stage' if len(inp.stages) == 1 else 'one of them'}"
                                  f" to 'stages' or set stages.{name}.{inp.field}{alt}")
    return [(n, cfgs[n]) for n in order]


def select(plan: list[tuple[str, dict]], start: str | None = None,
           until: str | None = None) -> list[tuple[str, dict]]:
    """The contiguous part of ``plan`` from ``start`` through ``until`` (either may be None: the ends)."""
    names = [n for n, _ in plan]
    for opt, v in (("--from", start), ("--until", until)):
        if v is not None and v not in names:
            raise ConfigError(f"pipeline: {opt} {v}: not a stage of this pipeline ({', '.join(names)})")
    i = names.index(start) if start else 0
    j = names.index(until) + 1 if until else len(names)
    if i >= j:
        raise ConfigError(f"pipeline: --from {start} comes after --until {until} (order: {' → '.join(names)})")
    return plan[i:j]


def run_pipeline(spec: dict, *, run: str | None = None, force: list[str] | tuple = (),
                 replace: list[str] | tuple = (), until: str | None = None, start: str | None = None,
                 before: Callable[[str, dict], None] | None = None,
                 echo: Callable[[str], None] = print, steal_lease: bool = False) -> dict:
    """Run the stages in order (those from ``start`` through ``until``); returns {stage: manifest}.
    ``before(name, cfg)`` may edit a config just before its stage runs (the demo fills in the URL of a
    server that was still starting).

    One pipeline per run prefix: the run lease ``<run>/_run/_LEASE`` (the same one the Kubernetes
    driver takes) refuses a second pipeline or driver of the run while this one lives."""
    from . import lease

    plan = wire(spec, run)
    todo = select(plan, start, until)
    for name, cfg in todo:  # validate everything before running anything
        validate_config(name, cfg, source=f"pipeline stage '{name}'")
    root = (run or spec.get("run")).rstrip("/")
    storage.ensure_bucket(root)
    with lease.hold(storage.join(root, "_run"), purpose="pipeline", steal=steal_lease):
        write_plan(root, [(n, c["output"]) for n, c in plan])
        return _run_plan(spec, todo, root=root, force=force, replace=replace, before=before, echo=echo,
                         steal_lease=steal_lease)


def write_plan(root: str, stages: list[tuple[str, str]]) -> None:
    """``<run>/_run/plan.json``: every stage of a run with its output, written when the run starts by the
    local pipeline and by the Kubernetes driver alike; what ``memsifter status`` lists as "not started"
    until each stage shows up in the store."""
    from . import lease

    storage.write_atomic(storage.join(root, "_run", "plan.json"), json.dumps(
        {"run": root, "run_id": lease.run_id(), "started_at": storage.utcnow(),
         "stages": [{"stage": n, "output": out} for n, out in stages]}, indent=2).encode())


def _run_plan(spec: dict, plan: list, *, root, force, replace, before, echo, steal_lease) -> dict:  # noqa: ANN001
    from .raypool import session

    ray_cfg = spec.get("ray") or {}
    results: dict[str, dict] = {}
    summary = {"run": root, "stages": {}}
    with contextlib.suppress(Exception):   # a part of the order (--from/--until) adds to the run's summary
        old = json.loads(storage.read_bytes(storage.join(root, "pipeline.json")))
        if old.get("run") == root and isinstance(old.get("stages"), dict):
            summary["stages"].update(old["stages"])
    with session(ray_cfg.get("address"), ray_cfg.get("num_cpus")):
        for name, cfg in plan:
            if before:
                before(name, cfg)
            config = validate_config(name, cfg, source=f"pipeline stage '{name}'")
            if name not in replace:
                _refuse_other_config(name, config)
            t0 = time.time()
            manifest = get_stage(name).run(config, force=name in force, replace=name in replace,
                                           steal_lease=steal_lease)
            secs = time.time() - t0
            state = "skipped (already published)" if manifest.get("skipped") else f"done in {secs:.1f}s"
            echo(f"[pipeline] {name:<8} {state}: {config.output}")
            results[name] = manifest
            summary["stages"][name] = {"output": config.output, "skipped": bool(manifest.get("skipped")),
                                       "seconds": round(secs, 2), "config_hash": manifest.get("config_hash")}
    storage.write_bytes(storage.join(summary["run"], "pipeline.json"),
                        json.dumps(summary, indent=2, sort_keys=True).encode())
    return results


def _refuse_other_config(name: str, config: Any) -> None:
    """The stage's output holds its output for another config: refused here with the pipeline's own
    hint (``--replace STAGE``: the pipeline's ``--replace`` takes stage names); the stage's own check
    (:meth:`memsifter.stage.Stage.run`) stays the guard."""
    try:
        existing = storage.try_manifest(config.output)
    except storage.BadManifestError:
        return   # the stage says what is wrong with it
    if existing and existing.get("stage") == name and existing.get("config_hash") != config_hash(config):
        raise ConfigError(f"{config.output}: holds stage {name}'s output for another config (hash "
                          f"{existing.get('config_hash')}, published {existing.get('published_at')} by run "
                          f"{existing.get('run_id')}; this config: {config_hash(config)}); pass --replace {name} "
                          f"to `memsifter pipeline run` to replace it, or choose another run prefix")


def apply_sets(spec: dict, sets: list[str]) -> dict:
    spec = copy.deepcopy(spec)
    for s in sets or []:
        if "=" not in s:
            raise ConfigError(f"--set {s}: expected key=value")
        k, v = s.split("=", 1)
        set_path(spec, k.strip(), parse_value(v, f"--set {k.strip()}"))
    return spec


def check_stage_names(plan: list[tuple[str, dict]], **given: list[str]) -> None:
    """``--force``/``--replace`` name stages of the part of the pipeline that runs: anything else is one
    line (with the nearest name) instead of a flag that silently does nothing."""
    names = [n for n, _ in plan]
    for opt, values in given.items():
        for v in values:
            if v not in names:
                raise ConfigError(f"--{opt} {v}: not a stage of this pipeline{suggest(v, names)} (it runs: "
                                  f"{', '.join(names)})")


REPORT = "report.md"


def main(argv: list[str] | None = None) -> int:
    from .cli import SuggestingParser, plain, setup_logging
    from .stage import available_stages

    names = available_stages()
    p = SuggestingParser(prog="memsifter pipeline", description=plain(__doc__))
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("schema", help="print the pipeline config's JSON schema (every key, every stage's section)")
    for cmd, help_ in (("run", "run the stages in order"), ("show", "print the wired stage configs")):
        sp = sub.add_parser(cmd, help=help_)
        sp.add_argument("--config", required=True, help="pipeline YAML/JSON (local path or s3://)")
        sp.add_argument("--run", help="run prefix (overrides 'run:' in the config)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any field, e.g. stages.rank.model=... or run=s3://b/p")
        sp.add_argument("--from", dest="start", choices=names, metavar="STAGE",
                        help="start at this stage (earlier stages' outputs in the run are its inputs)")
        sp.add_argument("--until", choices=names, metavar="STAGE", help="stop after this stage")
        if cmd == "run":
            sp.add_argument("--force", nargs="+", default=[], metavar="STAGE",
                            help="re-run these stages with the same config")
            sp.add_argument("--replace", nargs="+", default=[], metavar="STAGE",
                            help="let these stages replace an output published with a different config")
            sp.add_argument("--steal-lease", action="store_true",
                            help="take over the run's and the stages' leases from a dead run")
            sp.add_argument("-v", "--verbose", action="count", default=0)
            sp.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "schema":
        print(json.dumps(pipeline_schema(), indent=2))
        return 0
    spec = apply_sets(load_config_file(args.config), args.set)
    if args.cmd == "show":
        for name, cfg in select(wire(spec, args.run), args.start, args.until):
            print(f"# {name}\n{json.dumps(validate_config(name, cfg).model_dump(mode='json'), indent=2)}")
        return 0
    setup_logging(-1 if args.quiet else args.verbose)
    check_stage_names(select(wire(spec, args.run), args.start, args.until), force=args.force,
                      replace=args.replace)
    results = run_pipeline(spec, run=args.run, force=args.force, replace=args.replace, until=args.until,
                           start=args.start, steal_lease=args.steal_lease)
    for manifest in results.values():   # stages that publish a report (evaluate)
        if REPORT in (manifest.get("files") or {}):
            print(f"report: {storage.join(manifest.get('config', {}).get('output') or '', REPORT)}")
            print(json.dumps(manifest.get("stats", {}), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
