"""The stage framework (config hash, skip, atomic publish on error) and the generated CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any, Literal

import pyarrow as pa
import pytest
from pydantic import BaseModel, ConfigDict, Field

from memsifter import cli
from memsifter.store import storage
from memsifter import stage as stg
from memsifter.errors import ConfigError, InputError, NotPublishedError


class EchoConfig(stg.StageConfig):
    text: str = "hi"
    repeat: int = 2
    mode: Literal["upper", "lower"] = "lower"
    tags: list[str] = []
    fail: bool = False
    workers: int = stg.runtime_field(1, "how many workers (does not change the output)")


CALLS = {"n": 0}


@stg.stage("echo-test", EchoConfig, family="chat", help="test stage")
def run(config: EchoConfig, out: storage.Publication) -> dict:
    CALLS["n"] += 1
    text = config.text.upper() if config.mode == "upper" else config.text.lower()
    out.write_table("echo.parquet", pa.table({"t": [text] * config.repeat}))
    if config.fail:
        raise InputError("boom", file="in.json", item="row 3", field="text")
    return {"rows": config.repeat}


@pytest.fixture(autouse=True)
def _register(monkeypatch):
    monkeypatch.setitem(stg.STAGES, "echo-test", run.stage)
    CALLS["n"] = 0


def test_run_publishes_then_skips_same_config(store_root):
    out = storage.join(store_root, "echo")
    m = run({"output": out, "text": "Hey"})
    assert m["stats"] == {"rows": 2} and CALLS["n"] == 1
    assert storage.read_parquet(storage.published_file(out, "echo.parquet")).column("t").to_pylist() == ["hey", "hey"]
    # Same config (runtime fields differ): skipped.
    m2 = run({"output": out, "text": "Hey", "workers": 4})
    assert m2.get("skipped") and CALLS["n"] == 1
    # Different config: refused without replace (a changed flag does not overwrite published work) ...
    with pytest.raises(ConfigError, match="another config.*--replace"):
        run({"output": out, "text": "Hey", "repeat": 3})
    with pytest.raises(ConfigError, match="--replace"):
        run({"output": out, "text": "Hey", "repeat": 3}, force=True)
    assert CALLS["n"] == 1
    # ... and runs again with it.
    run({"output": out, "text": "Hey", "repeat": 3}, replace=True)
    assert CALLS["n"] == 2
    assert storage.read_manifest(out)["stats"] == {"rows": 3}
    # force re-runs.
    run({"output": out, "text": "Hey", "repeat": 3}, force=True)
    assert CALLS["n"] == 3


def test_error_publishes_nothing(store_root):
    out = storage.join(store_root, "failing")
    with pytest.raises(InputError, match="in.json: row 3: field 'text': boom"):
        run({"output": out, "fail": True})
    with pytest.raises(NotPublishedError):
        storage.read_manifest(out)
    # nothing published: only the failed attempt's record, which `memsifter status` shows
    assert storage.list_files(out) == ["_work/failure.json"]
    assert "boom" in storage.read_text(storage.join(out, "_work", "failure.json"))


def test_config_hash_ignores_output_and_runtime():
    a = EchoConfig(output="/a", workers=1)
    b = EchoConfig(output="/b", workers=8)
    assert stg.config_hash(a) == stg.config_hash(b)
    assert stg.config_hash(a) != stg.config_hash(EchoConfig(output="/a", repeat=5))


def test_cli_flags_file_and_set(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("text: FromFile\nrepeat: 1\n")
    out = str(tmp_path / "o")
    rc = cli.main(["run", "echo-test", "--config", str(cfg), "--repeat", "4", "--mode", "upper",
                   "--tags", "a", "b", "--set", "repeat=5", "--output", out, "--print-config"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"output": out, "text": "FromFile", "repeat": 5, "mode": "upper", "tags": ["a", "b"],
                       "fail": False, "workers": 1}
    assert cli.main(["run", "echo-test", "--output", out, "--text", "x"]) == 0
    assert "published" in capsys.readouterr().out
    assert cli.main(["run", "echo-test", "--output", out, "--text", "x"]) == 0
    assert "skipped" in capsys.readouterr().out


def test_cli_bad_config_is_one_clear_error(tmp_path, capsys):
    rc = cli.main(["run", "echo-test", "--output", str(tmp_path / "o"), "--set", "repaet=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "repaet" in err and "Extra inputs are not permitted" in err
    rc = cli.main(["run", "echo-test", "--output", str(tmp_path / "o"), "--set", "repeat=many"])
    assert rc == 2 and "repeat" in capsys.readouterr().err
    rc = cli.main(["run", "echo-test", "--config", str(tmp_path / "missing.yaml"), "--output", "x"])
    assert rc == 2 and "missing.yaml" in capsys.readouterr().err
    rc = cli.main(["run", "no-such-stage"])
    assert rc == 2 and "unknown stage" in capsys.readouterr().err


def test_cli_input_error_exit_code(tmp_path, capsys):
    rc = cli.main(["run", "echo-test", "--output", str(tmp_path / "o"), "--fail"])
    assert rc == 2
    assert "error: in.json: row 3: field 'text': boom" in capsys.readouterr().err


def test_help_for_every_command(capsys):
    assert cli.main(["--help"]) == 0
    assert cli.main(["run", "--help"]) == 0
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "echo-test", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--repeat" in out and "--set" in out
    for sub in (["data", "--help"], ["data", "import", "--help"], ["data", "synth", "--help"],
                ["data", "export", "--help"], ["data", "info", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(sub)
        assert e.value.code == 0


def test_every_registered_stage_has_a_valid_config_schema():
    for name in stg.available_stages():
        st = stg.get_stage(name)
        schema = st.config.model_json_schema()
        assert "output" in schema["properties"], name
        assert st.help and st.family


class ChainConfig(stg.StageConfig):
    input: str = stg.uri_field("upstream output or a raw file")


@stg.stage("chain-test", ChainConfig, family="chat", help="reads an input")
def run_chain(config: ChainConfig, out: storage.Publication) -> dict:
    CALLS["n"] += 1
    out.write_bytes("copy.bin", storage.read_bytes(config.input) if storage.is_file(config.input) else b"")
    return {}


def test_changed_input_is_not_skipped(store_root, monkeypatch):
    monkeypatch.setitem(stg.STAGES, "chain-test", run_chain.stage)
    src = storage.join(store_root, "raw.txt")
    storage.write_bytes(src, b"v1")
    out = storage.join(store_root, "chain")
    run_chain({"input": src, "output": out})
    run_chain({"input": src, "output": out})
    assert CALLS["n"] == 1
    storage.write_bytes(src, b"version-2")  # the raw source changed at the same URI
    run_chain({"input": src, "output": out})
    assert CALLS["n"] == 2
    # A re-published upstream stage output also invalidates the downstream one.
    up = storage.join(store_root, "up")
    run({"output": up})
    run_chain({"input": up, "output": out}, replace=True)   # another input URI: another config
    n = CALLS["n"]
    run_chain({"input": up, "output": out})
    assert CALLS["n"] == n
    run({"output": up, "repeat": 7}, replace=True)
    run_chain({"input": up, "output": out})   # same config, new input content: re-runs, no replace needed
    assert CALLS["n"] == n + 2  # one for the upstream re-run, one for the downstream


def test_nested_runtime_fields_are_not_hashed():
    from memsifter.models.llm import LLMEndpoint

    class WithEndpoint(stg.StageConfig):
        endpoint: LLMEndpoint = LLMEndpoint()

    a = WithEndpoint(output="/a", endpoint=LLMEndpoint(base_url="http://127.0.0.1:1/v1", model="m"))
    b = WithEndpoint(output="/a", endpoint=LLMEndpoint(base_url="http://10.0.0.9:8000/v1", model="m", concurrency=3))
    c = WithEndpoint(output="/a", endpoint=LLMEndpoint(base_url="http://127.0.0.1:1/v1", model="other"))
    assert stg.config_hash(a) == stg.config_hash(b) != stg.config_hash(c)


# --------------------------------------------------------------------------- nested flags
class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")

    depth: int = Field(1, description="how deep")


class Engine(BaseModel):
    """Engine settings."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, description="engine copies")
    base_url: str | None = Field(None, description="server URL (default: env MEMSIFTER_URL)")
    eager: bool | None = None
    kind: Literal["a", "b"] = "a"
    kwargs: dict[str, Any] = Field({}, description="extra engine arguments")
    inner: Inner = Field(default_factory=Inner, description="inner settings")


class NestConfig(stg.StageConfig):
    recipe: dict[str, int] = Field(description="count per split")
    budget: int = Field(5, description="token budget (default: five times the rest)")
    engine: Engine = Field(default_factory=lambda: Engine(replicas=3), description="the engine")
    judge: Engine | None = Field(None, description="optional judge")


@stg.stage("nest-test", NestConfig, family="chat", help="nested settings")
def run_nest(config: NestConfig, out: storage.Publication) -> dict:
    return {}


@pytest.fixture
def nest(monkeypatch, tmp_path):
    monkeypatch.setitem(stg.STAGES, "nest-test", run_nest.stage)
    cfg = tmp_path / "nest.yaml"
    cfg.write_text("output: /o\nrecipe: {train: 2}\nengine: {replicas: 4, kind: b, inner: {depth: 3}}\n")
    return str(cfg)


def _printed(capsys, argv: list[str]) -> dict:
    assert cli.main(argv + ["--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_nested_flags_set_values_and_merge_into_the_config_file(nest, capsys):
    got = _printed(capsys, ["run", "nest-test", "--config", nest, "--engine.replicas", "2",
                            "--engine.base_url", "http://h:1/v1", "--engine.no-eager", "--engine.inner.depth", "9",
                            "--engine.kwargs", '{"a": 1, "b": [2]}', "--judge.kind", "b", "--budget=7"])
    # the file's engine.kind survives the engine flags; judge (unset) is created with its defaults
    assert got["engine"] == {"replicas": 2, "base_url": "http://h:1/v1", "eager": False, "kind": "b",
                             "kwargs": {"a": 1, "b": [2]}, "inner": {"depth": 9}}
    assert got["judge"] == {**Engine().model_dump(), "kind": "b"}
    assert got["budget"] == 7 and got["recipe"] == {"train": 2}
    # - and _ name the same flag; a JSON flag sets a mapping field; flags alone (no file) work too
    got = _printed(capsys, ["run", "nest-test", "--output", "/o", "--recipe", "{train: 1, test: 2}",
                            "--engine.base-url", "u", "--engine.eager"])
    assert got["recipe"] == {"train": 1, "test": 2}
    assert got["engine"] == {**Engine(replicas=3).model_dump(), "base_url": "u", "eager": True}


def test_precedence_defaults_config_flags_set(nest, capsys, tmp_path):
    base = ["run", "nest-test", "--output", "/o", "--recipe", "{a: 1}"]
    assert _printed(capsys, base)["engine"]["replicas"] == 3                              # default
    assert _printed(capsys, base + ["--config", nest])["engine"]["replicas"] == 4         # < --config
    assert _printed(capsys, base + ["--config", nest, "--engine.replicas", "2"])["engine"]["replicas"] == 2
    got = _printed(capsys, base + ["--config", nest, "--engine.replicas", "2", "--set", "engine.replicas=7"])
    assert got["engine"] == {**Engine().model_dump(), "replicas": 7, "kind": "b", "inner": {"depth": 3}}
    # --set in order (last wins) and null unsets an optional setting a flag made
    got = _printed(capsys, base + ["--judge.replicas", "2", "--set", "judge=null", "--set", "budget=1",
                                   "--set", "budget=2"])
    assert got["judge"] is None and got["budget"] == 2
    # a config that sets the parent to null: a nested flag makes it a mapping again
    cfg = tmp_path / "null.yaml"
    cfg.write_text("judge: null\n")
    assert _printed(capsys, base + ["--config", str(cfg), "--judge.replicas", "5"])["judge"]["replicas"] == 5


def test_nested_flag_bad_values_are_one_clear_error(nest, capsys, tmp_path):
    for argv, says in ((["--engine.replicas", "many"], "argument --engine.replicas: invalid int value: 'many'"),
                       (["--engine.kind", "c"], "argument --engine.kind: invalid choice: 'c'"),
                       (["--engine.inner.nope", "1"], "unrecognized arguments: --engine.inner.nope")):
        with pytest.raises(SystemExit) as e:
            cli.main(["run", "nest-test", "--config", nest, *argv])
        assert e.value.code == 2
        assert says in capsys.readouterr().err
    # a value argparse takes but the config does not: the field is named, exit 2
    assert cli.main(["run", "nest-test", "--config", nest, "--engine.kwargs", "[1, 2]"]) == 2
    assert "engine.kwargs: Input should be a valid dictionary" in capsys.readouterr().err
    cfg = tmp_path / "str.yaml"
    cfg.write_text("engine: fast\n")
    assert cli.main(["run", "nest-test", "--config", str(cfg), "--engine.replicas", "2"]) == 2
    assert "--engine.replicas: 'engine' is 'fast', not a mapping" in capsys.readouterr().err
    assert cli.main(["run", "nest-test", "--config", str(cfg), "--set", "engine.inner.depth=2"]) == 2
    assert "--set engine.inner.depth: 'engine' is 'fast', not a mapping" in capsys.readouterr().err


def test_bad_nested_value_exits_2_from_the_shell():
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "run", "rank", "--vllm.replicas", "many"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2 and "argument --vllm.replicas: invalid int value: 'many'" in p.stderr
    assert "Traceback" not in p.stderr


def _help(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_groups_nested_flags_marks_required_and_states_defaults_once(nest, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    text = _help(capsys, ["run", "nest-test"])
    for line in ("engine:\n  the engine\n", "engine.inner:\n  inner settings\n", "judge:\n  optional judge (unset"):
        assert line in text
    assert text.index("--budget") < text.index("engine:") < text.index("--engine.replicas") < text.index("judge:")
    assert "engine copies (default: 3)" in text                        # the parent's default instance
    assert "--engine.eager, --engine.no-eager" in text and "{a,b}" in text
    assert "count per split (required)" in text
    assert "token budget (default: five times the rest)\n" in text      # its own words, not "(default: 5)" too
    assert "server URL (default: env MEMSIFTER_URL)\n" in text
    assert "--engine.kwargs JSON" in text and "extra engine arguments (default: {})" in text

    chat = _help(capsys, ["run", "chat"])
    assert "\nendpoint:\n" in chat and "--endpoint.base-url" in chat and "--judge.model" in chat
    assert "(default: None)" not in chat and "prompt template with {history}, {current} and {date} " \
        "(default: memsifter/prompts/chat.txt)\n" in chat
    prl = _help(capsys, ["run", "prepare-rl"])
    assert re.search(r"--recipe JSON\s+per split.*\(required\)", prl, re.DOTALL)


def test_every_stage_has_a_flag_for_every_leaf_field_with_its_default_once():
    from pydantic import BaseModel as Model

    def leaves(cls, prefix=""):
        for name, f in cls.model_fields.items():
            sub = cli._model_type(f.annotation)
            yield from leaves(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]

    for name in stg.available_stages():
        p = cli.stage_parser(name)
        actions = {a.dest[len(cli.CONFIG_DEST):]: a for a in p._actions if a.dest.startswith(cli.CONFIG_DEST)}
        assert sorted(actions) == sorted(leaves(stg.get_stage(name).config)), name
        for dotted, a in actions.items():
            stated = re.findall(r"(?:^|[(;]\s*)default\b", a.help, re.IGNORECASE)
            assert len(stated) + a.help.endswith("(required)") == 1, (name, dotted, a.help)
            assert "(default: None)" not in a.help and "--" + dotted.replace("_", "-") in a.option_strings
        assert issubclass(stg.get_stage(name).config, Model)
    flags = {o for a in cli.stage_parser("train")._actions for o in a.option_strings}
    assert {"--verl", "--verl-overrides-file", "--no-fast-logprobs", "--reward.mode", "--nnodes"} <= flags
    assert {"--vllm.replicas", "--endpoint.base-url", "--vllm.engine-kwargs"} <= {
        o for a in cli.stage_parser("rank")._actions for o in a.option_strings}


def test_real_stage_nested_flag_merges_with_config(tmp_path, capsys):
    cfg = tmp_path / "rank.yaml"
    cfg.write_text("input: /d\nembeddings: /e\noutput: /o\nvllm: {replicas: 4, batch_size: 3, env: {A: '1'}}\n")
    got = _printed(capsys, ["run", "rank", "--config", str(cfg), "--vllm.replicas", "2",
                            "--endpoint.base_url", "http://h:8000/v1"])
    assert got["vllm"]["replicas"] == 2 and got["vllm"]["batch_size"] == 3 and got["vllm"]["env"] == {"A": "1"}
    assert got["endpoint"]["base_url"] == "http://h:8000/v1"
