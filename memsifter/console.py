"""What the ``memsifter`` commands print: help text from docstrings, argument errors with the nearest
flag, and logging that shows memsifter's own lines (``-q`` fewer, ``-v`` more). Every command module
(``cli``, ``pipeline``, ``demo``, ``status``, ``k8s``, ``serve``) takes these from here."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import typing


def plain(doc: str | None) -> str:
    """A module docstring's first paragraph for ``--help``: reST literals (````x````) and roles
    (``:func:`x```) shown as plain text."""
    import re

    first = (doc or "").strip().split("\n\n")[0]
    first = re.sub(r":\w+:`~?([^`]+)`", r"\1", first)
    return re.sub(r"``([^`]+)``", r"\1", first)


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the nearest flag or choice to a typo: ``unrecognized
    arguments: --inptu (did you mean --input?)``, ``invalid choice: 'statsu' ... (did you mean
    'status'?)``. Subparsers are of the same class; an unknown flag is matched against the flags of
    this parser and of all its subcommands."""

    def _all_options(self) -> list[str]:
        out = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    if isinstance(sub, SuggestingParser):
                        out += sub._all_options()
        return out

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        from .stage import suggest

        if message.startswith("unrecognized arguments: "):
            words = message[len("unrecognized arguments: "):].split()
            hints = [f"{w}{suggest(w.split('=')[0][2:], [o[2:] for o in self._all_options()], prefix='--')}"
                     for w in words if w.startswith("--")]
            hints = [h for h in hints if "did you mean" in h]
            if hints:
                message += "; " + "; ".join(hints)
        else:
            m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
            if m:
                message += suggest(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
        super().error(message)


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


class _OwnLines(logging.Filter):
    """What reaches the terminal: at ``-q`` only memsifter's own warnings and errors; otherwise no
    record below the chosen level, also from a library that lowers its own logger's level (bm25s sets
    DEBUG on import, which would print 24 lines per embed run)."""

    def __init__(self, level: int, own_only: bool):
        super().__init__()
        self.level, self.own_only = level, own_only

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return False
        return not self.own_only or record.name == "memsifter" or record.name.startswith("memsifter.")


QUIET_LOGGERS = ("bm25s", "ray", "ray.data", "vllm", "py.warnings", "urllib3", "botocore", "filelock", "httpx",
                 "httpx2", "openai", "transformers", "sentence_transformers", "torch")


def setup_logging(verbose: int = 0) -> None:
    """Log lines on stderr: ``-v`` info (the default), ``-vv`` debug, ``-q`` (verbose < 0) only
    memsifter's own warnings and errors, Ray's and vLLM's lines routed away from the terminal
    (:func:`memsifter.models.raypool.set_quiet`); progress bars (tqdm) still show."""
    from .models import raypool
    from .service.logs import RedactingFilter

    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose >= 0 else logging.WARNING
    quiet = verbose < 0
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(_OwnLines(level, quiet))
    handler.addFilter(RedactingFilter(()))   # every credential the process knows, in any of its forms
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("urllib3", "botocore", "filelock", "httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(quiet)   # Python warnings become "py.warnings" records, which -q leaves out
    if quiet:  # Ray Data's advice (e.g. "high memory" every 30 s) is not the user's business
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
    raypool.set_quiet(quiet)


# C0 controls (ESC among them), DEL, C1 controls (0x9b is a one-byte CSI) and the bidirectional overrides
# and isolates (text that reads differently from what it is): what a terminal would act on.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """``text`` safe to print on a terminal: every control character (newline included) shown as its
    escape (``\\x1b``, ``\\n``, ``\\u202e``), so a string read from a store file can neither move the
    cursor, recolour, retitle the terminal nor start a line of its own."""
    def esc(m: re.Match) -> str:
        c = ord(m.group())
        return {10: "\\n", 9: "\\t", 13: "\\r"}.get(c) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")
    return _CONTROL.sub(esc, str(text))
