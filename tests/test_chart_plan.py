"""One plan: the Helm chart wires a stage's inputs exactly as ``memsifter pipeline`` does (issue 30).

For every ``charts/memsifter/ci/*.yaml`` scenario and a table of extra stage combinations, the chart is
rendered with the real helm binary (:func:`memsifter_dev.k8s.chart.render_docs`) and each enabled stage's
config document (its ConfigMap) is compared with what :func:`memsifter.pipeline.wire` gives for the same
enabled stages, stage configs and run root: equal for all, output and wired input URIs included. A
combination the local pipeline refuses (two alternative producers of one input, or a required input that
no enabled stage produces) must make ``helm template`` fail too, naming the stage and the field.

Also: the Kubernetes driver leaves the run record ``memsifter status`` reads (``<run>/_run/plan.json``),
so a Kubernetes run's stages that have not started are listed; checked on a local store.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from memsifter import pipeline, status
from memsifter.errors import ConfigError
from memsifter_dev.k8s import chart
from memsifter_dev.k8s.tools import ToolError

CHART = chart.CHART_DIR
SCENARIOS = sorted((CHART / "ci").glob("*.yaml"))
BUCKET = "memsifter-ci"
# what a user must set for these stages (the ci/ placeholders): no input of another stage among them
USER = {"import": {"format": "longmemeval", "source": f"s3://{BUCKET}/inputs/import/source"},
        "prepare-rl": {"recipe": {"example": {"example": 1}}}}
TRAINING_CHAIN = ["import", "embed", "prepare-rl", "sft", "train", "collect", "merge"]

# name -> (enabled stages, {stage: config overrides}): combinations beyond the ci/ scenarios
COMBOS: dict[str, tuple[list[str], dict]] = {
    "import+embed+evaluate": (["import", "embed", "evaluate"], {}),
    "import+embed+rank+evaluate": (["import", "embed", "rank", "evaluate"], {}),
    "synth+embed+rank+chat+evaluate": (["synth", "embed", "rank", "chat", "evaluate"], {}),
    "training chain": (TRAINING_CHAIN, {}),
    "training without prepare-rl's producers": (["prepare-rl", "sft", "train", "collect", "merge"],
                                                {"prepare-rl": {"datasets": [f"s3://{BUCKET}/old/import"]}}),
    "producer output set by the user": (["import", "embed", "rank", "chat", "evaluate"],
                                        {"embed": {"output": f"s3://{BUCKET}/elsewhere/embed"}}),
    "input set by the user": (["synth", "embed", "evaluate"],
                              {"evaluate": {"rankings": [f"s3://{BUCKET}/old/rank"]}}),
    "chat only over embed": (["import", "embed", "chat"], {}),
}
REFUSED: dict[str, tuple[list[str], dict, list[str]]] = {   # name -> (enabled, configs, words of the error)
    "import and synth together": (["import", "synth", "embed"], {}, ["embed", "input", "import", "synth"]),
    "no producer of a required input": (["embed"], {}, ["embed", "input", "import", "synth"]),
    "rank without embed": (["import", "rank"], {}, ["rank", "embeddings", "embed"]),
}


def combo_values(run_id: str, enabled: list[str], configs: dict) -> dict:
    stages = {}
    for n in enabled:
        cfg = {**copy.deepcopy(USER.get(n, {})), **copy.deepcopy(configs.get(n, {}))}
        stages[n] = {"enabled": True, **({"config": cfg} if cfg else {})}
    return {"run": {"id": run_id}, "s3": {"bucket": BUCKET}, "stages": stages}


def run_root(values: dict) -> str:
    return f"s3://{values['s3']['bucket']}/runs/{values['run']['id']}"


def local_plan(values: dict) -> dict[str, dict]:
    """What `memsifter pipeline` runs for these values: the enabled stages with their configs."""
    enabled = {n: b for n, b in values["stages"].items() if b.get("enabled")}
    spec = {"run": run_root(values), "stages": {n: copy.deepcopy(b.get("config") or {}) for n, b in enabled.items()}}
    return dict(pipeline.wire(spec))


def chart_plan(values: dict) -> dict[str, dict]:
    """The enabled stages' config documents as the chart renders them (one ConfigMap per stage)."""
    docs = chart.render_docs([], values=values, show_only="templates/configmaps.yaml")
    out = {}
    for d in docs:
        stage = d["metadata"]["labels"]["memsifter.io/stage"]
        # the config document, beside the S3 settings the RayJob's containers read (memsifter.runSettings)
        assert set(d["data"]) == {f"{stage}.yaml", "MEMSIFTER_S3_ENDPOINT", "AWS_REGION"}, d["data"].keys()
        out[stage] = yaml.safe_load(d["data"][f"{stage}.yaml"])
    return out


def cases() -> list:
    out = [pytest.param(yaml.safe_load(p.read_text()), id=f"ci/{p.name}") for p in SCENARIOS]
    out += [pytest.param(combo_values(f"c{i}", en, cfgs), id=name)
            for i, (name, (en, cfgs)) in enumerate(COMBOS.items())]
    return out


@pytest.mark.parametrize("values", cases())
def test_chart_wires_like_the_local_pipeline(values):
    want = local_plan(values)
    got = chart_plan(values)
    assert list(got) == sorted(want), "the chart renders a ConfigMap for exactly the enabled stages"
    for name, cfg in want.items():
        assert got[name] == cfg, f"{name}: chart {got[name]} != local {cfg}"


@pytest.mark.parametrize("name", list(REFUSED))
def test_chart_refuses_what_the_local_pipeline_refuses(name):
    enabled, configs, words = REFUSED[name]
    values = combo_values("refused", enabled, configs)
    with pytest.raises(ConfigError):
        local_plan(values)
    with pytest.raises(ToolError) as err:
        chart_plan(values)
    msg = str(err.value)
    assert all(w in msg for w in words), msg


def test_driver_plan_is_listed_by_status(tmp_path):
    """A Kubernetes run (the chart's plan, driven by `memsifter k8s drive`) leaves `_run/plan.json` in the
    shape `memsifter pipeline` writes: `memsifter status` then lists its stages that have not started.
    The RayJobs run on a scripted in-memory backend (no cluster here); the store is a real local one."""
    from memsifter.k8s.driver import DriveError, Driver, Plan

    values = combo_values("st", ["import", "embed", "rank"], {})
    docs = chart.render_docs([], values=values, show_only="templates/driver.yaml")
    plan_doc = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["plan.json"])
    root = str(tmp_path / "store" / "runs" / "st")
    plan_doc["run"]["root"] = root
    for s in plan_doc["stages"]:
        s["config"]["output"] = f"{root}/{s['name']}"

    class FailFirst:   # the first RayJob fails at once: nothing is published, later stages never start
        created: set = set()

        def get(self, name):
            return {"metadata": {"name": name}, "status": {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}} \
                if name in self.created else None

        def create(self, rj):
            self.created.add(rj["metadata"]["name"])

        def delete(self, name):
            self.created.discard(name)

        def logs_hint(self, name):
            return "-"

    drv = Driver(Plan.from_dict(plan_doc), FailFirst(), poll=0, check_configs=False,
                 is_published=lambda st: (False, "not published"), lease_wait=0, sleep=lambda s: None)
    with pytest.raises(DriveError):
        drv.run()
    record = json.loads((tmp_path / "store" / "runs" / "st" / "_run" / "plan.json").read_text())
    assert set(record) == {"run", "run_id", "started_at", "stages"} and record["run"] == root
    assert record["stages"] == [{"stage": n, "uses": n, "output": f"{root}/{n}"} for n in ("import", "embed", "rank")]
    report = status.run_status(root)
    assert report["planned"]
    assert [(s["stage"], s["state"]) for s in report["stages"]] == \
        [("import", "not started"), ("embed", "not started"), ("rank", "not started")]
