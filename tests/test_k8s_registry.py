"""How the chart learns about stages from the registry: input wiring and multi-node capacity."""

from __future__ import annotations

from pydantic import BaseModel, Field

from memsifter.k8s import registry
from memsifter.stage import StageConfig


def test_wiring_table_is_what_the_pipeline_does():
    """files/stages.json's wiring comes from memsifter.pipeline.wire, per set of enabled producers: the first
    producer that runs, every one for wire="all", nothing from a stage that does not run, a refusal (the
    chart's one-line message) for two alternatives or for a required input that nobody produces."""
    infos = {i.name: i for i in registry.stage_infos()}
    ev = infos["evaluate"].wiring
    assert ev["rankings"] == {"from": ["embed", "rank"], "list": True, "cases": {
        "": [], "embed": ["embed"], "rank": ["rank"], "embed,rank": ["embed", "rank"]}}
    assert ev["answers"]["cases"] == {"": [], "chat": ["chat"], "agents": ["agents"],   # wire="all": every one
                                      "chat,agents": ["chat", "agents"]}
    emb = infos["embed"].wiring["input"]
    assert emb["from"] == ["import", "synth"] and emb["cases"]["import"] == ["import"]
    assert emb["cases"]["synth"] == ["synth"]
    assert "stages.embed.config.input could read the output of import or of synth" in emb["cases"]["import,synth"]
    assert "stages.embed needs the output of import or synth" in emb["cases"][""]
    assert infos["chat"].wiring["rankings"]["cases"]["rank,embed"] == ["rank"]   # rank's if there, else embed's
    # wire="none" fields are never filled; a producer that runs later (collect for train) is not a candidate
    assert "compare" not in infos["chat"].wiring and "init_adapter" not in infos["train"].wiring
    # inputs: what each field reads when all its producers could run (the chart README's summary)
    assert infos["evaluate"].inputs == {"input": "import", "rankings": ["embed", "rank"],
                                        "answers": ["chat", "agents"]}
    assert infos["import"].unwired == ["source"]


class Inner(BaseModel):
    nnodes: int = 2
    n_gpus_per_node: int = 4


class Nested(StageConfig):
    trainer: Inner = Field(default_factory=Inner)


def test_capacity_fields_found_in_nested_configs():
    assert registry._find_path(Nested, "nnodes") == "trainer.nnodes"
    assert registry._default_at(Nested, "trainer.n_gpus_per_node") == 4


