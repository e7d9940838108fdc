"""pipeline: synth → embed → rank → chat → evaluate under one run prefix, on a local directory and
on S3 (SeaweedFS); a crash in the middle of each stage, then re-runs that skip published stages,
resume partial work and end with the same outputs as an uninterrupted run."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from memsifter.testing import faults
from memsifter import pipeline
from memsifter.store import storage
from memsifter.errors import ConfigError


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from memsifter.models.embedding import ensure_ray

    started = not ray.is_initialized()
    ensure_ray()
    yield
    if started:
        ray.shutdown()


def _spec(run: str, endpoint: str, model_dir: str) -> dict:
    return {
        "run": run,
        "stages": {
            "synth": {"questions": 4, "sessions_per_question": 6, "seed": 5},
            "embed": {"model": "all-MiniLM-L6-v2", "bm25": True, "dense": True, "max_batch_size": 4},
            "rank": {"model": model_dir, "engine": "endpoint", "endpoint": {"base_url": endpoint, "model": "tiny"},
                     "context_limit": 2000, "max_tokens": 24, "temperature": 0, "shard_size": 1},
            "chat": {"endpoint": {"base_url": endpoint, "model": "tiny", "max_tokens": 12, "temperature": 0},
                     "tokenizer": model_dir, "context_tokens": 1200, "shard_size": 1},
            "evaluate": {"curve_max_k": 6},
        },
    }


OUTPUT_FILES = {
    "embed": ["rankings.parquet", "rankings_dense.parquet", "rankings_bm25.parquet", "rankings_hybrid.parquet",
              "similarities.parquet"],
    "rank": ["rankings.parquet", "prompts.parquet"],
    "chat": ["answers.parquet"],
}


def _outputs(run: str) -> dict:
    out = {}
    for st, files in OUTPUT_FILES.items():
        for f in files:
            out[f"{st}/{f}"] = storage.read_parquet(storage.join(run, st, f)).to_pylist()
    rep = json.loads(storage.read_text(storage.join(run, "evaluate", "report.json")))
    rep["dataset"].pop("uri")
    for section in ("retrieval", "answers"):
        for v in rep[section].values():
            v.pop("source")
    out["evaluate/report.json"] = rep
    return out


def test_wiring_and_errors():
    plan = dict(pipeline.wire({"run": "s3://b/r", "stages": {"synth": {}, "embed": {}, "rank": {}, "chat": {},
                                                               "evaluate": {}}}))
    assert plan["embed"]["input"] == "s3://b/r/synth" and plan["rank"]["embeddings"] == "s3://b/r/embed"
    assert plan["chat"]["rankings"] == "s3://b/r/rank" and plan["chat"]["embeddings"] == "s3://b/r/embed"
    assert plan["evaluate"]["rankings"] == ["s3://b/r/embed", "s3://b/r/rank"]
    assert plan["evaluate"]["answers"] == ["s3://b/r/chat"]
    no_rank = dict(pipeline.wire({"run": "r", "dataset": "d", "stages": {"embed": {}, "chat": {}}}))
    assert no_rank["chat"]["rankings"] == "r/embed" and no_rank["embed"]["input"] == "d"
    with pytest.raises(ConfigError, match="dataset"):
        pipeline.wire({"run": "r", "stages": {"embed": {}}})
    with pytest.raises(ConfigError, match="unknown"):
        pipeline.wire({"run": "r", "stages": {"synth": {}, "embedd": {}}})
    with pytest.raises(ConfigError, match="run prefix"):
        pipeline.wire({"stages": {"synth": {}}})


def test_named_instances_of_one_stage():
    """Two rankers in one run: sections named freely with ``uses: STAGE``; each publishes to
    <run>/<name>; an input may name the instance it reads; one ambiguous input is one line."""
    stages = {"synth": {}, "embed": {}, "rank": {"model": "base"},
              "rank-trained": {"uses": "rank", "model": "adapter"},
              "chat": {"rankings": "rank-trained"}, "evaluate": {}}
    steps = pipeline.plan({"run": "s3://b/r", "stages": stages})
    assert [(s.name, s.stage) for s in steps] == [
        ("synth", "synth"), ("embed", "embed"), ("rank", "rank"), ("rank-trained", "rank"), ("chat", "chat"),
        ("evaluate", "evaluate")]
    by = {s.name: s.config for s in steps}
    assert "uses" not in by["rank-trained"] and by["rank-trained"]["model"] == "adapter"
    assert by["rank-trained"]["output"] == "s3://b/r/rank-trained"
    assert by["rank-trained"]["embeddings"] == "s3://b/r/embed"          # wired as for the first instance
    assert by["chat"]["rankings"] == "s3://b/r/rank-trained"             # the instance it names
    # evaluate reads every instance of its producers when left out, or the ones it names, in its order
    assert by["evaluate"]["rankings"] == ["s3://b/r/embed", "s3://b/r/rank", "s3://b/r/rank-trained"]
    lines = pipeline.brief(steps)   # `memsifter pipeline show --brief`
    assert lines[3].split() == ["rank-trained", "rank", "->", "s3://b/r/rank-trained", "reads", "input=synth",
                                "embeddings=embed"]
    assert lines[-1].endswith("reads input=synth rankings=embed,rank,rank-trained answers=chat")
    named = pipeline.plan({"run": "r", "stages": {**stages, "evaluate": {"rankings": ["rank-trained", "embed",
                                                                                      "./rank", "s3://x/y"]}}})
    assert named[-1].config["rankings"] == ["r/rank-trained", "r/embed", "./rank", "s3://x/y"]
    compare = pipeline.plan({"run": "r", "stages": {**stages, "chat": {"rankings": "rank", "compare": [
        "rank-trained", "embed/rankings_dense.parquet"]}}})
    assert [s.config for s in compare if s.name == "chat"][0]["compare"] == ["r/rank-trained",
                                                                            "r/embed/rankings_dense.parquet"]
    # an instance listed before its producer still runs after it
    later = pipeline.plan({"run": "r", "stages": {"evaluate": {"rankings": ["late"]}, "late": {"uses": "rank"},
                                                  "synth": {}, "embed": {}}})
    assert [s.name for s in later] == ["synth", "embed", "late", "evaluate"]
    for bad, words in [
        ({**stages, "chat": {}}, "chat.rankings could read the output of rank or of rank-trained: name one"),
        ({**stages, "rank-trained": {"uses": "rnak"}}, "stages.rank-trained.uses: unknown stage 'rnak' (did you mean 'rank'?)"),
        ({**stages, "embed": {"uses": "rank"}}, "the section named after stage embed runs embed"),
        ({**stages, "Rank_2": {"uses": "rank"}}, "an instance name is 1-40 lowercase"),
        ({**stages, "rank-trained": {"uses": "rank", "embeddings": "rank-trained"}}, "reads its own output"),
        ({"synth": {}, "rnk": {}}, "unknown stage 'rnk'"),
        ({**stages, "chat": {"rankings": "synth"}}, "chat.rankings: synth runs synth, which this input does not read"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            pipeline.plan({"run": "r", "stages": bad})


def test_pipeline_crash_resume_identical(s3_root, tmp_path, vllm_endpoint, tiny_model_dir, ray_local, monkeypatch,
                                         capsys):
    """An uninterrupted run on a local directory, then the same pipeline on S3 crashing in each stage in turn:
    its outputs equal the first's (both stores, one pipeline run each)."""
    # 1) uninterrupted run on a local directory, through the CLI with a config file stored on S3
    clean = str(tmp_path / "clean")
    cfg_uri = storage.join(s3_root, "pipeline.yaml")
    storage.write_bytes(cfg_uri, yaml.safe_dump(_spec("ignored", vllm_endpoint, tiny_model_dir)).encode())
    assert pipeline.main(["run", "--config", cfg_uri, "--run", clean, "-q"]) == 0
    assert "report:" in capsys.readouterr().out
    assert json.loads(storage.read_text(storage.join(clean, "pipeline.json")))["stages"]["evaluate"]["skipped"] is False
    expected = _outputs(clean)
    assert len(expected["rank/rankings.parquet"]) == 4 and len(expected["chat/answers.parquet"]) == 4

    # 2) the same pipeline elsewhere, crashing in the middle of each stage in turn
    spec = _spec(storage.join(s3_root, "crashy"), vllm_endpoint, tiny_model_dir)
    log: list[str] = []
    for stage in ("embed", "rank", "chat", "evaluate"):
        monkeypatch.setenv("MEMSIFTER_CRASH_AFTER", f"{stage}:1")
        log.append(f"--- crash in {stage}")
        with pytest.raises(faults.InjectedCrash):
            pipeline.run_pipeline(spec, echo=log.append)
        assert not storage.exists(storage.join(spec["run"], stage, "_SUCCESS"))
    monkeypatch.delenv("MEMSIFTER_CRASH_AFTER")
    log.append("--- final")
    results = pipeline.run_pipeline(spec, echo=log.append)
    text = "\n".join(log)
    # published stages were never redone: each stage ran to completion exactly once
    for stage in ("synth", "embed", "rank", "chat", "evaluate"):
        assert sum(1 for line in log if line.startswith(f"[pipeline] {stage} ") and "done in" in line) == 1, text
    assert all(results[s].get("skipped") for s in ("synth", "embed", "rank", "chat")), text
    # partial work was resumed, not redone
    embed_stats = storage.read_manifest(storage.join(spec["run"], "embed"))["stats"]
    assert embed_stats["reused"] > 0 and embed_stats["embedded"] < embed_stats["texts"]
    assert storage.read_manifest(storage.join(spec["run"], "rank"))["stats"]["resumed"] == 1
    assert storage.read_manifest(storage.join(spec["run"], "chat"))["stats"]["resumed"] == 1
    # ... and the outputs equal the uninterrupted run's
    got = _outputs(spec["run"])
    for key in expected:
        assert got[key] == expected[key], key
    # 3) a re-run of a finished pipeline does nothing
    again = pipeline.run_pipeline(spec, echo=lambda s: None)
    assert all(m.get("skipped") for m in again.values())


def test_demo_config_is_valid(tmp_path):
    """The demo's pipelines (configs/demo.yaml, synthetic and real, with and without answers) wire and
    validate: two rank instances (the untrained base and the trained adapter), chat answering with the
    base's rankings and, side by side, the adapter's, dense, the default first stage and both baselines;
    evaluate scoring every instance. demo.py runs this plan as it is (no stage by hand)."""
    from memsifter import demo
    from memsifter.stage import load_config_file, validate_config

    specs = [load_config_file(demo.config_path()),
             demo.demo_spec(str(tmp_path / "run"), 5, "vllm", 3),
             demo.demo_spec("s3://bucket/demo", 5, "endpoint", 3)]
    for spec in specs:
        steps = pipeline.plan(spec)
        assert [(s.name, s.stage) for s in steps] == [("synth", "synth"), ("embed", "embed"), ("rank", "rank"),
                                                     ("rank-trained", "rank"), ("chat", "chat"),
                                                     ("evaluate", "evaluate")]
        for step in steps:
            validate_config(step.stage, step.config)
    run = tmp_path / "run"
    plan = dict(pipeline.wire(specs[1]))
    chat, trained = plan["chat"], plan["rank-trained"]
    assert chat["rankings"] == str(run / "rank") and chat["limit"] == 3
    assert chat["compare"] == [str(run / "rank-trained"), str(run / "embed" / "rankings_dense.parquet"),
                               str(run / "embed")]
    assert chat["baselines"] == ["none", "oracle", "random"] and chat["endpoint"]["model"] == demo.MODEL
    assert trained["model"] == demo.TRAINED and trained["engine"] == "vllm" and trained["limit"] == 3
    assert trained["embeddings"] == str(run / "embed") and trained["prompt_style"] == "direct"
    assert plan["evaluate"]["rankings"] == [str(run / "embed"), str(run / "rank"), str(run / "rank-trained")]
    real = demo.real_spec(str(tmp_path / "d"), *demo.REAL[1], 2, 0)
    assert [n for n, _ in pipeline.wire(real)] == ["import", "embed", "evaluate"]  # first stage only
    untrained = dict(pipeline.wire(demo.demo_spec(str(run), 5, "endpoint", 3, trained=False)))
    assert "rank-trained" not in untrained and untrained["chat"]["compare"] == chat["compare"][1:]


def test_one_pipeline_per_run(tmp_path):
    """A second pipeline (or a driver) of a run that a live one holds is refused, naming the holder."""
    from memsifter.store import lease
    from memsifter.pipeline import run_pipeline

    run = str(tmp_path / "run")
    spec = {"run": run, "stages": {"synth": {"questions": 2, "sessions_per_question": 3}}}
    held = lease.Lease(storage.join(run, "_run"), purpose="pipeline", ttl=30).acquire().start()
    try:
        with pytest.raises(lease.LeaseHeldError, match=f"pid {held.holder['pid']}"):
            run_pipeline(spec, echo=lambda s: None)
        assert not storage.exists(storage.join(run, "synth"))
    finally:
        held.release()
    out = run_pipeline(spec, echo=lambda s: None)
    assert out["synth"]["stage"] == "synth"
    assert not storage.exists(storage.join(run, "_run", lease.LEASE))
