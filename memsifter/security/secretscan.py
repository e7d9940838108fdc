"""A small secret scanner for what memsifter ships and writes.

``python -m memsifter.security.secretscan PATH_OR_URI...`` scans files, directories (recursively), tar/zip archives
(an image build context), gzip files, parquet tables and ``s3://`` prefixes (a run's outputs, its
``_SUCCESS`` manifests and logs) for:

* AWS access key ids (``AKIA``/``ASIA``... + 16) and AWS secret access keys in an assignment
  (``aws_secret_access_key = ...``, ``AWS_SECRET_ACCESS_KEY: ...``, JSON keys alike) or a Kubernetes env
  entry (``name: AWS_SECRET_ACCESS_KEY`` then ``value: ...``, in YAML or JSON);
* OpenAI API keys (``sk-...``, ``sk-proj-...``, ``sk-svcacct-...``, ``sk-admin-...``);
* Hugging Face tokens (``hf_...``) and GitHub tokens (``ghp_``/``gho_``/``github_pat_``);
* PEM private keys (``-----BEGIN ... PRIVATE KEY-----``).

Matches are printed redacted (prefix and length only), one per line: ``location: kind: redacted``. Exit
status 1 when anything is found, 0 when clean, 2 on bad input (a path that does not exist). Values
containing ``EXAMPLE`` (AWS documentation keys) or ``CHANGE-ME`` are placeholders, not findings.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

# One place for the token shapes: what this scanner reports is what memsifter.security.redact removes from
# errors, logs and published columns.
from .redact import HINT, HINT_WORDS, PATTERNS

SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "node_modules", ".mypy_cache", ".ruff_cache"}
MAX_BYTES = 64 << 20  # larger files are reported as skipped, not read

PLACEHOLDERS = ("EXAMPLE", "CHANGE-ME", "CHANGEME", "XXXXXXXX", "xxxxxxxx")


@dataclass(frozen=True)
class Finding:
    location: str   # path[:member]:line
    kind: str
    redacted: str
    value: str      # the match itself: for callers (tests) only, never printed

    def __str__(self) -> str:
        return f"{self.location}: {self.kind}: {self.redacted}"


def _plausible(kind: str, value: str) -> bool:
    if any(p in value for p in PLACEHOLDERS):
        return False
    if kind in ("openai-api-key", "huggingface-token", "aws-secret-access-key", "github-token"):
        body = re.sub(r"^sk-(?:proj-|svcacct-|admin-)?", "", value) if kind == "openai-api-key" else value
        # real keys are random: letters and digits mixed (rules out e.g. sk-learn-style words, long names)
        letters = sum(c.isalpha() for c in body)
        digits = sum(c.isdigit() for c in body)
        if kind == "huggingface-token":
            return any(c.isupper() for c in body) and any(c.islower() for c in body)
        return letters >= 4 and digits >= 2
    return True


def redact(value: str) -> str:
    keep = 8 if value.startswith("sk-proj-") else 4
    return f"{value[:keep]}...({len(value)} chars)"


KNOWN = "credential"   # the kind of a finding that is one of the run's own credentials (``known``)


def scan_text(text: str, location: str, known: Iterable[str] = ()) -> list[Finding]:
    """Findings in ``text``: the token shapes of :data:`PATTERNS`, and each string of ``known`` (the run's
    credentials in their forms, :func:`memsifter.security.redact.known_secrets`), shown by length only."""
    out = []
    for start, end in _windows(text):
        part = text[start:end]
        for kind, rx in PATTERNS:
            for m in rx.finditer(part):
                value = m.group(1)
                if _plausible(kind, value):
                    line = text.count("\n", 0, start + m.start()) + 1
                    out.append(Finding(f"{location}:{line}", kind, redact(value), value))
    for value in known:
        at = text.find(value) if value else -1
        if at >= 0:
            out.append(Finding(f"{location}:{text.count(chr(10), 0, at) + 1}", KNOWN, f"({len(value)} chars)", value))
    return out


_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-/+=")


def _windows(text: str) -> list[tuple[int, int]]:
    """The parts of ``text`` that can hold a match of :data:`PATTERNS`: around each of
    :data:`HINT_WORDS`, to the end of the token that follows, merged. ``str.find``
    instead of the patterns over the whole text: those take seconds per MB-sized file (a binary read as
    text), the words milliseconds."""
    hits: list[int] = []
    for word in HINT_WORDS:
        at = text.find(word)
        while at >= 0:
            hits.append(at)
            at = text.find(word, at + 1)
    spans: list[tuple[int, int]] = []
    for at in sorted(hits):
        start, end = max(0, at - 64), min(len(text), at + 256)
        while end < len(text) and text[end] in _TOKEN_CHARS:
            end += 1
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
        else:
            spans.append((start, end))
    return spans


def scrub_text(text: str, known: Iterable[str] = ()) -> str:
    """``text`` with what :func:`scan_text` would report replaced by ``***``: the strings of ``known``
    (longest first) and the plausible token shapes; nothing else changes."""
    from .redact import MASK

    for value in sorted(known, key=len, reverse=True):
        if value and value in text:
            text = text.replace(value, MASK)
    for f in scan_text(text, ""):
        text = text.replace(f.value, MASK)
    return text


# --------------------------------------------------------------------------- tables (published columns)
def _hint(known: Iterable[str]) -> str:
    """An RE2 pattern (Arrow's) that every string holding a finding matches: a quick first pass over a
    column, so that only its few candidate values are scanned in Python."""
    def literal(text: str) -> str:   # RE2 escapes: every character that is not an ASCII letter or digit as \x{..}
        return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)
    return "|".join([HINT] + [literal(k) for k in known if k])


def _strings(arr: "pa.Array", fn: Callable[["pa.Array"], "pa.Array | None"],
             binary: bool = False) -> "pa.Array | None":
    """``fn`` applied to every string array inside ``arr`` (lists and structs opened; with ``binary``,
    binary and dictionary arrays too): the rebuilt array, or None when ``fn`` changed nothing (``fn``
    returns None for an array it leaves as it is)."""
    import pyarrow as pa

    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return fn(arr)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        values = _strings(arr.values, fn, binary)
        if values is None:
            return None
        cls = pa.ListArray if pa.types.is_list(t) else pa.LargeListArray
        return cls.from_arrays(arr.offsets, values, type=t, mask=arr.is_null() if arr.null_count else None)
    if pa.types.is_struct(t):
        kids = [arr.field(i) for i in range(t.num_fields)]
        new = [_strings(k, fn, binary) for k in kids]
        if all(n is None for n in new):
            return None
        return pa.StructArray.from_arrays([n if n is not None else k for n, k in zip(new, kids)],
                                          fields=list(t), mask=arr.is_null() if arr.null_count else None)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_dictionary(t):
        return fn(arr) if binary else None
    return None


def _candidates(arr: "pa.Array", hint: str) -> list[int]:
    import pyarrow.compute as pc

    hit = pc.fill_null(pc.match_substring_regex(arr, hint), False)
    return pc.indices_nonzero(hit).to_pylist() if pc.any(hit).as_py() else []


def scrub_table(table: "pa.Table", known: Iterable[str] = ()) -> "pa.Table":
    """``table`` with :func:`scrub_text` applied to every string value (lists and structs included; a
    column without a candidate is left untouched, not copied). Binary and dictionary columns are not
    rewritten: :func:`scan_table` reports what they hold."""
    import pyarrow as pa

    known = list(known)
    hint = _hint(known)

    def fix(arr: pa.Array) -> pa.Array | None:
        rows = _candidates(arr, hint)
        if not rows:
            return None
        values = arr.to_pylist()
        for i in rows:
            values[i] = scrub_text(values[i], known)
        return pa.array(values, arr.type)

    cols = []
    changed = False
    for col in table.columns:
        chunks = [_strings(c, fix) for c in col.chunks]
        changed |= any(c is not None for c in chunks)
        cols.append(pa.chunked_array([n if n is not None else c for n, c in zip(chunks, col.chunks)], col.type)
                    if any(c is not None for c in chunks) else col)
    return pa.Table.from_arrays(cols, schema=table.schema) if changed else table


def scan_table(table: "pa.Table", location: str, known: Iterable[str] = ()) -> list[Finding]:
    """Findings in a table's values (strings, in lists and structs too, and binary columns read as text)
    and its schema metadata; locations name the column and the row."""
    import pyarrow as pa

    known = list(known)
    hint = _hint(known)
    out: list[Finding] = []
    meta = table.schema.metadata or {}
    for k, v in meta.items():
        out += scan_text(f"{k.decode(errors='replace')}: {v.decode(errors='replace')}", f"{location}: metadata", known)
    for name, col in zip(table.column_names, table.columns):
        for chunk in col.chunks:
            def scan(arr: pa.Array, name: str = name) -> None:
                if pa.types.is_dictionary(arr.type):
                    arr = arr.dictionary_decode()
                if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
                    values = [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v
                              for v in arr.to_pylist()]
                    rows = [i for i, v in enumerate(values) if isinstance(v, str)]
                else:
                    values, rows = None, _candidates(arr, hint)
                for i in rows:
                    v = values[i] if values is not None else arr[i].as_py()
                    out.extend(scan_text(v, f"{location}: column {name} value {i}", known))
                return None
            _strings(chunk, scan, binary=True)
    return out


def _parquet_text(data: bytes) -> str:
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(data))
    meta = table.schema.metadata or {}
    rows = table.to_pylist()
    return json.dumps({"metadata": {k.decode(errors="replace"): v.decode(errors="replace") for k, v in meta.items()},
                       "rows": rows}, default=str, ensure_ascii=False, indent=0)


def scan_bytes(data: bytes, location: str, known: Iterable[str] = ()) -> list[Finding]:
    """Findings in one file's content (archives and parquet are opened; other binaries are read as text);
    ``known`` as in :func:`scan_text`."""
    name = location.lower()
    known = list(known)
    try:
        if data[:4] == b"PAR1" or name.endswith(".parquet"):
            return scan_text(_parquet_text(data), location, known)
        if data[:2] == b"\x1f\x8b":
            inner = gzip.decompress(data)
            if name.endswith((".tgz", ".tar.gz")) or _is_tar(inner):
                return _scan_tar(inner, location, known)
            return scan_bytes(inner, location + "!gunzip", known)
        if data[:4] == b"PK\x03\x04":
            out = []
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                for info in zf.infolist():
                    if not info.is_dir() and info.file_size <= MAX_BYTES:
                        out += scan_bytes(zf.read(info), f"{location}!{info.filename}", known)
            return out
        if _is_tar(data):
            return _scan_tar(data, location, known)
    except Exception as e:  # a corrupt container: scan its raw bytes instead, and say so
        print(f"secretscan: {location}: could not open ({e}); scanned as text", file=sys.stderr)
    return scan_text(data.decode("utf-8", errors="replace"), location, known)


def scan_stream(open_file: Callable[[], Any], size: int, location: str, known: Iterable[str] = ()) -> list[Finding]:
    """Findings in a file of ``size`` bytes that ``open_file()`` opens (a local file, a store object): as
    :func:`scan_bytes` up to :data:`MAX_BYTES`; a larger one (weights, checkpoints) is searched for the
    ``known`` strings only, in 8 MiB blocks that overlap."""
    known = list(known)
    if size <= MAX_BYTES:
        with open_file() as f:
            return scan_bytes(f.read(), location, known)
    wanted = [k.encode() for k in known if k]
    if not wanted:
        return []
    overlap, tail, offset = max(len(w) for w in wanted), b"", 0
    with open_file() as f:
        while block := f.read(8 << 20):
            window = tail + block
            for k, w in zip(known, wanted):
                if w in window:
                    return [Finding(f"{location}:byte {offset - len(tail) + window.index(w)}", KNOWN,
                                    f"({len(k)} chars)", k)]
            offset += len(block)
            tail = window[-overlap:]
    return []


def _is_tar(data: bytes) -> bool:
    return len(data) > 262 and data[257:262] == b"ustar"


def _scan_tar(data: bytes, location: str, known: Iterable[str] = ()) -> list[Finding]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for m in tf:
            if m.isfile() and m.size <= MAX_BYTES:
                f = tf.extractfile(m)
                if f is not None:
                    out += scan_bytes(f.read(), f"{location}!{m.name}", known)
    return out


def _walk(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.is_file() and not p.is_symlink():
                yield p


def scan_path(target: str) -> list[Finding]:
    """Findings under a local path or an ``s3://`` prefix. Raises FileNotFoundError for a missing target."""
    if "://" in target:
        from ..store import storage

        files = [target] if storage.is_file(target) else [storage.join(target, f) for f in storage.list_files(target)]
        if not files and not storage.exists(target):
            raise FileNotFoundError(target)
        out = []
        for uri in files:
            out += scan_bytes(storage.read_bytes(uri), uri)
        return out
    root = Path(target)
    if not root.exists():
        raise FileNotFoundError(target)
    out = []
    for p in _walk(root):
        if p.stat().st_size > MAX_BYTES:
            print(f"secretscan: {p}: larger than {MAX_BYTES >> 20} MiB, skipped", file=sys.stderr)
            continue
        out += scan_bytes(p.read_bytes(), str(p))
    return out


def scan(targets: Iterable[str]) -> list[Finding]:
    out = []
    for t in targets:
        out += scan_path(t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memsifter.security.secretscan", description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="+", metavar="PATH_OR_URI")
    args = ap.parse_args(argv)
    try:
        findings = scan(args.targets)
    except FileNotFoundError as e:
        print(f"secretscan: {e.args[0]}: no such file, directory or prefix", file=sys.stderr)
        return 2
    for f in findings:
        print(f)
    where = ", ".join(args.targets) if len(args.targets) <= 3 else f"{len(args.targets)} paths"
    print(f"secretscan: {len(findings)} finding(s) in {where}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
