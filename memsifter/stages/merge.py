"""Stage ``merge``: uniform or weighted average of N Hugging Face checkpoints (MEMSIFTER.md §6).

Streaming, tensor by tensor: each input's safetensors headers are read first (names, shapes, dtypes,
byte offsets), then for every tensor of the output the N slices are read with ranged reads (local
files or S3 objects, no download), accumulated in float32 (``acc += w_i * t_i``) and written in the
explicit output dtype (bf16 by default) to the output shard being built. Peak memory is a few copies
of the largest tensor, whatever N or the model size; the original loaded N whole fp32 models.

The inputs must agree: the same tensor names, the same shapes, the same tokenizer files and the same
model config (dtype fields aside). Otherwise the stage refuses and names the first difference.
Integer tensors (if any) must be identical and are copied. The output keeps the first input's shard
layout (and index file); config, tokenizer and generation files come from the first input, with the
config's dtype set to the output dtype.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from ..store import storage
from ..errors import InputError
from ..stage import StageConfig, runtime_field, stage, uri_field

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
CONFIG_IGNORE = {"torch_dtype", "dtype", "_name_or_path", "transformers_version", "architectures_note"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
OUT_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


class MergeConfig(StageConfig):
    inputs: list[str] = uri_field("Hugging Face model directories to average (local or s3://)", [])
    checkpoints: str | None = uri_field("a collect output: average its global_step_<N> directories", None,
                                        stage="collect")
    steps: list[int] = Field(default_factory=list, description="steps of `checkpoints` to average, e.g. 20 30 40 "
                             "(default: every step the collect output holds)")
    weights: list[float] | None = Field(None, description="one weight per input (normalised); default uniform")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="output dtype (explicit; "
                                                             "never taken from the hardware)")
    local_tmp: str | None = runtime_field(None, "directory for the output shard being written (default: system tmp)")

    @model_validator(mode="after")
    def _inputs(self) -> "MergeConfig":
        if self.steps and not self.checkpoints:
            raise ValueError("`steps` needs `checkpoints` (a collect output)")
        if not self.inputs and not self.checkpoints:
            raise ValueError("give `inputs` or `checkpoints` (+ `steps`)")
        if self.weights is not None:
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError("weights must be non-negative with a positive sum")
            if not self.checkpoints or self.steps:
                n = len(self.inputs) + len(self.steps)
                if len(self.weights) != n:
                    raise ValueError(f"{len(self.weights)} weights for {n} inputs")
        return self

    def model_uris(self) -> list[str]:
        """The models to average (reads the collect output's directory list when `steps` is empty)."""
        out = list(self.inputs)
        if self.checkpoints:
            steps = self.steps or collected_steps(self.checkpoints)
            if not steps:
                raise InputError("no global_step_<N> directories", file=self.checkpoints)
            out += [storage.join(self.checkpoints, f"global_step_{s}") for s in steps]
        return out

    def normalised_weights(self, n: int) -> list[float]:
        w = self.weights if self.weights is not None else [1.0] * n
        if len(w) != n:
            raise InputError(f"{len(w)} weights for {n} inputs", file=self.checkpoints)
        total = float(sum(w))
        return [x / total for x in w]


def collected_steps(uri: str) -> list[int]:
    import re

    return sorted(int(m.group(1)) for d in storage.list_dirs(uri) if (m := re.fullmatch(r"global_step_(\d+)", d)))


# --------------------------------------------------------------------------- safetensors, streamed
@dataclass
class TensorInfo:
    file: str          # relative file name within the model directory
    dtype: str         # safetensors code (BF16, F32, ...)
    shape: list[int]
    start: int         # absolute byte offset in the file
    nbytes: int


def read_header(uri: str) -> tuple[dict[str, dict], int]:
    """Header entries and the data start offset of one safetensors file (two ranged reads)."""
    fs, path = storage.resolve(uri)

    def _read() -> tuple[dict, int]:
        with fs.open_input_file(path) as f:
            n = struct.unpack("<Q", f.read_at(8, 0))[0]
            header = json.loads(f.read_at(n, 8))
        return header, 8 + n
    header, base = storage.retrying(_read, uri)
    header.pop("__metadata__", None)
    return header, base


class ModelDir:
    """One input: its weight files, tensor table and side files (config, tokenizer)."""

    def __init__(self, uri: str, position: int):
        self.uri, self.position = uri.rstrip("/"), position
        files = storage.list_files(self.uri, recursive=False)
        if not files:
            raise InputError("no files (not a model directory)", file=self.uri)
        self.files = files
        if INDEX in files:
            weight_map = storage.read_json(storage.join(self.uri, INDEX))["weight_map"]
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(f for f in files if f.endswith(".safetensors"))
        if not shards:
            bins = [f for f in files if f.endswith(WEIGHT_SUFFIXES)]
            raise InputError("no safetensors weights" + (f" (found {bins[:3]}: convert to safetensors first)"
                                                          if bins else ""), file=self.uri)
        self.shards = shards
        self.tensors: dict[str, TensorInfo] = {}
        self.order: list[str] = []
        for shard in shards:
            header, base = read_header(storage.join(self.uri, shard))
            for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                a, b = e["data_offsets"]
                if name in self.tensors:
                    raise InputError(f"tensor '{name}' appears in two shards", file=self.uri)
                self.tensors[name] = TensorInfo(shard, e["dtype"], list(e["shape"]), base + a, b - a)
                self.order.append(name)
        self._handles: dict[str, Any] = {}

    def label(self) -> str:
        return f"input {self.position + 1} ({self.uri})"

    def read(self, name: str, buffer: Any = None) -> Any:
        """One tensor, read with a ranged read into ``buffer`` (a uint8 tensor, reused) or a new one."""
        import torch

        info = self.tensors[name]
        if info.dtype not in ST_DTYPES:
            raise InputError(f"tensor '{name}': unsupported dtype {info.dtype}", file=self.uri)
        f = self._handles.get(info.file)
        if f is None:  # retries a read cut off mid-answer (re-opens the file, reads the range again)
            f = self._handles[info.file] = storage.RangeReader(storage.join(self.uri, info.file))
        raw = buffer[:info.nbytes] if buffer is not None else torch.empty(info.nbytes, dtype=torch.uint8)
        if info.nbytes:
            got = f.read_into(info.start, raw.numpy())
            if got != info.nbytes:
                raise InputError(f"tensor '{name}': short read ({got} of {info.nbytes} bytes)", file=self.uri)
        return raw.view(getattr(torch, ST_DTYPES[info.dtype])).reshape(info.shape)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()

    def side_file(self, name: str) -> bytes | None:
        return storage.read_bytes(storage.join(self.uri, name)) if name in self.files else None


def check_compatible(models: list[ModelDir]) -> None:
    """Refuse inputs whose tensor names, shapes, tokenizers or configs differ (first difference named)."""
    ref = models[0]
    for m in models[1:]:
        extra = [n for n in m.order if n not in ref.tensors]
        lacking = [n for n in ref.order if n not in m.tensors]
        if lacking:
            raise InputError(f"tensor names differ: {m.label()} has no tensor '{lacking[0]}' "
                             f"(present in {ref.label()})", file=m.uri)
        if extra:
            raise InputError(f"tensor names differ: {m.label()} has tensor '{extra[0]}' that "
                             f"{ref.label()} lacks", file=m.uri)
        for n in ref.order:
            if m.tensors[n].shape != ref.tensors[n].shape:
                raise InputError(f"tensor '{n}': shape {m.tensors[n].shape} in {m.label()} differs from "
                                 f"{ref.tensors[n].shape} in {ref.label()}", file=m.uri)
    for name in TOKENIZER_FILES:
        ref_h = _digest(ref.side_file(name))
        for m in models[1:]:
            h = _digest(m.side_file(name))
            if h == ref_h:
                continue
            if h is None:
                detail = f"'{name}' is missing in {m.label()} (present in {ref.label()})"
            elif ref_h is None:
                detail = f"'{name}' is only in {m.label()} (not in {ref.label()})"
            else:
                detail = f"'{name}' differs between {ref.label()} and {m.label()}"
            raise InputError(f"tokenizers differ: {detail}", file=m.uri)
    ref_cfg = _config(ref)
    for m in models[1:]:
        cfg = _config(m)
        for k in sorted(set(ref_cfg) | set(cfg)):
            if ref_cfg.get(k, "<absent>") != cfg.get(k, "<absent>"):
                raise InputError(f"model configs differ: config.json '{k}' is {cfg.get(k, '<absent>')!r} in "
                                 f"{m.label()}, {ref_cfg.get(k, '<absent>')!r} in {ref.label()}", file=m.uri)


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _config(m: ModelDir) -> dict:
    raw = m.side_file("config.json")
    if raw is None:
        raise InputError("no config.json", file=m.uri)
    return {k: v for k, v in json.loads(raw).items() if k not in CONFIG_IGNORE}


# --------------------------------------------------------------------------- averaging
def _header_bytes(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, code, shape, nbytes in entries:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _out_code(info: TensorInfo, out_dtype: str) -> str:
    return OUT_CODES[out_dtype] if info.dtype in ("F64", "F32", "F16", "BF16") else info.dtype


def _elem_size(code: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(code, 1)


def average_tensor(models: list[ModelDir], weights: list[float], name: str, out_dtype: str) -> Any:
    """The weighted average of one tensor over all inputs, accumulated in float32.

    Working memory: the float32 accumulator, one read buffer reused for every input, the result.
    """
    import torch

    buf = torch.empty(max(m.tensors[name].nbytes for m in models), dtype=torch.uint8)
    first = models[0].read(name, buf)
    if not first.is_floating_point():
        first = first.clone()
        for m in models[1:]:
            if not torch.equal(m.read(name, buf), first):
                raise InputError(f"integer tensor '{name}' differs between {models[0].label()} and {m.label()}",
                                 file=m.uri)
        return first
    acc = torch.zeros(first.shape, dtype=torch.float32)
    for i, m in enumerate(models):
        t = first if i == 0 else m.read(name, buf)
        if t.dtype == torch.float64:
            t = t.to(torch.float32)
        acc.add_(t, alpha=weights[i])
        del t
    del first, buf
    return acc.to(getattr(torch, out_dtype))


def _return_freed_memory_to_os() -> None:
    """glibc: serve big allocations with mmap (freed at once) instead of the heap, whose dynamic
    threshold otherwise lets freed tensors linger and fragment. Best effort, no-op elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except Exception:  # noqa: BLE001
        pass


def merge_models(uris: list[str], weights: list[float], out_dtype: str, out: storage.Publication | None,
                 out_dir: str | None = None, tmp_dir: str | None = None) -> dict:
    """Average ``uris`` into a publication (or a local ``out_dir``); returns stats."""
    import torch

    _return_freed_memory_to_os()
    t0 = time.time()
    models = [ModelDir(u, i) for i, u in enumerate(uris)]
    check_compatible(models)
    ref = models[0]
    by_file: dict[str, list[str]] = {}
    for n in ref.order:
        by_file.setdefault(ref.tensors[n].file, []).append(n)
    total_bytes, n_params = 0, 0
    weight_map: dict[str, str] = {}
    try:
        for shard, names in by_file.items():
            entries = []
            for n in names:
                info = ref.tensors[n]
                code = _out_code(info, out_dtype)
                numel = 1
                for d in info.shape:
                    numel *= d
                entries.append((n, code, info.shape, numel * _elem_size(code)))
                n_params += numel
            with tempfile.NamedTemporaryFile(dir=tmp_dir or out_dir, suffix=".safetensors", delete=False) as f:
                local = f.name
                f.write(_header_bytes(entries))
                for n, code, shape, nbytes in entries:
                    t = average_tensor(models, weights, n, out_dtype).contiguous()
                    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
                    if len(data) != nbytes:
                        raise AssertionError(f"{n}: wrote {len(data)} bytes, expected {nbytes}")
                    f.write(data)
                    del t, data
                    weight_map[n] = shard
            total_bytes += os.path.getsize(local)
            if out is not None:
                out.add_file(shard, local)
                os.remove(local)
            else:
                os.replace(local, os.path.join(out_dir, shard))
    finally:
        for m in models:
            m.close()
    # side files from the first input
    side = [f for f in ref.files if not f.endswith(WEIGHT_SUFFIXES) and f != INDEX]
    for name in side:
        data = ref.side_file(name)
        if name == "config.json":
            cfg = json.loads(data)
            keys = [k for k in ("torch_dtype", "dtype") if k in cfg] or ["torch_dtype"]
            for key in keys:
                cfg[key] = out_dtype
            data = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
        _put(out, out_dir, name, data)
    if INDEX in ref.files:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _put(out, out_dir, INDEX, (json.dumps(index, indent=2) + "\n").encode())
    return {"inputs": uris, "weights": weights, "dtype": out_dtype, "tensors": len(ref.order),
            "parameters": n_params, "shards": len(by_file), "bytes_written": total_bytes,
            "seconds": round(time.time() - t0, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _put(out: storage.Publication | None, out_dir: str | None, name: str, data: bytes) -> None:
    if out is not None:
        out.write_bytes(name, data)
    else:
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)


@stage("merge", MergeConfig, family="train",
       help="Average N Hugging Face checkpoints tensor by tensor (float32 accumulation, explicit output dtype)")
def run(config: MergeConfig, out: storage.Publication) -> dict:
    uris = config.model_uris()
    weights = config.normalised_weights(len(uris))
    log.info("merge: %d inputs, weights %s, output %s", len(uris), [round(w, 4) for w in weights], config.dtype)
    return merge_models(uris, weights, config.dtype, out, tmp_dir=config.local_tmp)
