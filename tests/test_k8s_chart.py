"""The Helm chart, jobs/ and the RayJobs they render, checked with the real tools that run here.

* The chart's generated files (values.yaml, values.schema.json, files/stages.json, README.md, ci/*.yaml) and
  jobs/ match the stage registry and the chart (`memsifter k8s gen-chart --check`, `gen-jobs --check`); the
  chart's sizes are within the targets of issue 18 (printed); every value is documented (`# --`).
* A step's config travels as one document (a ConfigMap per step of the plan, mounted into the head pod, read
  with `memsifter run <stage> --config`) holding only what its section sets, output and the wired inputs.
* `helm lint --strict` and `helm template` (real helm from the PyPI wheel) for the default values and
  every ci/ scenario; the schema rejects typos.
* Core kinds pass `kubernetes-validate --strict`; every RayJob passes the KubeRay 1.7.0 CRD schema with
  unknown fields rejected, the CRD's CEL rules and KubeRay's admission rules (memsifter.k8s.validate).
* Naming, secrets by reference, /dev/shm, the driver's RBAC, and the training group's autoscaling shape,
  checked against Ray's own KubeRay autoscaler code and resource-demand scheduler.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from memsifter import stage as stg
from memsifter.k8s import registry
from memsifter.k8s import validate
from memsifter.k8s.plan import chart_plan
from memsifter_dev.k8s import chart, scenarios
from memsifter_dev.k8s.tools import ToolError, helm

CHART = chart.CHART_DIR
SCENARIOS = sorted((CHART / "ci").glob("*.yaml"))
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CORE_KINDS = {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Job", "Namespace", "Secret", "Service",
              "Deployment", "PersistentVolumeClaim", "NetworkPolicy"}


@pytest.fixture(scope="module")
def infos():
    return registry.stage_infos()


@pytest.fixture(scope="module")
def crd(shared_dir):
    return validate.crd_schema(shared_dir / "crds" / "ray.io_rayjobs.yaml")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Every scenario rendered twice: with the driver (plan ConfigMap) and without (RayJobs)."""
    out = {}
    for f in SCENARIOS:
        out[f.stem] = chart.render_docs([f])
        out[f.stem + "+nodriver"] = chart.render_docs([f], ["driver.enabled=false"])
    out["defaults"] = chart.render_docs([])
    out["full+netpol"] = chart.render_docs([CHART / "ci" / "full.yaml"], ["networkPolicy.enabled=true"])
    return out


def rayjobs_of(docs: list[dict]) -> list[dict]:
    jobs = [d for d in docs if d.get("kind") == "RayJob"]
    for d in docs:
        if d.get("kind") == "ConfigMap" and "plan.json" in (d.get("data") or {}):
            import json

            jobs += [s["rayjob"] for s in json.loads(d["data"]["plan.json"])["stages"]]
    return jobs


def config_of(docs: list[dict], rj: dict) -> dict:
    """The config document a rendered RayJob runs with: its entrypoint is `memsifter run <stage> --config
    /etc/memsifter/<stage>.yaml` (behind await-capacity), the file its head pod mounts from the ConfigMap."""
    words = shlex.split(validate.submitted_entrypoint(rj["spec"]["entrypoint"]))
    if words[:3] == ["memsifter", "k8s", "await-capacity"]:
        words = words[words.index("--") + 1:]
    stage = rj["metadata"]["labels"]["memsifter.io/stage"]
    assert words == ["memsifter", "run", stage, "--config", f"/etc/memsifter/{stage}.yaml"], words
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (vol,) = [v for v in head["volumes"] if v["name"] == "config"]
    assert vol["configMap"]["name"] == rj["metadata"]["name"]
    assert {"name": "config", "mountPath": "/etc/memsifter", "readOnly": True} in head["containers"][0]["volumeMounts"]
    return chart.stage_config(docs, rj)


# --------------------------------------------------------------------------- generated files
def test_chart_generated_from_registry(infos):
    assert chart.gen_chart(check=True, infos=infos) == [], "run `memsifter k8s gen-chart`"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # nothing runs by default: the plan (`memsifter k8s plan`) says what runs; no per-stage defaults or facts
    assert values["pipeline"] == {"run": "", "steps": []} and values["stages"] == {}
    import json

    facts = json.loads((CHART / "files" / "stages.json").read_text())
    assert list(facts) == stg.available_stages()
    for i in infos:   # code facts only: no wiring (the plan's alone)
        assert (facts[i.name]["family"], facts[i.name]["gpus"]) == (i.family, i.gpus)
        assert not {"needs", "inputs", "wiring"} & set(facts[i.name])


def test_chart_sizes_within_targets():
    """Issue 18's targets: values.yaml <= 450 lines, values.schema.json <= 3500, _helpers.tpl <= 120, jobs/
    entrypoints <= 3 lines, the image named once per jobs/ file (also printed by `memsifter k8s gen-chart`)."""
    report, over = chart.size_report()
    print("\n" + report)
    assert over == [], report
    assert set(chart.sizes()) == set(chart.TARGETS)


def test_every_value_is_documented():
    """Every key of values.yaml has a helm-docs `# --` comment above it, down to the values users set: in a
    mapping either every key is documented (a group of values) or none is (one value, e.g. `resources`)."""
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()

    def documented(key_node: yaml.Node) -> bool:
        j = key_node.start_mark.line - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        return j >= 0 and lines[j].strip().startswith("# --")

    count = 0

    def walk(node: yaml.MappingNode, path: str, top: bool) -> None:
        nonlocal count
        marks = [documented(k) for k, _ in node.value]
        assert top or all(marks) or not any(marks), f"{path}: some keys documented, some not"
        if not all(marks):
            assert not top, f"values.yaml: top-level keys without `# --`: {[k.value for (k, _), m in zip(node.value, marks) if not m]}"
            return
        for k, v in node.value:
            count += 1
            if isinstance(v, yaml.MappingNode) and not v.flow_style and v.value:
                walk(v, f"{path}{k.value}.", False)

    walk(yaml.compose(text), "", True)
    assert count > 80, count


def test_helm_show_readme():
    out = helm("show", "readme", str(CHART)).stdout
    assert out.strip(), "helm show readme is empty"
    for name in stg.available_stages():
        assert f"### {name}" in out
    assert "memsifter k8s plan" in out and "`profiles." in out


def test_config_documents_hold_only_overrides(infos, rendered):
    """A step's config document = its section of the scenario's pipeline config + output + the inputs the plan
    wired; defaults stay in pydantic (a default value never appears unless the section sets it)."""
    by = {i.name: i for i in infos}
    spec = scenarios.scenario_spec(infos, "full", chart.scenario_sets(infos)["full"])
    docs = rendered["full+nodriver"]
    for rj in rayjobs_of(docs):
        name = rj["metadata"]["labels"]["memsifter.io/stage"]
        cfg = config_of(docs, rj)
        own = spec["stages"][name]
        assert {k: cfg[k] for k in own} == own and set(cfg) - set(own) <= {"output", *by[name].wired}, name
        stg.validate_config(name, cfg, source=f"{name} config document")


def test_jobs_are_short_and_name_the_image_once(infos):
    """jobs/<stage>.yaml: the stage's ConfigMap and RayJob; an entrypoint of at most 3 lines; the image
    named once (a YAML anchor the RayJob's containers refer to)."""
    for i in infos:
        p = chart.JOBS_DIR / f"{i.name}.yaml"
        text = p.read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
        assert [d["kind"] for d in docs] == ["ConfigMap", "RayJob"], p
        cfg = config_of(docs, docs[1])
        assert set(cfg) <= {"output", *i.wired, *i.required_user_fields, *i.fields}, p
        assert text.count("ghcr.io/") == 1 and "image: &image " in text, p
        pods = [docs[1]["spec"]["submitterPodTemplate"], docs[1]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]]
        images = {c["image"] for t in pods for c in t["spec"]["containers"]}
        assert len(images) == 1, images


def test_jobs_rendered_from_chart(infos):
    assert chart.gen_jobs(check=True, infos=infos) == [], "run `memsifter k8s gen-jobs`"
    assert sorted(p.stem for p in chart.JOBS_DIR.glob("*.yaml") if p.stem != "values") == \
        sorted([*stg.available_stages(), chart.SERVE_JOB])


def test_every_family_has_an_image(infos):
    assert chart.check_images(infos) == []


def test_scenarios_cover_all_stages(infos):
    sets = chart.scenario_sets(infos)
    names = {i.name for i in infos}
    # full: every stage but the alternatives the pipeline refuses to run together (import and synth)
    assert sets["full"] == scenarios.without_refused(infos, names) and names - sets["full"]
    assert sets["inference-only"] | sets["training-only"] == sets["full"]
    assert set().union(*sets.values()) == names, "every stage is in some scenario"
    assert not sets["inference-only"] & sets["training-only"]
    assert all(not i.capacity and i.gpus == 0 for i in infos if i.name in sets["minimal-cpu"])
    assert {p.stem for p in SCENARIOS} == set(sets)


def test_values_defaults_are_valid_stage_configs(infos):
    """Each stage's config document (the plan's copy of what the ConfigMap holds), with the chart's output and
    wiring, validates with the stage's own pydantic class (what `memsifter run --config` does in the pod)."""
    docs = chart.render_docs([CHART / "ci" / "full.yaml"])
    import json

    plan = json.loads(next(d for d in docs if d["kind"] == "ConfigMap" and "plan.json" in d["data"])["data"]["plan.json"])
    assert {s["name"] for s in plan["stages"]} == chart.scenario_sets(infos)["full"]
    for s in plan["stages"]:
        cfg = stg.validate_config(s["stage"], s["config"], source="chart")
        assert cfg.output == f"s3://memsifter-ci/runs/ci-full/{s['name']}"


def test_inputs_wired_to_producer_outputs(infos):
    by = {i.name: i for i in infos}
    docs = chart.render_docs([CHART / "ci" / "full.yaml"], ["driver.enabled=false"])
    for rj in rayjobs_of(docs):
        name = rj["metadata"]["labels"]["memsifter.io/stage"]
        cfg = config_of(docs, rj)
        for inp in scenarios.wired(by[name]):   # every producer runs but alternatives
            want = [f"s3://memsifter-ci/runs/ci-full/{p}" for p in scenarios.preferred(by[name], inp)]
            got = cfg[inp.field] if isinstance(cfg[inp.field], list) else [cfg[inp.field]]
            assert got == want, (name, inp.field)


# --------------------------------------------------------------------------- helm
@pytest.mark.parametrize("values", [None, *SCENARIOS], ids=lambda p: p.stem if p else "defaults")
def test_helm_lint_strict(values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    proc = helm(*args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("bad,msg", [
    (["s3.bucketz=x"], "bucketz"),
    (["driver.pollSecs=3"], "pollSecs"),
    (["stages.{stage}.imgae.tag=x"], "imgae"),
    (["stages.{stage}.config.model=x"], "config"),      # a config is the plan's: pipeline.steps
    (["stages.{stage}.workers.gpus=-1"], "minimum"),
    (["s3.bucket=Not_A_Bucket"], "bucket"),
    (["stages.No_Such.head.shmSize=1Gi"], "No_Such"),
    (["pipeline.run=/local/run"], "pipeline/run"),
])
def test_schema_rejects_typos(bad, msg, infos):
    sets = [s.format(stage=infos[-1].name) for s in bad]
    with pytest.raises(ToolError, match=msg):
        chart.render([], sets)


def test_schema_checks_a_step_against_its_stage(infos):
    """A hand-edited plan: a step's config is checked against the schema of the stage it names."""
    plan = chart_plan({"run": "s3://bkt/r", "stages": {"synth": {}, "embed": {}}})
    plan["steps"][1]["config"]["no_such_option"] = 1
    with pytest.raises(ToolError, match="no_such_option"):
        chart.render([], values={"pipeline": plan})


def test_required_fields_enforced_by_the_plan(infos):
    need = [i for i in infos if i.required_user_fields]
    if not need:
        pytest.skip("no stage has user-required fields")
    i = need[0]
    from memsifter.errors import ConfigError

    with pytest.raises(ConfigError, match=i.required_user_fields[0]):
        chart_plan({"run": "s3://b/r", "stages": {i.name: {k: v for k, v in scenarios.section(
            i, {i.name}, "b", "s3://b/old").items() if k != i.required_user_fields[0]}}})


def test_core_kinds_valid_for_kubernetes(rendered):
    seen = set()
    for scenario, docs in rendered.items():
        for d in docs:
            if d["kind"] in ("RayJob", "RayService"):  # KubeRay's kinds: checked against their CRDs
                continue
            assert d["kind"] in CORE_KINDS, d["kind"]
            seen.add(d["kind"])
            for v in K8S_VERSIONS:
                kubernetes_validate.validate(d, v, strict=True)
    assert {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Job"} <= seen


def test_every_rayjob_valid_against_crd_cel_and_kuberay(rendered, crd):
    n = 0
    for scenario, docs in rendered.items():
        for rj in rayjobs_of(docs):
            errs = validate.validate_rayjob(rj, crd)
            assert errs == [], f"{scenario}: {rj['metadata']['name']}: {errs}"
            n += 1
    for p in chart.JOBS_DIR.glob("*.yaml"):
        if p.stem == "values":
            continue
        for rj in (d for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "RayJob"):
            assert validate.validate_rayjob(rj, crd) == [], p
            n += 1
    assert n > 0


def test_rayjob_shape(rendered, infos):
    by = {i.name: i for i in infos}
    for scenario, docs in rendered.items():
        for rj in rayjobs_of(docs):
            meta, spec = rj["metadata"], rj["spec"]
            stage = meta["labels"]["memsifter.io/stage"]
            assert len(meta["name"]) <= 47 and meta["name"].endswith("-" + stage)
            for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                      "app.kubernetes.io/managed-by", "helm.sh/chart", "memsifter.io/run"):
                assert k in meta["labels"]
            rcs = spec["rayClusterSpec"]
            groups = [rcs["headGroupSpec"], *rcs.get("workerGroupSpecs", [])]
            for g in groups:
                pod = g["template"]["spec"]
                vols = {v["name"]: v for v in pod["volumes"]}
                assert vols["dshm"]["emptyDir"]["medium"] == "Memory" and vols["dshm"]["emptyDir"]["sizeLimit"]
                c = pod["containers"][0]
                assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
                assert pod["securityContext"]["runAsNonRoot"] is True
                for e in c["env"]:  # secrets only by reference
                    assert not ("KEY" in e["name"] and "value" in e), e
                names = {e["name"]: e for e in c["env"]}
                assert names["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"]
            info = by[stage]
            if scenario.startswith("minimal-cpu"):
                assert not rcs.get("workerGroupSpecs")
            elif info.gpus and not scenario.startswith("minimal-cpu"):
                wg = rcs["workerGroupSpecs"][0]
                assert wg["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
                assert wg["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
            if "+nodriver" in scenario or scenario.startswith("jobs"):
                cfg = config_of(docs, rj)
                stg.validate_config(stage, cfg, source=f"{scenario} config document")


def test_driver_rbac_is_limited_to_rayjobs(rendered):
    for scenario, docs in rendered.items():
        for d in docs:
            if d["kind"] == "Role":
                assert d["rules"] == [{"apiGroups": ["ray.io"], "resources": ["rayjobs"],
                                       "verbs": ["get", "create", "delete"]}]
            assert d["kind"] not in ("ClusterRole", "ClusterRoleBinding")
        jobs = [d for d in docs if d["kind"] == "Job"]
        if "nodriver" in scenario:
            assert not jobs
        else:
            (job,) = jobs
            pod = job["spec"]["template"]["spec"]
            sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
            assert pod["serviceAccountName"] == sa
            assert pod["containers"][0]["command"] == ["memsifter", "k8s", "drive"]


def test_driver_role_grants_exactly_the_verbs_driver_py_uses(rendered):
    """The Role's verbs are the Kubernetes API calls memsifter/k8s/driver.py makes (read from its source):
    a new call there (list, patch, pods/log ...) fails here until the Role grants it, and vice versa."""
    import re

    src = (chart.REPO / "memsifter" / "k8s" / "driver.py").read_text()
    calls = set(re.findall(r"\.api\.([a-z]+)_(?:namespaced|cluster)_custom_object(?:_status)?\(", src))
    assert calls, "driver.py makes no custom-object call: update this test"
    other_apis = re.findall(r"client\.([A-Z][A-Za-z]+Api)\(", src)
    assert set(other_apis) == {"CustomObjectsApi"}, other_apis  # no pods/logs/events access
    verb = {"get": "get", "list": "list", "create": "create", "delete": "delete", "patch": "patch",
            "replace": "update"}
    used = {verb[c] for c in calls}
    for docs in rendered.values():
        for d in docs:
            if d["kind"] == "Role":
                (rule,) = d["rules"]
                assert set(rule["verbs"]) == used and rule["resources"] == ["rayjobs"], (rule, used)


WRITABLE_ENV = ("HOME", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR",
                "MPLCONFIGDIR")


def _pod_specs(docs):
    """(what, pod spec) of every pod the manifests create, RayJob pods included (as KubeRay builds them)."""
    for d in validate.workload_manifests(docs):
        if d["kind"] == "Pod":
            yield f"Pod {d['metadata']['name']}", d["spec"]
        elif d["kind"] in ("Job", "Deployment"):
            yield f"{d['kind']} {d['metadata']['name']}", d["spec"]["template"]["spec"]


def test_every_pod_and_container_is_hardened(rendered):
    """runAsNonRoot, no privilege escalation, all capabilities dropped, seccomp RuntimeDefault and a read-only
    root filesystem for every container (Ray head/worker, autoscaler sidecar, submitter, driver, SeaweedFS);
    what they write (/tmp, HOME, model/compile caches) is on an emptyDir/PVC mount."""
    prereq = [d for p in sorted((chart.REPO / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
              if d and d.get("kind")]
    n = 0
    for scenario, docs in [*rendered.items(), ("k8s/", prereq)]:
        for what, pod in _pod_specs(docs):
            where = f"{scenario}: {what}"
            psc = pod.get("securityContext") or {}
            assert psc.get("runAsNonRoot") is True, where
            assert (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", where
            assert psc.get("runAsUser", 0) > 0, where
            vols = {v["name"]: v for v in pod.get("volumes") or []}
            for c in pod["containers"]:
                sc = c.get("securityContext") or {}
                assert sc.get("allowPrivilegeEscalation") is False, (where, c["name"])
                assert sc.get("readOnlyRootFilesystem") is True, (where, c["name"])
                assert (sc.get("capabilities") or {}).get("drop") == ["ALL"], (where, c["name"])
                assert not (sc.get("capabilities") or {}).get("add"), (where, c["name"])
                assert sc.get("privileged") in (None, False) and sc.get("runAsUser", 1) != 0, (where, c["name"])
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
                for path, vol in mounts.items():
                    assert vol in vols, (where, c["name"], vol)
                writable = [p for p, v in mounts.items()
                            if ("emptyDir" in vols[v] or "persistentVolumeClaim" in vols[v])]
                assert "/tmp" in writable, (where, c["name"])
                env = {e["name"]: e.get("value") for e in c.get("env") or []}
                for name in WRITABLE_ENV:
                    if name in env:
                        assert any(env[name] == w or env[name].startswith(w.rstrip("/") + "/") for w in writable), \
                            (where, c["name"], name, env[name])
                if c["name"] in ("ray-head", "ray-worker"):  # Ray containers: home and every cache on writable mounts
                    assert set(WRITABLE_ENV) <= set(env), (where, c["name"])
                n += 1
            token = pod.get("automountServiceAccountToken")
            if "driver" in what and "submitter" not in what:
                assert pod.get("serviceAccountName"), where
            elif what.endswith("-head") and any(c["name"] == "autoscaler" for c in pod["containers"]):
                assert token is True, where  # KubeRay's autoscaler sidecar calls the API
            else:
                assert token is False, where
    assert n > 50


def test_network_policy_optional_and_covers_every_pod(rendered):
    assert not [d for s, docs in rendered.items() if s != "full+netpol" for d in docs if d["kind"] == "NetworkPolicy"]
    docs = rendered["full+netpol"]
    (np_,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    sel = np_["spec"]["podSelector"]["matchLabels"]
    assert sel and set(np_["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    pods = [d for d in validate.workload_manifests(docs) if d["kind"] in ("Pod", "Job")]
    assert len(pods) > 10
    for d in pods:
        labels = (d["metadata"]["labels"] if d["kind"] == "Pod" else d["spec"]["template"]["metadata"]["labels"])
        assert sel.items() <= labels.items(), d["metadata"]["name"]
    # ingress: the release's own pods, and the operator's namespace on the dashboard port only
    ingress = np_["spec"]["ingress"]
    assert ingress[0]["from"] == [{"podSelector": {"matchLabels": sel}}]
    assert ingress[1]["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert "namespaceSelector" in ingress[1]["from"][0]


def alone(info, **config) -> dict:
    """The values of a plan of ``info``'s stage alone (jobs/values.yaml's run root): placeholders for what a user
    sets, an earlier run's outputs for its inputs (no producer runs), ``config`` on top."""
    section = {**scenarios.section(info, {info.name}, "my-bucket", "s3://my-bucket/runs/earlier"), **config}
    return {"pipeline": chart_plan({"run": "s3://my-bucket/runs/example", "stages": {info.name: section}})}


def test_rayjob_names_run_scoped_and_short(infos, tmp_path):
    longest_info = max(infos, key=lambda i: len(i.name))
    longest = longest_info.name
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(alone(longest_info)))
    names = set()
    for release, run_id in [("memsifter", ""), ("a-very-long-release-name-for-a-team", "2026-11-22-ablation-b"),
                            ("r", "x" * 40), ("9lives", "")]:
        sets = ["driver.enabled=false"]
        if run_id:
            sets.append(f"run.id={run_id}")
        args = ["template", release, str(CHART), "--show-only", "templates/rayjobs.yaml", "-f", str(plan)]
        for s in sets:
            args += ["--set", s]
        docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
        (rj,) = docs
        name = rj["metadata"]["name"]
        assert validate.kuberay_errors(rj) == [] and len(name) <= 47 and name.endswith(longest)
        names.add(name)
    assert len(names) == 4


# --------------------------------------------------------------------------- training capacity
def _train_info(infos):
    cap = [i for i in infos if i.capacity]
    if not cap:
        pytest.skip("no multi-node stage (config with nnodes / n_gpus_per_node) registered yet")
    return cap[0]


def test_training_group_autoscales_to_nnodes(infos):
    info = _train_info(infos)
    nodes_f, gpn_f = info.capacity["nodes"], info.capacity["gpusPerNode"]
    assert "." not in nodes_f + gpn_f   # top-level config fields (verl's names)
    jobs = [chart.JOBS_DIR / "values.yaml"]
    docs = chart.render_docs(jobs, [f"stages.{info.name}.workers.gpus=4"],
                             values=alone(info, **{nodes_f: 3, gpn_f: 4}), show_only="templates/rayjobs.yaml")
    (rj,) = docs
    rcs = rj["spec"]["rayClusterSpec"]
    assert rcs["enableInTreeAutoscaling"] is True
    (wg,) = rcs["workerGroupSpecs"]
    assert wg["minReplicas"] == 0 and wg["replicas"] == 0 and wg["maxReplicas"] >= 3
    assert wg["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    words = shlex.split(rj["spec"]["entrypoint"])
    assert words[:9] == ["memsifter", "k8s", "await-capacity", "--nodes", "3", "--gpus-per-node", "4",
                         "--timeout", words[8]]
    # the worker group follows the config's GPUs per node unless set
    (rj,) = chart.render_docs(jobs, values=alone(info, **{gpn_f: 4}), show_only="templates/rayjobs.yaml")
    (wg,) = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert wg["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    # a worker pod must be a whole training node
    with pytest.raises(ToolError, match="must equal"):
        chart.render(jobs, [f"stages.{info.name}.workers.gpus=2"], values=alone(info))


@pytest.mark.parametrize("nnodes", [1, 2, 4])
def test_training_placement_groups_fit_chart_and_trigger_scale_up(infos, nnodes):
    """Ray's own KubeRay code turns the rendered cluster spec into autoscaler node types; Ray's
    resource-demand scheduler then packs the placement groups verl creates (the train stage's
    `placement_request`) and must launch exactly nnodes GPU workers with nothing left over."""
    info = _train_info(infos)
    import importlib
    from functools import partial

    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )
    from ray.autoscaler._private.node_provider_availability_tracker import (
        NodeAvailabilitySummary,
    )
    from ray.autoscaler._private.resource_demand_scheduler import (
        _default_utilization_scorer,
        get_nodes_for,
    )

    scorer = partial(_default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({}))

    mod = importlib.import_module(stg.get_stage(info.name).module)
    if not hasattr(mod, "placement_request"):
        pytest.skip(f"{info.name} has no placement_request()")
    nodes_f = info.capacity["nodes"]
    docs = chart.render_docs([chart.JOBS_DIR / "values.yaml"], values=alone(info, **{nodes_f: nnodes}),
                             show_only=["templates/configmaps.yaml", "templates/rayjobs.yaml"])
    (rj,) = [d for d in docs if d["kind"] == "RayJob"]
    cfg = stg.validate_config(info.name, config_of(docs, rj))
    req = mod.placement_request(cfg)
    auto = _derive_autoscaling_config_from_ray_cr({"metadata": {"name": "c", "namespace": "ns"},
                                                   "spec": rj["spec"]["rayClusterSpec"]})
    types = auto["available_node_types"]
    gpu_types = [t for t, v in types.items() if v["resources"].get("GPU")]
    assert gpu_types == ["gpu"] and types["gpu"]["min_workers"] == 0 and types["gpu"]["max_workers"] >= nnodes
    # STRICT_PACK placement group -> one demand of the summed bundles (Ray's own conversion rule)
    demands = []
    for pg in req["placement_groups"]:
        assert pg["strategy"] == "STRICT_PACK"
        tot: dict[str, float] = {}
        for b in pg["bundles"]:
            for k, v in b.items():
                tot[k] = tot.get(k, 0) + v
        demands.append(tot)
    to_add, residual = get_nodes_for(types, {"headgroup": 1}, "headgroup", auto["max_workers"], demands, scorer)
    assert residual == [] and dict(to_add) == {"gpu": nnodes}
    # the bundles await-capacity requests have the same shape
    from memsifter.k8s.capacity import node_bundles

    gpn = req["gpus_per_node"]
    assert node_bundles(nnodes, gpn, req["per_gpu_node"]["CPU"] / gpn) == \
        [{"GPU": float(gpn), "CPU": float(req["per_gpu_node"]["CPU"])}] * nnodes
    # CPU actors (task runner, reward and agent loops) fit on head + workers
    cpu_need = sum(req.get("cpu_actors", {}).values())
    cpus = types["headgroup"]["resources"]["CPU"] + nnodes * (types["gpu"]["resources"]["CPU"]
                                                             - req["per_gpu_node"]["CPU"])
    assert cpus >= cpu_need
    # too few CPUs per worker pod: the scheduler cannot place a node's placement group
    small = yaml.safe_load(yaml.safe_dump(rj["spec"]["rayClusterSpec"]))
    res = small["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    res["requests"]["cpu"] = str(req["per_gpu_node"]["CPU"] - 1)
    res.setdefault("limits", {})["cpu"] = res["requests"]["cpu"]
    types2 = _derive_autoscaling_config_from_ray_cr({"metadata": {"name": "c", "namespace": "ns"},
                                                    "spec": small})["available_node_types"]
    _, residual = get_nodes_for(types2, {"headgroup": 1}, "headgroup", nnodes, demands, scorer)
    assert residual, "an undersized worker must be reported as unschedulable"


def test_values_file_paths():
    assert (CHART / "Chart.yaml").exists() and (CHART / "templates" / "NOTES.txt").exists()
    assert Path(chart.JOBS_DIR / "values.yaml").exists()


# --------------------------------------------------------------------------- k8s/ prerequisites
K8S_DIR = chart.REPO / "k8s"


def test_cluster_prerequisite_manifests_are_valid():
    docs = [(p, d) for p in sorted(K8S_DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    kinds = {d["kind"] for _, d in docs}
    assert {"Namespace", "Secret", "Deployment", "Service", "PersistentVolumeClaim"} <= kinds
    for p, d in docs:
        for v in K8S_VERSIONS:
            kubernetes_validate.validate(d, v, strict=True)
        if d["kind"] == "Secret":  # placeholders only
            assert set(d["stringData"].values()) == {"CHANGE-ME"}, p
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    secrets = {d["metadata"]["name"]: set(d["stringData"]) for _, d in docs if d["kind"] == "Secret"}
    s = values["secrets"]
    assert {s["s3"]["accessKeyIdKey"], s["s3"]["secretAccessKeyKey"]} <= secrets[s["s3"]["name"]]
    assert s["llm"]["key"] in secrets[s["llm"]["name"]] and s["huggingFace"]["key"] in secrets[s["huggingFace"]["name"]]


@pytest.mark.parametrize("values", [None, CHART / "ci" / "full.yaml"], ids=["defaults", "full"])
def test_notes_render(values):
    args = ["install", "lme", str(CHART), "-n", "memsifter", "--dry-run=client"]
    if values:
        args += ["-f", str(values)]
    out = helm(*args).stdout
    notes = out[out.index("NOTES:"):]
    assert "run manifest: s3://" in notes
    assert ("the plan is empty" in notes) == (values is None)


def test_model_cache_on_a_persistent_volume_and_train_restarts():
    """Issue 19: `cacheVolume.existingClaim` puts every pod's model cache on one PVC (weights downloaded
    once); the train RayJob is resubmitted after preemption (backoffLimit 3, it resumes from S3)."""
    def pod_volumes(docs):
        out = []
        for job in rayjobs_of(docs):
            spec = job["spec"]["rayClusterSpec"]
            for tpl in [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]:
                out += [v for v in tpl["spec"]["volumes"] if v["name"] == "cache"]
        return out

    full = CHART / "ci" / "full.yaml"
    default = pod_volumes(chart.render_docs([full], ["driver.enabled=false"]))
    assert default and all("emptyDir" in v for v in default)
    shared = pod_volumes(chart.render_docs([full], ["driver.enabled=false", "cacheVolume.existingClaim=models"]))
    assert shared and all(v.get("persistentVolumeClaim") == {"claimName": "models"} for v in shared)
    jobs = {j["metadata"]["labels"].get("memsifter.io/stage", j["metadata"]["name"]): j
            for j in rayjobs_of(chart.render_docs([full], ["driver.enabled=false"]))}
    train = next(j for k, j in jobs.items() if "train" in k)
    assert train["spec"]["backoffLimit"] == 3
    assert all(j["spec"].get("backoffLimit", 0) == 0 for k, j in jobs.items() if "train" not in k)


# --------------------------------------------------------------------------- values refused (issue 41)
_IMPORT = {"pipeline": chart_plan({"run": "s3://bkt/runs/r", "stages": {
    "import": {"format": "longmemeval", "source": "s3://b/in"}, "embed": {}}})}
_SECRET = "pw" + "x" * 6   # built at run time: no key-shaped literal in the repository


def _step(values: dict, name: str, **config) -> dict:
    """``values`` with more keys in the config of the plan's step ``name`` (a plan edited by hand, or one whose
    stage does not refuse what the chart must)."""
    import copy as _copy

    out = _copy.deepcopy(values)
    steps = out["pipeline"]["steps"]
    if name not in [s["name"] for s in steps]:
        steps.append({"name": name, "stage": name, "config": {"output": f"{out['pipeline']['run']}/{name}"}})
    next(s for s in steps if s["name"] == name)["config"].update(config)
    return out


def _with(values: dict, **more) -> dict:
    import copy as _copy

    out = _copy.deepcopy(values)
    for dotted, v in more.items():
        cur = out
        *path, last = dotted.split("__")
        for k in path:
            cur = cur.setdefault(k, {})
        cur[last] = v
    return out


BAD_VALUES = {
    "tag with a space": (_with(_IMPORT, images__families__embed__tag="0.1 .0"), "/images/families/embed/tag"),
    "empty tag": (_with(_IMPORT, images__families__embed__tag=""), "/images/families/embed/tag"),
    "tag with a newline": (_with(_IMPORT, images__families__embed__tag="0.1.0\nrepository: x"),
                           "/images/families/embed/tag"),
    "stage image tag with a space": (_with(_IMPORT, stages__embed__image={"tag": "a b"}), "/stages/embed/image/tag"),
    "1 MB config value": (_step(_IMPORT, "import", source="s3://b/" + "x" * 1_000_000),
                          "/pipeline/steps/0/config/source"),
    "1 MB env value": (_with(_IMPORT, env=[{"name": "BIG", "value": "x" * 1_000_000}]), "/env/0/value"),
    "fullnameOverride with /": ({"fullnameOverride": "a/b"}, "/fullnameOverride"),
    "fullnameOverride ..": ({"fullnameOverride": ".."}, "/fullnameOverride"),
    "fullnameOverride with a space": ({"fullnameOverride": "my app"}, "/fullnameOverride"),
    "secret name with /": ({"secrets": {"s3": {"name": "a/b"}}}, "/secrets/s3/name"),
    "secret name ..": ({"secrets": {"llm": {"name": ".."}}}, "/secrets/llm/name"),
    "secret name with a space": ({"secrets": {"huggingFace": {"name": "my hf"}}}, "/secrets/huggingFace/name"),
    "secret key ..": ({"secrets": {"s3": {"accessKeyIdKey": ".."}}}, "/secrets/s3/accessKeyIdKey"),
    "serve secret name with /": ({"serve": {"enabled": True, "apiKeys": {"secretName": "a/b"}}},
                                 "/serve/apiKeys/secretName"),
    "extraEnv secret name ..": ({"secrets": {"extraEnv": [{"name": "T", "secretName": "..", "key": "t"}]}},
                                "/secrets/extraEnv/0/secretName"),
    "runPrefix ../": ({"s3": {"runPrefix": "../other"}}, "/s3/runPrefix"),
    "runPrefix with a space": ({"s3": {"runPrefix": "my runs"}}, "/s3/runPrefix"),
    "runPrefix /abs": ({"s3": {"runPrefix": "/runs"}}, "/s3/runPrefix"),
    "endpoint with a password": ({"s3": {"endpoint": f"http://user:{_SECRET}@seaweedfs:8333"}},
                                 "/s3/endpoint"),
    "endpoint with a path": ({"s3": {"endpoint": "http://seaweedfs:8333/x y"}}, "/s3/endpoint"),
    "LLM base_url with a password": (_step(_IMPORT, "rank", input="s3://bkt/runs/r/import", embeddings="s3://bkt/runs/r/embed",
                                           endpoint={"base_url": f"http://user:{_SECRET}@llm:8000/v1"}),
                                     "/pipeline/steps/2/config/endpoint/base_url"),
    "service ranker URL with a password": ({"serve": {"enabled": True, "config": {"ranker": {"endpoint": {
        "base_url": f"http://user:{_SECRET}@llm:8000/v1"}}}}}, "/serve/config/ranker/endpoint/base_url"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_unsafe_values_refused_by_template_and_lint(case, tmp_path):
    """Each probe of issue 41 that used to render (an image tag with a space, empty or with a newline; a 1 MB
    value; names and prefixes with '/', '..' or spaces; a URL with a password) is refused by `helm template` and
    `helm lint` in one message naming the value's path, and the password is never printed."""
    values, where = BAD_VALUES[case]
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    for args in (["template", "x", str(CHART), "-f", str(f)], ["lint", "--strict", str(CHART), "-f", str(f)]):
        proc = helm(*args, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"{args[0]} accepted {case}"
        assert where in out, out[-2000:]
        assert _SECRET not in out


@pytest.mark.parametrize("sets", [
    ["images.families.embed.tag=0.1.0@sha256:" + "a" * 64],
    ["images.families.embed.repository=registry.example.com:5000/team/memsifter-embed"],
    ["s3.endpoint=http://[::1]:8333", "s3.runPrefix=team-a/runs_2026.11"],
    ["fullnameOverride=lme", "secrets.s3.name=s3.creds", "secrets.s3.accessKeyIdKey=.id"],
])
def test_safe_values_still_render(sets):
    assert chart.render_docs([CHART / "ci" / "minimal-cpu.yaml"], sets)


_BIG_ENV = [{"name": f"E{i}", "value": "y" * 60000} for i in range(20)]   # each within the schema's bound


@pytest.mark.parametrize("case,values,msg", [
    ("RayJob over 1 MiB", _with(_IMPORT, env=_BIG_ENV, driver={"enabled": False}), ": the RayJob renders"),
    ("plan over 1 MiB", _with(_IMPORT, env=_BIG_ENV), "the driver's plan ConfigMap"),
    ("password in a field not named *_url", _step(_IMPORT, "embed", input=f"s3://b/in?u=http://user:{_SECRET}@host/x"),
     "pipeline step embed: its config: a URL with user:password@"),
])
def test_template_checks_what_the_schema_cannot(case, values, msg):
    """An object over 1 MiB made of strings each within the schema's bound, and a credential-bearing URL in a field
    the schema does not know as a URL: `helm template`/`install` fail naming the value, no password shown. (helm
    4's lint reports a template's `fail` as INFO only, so these are the templates' alone.)"""
    with pytest.raises(ToolError) as err:
        chart.render([], values=values)
    assert msg in str(err.value) and _SECRET not in str(err.value), str(err.value)[-1500:]


# --------------------------------------------------------------------------- jobs/: one place to edit (issue 41)
def _job(name: str) -> tuple[str, list[dict]]:
    text = (chart.JOBS_DIR / f"{name}.yaml").read_text()
    return text, [d for d in yaml.safe_load_all(text) if d]


def _pod_env(container: dict, configmaps: dict[str, dict]) -> dict[str, str | None]:
    """What a container's env resolves to (a ConfigMap key as kubectl apply of the file would make it; a
    Secret as None)."""
    out: dict[str, str | None] = {}
    for e in container.get("env") or []:
        ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
        out[e["name"]] = configmaps[ref["name"]]["data"][ref["key"]] if ref else e.get("value")
    return out


@pytest.mark.parametrize("stage", [i.name for i in registry.stage_infos()])
def test_job_has_one_place_to_edit(stage):
    """`kubectl apply -f jobs/<stage>.yaml` after editing only the ConfigMap at its top: the stage's config (format,
    source, output, inputs) and the S3 endpoint/region that every Ray container reads from it; no container
    carries its own copy of them."""
    text, docs = _job(stage)
    cm, rj = docs[0], docs[1]
    assert (cm["kind"], rj["kind"]) == ("ConfigMap", "RayJob") and cm["metadata"]["name"] == rj["metadata"]["name"]
    assert "Edit one place, the ConfigMap below" in text
    assert {"MEMSIFTER_S3_ENDPOINT", "AWS_REGION", f"{stage}.yaml"} <= set(cm["data"])
    edited = copy.deepcopy(cm)
    edited["data"]["MEMSIFTER_S3_ENDPOINT"] = "http://seaweedfs.storage.svc:8333"
    edited["data"]["AWS_REGION"] = "eu-west-3"
    spec = rj["spec"]["rayClusterSpec"]
    templates = [spec["headGroupSpec"]["template"], *[g["template"] for g in spec.get("workerGroupSpecs", [])]]
    for tpl in templates:
        for c in tpl["spec"]["containers"]:
            env = _pod_env(c, {cm["metadata"]["name"]: edited})
            assert env["MEMSIFTER_S3_ENDPOINT"] == "http://seaweedfs.storage.svc:8333", c["name"]
            assert env["AWS_REGION"] == "eu-west-3", c["name"]
    head = spec["headGroupSpec"]["template"]["spec"]
    (vol,) = [v for v in head["volumes"] if v["name"] == "config"]
    assert vol["configMap"]["items"] == [{"key": f"{stage}.yaml", "path": f"{stage}.yaml"}]


@pytest.mark.parametrize("stage", [i.name for i in registry.stage_infos()])
def test_job_inputs_optional_when_their_stage_is_not_run(stage):
    """A job's config wires only its required inputs (jobs/evaluate.yaml no longer needs rank, chat and agents
    outputs); the optional ones are listed as comments in the config document, and uncommenting them gives a
    valid config of the stage with those inputs."""
    info = stg.get_stage(stage)
    kinfo = next(i for i in registry.stage_infos() if i.name == stage)
    _, docs = _job(stage)
    doc = docs[0]["data"][f"{stage}.yaml"]
    cfg = yaml.safe_load(doc)
    wired = {i.field: i for i in scenarios.wired(kinfo)}
    optional = {f for f, i in wired.items() if not i.required}
    ran = chart.job_stages(kinfo, registry.stage_infos(), optional=False)
    # an optional input is wired only from a stage its required inputs run anyway (chat: embeddings from the
    # embed stage that rank reads), or where the config cannot do without one (sft: data or traces)
    try:
        info.config.model_validate({k: v for k, v in cfg.items() if k not in optional})
        needs_one = False
    except Exception:
        needs_one = True
    for f in optional & set(cfg):
        assert needs_one or set(wired[f].stages) & set(ran), (stage, f)
    assert info.config.model_validate(cfg)
    if optional:
        uncommented = yaml.safe_load("\n".join(ln[2:] if ln.startswith("# ") else ln for ln in doc.splitlines()
                                               if not ln.startswith("# Optional")))
        assert set(uncommented) - set(cfg) <= optional, stage
        full = info.config.model_validate(uncommented)
        for f in optional:
            assert getattr(full, f), (stage, f)
    if stage == "evaluate":
        assert set(cfg) == {"input", "output"}
