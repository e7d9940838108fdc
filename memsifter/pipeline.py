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

Several instances of one stage (two rankers compared on the same questions) are sections with their
own names and ``uses: STAGE``::

      rank: {model: smollm2-135m-instruct}
      rank-trained: {uses: rank, model: smollm2-135m-memsifter-ranker}
      chat: {rankings: rank}                       # an input may name the instance it reads
      evaluate: {rankings: [embed, rank, rank-trained]}

An instance publishes to ``<run>/<name>``. An input left out reads every instance of its producers
(``wire: all`` inputs) or the one instance of its first producer; two instances of that producer are
one line asking to name one. An input's value that is the name of a section of the pipeline stands for
that section's output, ``NAME/path`` for a file in it (write ``./rank`` for a local directory of that
name).

The keys are checked before anything runs: an unknown key (``rey:``, ``datset:``, a stage's
``questoins:``) is one line with the nearest known key. ``memsifter pipeline schema`` prints the
config's JSON schema, generated from :class:`PipelineConfig` and the stage registry.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import sys
import time
from typing import Any, Callable, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from .store import storage
from .errors import ConfigError
from .stage import (
    available,
    config_hash,
    derive_needs,
    derive_order,
    get_stage,
    load_config_file,
    parse_value,
    set_path,
    suggest,
    upstream,
    validate_config,
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
        instances(stages)
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
    # any other section is a second instance of a stage: 'uses: STAGE' plus that stage's config
    schema["$defs"]["PipelineStages"]["propertyNames"] = {"pattern": "^" + INSTANCE_NAME.pattern + "$"}
    schema["$defs"]["PipelineStages"]["additionalProperties"] = {
        "type": "object", "required": ["uses"], "description": "a second instance of a stage (its output: "
        "<run>/<name>): 'uses: STAGE' and that stage's config",
        "properties": {"uses": {"enum": list(available())}}}
    return schema


INSTANCE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?")


def instances(stages: dict) -> dict[str, str]:
    """Section name -> the stage it runs: a stage's own name, or another name with ``uses: STAGE``
    (a second instance). One ConfigError line for an unknown stage, a bad name or a ``uses`` that
    contradicts the section's name."""
    known = available()
    out: dict[str, str] = {}
    for name, section in stages.items():
        uses = section.get("uses") if isinstance(section, dict) else None
        if uses is None:
            if name not in known:
                raise ConfigError(f"pipeline: unknown stage '{name}'{suggest(name, known)} (known: "
                                  f"{', '.join(known)}; a second instance of a stage is a section with "
                                  f"'uses: STAGE')")
            out[name] = name
            continue
        if not isinstance(uses, str) or uses not in known:
            raise ConfigError(f"pipeline: stages.{name}.uses: unknown stage '{uses}'"
                              f"{suggest(str(uses), known)} (known: {', '.join(known)})")
        if name in known and uses != name:
            raise ConfigError(f"pipeline: stages.{name}.uses: {uses}: the section named after stage {name} "
                              f"runs {name}; give the {uses} instance another name")
        if not isinstance(name, str) or not INSTANCE_NAME.fullmatch(name):
            raise ConfigError(f"pipeline: stages.{name}: an instance name is 1-40 lowercase letters, digits "
                              f"and '-' (it names the output <run>/{name} and its Kubernetes objects)")
        out[name] = uses
    return out


class Step(NamedTuple):
    """One stage instance of a plan: its name (the pipeline section), the stage it runs, and its config
    with output and wired inputs filled in."""

    name: str
    stage: str
    config: dict


def plan(spec: dict, run: str | None = None) -> list[Step]:
    """The plan of a run: every stage instance in dependency order, with outputs and the inputs that
    read another instance's output filled in. The one place a run is wired: the local pipeline runs
    it, ``pipeline show`` prints it, the chart's wiring is rendered from it at gen time."""
    check_spec(spec)
    run = (run or spec.get("run") or "").rstrip("/")
    if not run:
        raise ConfigError("pipeline: no run prefix (set 'run:' in the config or pass --run)")
    stages = spec.get("stages") or {}
    if not isinstance(stages, dict):
        raise ConfigError("pipeline: 'stages' must be a mapping of stage name -> config")
    known = available()
    uses = instances(stages)
    if not uses:
        raise ConfigError("pipeline: no stages")
    needs = derive_needs(known)
    rank_of = {n: i for i, n in enumerate(known)}
    names = sorted(uses, key=lambda n: rank_of[uses[n]])   # stage order; instances of a stage as written
    cfgs = {n: {k: v for k, v in copy.deepcopy(stages[n] or {}).items() if k != "uses"} for n in names}
    outputs = {}
    for name in names:
        cfgs[name].setdefault("output", storage.join(run, name))
        outputs[name] = cfgs[name]["output"]
    of_stage: dict[str, list[str]] = {}
    for name in names:
        of_stage.setdefault(uses[name], []).append(name)
    # a published dataset named at the top stands in for the stages that start a pipeline (they read
    # no other stage's output: import, synth) when none of them is in it
    roots = [n for n, st in known.items() if not any(i.stages for i in st.inputs)]
    dataset = {r: spec["dataset"] for r in roots} if spec.get("dataset") and not any(r in of_stage for r in roots) \
        else {}
    reads: dict[str, set[str]] = {n: set() for n in names}
    for name in names:
        cfg, st = cfgs[name], uses[name]
        for inp in get_stage(st).inputs:
            if inp.field in cfg:   # set by the user: names of sections stand for their outputs
                if inp.stages:
                    cfg[inp.field], named = _by_name(cfg[inp.field], outputs, uses, name, inp)
                    reads[name] |= named
                continue
            if inp.wire == "none" or not inp.stages:
                continue
            mine = [p for p in inp.stages if p in needs[st] and (p in of_stage or p in dataset)]
            if inp.wire == "first":
                for a, b in alternatives(st, inp, needs):
                    if a in mine and b in mine and (a in of_stage or b in of_stage):
                        raise ConfigError(f"pipeline: {name}.{inp.field} could read the output of {a} or "
                                          f"of {b}: keep one of them, or set stages.{name}.{inp.field}")
                mine = mine[:1]
                if mine and len(of_stage.get(mine[0], [])) > 1:
                    them = of_stage[mine[0]]
                    raise ConfigError(f"pipeline: {name}.{inp.field} could read the output of "
                                      f"{' or of '.join(them)}: name one (stages.{name}.{inp.field}: {them[0]})")
            got = [(m, outputs[m]) for p in mine for m in of_stage.get(p, [])] or \
                [(None, dataset[p]) for p in mine if p in dataset]
            if got:
                values = [v for _, v in got]
                cfg[inp.field] = values if inp.wire == "all" else [values[0]] if inp.many else values[0]
                reads[name] |= {m for m, _ in got if m}
            elif inp.required:
                alt = ", or give a top-level 'dataset: URI'" if any(p in roots for p in inp.stages) else ""
                raise ConfigError(f"pipeline: stage {name} needs the output of {' or '.join(inp.stages)} "
                                  f"({name}.{inp.field}): add {'that stage' if len(inp.stages) == 1 else 'one of them'}"
                                  f" to 'stages' or set stages.{name}.{inp.field}{alt}")
    pos = {n: i for i, n in enumerate(names)}
    # dependency order; among instances free to run, the stages' order, then as written
    order = derive_order(reads, key=pos.get)
    return [Step(n, uses[n], cfgs[n]) for n in order]


def alternatives(stage: str, inp: Any, needs: dict[str, list[str]]) -> list[tuple[str, str]]:
    """The pairs of producers of input ``inp`` of ``stage`` (a ``wire="first"`` input) that a plan refuses to
    run together when it would have to choose: neither reads the other's output (import and synth), in the
    order the input declares them (the first one is preferred)."""
    from itertools import combinations

    ps = [p for p in inp.stages if p in needs[stage]]
    return [(a, b) for a, b in combinations(ps, 2) if a not in upstream(b, needs) and b not in upstream(a, needs)]


def _by_name(value: Any, outputs: dict[str, str], uses: dict[str, str], me: str, inp: Any) -> tuple[Any, set[str]]:
    """An input value set by the user with each string that names a section of the pipeline (``rank``)
    or a path below one (``embed/rankings_dense.parquet``) replaced by that section's output (and the
    path below it); and the names so replaced. A named section must run one of the input's producers."""
    named: set[str] = set()

    def one(v: Any) -> Any:
        if not isinstance(v, str):
            return v
        head, _, rest = v.partition("/")
        if head not in outputs:
            return v
        if head == me:
            raise ConfigError(f"pipeline: stages.{me}.{inp.field} reads its own output ({v})")
        if uses[head] not in inp.stages:
            raise ConfigError(f"pipeline: stages.{me}.{inp.field}: {head} runs {uses[head]}, which this input does "
                              f"not read (it reads the output of {' or '.join(inp.stages)}; write ./{v} for a "
                              f"local path)")
        named.add(head)
        return storage.join(outputs[head], rest) if rest else outputs[head]

    return ([one(v) for v in value] if isinstance(value, list) else one(value)), named


def brief(steps: list[Step]) -> list[str]:
    """The plan in lines: each instance, the stage it runs, its output and the inputs it reads from
    other instances of the plan (by name)."""
    by_output = {s.config["output"]: s.name for s in steps}

    def src(v: Any) -> str:
        for out, name in by_output.items():
            if isinstance(v, str) and (v == out or v.startswith(out + "/")):
                return name + v[len(out):]
        return str(v)

    w = max(len(s.name) for s in steps)
    lines = []
    for s in steps:
        reads = []
        for inp in get_stage(s.stage).inputs:
            v = s.config.get(inp.field)
            if inp.stages and v:
                reads.append(f"{inp.field}=" + (",".join(src(x) for x in v) if isinstance(v, list) else src(v)))
        lines.append(f"{s.name:<{w}}  {s.stage:<10} -> {s.config['output']}" + (f"   reads {' '.join(reads)}" if reads else ""))
    return lines


def wire(spec: dict, run: str | None = None) -> list[tuple[str, dict]]:
    """:func:`plan` as (section name, config dict) pairs."""
    return [(s.name, s.config) for s in plan(spec, run)]


def select(plan: list, start: str | None = None, until: str | None = None) -> list:
    """The contiguous part of ``plan`` (steps or (name, config) pairs) from ``start`` through ``until``
    (section names; either may be None: the ends)."""
    names = [p[0] for p in plan]
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
                 after: Callable[[str, dict], None] | None = None,
                 echo: Callable[[str], None] = print, steal_lease: bool = False) -> dict:
    """Run the stages in order (those from ``start`` through ``until``); returns {stage: manifest}.
    ``before(name, cfg)`` may edit a config just before its stage runs (the demo fills in the URL of a
    server that was still starting); ``after(name, manifest)`` sees each stage's manifest as soon as it is
    done, before the next one starts (the demo prints a stage's table there).

    One pipeline per run prefix: the run lease ``<run>/_run/_LEASE`` (the same one the Kubernetes
    driver takes) refuses a second pipeline or driver of the run while this one lives."""
    from .store import lease

    steps = plan(spec, run)
    todo = select(steps, start, until)
    for step in todo:  # validate everything before running anything
        validate_config(step.stage, step.config, source=f"pipeline stage '{step.name}'")
    root = (run or spec.get("run")).rstrip("/")
    storage.ensure_bucket(root)
    with lease.hold(storage.join(root, "_run"), purpose="pipeline", steal=steal_lease):
        write_plan(root, [(s.name, s.config["output"], s.stage) for s in steps])
        return _run_plan(spec, todo, root=root, force=force, replace=replace, before=before, after=after,
                         echo=echo, steal_lease=steal_lease)


def write_plan(root: str, stages: list[tuple[str, str, str]]) -> None:
    """``<run>/_run/plan.json``: every stage instance of a run (name, output, the stage it runs),
    written when the run starts by the local pipeline and by the Kubernetes driver alike; what
    ``memsifter status`` lists as "not started" until each shows up in the store."""
    from .store import lease

    storage.write_atomic(storage.join(root, "_run", "plan.json"), json.dumps(
        {"run": root, "run_id": lease.run_id(), "started_at": storage.utcnow(),
         "stages": [{"stage": n, "uses": st, "output": out} for n, out, st in stages]}, indent=2).encode())


def _run_plan(spec: dict, steps: list[Step], *, root, force, replace, before, after, echo,  # noqa: ANN001
              steal_lease) -> dict:
    from .models.raypool import session

    ray_cfg = spec.get("ray") or {}
    results: dict[str, dict] = {}
    summary = {"run": root, "stages": {}}
    with contextlib.suppress(Exception):   # a part of the order (--from/--until) adds to the run's summary
        old = json.loads(storage.read_bytes(storage.join(root, "pipeline.json")))
        if old.get("run") == root and isinstance(old.get("stages"), dict):
            summary["stages"].update(old["stages"])
    with session(ray_cfg.get("address"), ray_cfg.get("num_cpus")):
        for name, stage, cfg in steps:
            if before:
                before(name, cfg)
            config = validate_config(stage, cfg, source=f"pipeline stage '{name}'")
            if name not in replace:
                _refuse_other_config(name, stage, config)
            t0 = time.time()
            manifest = get_stage(stage).run(config, force=name in force, replace=name in replace,
                                            steal_lease=steal_lease)
            secs = time.time() - t0
            state = "skipped (already published)" if manifest.get("skipped") else f"done in {secs:.1f}s"
            echo(f"[pipeline] {name:<12} {state}: {config.output}")
            results[name] = manifest
            summary["stages"][name] = {"output": config.output, "skipped": bool(manifest.get("skipped")),
                                       "seconds": round(secs, 2), "config_hash": manifest.get("config_hash")}
            if after:
                after(name, manifest)
    storage.write_bytes(storage.join(summary["run"], "pipeline.json"),
                        json.dumps(summary, indent=2, sort_keys=True).encode())
    return results


def _refuse_other_config(name: str, stage: str, config: Any) -> None:
    """The stage's output holds its output for another config: refused here with the pipeline's own
    hint (``--replace STAGE``: the pipeline's ``--replace`` takes stage names); the stage's own check
    (:meth:`memsifter.stage.Stage.run`) stays the guard."""
    try:
        existing = storage.try_manifest(config.output)
    except storage.BadManifestError:
        return   # the stage says what is wrong with it
    if existing and existing.get("stage") == stage and existing.get("config_hash") != config_hash(config):
        raise ConfigError(f"{config.output}: holds stage {stage}'s output for another config (hash "
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


def check_stage_names(plan: list, **given: list[str]) -> None:
    """``--force``/``--replace`` name sections of the part of the pipeline that runs: anything else is
    one line (with the nearest name) instead of a flag that silently does nothing."""
    names = [p[0] for p in plan]
    for opt, values in given.items():
        for v in values:
            if v not in names:
                raise ConfigError(f"--{opt} {v}: not a stage of this pipeline{suggest(v, names)} (it runs: "
                                  f"{', '.join(names)})")


REPORT = "report.md"


def main(argv: list[str] | None = None) -> int:
    from .console import SuggestingParser, plain, setup_logging
    p = SuggestingParser(prog="memsifter pipeline", description=plain(__doc__))
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("schema", help="print the pipeline config's JSON schema (every key, every stage's section)")
    for cmd, help_ in (("run", "run the stages in order"), ("show", "print the wired stage configs")):
        sp = sub.add_parser(cmd, help=help_)
        sp.add_argument("--config", required=True, help="pipeline YAML/JSON (local path or s3://)")
        sp.add_argument("--run", help="run prefix (overrides 'run:' in the config)")
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any field, e.g. stages.rank.model=... or run=s3://b/p")
        sp.add_argument("--from", dest="start", metavar="STAGE",
                        help="start at this stage or instance (earlier stages' outputs in the run are its inputs)")
        sp.add_argument("--until", metavar="STAGE", help="stop after this stage or instance")
        if cmd == "show":
            sp.add_argument("--brief", action="store_true",
                            help="one line per stage instance: the stage it runs, its output, what it reads")
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
    if args.cmd == "show" and args.brief:
        for line in brief(select(plan(spec, args.run), args.start, args.until)):
            print(line)
        return 0
    if args.cmd == "show":
        for step in select(plan(spec, args.run), args.start, args.until):
            head = step.name if step.name == step.stage else f"{step.name} (uses: {step.stage})"
            config = validate_config(step.stage, step.config, source=f"pipeline stage '{step.name}'")
            print(f"# {head}\n{json.dumps(config.model_dump(mode='json'), indent=2)}")
        return 0
    setup_logging(-1 if args.quiet else args.verbose)
    check_stage_names(select(plan(spec, args.run), args.start, args.until), force=args.force,
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
