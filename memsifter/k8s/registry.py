"""What the Kubernetes layer knows about each stage, read from the stage registry only.

Nothing here names a stage: the chart, ``jobs/``, the scenarios and the driver iterate over
:func:`memsifter.stage.available_stages` and look at each stage's config class (pydantic), its
``family`` (image), ``gpus`` and ``needs``.

Input wiring: a stage's input-URI fields (``uri_field``) that read another stage's output are filled
from the run prefix (``<run root>/<producer stage>``) unless the user sets them. The producer of a
field is found, in order, from the field's ``json_schema_extra`` (``{"uri": True, "stage": "embed"}``
or ``"from_stage"``), its description naming it (``"embed stage output"``, ``"import/synth outputs"``),
a field name that names a needed stage (``embed``, ``embed_uri``), a dataset field (the upstream stage
without needs, i.e. the importer), or, when exactly one field and one needed stage are left, their
pairing. Fields that cannot be wired stay for the user to set (the values schema then requires them
when the stage is enabled). List-typed fields get a list of outputs.
"""

from __future__ import annotations

import re
import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from .. import stage as stg

# Names that mean "a published dataset" (produced by a stage without needs, e.g. an importer).
DATASET_FIELD_NAMES = {"dataset", "data", "input", "questions", "dataset_uri", "input_uri", "data_uri"}
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


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _is_list(annotation: Any) -> bool:
    tp = annotation
    for cand in (tp, *typing.get_args(tp)):
        if typing.get_origin(cand) in (list, tuple, set):
            return True
    return False


def _transitive(name: str, needs_of: dict[str, list[str]]) -> list[str]:
    out: list[str] = []
    todo = list(needs_of.get(name, []))
    while todo:
        n = todo.pop(0)
        if n not in out:
            out.append(n)
            todo += needs_of.get(n, [])
    return out


def _named_producers(text: str, stages: list[str]) -> list[str]:
    """Stages named as producers in a description, in order: 'embed output', 'import/synth outputs',
    'rank or embed output', 'a collect output', 'embed stage output', 'stage outputs (embed, rank)'."""
    name = r"[A-Za-z][\w-]*"
    found: list[str] = []
    spans = [m.group(1) for m in re.finditer(
        rf"((?:{name})(?:\s*(?:/|,|\bor\b|\band\b)\s*{name})*)\s+(?:stage\s+)?outputs?\b", text)]
    spans += [m.group(1) for m in re.finditer(r"outputs?\s*\(([^)]*)\)", text)]
    for span in spans:
        for word in re.split(r"\s*(?:/|,|\bor\b|\band\b|\s)\s*", span):
            if word in stages and word not in found:
                found.append(word)
    return found


def wire_inputs(name: str, needs: list[str], fields: dict[str, FieldInfo], cls: type[BaseModel],
                roots: set[str], needs_of: dict[str, list[str]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """Map input-URI fields to the stages that produce them (see the module docstring).

    Returns ``{field: stage}`` (``{field: [stage]}`` for list-typed fields) and the required URI
    fields left unwired. A field is only wired to stages upstream of this one (direct needs preferred);
    a list-typed field gets every upstream stage its description names.
    """
    needs_of = dict(needs_of or {})
    needs_of.setdefault(name, list(needs))
    upstream = _transitive(name, needs_of)
    stages = sorted(set(needs_of) | set(upstream), key=len, reverse=True)
    uri_fields = [f for f in fields.values() if f.uri and f.name != "output"]
    wired: dict[str, str] = {}

    def pick(f: FieldInfo, cands: list[str]) -> Any:
        ok = [c for c in cands if c in upstream]
        if not ok:
            return None
        if _is_list(f.annotation):
            return ok
        direct = [c for c in ok if c in needs]
        return (direct or ok)[0]

    for f in uri_fields:
        ex = _extra(cls.model_fields[f.name])
        explicit = ex.get("from_stage") or ex.get("stage")
        if explicit:                                                    # 1. declared by the stage
            wired[f.name] = explicit
            continue
        got = pick(f, _named_producers(f.description, stages))         # 2. "<stage> output" in the help
        if got:
            wired[f.name] = got
        if f.name in wired:
            continue
        n = _norm(f.name)
        for src in needs:                                               # 3. the field names a need
            nn = _norm(src)
            if n == nn or (n.startswith(nn) and n[len(nn):] in ("uri", "output", "out", "dir", "path")):
                wired[f.name] = src
                break
        if f.name in wired:
            continue
        if f.required and (f.name.rstrip("s") in DATASET_FIELD_NAMES
                           or "published dataset" in f.description.lower()):
            cands = [u for u in upstream if u in roots]                 # 4. a dataset: the upstream importer
            if cands:
                wired[f.name] = cands[0]
    used = {x for v in wired.values() for x in (v if isinstance(v, list) else [v])}
    left_needs = [n for n in needs if n not in used]
    rest = [f for f in uri_fields if f.name not in wired and f.required]
    if len(rest) == 1 and len(left_needs) == 1:                         # 5. the last pair
        wired[rest[0].name] = left_needs[0]
    out: dict[str, Any] = {k: ([v] if _is_list(fields[k].annotation) and not isinstance(v, list) else v)
                           for k, v in wired.items()}
    unwired = [f.name for f in uri_fields if f.name not in wired and f.required]
    return out, unwired


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
    """Every available stage (or those named), in registry order."""
    names = list(names) if names is not None else stg.available_stages()
    stages = [stg.get_stage(n) for n in names]
    roots = {s.name for s in stages if not s.needs}
    needs_of = {s.name: list(s.needs) for s in stages}
    out = []
    for st in stages:
        fields = _field_infos(st.config)
        inputs, unwired = wire_inputs(st.name, st.needs, fields, st.config, roots, needs_of)
        info = StageInfo(st.name, st.family, st.help, int(st.gpus or 0), list(st.needs), st.config, fields,
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
