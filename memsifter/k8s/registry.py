"""What the Kubernetes layer knows about each stage, read from the stage registry only.

Nothing here names a stage: the chart, ``jobs/``, the scenarios and the driver iterate over
:func:`memsifter.stage.available_stages` and look at each stage's config class (pydantic), its
``family`` (image), ``gpus`` and ``needs``.

Nothing here wires an input: a run's wiring is :func:`memsifter.pipeline.plan`'s alone, and the chart
deploys that plan as it is (``memsifter k8s plan``). The fields read here are a stage's own: its config
fields, and which of them are inputs that a plan fills from another stage's output (:attr:`StageInfo.wired`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from .. import stage as stg

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
    wired: list[str] = field(default_factory=list)            # input fields a plan fills from another stage
    capacity: dict[str, str] = field(default_factory=dict)     # {"nodes": path, "gpusPerNode": path}
    capacity_defaults: dict[str, int] = field(default_factory=dict)

    @property
    def required_user_fields(self) -> list[str]:
        """Required config fields that a plan does not fill (output, inputs read from another stage)."""
        return [f.name for f in self.fields.values()
                if f.required and f.name != "output" and f.name not in self.wired]

    def defaults(self) -> dict[str, Any]:
        """Config defaults: every field with a default, except output and the inputs a plan fills."""
        return {f.name: f.default for f in self.fields.values()
                if not f.required and f.name != "output" and f.name not in self.wired}


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
        wired = [i.field for i in st.inputs if i.wire != "none" and any(p in needs_of[name] for p in i.stages)]
        info = StageInfo(st.name, st.family, st.help, int(st.gpus or 0), list(needs_of[name]), st.config, fields,
                         wired=wired)
        nodes, gpn = _find_path(st.config, NODES_FIELD), _find_path(st.config, GPUS_PER_NODE_FIELD)
        if nodes and gpn:
            info.capacity = {"nodes": nodes, "gpusPerNode": gpn}
            info.capacity_defaults = {"nodes": int(_default_at(st.config, nodes) or 1),
                                      "gpusPerNode": int(_default_at(st.config, gpn) or max(st.gpus, 1))}
        out.append(info)
    return out
