"""The memory retrieval service (``memsifter serve``) in the chart: the ``serve`` values, ``files/serve.json``
and the examples of ``ci/serve.yaml`` and ``jobs/serve.yaml``.

``templates/rayservice.yaml`` renders, with ``serve.enabled``, one KubeRay RayService: ``serveConfigV2`` holds
one Serve application (``import_path`` the service's application builder, ``args`` a
:class:`memsifter.service.config.ServeConfig` mapping: ``serve.config`` plus the wired ``index``) and the
autoscaling and actor options of its deployments, read from the same config; ``rayClusterConfig`` a head, a CPU
worker group (the first stage and the HTTP ingress) and, when the ranker asks for GPUs, a GPU worker group,
with the RayJobs' pod conventions (``memsifter.podTemplate``).

What the templates cannot compute is written here at gen time into ``files/serve.json`` (:func:`serve_facts`):
the application's name, builder and deployment names (read from :mod:`memsifter.service.app`), the config
defaults the deployment options fall back to (from the pydantic models), and the stage whose output is the
``index`` when ``serve.config`` leaves it out (``indexStage``): the template takes the output the plan gives
that stage's step (``pipeline.steps``), else ``<run root>/embed`` (a later run publishes it; the head waits).
"""

from __future__ import annotations

from typing import Any

from .values import NAME, SECRET_KEY_SCHEMA, Group, Value, resources

# The stage whose publication the service loads (memsifter.service.index reads an embed stage's output:
# its _SUCCESS, config and vector store).
INDEX_STAGE = "embed"
UPGRADE_TYPES = ["auto", "NewCluster", "NewClusterWithIncrementalUpgrade", "None"]
# Fields of ServeConfig / RankerSettings the template reads to write the deployments' options.
FIRST_STAGE_FIELDS = ("num_cpus", "min_replicas", "max_replicas", "target_ongoing_requests")
RANKER_FIELDS = ("num_cpus", "num_gpus", "min_replicas", "max_replicas", "max_batch_size")
EXAMPLE_KEY = {"MEMSIFTER_KEY_TRAINER": "trainer"}
# Out of the box (issue 46 item 4): with no apiKeys.keys, one key, this variable from the Secret's key, granted
# read and write on every id unless config.auth names its own grants; the memory state under this prefix of the
# release's bucket (s3://<bucket>/<prefix>/<RayService name>) unless config.state is set.
DEFAULT_KEY = {"env": "MEMSIFTER_API_KEY", "secretKey": "api-key"}
STATE_PREFIX = "serve-state"
# The service's readiness route: 200 once the index, the encoder and the unit vectors are loaded, else 503
# (memsifter.service.http); the worker pods' readiness probe, so that <name>-serve-svc sends a request only
# to pods of a service that answers it at once.
READINESS_PATH = "/readyz"


def serve_facts() -> dict:
    """files/serve.json: what the RayService template knows about the service (code, not settings)."""
    from memsifter.service import app
    from memsifter.service.config import RankerSettings, ServeConfig

    def defaults(cls: Any, names: tuple[str, ...]) -> dict:
        return {n: cls.model_fields[n].get_default(call_default_factory=True) for n in names}

    return {"application": {"name": app.APP_NAME, "importPath": f"{app.build_app.__module__}:{app.build_app.__name__}",
                            "firstStage": app.FirstStageDeployment.name, "ranker": app.RankerDeployment.name},
            "defaultKey": DEFAULT_KEY, "statePrefix": STATE_PREFIX, "readinessPath": READINESS_PATH,
            "defaults": defaults(ServeConfig, FIRST_STAGE_FIELDS),
            "rankerDefaults": defaults(RankerSettings, RANKER_FIELDS),
            "indexStage": INDEX_STAGE}


# --------------------------------------------------------------------------- values
def _group_schema(*extra: str) -> dict:
    nonneg = {"type": "integer", "minimum": 0}
    props: dict[str, Any] = {"resources": {"$ref": "#/$defs/resources"}, "shmSize": {"$ref": "#/$defs/size"},
                             "rayStartParams": {"$ref": "#/$defs/rayStartParams"},
                             "nodeSelector": {"$ref": "#/$defs/nodeSelector"},
                             "tolerations": {"$ref": "#/$defs/tolerations"}, "affinity": {"type": "object"}}
    props.update({k: {"type": "integer", "minimum": 1} if k == "gpus" else nonneg for k in extra})
    return {"type": "object", "additionalProperties": False, "properties": props}


def serve_group(families: list[str]) -> Group:
    """The ``serve`` block of values.yaml (and of the schema and README, like every global value)."""
    fam = {"enum": families}
    return Group(
        "The memory retrieval service (`memsifter serve`: Search-R1's POST /retrieve, the memory API) as a KubeRay "
        "RayService named <fullname>; KubeRay's Service <fullname>-serve-svc:8000 reaches it (NOTES.txt).", {
            "enabled": Value(False, "Create the RayService; stages that search it (agents: search_url) get its URL.",
                             {"type": "boolean"}),
            "config": Value({}, "The service's config (ServeConfig, `memsifter serve --help`; README: serve.config): only "
                            "what differs from its defaults; its deployments' replicas, CPUs and GPUs come from it. "
                            f"Defaults: index, this run's {INDEX_STAGE} output; state, s3://<bucket>/{STATE_PREFIX}/"
                            "<name>; auth.keys, read and write '*' for each apiKeys variable. host/port: 0.0.0.0:8000.",
                            {"$ref": "#/$defs/serve__config"}),
            "apiKeys": Group("API keys by reference, never in values: each is an env var of the Ray containers from "
                             "a Secret (secretKeyRef); config.auth.keys grants each variable it names.", {
                "secretName": Value("memsifter-serve-keys", "The Secret holding the keys.", NAME),
                "keys": Value({}, "ENV_NAME: key in the Secret, e.g. {MEMSIFTER_KEY_TRAINER: trainer}; {}: "
                              f"{{{DEFAULT_KEY['env']}: {DEFAULT_KEY['secretKey']}}}.",
                              {"type": "object", "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                               "additionalProperties": SECRET_KEY_SCHEMA})}),
            "families": Value({"cpu": "embed", "gpu": "rank"}, "Image family of the head and CPU workers (first "
                              "stage: BM25, the embed encoder) and of GPU workers (the ranker: vLLM).",
                              {"type": "object", "additionalProperties": False, "required": ["cpu", "gpu"],
                               "properties": {"cpu": fam, "gpu": fam}}),
            "image": Value({"repository": "", "tag": ""}, "One image for every pod instead (with both families' "
                           "extras).", {"$ref": "#/$defs/image"}),
            "head": Value({"resources": resources("2", "8Gi"), "shmSize": "2Gi", "rayStartParams": {"num-cpus": "0"}},
                          "Head pod (Serve's controller and a proxy; num-cpus 0 keeps replicas on workers).",
                          _group_schema()),
            "cpuWorkers": Value({"resources": resources("4", "16Gi"), "shmSize": "2Gi", "minReplicas": 1,
                                 "maxReplicas": 4}, "CPU worker group: first-stage replicas (each holds the whole "
                                "index); Ray's autoscaler keeps it within min/maxReplicas.",
                                _group_schema("minReplicas", "maxReplicas")),
            "gpuWorkers": Value({"resources": resources("8", "48Gi"), "shmSize": "8Gi", "gpus": 1, "minReplicas": 1,
                                 "maxReplicas": 2}, "GPU worker group, when config.ranker asks for GPUs (num_gpus > "
                                "0): gpus per pod (a Ranker replica must fit one), min/maxReplicas.",
                                _group_schema("gpus", "minReplicas", "maxReplicas")),
            "waitForIndex": Value({"enabled": True, "pollSeconds": 15}, "The head waits for the index's _SUCCESS "
                                  "(init container).",
                                  {"type": "object", "additionalProperties": False, "properties": {
                                      "enabled": {"type": "boolean"},
                                      "pollSeconds": {"type": "integer", "minimum": 1, "maximum": 3600}}}),
            "ingress": Value({"enabled": False, "className": "", "host": "", "path": "/"}, "An Ingress to the "
                             "service; also annotations, tls: [{secretName, hosts}].",
                             {"type": "object", "additionalProperties": False, "properties": {
                                 "enabled": {"type": "boolean"},
                                 "className": {"type": "string", "pattern": "^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
                                               "maxLength": 253},
                                 "host": {"type": "string", "maxLength": 253,
                                          "pattern": "^((\\*\\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$"},
                                 "path": {"type": "string", "pattern": "^/[-._~/A-Za-z0-9]*$", "maxLength": 200},
                                 "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                                 "tls": {"type": "array", "items": {
                                     "type": "object", "additionalProperties": False, "required": ["secretName"],
                                     "properties": {"secretName": NAME,
                                                    "hosts": {"type": "array", "items": {"type": "string"}}}}}}}),
            "upgradeStrategy": Value("auto", "How a change of the cluster spec is rolled out. NewCluster: a second "
                                     "cluster takes over when ready (zero downtime; needs room for two clusters). "
                                     "NewClusterWithIncrementalUpgrade: traffic moves step by step (needs the Gateway "
                                     "API: incrementalUpgrade). None: not applied to the running cluster (serve.config "
                                     "changes still are, in place). auto: NewCluster when gpuPool holds two "
                                     "clusters' GPU workers (2 x gpuWorkers.maxReplicas), else None.",
                                     {"enum": UPGRADE_TYPES}),
            "gpuPool": Value({"nodes": 0, "gpusPerNode": 1}, "The GPU nodes the service may use, for auto: room = "
                             "nodes x floor(gpusPerNode / gpuWorkers.gpus) GPU workers (0 nodes: unknown).",
                             {"type": "object", "additionalProperties": False, "properties": {
                                 "nodes": {"type": "integer", "minimum": 0},
                                 "gpusPerNode": {"type": "integer", "minimum": 1}}}),
            "incrementalUpgrade": Value({"gatewayClassName": "", "stepSizePercent": 25, "intervalSeconds": 60,
                                         "maxSurgePercent": 100}, "clusterUpgradeOptions of "
                                        "NewClusterWithIncrementalUpgrade (gatewayClassName: a Gateway API class).",
                                        {"type": "object", "additionalProperties": False, "properties": {
                                            "gatewayClassName": {"type": "string"},
                                            "stepSizePercent": {"type": "integer", "minimum": 0, "maximum": 100},
                                            "intervalSeconds": {"type": "integer", "minimum": 1},
                                            "maxSurgePercent": {"type": "integer", "minimum": 0, "maximum": 100}}}),
        })


# --------------------------------------------------------------------------- examples
def scenario_serve(bucket: str) -> dict:
    """ci/serve.yaml's ``serve`` block: the service over the scenario's embed output, with the ranker on GPUs,
    a memory store and one key; a GPU pool that holds two clusters (upgradeStrategy auto: NewCluster)."""
    return {"enabled": True,
            "config": {"state": f"s3://{bucket}/serve-state", "max_replicas": 4,
                       "auth": {"keys": {"MEMSIFTER_KEY_CI": {"read": ["*"], "write": ["*"]}}},
                       "ranker": {"max_replicas": 2}},
            "apiKeys": {"keys": {"MEMSIFTER_KEY_CI": "ci"}},
            "gpuPool": {"nodes": 4, "gpusPerNode": 1}}


def jobs_serve() -> dict:
    """jobs/values.yaml's ``serve`` block (enabled on the command line): first stage only, one key."""
    return {"config": {"auth": {"keys": {name: {"read": ["*"]} for name in EXAMPLE_KEY}}},
            "apiKeys": {"secretName": "memsifter-serve-keys", "keys": dict(EXAMPLE_KEY)}}
