"""The one definition of a stage: a pydantic config, a ``run(config)``, a registry.

A stage module looks like::

    class EmbedConfig(StageConfig):
        input: str = uri_field("published dataset to embed")
        model: str = "BAAI/bge-m3"

    @stage("embed", EmbedConfig, family="embed", help="Embed sessions and questions")
    def run(config: EmbedConfig, out: Publication) -> dict:
        ...  # read inputs by URI, write files with out.write_table(...)
        return {"questions": 30}                 # stats recorded in the manifest

``@stage`` turns the body into ``run(config, force=False, replace=False) -> manifest``: it hashes the
config, skips the work when ``<output>/_SUCCESS`` already holds the same stage, config hash and inputs
and its files still match it, otherwise stages the outputs and publishes them atomically. What is
published is not lost by mistake (:meth:`Stage.run`): another stage's output is never replaced, an
output of another config only with ``replace``, and an output that is or contains an input (or lies
inside one) is refused. The CLI (``memsifter run NAME``), the RayJob entrypoints,
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
    "sft": "memsifter.stages.sft",
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


def _uri_fields(config: StageConfig, all_fields: bool = False) -> dict[str, list[str]]:
    """Input URIs of a config by field (``uri_field``s); ``all_fields`` includes those marked
    ``fingerprint=False``."""
    out: dict[str, list[str]] = {}
    for name, f in type(config).model_fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if not extra.get("uri") or (extra.get("fingerprint") is False and not all_fields):
            continue
        v = getattr(config, name)
        vals = v if isinstance(v, list) else [v]
        out[name] = [x for x in vals if isinstance(x, str) and x]
    return out


def _location(uri: str) -> tuple[str, str]:
    """(store, normalised path) of a URI, for comparing prefixes: ``("s3", "bucket/key")`` or
    ``("local", "/abs/path")``; no filesystem access."""
    if storage.is_s3(uri):
        return "s3", "/".join(p for p in storage.s3_path(uri).split("/") if p)
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return "local", os.path.normpath(os.path.abspath(os.path.expanduser(uri)))


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

    def published(self, config: StageConfig, damage: list[str] | None = None) -> dict | None:
        """The manifest at ``config.output`` if it holds this stage's output for this exact config
        and the current content of its inputs, and its files still match it
        (:func:`memsifter.storage.damaged_file`); else None (the stage would run). A damaged file is
        appended to ``damage`` when given; a broken ``_SUCCESS`` counts as not published."""
        try:
            existing = storage.try_manifest(config.output)
        except storage.BadManifestError:
            return None
        if (existing and existing.get("stage") == self.name
                and existing.get("config_hash") == config_hash(config)
                and existing.get("inputs", {}) == inputs_fingerprint(config)):
            bad = storage.damaged_file(config.output, existing)
            if bad is None:
                return existing
            if damage is not None:
                damage.append(bad)
        return None

    def _check_paths(self, config: StageConfig) -> None:
        """Refuse an output that is an input, lies inside one, or contains one (publishing would
        replace or shadow that input's files). Inputs under ``<output>/_work/`` (the stage's own
        scratch, e.g. an embedding store) are allowed."""
        out = _location(config.output)
        for fname, uris in _uri_fields(config, all_fields=True).items():
            for uri in uris:
                inp = _location(uri)
                if inp[0] != out[0]:
                    continue
                if inp[1] == out[1]:
                    why = f"is also the input '{fname}'"
                elif out[1].startswith(inp[1] + "/"):
                    why = f"lies inside the input '{fname}' ({uri})"
                elif inp[1].startswith(out[1] + "/") and not inp[1].startswith(f"{out[1]}/{storage.WORK}/"):
                    why = f"contains the input '{fname}' ({uri})"
                else:
                    continue
                raise ConfigError(f"{config.output}: the output {why}: publishing there would replace "
                                  f"an input; choose another output URI")

    def _check_output(self, config: StageConfig) -> None:
        """The output must be a directory/prefix (not a regular file)."""
        if not storage.is_s3(config.output) and storage.is_file(config.output):
            raise ConfigError(f"{config.output}: is a regular file; the output must be a directory "
                              f"(or s3://bucket/prefix)")

    def run(self, config: StageConfig | dict, force: bool = False, steal_lease: bool = False,
            replace: bool = False) -> dict:
        """Run the stage unless its output is published for this config and inputs.

        * Same config and inputs, files intact: skipped. A published file that no longer matches the
          manifest (size, or sha256 up to ``MEMSIFTER_VERIFY_BYTES``) makes it re-run, with a warning
          naming the file. Inputs re-published since: re-run.
        * ``force`` re-runs it even when published, and replaces a broken ``_SUCCESS`` (without it a
          broken one is a one-line error naming the file). It re-runs this stage's output for *this*
          config only: an output of another config is replaced only with ``replace`` (``--replace``),
          and another stage's output never (choose another URI).
        * An output that is, contains or lies inside one of the config's inputs is refused, as are an
          output that is a regular file and bad numeric environment settings
          (:func:`memsifter.storage.check_env`).
        * Neither flag takes an output that a live run holds (``<output>/_LEASE``,
          :mod:`memsifter.lease`): that is refused with the holder's name. ``steal_lease`` takes that
          lease over (the other run then stops before publishing). A publish that a crash interrupted
          is completed from its journal instead of re-running the body.
        """
        if isinstance(config, dict):
            config = validate_config(self.name, config)
        storage.check_env()
        if storage.is_s3(config.output):
            storage.s3_path(config.output)   # refuses s3:// without a bucket
        self._check_paths(config)
        if self.preview is not None and getattr(config, "dry_run", False):
            return {"stage": self.name, "dry_run": True, **(self.preview(config) or {})}
        h = config_hash(config)
        self._check_output(config)
        try:
            existing = storage.try_manifest(config.output)
        except storage.BadManifestError as e:
            if not force:
                raise
            log.warning("%s: %s; replacing it (--force)", self.name, str(e).split("; re-run")[0])
            existing = None
        if existing and existing.get("stage") != self.name:
            raise ConfigError(f"{config.output}: holds the output of stage '{existing.get('stage')}', "
                              f"not '{self.name}' (neither --force nor --replace replaces another stage's "
                              f"output); choose another output URI")
        if existing and existing.get("config_hash") != h and not replace:
            raise ConfigError(f"{config.output}: holds this stage's output for another config (hash "
                              f"{existing.get('config_hash')}, published {existing.get('published_at')} by "
                              f"run {existing.get('run_id')}; this config: {h}); pass --replace to replace "
                              f"it, or choose another output URI")
        if existing and not force:
            damage: list[str] = []
            if self.published(config, damage):
                log.info("%s: %s already published with this config (hash %s): skipping", self.name,
                         config.output, h)
                return {**existing, "skipped": True}
            if damage:
                log.warning("%s: %s was modified after publishing: re-running the stage", self.name, damage[0])
            elif existing.get("config_hash") == h:
                log.info("%s: %s: inputs changed since it was published: re-running", self.name, config.output)
            else:
                log.warning("%s: replacing %s (config %s, published %s by run %s) with config %s (--replace)",
                            self.name, config.output, existing.get("config_hash"), existing.get("published_at"),
                            existing.get("run_id"), h)
        from . import lease

        storage.ensure_bucket(config.output)
        prev_stage = storage.CURRENT_STAGE["name"]
        storage.CURRENT_STAGE["name"] = self.name
        try:
            with lease.hold(config.output, purpose=f"stage {self.name}", steal=steal_lease) as held:
                now = storage.try_manifest(config.output) if not force else None
                if (now is not None and (existing is None or now.get("attempt") != existing.get("attempt"))
                        and self.published(config)):   # another writer finished while we waited
                    return {**now, "skipped": True}
                fingerprints = inputs_fingerprint(config)
                if not force:
                    done = storage.roll_forward(config.output, self.name, h, fingerprints)
                    if done is not None:
                        log.info("%s: completed the interrupted publish of %s", self.name, config.output)
                        return {**done, "resumed_publish": True}
                pub = storage.Publication(config.output, self.name, config.model_dump(mode="json"), h,
                                          code_version())
                tail = _LogTail()
                logging.getLogger().addHandler(tail)
                try:
                    pub.inputs = fingerprints
                    stats = self.body(config, pub) or {}
                    manifest = pub.publish(stats, check=held.check)
                except BaseException as e:
                    pub.abort()
                    record_failure(config.output, self.name, h, e, tail.lines())
                    raise
                finally:
                    logging.getLogger().removeHandler(tail)
                clear_failure(config.output)
        finally:
            storage.CURRENT_STAGE["name"] = prev_stage
        log.info("%s: published %s (%d files)", self.name, config.output, len(manifest["files"]))
        return manifest


FAILURE = "failure.json"   # under <output>/_work/: the last failed attempt, for `memsifter status`


class _LogTail(logging.Handler):
    """The last log lines of a stage's run (all loggers, INFO and up), kept for its failure record."""

    def __init__(self, keep: int = 40):
        super().__init__(logging.INFO)
        from collections import deque

        self._lines: Any = deque(maxlen=keep)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record)[:2000])
        except Exception:  # noqa: BLE001 - a log line must never fail the stage
            pass

    def lines(self) -> list[str]:
        return list(self._lines)


def record_failure(output: str, stage_name: str, config_hash_: str, exc: BaseException, tail: list[str]) -> None:
    """Archive why an attempt failed under ``<output>/_work/failure.json`` (best effort): the pods
    and their logs may be gone when someone asks ``memsifter status``."""
    import socket
    import traceback

    from .lease import run_id

    rec = {"stage": stage_name, "config_hash": config_hash_, "failed_at": storage.utcnow(), "run_id": run_id(),
           "host": socket.gethostname(), "pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"[:4000],
           "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:],
           "log_tail": tail}
    try:
        storage.write_bytes(storage.join(output, storage.WORK, FAILURE), json.dumps(rec, indent=2).encode())
    except Exception as e:  # noqa: BLE001 - the original error is what the user must see
        log.debug("could not archive the failure of %s: %s", output, e)


def clear_failure(output: str) -> None:
    try:
        uri = storage.join(output, storage.WORK, FAILURE)
        if storage.exists(uri):
            storage.delete(uri)
    except Exception as e:  # noqa: BLE001
        log.debug("could not clear the failure record of %s: %s", output, e)


STAGES: dict[str, Stage] = {}


def stage(name: str, config: type[StageConfig], *, family: str, help: str, gpus: int = 0,
          needs: list[str] | None = None, preview: Callable | None = None) -> Callable:
    """Register a stage body; returns the module-level ``run(config, force=False, steal_lease=False,
    replace=False)`` (see :meth:`Stage.run`)."""

    def deco(body: Callable) -> Callable[..., dict]:
        st = Stage(name, config, body, family, help, gpus, needs or [], preview)
        STAGES[name] = st

        def run(cfg: StageConfig | dict, force: bool = False, steal_lease: bool = False,
                replace: bool = False) -> dict:
            return st.run(cfg, force=force, steal_lease=steal_lease, replace=replace)
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
    except RecursionError:
        raise ConfigError(f"--set value nested too deeply ({len(raw)} characters)") from None


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a mapping")
    cur[keys[-1]] = value


def load_config_file(path: str) -> dict:
    """A YAML/JSON config file as a mapping. Every way it can be wrong is one ConfigError line naming
    the file: unreadable, not UTF-8 text (a binary file), not YAML/JSON, nested too deeply for the
    parser, or not a mapping."""
    try:
        raw = storage.read_bytes(path)
    except storage.StorageError as e:
        raise ConfigError(f"config {e}") from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text config file (byte {e.start} is not UTF-8: {e.reason})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {_one_line(e)}") from e
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to parse (a config is a shallow mapping)") from None
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
