"""What the Kubernetes layer knows about each stage, read from the stage registry only.

Nothing here names a stage: the chart, ``jobs/``, the scenarios and the driver iterate over
:func:`memsifter.stage.available_stages` and look at each stage's config class (pydantic), its
``family`` (image), ``gpus`` and ``needs``.

Input wiring follows the one rule of ``memsifter pipeline`` (:func:`memsifter.pipeline.wire`): an unset
input field takes the output of the first of its producers that runs (every producer that runs for
``wire="all"``; nothing for ``wire="none"``), a stage that does not run is referenced by nobody, and two
alternative producers of one input that both run, or a required input that no stage produces, are
refused. Helm cannot call Python, so the chart does not decide: for each input field the chart may fill,
:func:`wire_cases` asks :func:`memsifter.pipeline.wire` itself what it does for every set of the field's
producers that can be enabled, and ``files/stages.json`` carries that table (``wiring``; ``inputs``
names the producers each field reads when all of them run); the templates only look up which producers
are enabled. Required fields that no stage produces stay for the user to set (the values schema then
requires them when the stage is enabled).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from .. import stage as stg
from ..store import storage

# Config fields from which the capacity of a multi-node GPU stage is read (verl's names).
NODES_FIELD = "nnodes"
GPUS_PER_NODE_FIELD = "n_gpus_per_node"


@dataclass
class FieldInfo:
    name: str
    required: bool
    default: Any            # JSON-able default (None when required)
    uri: bool
    runtime: bool
    description: str
    annotation: Any = None


@dataclass
class StageInfo:
    name: str
    family: str
    help: str
    gpus: int
    needs: list[str]
    config: type[BaseModel]
    fields: dict[str, FieldInfo]
    inputs: dict[str, Any] = field(default_factory=dict)      # uri field -> its producer(s) when all run
    wiring: dict[str, dict] = field(default_factory=dict)     # uri field -> its wiring table (:func:`wire_cases`)
    unwired: list[str] = field(default_factory=list)           # required uri fields left to the user
    capacity: dict[str, str] = field(default_factory=dict)     # {"nodes": path, "gpusPerNode": path}
    capacity_defaults: dict[str, int] = field(default_factory=dict)

    @property
    def required_user_fields(self) -> list[str]:
        """Required config fields that neither the chart (output) nor the wiring fill."""
        return [f.name for f in self.fields.values()
                if f.required and f.name != "output" and f.name not in self.inputs]

    def defaults(self) -> dict[str, Any]:
        """Config defaults for values.yaml: every field with a default, except output and wired inputs."""
        return {f.name: f.default for f in self.fields.values()
                if not f.required and f.name != "output" and f.name not in self.inputs}


def _extra(f: Any) -> dict:
    return f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}


def _field_infos(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    out = {}
    for name, f in cls.model_fields.items():
        required = f.is_required()
        default = None
        if not required:
            raw = f.get_default(call_default_factory=True)
            default = None if raw is PydanticUndefined else to_jsonable_python(raw)
        ex = _extra(f)
        out[name] = FieldInfo(name, required, default, bool(ex.get("uri")), bool(ex.get("runtime")),
                              f.description or "", f.annotation)
    return out


WIRE_ROOT = "s3://wiring/run"   # the run prefix of the specs :func:`wire_cases` hands to the pipeline


def _stand_in(inp: stg.Input) -> Any:
    """A value that keeps :func:`memsifter.pipeline.wire` from wiring (or refusing) the field ``inp``."""
    uri = f"s3://wiring/user/{inp.field}"
    return [uri] if inp.many else uri


def wire_cases(st: stg.Stage, needs: list[str]) -> tuple[dict[str, dict], list[str]]:
    """The chart's wiring of a stage, as :func:`memsifter.pipeline.wire` decides it, and the required input
    fields that no stage fills (the user sets them).

    For each input field the chart may fill (producers among ``needs``, ``wire`` not ``"none"``):
    ``{"from": [producers, in order of preference], "list": bool, "cases": {key: value}}``. A key names
    the producers that run, comma-joined in ``from`` order (``""``: none). Its value is what
    :func:`memsifter.pipeline.wire` does with a pipeline of this stage and exactly those producers: the
    producers whose outputs fill the field (empty: left unset), or, where it refuses, the one-line message
    the chart fails with. The field's other stages and the producers' own inputs are set in that
    pipeline, so nothing but this field is decided there."""
    from itertools import combinations

    from .. import pipeline
    from ..errors import ConfigError

    wired: dict[str, dict] = {}
    unwired = []
    for inp in st.inputs:
        cands = [p for p in inp.stages if p in needs]
        if inp.wire == "none" or not cands:
            if inp.required:
                unwired.append(inp.field)
            continue
        mine = {i.field: _stand_in(i) for i in st.inputs if i.stages and i.field != inp.field}
        cases: dict[str, Any] = {}
        for k in range(len(cands) + 1):
            for on in combinations(cands, k):
                stages = {st.name: dict(mine)}
                stages.update({p: {i.field: _stand_in(i) for i in stg.get_stage(p).inputs if i.stages} for p in on})
                key = ",".join(on)
                try:
                    cfg = dict(pipeline.wire({"run": WIRE_ROOT, "stages": stages}))[st.name]
                except ConfigError:
                    field = f"stages.{st.name}.config.{inp.field}"
                    cases[key] = (f"{field} could read the output of {' or of '.join(on)}: enable only one of "
                                  f"them, or set {field}" if on else
                                  f"stages.{st.name} needs the output of {' or '.join(cands)} "
                                  f"(config.{inp.field}): enable {'that stage' if len(cands) == 1 else 'one of them'}"
                                  f", or set {field}")
                    continue
                value = cfg.get(inp.field)
                uris = [] if value is None else value if isinstance(value, list) else [value]
                by_output = {storage.join(WIRE_ROOT, p): p for p in on}
                cases[key] = [by_output[u] for u in uris]
        wired[inp.field] = {"from": cands, "list": inp.many, "cases": cases}
    return wired, unwired


def preferred(wiring: dict) -> list[str]:
    """The producers an input field reads in a run where all of them could run: those a run of all of
    them wires (every one for ``wire="all"``), or the first one where such a run is refused (alternatives
    such as import and synth). ``wiring``: the field's entry of :attr:`StageInfo.wiring`."""
    every = wiring["cases"][",".join(wiring["from"])]
    return every if isinstance(every, list) and every else wiring["from"][:1]


def _find_path(cls: type[BaseModel], target: str, prefix: str = "") -> str | None:
    for name, f in cls.model_fields.items():
        if name == target:
            return prefix + name
        tp = f.annotation
        for cand in (tp, *typing.get_args(tp)):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                hit = _find_path(cand, target, f"{prefix}{name}.")
                if hit:
                    return hit
    return None


def _default_at(cls: type[BaseModel], path: str) -> Any:
    cur: Any = cls
    parts = path.split(".")
    for i, p in enumerate(parts):
        f = cur.model_fields[p]
        if i == len(parts) - 1:
            return None if f.is_required() else f.get_default(call_default_factory=True)
        cur = f.annotation
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            cur = next(a for a in typing.get_args(cur) if isinstance(a, type) and issubclass(a, BaseModel))
    return None


def stage_infos(names: list[str] | None = None) -> list[StageInfo]:
    """Every available stage (or those named), in pipeline order."""
    known = stg.available()
    needs_of = stg.derive_needs({**known, **{n: stg.get_stage(n) for n in names or []}})
    names = list(names) if names is not None else list(known)
    out = []
    for name in names:
        st = stg.get_stage(name)
        fields = _field_infos(st.config)
        wiring, unwired = wire_cases(st, needs_of[name])
        inputs = {f: preferred(w) if w["list"] else preferred(w)[0] for f, w in wiring.items()}
        info = StageInfo(st.name, st.family, st.help, int(st.gpus or 0), list(needs_of[name]), st.config, fields,
                         inputs=inputs, wiring=wiring, unwired=unwired)
        nodes, gpn = _find_path(st.config, NODES_FIELD), _find_path(st.config, GPUS_PER_NODE_FIELD)
        if nodes and gpn:
            info.capacity = {"nodes": nodes, "gpusPerNode": gpn}
            info.capacity_defaults = {"nodes": int(_default_at(st.config, nodes) or 1),
                                      "gpusPerNode": int(_default_at(st.config, gpn) or max(st.gpus, 1))}
        out.append(info)
    return out
