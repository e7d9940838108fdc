"""One plan: the Helm chart runs what ``memsifter pipeline run`` runs (issue 45 item 2).

The chart takes the plan of the same pipeline config a user gives ``memsifter pipeline run`` (sections,
``uses:`` instances, inputs naming a section), computed once in Python by ``memsifter k8s plan``
(:func:`memsifter.pipeline.plan`), and deploys it as it is. Here the demo config (``memsifter demo``'s, with its
two rank instances) is planned with the CLI, rendered with the real helm binary, and every step's config
document (its ConfigMap, and the driver's plan.json) is compared with the local plan: same sections, same
order, same configs; the named instance deploys as a RayJob of its stage; the RayJobs stay valid against the
KubeRay CRD of ../shared/crds. The driver then runs that plan on a scripted backend (no cluster here) in the
plan's order, checks each step's config with the stage it uses, and leaves the run record ``memsifter status``
reads (``<run>/_run/plan.json``) on a real local store.
"""

from __future__ import annotations

import copy
import json
import shlex

import pytest
import yaml

from memsifter import cli, demo, pipeline, status
from memsifter.k8s import validate
from memsifter.k8s.driver import DriveError, Driver, Plan
from memsifter.k8s.plan import chart_plan
from memsifter.stage import load_config_file
from memsifter_dev.k8s import chart
from memsifter_dev.k8s.tools import ToolError

ROOT = "s3://memsifter-ci/runs/demo"
TEMPLATES = ["templates/configmaps.yaml", "templates/driver.yaml"]


@pytest.fixture(scope="module")
def demo_spec() -> dict:
    spec = load_config_file(demo.config_path())
    assert spec["stages"]["rank-trained"]["uses"] == "rank"   # the demo's second rank instance
    return spec


@pytest.fixture(scope="module")
def rendered(demo_spec, tmp_path_factory) -> tuple[list, list[dict]]:
    """(the local plan, the chart's documents) of the demo config: planned with `memsifter k8s plan`, rendered
    with `helm template -f plan.yaml`."""
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    assert cli.main(["k8s", "plan", "--config", demo.config_path(), "--run", ROOT, "-o", str(out)]) == 0
    docs = chart.render_docs([out], show_only=TEMPLATES)
    return pipeline.plan(demo_spec, ROOT), docs


def step_configs(docs: list[dict]) -> dict[str, dict]:
    """Section -> its config document, from the rendered ConfigMaps (one per step)."""
    out = {}
    for d in docs:
        if d["kind"] == "ConfigMap" and "plan.json" not in d["data"]:
            name = d["metadata"]["labels"]["memsifter.io/stage"]
            assert set(d["data"]) == {f"{name}.yaml", "MEMSIFTER_S3_ENDPOINT", "AWS_REGION"}, d["data"].keys()
            out[name] = yaml.safe_load(d["data"][f"{name}.yaml"])
    return out


def plan_json(docs: list[dict]) -> dict:
    return json.loads(next(d for d in docs if d["kind"] == "ConfigMap" and "plan.json" in d["data"])["data"]["plan.json"])


def test_chart_deploys_the_local_plan_of_the_demo(rendered):
    local, docs = rendered
    assert [s.name for s in local] == ["synth", "embed", "rank", "rank-trained", "chat", "evaluate"]
    driver = plan_json(docs)
    assert driver["run"]["root"] == ROOT
    assert [(s["name"], s["stage"]) for s in driver["stages"]] == [(s.name, s.stage) for s in local]
    assert [s["config"] for s in driver["stages"]] == [s.config for s in local]
    configs = step_configs(docs)
    assert sorted(configs) == sorted(s.name for s in local)
    for step in local:
        assert configs[step.name] == step.config, step.name
    # inputs naming a section: chat reads the untrained ranker, compares the trained one and embed's files
    chat = configs["chat"]
    assert chat["rankings"] == f"{ROOT}/rank"
    assert chat["compare"] == [f"{ROOT}/rank-trained", f"{ROOT}/embed/rankings_dense.parquet", f"{ROOT}/embed"]
    assert configs["evaluate"]["rankings"] == [f"{ROOT}/embed", f"{ROOT}/rank", f"{ROOT}/rank-trained"]


def test_named_instance_deploys_as_a_rayjob_of_its_stage(rendered, shared_dir):
    _, docs = rendered
    crd = validate.crd_schema(shared_dir / "crds" / "ray.io_rayjobs.yaml")
    jobs = {s["name"]: s["rayjob"] for s in plan_json(docs)["stages"]}
    rj = jobs["rank-trained"]
    assert rj["metadata"]["name"] == "memsifter-rank-trained"
    assert rj["metadata"]["labels"]["memsifter.io/stage"] == "rank-trained"
    assert rj["metadata"]["annotations"]["memsifter.io/uses"] == "rank"
    assert shlex.split(rj["spec"]["entrypoint"]) == ["memsifter", "run", "rank", "--config",
                                                      "/etc/memsifter/rank-trained.yaml"]
    head = rj["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (vol,) = [v for v in head["volumes"] if v["name"] == "config"]
    assert vol["configMap"] == {"name": "memsifter-rank-trained",
                                "items": [{"key": "rank-trained.yaml", "path": "rank-trained.yaml"}]}
    # the same image and GPU worker as the rank stage: the facts of the stage it uses
    assert head["containers"][0]["image"] == \
        jobs["rank"]["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    for name, job in jobs.items():
        errs = validate.validate_kuberay(job, {"RayJob": crd})
        assert errs == [], f"{name}: {errs}"


def test_plan_refuses_what_the_pipeline_refuses(demo_spec, tmp_path, capsys):
    """Nothing is decided in the templates: a config the local pipeline refuses is refused by `memsifter k8s
    plan` (one line, exit 2, nothing written), and so is a run root the pods could not reach."""
    out = tmp_path / "plan.yaml"
    bad = tmp_path / "bad.yaml"
    cases = {
        "two producers of embed's input": ({**demo_spec, "stages": {"import": {"format": "locomo", "source": "x"},
                                                                     **demo_spec["stages"]}}, ["embed.input", "synth"]),
        "an input naming no producer": ({**demo_spec, "stages": {**demo_spec["stages"],
                                                                 "chat": {"rankings": "synth"}}}, ["chat.rankings"]),
        "a misspelt key of a section": ({**demo_spec, "stages": {**demo_spec["stages"],
                                                                 "rank-trained": {"uses": "rank", "modle": "x"}}},
                                        ["rank-trained", "modle"]),
    }
    for what, (spec, words) in cases.items():
        bad.write_text(yaml.safe_dump(spec))
        assert cli.main(["k8s", "plan", "--config", str(bad), "--run", ROOT, "-o", str(out)]) == 2, what
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: pipeline") and all(w in err for w in words), (what, err)
        assert not out.exists()
    assert cli.main(["k8s", "plan", "--config", demo.config_path(), "--run", str(tmp_path / "run")]) == 2
    assert "s3://" in capsys.readouterr().err


def test_chart_checks_the_values_around_the_plan(demo_spec):
    plan = chart_plan(demo_spec, ROOT)
    for values, words in [
        ({"pipeline": plan, "stages": {"rank-traind": {"workers": {"gpus": 2}}}}, ["stages.rank-traind", "rank-trained"]),
        ({"pipeline": {**plan, "steps": plan["steps"] + plan["steps"][-1:]}}, ["evaluate", "twice"]),
        ({"pipeline": {"steps": plan["steps"]}}, ["pipeline.run"]),
    ]:
        with pytest.raises(ToolError) as err:
            chart.render_docs([], values=values, show_only=TEMPLATES)
        assert all(w in str(err.value) for w in words), str(err.value)
    # a section's own block applies to that section only
    docs = chart.render_docs([], values={"pipeline": plan, "stages": {"rank-trained": {"workers": {"gpus": 2}}}},
                             show_only=TEMPLATES)
    jobs = {s["name"]: s["rayjob"] for s in plan_json(docs)["stages"]}

    def gpus(rj: dict) -> int:
        (group,) = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"]
        return group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]

    assert (gpus(jobs["rank-trained"]), gpus(jobs["rank"])) == (2, 1)


def test_serve_index_from_the_plan(demo_spec):
    plan = chart_plan(demo_spec, ROOT)

    def index(p: dict) -> str:
        (rs,) = chart.render_docs([], values={"pipeline": p, "serve": {"enabled": True}},
                                  show_only="templates/rayservice.yaml")
        (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
        return app["args"]["index"]

    assert index(plan) == f"{ROOT}/embed"
    spec = copy.deepcopy(demo_spec)
    spec["stages"]["embed"]["output"] = "s3://memsifter-ci/index/demo"
    assert index(chart_plan(spec, ROOT)) == "s3://memsifter-ci/index/demo"
    two = {"stages": {"synth": {}, "embed": {}, "embed-dense": {"uses": "embed", "dense": True}}}
    with pytest.raises(ToolError, match=r"serve.config.index: the plan has 2 embed sections \(embed, embed-dense\)"):
        index(chart_plan(two, ROOT))


class Scripted:
    """A Kubernetes backend that records the RayJobs created and reports each one done at once (no cluster
    here); ``fail`` names a RayJob that fails instead."""

    def __init__(self, fail: str | None = None):
        self.created: list[str] = []
        self.fail = fail

    def get(self, name):
        if name not in self.created:
            return None
        bad = name == self.fail
        return {"metadata": {"name": name}, "status": {"jobDeploymentStatus": "Failed" if bad else "Complete",
                                                       "jobStatus": "FAILED" if bad else "SUCCEEDED"}}

    def create(self, rj):
        self.created.append(rj["metadata"]["name"])

    def delete(self, name):
        self.created.remove(name)

    def logs_hint(self, name):
        return "-"


def local_plan_doc(docs: list[dict], root: str) -> dict:
    """The rendered plan.json with its run moved to a local store."""
    doc = plan_json(docs)
    text = json.dumps(doc).replace(ROOT, root)
    return json.loads(text)


def test_driver_runs_the_plan_in_its_order(rendered, tmp_path):
    """The driver creates the RayJobs in the plan's order (nothing re-sorted), checks each step's config with
    the stage it uses (rank-trained: rank's), and its status record lists the instances and their stages."""
    local, docs = rendered
    root = str(tmp_path / "store" / "runs" / "demo")
    doc = local_plan_doc(docs, root)
    backend = Scripted()
    drv = Driver(Plan.from_dict(doc), backend, poll=0, lease_wait=0, sleep=lambda s: None,
                 is_published=lambda st: (st.rayjob_name in backend.created, "scripted"))
    manifest = drv.run()
    assert backend.created == [f"memsifter-{s.name}" for s in local]
    assert manifest["order"] == [s.name for s in local]
    assert manifest["stages"]["rank-trained"]["stage"] == "rank"
    record = json.loads((tmp_path / "store" / "runs" / "demo" / "_run" / "plan.json").read_text())
    assert record["stages"] == [{"stage": s.name, "uses": s.stage, "output": f"{root}/{s.name}"} for s in local]

    bad = copy.deepcopy(doc)   # an instance's config is checked against the stage it uses, before anything starts
    next(s for s in bad["stages"] if s["name"] == "rank-trained")["config"]["context_limit"] = -1
    backend = Scripted()
    with pytest.raises(DriveError, match=r"(?s)rank-trained.*stage .rank.*context_limit"):
        Driver(Plan.from_dict(bad), backend, poll=0, write_manifest=False, sleep=lambda s: None).run()
    assert backend.created == []


def test_driver_plan_is_listed_by_status(rendered, tmp_path):
    """A Kubernetes run that stops at its first step still leaves `_run/plan.json` in the shape `memsifter
    pipeline` writes: `memsifter status` lists the steps that have not started."""
    local, docs = rendered
    root = str(tmp_path / "store" / "runs" / "st")
    backend = Scripted(fail="memsifter-synth")
    drv = Driver(Plan.from_dict(local_plan_doc(docs, root)), backend, poll=0, check_configs=False,
                 is_published=lambda st: (False, "not published"), lease_wait=0, sleep=lambda s: None)
    with pytest.raises(DriveError):
        drv.run()
    assert backend.created == ["memsifter-synth"]
    report = status.run_status(root)
    assert report["planned"]
    assert [s["stage"] for s in report["stages"]] == [s.name for s in local]
    assert all(s["state"] in ("not started", "failed") for s in report["stages"])
