"""How the chart learns about stages from the registry: input wiring and multi-node capacity."""

from __future__ import annotations

from pydantic import BaseModel, Field

from memsifter.k8s import registry
from memsifter.stage import Stage, StageConfig, uri_field


class Cfg(StageConfig):
    dataset: str = uri_field("published dataset", stage=("import", "synth"))
    sims: list[str] = uri_field("similarity order", [], stage="embed")
    ranks: list[str] = uri_field("rankings to score", [], stage=("embed", "rank"), wire="all")
    previous: list[str] = uri_field("rankings of an earlier ranker", [], stage="rank", wire="none")
    best: str | None = uri_field("the best rankings at hand", None, stage=("rank", "embed"))
    prompt: str | None = uri_field("prompt template file", None)
    source: str = uri_field("a raw file the user names")


def test_wiring_is_read_from_the_declarations():
    st = Stage("x", Cfg, lambda c, o: {}, "chat", "x", module="x")
    wired, unwired = registry.wire_inputs(st, ["import", "synth", "embed", "rank"])
    assert wired == {"dataset": "import", "sims": ["embed"], "ranks": ["embed", "rank"], "best": "rank"}
    assert unwired == ["source"]
    # only producers among the needs are wired (a producer that runs later is an earlier run's output)
    wired, _ = registry.wire_inputs(st, ["import", "embed"])
    assert wired == {"dataset": "import", "sims": ["embed"], "ranks": ["embed"], "best": "embed"}


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
