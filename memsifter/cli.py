"""The ``memsifter`` command line.

``memsifter run STAGE`` is generated from the stage registry: every simple config field becomes a
flag (``--model``, ``--batch-size``), any field can be set with ``--set key=value`` (dotted keys for
nested ones), and ``--config FILE`` loads YAML/JSON (local or s3://). Errors a user can cause print one
line and exit 2; nothing is published on error.

Published outputs are not replaced by mistake: ``--force`` re-runs a stage over its own output made
with the same config (and replaces a broken ``_SUCCESS``); ``--replace`` is needed to replace an output
this stage published with a different config; another stage's output is never replaced, and an output
that is, contains or lies inside an input is refused (:meth:`memsifter.stage.Stage.run`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import types
import typing
from typing import Any, Sequence

from . import __version__
from .errors import MemsifterError

log = logging.getLogger("memsifter")

# Command groups owned by other modules: name -> (module, help). Each module has main(argv) -> int.
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "pipeline": ("memsifter.pipeline", "run several stages in order under one run prefix"),
    "demo": ("memsifter.demo", "offline end-to-end demo: real samples, real SmolLM2 ranker and working LLM"),
    "status": ("memsifter.status", "what each stage of a run is doing: published / running / failed / not started"),
    "models": ("memsifter.models", "real models that install offline from PyPI (list, path, verify)"),
    "k8s": ("memsifter.k8s.cli", "render RayJobs and drive a pipeline on Kubernetes"),
}


def plain(doc: str | None) -> str:
    """A module docstring's first paragraph for ``--help``: reST literals (````x````) and roles
    (``:func:`x```) shown as plain text."""
    import re

    first = (doc or "").strip().split("\n\n")[0]
    first = re.sub(r":\w+:`~?([^`]+)`", r"\1", first)
    return re.sub(r"``([^`]+)``", r"\1", first)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (so redirected stderr is honoured)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def setup_logging(verbose: int = 0) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose >= 0 else logging.WARNING
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("urllib3", "botocore", "filelock", "httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if verbose < 0:  # -q: Ray Data's advice (e.g. "high memory" every 30 s) is not the user's business
        for name in ("ray.data._internal.issue_detection", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)


FORCE_HELP = ("re-run even if the output is already published with this config (also when a published "
              "file was damaged or its _SUCCESS is broken: that is replaced). It never replaces an output of "
              "another config (see --replace) or of another stage, and does not take an output a live run "
              "holds (see --steal-lease)")
REPLACE_HELP = ("replace an output this stage published with a DIFFERENT config (without it that is refused, "
                "so a changed flag cannot silently overwrite published work); another stage's output is "
                "never replaced")


# --------------------------------------------------------------------------- flags from a config
def _unwrap(tp: Any) -> tuple[Any, bool]:
    """Strip Optional[...]; returns (type, optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type) -> list[str]:
    """Add one flag per simple field of a pydantic config; returns the field names added."""
    added = []
    for name, f in config_cls.model_fields.items():
        tp, _ = _unwrap(f.annotation)
        origin = typing.get_origin(tp)
        flag = "--" + name.replace("_", "-")
        desc = (f.description or "").replace("%", "%%")
        default = None if f.is_required() else f.get_default(call_default_factory=True)
        help_ = f"{desc} (default: {default!r})" if not f.is_required() else f"{desc} (required)"
        kw: dict[str, Any] = {"dest": name, "default": None, "help": help_}
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif tp in (str, int, float):
            parser.add_argument(flag, type=tp, metavar=name.upper(), **kw)
        elif origin is typing.Literal:
            parser.add_argument(flag, choices=[str(a) for a in typing.get_args(tp)], **kw)
        elif origin is list and typing.get_args(tp) and typing.get_args(tp)[0] in (str, int, float):
            parser.add_argument(flag, type=typing.get_args(tp)[0], nargs="+", metavar="V", **kw)
        else:
            continue  # nested models and mappings: --set key=value or --config
        added.append(name)
    return added


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
    return run_stage_cli(argv[0], list(argv[1:]))


def run_stage_cli(name: str, rest: list[str], prog: str | None = None,
                  positionals: Sequence[tuple[str, str]] = ()) -> int:
    """One command line per stage, generated from its config: ``memsifter run NAME`` and the
    front doors that are the same stage (``memsifter data import SRC DEST`` = ``run import`` with
    ``source``/``output`` given positionally); same flags, same precedence, same skip/--force."""
    from . import stage as stg

    st = stg.get_stage(name)
    p = argparse.ArgumentParser(prog=prog or f"memsifter run {name}", description=st.help,
                                epilog="Any field, nested ones too: --set key.sub=value. "
                                       "Precedence: --config < flags < --set.")
    for field, meta in positionals:
        p.add_argument(f"_pos_{field}", metavar=meta, help=f"the {field!r} field")
    p.add_argument("--config", help="YAML/JSON config file (local path or s3:// URI)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--replace", action="store_true", help=REPLACE_HELP)
    p.add_argument("--steal-lease", action="store_true", help="take over the output's lease from another "
                   "run (use only when that run is dead; it stops before publishing if it is not)")
    p.add_argument("--print-config", action="store_true", help="print the validated config and exit")
    p.add_argument("--schema", action="store_true", help="print the config's JSON schema and exit")
    p.add_argument("-v", "--verbose", action="count", default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    fields = add_config_flags(p, st.config)
    args = p.parse_args(rest)
    setup_logging(-1 if args.quiet else args.verbose)
    if args.schema:
        print(json.dumps(st.config.model_json_schema(), indent=2))
        return 0
    flags = {f: getattr(args, f) for f in fields}
    for field, _ in positionals:
        flags[field] = getattr(args, f"_pos_{field}")
    cfg = stg.build_config(name, args.config, args.set, flags)
    if args.print_config:
        print(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return 0
    manifest = st.run(cfg, force=args.force, steal_lease=args.steal_lease, replace=args.replace)
    if not manifest.get("dry_run"):
        report_manifest(cfg.output, manifest)
    return 0


def report_manifest(uri: str, manifest: dict) -> None:
    state = "already published (skipped)" if manifest.get("skipped") else "published"
    print(f"{manifest['stage']}: {state}: {uri}")
    stats = manifest.get("stats") or {}
    if stats:
        print(json.dumps(stats, indent=2, sort_keys=True, default=str))


# --------------------------------------------------------------------------- data commands
def _data_main(argv: Sequence[str]) -> int:
    from . import stage as stg

    if argv and argv[0] == "import":
        return run_stage_cli("import", list(argv[1:]), prog="memsifter data import",
                             positionals=(("source", "SRC"), ("output", "DEST")))
    p = argparse.ArgumentParser(prog="memsifter data", description="Import, export, synthesise and inspect datasets")
    p.add_argument("-v", "--verbose", action="count", default=0)
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
    info = sub.add_parser("info", help="summary of a published dataset or stage output")
    info.add_argument("uri")
    args = p.parse_args(argv)
    setup_logging(args.verbose)
    if args.cmd == "synth":
        cfg = {"output": args.dest, "questions": args.questions, "sessions_per_question": args.sessions,
               "seed": args.seed}
        m = stg.get_stage("synth").run(cfg, force=args.force, replace=args.replace)
        report_manifest(args.dest, m)
    elif args.cmd == "export":
        from .data.importers import export_memsifter
        n = export_memsifter(args.src, args.dest)
        print(f"exported {n} questions to {args.dest}")
    elif args.cmd == "info":
        from . import storage
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
        print(f"memsifter: unknown command '{cmd}' (see memsifter --help)", file=sys.stderr)
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
