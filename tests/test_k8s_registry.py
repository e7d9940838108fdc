"""How the chart learns about stages from the registry: input wiring and multi-node capacity."""

from __future__ import annotations

from pydantic import BaseModel, Field

from memsifter.k8s import registry
from memsifter.stage import StageConfig, uri_field


def test_named_producers():
    stages = ["import", "synth", "embed", "rank", "prepare-rl", "collect", "chat"]
    f = registry._named_producers
    assert f("published datasets (import/synth outputs)", stages) == ["import", "synth"]
    assert f("rankings (rank or embed output, or a rankings parquet file)", stages) == ["rank", "embed"]
    assert f("rankings to score: stage outputs (embed, rank) or parquet files", stages) == ["embed", "rank"]
    assert f("prepare-rl output (train_*.parquet)", stages) == ["prepare-rl"]
    assert f("a collect output: average its steps", stages) == ["collect"]
    assert f("embed stage output", stages) == ["embed"]
    assert f("Hugging Face model directories", stages) == []


class Cfg(StageConfig):
    dataset: str = uri_field("published dataset")
    sims: list[str] = uri_field("embed outputs (similarity order)", [])
    ranks: list[str] = uri_field("rankings: stage outputs (embed, rank)", [])
    previous: list[str] = uri_field("rank outputs of an earlier ranker", [])
    explicit: str = Field("", json_schema_extra={"uri": True, "stage": "synth"})
    prompt: str | None = uri_field("prompt template file", None)


def test_wiring_rules():
    needs_of = {"import": [], "synth": [], "embed": ["import"], "rank": ["import", "embed"],
                "x": ["rank"], "other": ["embed"]}
    fields = registry._field_infos(Cfg)
    wired, unwired = registry.wire_inputs("x", ["rank"], fields, Cfg, {"import", "synth"}, needs_of)
    assert wired == {"dataset": "import", "sims": ["embed"], "ranks": ["embed", "rank"], "previous": ["rank"],
                     "explicit": "synth"}
    assert unwired == []
    # only upstream stages are wired: for a stage that does not depend on rank, 'previous' stays empty
    wired, _ = registry.wire_inputs("other", ["embed"], fields, Cfg, {"import", "synth"}, needs_of)
    assert "previous" not in wired and wired["ranks"] == ["embed"]


class Inner(BaseModel):
    nnodes: int = 2
    n_gpus_per_node: int = 4


class Nested(StageConfig):
    trainer: Inner = Field(default_factory=Inner)


def test_capacity_fields_found_in_nested_configs():
    assert registry._find_path(Nested, "nnodes") == "trainer.nnodes"
    assert registry._default_at(Nested, "trainer.n_gpus_per_node") == 4


def test_topo_order_keeps_given_order_for_ties():
    assert registry.topo_order({"b": [], "a": [], "c": ["a", "b"]}) == ["b", "a", "c"]
