"""The chart's values, written once: defaults, ``# --`` doc comments and JSON schema side by side.

:data:`GLOBALS` is a tree of :class:`Group` / :class:`Value` nodes (default, one-line doc, schema). From it,
and from the stage registry, come ``values.yaml`` (helm-docs style ``# --`` comments on every value),
the non-stage part of ``values.schema.json`` (:mod:`.schema`) and the values tables of the chart's
``README.md``. What runs is ``pipeline``: the plan ``memsifter k8s plan`` makes from a pipeline config
(:func:`memsifter.pipeline.plan`'s steps, in order, empty here); ``stages`` holds only Kubernetes settings per
section of that plan (head/worker sizes come from the family ``profiles`` and ``common``/``multiNode``
settings). Facts that are code, not settings (family, GPUs per worker, multi-node capacity fields) go to
``files/stages.json`` (:func:`stage_facts`), which the templates read.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from memsifter import __version__
from memsifter.k8s.registry import StageInfo
from memsifter.pipeline import INSTANCE_NAME

RAY_VERSION = "2.59.0"
IMAGE_REPOSITORY = "ghcr.io/memsifter/memsifter-{family}"
DRIVER_FAMILY = "chat"  # the driver runs in the chat image (light, no torch; it has the kubernetes client)
WIDTH = 110

# Head/worker pods per image family (the families of the images/ Dockerfiles); a family without an entry
# here gets the "chat" sizes. CPU limit = request (Ray sizes num-cpus from it).
FAMILY_PROFILES: dict[str, dict[str, tuple[str, str, str]]] = {   # group -> (cpu, memory, /dev/shm)
    "chat": {"head": ("2", "8Gi", "1Gi"), "workers": ("4", "16Gi", "2Gi")},
    "embed": {"head": ("2", "8Gi", "2Gi"), "workers": ("8", "48Gi", "8Gi")},
    "rank": {"head": ("4", "16Gi", "2Gi"), "workers": ("16", "128Gi", "32Gi")},
    "train": {"head": ("8", "64Gi", "8Gi"), "workers": ("64", "512Gi", "64Gi")},
}
# Every pod and container of the chart: non-root, no privilege escalation, no capabilities, RuntimeDefault
# seccomp, read-only root filesystem with emptyDir mounts where the workloads write. k8s/SECURITY.md.
POD_SECURITY_CONTEXT = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                              "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                              "seccompProfile": {"type": "RuntimeDefault"}}


# --------------------------------------------------------------------------- the tree
@dataclass
class Value:
    default: Any
    doc: str
    schema: dict = field(default_factory=dict)


@dataclass
class Group:
    doc: str
    items: dict[str, Value | Group]
    required: list[str] = field(default_factory=list)


def resources(cpu: str, memory: str, cpu_limit: str | None = None) -> dict:
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"cpu": cpu_limit or cpu, "memory": memory}}


def image_families(infos: list[StageInfo]) -> list[str]:
    return sorted({i.family for i in infos} | {DRIVER_FAMILY}) + ["driver"]


def _ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_POS = {"type": "integer", "minimum": 1}
_NONNEG = {"type": "integer", "minimum": 0}
_PATH = {"type": "string", "pattern": "^/[-._/A-Za-z0-9]*$", "maxLength": 200}

# Values that end up in names, paths and references are checked by the schema (issue 41): no '/', '..', spaces,
# newlines or oversized strings reach a manifest. Kubernetes' own grammars (DNS-1123 names, Secret keys, env var
# names), the image reference grammar, an S3 endpoint of scheme, host and port only (no user:password@: the
# credentials come from secrets.s3), a prefix of path segments that do not start with '.'.
DNS1123_LABEL = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$"
DNS1123_SUBDOMAIN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY = "^\\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"   # Kubernetes: [-._a-zA-Z0-9]+, not '.', '..' or '..x'
ENV_NAME = "^[A-Za-z_][A-Za-z0-9_]*$"
IMAGE_TAG = "^([A-Za-z0-9_][A-Za-z0-9_.-]{0,127}(@sha256:[a-f0-9]{64})?)?$"
IMAGE_REPO_PATTERN = ("^(([a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]{1,5})?/)?[a-z0-9]+([._-]+[a-z0-9]+)*"
                      "(/[a-z0-9]+([._-]+[a-z0-9]+)*)*)?$")
# (user:password@ passes the pattern and is refused by `not`, whose error does not print the value)
S3_ENDPOINT = "^(https?://([^/@\\s]*@)?([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?|\\[[0-9A-Fa-f:.]+\\])(:[0-9]{1,5})?/?)?$"
PREFIX = "^([A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*)?$"
NAME = {"type": "string", "pattern": DNS1123_SUBDOMAIN, "maxLength": 253}   # a Secret, ServiceAccount, PVC ...
NAME_OR_EMPTY = {"type": "string", "pattern": DNS1123_SUBDOMAIN.replace("^", "^(", 1)[:-1] + ")?$", "maxLength": 253}
SECRET_KEY_SCHEMA = {"type": "string", "pattern": SECRET_KEY, "maxLength": 253}
ENV_NAME_SCHEMA = {"type": "string", "pattern": ENV_NAME, "maxLength": 253}


def profile_group(family: str, infos: list[StageInfo]) -> Group:
    prof = FAMILY_PROFILES.get(family, FAMILY_PROFILES["chat"])
    users = ", ".join(i.name for i in infos if i.family == family)
    items: dict[str, Value | Group] = {}
    for grp, (cpu, mem, shm) in prof.items():
        what = "Head pod" if grp == "head" else "Worker pods (GPU stages: the nvidia.com/gpu limit comes from workers.gpus)"
        items[grp] = Group(f"{what}.", {
            "resources": Value(resources(cpu, mem), "Requests and limits.", _ref("resources")),
            "shmSize": Value(shm, "Size of the /dev/shm tmpfs (Ray's object store, NCCL).", _ref("size"))})
    return Group(f"Family {family} ({users}).", items)


def global_tree(infos: list[StageInfo]) -> dict[str, Value | Group]:
    from .serve import serve_group

    families = image_families(infos)
    return {
        "nameOverride": Value("", "Replaces the chart name in resource names.",
                              {"type": "string", "pattern": DNS1123_LABEL, "maxLength": 40}),
        "fullnameOverride": Value("", "Replaces <release>-<chart> in resource names.",
                                  {"type": "string", "pattern": DNS1123_LABEL, "maxLength": 63}),
        "run": Group("Run identity: RayJob and ConfigMap names and the run's labels are scoped by it.", {
            "id": Value("", "Run id ('' = the release name): a new id creates new RayJobs (the plan's run root says "
                        "where outputs go: published steps are skipped), the same id resumes.",
                        {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", "maxLength": 40})}),
        "s3": Group("S3 settings of every pod; bucket/runPrefix make the run root s3://<bucket>/<runPrefix>/<run id> "
                    "when no plan gives one (pipeline.run), and the bucket holds the service's state.", {
            "endpoint": Value("", "S3 endpoint, http(s)://host[:port] ('' for AWS S3), e.g. "
                              "http://seaweedfs.memsifter.svc:8333.",
                              {"type": "string", "pattern": S3_ENDPOINT, "maxLength": 253,
                               "not": {"pattern": "://[^/?#@\\s]*@"}}),
            "region": Value("us-east-1", "Region (AWS_REGION).",
                            {"type": "string", "pattern": "^[a-z0-9][-a-z0-9]*$", "maxLength": 40}),
            "bucket": Value("memsifter", "Bucket of the run.",
                            {"type": "string", "pattern": "^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"}),
            "runPrefix": Value("runs", "Prefix of runs in the bucket ('/'-separated segments of [A-Za-z0-9._-]).",
                               {"type": "string", "pattern": PREFIX, "maxLength": 200})}, required=["bucket"]),
        "secrets": Group("Secrets by name and key (create them first: k8s/secrets.example.yaml); pods get them as "
                         "env vars via secretKeyRef, nothing secret is stored in values.", {
            "s3": Value({"name": "memsifter-s3", "accessKeyIdKey": "AWS_ACCESS_KEY_ID",
                         "secretAccessKeyKey": "AWS_SECRET_ACCESS_KEY"}, "S3 credentials.",
                        _secret("accessKeyIdKey", "secretAccessKeyKey")),
            "llm": Value({"name": "memsifter-llm", "key": "OPENAI_API_KEY", "envName": "OPENAI_API_KEY",
                          "optional": True}, "Key of the working LLM / judge endpoint, as env var envName.",
                         _secret("key", "envName", "optional")),
            "huggingFace": Value({"name": "memsifter-hf", "key": "HF_TOKEN", "optional": True},
                                 "Hugging Face token (HF_TOKEN), for gated models.", _secret("key", "optional")),
            "extraEnv": Value([], "More env vars from Secrets: [{name, secretName, key, optional}] (e.g. tracker "
                                  "credentials).", {"type": "array", "items": _ref("secretEnv")})}),
        "images": Group("One image per stage family (images/<family>/Dockerfile); the driver uses the chat image.", {
            "pullPolicy": Value("Always", "Always re-checks the registry (and pull credentials) at each pod start; "
                                          "IfNotPresent for images loaded into nodes.",
                                {"enum": ["Always", "IfNotPresent", "Never"]}),
            "pullSecrets": Value([], "imagePullSecrets of every pod: [{name: ...}].",
                                 {"type": "array", "items": {"type": "object", "required": ["name"],
                                                            "additionalProperties": False,
                                                            "properties": {"name": NAME}}}),
            "families": Value({f: {"repository": IMAGE_REPOSITORY.format(family=DRIVER_FAMILY if f == "driver" else f),
                                   "tag": __version__} for f in families},
                              "repository/tag per family; pin by digest with tag: \"<tag>@sha256:<digest>\".",
                              {"type": "object", "additionalProperties": False, "required": families,
                               "properties": {f: _ref("familyImage") for f in families}})}),
        "rayVersion": Value(RAY_VERSION, "Ray version of the images (KubeRay uses it for the cluster spec).",
                            {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}),
        "env": Value([{"name": "TOKENIZERS_PARALLELISM", "value": "false"}],
                     "Extra env vars of every Ray container (name/value or name/valueFrom).", _ref("env")),
        "cacheVolume": Group("Model and compile caches (HF_HOME, XDG_CACHE_HOME, vLLM, Triton point here).", {
            "sizeLimit": Value("100Gi", "Size of the per-pod emptyDir.", _ref("size")),
            "mountPath": Value("/cache", "Where it is mounted.", _PATH),
            "existingClaim": Value("", "A ReadWriteMany PersistentVolumeClaim shared by every pod instead (weights "
                                       "downloaded once).", NAME_OR_EMPTY)}),
        "scratchVolume": Group("emptyDir at /tmp: Ray's session files and stage scratch (train's local_dir).", {
            "sizeLimit": Value("200Gi", "Size (needs that much node disk).", _ref("size"))}),
        "homeVolume": Group("emptyDir used as HOME (the root filesystem is read-only).", {
            "sizeLimit": Value("1Gi", "Size.", _ref("size")),
            "mountPath": Value("/home/memsifter", "HOME of the Ray containers.", _PATH)}),
        "volumes": Value([], "Extra volumes of every Ray pod.", {"type": "array", "items": {"type": "object"}}),
        "volumeMounts": Value([], "Extra volume mounts of every Ray container.",
                              {"type": "array", "items": {"type": "object"}}),
        "podSecurityContext": Value(POD_SECURITY_CONTEXT, "Every pod: the images' non-root user, seccomp "
                                                          "RuntimeDefault.", {"type": "object"}),
        "containerSecurityContext": Value(CONTAINER_SECURITY_CONTEXT, "Every container: no privilege escalation, "
                                          "no capabilities, read-only root filesystem (k8s/SECURITY.md).",
                                          {"type": "object"}),
        "cpuPool": Group("Scheduling of head pods, submitters, the driver and workers of CPU-only stages.", {
            "nodeSelector": Value({}, "Node labels.", _ref("nodeSelector")),
            "tolerations": Value([], "Tolerations.", _ref("tolerations")),
            "affinity": Value({}, "Affinity.", {"type": "object"})}),
        "gpuPool": Group("Scheduling of GPU worker pods: the GPU pool's labels and taints (k8s/gpu-node-pool.md).", {
            "nodeSelector": Value({"memsifter.io/pool": "gpu"}, "Node labels.", _ref("nodeSelector")),
            "tolerations": Value([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                                 "Tolerations.", _ref("tolerations")),
            "affinity": Value({}, "Affinity.", {"type": "object"})}),
        "driver": Group("The pipeline driver (`memsifter k8s drive`): a Job that creates the plan's RayJobs in the "
                        "plan's order, waits for each, stops at the first failure and writes the run manifest.", {
            "enabled": Value(True, "false: helm creates the RayJobs at once, unordered (as in jobs/).", _BOOL),
            "image": Value({"repository": "", "tag": ""}, "Overrides images.families.driver.", _ref("image")),
            "pollSeconds": Value(15, "Seconds between status checks.", _POS),
            "stageTimeoutSeconds": Value(0, "Fail a stage after this long (0: the RayJob's own deadline).", _NONNEG),
            "backoffLimit": Value(3, "Retries of the driver pod (a new pod resumes the run).", _NONNEG),
            "resources": Value(resources("200m", "512Mi", cpu_limit="1"), "Driver pod resources.", _ref("resources")),
            "serviceAccount": Group("Its ServiceAccount (a Role allows get/create/delete on rayjobs only).", {
                "create": Value(True, "Create it.", _BOOL),
                "name": Value("", "Name ('' = <fullname>-driver, or 'default' when not created).",
                              NAME_OR_EMPTY)})}),
        "submitter": Group("KubeRay's submitter pod of each RayJob (`ray job submit`, in the head's image).", {
            "resources": Value(resources("500m", "1Gi"), "Its resources.", _ref("resources"))}),
        "networkPolicy": Group("Optional NetworkPolicy for all pods of the release: ingress from the release's pods "
                               "and (dashboard port) the KubeRay operator; egress to the release, DNS and `egress`.", {
            "enabled": Value(False, "Create it.", _BOOL),
            "operatorNamespaceLabels": Value({"kubernetes.io/metadata.name": "kuberay-system"},
                                             "Labels of the KubeRay operator's namespace.",
                                             {"type": "object", "additionalProperties": _STR}),
            "extraIngress": Value([], "More ingress rules.", {"type": "array", "items": {"type": "object"}}),
            "egress": Value([{}], "Egress rules ([{}]: anywhere; narrow it to your S3/LLM endpoints).",
                            {"type": "array", "items": {"type": "object"}})}),
        "profiles": Group("Head/worker pod sizes per stage family; a stage's own head/workers override them key by "
                          "key.", {f: profile_group(f, infos) for f in sorted({i.family for i in infos})},
                          required=sorted({i.family for i in infos})),
        "common": Group("Settings of every step's RayJob; a section's block (stages.<name>) overrides each of them.", {
            "activeDeadlineSeconds": Value(86400, "Seconds a RayJob may run.", _POS),
            "backoffLimit": Value(0, "Re-runs of a failed RayJob's submitter.", _NONNEG),
            "ttlSecondsAfterFinished": Value(600, "Seconds a finished RayJob's cluster is kept.", _NONNEG),
            "shutdownAfterJobFinishes": Value(True, "Delete the Ray cluster when the job ends.", _BOOL),
            "workers": Group("Worker group (its size comes from the stage: GPUs per worker, multi-node capacity).", {
                "idleTimeoutSeconds": Value(600, "Autoscaled groups: seconds before an idle worker is removed.",
                                            _NONNEG)})}),
        "multiNode": Group("Stages that span GPU nodes (config nnodes / n_gpus_per_node: their worker group "
                           "autoscales from 0); over `common`, under the stage's block.", {
            "activeDeadlineSeconds": Value(7 * 86400, "Seconds a RayJob may run.", _POS),
            "backoffLimit": Value(3, "Re-runs after preemption or failure (training resumes from its S3 "
                                     "checkpoints).", _NONNEG),
            "capacityTimeoutSeconds": Value(1800, "How long the entrypoint waits for the GPU nodes "
                                                  "(`memsifter k8s await-capacity`).", _POS)}),
        "serve": serve_group([f for f in families if f != "driver"]),
        "pipeline": Group("What runs: the plan `memsifter k8s plan --config pipeline.yaml` makes from a pipeline config "
                          "(the one `memsifter pipeline run` takes: sections, `uses:` instances, inputs naming a "
                          "section), written with `-o plan.yaml` and given with `-f plan.yaml`. The chart deploys it as "
                          "it is: one config ConfigMap and RayJob per step, created in this order.", {
            "run": Value("", "The run root every output is under (s3://bucket/prefix).",
                         {"type": "string", "pattern": "^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\\s]*)?)?$",
                          "maxLength": 1024}),
            "steps": Value([], "The plan's steps in order: {name (the section), stage (what it runs), config (its "
                               "config: what the section sets, plus output and the wired inputs)}.",
                           {"type": "array", "items": _ref("step")})}),
        "stages": Value({}, "Kubernetes settings of a section of the plan (keys: section names, e.g. rank or an "
                            "instance rank-trained), over common/multiNode/profiles: " + ", ".join(STAGE_KEYS) + ".",
                        {"type": "object", "propertyNames": {"pattern": "^" + INSTANCE_NAME.pattern + "$"},
                         "additionalProperties": _ref("stage")}),
    }


def _secret(*keys: str) -> dict:
    def prop(k: str) -> dict:
        return _BOOL if k == "optional" else ENV_NAME_SCHEMA if k == "envName" else SECRET_KEY_SCHEMA

    return {"type": "object", "additionalProperties": False,
            "required": ["name", *[k for k in keys if k != "optional"]],
            "properties": {"name": NAME, **{k: prop(k) for k in keys}}}


# Keys of a section's block, stages.<name> (schema $defs/stage).
STAGE_KEYS: dict[str, str] = {
    "image": "{repository, tag}: overrides the family image.",
    "env": "Extra env vars of the stage's Ray containers.",
    "runtimeEnv": "Extra Ray runtime_env (runtimeEnvYAML); env_vars are merged.",
    "head": "Head pod: resources (merged over the profile), shmSize, rayStartParams, nodeSelector, tolerations, "
            "affinity (default: cpuPool's).",
    "workers": "Worker group: the head's keys plus replicas, minReplicas, maxReplicas, autoscaling, gpus, "
               "idleTimeoutSeconds (scheduling default: gpuPool's when gpus > 0).",
    "activeDeadlineSeconds": "As in common / multiNode.",
    "backoffLimit": "As in common / multiNode.",
    "ttlSecondsAfterFinished": "As in common.",
    "shutdownAfterJobFinishes": "As in common.",
    "capacityTimeoutSeconds": "As in multiNode (multi-node stages only).",
}


def walk(tree: dict[str, Value | Group], prefix: str = "") -> Iterator[tuple[str, Value]]:
    """(dotted key, value) of every leaf."""
    for k, node in tree.items():
        if isinstance(node, Group):
            yield from walk(node.items, f"{prefix}{k}.")
        else:
            yield prefix + k, node


def defaults(tree: dict[str, Value | Group]) -> dict:
    return {k: defaults(n.items) if isinstance(n, Group) else n.default for k, n in tree.items()}


# --------------------------------------------------------------------------- facts
def stage_facts(infos: list[StageInfo]) -> dict:
    """files/stages.json: what the templates know about each stage (code, not settings)."""
    out = {}
    for i in infos:
        cap = None
        if i.capacity:
            cap = {**i.capacity, "defaultNodes": i.capacity_defaults["nodes"],
                   "defaultGpusPerNode": i.capacity_defaults["gpusPerNode"]}
        out[i.name] = {"family": i.family, "gpus": i.gpus, "capacity": cap, "help": i.help}
        serve_url = serve_url_field(i.config)
        if serve_url:
            out[i.name]["serveUrl"] = serve_url
    return out


def serve_url_field(config: Any) -> str | None:
    """The config field a stage reads the memory service's base URL from (marked ``serve_url`` in its
    ``json_schema_extra``, e.g. the agents stage's ``search_url``): with ``serve.enabled`` the chart fills
    it with the RayService's URL where the stage's config leaves it out (``memsifter.stageConfig``)."""
    for name, f in config.model_fields.items():
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("serve_url"):
            return name
    return None


# --------------------------------------------------------------------------- values.yaml
def _comment(text: str, indent: int, first: str = "# -- ") -> str:
    pad = " " * indent
    lines = textwrap.wrap(text, WIDTH - indent - len(first)) or [""]
    return "".join(f"{pad}{first if n == 0 else '# '}{line}\n" for n, line in enumerate(lines))


def _dump(key: str, value: Any, indent: int) -> str:
    """``key: value``: scalars plain, collections of scalars in flow style, deeper ones as blocks of those."""
    leaf = not isinstance(value, (dict, list)) or \
        not any(isinstance(v, (dict, list)) for v in (value.values() if isinstance(value, dict) else value))
    text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=True if leaf else None,
                          width=WIDTH - indent, allow_unicode=True)
    if leaf:
        text = text.strip()[1:-1] + "\n"  # the outer {key: value}'s braces
    pad = " " * indent
    return "".join(pad + line for line in text.splitlines(True))


def _tree_text(tree: dict[str, Value | Group], indent: int) -> str:
    out = []
    for k, node in tree.items():
        out.append(_comment(node.doc, indent))
        if isinstance(node, Group):
            out.append(" " * indent + f"{k}:\n" + _tree_text(node.items, indent + 2))
        else:
            out.append(_dump(k, node.default, indent))
        if indent == 0:
            out.append("\n")
    return "".join(out)


def stage_summary(info: StageInfo) -> str:
    gpus = (f"{info.capacity_defaults['gpusPerNode']} GPUs per node, config.{info.capacity['nodes']} nodes"
            if info.capacity else f"{info.gpus} GPU worker" if info.gpus else "no GPUs")
    return f"family {info.family}, {gpus}; needs: {', '.join(info.needs) or '-'}"


def values_text(infos: list[StageInfo], header: str) -> str:
    return "".join([header, "# Values of the memsifter chart (helm show readme: every value, every stage's config "
                    "fields).\n", "# Validated by values.schema.json: unknown keys fail.\n\n",
                    _tree_text(global_tree(infos), 0)]).rstrip("\n") + "\n"


# --------------------------------------------------------------------------- README.md
def _md(v: Any) -> str:
    text = json.dumps(v, separators=(", ", ": ")) if not isinstance(v, str) else json.dumps(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return "`" + text.replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _config_rows(cls: Any, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(field, default, description) of a pydantic model, nested models one level down."""
    import typing

    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined, to_jsonable_python

    for name, f in cls.model_fields.items():
        if name == "output" and not prefix:
            continue
        sub = next((a for a in (f.annotation, *typing.get_args(f.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if f.is_required():
            default = "required"
        else:
            raw = f.get_default(call_default_factory=True)
            default = "" if raw is PydanticUndefined else _md(to_jsonable_python(raw))
        if sub is not None and not prefix:
            yield prefix + name, "" if default != "`null`" else default, _cell(f.description or "")
            yield from _config_rows(sub, f"{prefix}{name}.")
        else:
            yield prefix + name, default, _cell(f.description or "")


def wired_inputs(info: StageInfo) -> list[tuple[str, str]]:
    """(field, its producers) of the inputs a plan fills from another stage: ``a+b`` when it reads every one
    that runs (``wire="all"``), ``a or b`` when the first one that runs."""
    from memsifter import stage as stg

    return [(i.field, ("+" if i.wire == "all" else " or ").join(p for p in i.stages if p in info.needs))
            for i in stg.get_stage(info.name).inputs if i.field in info.wired]


def readme_text(infos: list[StageInfo], chart_meta: dict, header: str) -> str:
    facts = stage_facts(infos)
    intro = (f"# memsifter chart\n\n{_cell(chart_meta.get('description', ''))}\n\n"
             f"Chart {chart_meta.get('version')}, app {chart_meta.get('appVersion')}; needs "
             f"{chart_meta.get('annotations', {}).get('memsifter.io/requires', 'the KubeRay operator')}. "
             "Cluster prerequisites, install, progress, results, resume: "
             "[k8s/README.md](https://github.com/memsifter/memsifter/blob/main/k8s/README.md).\n\n"
             "```sh\nhelm install lme charts/memsifter -n memsifter -f my-run.yaml   # see ci/*.yaml for scenarios\n```\n\n"
             "## What runs: the plan of a pipeline config\n\n"
             "- The chart runs what `memsifter pipeline run` runs. Write the pipeline config (sections, `uses:` "
             "instances such as `rank-trained: {uses: rank}`, inputs naming a section; `memsifter pipeline schema`) "
             "and make its plan: `memsifter k8s plan --config pipeline.yaml --run s3://<bucket>/<prefix> -o "
             "plan.yaml`. That is `memsifter.pipeline.plan`, computed once: the value `pipeline` holds its run root "
             "and its steps in order, each with the config the plan gives it (what the section sets, plus `output` "
             "and the inputs wired from the other sections). Nothing is wired in the templates.\n"
             "- Each step's config travels as one file: a ConfigMap per step (named like its RayJob) mounted into "
             "the head pod at `/etc/memsifter/<section>.yaml`; the entrypoint is `memsifter run <stage> --config "
             "/etc/memsifter/<section>.yaml` (behind `memsifter k8s await-capacity` for multi-node stages). The "
             "driver creates the RayJobs in the plan's order; with `driver.enabled=false` helm creates them at once.\n"
             "- Pod sizes: `profiles.<family>` (head and workers), then the section's own `stages.<section>.head`/"
             "`workers`; other RayJob settings: `common`, then `multiNode` for stages that span GPU nodes, then the "
             "section's block. Worker group sizes come from the stage (GPUs per worker; `nnodes`/`n_gpus_per_node` "
             "of multi-node stages).\n"
             "- Facts that are code (family, GPUs, capacity fields) are not values: `files/stages.json`, generated "
             "with `values.yaml`, `values.schema.json`, `ci/` and this README by `memsifter k8s gen-chart` from the "
             "stage registry.\n\n")
    out = [header, intro, "## Values\n\n| Key | Default | Description |\n| --- | --- | --- |\n"]
    for key, v in walk(global_tree(infos)):
        out.append(f"| `{key}` | {_md(v.default)} | {_cell(v.doc)} |\n")
    for k, doc in STAGE_KEYS.items():
        out.append(f"| `stages.<name>.{k}` | | {_cell(doc)} |\n")
    out.append("\n## Stages\n\n| Stage | Family | GPUs per worker | Needs | Inputs a plan wires | "
               "Required |\n| --- | --- | --- | --- | --- | --- |\n")
    for i in infos:
        f = facts[i.name]
        wired = ", ".join(f"`{k}` ← {producers}" for k, producers in wired_inputs(i))
        if f.get("serveUrl"):
            wired += (", " if wired else "") + f"`{f['serveUrl']}` ← the RayService's URL (serve.enabled)"
        gpus = f"{i.capacity_defaults['gpusPerNode']} × `{i.capacity['nodes']}` nodes" if i.capacity else str(i.gpus)
        out.append(f"| `{i.name}` | {i.family} | {gpus} | {', '.join(i.needs) or '-'} | {wired or '-'} | "
                   f"{', '.join(f'`{r}`' for r in i.required_user_fields) or '-'} |\n")
    out.append("\n## Stage configs\n\nEvery field of a pipeline config's section of the stage, with its default "
               "(`memsifter run <name> --help`, `--schema`).\n")
    for i in infos:
        out.append(f"\n### {i.name}\n\n{_cell(i.help)}\n\n| Field | Default | Description |\n| --- | --- | --- |\n")
        for name, default, desc in _config_rows(i.config):
            out.append(f"| `{name}` | {default} | {desc} |\n")
    from memsifter.service.config import ServeConfig

    from .serve import DEFAULT_KEY, INDEX_STAGE, READINESS_PATH, STATE_PREFIX

    out.append("\n## The memory service (`serve`)\n\n`serve.enabled` renders a KubeRay RayService (templates/"
               "rayservice.yaml): one Ray Serve application whose args are `serve.config` (only what differs from "
               "the defaults below, `memsifter serve --help`); a head, a CPU worker group and, when `config.ranker` "
               "asks for GPUs, a GPU worker group, Ray-autoscaled. KubeRay's Service `<fullname>-serve-svc` listens "
               "on 8000 (`kubectl port-forward`, or `serve.ingress`).\n\nOut of the box (`--set serve.enabled=true` "
               f"and nothing else; NOTES.txt prints the commands):\n\n- `index`: the output of the plan's {INDEX_STAGE} "
               "step, else `<run root>/embed` (a plan with two asks to set it): the head's init container "
               "(`memsifter k8s await-published`) holds the cluster until its `_SUCCESS` exists, so the service "
               f"starts once the {INDEX_STAGE} stage publishes (`serve.waitForIndex`).\n"
               f"- `state` (the memory API's store): `s3://<bucket>/{STATE_PREFIX}/<RayService name>`.\n"
               f"- Keys: `serve.apiKeys.keys` empty means one, `{DEFAULT_KEY['env']}` from key "
               f"`{DEFAULT_KEY['secretKey']}` of Secret `serve.apiKeys.secretName` (create it: `kubectl create secret "
               f"generic memsifter-serve-keys --from-literal={DEFAULT_KEY['secretKey']}=...`), granted read and write "
               "on every id unless `config.auth` names grants; no anonymous access.\n"
               f"- Readiness: a worker pod is ready when `GET {READINESS_PATH}` answers 200 (index, encoder and unit "
               "vectors loaded); the head stays out of the Service (`excludeHeadPodFromServeSvc`).\n\n"
               "### serve.config\n\n| Field | Default | Description |\n| --- | --- | --- |\n")
    for name, default, desc in _config_rows(ServeConfig):
        out.append(f"| `{name}` | {default} | {desc} |\n")
    return "".join(out)
