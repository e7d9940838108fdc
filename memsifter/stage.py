"""The one definition of a stage: a pydantic config, a ``run(config)``, a registry.

A stage module looks like::

    class EmbedConfig(StageConfig):
        input: str = uri_field("published dataset to embed", stage=("import", "synth"))
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

How stages connect is declared once, on the input fields: ``uri_field(..., stage="embed")`` names the
stage whose output a field reads (a tuple when several can produce it, in order of preference). A
stage's ``needs``, the pipeline order (:func:`available_stages`), the inputs ``memsifter pipeline`` fills
in (:func:`memsifter.pipeline.plan`, whose wiring the chart renders) are all derived from those
declarations; nothing else names a producer. Stage modules are found by importing every module of :data:`STAGE_PACKAGES`: adding a stage is
one module with one ``@stage`` registration (then ``memsifter k8s gen-chart && memsifter k8s gen-jobs``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import pkgutil
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import __version__
from .store import hooks, storage
# What a running stage records for `memsifter status` (PROGRESS, progress_bar, report_progress, _LogTail:
# imported from here by status, the stages' progress bars and tests)
from .store.records import (PROGRESS, _LogTail, _progress, clear_failure, progress_bar,  # noqa: F401
                            record_failure, report_progress)
from .errors import ConfigError

log = logging.getLogger(__name__)

# Where stages live: every module of these packages (or these modules) is imported to find the
# stages it registers (:func:`discover`). A new stage module needs no entry anywhere.
STAGE_PACKAGES: tuple[str, ...] = ("memsifter.stages",)


class StageConfig(BaseModel):
    """Base of every stage config. Unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    output: str = Field(description="URI (local path or s3://bucket/prefix) where the stage publishes")

    def preflight(self) -> None:
        """Checks that need this machine's environment (a model reference it can load, an endpoint the
        user named and its key), made by :meth:`Stage.run` after the skip decision and before the
        output's lease is taken or anything is read: one line, exit 2, nothing written. Not done at
        validation, where a pipeline checks every stage's config before earlier stages ran (a server
        started by one, a model published by another). Stages override it; the default checks nothing."""


WIRE_MODES = ("first", "all", "none")


def uri_field(description: str, default: Any = ..., *, stage: str | tuple[str, ...] | None = None,
              wire: str = "first", **kw: Any) -> Any:
    """A config field holding an input URI.

    ``stage`` names the stage whose published output the field reads; a tuple when several stages can
    produce it, in order of preference (``stage=("rank", "embed")``). Leave it out for what the user
    names (a raw source file, a prompt, a model). These declarations are the only place where stages
    are connected: needs, pipeline order and the inputs a pipeline or the chart fills in derive from
    them. ``wire`` says what fills an unset field: ``first``, the output of the first producer there
    is (a one-element list for a list field); ``all``, every producer's output; ``none``, nothing (the
    producers then only order the stages: the user names the output, e.g. one of an earlier run).
    """
    extra: dict[str, Any] = {"uri": True}
    if stage is not None:
        producers = (stage,) if isinstance(stage, str) else tuple(stage)
        if not producers or not all(isinstance(p, str) and p for p in producers):
            raise ValueError(f"uri_field stage={stage!r}: expected a stage name or a tuple of them")
        if wire not in WIRE_MODES:
            raise ValueError(f"uri_field wire={wire!r}: expected one of {WIRE_MODES}")
        extra["stage"] = list(producers)
        if wire != "first":
            extra["wire"] = wire
    elif wire != "first":
        raise ValueError("uri_field wire= needs stage=")
    return Field(default, description=description, json_schema_extra=extra, **kw)


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
    import pyarrow.fs as pafs

    fs, path = storage.resolve(uri)
    info = storage.retrying(lambda: fs.get_file_info(path), uri)
    if info.type == pafs.FileType.File:
        return f"file:{info.size}:{info.mtime_ns}"
    return "dir" if info.type == pafs.FileType.Directory else "missing"


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
    # Runs instead of the body when the config says ``dry_run``: before the output store is touched
    # (no manifest read, no staging, nothing published), so an unreachable store cannot stop it.
    preview: Callable | None = None
    module: str = ""                                # the module that registered it

    @property
    def inputs(self) -> list["Input"]:
        """The config's input fields and the stages that produce them (``uri_field(stage=...)``)."""
        return config_inputs(self.config)

    @property
    def needs(self) -> list[str]:
        """The stages it reads from, derived from its input fields (:func:`derive_needs`), in
        pipeline order."""
        stages = {**available(), self.name: self}
        return derive_needs(stages)[self.name]

    def published(self, config: StageConfig, damage: list[str] | None = None) -> dict | None:
        """The manifest at ``config.output`` if it holds this stage's output for this exact config
        and the current content of its inputs, and its files still match it
        (:func:`memsifter.store.storage.damaged_file`); else None (the stage would run). A damaged file is
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
          (:func:`memsifter.store.storage.check_env`).
        * Neither flag takes an output that a live run holds (``<output>/_LEASE``,
          :mod:`memsifter.store.lease`): that is refused with the holder's name. ``steal_lease`` takes that
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
        config.preflight()
        from .store import lease

        storage.ensure_bucket(config.output)
        hooks.checkpoint("stage-start", stage=self.name)
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
                _progress.clear()
                _progress.update(output=config.output, stage=self.name)
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
                    _progress.clear()
                clear_failure(config.output)
        finally:
            hooks.checkpoint("stage-end", stage=self.name)
        log.info("%s: published %s (%d files)", self.name, config.output, len(manifest["files"]))
        return manifest


STAGES: dict[str, Stage] = {}


def stage(name: str, config: type[StageConfig], *, family: str, help: str, gpus: int = 0,
          preview: Callable | None = None) -> Callable:
    """Register a stage body; returns the module-level ``run(config, force=False, steal_lease=False,
    replace=False)`` (see :meth:`Stage.run`). What the stage reads from other stages is declared on
    its config's input fields (:func:`uri_field` ``stage=``), not here."""

    def deco(body: Callable) -> Callable[..., dict]:
        config_inputs(config)  # a bad declaration fails at import, naming the field
        st = Stage(name, config, body, family, help, gpus, preview, getattr(body, "__module__", ""))
        STAGES[name] = st

        def run(cfg: StageConfig | dict, force: bool = False, steal_lease: bool = False,
                replace: bool = False) -> dict:
            return st.run(cfg, force=force, steal_lease=steal_lease, replace=replace)
        run.__doc__ = body.__doc__
        run.stage = st  # type: ignore[attr-defined]
        return run
    return deco


_SCANNED: set[str] = set()


def discover() -> None:
    """Import every module of :data:`STAGE_PACKAGES` (once each): their ``@stage`` decorators register
    the stages. A package's modules are found by scanning it; an entry that is a plain module is
    imported as it is."""
    for pkg in STAGE_PACKAGES:
        if pkg in _SCANNED:
            continue
        mod = importlib.import_module(pkg)
        if hasattr(mod, "__path__"):
            for info in sorted(pkgutil.iter_modules(mod.__path__), key=lambda m: m.name):
                importlib.import_module(f"{pkg}.{info.name}")
        _SCANNED.add(pkg)


def _shipped(st: Stage) -> bool:
    return any(st.module == p or st.module.startswith(p + ".") for p in STAGE_PACKAGES)


def available() -> dict[str, Stage]:
    """The stages of :data:`STAGE_PACKAGES` by name, in pipeline order (:func:`available_stages`)."""
    discover()
    found = {n: s for n, s in STAGES.items() if _shipped(s)}
    return {n: found[n] for n in derive_order(derive_needs(found))}


def available_stages() -> list[str]:
    """The stages of this installation in pipeline order: each after the stages it reads from, ties
    by name (:func:`derive_order`)."""
    return list(available())


def get_stage(name: str) -> Stage:
    if name not in STAGES:
        discover()
    if name not in STAGES:
        raise ConfigError(f"unknown stage '{name}' (known: {', '.join(available_stages())})")
    return STAGES[name]


# --------------------------------------------------------------------------- inputs and wiring
@dataclass(frozen=True)
class Input:
    """An input field of a stage config: the stages whose output it reads (empty: a file or model the
    user names), how an unset field is filled (``wire``), whether it is required, whether it is a list."""

    field: str
    stages: tuple[str, ...]
    wire: str
    required: bool
    many: bool


def _extra(f: Any) -> dict:
    return f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}


def is_list(annotation: Any) -> bool:
    """A list/tuple/set type (or an optional one)."""
    for cand in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(cand) in (list, tuple, set):
            return True
    return False


def config_inputs(cls: type[BaseModel]) -> list[Input]:
    """The ``uri_field`` inputs of a config class (``output`` aside), in field order."""
    out = []
    for name, f in cls.model_fields.items():
        ex = _extra(f)
        if not ex.get("uri") or name == "output":
            continue
        stages = tuple(ex.get("stage") or ())
        wire = ex.get("wire", "first")
        many = is_list(f.annotation)
        if wire == "all" and not many:
            raise ValueError(f"{cls.__name__}.{name}: wire='all' needs a list field")
        out.append(Input(name, stages, wire, f.is_required(), many))
    return out


def derive_needs(stages: Mapping[str, Stage]) -> dict[str, list[str]]:
    """Stage -> the stages among ``stages`` that its input fields name, in pipeline order.

    An optional input whose producer itself needs this stage through required inputs (train's
    ``init_adapter`` may be a collect output, and collect reads train's checkpoints) can only be the
    output of an earlier run: it adds no need. A producer that is not registered is an error."""
    ins = {n: s.inputs for n, s in stages.items()}
    for n, fields in ins.items():
        for i in fields:
            bad = [p for p in i.stages if p not in stages and p not in STAGES]
            if bad:
                raise ConfigError(f"stage '{n}': field '{i.field}' names unknown stage(s) {bad} "
                                  f"(uri_field stage=...)")
    hard = {n: {p for i in fields if i.required for p in i.stages if p in stages and p != n}
            for n, fields in ins.items()}

    def reaches(a: str, b: str) -> bool:   # a needs b through required inputs
        return b in upstream(a, hard)

    needs: dict[str, list[str]] = {}
    for n, fields in ins.items():
        out: list[str] = []
        for i in fields:
            for p in i.stages:
                if p in stages and p != n and p not in out and (i.required or not reaches(p, n)):
                    out.append(p)
        needs[n] = out
    order = derive_order(needs)
    return {n: sorted(ds, key=order.index) for n, ds in needs.items()}


def upstream(name: str, needs: Mapping[str, Iterable[str]]) -> set[str]:
    """Every node ``name`` needs, directly or through others (the one reachability helper)."""
    out: set[str] = set()
    todo = list(needs.get(name, ()))
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += needs.get(n, ())
    return out


def derive_order(needs: Mapping[str, Iterable[str]], key: Callable[[str], Any] | None = None) -> list[str]:
    """Nodes (stages, stage instances) in dependency order: each after every node it needs (needs
    outside ``needs`` ignored), ties by ``key`` (default: the name). The one topological sort of the
    package. Raises ConfigError on a cycle."""
    left = {n: {d for d in ds if d in needs and d != n} for n, ds in needs.items()}
    order: list[str] = []
    while left:
        ready = sorted((n for n, ds in left.items() if not ds), key=key)
        if not ready:
            raise ConfigError("dependency cycle among " + ", ".join(sorted(left)) +
                              " (their inputs: uri_field stage= declarations or names in a pipeline)")
        order.append(ready[0])
        del left[ready[0]]
        for ds in left.values():
            ds.discard(ready[0])
    return order


# --------------------------------------------------------------------------- config loading
MAX_CONFIG_BYTES = 1 << 20   # a config file is a small mapping; data belongs in the store, named by URI
MAX_CONFIG_VALUES = 100_000  # values a config may hold once YAML aliases are expanded (an alias bomb)


def suggest(word: str, choices: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the choice closest to a mistyped ``word`` (difflib), else ``""``.
    ``prefix`` goes before the suggestion (``--`` for flags)."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {prefix}{close[0]}?)" if prefix else f" (did you mean '{close[0]}'?)"


# Bits of the largest integer Python turns into its 4,300 decimal digits (sys.get_int_max_str_digits): a
# hexadecimal, octal or binary YAML literal is read at any length, and every later str() of it would raise.
_MAX_INT_BITS = int(4300 * 3.3219280948873626) - 1


def _check_values(data: Any, what: str) -> None:
    """Refuse a document that expands to more than :data:`MAX_CONFIG_VALUES` values: YAML aliases
    share one object per anchor while parsing, but validation, hashing and JSON copy every use; and an
    integer too long to print (:data:`_MAX_INT_BITS`)."""
    count, todo = 0, [data]
    while todo:
        cur = todo.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(f"{what}: holds more than {MAX_CONFIG_VALUES:,} values once its YAML aliases "
                              f"are expanded; a config is a small mapping")
        if isinstance(cur, dict):
            todo.extend(cur.keys())
            todo.extend(cur.values())
        elif isinstance(cur, (list, tuple)):
            todo.extend(cur)
        elif isinstance(cur, int) and cur.bit_length() > _MAX_INT_BITS:   # 0x<5000 f's>: YAML reads any length
            raise ConfigError(f"{what}: a value cannot be read: an integer of {cur.bit_length():,} bits, more "
                              f"digits than can be read (at most 4300)")


def _unreadable_value(what: str, e: Exception) -> ConfigError:
    """A YAML scalar that parses but cannot become a value: an integer past Python's 4,300-digit
    conversion limit, a date such as 2024-13-45."""
    msg = _one_line(e)
    if "4300" in msg or "integer string conversion" in msg:
        msg = "an integer with more digits than can be read (at most 4300)"
    return ConfigError(f"{what}: a value cannot be read: {msg}")


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading a number in exponent form without a dot (``2e-05``, YAML 1.2's float) as
    a float: helm and kubectl write floats so (Go), and YAML 1.1 alone reads that a string, which reached verl as
    a learning rate of ``'2e-05'`` from a config document the chart had rendered."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def parse_value(raw: str, what: str = "--set value") -> Any:
    """A ``--set`` value as YAML (a plain word stays a string). ``what`` names it in errors
    (``--set key``)."""
    try:
        value = yaml.load(raw, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError:
        return raw
    except RecursionError:
        raise ConfigError(f"{what}: nested too deeply ({len(raw)} characters)") from None
    except (ValueError, OverflowError) as e:
        raise _unreadable_value(what, e) from None
    _check_values(value, what)
    return value


def _one_line(text: Any) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        cur = cur.setdefault(k, {})
        if not isinstance(cur, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a mapping")
    cur[keys[-1]] = value


def _read_config_bytes(path: str) -> bytes:
    """At most :data:`MAX_CONFIG_BYTES` of a config file. A local path that is not a regular file (a
    pipe would block, /dev/zero never ends) is refused before it is opened; the size is checked while
    reading (also on s3://), so nothing larger is ever held in memory."""
    import stat

    if not storage.is_s3(path):
        try:
            _, local = storage.resolve(path)
            mode = os.stat(local).st_mode
        except storage.StorageError as e:
            raise ConfigError(f"config {e}") from e
        except FileNotFoundError:
            mode = None   # read_bytes says so, in the store's own words
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config: {e.strerror or type(e).__name__}") from None
        if mode is not None and stat.S_ISDIR(mode):
            raise ConfigError(f"{path}: is a directory, not a config file")
        if mode is not None and not stat.S_ISREG(mode):
            raise ConfigError(f"{path}: not a regular file (a device, pipe or socket); a config is a "
                              f"YAML/JSON file")
    try:
        return storage.read_bytes(path, limit=MAX_CONFIG_BYTES)
    except storage.TooLargeError:
        raise ConfigError(f"{path}: larger than 1 MiB ({MAX_CONFIG_BYTES} bytes); a config file is a small "
                          f"mapping (put data in the store and name its URI)") from None
    except storage.StorageError as e:
        raise ConfigError(f"config {e}") from e


def load_config_file(path: str) -> dict:
    """A YAML/JSON config file as a mapping. Every way it can be wrong is one ConfigError line naming
    the file: unreadable, not a regular file, over 1 MiB, not UTF-8 text (a binary file), not
    YAML/JSON, a value that cannot be read (a 5,000-digit integer), nested too deeply for the parser,
    more values than :data:`MAX_CONFIG_VALUES` once aliases are expanded, or not a mapping."""
    raw = _read_config_bytes(path)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text config file (byte {e.start} is not UTF-8: {e.reason})") from None
    try:
        data = yaml.load(text, Loader=ConfigLoader) or {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {_one_line(e)}") from e
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to parse (a config is a shallow mapping)") from None
    except (ValueError, OverflowError) as e:
        raise _unreadable_value(path, e) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping, got {type(data).__name__}")
    _check_values(data, path)
    return data


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str] | None:
    """The field names of the (nested) model that ``loc``'s last key sits in; None where the path
    leaves the models (a mapping field, a list)."""
    from typing import get_args, get_origin

    cls: Any = model
    for key in loc[:-1]:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or key not in cls.model_fields:
            return None
        tp = cls.model_fields[key].annotation
        if get_origin(tp) is not None:   # Optional[Model], Model | None
            models = [a for a in get_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)]
            tp = models[0] if len(models) == 1 else None
        cls = tp
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return list(cls.model_fields)
    return None


def validate_config(name: str, data: dict, source: str = "config") -> StageConfig:
    st = get_stage(name)
    try:
        return st.config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(root)"
            hint = ""
            if err.get("type") == "extra_forbidden" and err["loc"]:
                hint = suggest(err["loc"][-1], _fields_at(st.config, tuple(err["loc"])) or [])
            lines.append(f"  {loc}: {err['msg']}{hint}")
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
        set_path(data, k.strip(), parse_value(v, f"--set {k.strip()}"))
    return validate_config(name, data, source=file or "command line")
