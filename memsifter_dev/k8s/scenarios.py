"""Example values: the ``ci/`` scenarios of the chart and the values ``jobs/`` are rendered with.

Scenarios (inference-only, training-only, full, minimal-cpu; serve: the memory service over the stages
that publish its index) are derived from the stages' families, GPU counts and needs only (reachability:
:func:`memsifter.stage.upstream`), less the alternatives a plan refuses to run together
(:func:`memsifter.pipeline.alternatives`: import and synth). Each scenario is a pipeline config: every
section gets placeholders for the config fields a user must set (and those its own cross-field validation
asks for), inputs produced by stages outside the scenario point at an earlier run; its values hold the plan
``memsifter k8s plan`` makes of it (:func:`memsifter.k8s.plan.chart_plan`). Like a user's pipeline config,
sections hold only what differs from the stages' defaults.
"""

from __future__ import annotations

import copy
from typing import Any

from memsifter import pipeline
from memsifter import stage as stg
from memsifter.k8s.plan import chart_plan
from memsifter.k8s.registry import StageInfo
from .serve import INDEX_STAGE, jobs_serve, scenario_serve
from .values import resources


def _placeholder(info: StageInfo, field: str, bucket: str) -> Any:
    f = info.fields[field]
    if f.uri:
        return f"s3://{bucket}/inputs/{info.name}/{field}"
    sch = info.config.model_json_schema(mode="validation")["properties"][field]
    if "enum" in sch:
        return sch["enum"][0]
    if "const" in sch:
        return sch["const"]
    t = sch.get("type")
    if t == "integer":
        return int(sch.get("minimum", 1))
    if t == "number":
        return float(sch.get("minimum", 1.0))
    if t == "boolean":
        return False
    if t in ("array", "object"):
        return _example_of_type(f.annotation)
    return f"CHANGE-ME-{field}"


def _example_of_type(tp: Any) -> Any:
    import types
    import typing

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _example_of_type(args[0]) if args else None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return args[0]
    if origin in (list, tuple, set):
        return [_example_of_type(args[0] if args else str)]
    if origin is dict:
        return {"example": _example_of_type(args[1] if len(args) > 1 else str)}
    return {int: 1, float: 1.0, bool: True, str: "example"}.get(tp, "example")


def _example_value(info: StageInfo, field: str, bucket: str) -> Any:
    """A plausible value for a config field, from its type (for generated example values only)."""
    if info.fields[field].uri:
        return _placeholder(info, field, bucket)
    return _example_of_type(info.fields[field].annotation)


def example_config(info: StageInfo, cfg: dict, wired: dict, bucket: str) -> dict:
    """``cfg`` plus values for the fields that the stage's own cross-field validation asks for.

    Validates ``values defaults + cfg + wired inputs + output`` with the stage's config class; when it
    fails on fields named in the error (its location, or names in backticks/quotes in the message) that
    are still empty, they get an example value from their type, and it tries again.
    """
    import re

    from pydantic import ValidationError

    cfg = dict(cfg)
    for _ in range(len(info.fields)):
        data = {**info.defaults(), **wired, **cfg, "output": f"s3://{bucket}/example/{info.name}"}
        try:
            info.config.model_validate(data)
            return cfg
        except ValidationError as e:
            named: list[str] = []
            for err in e.errors():
                named += [str(p) for p in err["loc"][:1]]
                named += re.findall(r"[`'\"]([A-Za-z_][A-Za-z0-9_]*)[`'\"]", err["msg"])
            todo = [n for n in dict.fromkeys(named) if n in info.fields and n != "output" and not data.get(n)]
            if not todo:
                return cfg
            for n in todo:
                cfg[n] = _example_value(info, n, bucket)
    return cfg


def preferred(info: StageInfo, inp: stg.Input) -> list[str]:
    """The producers a wired input of ``info`` reads in a run where all of them run: every one for
    ``wire="all"``, else the first (of alternatives such as import and synth, the one the input prefers)."""
    ps = [p for p in inp.stages if p in info.needs]
    return ps if inp.wire == "all" else ps[:1]


def wired(info: StageInfo) -> list[stg.Input]:
    """The inputs of ``info`` that a plan fills from another stage's output."""
    return [i for i in stg.get_stage(info.name).inputs if i.field in info.wired]


def _uris(info: StageInfo, inp: stg.Input, prefix: str) -> Any:
    uris = [f"{prefix}/{p}" for p in preferred(info, inp)]
    return uris if inp.many else uris[0]


def _wired_example(info: StageInfo, bucket: str) -> dict:
    return {i.field: _uris(info, i, f"s3://{bucket}/x") for i in wired(info)}


def needs_of(infos: list[StageInfo]) -> dict[str, list[str]]:
    return {i.name: i.needs for i in infos}


def without_refused(infos: list[StageInfo], enabled: set[str], prefer_ready: bool = False) -> set[str]:
    """``enabled`` less the alternatives a plan refuses to run together (:func:`memsifter.pipeline.alternatives`:
    two producers of one input, such as import and synth): of each such pair the one the input prefers stays,
    or with ``prefer_ready`` the first one that needs no user-set field (a smoke test runs without files of its
    own)."""
    by, needs = {i.name: i for i in infos}, needs_of(infos)
    out = set(enabled)
    for i in infos:
        for inp in (wired(i) if i.name in out else []):
            for a, b in (pipeline.alternatives(i.name, inp, needs) if inp.wire == "first" else []):
                if a in out and b in out:
                    out.discard(max((a, b), key=lambda p: (prefer_ready and bool(by[p].required_user_fields),
                                                           (a, b).index(p))))
    return out


def scenario_sets(infos: list[StageInfo]) -> dict[str, set[str]]:
    """Stage sets of the ci/ scenarios, from families, GPU counts and needs only.

    training = the train-family stages, what reads their outputs, and the stages only they read from;
    inference = the rest; minimal-cpu = the stages without GPUs. None holds alternatives that
    ``memsifter pipeline`` refuses to run together (:func:`without_refused`).
    """
    by, needs = {i.name: i for i in infos}, needs_of(infos)
    seeds = {i.name for i in infos if i.family == "train"}
    train = {n for n in by if n in seeds or seeds & stg.upstream(n, needs)}
    readers = {n: {u for u in by if n in stg.upstream(u, needs)} for n in by}
    # helpers only read by training stages (e.g. RL data preparation)
    train |= {n for n in by if by[n].needs and readers[n] and readers[n] <= train}
    allnames = set(by)
    inference = allnames - train
    index = {INDEX_STAGE, *stg.upstream(INDEX_STAGE, needs)} if INDEX_STAGE in by else set()
    return {
        "inference-only": without_refused(infos, inference),
        "training-only": without_refused(infos, train),
        "full": without_refused(infos, allnames),
        "minimal-cpu": without_refused(infos, {n for n in allnames if by[n].gpus == 0 and not by[n].capacity},
                                       prefer_ready=True),
        "serve": without_refused(infos, index, prefer_ready=True),
    }


_SCENARIO_DOC = {
    "inference-only": "the inference stages (no training family), driven in dependency order",
    "training-only": "the training stages; inputs produced by disabled stages come from a previous run",
    "full": "every stage (of alternative producers of one input, the preferred one: the pipeline refuses both)",
    "minimal-cpu": "only stages without GPUs, small CPU pods, no GPU pool: a smoke test on any cluster",
    "serve": "the memory service (RayService, ranker on GPUs) over the index its embed stage publishes",
}


def section(info: StageInfo, enabled: set[str], bucket: str, previous: str | None) -> dict:
    """A pipeline config's section of ``info``: placeholders for what a user must set, the inputs whose
    producers are not in ``enabled`` from the run ``previous`` (if given), and what its cross-field validation
    asks for."""
    cfg: dict[str, Any] = {f: _placeholder(info, f, bucket) for f in info.required_user_fields}
    for inp in wired(info) if previous else []:
        if not any(p in enabled for p in inp.stages):  # produced by an earlier run
            cfg[inp.field] = _uris(info, inp, previous)
    return example_config(info, cfg, _wired_example(info, bucket), bucket)


def scenario_spec(infos: list[StageInfo], name: str, enabled: set[str], bucket: str = "memsifter-ci") -> dict:
    """The pipeline config of scenario ``name``."""
    return {"run": f"s3://{bucket}/runs/ci-{name}",
            "stages": {i.name: section(i, enabled, bucket, f"s3://{bucket}/runs/previous-run")
                       for i in infos if i.name in enabled}}


def scenario_values(infos: list[StageInfo], name: str, enabled: set[str]) -> dict:
    bucket = "memsifter-ci"
    out: dict[str, Any] = {"run": {"id": f"ci-{name}"},
                           "s3": {"bucket": bucket, "endpoint": "http://seaweedfs.memsifter.svc:8333"}}
    if name == "minimal-cpu":  # small pods for every family in use, no GPU pool, short deadlines
        small = {"head": {"resources": resources("1", "2Gi"), "shmSize": "512Mi"},
                 "workers": {"resources": resources("1", "2Gi")}}
        out["profiles"] = {f: copy.deepcopy(small) for f in sorted({i.family for i in infos if i.name in enabled})}
        out["common"] = {"activeDeadlineSeconds": 3600}
        out["gpuPool"] = {"nodeSelector": {}, "tolerations": []}
        out["cacheVolume"] = {"sizeLimit": "5Gi"}
        out["scratchVolume"] = {"sizeLimit": "5Gi"}
    if name == "training-only":
        out["driver"] = {"pollSeconds": 30}
    if name == "serve":
        out["serve"] = scenario_serve(bucket)
    out["pipeline"] = chart_plan(scenario_spec(infos, name, enabled, bucket))
    return out


def jobs_values(infos: list[StageInfo]) -> dict:
    """Documented example values used to render jobs/ (each job adds the plan of its stage's pipeline)."""
    return {"run": {"id": "example"}, "s3": {"bucket": JOBS_BUCKET, "endpoint": "", "region": "us-east-1"},
            "driver": {"enabled": False}, "serve": jobs_serve()}


JOBS_BUCKET = "my-bucket"


def job_spec(infos: list[StageInfo], name: str, chain: list[str]) -> dict:
    """The pipeline config of ``jobs/<name>.yaml``: the stages of ``chain`` (``name`` and those it reads from),
    each with placeholders for what a user sets, under jobs/values.yaml's run root; inputs no section of the
    chain produces are left out (optional: the job lists them as comments)."""
    by = {i.name: i for i in infos}
    return {"run": f"s3://{JOBS_BUCKET}/runs/example",
            "stages": {n: section(by[n], set(chain), JOBS_BUCKET, None) for n in chain}}
