"""How the chart learns about stages from the registry: the inputs a plan fills, multi-node capacity."""

from __future__ import annotations

from pydantic import BaseModel, Field

from memsifter.k8s import registry
from memsifter.stage import StageConfig


def test_registry_wires_nothing():
    """The Kubernetes layer keeps no wiring of its own (a run's wiring is memsifter.pipeline.plan's, deployed by
    the chart as it is): per stage it knows only which input fields a plan may fill from another stage, and the
    required fields a plan cannot fill (the user sets them)."""
    infos = {i.name: i for i in registry.stage_infos()}
    assert infos["evaluate"].wired == ["input", "rankings", "answers"]
    assert infos["embed"].wired == ["input"] and infos["import"].wired == []
    # wire="none" fields are never filled; a producer that runs later (collect for train) is not a candidate
    assert "compare" not in infos["chat"].wired and "init_adapter" not in infos["train"].wired
    assert infos["import"].required_user_fields == ["format", "source"]
    assert not hasattr(registry, "wire_cases") and not hasattr(infos["embed"], "wiring")


class Inner(BaseModel):
    nnodes: int = 2
    n_gpus_per_node: int = 4


class Nested(StageConfig):
    trainer: Inner = Field(default_factory=Inner)


def test_capacity_fields_found_in_nested_configs():
    assert registry._find_path(Nested, "nnodes") == "trainer.nnodes"
    assert registry._default_at(Nested, "trainer.n_gpus_per_node") == 4


