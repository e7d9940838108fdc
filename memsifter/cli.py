"""The ``memsifter`` command line.

``memsifter run STAGE`` is generated from the stage registry: every config field is a flag, nested
settings included, to any depth (``--model``, ``--batch-size``, ``--endpoint.base-url``,
``--vllm.replicas``, ``--reward.mode``; ``_`` works for ``-`` in names). ``--help`` groups the flags of
each nested setting under its name and description, marks required fields "(required)" and states each
default once. Types come from the config: ``--x``/``--no-x`` for booleans (``--a.no-x`` nested),
choices for Literals, several values for lists, one JSON/YAML value for mappings and other shapes.

Where a value comes from, lowest first: the config's defaults < ``--config FILE`` (YAML/JSON, local or
s3://) < flags < ``--set key.sub=value`` (YAML value, applied in order, the last wins). A nested flag
changes only its own field: ``--vllm.replicas 2`` keeps the other ``vllm`` settings of the config
file, and sets ``endpoint`` (with defaults for the rest) where the config left it unset. Errors a user
can cause print one line and exit 2 (a flag argparse rejects: its usage line and exit 2); nothing is
published on error.

Published outputs are not replaced by mistake: ``--force`` re-runs a stage over its own output made
with the same config (and replaces a broken ``_SUCCESS``); ``--replace`` is needed to replace an output
this stage published with a different config; another stage's output is never replaced, and an output
that is, contains or lies inside an input is refused (:meth:`memsifter.stage.Stage.run`).
"""
from __future__ import annotations

import argparse
import enum
import importlib
import json
import logging
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import __version__
from .console import SuggestingParser, plain, setup_logging
from .errors import ConfigError, MemsifterError

if TYPE_CHECKING:
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

log = logging.getLogger("memsifter")

# Command groups owned by other modules: name -> (module, help). Each module has main(argv) -> int.
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "pipeline": ("memsifter.pipeline", "run several stages in order under one run prefix"),
    "demo": ("memsifter.demo", "offline end-to-end demo: real samples, real SmolLM2 ranker and working LLM"),
    "status": ("memsifter.status", "what each stage of a run is doing: published / running / failed / not started"),
    "models": ("memsifter.models.registry", "real models that install offline from PyPI (list, path, verify)"),
    "k8s": ("memsifter.k8s.cli", "render RayJobs and drive a pipeline on Kubernetes"),
    "serve": ("memsifter.service.cli", "memory retrieval online: Search-R1's /retrieve and a memory API (Ray Serve)"),
}


FORCE_HELP = ("re-run even if the output is already published with this config (also when a published "
              "file was damaged or its _SUCCESS is broken: that is replaced). It never replaces an output of "
              "another config (see --replace) or of another stage, and does not take an output a live run "
              "holds (see --steal-lease)")
STEAL_HELP = ("take over the output's lease from another run (use only when that run is dead; it stops "
              "before publishing if it is not)")
REPLACE_HELP = ("replace an output this stage published with a DIFFERENT config (without it that is refused, "
                "so a changed flag cannot silently overwrite published work); another stage's output is "
                "never replaced")


# --------------------------------------------------------------------------- flags from a config
CONFIG_DEST = "cfg:"   # argparse dest prefix of the flags generated from a config: "cfg:vllm.replicas"

# A description that already states its default ("(default: ...", "; default: ...", "default: ...")
# gets no second "(default: ...)"; "verl's default, ..." is not such a statement.
_STATES_DEFAULT = re.compile(r"(^|[(;]\s*)default\b", re.IGNORECASE)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """Strip Optional[...]; returns (type, optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _model_type(tp: Any) -> type[BaseModel] | None:
    """The pydantic model of a field typed ``Model`` or ``Model | None``; None otherwise."""
    from pydantic import BaseModel

    tp, _ = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _choices(tp: Any) -> list | None:
    """The allowed values of a Literal or Enum type; None for other types."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m.value for m in tp]
    return None


def _choice(values: list) -> Callable[[str], Any]:
    """argparse ``type`` that maps a word to the choice it spells (so ``Literal[1, 2]`` gets ints);
    an unknown word passes through for argparse's "invalid choice" message."""
    by_text = {str(v): v for v in values}

    def convert(text: str) -> Any:
        return by_text.get(text, text)

    convert.__name__ = "choice"
    return convert


def _yaml_value(text: str) -> Any:
    """argparse ``type`` of a mapping/complex field: a YAML or JSON value, as ``--set`` takes."""
    from . import stage as stg

    return stg.parse_value(text, "a JSON/YAML flag value")


_yaml_value.__name__ = "JSON/YAML"

NULL_WORDS = frozenset({"", "~", "null", "none"})   # what unsets an optional flag (YAML's nulls, and "none")


def _or_null(tp: type) -> Callable[[str], Any]:
    """argparse ``type`` of an optional scalar field: ``null``/``none``/``~``/empty (any case) unsets it, as
    ``--set key=null`` does (``--search-api-key-env null`` is anonymous access, not a variable named null)."""
    def convert(text: str) -> Any:
        return None if text.strip().lower() in NULL_WORDS else tp(text)

    convert.__name__ = tp.__name__
    return convert


class _BoolFlag(argparse.Action):
    """``--x`` sets True, ``--no-x`` (``--a.no-x`` for a nested field) sets False."""

    def __init__(self, option_strings: list[str], dest: str, negative: str = "", **kw: Any) -> None:
        self.negative = negative
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, option_string != self.negative)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value.value if isinstance(value, enum.Enum) else value)


def _field_help(f: FieldInfo, has_default: bool, default: Any) -> str:
    """A field's help line: its description, then "(required)" or its default, stated once."""
    desc = " ".join((f.description or "").split())
    if not has_default:
        tail = "(required)"
    elif _STATES_DEFAULT.search(desc):
        tail = ""   # the description says what the default is (often better than the raw value)
    else:
        tail = f"(default: {_show(default)})"
    return " ".join(x for x in (desc, tail) if x).replace("%", "%%")


def _field_default(f: FieldInfo, name: str, parent_default: Any) -> tuple[bool, Any]:
    """(has a default, the default) of a field; inside a model whose default is an instance, the
    instance's value (``vllm: VLLMSettings = VLLMSettings(replicas=4)`` shows replicas 4)."""
    from pydantic import BaseModel

    if isinstance(parent_default, BaseModel):
        return True, getattr(parent_default, name, None)
    if f.is_required():
        return False, None
    try:
        return True, f.get_default(call_default_factory=True)
    except (TypeError, ValueError):  # a default factory that needs the validated data
        return True, None


def _group_text(f: FieldInfo, model: type[BaseModel], dotted: str, has_default: bool, default: Any) -> str:
    desc = " ".join((f.description or plain(model.__doc__)).split())
    if default is None:
        how = (f"unset by default: any flag below sets it, the rest at these defaults; --set {dotted}=null "
               f"unsets it" if has_default else "required: set it with the flags below, --config or --set")
        desc = f"{desc} ({how})" if desc else how.capitalize()
    return desc.replace("%", "%%")


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type[BaseModel],
                     group: Any = None, prefix: tuple[str, ...] = (), parent_default: Any = None,
                     _seen: tuple[type, ...] = ()) -> list[str]:
    """Add one flag per leaf field of a pydantic config, nested models included, to any depth:
    ``--batch-size`` for a top-level field, ``--vllm.replicas`` for a field of the ``vllm`` model
    (each nested model in its own argument group, titled by its dotted name). Fields with no flag type
    of their own (mappings, lists of lists, unions) take one JSON/YAML value, as ``--set`` does.
    Every flag stores under ``CONFIG_DEST + dotted name`` only when given (argparse.SUPPRESS), so
    ``config_flag_values`` returns exactly what was given. Returns the dotted names added."""
    group = group if group is not None else parser
    added: list[str] = []
    nested: list[tuple[str, FieldInfo, type[BaseModel]]] = []
    for name, f in config_cls.model_fields.items():
        dotted = ".".join((*prefix, name))
        has_default, default = _field_default(f, name, parent_default)
        model = _model_type(f.annotation)
        if model is not None and model not in _seen:
            nested.append((name, f, model))
            continue
        flag = "--" + dotted.replace("_", "-")
        kw: dict[str, Any] = {"dest": CONFIG_DEST + dotted, "default": argparse.SUPPRESS,
                              "help": _field_help(f, has_default, default)}
        tp, optional = _unwrap(f.annotation)
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        leaf_meta = name.upper()
        if tp is bool:
            negative = "--" + ".".join((*prefix, "no-" + name)).replace("_", "-")
            group.add_argument(flag, negative, action=_BoolFlag, negative=negative, **kw)
        elif tp in (str, int, float):
            group.add_argument(flag, type=_or_null(tp) if optional else tp, metavar=leaf_meta, **kw)
        elif _choices(tp) is not None:
            group.add_argument(flag, type=_choice(_choices(tp)), choices=_choices(tp), **kw)
        elif item in (str, int, float):
            group.add_argument(flag, type=item, nargs="*", metavar="V", **kw)
        elif item is not None and _choices(item) is not None:
            group.add_argument(flag, type=_choice(_choices(item)), choices=_choices(item), nargs="*", **kw)
        else:
            group.add_argument(flag, type=_yaml_value, metavar="JSON", **kw)
        added.append(dotted)
    # Nested models after the fields of their parent, each in its own group (argparse groups do not nest).
    for name, f, model in nested:
        dotted = ".".join((*prefix, name))
        has_default, default = _field_default(f, name, parent_default)
        sub = parser.add_argument_group(dotted, _group_text(f, model, dotted, has_default, default))
        added += add_config_flags(parser, model, sub, (*prefix, name), default, (*_seen, config_cls))
    return added


def config_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The config flags given on a command line: dotted name -> value."""
    return {k[len(CONFIG_DEST):]: v for k, v in vars(args).items() if k.startswith(CONFIG_DEST)}


def _normalise_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Accept ``_`` for ``-`` in flag names (``--endpoint.base_url`` = ``--endpoint.base-url``): a
    ``--name[=value]`` word is rewritten where the rewritten name starts a known flag; words after
    ``--`` are left alone."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    out: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            return out + argv[i:]
        name, eq, value = word.partition("=")
        if word.startswith("--") and "_" in name:
            fixed = "--" + name[2:].replace("_", "-")
            if any(o.startswith(fixed) for o in known):
                word = fixed + eq + value
        out.append(word)
    return out


def _seed(f: FieldInfo | None) -> dict:
    """What a nested setting holds before a flag sets one of its fields, where the config left it
    unset: the field's default instance (its explicitly set fields), so the flag refines the default."""
    from pydantic import BaseModel

    if f is None or f.is_required():
        return {}
    try:
        default = f.get_default(call_default_factory=True)
    except (TypeError, ValueError):  # a default factory that needs the validated data
        return {}
    return default.model_dump(exclude_unset=True) if isinstance(default, BaseModel) else {}


def merge_path(data: dict, dotted: str, value: Any, model: type[BaseModel] | None = None,
               what: str | None = None) -> None:
    """Set ``a.b.c`` in a config mapping, keeping what else ``a`` and ``a.b`` hold (a nested flag
    refines the config file's setting, it does not replace it). A parent that is missing or null
    becomes a mapping (seeded from ``model``'s default for it); one that is not a mapping is a
    ConfigError naming ``what`` (the flag or ``--set key``)."""
    keys = dotted.split(".")
    cur, cls = data, model
    for i, k in enumerate(keys[:-1]):
        f = cls.model_fields.get(k) if cls is not None else None
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = _seed(f)
        elif not isinstance(nxt, dict):
            raise ConfigError(f"{what or '--' + dotted}: '{'.'.join(keys[:i + 1])}' is {nxt!r}, not a mapping")
        cur = nxt
        cls = _model_type(f.annotation) if f is not None else None
    cur[keys[-1]] = value


def compose_config(name: str, file: str | None, flags: dict[str, Any], sets: Sequence[str]) -> Any:
    """The validated config of stage ``name``: defaults < ``--config`` file < flags < ``--set key=value``
    (in order; the last wins). Flags and ``--set`` keys are dotted paths merged into the mapping."""
    from . import stage as stg

    model = stg.get_stage(name).config
    data = stg.load_config_file(file) if file else {}
    for dotted, value in flags.items():
        merge_path(data, dotted, value, model, "--" + dotted.replace("_", "-"))
    for s in sets:
        if "=" not in s:
            raise ConfigError(f"--set {s}: expected key=value")
        k, v = s.split("=", 1)
        merge_path(data, k.strip(), stg.parse_value(v, f"--set {k.strip()}"), model, f"--set {k.strip()}")
    return stg.validate_config(name, data, source=file or "command line")


def _stage_main(argv: Sequence[str]) -> int:
    from . import stage as stg

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: memsifter run STAGE [options]\n\nstages:")
        for name in stg.available_stages():
            try:
                print(f"  {name:<12} {stg.get_stage(name).help}")
            except Exception as e:  # a stage whose extras are not installed
                print(f"  {name:<12} (unavailable: {e})")
        print("\n`memsifter run STAGE --help` lists a stage's options.")
        return 0
    if argv[0] not in stg.available_stages() and argv[0] not in stg.STAGES:
        known = stg.available_stages()
        raise ConfigError(f"unknown stage '{argv[0]}'{stg.suggest(argv[0], known)} (known: {', '.join(known)})")
    return run_stage_cli(argv[0], list(argv[1:]))


STAGE_EPILOG = ("Every config field is a flag; a field of a nested setting is dotted (--vllm.replicas 2) and "
                "changes only that field, keeping the rest from --config. Flag names take - or _ "
                "(--endpoint.base_url). Any field can also be set with --set key.sub=value (a YAML/JSON value; "
                "key=null unsets). Precedence: defaults < --config < flags < --set.")


def stage_parser(name: str, prog: str | None = None,
                 positionals: Sequence[tuple[str, str]] = ()) -> argparse.ArgumentParser:
    """The argument parser of ``memsifter run NAME``: run controls, then the config's flags."""
    from . import stage as stg

    st = stg.get_stage(name)
    pos = "".join(f" {meta}" for _, meta in positionals)
    p = SuggestingParser(prog=prog or f"memsifter run {name}", description=st.help, epilog=STAGE_EPILOG,
                         usage=f"%(prog)s{pos} [--config FILE] [--set KEY=VALUE] [--FIELD VALUE ...] [options]")
    for field, meta in positionals:
        p.add_argument(f"_pos_{field}", metavar=meta, help=f"the {field!r} field")
    p.add_argument("--config", metavar="FILE", help="YAML/JSON config file (local path or s3:// URI)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="set a field, nested ones with dotted keys (repeatable; wins over flags)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--replace", action="store_true", help=REPLACE_HELP)
    p.add_argument("--steal-lease", action="store_true", help=STEAL_HELP)
    p.add_argument("--print-config", action="store_true", help="print the validated config and exit")
    p.add_argument("--schema", action="store_true", help="print the config's JSON schema and exit")
    if terminal_summary(name):
        p.add_argument("--json", action="store_true",
                       help="print the output's stats as JSON instead of its tables")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    settings = p.add_argument_group(f"{name} settings", plain(st.config.__doc__) or None)
    add_config_flags(p, st.config, settings)
    return p


def run_stage_cli(name: str, rest: list[str], prog: str | None = None,
                  positionals: Sequence[tuple[str, str]] = ()) -> int:
    """One command line per stage, generated from its config: ``memsifter run NAME`` and the
    front doors that are the same stage (``memsifter data import SRC DEST`` = ``run import`` with
    ``source``/``output`` given positionally); same flags, same precedence, same skip/--force."""
    from . import stage as stg

    st = stg.get_stage(name)
    p = stage_parser(name, prog, positionals)
    args = p.parse_args(_normalise_flags(list(rest), p))
    setup_logging(-1 if args.quiet else args.verbose)
    if args.schema:
        print(json.dumps(st.config.model_json_schema(), indent=2))
        return 0
    flags = config_flag_values(args)
    for field, _ in positionals:
        flags[field] = getattr(args, f"_pos_{field}")
    cfg = compose_config(name, args.config, flags, args.set)
    if args.print_config:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return 0
    manifest = st.run(cfg, force=args.force, steal_lease=args.steal_lease, replace=args.replace)
    if not manifest.get("dry_run"):
        report_manifest(cfg.output, manifest, None if getattr(args, "json", False) else terminal_summary(name))
    return 0


def terminal_summary(name: str) -> Callable[[dict], list[str]] | None:
    """A stage's own screen of its output (its module's ``terminal_summary(manifest)``: evaluate's tables),
    or None: the stats are printed as JSON."""
    import importlib

    from . import stage as stg

    return getattr(importlib.import_module(stg.get_stage(name).module), "terminal_summary", None)


def report_manifest(uri: str, manifest: dict, summary: Callable[[dict], list[str]] | None = None) -> None:
    state = "already published (skipped)" if manifest.get("skipped") else "published"
    print(f"{manifest['stage']}: {state}: {uri}")
    stats = manifest.get("stats") or {}
    if summary:
        print("\n".join(summary(manifest)))
    elif stats:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))


# --------------------------------------------------------------------------- data commands
def _data_main(argv: Sequence[str]) -> int:
    from . import stage as stg

    if argv and argv[0] == "import":
        return run_stage_cli("import", list(argv[1:]), prog="memsifter data import",
                             positionals=(("source", "SRC"), ("output", "DEST")))
    p = SuggestingParser(prog="memsifter data", description="Import, export, synthesise and inspect datasets")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true", help="only memsifter's warnings and errors")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("import", help="convert a raw source file into a memsifter dataset (= memsifter run import "
                                  "--source SRC --output DEST; `memsifter data import --help` lists its flags)")
    exp = sub.add_parser("export", help="export a dataset to MemSifter-style parquet (one row per question)")
    exp.add_argument("--format", default="memsifter", choices=["memsifter"])
    exp.add_argument("src")
    exp.add_argument("dest", help="output parquet file URI (not inside a published output: refused)")
    syn = sub.add_parser("synth", help="deterministic synthetic dataset with planted gold sessions")
    syn.add_argument("dest")
    syn.add_argument("--questions", type=int, default=12)
    syn.add_argument("--sessions", type=int, default=16, help="haystack sessions per question")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--force", action="store_true", help=FORCE_HELP)
    syn.add_argument("--replace", action="store_true", help=REPLACE_HELP)
    syn.add_argument("--steal-lease", action="store_true", help=STEAL_HELP)
    syn.add_argument("-q", "--quiet", dest="cmd_quiet", action="store_true",
                     help="only memsifter's warnings and errors")
    info = sub.add_parser("info", help="summary of a published dataset or stage output")
    info.add_argument("uri")
    args = p.parse_args(argv)
    setup_logging(-1 if args.quiet or getattr(args, "cmd_quiet", False) else args.verbose)
    if args.cmd == "synth":
        cfg = {"output": args.dest, "questions": args.questions, "sessions_per_question": args.sessions,
               "seed": args.seed}
        m = stg.get_stage("synth").run(cfg, force=args.force, replace=args.replace, steal_lease=args.steal_lease)
        report_manifest(args.dest, m)
    elif args.cmd == "export":
        from .data.importers import export_memsifter
        n = export_memsifter(args.src, args.dest)
        print(f"exported {n} questions to {args.dest}")
    elif args.cmd == "info":
        from .store import storage
        from .errors import NotPublishedError
        try:
            m = storage.read_manifest(args.uri)
        except NotPublishedError:
            if storage.exists(storage.join(args.uri, "_run")) or any(
                    storage.exists(storage.join(args.uri, d, storage.MANIFEST)) for d in storage.list_dirs(args.uri)):
                raise NotPublishedError(f"{args.uri}: a run prefix, not one stage's output: `memsifter status "
                                        f"{args.uri}` shows each stage") from None
            raise
        print(f"{args.uri}: stage {m['stage']}, published {m['published_at']}, code {m['code_version']}")
        for fname, meta in sorted(m["files"].items()):
            rows = f", {meta['rows']} rows" if "rows" in meta else ""
            print(f"  {fname}: {meta['bytes']} bytes{rows}")
        if m.get("stats"):
            print(json.dumps(m["stats"], indent=2, sort_keys=True, default=str))
    return 0


def _stages_main(argv: Sequence[str]) -> int:
    return _stage_main(["--help"])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run": ("run one stage", _stage_main), "data": ("datasets", _data_main),
                "stages": ("list stages", _stages_main)}
    if not argv or argv[0] in ("-h", "--help"):
        print(f"memsifter {__version__}: MemSifter memory retrieval as a batch platform\n\n"
              "usage: memsifter COMMAND ...\n\ncommands:")
        for k, (h, _) in commands.items():
            print(f"  {k:<10} {h}")
        for k, (_, h) in EXTERNAL_COMMANDS.items():
            print(f"  {k:<10} {h}")
        print("\n`memsifter COMMAND --help` for details.")
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd in commands:
            return commands[cmd][1](rest)
        if cmd in EXTERNAL_COMMANDS:
            mod = importlib.import_module(EXTERNAL_COMMANDS[cmd][0])
            return int(mod.main(rest) or 0)
        from .stage import suggest

        hint = suggest(cmd, [*commands, *EXTERNAL_COMMANDS])
        print(f"memsifter: unknown command '{cmd}'{hint} (see memsifter --help)", file=sys.stderr)
        return 2
    except MemsifterError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except RecursionError:   # input nested deeper than a parser copes with, where no file could be named
        print("error: input nested too deeply to process (RecursionError)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
