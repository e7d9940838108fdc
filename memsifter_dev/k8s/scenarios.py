"""Example values: the ``ci/`` scenarios of the chart and the values ``jobs/`` are rendered with.

Scenarios (inference-only, training-only, full, minimal-cpu; serve: the memory service over the stages
that publish its index) are derived from the stages' families, GPU counts and needs only, less the
alternatives the pipeline refuses to run together (import and synth);
each enabled stage gets placeholders for the config fields a user must set (and those its own
cross-field validation asks for), and inputs produced by disabled stages point at an earlier run. Like
``values.yaml``, configs hold only what differs from the stages' defaults.
"""

from __future__ import annotations

import copy
from typing import Any

from memsifter.k8s.registry import StageInfo, preferred
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


def _uris(wiring: dict, prefix: str) -> Any:
    uris = [f"{prefix}/{p}" for p in preferred(wiring)]
    return uris if wiring["list"] else uris[0]


def _wired_example(info: StageInfo, bucket: str) -> dict:
    return {f: _uris(w, f"s3://{bucket}/x") for f, w in info.wiring.items()}


def without_refused(infos: list[StageInfo], enabled: set[str], prefer_ready: bool = False) -> set[str]:
    """``enabled`` less the alternatives ``memsifter pipeline`` refuses to run together (two producers of
    one input, such as import and synth): of each such group the stage preferred by the input's
    declaration stays, or with ``prefer_ready`` the first one that needs no user-set field (a smoke test
    runs without files of its own)."""
    by = {i.name: i for i in infos}
    out = set(enabled)
    changed = True
    while changed:
        changed = False
        for i in infos:
            if i.name not in out:
                continue
            for w in i.wiring.values():
                on = [p for p in w["from"] if p in out]
                if len(on) > 1 and isinstance(w["cases"][",".join(on)], str):
                    keep = min(on, key=lambda p: (prefer_ready and bool(by[p].required_user_fields), on.index(p)))
                    out -= set(on) - {keep}
                    changed = True
    return out


def _downstream(infos: list[StageInfo], seeds: set[str]) -> set[str]:
    out = set(seeds)
    changed = True
    while changed:
        changed = False
        for i in infos:
            if i.name not in out and any(n in out for n in i.needs):
                out.add(i.name)
                changed = True
    return out


def scenario_sets(infos: list[StageInfo]) -> dict[str, set[str]]:
    """Stage sets of the ci/ scenarios, from families, GPU counts and needs only.

    training = the train-family stages, what depends on them, and the stages only they need;
    inference = the rest; minimal-cpu = the stages without GPUs. None holds alternatives that
    ``memsifter pipeline`` refuses to run together (:func:`without_refused`).
    """
    by = {i.name: i for i in infos}
    train = _downstream(infos, {i.name for i in infos if i.family == "train"})
    # helpers only needed by training stages (e.g. RL data preparation)
    changed = True
    while changed:
        changed = False
        for i in infos:
            users = [u for u in infos if i.name in u.needs]
            if i.name not in train and users and all(u.name in train for u in users) and i.needs:
                train.add(i.name)
                changed = True
    allnames = {i.name for i in infos}
    inference = allnames - train
    return {
        "inference-only": without_refused(infos, inference),
        "training-only": without_refused(infos, train),
        "full": without_refused(infos, allnames),
        "minimal-cpu": without_refused(infos, {n for n in allnames if by[n].gpus == 0 and not by[n].capacity},
                                       prefer_ready=True),
        "serve": without_refused(infos, _producers_of(infos, INDEX_STAGE), prefer_ready=True),
    }


def _producers_of(infos: list[StageInfo], name: str) -> set[str]:
    """``name`` and, transitively, every stage its inputs may read from."""
    by = {i.name: i for i in infos}
    out, todo = set(), [name] if name in by else []
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += [p for w in by[n].wiring.values() for p in w["from"]]
    return out


_SCENARIO_DOC = {
    "inference-only": "the inference stages (no training family), driven in dependency order",
    "training-only": "the training stages; inputs produced by disabled stages come from a previous run",
    "full": "every stage (of alternative producers of one input, the preferred one: the pipeline refuses both)",
    "minimal-cpu": "only stages without GPUs, small CPU pods, no GPU pool: a smoke test on any cluster",
    "serve": "the memory service (RayService, ranker on GPUs) over the index its embed stage publishes",
}


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
    out["stages"] = {}
    for info in infos:
        if info.name not in enabled:
            continue
        block: dict[str, Any] = {"enabled": True}
        cfg: dict[str, Any] = {}
        for f in info.required_user_fields:
            cfg[f] = _placeholder(info, f, bucket)
        for f, w in info.wiring.items():
            if not any(p in enabled for p in w["from"]):  # produced by an earlier run
                cfg[f] = _uris(w, f"s3://{bucket}/runs/previous-run")
        cfg = example_config(info, cfg, _wired_example(info, bucket), bucket)
        if cfg:
            block["config"] = cfg
        out["stages"][info.name] = block
    if name == "serve":
        out["serve"] = scenario_serve(bucket)
    return out


def jobs_values(infos: list[StageInfo]) -> dict:
    """Documented example values used to render jobs/: placeholders for what each stage needs."""
    bucket = "my-bucket"
    stages: dict[str, Any] = {}
    for info in infos:
        cfg = {f: _placeholder(info, f, bucket) for f in info.required_user_fields}
        cfg = example_config(info, cfg, _wired_example(info, bucket), bucket)
        stages[info.name] = {"config": cfg} if cfg else {}
    return {"run": {"id": "example"}, "s3": {"bucket": bucket, "endpoint": "", "region": "us-east-1"},
            "driver": {"enabled": False}, "stages": stages, "serve": jobs_serve()}
