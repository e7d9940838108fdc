"""The stage framework (config hash, skip, atomic publish on error) and the generated CLI."""

from __future__ import annotations

import json
from typing import Literal

import pyarrow as pa
import pytest

from memsifter import cli, stage as stg, storage
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
    monkeypatch.setitem(stg.STAGE_MODULES, "echo-test", __name__)
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
    monkeypatch.setitem(stg.STAGE_MODULES, "chain-test", __name__)
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
    from memsifter.llm import LLMEndpoint

    class WithEndpoint(stg.StageConfig):
        endpoint: LLMEndpoint = LLMEndpoint()

    a = WithEndpoint(output="/a", endpoint=LLMEndpoint(base_url="http://127.0.0.1:1/v1", model="m"))
    b = WithEndpoint(output="/a", endpoint=LLMEndpoint(base_url="http://10.0.0.9:8000/v1", model="m", concurrency=3))
    c = WithEndpoint(output="/a", endpoint=LLMEndpoint(base_url="http://127.0.0.1:1/v1", model="other"))
    assert stg.config_hash(a) == stg.config_hash(b) != stg.config_hash(c)
