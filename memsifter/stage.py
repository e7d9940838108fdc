"""The one definition of a stage: a pydantic config, a ``run(config)``, a registry.

A stage module looks like::

    class EmbedConfig(StageConfig):
        input: str = uri_field("published dataset to embed")
        model: str = "BAAI/bge-m3"

    @stage("embed", EmbedConfig, family="embed", help="Embed sessions and questions")
    def run(config: EmbedConfig, out: Publication) -> dict:
        ...  # read inputs by URI, write files with out.write_table(...)
        return {"questions": 30}                 # stats recorded in the manifest

``@stage`` turns the body into ``run(config, force=False) -> manifest``: it hashes the config, skips
the work when ``<output>/_SUCCESS`` already holds the same stage and config hash, otherwise stages
the outputs and publishes them atomically. The CLI (``memsifter run NAME``), the RayJob entrypoints,
``jobs/`` and the Helm chart are all generated from this registry (:data:`STAGES`).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import __version__, storage
from .errors import ConfigError

log = logging.getLogger(__name__)

# Stage name -> module that defines it (imported lazily so `--help` stays fast).
STAGE_MODULES: dict[str, str] = {
    "import": "memsifter.data.importers",
    "synth": "memsifter.data.synth",
    "embed": "memsifter.stages.embed",
    "rank": "memsifter.stages.rank",
    "chat": "memsifter.stages.chat",
    "evaluate": "memsifter.stages.evaluate",
    "prepare-rl": "memsifter.stages.prepare_rl",
    "train": "memsifter.stages.train",
    "collect": "memsifter.stages.collect",
    "merge": "memsifter.stages.merge",
}


class StageConfig(BaseModel):
    """Base of every stage config. Unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    output: str = Field(description="URI (local path or s3://bucket/prefix) where the stage publishes")


def uri_field(description: str, default: Any = ..., **kw: Any) -> Any:
    """A config field holding an input URI (the pipeline wires these between stages)."""
    return Field(default, description=description, json_schema_extra={"uri": True}, **kw)


def runtime_field(default: Any, description: str, **kw: Any) -> Any:
    """A field that changes how a stage runs but not what it produces (left out of the hash)."""
    return Field(default, description=description, json_schema_extra={"runtime": True}, **kw)


def _runtime_exclude(model: BaseModel) -> dict:
    """Pydantic ``exclude`` spec of the runtime fields of a config, nested models included."""
    out: dict = {}
    for name, f in type(model).model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if extra.get("runtime"):
            out[name] = True
            continue
        value = getattr(model, name, None)
        if isinstance(value, BaseModel):
            sub = _runtime_exclude(value)
            if sub:
                out[name] = sub
    return out


def config_hash(config: StageConfig) -> str:
    """Hash of what a config produces: ``output`` and runtime-only fields (at any depth) left out."""
    exclude = {**_runtime_exclude(config), "output": True}
    data = config.model_dump(mode="json", exclude=exclude)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _uri_fields(config: StageConfig) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, f in type(config).model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if not extra.get("uri") or extra.get("fingerprint") is False:
            continue
        v = getattr(config, name)
        vals = v if isinstance(v, list) else [v]
        out[name] = [x for x in vals if isinstance(x, str) and x]
    return out


def input_fingerprint(uri: str) -> str:
    """What identifies the current content of an input: its manifest, or a file's size and mtime.

    A stage whose input was re-published (or whose raw source file changed) is not skipped.
    Directories without a manifest (model folders, caches) are not fingerprinted.
    """
    m = storage.try_manifest(uri) if not storage.is_file(uri) else None
    if m:
        return f"manifest:{m.get('stage')}:{m.get('config_hash')}:{m.get('published_at')}"
    fs, path = storage.resolve(uri)
    info = storage.retrying(lambda: fs.get_file_info(path), uri)
    if info.type == storage.pafs.FileType.File:
        return f"file:{info.size}:{info.mtime_ns}"
    return "dir" if info.type == storage.pafs.FileType.Directory else "missing"


def inputs_fingerprint(config: StageConfig) -> dict[str, list[str]]:
    return {k: [input_fingerprint(u) for u in v] for k, v in _uri_fields(config).items()}


def code_version() -> str:
    sha = os.environ.get("MEMSIFTER_GIT_SHA", "")
    return f"{__version__}+{sha[:12]}" if sha else __version__


@dataclass
class Stage:
    name: str
    config: type[StageConfig]
    body: Callable[[Any, storage.Publication], dict | None]
    family: str
    help: str
    gpus: int = 0                                   # GPUs one worker of this stage wants by default
    needs: list[str] = field(default_factory=list)  # names of stages it reads from (for pipelines)
    # Runs instead of the body when the config says ``dry_run``: before the output store is touched
    # (no manifest read, no staging, nothing published), so an unreachable store cannot stop it.
    preview: Callable | None = None

    def published(self, config: StageConfig) -> dict | None:
        """The manifest at ``config.output`` if it holds this stage's output for this exact config
        and the current content of its inputs; else None (the stage would run)."""
        existing = storage.try_manifest(config.output)
        if (existing and existing.get("stage") == self.name
                and existing.get("config_hash") == config_hash(config)
                and existing.get("inputs", {}) == inputs_fingerprint(config)):
            return existing
        return None

    def run(self, config: StageConfig | dict, force: bool = False, steal_lease: bool = False) -> dict:
        """Run the stage unless its output is published for this config and inputs.

        ``force`` re-runs it even when published; it does not take an output that a live run holds
        (``<output>/_LEASE``, :mod:`memsifter.lease`): that is refused with the holder's name.
        ``steal_lease`` takes that lease over (the other run then stops before publishing). A publish
        that a crash interrupted is completed from its journal instead of re-running the body.
        """
        if isinstance(config, dict):
            config = validate_config(self.name, config)
        if self.preview is not None and getattr(config, "dry_run", False):
            return {"stage": self.name, "dry_run": True, **(self.preview(config) or {})}
        h = config_hash(config)
        existing = storage.try_manifest(config.output)
        if existing and not force and self.published(config):
            log.info("%s: %s already published with this config (hash %s): skipping", self.name,
                     config.output, h)
            return {**existing, "skipped": True}
        if existing and not force and existing.get("stage") != self.name:
            raise ConfigError(f"{config.output}: holds output of stage '{existing.get('stage')}', "
                              f"not '{self.name}'; choose another output URI")
        from . import lease

        if existing and existing.get("stage") == self.name and not force:
            log.warning("%s: %s holds this stage's output for another config or other inputs (hash %s, "
                        "published %s by run %s): it will be replaced", self.name, config.output,
                        existing.get("config_hash"), existing.get("published_at"), existing.get("run_id"))
        storage.ensure_bucket(config.output)
        prev_stage = storage.CURRENT_STAGE["name"]
        storage.CURRENT_STAGE["name"] = self.name
        try:
            with lease.hold(config.output, purpose=f"stage {self.name}", steal=steal_lease) as held:
                if not force and self.published(config):  # another writer finished while we waited
                    return {**storage.read_manifest(config.output), "skipped": True}
                fingerprints = inputs_fingerprint(config)
                if not force:
                    done = storage.roll_forward(config.output, self.name, h, fingerprints)
                    if done is not None:
                        log.info("%s: completed the interrupted publish of %s", self.name, config.output)
                        return {**done, "resumed_publish": True}
                pub = storage.Publication(config.output, self.name, config.model_dump(mode="json"), h,
                                          code_version())
                try:
                    pub.inputs = fingerprints
                    stats = self.body(config, pub) or {}
                    manifest = pub.publish(stats, check=held.check)
                except BaseException:
                    pub.abort()
                    raise
        finally:
            storage.CURRENT_STAGE["name"] = prev_stage
        log.info("%s: published %s (%d files)", self.name, config.output, len(manifest["files"]))
        return manifest


STAGES: dict[str, Stage] = {}


def stage(name: str, config: type[StageConfig], *, family: str, help: str, gpus: int = 0,
          needs: list[str] | None = None, preview: Callable | None = None) -> Callable:
    """Register a stage body; returns the module-level ``run(config, force=False)``."""

    def deco(body: Callable) -> Callable[..., dict]:
        st = Stage(name, config, body, family, help, gpus, needs or [], preview)
        STAGES[name] = st

        def run(cfg: StageConfig | dict, force: bool = False, steal_lease: bool = False) -> dict:
            return st.run(cfg, force=force, steal_lease=steal_lease)
        run.__doc__ = body.__doc__
        run.stage = st  # type: ignore[attr-defined]
        return run
    return deco


def get_stage(name: str) -> Stage:
    if name not in STAGE_MODULES:
        raise ConfigError(f"unknown stage '{name}' (known: {', '.join(STAGE_MODULES)})")
    if name not in STAGES:
        importlib.import_module(STAGE_MODULES[name])
    if name not in STAGES:
        raise ConfigError(f"module {STAGE_MODULES[name]} did not register stage '{name}'")
    return STAGES[name]


def available_stages() -> list[str]:
    """Stages whose module exists in this installation."""
    out = []
    for name, mod in STAGE_MODULES.items():
        if importlib.util.find_spec(mod) is not None:
            out.append(name)
    return out


# --------------------------------------------------------------------------- config loading
def parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a mapping")
    cur[keys[-1]] = value


def load_config_file(path: str) -> dict:
    try:
        text = storage.read_text(path)
    except storage.StorageError as e:
        raise ConfigError(f"config {e}") from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping, got {type(data).__name__}")
    return data


def validate_config(name: str, data: dict, source: str = "config") -> StageConfig:
    st = get_stage(name)
    try:
        return st.config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(root)"
            lines.append(f"  {loc}: {err['msg']}")
        raise ConfigError(f"{source}: invalid config for stage '{name}':\n" + "\n".join(lines)) from e


def build_config(name: str, file: str | None = None, sets: list[str] | None = None,
                 flags: dict | None = None) -> StageConfig:
    """Config from a file, then flag values, then ``--set key=value`` overrides (last wins)."""
    data = load_config_file(file) if file else {}
    for k, v in (flags or {}).items():
        if v is not None:
            data[k] = v
    for s in sets or []:
        if "=" not in s:
            raise ConfigError(f"--set {s}: expected key=value")
        k, v = s.split("=", 1)
        set_path(data, k.strip(), parse_value(v))
    return validate_config(name, data, source=file or "command line")
