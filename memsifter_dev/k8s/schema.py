"""``values.schema.json``: every value's type, ``additionalProperties: false`` everywhere (a typo fails
``helm install``), the repeated shapes once in ``$defs``.

The global values come from the same tree as ``values.yaml`` (:data:`.values.global_tree`, descriptions
included). A step of the plan (``pipeline.steps``, ``$defs/step``) has its ``config`` narrowed to its stage's
own pydantic schema (``$defs/<stage>__config``, its nested models hoisted next to it; ``required`` dropped:
``memsifter k8s plan`` has validated each config with its stage). A section's block (``stages.<name>``) is
``$defs/stage``: image, env, runtimeEnv, head, workers, deadlines.
"""

from __future__ import annotations

import json
from typing import Any

from memsifter.k8s.registry import StageInfo
from .values import (ENV_NAME_SCHEMA, IMAGE_REPO_PATTERN, IMAGE_TAG, NAME, SECRET_KEY_SCHEMA, STAGE_KEYS, Group, Value,
                     global_tree, image_families)

# A URL field of a stage's or the service's config (``*_url``: an LLM endpoint, the memory service): a scheme and
# a host, no whitespace, and no ``user:password@`` (keys come from Secrets, never from a ConfigMap), refused with
# ``not`` so that the schema's error names the field without printing the credential.
URL_FIELD = "^[A-Za-z][A-Za-z0-9+.-]*://[^/?#\\s]+([/?#][^\\s]*)?$"
USERINFO = {"type": "string", "pattern": "^[A-Za-z][-A-Za-z0-9+.]*://[^/?#@\\s]*@"}   # a null URL (unset) passes
# Every string of a config is bounded (a ConfigMap holds 1 MiB; templates also bound a whole config document).
MAX_STRING = 65536


def _bound_strings(node: Any, name: str = "") -> None:
    """``maxLength`` on every string schema (and on fields whose type a coercing validator widened), and the URL
    rules on properties named ``url`` or ``*_url``."""
    if isinstance(node, dict):
        types = node.get("type", [])
        types = types if isinstance(types, list) else [types]
        if "string" in types or (name and not types and not ({"$ref", "anyOf", "allOf", "oneOf", "items",
                                                               "properties", "enum", "const"} & set(node))):
            node.setdefault("maxLength", MAX_STRING)
            if name == "url" or name.endswith("_url"):
                node["pattern"], node["not"], node["maxLength"] = URL_FIELD, USERINFO, 2048
        for k, v in node.items():
            if k == "properties" and isinstance(v, dict):
                for pname, prop in v.items():
                    _bound_strings(prop, pname)
            elif k not in ("not", "default", "examples"):
                _bound_strings(v)
    elif isinstance(node, list):
        for v in node:
            _bound_strings(v)


def _rename_refs(node: Any, names: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#/$defs/"):
                out[k] = f"#/$defs/{names[v[len('#/$defs/'):]]}"
            elif k in ("uri", "runtime") and isinstance(v, bool):
                out[f"x-memsifter-{k}"] = v
            elif (k == "stage" and isinstance(v, list) and all(isinstance(x, str) for x in v)) or \
                    (k == "wire" and isinstance(v, str)):   # the producing stages (uri_field stage=, wire=)
                out[f"x-memsifter-{k}"] = v
            else:
                out[k] = _rename_refs(v, names)
        return out
    if isinstance(node, list):
        return [_rename_refs(v, names) for v in node]
    return node


def _coercing_fields(cls: Any) -> set[str]:
    """Fields with a before/plain/wrap validator: their JSON schema is narrower than what they accept."""
    out: set[str] = set()
    decos = getattr(cls, "__pydantic_decorators__", None)
    for d in (decos.field_validators.values() if decos else []):
        if d.info.mode in ("before", "plain", "wrap"):
            fields = d.info.fields
            out |= set(cls.model_fields) if "*" in fields else set(fields)
    return out


def config_def(info: StageInfo) -> str:
    return f"{info.name.replace('-', '_')}__config"


def _compact(node: Any) -> Any:
    """pydantic's schema without its noise: no ``title`` (the property name says it), and
    ``anyOf: [{type: A}, {type: null}]`` written ``type: [A, null]``."""
    if isinstance(node, list):
        return [_compact(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _compact(v) for k, v in node.items() if not (k == "title" and isinstance(v, str))}
    alts = out.get("anyOf")
    if isinstance(alts, list) and alts and all(isinstance(a, dict) and set(a) == {"type"} for a in alts):
        out.pop("anyOf")
        types = [t for a in alts for t in (a["type"] if isinstance(a["type"], list) else [a["type"]])]
        out = {"type": types[0] if len(types) == 1 else types, **out}
    return out


def config_schema(info: StageInfo, defs: dict) -> dict:
    """The stage config's pydantic JSON schema, nested definitions hoisted into ``defs`` (shared between
    stages when identical, e.g. an LLM endpoint; else prefixed with the stage); ``required`` dropped (see
    the module docstring)."""
    sch = model_schema(info.config, f"{info.name.replace('-', '_')}__", defs)
    sch["description"] = (f"Config of stage '{info.name}': only what differs from the defaults "
                          f"(memsifter run {info.name} --schema).")
    return sch


def serve_config_schema(defs: dict) -> dict:
    """``serve.config``: the service's :class:`~memsifter.service.config.ServeConfig` (``index`` not required:
    the chart wires it from the embed stage, or fails naming it)."""
    from memsifter.service.config import ServeConfig

    sch = model_schema(ServeConfig, "serve__", defs)
    sch["description"] = ("Config of the memory service (memsifter.service.config.ServeConfig): only what differs "
                          "from the defaults.")
    return sch


def model_schema(cls: Any, prefix: str, defs: dict) -> dict:
    """A pydantic model's JSON schema for values: compact, fields with coercing validators widened, nested
    definitions hoisted into ``defs`` (``prefix`` + name unless an identical one is there), ``required``
    dropped, unknown keys rejected."""
    sch = _compact(cls.model_json_schema(mode="validation"))
    for fname in _coercing_fields(cls):
        prop = sch.get("properties", {}).get(fname)
        if prop is not None:  # the stage accepts more than the type says (e.g. a URI for a mapping)
            sch["properties"][fname] = {k: v for k, v in prop.items()
                                        if k in ("description", "default", "uri", "runtime", "stage", "wire")}
    names = {}
    own = sch.pop("$defs", {}) or {}
    _bound_strings(sch)
    _bound_strings(own)
    for name, d in own.items():
        shared = "$ref" not in str(d) and defs.get(name, _rename_refs(d, {})) == _rename_refs(d, {})
        names[name] = name if shared else prefix + name
    for name, d in own.items():
        defs[names[name]] = _rename_refs(d, names)
    sch = _rename_refs(sch, names)
    sch.pop("required", None)
    sch["additionalProperties"] = False
    return sch


def _node(node: Value | Group) -> dict:
    if isinstance(node, Value):
        return {**node.schema, "description": node.doc}
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "description": node.doc,
                           "properties": {k: _node(v) for k, v in node.items.items()}}
    if node.required:
        out["required"] = node.required
    return out


_OBJ = {"type": "object"}


def shared_defs() -> dict:
    """The shapes used more than once."""
    ref = lambda n: {"$ref": f"#/$defs/{n}"}
    group = {"resources": ref("resources"), "shmSize": ref("size"), "rayStartParams": ref("rayStartParams"),
             "nodeSelector": ref("nodeSelector"), "tolerations": ref("tolerations"), "affinity": _OBJ}
    nonneg = {"type": "integer", "minimum": 0}
    return {
        "quantity": {"anyOf": [{"type": "string"}, {"type": "number"}]},
        "size": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$"},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "requests": {"type": "object", "additionalProperties": ref("quantity")},
            "limits": {"type": "object", "additionalProperties": ref("quantity")}}},
        "image": {"type": "object", "additionalProperties": False, "description": "'' keeps the family's.",
                  "properties": {"repository": {"type": "string", "pattern": IMAGE_REPO_PATTERN, "maxLength": 255},
                                 "tag": {"type": "string", "pattern": IMAGE_TAG, "maxLength": 200}}},
        "familyImage": {"allOf": [ref("image"), {"required": ["repository", "tag"], "properties": {
            "repository": {"minLength": 1}, "tag": {"minLength": 1}}}]},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"], "additionalProperties": False,
                                           "properties": {"name": {"type": "string",
                                                                   "pattern": "^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                                                                   "maxLength": 253},
                                                          "value": {"type": "string", "maxLength": 65536},
                                                          "valueFrom": _OBJ}}},
        "secretEnv": {"type": "object", "additionalProperties": False, "required": ["name", "secretName", "key"],
                      "properties": {"name": ENV_NAME_SCHEMA, "secretName": NAME,
                                     "key": SECRET_KEY_SCHEMA, "optional": {"type": "boolean"}}},
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
            "key": {"type": "string"}, "operator": {"enum": ["Exists", "Equal"]}, "value": {"type": "string"},
            "effect": {"enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
            "tolerationSeconds": {"type": "integer"}}}},
        "rayStartParams": {"type": "object", "additionalProperties": {"type": "string"},
                           "not": {"required": ["labels"]}},
        "head": {"type": "object", "additionalProperties": False, "properties": group},
        "workers": {"type": "object", "additionalProperties": False, "properties": {
            **group, "replicas": nonneg, "minReplicas": nonneg, "maxReplicas": nonneg,
            "autoscaling": {"type": "boolean"}, "gpus": nonneg, "idleTimeoutSeconds": nonneg}},
        "stage": {"type": "object", "additionalProperties": False, "properties": {
            "image": ref("image"), "env": ref("env"), "runtimeEnv": _OBJ,
            "head": ref("head"), "workers": ref("workers"),
            "activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "backoffLimit": nonneg,
            "ttlSecondsAfterFinished": nonneg, "shutdownAfterJobFinishes": {"type": "boolean"},
            "capacityTimeoutSeconds": {"type": "integer", "minimum": 1}}},
    }


def step_schema(infos: list[StageInfo], defs: dict) -> dict:
    """``$defs/step``: a step of the plan, its config checked against the schema of the stage it names."""
    from memsifter.pipeline import INSTANCE_NAME

    cases = []
    for info in infos:
        defs[config_def(info)] = config_schema(info, defs)
        cases.append({"if": {"properties": {"stage": {"const": info.name}}},
                      "then": {"properties": {"config": {"$ref": f"#/$defs/{config_def(info)}"}}}})
    return {"type": "object", "additionalProperties": False, "required": ["name", "stage", "config"],
            "properties": {"name": {"type": "string", "pattern": "^" + INSTANCE_NAME.pattern + "$"},
                           "stage": {"enum": [i.name for i in infos]},
                           "config": {"type": "object", "required": ["output"]}},
            "allOf": cases}


def values_schema(infos: list[StageInfo]) -> dict:
    defs = shared_defs()
    assert set(defs["stage"]["properties"]) == set(STAGE_KEYS)
    props = {k: _node(v) for k, v in global_tree(infos).items()}
    defs["step"] = step_schema(infos, defs)
    defs["serve__config"] = serve_config_schema(defs)
    props["global"] = {"type": "object", "description": "Helm's global values (unused)."}
    assert image_families(infos)  # the driver's family is always there
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "memsifter chart values (generated by `memsifter k8s gen-chart`)",
            "type": "object", "additionalProperties": False, "properties": props, "$defs": defs}


def schema_text(schema: dict, width: int = 110) -> str:
    """JSON, indented, with lists of scalars (types, enums, required names) and objects of scalars (a string's
    type, pattern and bound) on one line when they fit."""
    def enc(node: Any, indent: int) -> str:
        pad, inner = "  " * indent, "  " * (indent + 1)
        if isinstance(node, dict):
            if not node:
                return "{}"
            flat = json.dumps(node)
            if all(not isinstance(v, (dict, list)) for v in node.values()) and len(inner) + len(flat) <= width:
                return flat
            items = [f"{inner}{json.dumps(k)}: {enc(v, indent + 1)}" for k, v in node.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(node, list):
            flat = json.dumps(node)
            if all(not isinstance(v, (dict, list)) for v in node) and len(inner) + len(flat) <= width:
                return flat
            return "[\n" + ",\n".join(f"{inner}{enc(v, indent + 1)}" for v in node) + f"\n{pad}]"
        return json.dumps(node)
    return enc(schema, 0) + "\n"
