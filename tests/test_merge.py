"""merge: streaming weighted average of Hugging Face checkpoints (MEMSIFTER.md §6)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from memsifter.store import storage
from memsifter.errors import ConfigError, InputError
from memsifter.stage import get_stage, validate_config
from memsifter.stages.merge import INDEX

SHAPES = {"model.embed.weight": (64, 16), "model.layers.0.w": (16, 16), "model.layers.0.b": (16,),
          "model.layers.1.w": (16, 32), "model.norm": (16,), "lm_head.weight": (64, 16)}


def make_model(path: str, seed: int, shapes: dict = SHAPES, dtype: torch.dtype = torch.bfloat16,
               tokenizer: str = "tok-v1", sharded: bool = True) -> dict[str, torch.Tensor]:
    """A fake HF model directory: two safetensors shards + index, config, tokenizer files."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(*s, generator=g).to(dtype) for n, s in shapes.items()}
    tensors["model.layers.0.count"] = torch.arange(5, dtype=torch.int64)  # integer tensor: copied
    names = sorted(tensors)
    if sharded:
        parts = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                 "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for f, ns in parts.items():
            save_file({n: tensors[n] for n in ns}, os.path.join(path, f), metadata={"format": "pt"})
        with open(os.path.join(path, INDEX), "w") as fh:
            json.dump({"metadata": {"total_size": 0}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}, fh)
    else:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({"architectures": ["TinyForCausalLM"], "hidden_size": 16, "torch_dtype": "bfloat16"}, fh)
    with open(os.path.join(path, "tokenizer.json"), "w") as fh:
        json.dump({"version": tokenizer, "vocab": {"a": 0, "b": 1}}, fh)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"eos_token": "<e>"}, fh)
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"temperature": 0.6}, fh)
    return tensors


def _publish_dir(local: str, uri: str) -> str:
    if storage.is_s3(uri):
        storage.upload_dir(local, uri)
        return uri
    return local


def _load_output(uri: str, tmp) -> dict[str, torch.Tensor]:
    local = storage.download_dir(uri, str(tmp / "dl"))
    out = {}
    for f in os.listdir(local):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(local, f)))
    return out


@pytest.mark.parametrize("weights,dtype", [(None, "bfloat16"), ([1.0, 2.0, 5.0], "float32")])
def test_merge_matches_float64_reference(store_root, tmp_path, weights, dtype):
    inputs, models = [], []
    for i in range(3):
        models.append(make_model(str(tmp_path / f"m{i}"), seed=i))
        inputs.append(_publish_dir(str(tmp_path / f"m{i}"), storage.join(store_root, f"in/m{i}")))
    out_uri = storage.join(store_root, f"merged-{dtype}")
    cfg = {"output": out_uri, "inputs": inputs, "dtype": dtype}
    if weights:
        cfg["weights"] = weights
    m = get_stage("merge").run(cfg)
    assert m["stats"]["dtype"] == dtype and m["stats"]["tensors"] == len(SHAPES) + 1
    assert set(m["files"]) >= {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX,
                               "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    out = _load_output(out_uri, tmp_path)
    w = torch.tensor(weights or [1.0, 1.0, 1.0], dtype=torch.float64)
    w = w / w.sum()
    same, total = 0, 0
    for name in SHAPES:
        ref = sum(w[i] * models[i][name].double() for i in range(3))
        got = out[name]
        assert got.dtype == getattr(torch, dtype) and got.shape == ref.shape
        if dtype == "float32":
            torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
        else:
            # bf16 output: equal to the float64 reference rounded to bf16 (at most one ulp off)
            ulp = ref.abs() * 2 ** -7 + 1e-6  # bf16 rounding + float32 accumulation error
            assert ((got.double() - ref).abs() <= ulp).all(), name
            same += int((got == ref.to(torch.bfloat16)).sum())
            total += got.numel()
    if dtype == "bfloat16":  # almost always the correctly rounded value (double rounding aside)
        assert same / total > 0.98
    assert torch.equal(out["model.layers.0.count"], models[0]["model.layers.0.count"])
    index = json.loads(storage.read_text(storage.join(out_uri, INDEX)))
    assert set(index["weight_map"]) == set(out)
    cfg_out = json.loads(storage.read_text(storage.join(out_uri, "config.json")))
    assert cfg_out["torch_dtype"] == dtype


def test_merge_steps_of_a_collect_output(tmp_path):
    root = tmp_path / "collect"
    models = [make_model(str(root / f"global_step_{s}"), seed=s, sharded=False) for s in (20, 30, 40)]
    m = get_stage("merge").run({"output": str(tmp_path / "out"), "checkpoints": str(root)})  # all steps
    assert [u.rsplit("/", 1)[1] for u in m["stats"]["inputs"]] == ["global_step_20", "global_step_30", "global_step_40"]
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = sum(mm["lm_head.weight"].double() for mm in models) / 3
    assert (out["lm_head.weight"].double() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("change,message", [
    ("names", "tensor names differ: input 2 .* has no tensor 'model.norm'"),
    ("shapes", r"tensor 'model.layers.0.b': shape \[17\] in input 2 .* differs from \[16\]"),
    ("tokenizer", "tokenizers differ: 'tokenizer.json' differs between input 1 .* and input 2"),
    ("config", "model configs differ: config.json 'hidden_size'"),
])
def test_merge_refuses_mismatches(tmp_path, change, message):
    make_model(str(tmp_path / "a"), seed=0)
    shapes = dict(SHAPES)
    if change == "names":
        shapes.pop("model.norm")
    if change == "shapes":
        shapes["model.layers.0.b"] = (17,)
    make_model(str(tmp_path / "b"), seed=1, shapes=shapes, tokenizer="tok-v2" if change == "tokenizer" else "tok-v1")
    if change == "config":
        with open(tmp_path / "b" / "config.json", "w") as fh:
            json.dump({"architectures": ["TinyForCausalLM"], "hidden_size": 32, "torch_dtype": "float32"}, fh)
    with pytest.raises(InputError, match=message):
        get_stage("merge").run({"output": str(tmp_path / "out"), "inputs": [str(tmp_path / "a"), str(tmp_path / "b")]})
    assert not storage.exists(str(tmp_path / "out" / "_SUCCESS"))


def test_merge_config_validation():
    with pytest.raises(ConfigError, match="3 inputs"):
        validate_config("merge", {"output": "x", "inputs": ["a", "b", "c"], "weights": [1, 2]})
    with pytest.raises(ConfigError, match="needs `checkpoints`"):
        validate_config("merge", {"output": "x", "steps": [1]})
    with pytest.raises(ConfigError, match="dtype"):
        validate_config("merge", {"output": "x", "inputs": ["a"], "dtype": "int8"})


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def test_merge_memory_does_not_grow_with_n(tmp_path):
    """Peak RSS during the merge stays a few tensors, for 2 or 5 models of 24 MB each."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("cannot reset the peak-RSS counter here")
    from memsifter.stages.merge import merge_models

    shapes = {f"layer.{i}.w": (1024, 1024) for i in range(6)}  # 6 x 4 MB fp32 per model
    paths = []
    for i in range(5):
        make_model(str(tmp_path / f"m{i}"), seed=i, shapes=shapes, dtype=torch.float32, sharded=False)
        paths.append(str(tmp_path / f"m{i}"))
    merge_models(paths[:2], [0.5, 0.5], "bfloat16", None, out_dir=str(tmp_path))  # warm-up (imports, pools)
    growth = {}
    for n in (2, 5):
        out = tmp_path / f"out{n}"
        out.mkdir()
        before = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS high-water mark (VmHWM)
        merge_models(paths[:n], [1 / n] * n, "bfloat16", None, out_dir=str(out))
        growth[n] = (_status_kb("VmHWM") - before) / 1024
    # one tensor is 4 MB in float32: accumulator + one read buffer + the bf16 result ~ 10 MB
    assert growth[5] < 20, growth                   # below one model (24 MB), let alone five (120 MB)
    assert abs(growth[5] - growth[2]) < 6, growth   # independent of N
