"""The memory retrieval service on Kubernetes (issue 32, item 4): the chart's RayService (``serve.enabled``).

Rendered with the real helm binary and checked against what KubeRay and Ray Serve themselves accept:

* the RayService passes the KubeRay v1.7.0 CRD schema (``../shared/crds/ray.io_rayservices.yaml``) with unknown
  fields rejected, its CEL rules and KubeRay's RayService admission rules (:func:`validate.validate_rayservice`);
* ``serveConfigV2`` parses as Ray Serve's own deploy schema; its one application's ``args`` validate as a
  :class:`memsifter.service.config.ServeConfig`, and its deployments' autoscaling and actor options are the ones
  ``memsifter.service.app`` derives from the same args (the builder run here, nothing deployed);
* ``index`` is the output the plan (``memsifter k8s plan``) gives its embed step, else ``<run root>/embed``;
* API keys only by reference (``secretKeyRef``): no env var of a key has a value, a grant naming a variable the
  chart does not set fails the install;
* ``upgradeStrategy: auto`` picks NewCluster only where the GPU pool holds two clusters' GPU workers;
* Ray's own KubeRay autoscaler code turns the cluster spec into node types on which the deployments' replicas fit;
* ``jobs/serve.yaml`` is up to date (``gen-jobs --check``) and valid; the ci/ scenario wires the index.
"""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from memsifter.k8s import validate
from memsifter.k8s.plan import chart_plan
from memsifter_dev.k8s import chart
from memsifter_dev.k8s.serve import DEFAULT_KEY, READINESS_PATH, STATE_PREFIX
from memsifter_dev.k8s.tools import ToolError, helm

CHART = chart.CHART_DIR
SCENARIO = CHART / "ci" / "serve.yaml"
JOB = chart.JOBS_DIR / "serve.yaml"
KEYS = {"MEMSIFTER_KEY_TRAINER": "trainer", "MEMSIFTER_KEY_APP": "app"}


@pytest.fixture(scope="module")
def crd(shared_dir):
    return validate.crd_schema(shared_dir / "crds" / "ray.io_rayservices.yaml")


def base_values(embed: dict | None = None, **serve) -> dict:
    """A plan of synth -> embed (``embed``: its section) with the service on (no ranker unless given)."""
    return {"run": {"id": "t"}, "s3": {"bucket": "memsifter-ci"},
            "pipeline": chart_plan({"run": "s3://memsifter-ci/runs/t", "stages": {"synth": {}, "embed": embed or {}}}),
            "serve": {"enabled": True, **serve}}


def rayservice(values: dict | None = None, files: list | None = None, sets: list[str] | None = None) -> dict:
    docs = chart.render_docs(files or [], sets, values=values, show_only="templates/rayservice.yaml")
    (rs,) = docs
    assert rs["kind"] == "RayService"
    return rs


def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def app_of(rs: dict) -> dict:
    (app,) = serve_config(rs)["applications"]
    return app


def containers(rs: dict) -> list[dict]:
    rcc = rs["spec"]["rayClusterConfig"]
    groups = [rcc["headGroupSpec"], *rcc.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


# --------------------------------------------------------------------------- the RayService is valid
@pytest.mark.parametrize("source", ["ci/serve.yaml", "jobs/serve.yaml", "no ranker"])
def test_rayservice_valid_against_crd_cel_and_kuberay(source, crd):
    if source == "ci/serve.yaml":
        rs = rayservice(files=[SCENARIO])
    elif source == "jobs/serve.yaml":
        (rs,) = [d for d in yaml.safe_load_all(JOB.read_text()) if d]
    else:
        rs = rayservice(base_values())
    assert rs["apiVersion"] == "ray.io/v1"
    assert validate.validate_rayservice(rs, crd) == []


@pytest.mark.parametrize("change,expect", [
    (lambda r: r["spec"].update(serveConfigV3="x"), "serveConfigV3"),
    (lambda r: r["spec"]["rayClusterConfig"]["headGroupSpec"].update(rayStartParamz={}), "rayStartParamz"),
    (lambda r: r["spec"].update(upgradeStrategy={"type": "Rolling"}), "Spec.UpgradeStrategy.Type value Rolling"),
    (lambda r: r["spec"].update(upgradeStrategy={"type": "NewClusterWithIncrementalUpgrade"}),
     "ClusterUpgradeOptions are required"),
    (lambda r: r["metadata"].update(name="s" * 48), "no more than 47"),
    (lambda r: r["spec"].update(serveConfigV2="applications: [unclosed"), "serveConfigV2 is not valid YAML"),
    (lambda r: r["spec"]["rayClusterConfig"].update(managedBy="someone/else"), "managedBy field value must be"),
])
def test_rayservice_checks_reject(change, expect, crd):
    rs = rayservice(files=[SCENARIO])
    bad = copy.deepcopy(rs)
    change(bad)
    errs = validate.validate_rayservice(bad, crd)
    assert any(expect in e for e in errs), errs


def test_pods_hardened_like_the_rayjobs():
    """The service's pods follow the RayJobs' conventions: non-root, read-only root, no capabilities, every
    writable path on an emptyDir, /dev/shm sized, the autoscaler's token only on the head."""
    rs = rayservice(files=[SCENARIO])
    pods = [d for d in validate.workload_manifests([rs]) if d["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == ["memsifter-head", "memsifter-cpu-worker", "memsifter-gpu-worker"]
    for p in pods:
        spec = p["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        head = p["metadata"]["name"].endswith("-head")
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["allowPrivilegeEscalation"] is False
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}
        assert spec["automountServiceAccountToken"] is head
        ray = spec["containers"][0]
        assert {"containerPort": 8000, "name": "serve", "protocol": "TCP"} in ray["ports"]
        if head:   # KubeRay's probes (raylet, GCS): it deploys the application only once the head is ready
            assert "readinessProbe" not in ray
            assert [c["name"] for c in spec["initContainers"]] == ["wait-for-index"]
        else:      # ready = the service's readiness route answers 200 (index, encoder, unit vectors loaded)
            assert ray["readinessProbe"]["httpGet"] == {"path": READINESS_PATH, "port": 8000}
            assert "initContainers" not in spec


# --------------------------------------------------------------------------- serveConfigV2
def _code_options(args: dict) -> dict:
    """Deployment name -> (autoscaling (min, max, target), ray_actor_options) as memsifter.service.app builds them."""
    from memsifter.service.app import build_app

    out = {}
    todo = [build_app(args)]
    while todo:
        d = todo.pop()._bound_deployment
        cfg = d._deployment_config
        if cfg.autoscaling_config is not None:
            a = cfg.autoscaling_config
            scale = (a.min_replicas, a.max_replicas, a.target_ongoing_requests)
        else:
            scale = (cfg.num_replicas, cfg.num_replicas, None)
        out[d.name] = (scale, dict(d.ray_actor_options or {}))
        todo += [a for a in d.init_args if hasattr(a, "_bound_deployment")]
    return out


@pytest.mark.parametrize("source", ["ci/serve.yaml", "no ranker", "scaled"])
def test_serve_config_parses_and_matches_the_application(source):
    from ray.serve.schema import ServeDeploySchema

    from memsifter.service.config import ServeConfig

    if source == "ci/serve.yaml":
        rs = rayservice(files=[SCENARIO])
    elif source == "no ranker":
        rs = rayservice(base_values())
    else:
        rs = rayservice(base_values(config={"num_cpus": 2, "min_replicas": 2, "max_replicas": 6,
                                            "target_ongoing_requests": 8,
                                            "ranker": {"num_gpus": 0.5, "min_replicas": 0, "max_replicas": 3,
                                                       "max_batch_size": 4}},
                                    gpuWorkers={"maxReplicas": 2}))
    sc = serve_config(rs)
    ServeDeploySchema.model_validate(sc)       # Ray Serve's own schema of a deploy config
    app = app_of(rs)
    assert (app["import_path"], app["route_prefix"]) == ("memsifter.service.app:build_app", "/")
    cfg = ServeConfig.model_validate(app["args"])
    assert cfg.host == "0.0.0.0" and cfg.port == 8000      # what the Serve proxy of the RayService listens on
    code = _code_options(app["args"])
    deps = {d["name"]: d for d in app["deployments"]}
    assert set(deps) == set(code) == ({"FirstStage", "Ranker"} if cfg.ranker else {"FirstStage"})
    for name, d in deps.items():
        (lo, hi, target), actor = code[name]
        a = d["autoscaling_config"]
        assert (a["min_replicas"], a["max_replicas"]) == (lo, hi), name
        if target is not None:
            assert a["target_ongoing_requests"] == target, name
        assert d["ray_actor_options"] == actor, name
    assert "num_gpus" not in deps["FirstStage"]["ray_actor_options"]
    groups = [g["groupName"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    gpus = bool(cfg.ranker and cfg.ranker.num_gpus > 0)
    assert groups == (["cpu", "gpu"] if gpus else ["cpu"])


def test_replicas_fit_the_node_types_rays_autoscaler_derives():
    """Ray's own KubeRay code turns the cluster spec into autoscaler node types: the head takes no replica
    (num-cpus 0), a FirstStage replica fits a CPU worker, a Ranker replica a GPU worker, and the worker groups
    can hold every replica at the deployments' maxima."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    rs = rayservice(files=[SCENARIO])
    auto = _derive_autoscaling_config_from_ray_cr({"metadata": {"name": "c", "namespace": "ns"},
                                                   "spec": rs["spec"]["rayClusterConfig"]})
    types = auto["available_node_types"]
    assert types["headgroup"]["resources"].get("CPU", 0) == 0
    deps = {d["name"]: d for d in app_of(rs)["deployments"]}
    for name, group, res in [("FirstStage", "cpu", "num_cpus"), ("Ranker", "gpu", "num_gpus")]:
        per = deps[name]["ray_actor_options"][res]
        have = types[group]["resources"]["CPU" if res == "num_cpus" else "GPU"]
        assert 0 < per <= have, (name, per, have)
        assert deps[name]["autoscaling_config"]["max_replicas"] * per <= have * types[group]["max_workers"], name
    assert types["gpu"]["resources"]["GPU"] >= 1 and not types["cpu"]["resources"].get("GPU")


# --------------------------------------------------------------------------- index wiring
@pytest.mark.parametrize("case", ["default", "embed output set", "index set"])
def test_index_wired_from_the_embed_output_as_the_plan_wires_it(case):
    values = base_values({"output": "s3://memsifter-ci/elsewhere/embed"} if case == "embed output set" else None)
    if case == "index set":
        values["serve"]["config"] = {"index": "s3://memsifter-ci/runs/older/embed"}
    args = app_of(rayservice(values))["args"]
    embed = next(s for s in values["pipeline"]["steps"] if s["stage"] == "embed")["config"]
    want = values["serve"].get("config", {}).get("index") or embed["output"]
    assert args["index"] == want
    if case == "default":
        assert want == "s3://memsifter-ci/runs/t/embed"


def test_index_defaults_to_this_runs_embed_output_without_the_stage():
    """serve.enabled alone serves this run's embed output (the head waits for it: the service starts once the
    embed stage publishes) instead of failing the install; a given index is served as it is."""
    rs = rayservice({"serve": {"enabled": True}})
    assert app_of(rs)["args"]["index"] == "s3://memsifter/runs/memsifter/embed"
    rs = rayservice({"serve": {"enabled": True, "config": {"index": "s3://b/runs/old/embed"}}})
    assert app_of(rs)["args"]["index"] == "s3://b/runs/old/embed"
    init = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["initContainers"]
    assert init[0]["command"][:4] == ["memsifter", "k8s", "await-published", "s3://b/runs/old/embed"]


def test_scenario_serves_its_embed_output():
    scenario = yaml.safe_load(SCENARIO.read_text())
    assert scenario["serve"]["enabled"] and "embed" in [s["name"] for s in scenario["pipeline"]["steps"]]
    assert "index" not in scenario["serve"].get("config", {})
    args = app_of(rayservice(files=[SCENARIO]))["args"]
    assert args["index"] == f"{scenario['pipeline']['run']}/embed"


# --------------------------------------------------------------------------- keys
def test_keys_only_by_reference():
    values = base_values(config={"auth": {"keys": {"MEMSIFTER_KEY_TRAINER": {"read": ["*"]},
                                                   "MEMSIFTER_KEY_APP": {"read": ["u-*"], "write": ["u-*"]}}}},
                         apiKeys={"secretName": "my-serve-keys", "keys": KEYS})
    rs = rayservice(values)
    for c in containers(rs):
        env = {e["name"]: e for e in c["env"]}
        for name, key in KEYS.items():
            assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": "my-serve-keys", "key": key}}}
        for e in c["env"]:   # no secret-looking variable carries a value
            assert "value" not in e or not re.search(r"(KEY|TOKEN|SECRET|PASSWORD)(_|$)", e["name"]), e
    args = app_of(rs)["args"]
    assert set(args["auth"]["keys"]) == set(KEYS)
    text = chart.render([], values=values, show_only="templates/rayservice.yaml")
    assert "secretKeyRef" in text and text.count("my-serve-keys") == len(KEYS) * len(containers(rs))


def test_grant_of_an_unset_variable_refused():
    values = base_values(config={"auth": {"keys": {"MEMSIFTER_KEY_NOBODY": {"read": ["*"]}}}},
                         apiKeys={"keys": KEYS})
    with pytest.raises(ToolError, match="MEMSIFTER_KEY_NOBODY"):
        rayservice(values)


@pytest.mark.parametrize("bad,msg", [
    ({"config": {"no_such_option": 1}}, "no_such_option"),
    ({"config": {"ranker": {"modle": "x"}}}, "modle"),
    ({"apiKeys": {"keys": {"NOT AN ENV NAME": "k"}}}, "NOT AN ENV NAME"),
    ({"upgradeStrategy": "Rolling"}, "upgradeStrategy"),
    ({"cpuWorkers": {"maxReplica": 3}}, "maxReplica"),
])
def test_schema_rejects_typos(bad, msg):
    with pytest.raises(ToolError, match=msg):
        rayservice(base_values(**bad))


def test_host_and_port_are_the_proxys():
    with pytest.raises(ToolError, match="serve.config.port"):
        rayservice(base_values(config={"port": 9000}))


# --------------------------------------------------------------------------- upgrade strategy
RANKED = {"config": {"ranker": {}}, "gpuWorkers": {"gpus": 1, "maxReplicas": 2}}


@pytest.mark.parametrize("pool,want", [
    ({"nodes": 3, "gpusPerNode": 1}, "None"),         # 3 GPU workers fit: one cluster (2), not two (4)
    ({"nodes": 4, "gpusPerNode": 1}, "NewCluster"),   # two clusters' GPU workers fit
    ({"nodes": 1, "gpusPerNode": 4}, "NewCluster"),   # 4 one-GPU workers on one node
    ({"nodes": 0, "gpusPerNode": 8}, "None"),         # pool unknown
])
def test_upgrade_strategy_auto_follows_the_gpu_pool(pool, want, crd):
    rs = rayservice(base_values(**copy.deepcopy(RANKED), gpuPool=pool))
    assert rs["spec"]["upgradeStrategy"] == {"type": want}
    assert validate.validate_rayservice(rs, crd) == []


def test_upgrade_strategy_without_gpus_and_explicit(crd):
    assert rayservice(base_values())["spec"]["upgradeStrategy"] == {"type": "NewCluster"}   # no GPU workers
    rs = rayservice(base_values(**copy.deepcopy(RANKED), upgradeStrategy="None", gpuPool={"nodes": 100}))
    assert rs["spec"]["upgradeStrategy"] == {"type": "None"}
    with pytest.raises(ToolError, match="gatewayClassName"):
        rayservice(base_values(upgradeStrategy="NewClusterWithIncrementalUpgrade"))
    rs = rayservice(base_values(upgradeStrategy="NewClusterWithIncrementalUpgrade",
                                incrementalUpgrade={"gatewayClassName": "istio"}))
    up = rs["spec"]["upgradeStrategy"]
    assert up["type"] == "NewClusterWithIncrementalUpgrade" and up["clusterUpgradeOptions"]["gatewayClassName"] == "istio"
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    assert validate.validate_rayservice(rs, crd) == []


def test_ranker_must_fit_a_gpu_worker():
    with pytest.raises(ToolError, match="num_gpus"):
        rayservice(base_values(config={"ranker": {"num_gpus": 2}}, gpuWorkers={"gpus": 1}))


# --------------------------------------------------------------------------- jobs/, NOTES, NetworkPolicy
def test_jobs_serve_is_up_to_date(crd):
    assert chart.gen_jobs(check=True) == [], "run `memsifter k8s gen-jobs`"
    text = JOB.read_text()
    (rs,) = [d for d in yaml.safe_load_all(text) if d]
    assert validate.validate_rayservice(rs, crd) == []
    assert app_of(rs)["args"]["index"] == "s3://my-bucket/runs/example/embed"
    assert text.count("ghcr.io/") == 1 and "image: &image " in text
    assert "kubectl apply" in text and "port-forward" in text


def test_notes_tell_how_to_reach_the_service():
    out = helm("install", "lme", str(CHART), "-n", "memsifter", "--dry-run=client", "-f", str(SCENARIO)).stdout
    notes = out[out.index("NOTES:"):]
    assert "kubectl -n memsifter port-forward svc/lme-memsifter-serve-svc 8000" in notes
    assert "curl" in notes and "/retrieve" in notes


def test_network_policy_lets_clients_reach_port_8000():
    docs = chart.render_docs([SCENARIO], ["networkPolicy.enabled=true"], show_only="templates/networkpolicy.yaml")
    pols = {d["metadata"]["name"]: d for d in docs}
    serve = pols["memsifter-serve"]
    assert serve["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "serve"
    (rule,) = serve["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert {"podSelector": {}} in rule["from"]                  # the namespace's pods
    assert any("namespaceSelector" in f for f in rule["from"])  # KubeRay checks the head's Serve proxy
    rs = rayservice(files=[SCENARIO])
    labels = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert serve["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert not [d for d in chart.render_docs([SCENARIO]) if d["kind"] == "NetworkPolicy"]


# --------------------------------------------------------------------------- out of the box (issue 46 item 4)
def test_default_serve_release_would_answer(crd):
    """`helm install` with serve.enabled=true and nothing else renders a RayService that would answer: valid for
    KubeRay's CRD, state in the release's bucket, one key from a Secret granted read and write (no anonymous
    access), the head waiting for the index it serves (with the S3 credentials to look), worker pods ready only
    when the service's readiness route answers, the head out of the Service, and NOTES that create that Secret and
    define every variable their curl uses."""
    from memsifter.service.config import ServeConfig

    docs = chart.render_docs([], ["serve.enabled=true"])
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    assert validate.validate_rayservice(rs, crd) == []
    assert validate.validate_rayservice(rs, validate.kind_schema("RayService")) == []   # the packaged CRD
    assert not [d for d in docs if d["kind"] in ("RayJob", "Ingress")]
    args = app_of(rs)["args"]
    cfg = ServeConfig.model_validate(args)
    assert cfg.state == f"s3://memsifter/{STATE_PREFIX}/{rs['metadata']['name']}"
    assert cfg.index == "s3://memsifter/runs/memsifter/embed"
    assert cfg.auth.anonymous is None
    assert {k: (g.read, g.write) for k, g in cfg.auth.keys.items()} == {DEFAULT_KEY["env"]: (["*"], ["*"])}
    ref = {"secretKeyRef": {"name": "memsifter-serve-keys", "key": DEFAULT_KEY["secretKey"]}}
    for c in containers(rs):
        env = {e["name"]: e for e in c["env"]}
        assert env[DEFAULT_KEY["env"]]["valueFrom"] == ref, c["name"]
        assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "memsifter-s3"
    rcc = rs["spec"]["rayClusterConfig"]
    head = rcc["headGroupSpec"]["template"]["spec"]
    (init,) = head["initContainers"]
    assert init["command"] == ["memsifter", "k8s", "await-published", cfg.index, "--poll", "15"]
    assert init["image"] == head["containers"][0]["image"]
    init_env = {e["name"]: e for e in init["env"]}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "MEMSIFTER_S3_ENDPOINT"} <= set(init_env)
    assert DEFAULT_KEY["env"] not in init_env          # the API keys stay with the service
    for g in rcc["workerGroupSpecs"]:
        probe = g["template"]["spec"]["containers"][0]["readinessProbe"]
        assert probe["httpGet"] == {"path": READINESS_PATH, "port": 8000}
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is True
    # the route the probe calls is the service's readiness route (memsifter.service.http: 503 until loaded)
    import inspect

    from memsifter.service import http

    assert f'@app.get("{READINESS_PATH}"' in inspect.getsource(http)

    out = helm("install", "lme", str(CHART), "-n", "memsifter", "--dry-run=client", "--set", "serve.enabled=true").stdout
    notes = out[out.index("NOTES:"):].splitlines()
    create = [ln for ln in notes if "create secret generic" in ln]
    assert create and create[0].strip() == ("kubectl -n memsifter create secret generic memsifter-serve-keys "
                                            f"--from-literal={DEFAULT_KEY['secretKey']}=\"$(openssl rand -hex 32)\"")
    defined: set[str] = set()
    for ln in notes:
        for var in re.findall(r"\$([A-Z]+)\b", ln.replace("$(", "")):
            assert var in defined, f"NOTES use ${var} before defining it: {ln}"
        m = re.match(r"\s*([A-Z]+)=", ln)
        if m:
            defined.add(m.group(1))
    assert {"KEY", "URL"} <= defined and any("curl" in ln and "$KEY" in ln for ln in notes)
    assert not any("RayJobs" in ln for ln in notes), "no stage is enabled: nothing about RayJobs"
    assert any(f"jsonpath='{{.data.{DEFAULT_KEY['secretKey']}}}'" in ln for ln in notes)


def test_optional_ingress_reaches_the_service():
    import kubernetes_validate

    values = {"serve": {"enabled": True, "ingress": {"enabled": True, "className": "nginx", "host": "mem.example.com",
                                                     "tls": [{"secretName": "mem-tls", "hosts": ["mem.example.com"]}],
                                                     "annotations": {"nginx.ingress.kubernetes.io/proxy-body-size": "32m"}}}}
    docs = chart.render_docs([], values=values)
    (ing,) = [d for d in docs if d["kind"] == "Ingress"]
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    kubernetes_validate.validate(ing, kubernetes_validate.latest_version(), strict=True)
    (rule,) = ing["spec"]["rules"]
    assert rule["host"] == "mem.example.com" and ing["spec"]["ingressClassName"] == "nginx"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{rs['metadata']['name']}-serve-svc", "port": {"number": 8000}}
    with pytest.raises(ToolError, match="/serve/ingress/host"):
        chart.render([], values={"serve": {"enabled": True, "ingress": {"enabled": True, "host": "a b"}}})
