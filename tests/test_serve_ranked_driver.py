"""Issue 46 item 5: ranked mode under load. bench_serve's ``--mode ranked`` (request body, counting ranked answers
apart from fallbacks) and the GPU driver benchmarks/gpu/run_serve_ranked.py (its servers' settings, its detached
config). The GPU run itself is not here: nothing in this file needs a GPU or vLLM."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
sys.path.insert(0, str(REPO / "benchmarks"))
driver = importlib.import_module("run_serve_ranked")
bench_serve = importlib.import_module("bench_serve")


def _serve_config(sets: list[str]):
    """What `memsifter serve --set ...` builds from the options (memsifter.service.cli.build_config + load_config)."""
    from memsifter.service.cli import build_config
    from memsifter.service.config import load_config

    ns = argparse.Namespace(config=None, index="/idx/embed", dataset="/idx/data", state="/idx/state", host=None,
                            port=8123, set=sets)
    return load_config(build_config(ns))


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "/root/gpu-serve-ranked/qwen3-4b-shape"])
def test_driver_server_sets_validate_as_the_service_config(model):
    from memsifter.service.config import RankerSettings

    a = driver.build_parser().parse_args(["run", "--set", "ranker.max_batch_size=4", "--set", "limits.max_topk=50"])
    sets = driver.server_sets(model, a)
    cfg = _serve_config(sets)
    r = cfg.ranker
    assert isinstance(r, RankerSettings)
    assert r.engine == "vllm" and r.model == model and r.constrained_output is True
    assert r.prompt_style == "direct" and r.context_limit == 6144 and r.max_tokens == 128 and r.candidates == 50
    assert r.max_batch_size == 4   # a --set extra wins over the driver's own (16)
    assert r.vllm.gpu_memory_utilization == 0.8 and cfg.limits.ranker_timeout_s == 120 and cfg.limits.max_topk == 50
    # the bench's servers get them through BENCH_SERVE_SET, split back like a shell line
    env = driver.bench_env(a, sets, env={})
    assert shlex.split(env["BENCH_SERVE_SET"]) == [x for s in sets for x in ("--set", s)]
    # the bench adds its own on the same command line: still one valid config
    both = _serve_config(["reuse_query_vectors=false", "reload_poll_s=0", "auth.anonymous={read: ['*']}", *sets])
    assert both.ranker == r and both.reuse_query_vectors is False
    no = driver.build_parser().parse_args(["run", "--no-constrained"])
    assert _serve_config(driver.server_sets(model, no)).ranker.constrained_output is False


def test_driver_runs_bench_serve_in_ranked_mode_on_the_sample(tmp_path):
    a = driver.build_parser().parse_args(["run", "--work", str(tmp_path), "--levels", "1,8", "--sample", "5"])
    cmd = driver.bench_command(a, str(tmp_path / "out"))
    args = bench_serve_parser_args(cmd[2:])
    assert cmd[1].endswith("benchmarks/bench_serve.py")
    assert args["--mode"] == "ranked" and args["--sample"] == "5" and args["--servers"] == "serve,local"
    assert args["--levels"] == "1,8" and args["--work"] == str(tmp_path / "bench")
    assert driver.MODELS["smollm2"] == "smollm2-135m-instruct"
    from memsifter.models import registry

    assert registry.lookup(driver.MODELS["smollm2"]) is not None
    with pytest.raises(SystemExit):
        driver.model_for("gpt-9", a)


def bench_serve_parser_args(argv: list[str]) -> dict:
    return {k: v for k, v in zip(argv[::2], argv[1::2])}


def test_driver_puts_the_carried_embed_model_on_the_path_only_when_it_is_missing(tmp_path, monkeypatch):
    a = driver.build_parser().parse_args(["run", "--embed-site", str(tmp_path)])
    (tmp_path / driver.EMBED_PACKAGE).mkdir()
    monkeypatch.setattr(driver.importlib.util, "find_spec", lambda name: None)
    assert driver.bench_env(a, [], env={"PYTHONPATH": "/site"})["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/site"
    monkeypatch.setattr(driver.importlib.util, "find_spec", lambda name: object())
    assert driver.bench_env(a, [], env={"PYTHONPATH": "/site"})["PYTHONPATH"] == "/site"


def test_serve_ranked_detached_config_loads_and_starts_the_driver():
    from memsifter.runs import detached

    cfg = detached.load(str(REPO / "benchmarks" / "gpu" / "configs" / "serve_ranked.yaml"))
    argv = detached.argv(cfg)
    assert argv[0] == sys.executable and argv[1] == "benchmarks/gpu/run_serve_ranked.py"
    a = driver.build_parser().parse_args(argv[2:])
    assert a.what == "run" and a.out == cfg.dir and a.work == cfg.work
    assert a.models.split(",") == list(driver.MODELS) and a.servers == "serve,local" and a.levels == "1,8,32"
    assert set(cfg.collect) == {"serve.md", "serve.json"}


def test_bench_serve_ranked_request_body_carries_the_mode():
    assert bench_serve.request_body("what did I buy?", "ranked") == {
        "queries": ["what did I buy?"], "topk": bench_serve.TOPK, "return_scores": True, "mode": "ranked"}
    # first_stage: the request the benchmark always sent (no mode field)
    assert bench_serve.request_body("q") == {"queries": ["q"], "topk": bench_serve.TOPK, "return_scores": True}
    with pytest.raises(ValueError):
        bench_serve.request_body("q", "reranked")
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--mode", "nope"], check=False,
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--mode" in p.stderr


def test_bench_serve_counts_a_fallback_as_a_fallback():
    out = bench_serve.ranker_outcome
    assert out({"result": [[]], "ranker": [{"status": "ok", "reason": None}]}) == ("ranked", None)
    assert out({"result": [[]], "ranker": [{"status": "fallback", "reason": "ranker timed out after 5s"}]}) == \
        ("fallback", "ranker timed out after 5s")
    assert out({"result": [[]]}) == ("unmarked", None)   # a server that ignores the mode (the baseline)


def test_combined_table_names_models_and_counts(tmp_path):
    a = driver.build_parser().parse_args(["run"])
    level = {"clients": 8, "qps": 12.5, "ranked": 240, "fallback": 10, "ranked_per_s": 12.0, "p50_ms": 600.0,
             "p90_ms": 700.0, "p99_ms": 900.0, "errors": 0, "fallback_reasons": {"ranker timed out after 120s": 10}}
    res = {"date": "d", "gpu": "NVIDIA H100", "args": vars(a), "common_sets": driver.server_sets("M", a)[1:],
           "runs": {"smollm2": {"model": "smollm2-135m-instruct", "exit": 0, "wall_s": 100.0,
                                "result": {"levels": {"serve": [level]}, "servers": {"serve": {"ready_seconds": 90.0}}}}}}
    md = driver.combined_md(res)
    assert "| smollm2 | serve | 8 | 12.5 | 240 | 10 | 12.0 | 600.0 | 700.0 | 900.0 | 0 |" in md
    assert "ranker timed out after 120s (10)" in md and "serve 90.0 s" in md


@pytest.mark.slow
def test_bench_serve_ranked_without_a_ranker_reports_every_answer_as_a_fallback(tmp_path):
    """One real run (~75 s on 2 cores): the shipped sample's first question, the no-Ray server with no ranker
    configured, 1 client for 3 s in ranked mode. Every answer is the first stage's: all counted as fallbacks,
    none as ranked, in serve.json and serve.md."""
    out = tmp_path / "out"
    env = {**os.environ, "BENCH_SERVE_SET": "--set limits.ranker_timeout_s=5"}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_serve.py"), "--mode", "ranked", "--sample", "1",
                        "--servers", "local", "--levels", "1", "--seconds", "3", "--warmup", "1",
                        "--work", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=str(REPO), check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((out / "serve.json").read_text())
    assert res["args"]["mode"] == "ranked" and res["server_sets"] == ["--set", "limits.ranker_timeout_s=5"]
    (row,) = res["levels"]["local"]
    assert row["errors"] == 0 and row["requests"] > 0
    assert row["ranked"] == 0 and row["ranked_per_s"] == 0
    assert row["fallback"] == row["requests"] and row["unmarked"] == 0
    assert row["fallback_reasons"] == {"no ranker is configured": row["requests"]}
    md = (out / "serve.md").read_text()
    assert "ranked mode" in md and f"| local | 1 | {row['qps']:.1f} | 0 | {row['requests']} | 0.0 |" in md
