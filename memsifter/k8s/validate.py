"""RayJob and RayService checks that run without a Kubernetes API server.

* :func:`strict_schema` — the CRD's ``openAPIV3Schema`` with ``additionalProperties: false`` added to
  every object schema that lists properties (the CRD has none of its own, so a misspelt field would be
  silently pruned by the API server), ``x-kubernetes-int-or-string`` made explicit.
* :func:`cel_errors` — the CRD's CEL rules (``x-kubernetes-validations``) evaluated in Python. A small
  translator handles the rule shapes KubeRay uses (``has()``, ``&&``, ``||``, ``!``, ``in [...]``);
  transition rules (``oldSelf``) only apply to updates and are skipped; any other rule raises
  :class:`UnsupportedRule`, so a new CRD version with new rules cannot pass unnoticed.
* :func:`kuberay_errors` — KubeRay's admission checks (``ValidateRayJobMetadata``,
  ``ValidateRayJobSpec``, ``ValidateRayClusterSpec`` in ray-operator/controllers/ray/utils/validation.go
  of v1.7.0) re-stated in Python, plus what the submitter needs: its shell splices ``entrypoint`` into
  ``ray job submit ... -- <entrypoint>``, so the entrypoint must be one simple command (no ``;``,
  ``&&``, pipes or redirections, which the submitter would run itself).
* :func:`rayservice_errors` — the same for a RayService (``ValidateRayServiceMetadata``,
  ``ValidateRayServiceSpec``, ``ValidateClusterUpgradeOptions``) and a parseable ``serveConfigV2``;
  :func:`validate_rayservice` runs them with the rayservices CRD's schema and CEL rules.

The three KubeRay v1.7.0 CRDs these checks read ship with the package (``crds/``, gzipped, with their
Apache-2.0 licence and provenance): :func:`packaged_crd` / :func:`kind_schema`; ``memsifter k8s validate``
uses them unless ``--crd`` names another file.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import yaml

from .driver import submitted_entrypoint  # noqa: F401 - what the submitter runs, re-exported

MAX_RAYJOB_NAME = 47
MAX_RAYSERVICE_NAME = 47   # MaxRayClusterNameLength (53) - 6
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
DNS1123_SUB = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
SHELL_OPERATORS = {";", "&&", "||", "|", "&", ">", ">>", "<", "<<", "(", ")", ";;", "|&", ">&", "<&"}


class UnsupportedRule(Exception):
    """A CEL rule outside the subset this module can evaluate."""


# --------------------------------------------------------------------------- CRD schema
CRD_DIR = Path(__file__).resolve().parent / "crds"
KUBERAY_VERSION = "v1.7.0"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml.gz", "RayService": "ray.io_rayservices.yaml.gz",
             "RayCluster": "ray.io_rayclusters.yaml.gz"}


def packaged_crd(kind: str) -> Path:
    """The KubeRay v1.7.0 CRD of ``kind`` (RayJob, RayService, RayCluster) shipped in ``crds/``."""
    return CRD_DIR / CRD_FILES[kind]


def read_crd(crd_path: str | Path) -> dict:
    """A CRD document from a ``.yaml`` or gzipped ``.yaml.gz`` file."""
    import gzip

    raw = Path(crd_path).read_bytes()
    return yaml.safe_load(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def crd_kind(crd: dict) -> str:
    return crd["spec"]["names"]["kind"]


def crd_version_schema(crd: dict, version: str = "v1", where: str = "CRD") -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{where}: no version {version}")


def crd_schema(crd_path: str | Path, version: str = "v1") -> dict:
    return crd_version_schema(read_crd(crd_path), version, str(crd_path))


def kind_schema(kind: str) -> dict:
    """The openAPIV3Schema of the packaged CRD of ``kind``."""
    return crd_schema(packaged_crd(kind))


def strict_schema(schema: dict) -> dict:
    """A copy of an OpenAPI v3 schema that rejects unknown fields (see the module docstring)."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("x-kubernetes-int-or-string"):
                node.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(out)
    return out


def schema_errors(obj: dict, schema: dict) -> list[str]:
    import jsonschema

    v = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in sorted(v.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]


# --------------------------------------------------------------------------- CEL rules
def cel_rules(schema: dict) -> list[tuple[tuple[str, ...], dict]]:
    """(schema path of properties, rule) for every x-kubernetes-validations entry."""
    out = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        for rule in node.get("x-kubernetes-validations", []) or []:
            out.append((path, rule))
        for k, v in (node.get("properties") or {}).items():
            walk(v, path + (k,))
        if isinstance(node.get("items"), dict):
            walk(node["items"], path + ("[]",))
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], path + ("{}",))
    walk(schema, ())
    return out


_TOKEN = re.compile(r"\s*(has\(self\.([A-Za-z_][A-Za-z0-9_]*)\)|&&|\|\||!|\(|\)|self\s+in\s+\[[^\]]*\]|"
                    r"self\s*==\s*oldSelf)")


def translate_cel(rule: str) -> str | None:
    """Python expression over ``self`` for a supported rule; None for transition rules (oldSelf)."""
    if "oldSelf" in rule:
        if re.fullmatch(r"\s*self\s*==\s*oldSelf\s*", rule):
            return None
        raise UnsupportedRule(rule)
    pos, out = 0, []
    while pos < len(rule):
        if rule[pos:].strip() == "":
            break
        m = _TOKEN.match(rule, pos)
        if not m:
            raise UnsupportedRule(f"{rule!r} at {rule[pos:]!r}")
        tok = m.group(1)
        if tok.startswith("has("):
            out.append(f"({m.group(2)!r} in self)")
        elif tok == "&&":
            out.append(" and ")
        elif tok == "||":
            out.append(" or ")
        elif tok == "!":
            out.append(" not ")
        elif tok.startswith("self") and " in " in f" {tok} ".replace("[", " ["):
            lst = tok[tok.index("["):]
            items = [s.strip().strip("'\"") for s in lst.strip("[]").split(",") if s.strip()]
            out.append(f"(self in {items!r})")
        else:
            out.append(tok)
        pos = m.end()
    return "".join(out)


def _values_at(obj: Any, path: tuple[str, ...]) -> Iterator[Any]:
    if not path:
        yield obj
        return
    head, rest = path[0], path[1:]
    if head == "[]":
        for item in obj if isinstance(obj, list) else []:
            yield from _values_at(item, rest)
    elif head == "{}":
        for item in (obj.values() if isinstance(obj, dict) else []):
            yield from _values_at(item, rest)
    elif isinstance(obj, dict) and head in obj:
        yield from _values_at(obj[head], rest)


def cel_errors(obj: dict, schema: dict) -> list[str]:
    errors = []
    for path, rule in cel_rules(schema):
        expr = translate_cel(rule["rule"])
        if expr is None:
            continue
        for value in _values_at(obj, path):
            if not eval(expr, {"__builtins__": {}}, {"self": value}):  # noqa: S307 - translated subset only
                errors.append(f"{'.'.join(path)}: {rule.get('message') or rule['rule']}")
    return errors


# --------------------------------------------------------------------------- KubeRay admission
def _containers(template: dict | None) -> list[dict]:
    return ((template or {}).get("spec") or {}).get("containers") or []


def _env_names(container: dict) -> set[str]:
    return {e.get("name") for e in container.get("env") or []}


def _group_errors(name: str, group: dict) -> list[str]:
    errs = []
    rsp = group.get("rayStartParams") or {}
    if any(rsp.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
        errs.append(f"resource fields should not be set in both rayStartParams and Resources for {name} group")
    if "labels" in rsp:
        errs.append(f"rayStartParams['labels'] is not supported for {name} group")
    for k, v in (group.get("labels") or {}).items():
        if not _qualified_name(k):
            errs.append(f"invalid label key for {name} group: {k!r}")
        if not LABEL_VALUE.match(str(v)) or len(str(v)) > 63:
            errs.append(f"invalid label value for key {k!r} in {name} group: {v!r}")
    return errs


def _qualified_name(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS1123_SUB.match(prefix)):
        return False
    return bool(name) and len(name) <= 63 and bool(LABEL_NAME.match(name))


def raycluster_spec_errors(spec: dict, annotations: dict | None = None) -> list[str]:
    annotations = annotations or {}
    errs = []
    head = spec.get("headGroupSpec") or {}
    head_containers = _containers(head.get("template"))
    if not head_containers:
        return ["headGroupSpec should have at least one container"]
    errs += _group_errors("Head", head)
    for wg in spec.get("workerGroupSpecs") or []:
        if not _containers(wg.get("template")):
            errs.append("workerGroupSpec should have at least one container")
        errs += _group_errors(wg.get("groupName", "?"), wg)
        lo, hi, rep = _int(wg.get("minReplicas", 0)), _int(wg.get("maxReplicas", 2147483647)), wg.get("replicas")
        rep = rep if isinstance(rep, int) else None
        if lo > hi:
            errs.append(f"worker group {wg.get('groupName')}: minReplicas {lo} > maxReplicas {hi}")
        if rep is not None and not (lo <= rep <= hi) and not spec.get("enableInTreeAutoscaling"):
            errs.append(f"worker group {wg.get('groupName')}: replicas {rep} outside [{lo}, {hi}]")
    if annotations.get("ray.io/ft-enabled") and spec.get("gcsFaultToleranceOptions"):
        errs.append("ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set")
    head_env = _env_names(head_containers[0])
    if not spec.get("gcsFaultToleranceOptions") and annotations.get("ray.io/ft-enabled") != "true" \
            and "RAY_REDIS_ADDRESS" in head_env:
        errs.append("RAY_REDIS_ADDRESS is set (implicit GCS fault tolerance) without GcsFaultToleranceOptions")
    if (head.get("rayStartParams") or {}).get("redis-username") or "REDIS_USERNAME" in head_env:
        errs.append("cannot set redis username in rayStartParams or environment variables")
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    for wg in spec.get("workerGroupSpecs") or []:
        if wg.get("suspend"):
            errs.append(f"worker group {wg.get('groupName')} cannot be suspended "
                        f"({'autoscaler enabled' if autoscaling else 'needs the RayJobDeletionPolicy gate'})")
    v2_env = {e.get("name"): e.get("value") for e in head_containers[0].get("env") or []}
    if not autoscaling and v2_env.get("RAY_enable_autoscaler_v2") in ("1", "true"):
        errs.append("RAY_enable_autoscaler_v2 set while enableInTreeAutoscaling is false")
    if autoscaling and (spec.get("autoscalerOptions") or {}).get("version") and "RAY_enable_autoscaler_v2" in v2_env:
        errs.append("both .spec.autoscalerOptions.version and RAY_enable_autoscaler_v2 are set")
    if autoscaling and ((spec.get("autoscalerOptions") or {}).get("version") == "v2"
                        or v2_env.get("RAY_enable_autoscaler_v2") in ("1", "true")):
        for grp in [head, *(spec.get("workerGroupSpecs") or [])]:
            rp = ((grp.get("template") or {}).get("spec") or {}).get("restartPolicy")
            if rp not in (None, "", "Never"):
                errs.append("restartPolicy should be Never or unset when using autoscaler V2")
    if ((spec.get("authOptions") or {}).get("mode") == "token"):
        rv = spec.get("rayVersion") or ""
        if not rv or tuple(int(x) for x in re.findall(r"\d+", rv)[:3]) < (2, 52, 0):
            errs.append("authOptions.mode is 'token' but rayVersion is not >= 2.52.0")
    return errs


def entrypoint_errors(entrypoint: str) -> list[str]:
    """The entrypoint must survive KubeRay's submitter: one simple shell command."""
    if not entrypoint.strip():
        return ["entrypoint is empty"]
    if "\n" in entrypoint.strip():
        return ["entrypoint spans several lines: the submitter would run the later lines itself"]
    try:
        lex = shlex.shlex(entrypoint, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
    except ValueError as e:
        return [f"entrypoint does not parse as a shell command: {e}"]
    if "$(" in entrypoint or "`" in entrypoint:
        return ["entrypoint contains command substitution (evaluated by the submitter's shell)"]
    ops = [t for t in tokens if t in SHELL_OPERATORS]
    if ops:
        return [f"entrypoint contains shell operators {ops}: KubeRay's submitter splices it into "
                f"`ray job submit -- <entrypoint>`, so they would run in the submitter pod"]
    return []


def _int(v: Any) -> int:
    """An integer field for comparisons (wrong types are the schema check's business)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def kuberay_errors(rayjob: dict) -> list[str]:
    errs = []
    meta = rayjob.get("metadata") or {}
    name = meta.get("name", "")
    if len(name) > MAX_RAYJOB_NAME:
        errs.append(f"RayJob name should be no more than {MAX_RAYJOB_NAME} characters ({name!r}: {len(name)})")
    if not DNS1035.match(name):
        errs.append(f"RayJob name should be a valid DNS1035 label ({name!r})")
    for k, v in (meta.get("labels") or {}).items():
        if not _qualified_name(k) or not LABEL_VALUE.match(str(v)) or len(str(v)) > 63:
            errs.append(f"invalid label {k}={v!r}")
    spec = rayjob.get("spec") or {}
    shutdown = bool(spec.get("shutdownAfterJobFinishes"))
    if spec.get("suspend") and not shutdown:
        errs.append("a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended")
    ttl = _int(spec.get("ttlSecondsAfterFinished", 0))
    if ttl < 0:
        errs.append("TTLSecondsAfterFinished must be a non-negative integer")
    if not shutdown and ttl > 0:
        errs.append("a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished")
    if spec.get("deletionStrategy"):
        errs.append("deletionStrategy needs the RayJobDeletionPolicy feature gate (not used by memsifter)")
    selector = spec.get("clusterSelector") or {}
    if spec.get("suspend") and selector:
        errs.append("the ClusterSelector mode doesn't support the suspend operation")
    if not spec.get("rayClusterSpec") and not selector:
        errs.append("one of RayClusterSpec or ClusterSelector must be set")
    mode = spec.get("submissionMode", "K8sJobMode")
    if selector:
        if not selector.get("ray.io/cluster"):
            errs.append("cluster name in ClusterSelector should not be empty")
        if mode == "SidecarMode":
            errs.append("ClusterSelector is not supported in SidecarMode")
    if mode == "InteractiveMode" and _int(spec.get("backoffLimit")) > 0:
        errs.append("BackoffLimit is incompatible with InteractiveMode")
    if mode == "SidecarMode":
        if spec.get("submitterPodTemplate") or spec.get("submitterConfig"):
            errs.append("SidecarMode doesn't support SubmitterPodTemplate / SubmitterConfig")
    if spec.get("rayClusterSpec"):
        errs += [f"rayClusterSpec: {e}" for e in raycluster_spec_errors(spec["rayClusterSpec"],
                                                                        meta.get("annotations"))]
    rte = spec.get("runtimeEnvYAML")
    if rte:
        try:
            parsed = yaml.safe_load(rte)
            if parsed is not None and not isinstance(parsed, dict):
                errs.append("runtimeEnvYAML is not a mapping")
        except yaml.YAMLError as e:
            errs.append(f"runtimeEnvYAML is not valid YAML: {e}")
    if spec.get("activeDeadlineSeconds") is not None and _int(spec["activeDeadlineSeconds"]) <= 0:
        errs.append("activeDeadlineSeconds must be a positive integer")
    if spec.get("backoffLimit") is not None and _int(spec["backoffLimit"]) < 0:
        errs.append("backoffLimit must be a positive integer")
    if mode in ("K8sJobMode", "SidecarMode") and not selector:
        errs += entrypoint_errors(spec.get("entrypoint", ""))
    return errs


UPGRADE_TYPES = ("NewCluster", "NewClusterWithIncrementalUpgrade", "None")
INITIALIZING_TIMEOUT = "ray.io/initializing-timeout"


def _duration_ok(text: str) -> bool:
    """A positive Go duration ("90s", "1h30m") or positive integer seconds."""
    if re.fullmatch(r"[0-9]+", text):
        return int(text) > 0
    m = re.fullmatch(r"(?:[0-9]+(?:\.[0-9]+)?(?:ns|us|µs|ms|s|m|h))+", text)
    return bool(m) and any(c in "123456789" for c in text)


def rayservice_errors(rs: dict) -> list[str]:
    """KubeRay's RayService admission checks (``ValidateRayServiceMetadata``, ``ValidateRayServiceSpec``,
    ``ValidateClusterUpgradeOptions`` of v1.7.0, the RayServiceIncrementalUpgrade gate on, its default), plus
    what the operator parses later: ``serveConfigV2`` must be a YAML mapping with ``applications``."""
    errs = []
    meta = rs.get("metadata") or {}
    name = meta.get("name", "")
    if len(name) > MAX_RAYSERVICE_NAME:
        errs.append(f"RayService name should be no more than {MAX_RAYSERVICE_NAME} characters ({name!r}: {len(name)})")
    if not DNS1035.match(name):
        errs.append(f"RayService name should be a valid DNS1035 label ({name!r})")
    for k, v in (meta.get("labels") or {}).items():
        if not _qualified_name(k) or not LABEL_VALUE.match(str(v)) or len(str(v)) > 63:
            errs.append(f"invalid label {k}={v!r}")
    timeout = (meta.get("annotations") or {}).get(INITIALIZING_TIMEOUT)
    if timeout and not _duration_ok(str(timeout)):
        errs.append(f"annotation {INITIALIZING_TIMEOUT} must be a positive duration or integer seconds ({timeout!r})")
    spec = rs.get("spec") or {}
    rcc = spec.get("rayClusterConfig") or {}
    if (rcc.get("authOptions") or {}).get("enableK8sTokenAuth"):
        errs.append("K8s token auth mode is currently not supported for RayService")
    errs += [f"rayClusterConfig: {e}" for e in raycluster_spec_errors(rcc, meta.get("annotations"))]
    if (((rcc.get("headGroupSpec") or {}).get("headService") or {}).get("metadata") or {}).get("name"):
        errs.append("spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set")
    up = spec.get("upgradeStrategy") or {}
    kind = up.get("type")
    if kind is not None and kind not in UPGRADE_TYPES:
        errs.append(f"Spec.UpgradeStrategy.Type value {kind} is invalid, valid options are "
                    f"{', '.join(UPGRADE_TYPES)}")
    delay = spec.get("rayClusterDeletionDelaySeconds")
    if isinstance(delay, int) and delay < 0:
        errs.append("Spec.RayClusterDeletionDelaySeconds should be a non-negative integer")
    if kind == "NewClusterWithIncrementalUpgrade":
        opts = up.get("clusterUpgradeOptions")
        if not rcc.get("enableInTreeAutoscaling"):
            errs.append("Ray Autoscaler is required for NewClusterWithIncrementalUpgrade")
        elif opts is None:
            errs.append("ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade")
        else:
            surge, step, every = opts.get("maxSurgePercent", 100), opts.get("stepSizePercent"), opts.get("intervalSeconds")
            if not 0 <= _int(surge) <= 100:
                errs.append("maxSurgePercent must be between 0 and 100")
            if step is None or not 0 <= _int(step) <= 100:
                errs.append("stepSizePercent must be between 0 and 100")
            elif _int(step) > _int(surge):
                errs.append("stepSizePercent must be less than or equal to maxSurgePercent")
            if every is None or _int(every) <= 0:
                errs.append("intervalSeconds must be greater than 0")
            if not opts.get("gatewayClassName"):
                errs.append("gatewayClassName is required for NewClusterWithIncrementalUpgrade")
    text = spec.get("serveConfigV2")
    if text is not None:
        try:
            sc = yaml.safe_load(text)
            if not isinstance(sc, dict) or not isinstance(sc.get("applications"), list):
                errs.append("serveConfigV2 is not a Serve config (a mapping with 'applications')")
        except yaml.YAMLError as e:
            errs.append(f"serveConfigV2 is not valid YAML: {str(e).splitlines()[0]}")
    return errs


def validate_rayservice(rs: dict, schema: dict | None = None) -> list[str]:
    """All checks of a RayService; ``schema`` is the rayservices CRD's openAPIV3Schema (made strict here)."""
    errs = []
    if schema is not None:
        errs += [f"schema: {e}" for e in schema_errors(rs, strict_schema(schema))]
        errs += [f"CEL: {e}" for e in cel_errors(rs, schema)]
    errs += [f"kuberay: {e}" for e in rayservice_errors(rs)]
    return errs


def validate_raycluster(rc: dict, schema: dict | None = None) -> list[str]:
    """A RayCluster: the rayclusters CRD's schema (strict) and CEL rules, KubeRay's cluster spec checks."""
    errs = []
    if schema is not None:
        errs += [f"schema: {e}" for e in schema_errors(rc, strict_schema(schema))]
        errs += [f"CEL: {e}" for e in cel_errors(rc, schema)]
    meta = rc.get("metadata") or {}
    errs += [f"kuberay: {e}" for e in raycluster_spec_errors(rc.get("spec") or {}, meta.get("annotations"))]
    return errs


def validate_rayjob(rayjob: dict, schema: dict | None = None) -> list[str]:
    """All checks; ``schema`` is the CRD's openAPIV3Schema (made strict here)."""
    errs = []
    if schema is not None:
        errs += [f"schema: {e}" for e in schema_errors(rayjob, strict_schema(schema))]
        errs += [f"CEL: {e}" for e in cel_errors(rayjob, schema)]
    errs += [f"kuberay: {e}" for e in kuberay_errors(rayjob)]
    return errs


VALIDATORS = {"RayJob": validate_rayjob, "RayService": validate_rayservice, "RayCluster": validate_raycluster}


def validate_kuberay(doc: dict, schemas: dict[str, dict | None]) -> list[str]:
    """The checks of a KubeRay document by its kind, with ``schemas[kind]`` (None: KubeRay's rules only)."""
    return VALIDATORS[doc["kind"]](doc, schemas.get(doc["kind"]))


# --------------------------------------------------------------------------- policy scanning
def _rayjobs_in(doc: dict) -> list[dict]:
    if doc.get("kind") in ("RayJob", "RayService"):
        return [doc]
    if doc.get("kind") == "ConfigMap" and "plan.json" in (doc.get("data") or {}):
        import json

        return [s["rayjob"] for s in json.loads(doc["data"]["plan.json"]).get("stages", [])]
    return []


def workload_manifests(docs: list[dict]) -> list[dict]:
    """``docs`` plus the pods hidden inside RayJobs, as core kinds that policy scanners understand.

    Scanners such as checkov skip custom resources, and with the driver enabled the RayJobs sit in the plan
    ConfigMap. For each RayJob this adds what KubeRay will create from it: a ``Pod`` for the head (with the
    autoscaler sidecar as a second container when in-tree autoscaling is on, as KubeRay adds it), a ``Pod``
    per worker group, and a ``Job`` for the submitter (``submitterPodTemplate``). Names are
    ``<rayjob>-head``, ``<rayjob>-<group>-worker`` and ``<rayjob>-submitter``. A RayService's cluster
    (``rayClusterConfig``) is expanded the same way (no submitter).
    """
    out = list(docs)
    for doc in docs:
        for rj in _rayjobs_in(doc):
            meta, spec = rj.get("metadata") or {}, rj.get("spec") or {}
            name, ns = meta.get("name", "rayjob"), meta.get("namespace")
            rcs = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or {}

            def pod(suffix: str, template: dict, extra: list[dict] | None = None) -> dict:
                tpl = copy.deepcopy(template or {})
                pmeta = {"name": f"{name}-{suffix}", "labels": (tpl.get("metadata") or {}).get("labels") or {}}
                if ns:
                    pmeta["namespace"] = ns
                pspec = tpl.get("spec") or {}
                pspec["containers"] = list(pspec.get("containers") or []) + (extra or [])
                return {"apiVersion": "v1", "kind": "Pod", "metadata": pmeta, "spec": pspec}

            head = (rcs.get("headGroupSpec") or {}).get("template") or {}
            extra = []
            if rcs.get("enableInTreeAutoscaling"):
                ao = rcs.get("autoscalerOptions") or {}
                image = ao.get("image") or (_containers(head) or [{}])[0].get("image")
                extra.append({"name": "autoscaler", "image": image,
                              **{k: ao[k] for k in ("imagePullPolicy", "resources", "securityContext", "env",
                                                    "envFrom", "volumeMounts", "command", "args") if k in ao}})
            out.append(pod("head", head, extra))
            for wg in rcs.get("workerGroupSpecs") or []:
                out.append(pod(f"{wg.get('groupName', 'group')}-worker", wg.get("template") or {}))
            sub = spec.get("submitterPodTemplate")
            if sub and spec.get("submissionMode", "K8sJobMode") == "K8sJobMode":
                jmeta = {"name": f"{name}-submitter", "labels": meta.get("labels") or {}}
                if ns:
                    jmeta["namespace"] = ns
                out.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": jmeta,
                            "spec": {"backoffLimit": 0, "template": copy.deepcopy(sub)}})
    return out
