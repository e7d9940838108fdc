"""What the Kubernetes layer knows about each stage, read from the stage registry only.

Nothing here names a stage: the chart, ``jobs/``, the scenarios and the driver iterate over
:func:`memsifter.stage.available_stages` and look at each stage's config class (pydantic), its
``family`` (image), ``gpus`` and ``needs``.

Input wiring: an input field declares the stages that produce it (``uri_field(..., stage=...)``,
:func:`memsifter.stage.config_inputs`), and that declaration is all the chart reads. Unless the user
sets it, the chart fills such a field with ``<run root>/<producer>``: the first producer it declares
(a one-element list for a list field), every producer for ``wire="all"`` (a list), none for
``wire="none"``; a producer that can only be an earlier run's output (it runs after this stage) is
skipped (:func:`memsifter.stage.derive_needs`). Required fields that no stage produces stay for the
user to set (the values schema then requires them when the stage is enabled).
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
    inputs: dict[str, Any] = field(default_factory=dict)      # uri field -> producer stage (or [stage])
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


def wire_inputs(st: stg.Stage, needs: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The chart's wiring of a stage: ``{field: producer}`` (``{field: [producers]}`` for list fields),
    read from its fields' declarations, with the producers limited to ``needs``; and the required
    input fields that no stage fills (the user sets them)."""
    wired: dict[str, Any] = {}
    unwired = []
    for inp in st.inputs:
        value = stg.wired_value(inp, {p: p for p in needs})
        if value is not None:
            wired[inp.field] = value
        elif inp.required:
            unwired.append(inp.field)
    return wired, unwired


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
        inputs, unwired = wire_inputs(st, needs_of[name])
        info = StageInfo(st.name, st.family, st.help, int(st.gpus or 0), list(needs_of[name]), st.config, fields,
                         inputs, unwired)
        nodes, gpn = _find_path(st.config, NODES_FIELD), _find_path(st.config, GPUS_PER_NODE_FIELD)
        if nodes and gpn:
            info.capacity = {"nodes": nodes, "gpusPerNode": gpn}
            info.capacity_defaults = {"nodes": int(_default_at(st.config, nodes) or 1),
                                      "gpusPerNode": int(_default_at(st.config, gpn) or max(st.gpus, 1))}
        out.append(info)
    return out


def topo_order(stages: dict[str, list[str]]) -> list[str]:
    """Stages in dependency order (needs first); needs outside ``stages`` are ignored.

    Ties keep the given order. Raises ValueError on a cycle.
    """
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ValueError("dependency cycle: " + " -> ".join(path + [n]))
        state[n] = 1
        for d in stages[n]:
            if d in stages:
                visit(d, path + [n])
        state[n] = 2
        order.append(n)

    for n in stages:
        visit(n, [])
    return order
