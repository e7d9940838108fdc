"""Wiring is declared once, on the input fields (``uri_field(stage=...)``): a stage's needs, the pipeline
order, the chart's wiring and ``memsifter pipeline`` follow from those declarations and nothing else.

A throwaway stage registered here (and made part of the installation by adding this module to
``STAGE_PACKAGES``) shows it: it lands after the stage it reads from, the pipeline and the chart fill
its input with that stage's output, and changing the field's declaration moves all of that with it."""

from __future__ import annotations

import json

import pytest

from memsifter import pipeline
from memsifter.store import storage
from memsifter import stage as stg
from memsifter.data.model import read_dataset
from memsifter.errors import ConfigError
from memsifter.k8s import registry


class ProbeConfig(stg.StageConfig):
    dataset: str = stg.uri_field("published dataset", stage=("import", "synth"))
    sims: str | None = stg.uri_field("an embed output", None, stage="embed")
    note: str | None = stg.uri_field("a file the user names", None)


@stg.stage("aa-probe", ProbeConfig, family="chat", help="throwaway stage that reads embed's output")
def run_probe(config: ProbeConfig, out: storage.Publication) -> dict:
    ds = read_dataset(config.dataset)
    out.write_json("probe.json", {"questions": len(ds.questions), "sims": config.sims})
    return {"questions": len(ds.questions)}


@pytest.fixture
def probe(monkeypatch):
    """The probe stage as part of this installation (as a module of memsifter/stages would be)."""
    monkeypatch.setattr(stg, "STAGE_PACKAGES", (*stg.STAGE_PACKAGES, __name__))
    return stg.get_stage("aa-probe")


def test_needs_order_and_chart_wiring_follow_the_declaration(probe):
    assert probe.needs == ["import", "synth", "embed"]
    order = stg.available_stages()
    # after what it reads, not where its name sorts
    assert order[:4] == ["import", "synth", "embed", "aa-probe"] and order.index("rank") > 3
    (info,) = [i for i in registry.stage_infos() if i.name == "aa-probe"]
    assert info.needs == ["import", "synth", "embed"]
    assert info.wired == ["dataset", "sims"] and info.required_user_fields == []
    # the chart deploys the plan: the probe's step carries the wiring memsifter.pipeline.plan gave it
    from memsifter.k8s.plan import chart_plan

    steps = chart_plan({"run": "s3://b/r", "stages": {"aa-probe": {}, "embed": {}, "synth": {}}})["steps"]
    assert steps[-1] == {"name": "aa-probe", "stage": "aa-probe",
                         "config": {"output": "s3://b/r/aa-probe", "dataset": "s3://b/r/synth", "sims": "s3://b/r/embed"}}


def test_pipeline_wires_the_probe_from_its_fields(probe):
    plan = dict(pipeline.wire({"run": "r", "stages": {"aa-probe": {}, "embed": {}, "synth": {}}}))
    assert list(plan) == ["synth", "embed", "aa-probe"]
    assert plan["aa-probe"] == {"output": "r/aa-probe", "dataset": "r/synth", "sims": "r/embed"}
    # without embed the optional input stays unset; given by the user, it is kept
    assert "sims" not in dict(pipeline.wire({"run": "r", "stages": {"aa-probe": {}, "synth": {}}}))["aa-probe"]
    mine = dict(pipeline.wire({"run": "r", "dataset": "d", "stages": {"aa-probe": {"sims": "x"}}}))["aa-probe"]
    assert mine["sims"] == "x" and mine["dataset"] == "d"


def test_changing_the_field_moves_needs_order_and_wiring(probe, monkeypatch):
    extra = ProbeConfig.model_fields["sims"].json_schema_extra
    monkeypatch.setitem(extra, "stage", ["rank"])            # sims now reads a rank output
    assert probe.needs == ["import", "synth", "rank"]
    order = stg.available_stages()
    assert order.index("aa-probe") == order.index("rank") + 1
    (info,) = [i for i in registry.stage_infos() if i.name == "aa-probe"]
    assert info.needs == ["import", "synth", "rank"] and info.wired == ["dataset", "sims"]
    plan = dict(pipeline.wire({"run": "r", "stages": {"synth": {}, "embed": {}, "rank": {}, "aa-probe": {}}}))
    assert plan["aa-probe"]["sims"] == "r/rank" and list(plan)[-1] == "aa-probe"
    # the required dataset declared as an embed output: without an embed stage the pipeline says so
    monkeypatch.setitem(ProbeConfig.model_fields["dataset"].json_schema_extra, "stage", ["embed"])
    with pytest.raises(ConfigError, match=r"aa-probe needs the output of embed \(aa-probe.dataset\)"):
        pipeline.wire({"run": "r", "stages": {"synth": {}, "aa-probe": {}}})


def test_run_a_slice_then_the_rest(probe, tmp_path, capsys):
    run = str(tmp_path / "run")
    spec = {"run": run, "stages": {"synth": {"questions": 3, "sessions_per_question": 4, "seed": 1}, "aa-probe": {}}}
    first = pipeline.run_pipeline(spec, until="synth", echo=lambda s: None)
    assert list(first) == ["synth"] and not storage.exists(storage.join(run, "aa-probe"))
    # --from: the probe's input is synth's published output in the run
    assert pipeline.main(["run", "--config", _write(tmp_path, spec), "--from", "aa-probe", "-q"]) == 0
    got = json.loads(storage.read_text(storage.join(run, "aa-probe", "probe.json")))
    assert got == {"questions": 3, "sims": None}
    # the run's summary keeps the first part's stages beside the second's
    summary = json.loads(storage.read_text(storage.join(run, "pipeline.json")))
    assert sorted(summary["stages"]) == ["aa-probe", "synth"]
    assert summary["stages"]["synth"]["output"] == storage.join(run, "synth")


def _write(tmp_path, spec: dict) -> str:
    p = tmp_path / "pipeline.json"
    p.write_text(json.dumps(spec))
    return str(p)


# --------------------------------------------------------------------------- the shipped stages
def test_training_stages_are_a_pipeline():
    spec = {"run": "r", "dataset": "d", "stages": {s: {} for s in ("merge", "collect", "train", "sft", "prepare-rl")}}
    spec["stages"]["prepare-rl"] = {"recipe": {"train": {"d": 1}}}
    plan = dict(pipeline.wire(spec))
    assert list(plan) == ["prepare-rl", "sft", "train", "collect", "merge"]
    assert plan["prepare-rl"]["datasets"] == ["d"]
    assert plan["sft"]["data"] == plan["train"]["data"] == "r/prepare-rl"
    assert plan["collect"]["checkpoints"] == "r/train" and plan["merge"]["checkpoints"] == "r/collect"
    assert "init_adapter" not in plan["train"]          # wire="none": the user names the adapter
    for name, cfg in plan.items():
        stg.validate_config(name, cfg)
    part = pipeline.select(list(plan.items()), "train", "collect")
    assert [n for n, _ in part] == ["train", "collect"]
    with pytest.raises(ConfigError, match="comes after"):
        pipeline.select(list(plan.items()), "collect", "sft")
    with pytest.raises(ConfigError, match="not a stage of this pipeline"):
        pipeline.select(list(plan.items()), "embed")


def test_shipped_needs_are_derived():
    needs = {n: st.needs for n, st in stg.available().items()}
    assert needs["embed"] == ["import", "synth"] and needs["rank"] == ["import", "synth", "embed"]
    assert needs["evaluate"] == ["import", "synth", "embed", "agents", "rank", "chat"]
    # train's init_adapter may be an sft output or a collect output; collect reads train's checkpoints,
    # so a collect output can only come from an earlier run: no need, no cycle
    assert needs["train"] == ["prepare-rl", "sft"] and needs["collect"] == ["train"]


def test_two_independent_producers_of_one_input_are_refused():
    with pytest.raises(ConfigError, match="embed.input could read the output of import or of synth"):
        pipeline.wire({"run": "r", "stages": {"import": {}, "synth": {}, "embed": {}}})


def test_derivation_rules():
    assert stg.derive_order({"b": [], "a": [], "c": ["b", "a"], "d": ["c", "zz"]}) == ["a", "b", "c", "d"]
    with pytest.raises(ConfigError, match="dependency cycle"):
        stg.derive_order({"a": ["b"], "b": ["a"]})
    # ties by a key: the plan keeps the stages' order, then the order written
    assert stg.derive_order({"b": [], "a": [], "c": ["a"]}, key=["b", "c", "a"].index) == ["b", "a", "c"]
    assert stg.upstream("d", {"d": ["c"], "c": ["b", "a"], "a": []}) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="wire"):
        stg.uri_field("x", stage="embed", wire="some")
    with pytest.raises(ValueError, match="list field"):
        class Bad(stg.StageConfig):
            x: str = stg.uri_field("x", stage="embed", wire="all")
        stg.config_inputs(Bad)


def test_unknown_producer_is_an_error(monkeypatch):
    class Typo(stg.StageConfig):
        x: str = stg.uri_field("x", stage="embedd")

    st = stg.Stage("typo-test", Typo, lambda c, o: {}, "chat", "typo", module="x")
    with pytest.raises(ConfigError, match="names unknown stage"):
        stg.derive_needs({**stg.available(), "typo-test": st})
