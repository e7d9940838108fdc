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
from typing import Iterable, Iterator

# One place for the token shapes: what this scanner reports is what memsifter.security.redact removes from
# errors, logs and published columns.
from .redact import PATTERNS

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


def scan_text(text: str, location: str) -> list[Finding]:
    out = []
    for kind, rx in PATTERNS:
        for m in rx.finditer(text):
            value = m.group(1)
            if _plausible(kind, value):
                line = text.count("\n", 0, m.start()) + 1
                out.append(Finding(f"{location}:{line}", kind, redact(value), value))
    return out


def _parquet_text(data: bytes) -> str:
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(data))
    meta = table.schema.metadata or {}
    rows = table.to_pylist()
    return json.dumps({"metadata": {k.decode(errors="replace"): v.decode(errors="replace") for k, v in meta.items()},
                       "rows": rows}, default=str, ensure_ascii=False, indent=0)


def scan_bytes(data: bytes, location: str) -> list[Finding]:
    """Findings in one file's content (archives and parquet are opened; other binaries are read as text)."""
    name = location.lower()
    try:
        if data[:4] == b"PAR1" or name.endswith(".parquet"):
            return scan_text(_parquet_text(data), location)
        if data[:2] == b"\x1f\x8b":
            inner = gzip.decompress(data)
            if name.endswith((".tgz", ".tar.gz")) or _is_tar(inner):
                return _scan_tar(inner, location)
            return scan_bytes(inner, location + "!gunzip")
        if data[:4] == b"PK\x03\x04":
            out = []
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                for info in zf.infolist():
                    if not info.is_dir() and info.file_size <= MAX_BYTES:
                        out += scan_bytes(zf.read(info), f"{location}!{info.filename}")
            return out
        if _is_tar(data):
            return _scan_tar(data, location)
    except Exception as e:  # a corrupt container: scan its raw bytes instead, and say so
        print(f"secretscan: {location}: could not open ({e}); scanned as text", file=sys.stderr)
    return scan_text(data.decode("utf-8", errors="replace"), location)


def _is_tar(data: bytes) -> bool:
    return len(data) > 262 and data[257:262] == b"ustar"


def _scan_tar(data: bytes, location: str) -> list[Finding]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for m in tf:
            if m.isfile() and m.size <= MAX_BYTES:
                f = tf.extractfile(m)
                if f is not None:
                    out += scan_bytes(f.read(), f"{location}!{m.name}")
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
