"""One storage layer for every stage: local paths and ``s3://bucket/prefix`` URIs.

* ``resolve(uri)`` gives a pyarrow filesystem and a path. S3 settings come from the standard AWS
  variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``)
  plus an explicit endpoint (``MEMSIFTER_S3_ENDPOINT``, else ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL``), which we parse ourselves and pass as ``endpoint_override``.
* :class:`Publication` is atomic publish: a stage writes its files under ``<out>/_staging/<attempt>/``,
  then ``publish()`` moves them to ``<out>/`` and writes ``<out>/_SUCCESS`` last. The manifest lists
  every file with its size and sha256, the stage config and its hash, the code version and times.
  Readers (:func:`read_manifest`, :func:`published_file`) refuse a prefix without a manifest.
* ``<out>/_work/`` is scratch that survives a crash, for stages that resume part-way.

Guarantees (tests/test_faults.py, tests/test_kill.py):

* Transient store errors (resets, stalls, 5xx/SlowDown, a store down for a while) are retried by the
  AWS SDK (``MEMSIFTER_S3_ATTEMPTS`` tries per request) and then by :func:`retrying` for at most
  ``MEMSIFTER_STORE_RETRY_SECONDS`` (default 120 s); then one :class:`StorageError` names the URI, the
  operation, the attempts and the last error. Nothing hangs: every request has a timeout
  (``MEMSIFTER_S3_CONNECT_TIMEOUT`` / ``MEMSIFTER_S3_REQUEST_TIMEOUT``).
* Publishing is journalled: ``_PUBLISHING`` (the manifest to be) is written before the first move, so a
  run killed between the moves and ``_SUCCESS`` is rolled forward by the next run (no re-computation);
  moves are idempotent. ``_SUCCESS`` is one PUT on S3 and a rename on a local disk.
* Readers are checked: every file a reader opens under a manifest it read (``read_manifest`` then
  ``published_file``/``join`` and ``read_bytes``/``read_parquet``/``copy_file``) is verified against
  that manifest's sha256; a file replaced by a concurrent publish raises :class:`ConcurrentPublishError`
  instead of mixing generations, and a file changed in place after publishing (the manifest is still
  the one read) raises :class:`ModifiedAfterPublishError` naming the file and the stage to re-run.
* Manifests are validated (:func:`read_manifest`): a ``_SUCCESS`` that is not JSON, not an object, lacks
  ``stage``/``files`` or lists a key that leaves its prefix raises :class:`BadManifestError` (one line,
  naming the file); ``--force`` replaces it (memsifter.stage).
* Keys built with :func:`join` cannot leave their prefix (``..``, ``.``, ``%2F``, ``\\``, NUL); every path
  built from a journal or a manifest goes through the same check (:func:`roll_forward` drops a journal
  whose keys do not pass it).
* Numeric settings from the environment are parsed in one place (:func:`setting`, table
  :data:`SETTINGS`) with ranges; a bad value is one :class:`~memsifter.errors.ConfigError` naming the
  variable. ``s3://`` URIs without a bucket are refused (:func:`resolve`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from . import faults
from .errors import ConfigError, NotPublishedError, StorageError

log = logging.getLogger(__name__)
MANIFEST = "_SUCCESS"
JOURNAL = "_PUBLISHING"
STAGING = "_staging"
WORK = "_work"
T = TypeVar("T")


class ConcurrentPublishError(NotPublishedError):
    """A file changed under a reader: the output was re-published after the reader read its manifest."""


class ModifiedAfterPublishError(ConcurrentPublishError):
    """A published file whose content no longer matches the manifest that is still in place: it was
    changed after publishing (by hand, by a tool writing into the prefix); re-run the producing stage
    with ``--force``."""


class BadManifestError(StorageError):
    """A ``_SUCCESS`` that is not a valid manifest (not JSON, not an object, keys missing or unsafe)."""


class TooLargeError(StorageError):
    """A read that went past its size limit (:func:`read_bytes` ``limit``)."""


# Numeric settings read from the environment: name -> (default, integer?, minimum, minimum allowed?,
# what it is). Parsed by :func:`setting` only, so every reader gets the same checks and messages.
SETTINGS: dict[str, tuple[float, bool, float, bool, str]] = {
    "MEMSIFTER_STORE_ATTEMPTS": (8, True, 1, True, "tries per storage operation"),
    "MEMSIFTER_STORE_RETRY_SECONDS": (120, False, 0, False, "seconds of retrying per storage operation"),
    "MEMSIFTER_S3_ATTEMPTS": (4, True, 1, True, "tries per S3 request"),
    "MEMSIFTER_S3_CONNECT_TIMEOUT": (10, False, 0, False, "S3 connect timeout in seconds"),
    "MEMSIFTER_S3_REQUEST_TIMEOUT": (120, False, 0, False, "S3 request timeout in seconds"),
    "MEMSIFTER_LEASE_TTL": (60, False, 0, False, "lease expiry in seconds"),
    "MEMSIFTER_LEASE_WAIT": (0, False, 0, True, "seconds to wait for a live lease"),
    "MEMSIFTER_MAX_INPUT_BYTES": (4 << 30, True, 1, True, "largest input file an import reads, in bytes "
                                  "after decompression"),
    "MEMSIFTER_VERIFY_BYTES": (1 << 30, True, 0, True, "largest published output whose files are checked "
                               "by sha256 (not only by size) before a re-run is skipped"),
}


@functools.lru_cache(maxsize=64)
def _parse_setting(name: str, raw: str) -> float:
    default, integer, low, inclusive, what = SETTINGS[name]
    if not raw.strip():
        return default
    bound = f"{'>=' if inclusive else '>'} {low:g}"
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")) or not (value >= low if inclusive else value > low):
        raise ConfigError(f"environment {name}={raw!r}: expected {'an integer' if integer else 'a number'} "
                          f"{bound} ({what}; default {default:g})")
    return value


def setting(name: str) -> Any:
    """The value of a numeric setting of :data:`SETTINGS` (environment, else its default), checked
    against its range: a bad value is one ConfigError naming the variable, its range and default."""
    return _parse_setting(name, os.environ.get(name, ""))


def check_env() -> None:
    """Parse every numeric setting now (a stage calls this before it touches anything), so a bad value
    stops the run with one line instead of failing part-way (a lease heartbeat, a retry loop)."""
    for name in SETTINGS:
        setting(name)


# Counters of what the retry layer did in this process (the fault tests print them).
STATS: dict[str, int] = {"retries": 0, "gave_up": 0, "verified_reads": 0}
_stats_lock = threading.Lock()


def _count(key: str, n: int = 1) -> None:
    with _stats_lock:
        STATS[key] = STATS.get(key, 0) + n


# --------------------------------------------------------------------------- filesystems
@dataclass(frozen=True)
class S3Settings:
    endpoint: str | None
    scheme: str
    region: str
    access_key: str | None
    secret_key: str | None
    session_token: str | None
    attempts: int = 4
    connect_timeout: float = 10
    request_timeout: float = 120

    @classmethod
    def from_env(cls) -> "S3Settings":
        raw = (os.environ.get("MEMSIFTER_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL_S3")
               or os.environ.get("AWS_ENDPOINT_URL") or "")
        endpoint, scheme = None, "https"
        if raw:
            p = urlparse(raw if "://" in raw else f"https://{raw}")
            endpoint, scheme = p.netloc, p.scheme or "https"
        attempts = int(setting("MEMSIFTER_S3_ATTEMPTS"))
        connect = float(setting("MEMSIFTER_S3_CONNECT_TIMEOUT"))
        request = float(setting("MEMSIFTER_S3_REQUEST_TIMEOUT"))
        # One store operation is up to `attempts` SDK tries of (connect + request) seconds each: unless
        # the user set the timeouts, fit them into the retry budget, so that a server that accepts and
        # never answers fails the operation within MEMSIFTER_STORE_RETRY_SECONDS, as documented. (The
        # request timeout is the SDK's read timeout: silence, not the length of a transfer.)
        budget = float(setting("MEMSIFTER_STORE_RETRY_SECONDS"))
        if "MEMSIFTER_S3_CONNECT_TIMEOUT" not in os.environ:
            connect = min(connect, max(0.5, budget / attempts / 4))
        if "MEMSIFTER_S3_REQUEST_TIMEOUT" not in os.environ:
            request = min(request, max(1.0, budget / attempts - connect))
        return cls(endpoint=endpoint, scheme=scheme,
                   region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
                   access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
                   secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                   session_token=os.environ.get("AWS_SESSION_TOKEN"),
                   attempts=attempts, connect_timeout=connect, request_timeout=request)


@functools.lru_cache(maxsize=8)
def _s3(settings: S3Settings) -> pafs.S3FileSystem:
    kw: dict[str, Any] = dict(region=settings.region, scheme=settings.scheme,
                              retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=settings.attempts),
                              connect_timeout=settings.connect_timeout,
                              request_timeout=settings.request_timeout,
                              allow_bucket_creation=True)
    if settings.endpoint:
        kw["endpoint_override"] = settings.endpoint
        kw["force_virtual_addressing"] = False
    if settings.access_key and settings.secret_key:
        kw.update(access_key=settings.access_key, secret_key=settings.secret_key,
                  session_token=settings.session_token)
    else:
        kw["anonymous"] = not os.environ.get("AWS_PROFILE") and not os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE")
    return pafs.S3FileSystem(**kw)


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def s3_path(uri: str) -> str:
    """``bucket/key`` of an ``s3://`` URI; a URI without a bucket (``s3://``, ``s3:///x``) is refused."""
    path = uri[len("s3://"):].rstrip("/")
    if not path or path.startswith("/") or not path.split("/", 1)[0].strip():
        raise StorageError(f"{uri}: no bucket name (expected s3://bucket/prefix)")
    return path


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """Filesystem and path for a URI (``s3://b/k``, ``file:///p`` or a plain path); an ``s3://`` URI
    without a bucket is a StorageError."""
    if not uri:
        raise StorageError("empty URI")
    if is_s3(uri):
        path = s3_path(uri)
        return _s3(S3Settings.from_env()), path
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" in uri:
        raise StorageError(f"{uri}: unsupported URI scheme (use a local path or s3://bucket/prefix)")
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


_BAD_KEY = re.compile(r"%(2f|5c|2e|00)|\\|\x00", re.IGNORECASE)


def check_key(part: str, base: str = "") -> str:
    """A key part built from data (ids, names) must stay under its prefix: no ``..``/``.`` segments,
    no percent-encoded ``/``, ``\\``, ``.`` or NUL, no backslash or NUL, no empty segment. A leading
    ``/`` is not an absolute path here: it is refused too, so a mistake does not pass silently."""
    where = f" under {base}" if base else ""
    if part.startswith("/") or _BAD_KEY.search(part):
        raise StorageError(f"object key {part!r}{where}: refused (absolute, encoded separator or control "
                           f"character: keys built from ids must stay under their prefix)")
    segs = part.rstrip("/").split("/")
    if any(s in ("", ".", "..") for s in segs) or any(ord(c) < 32 for c in part):
        raise StorageError(f"object key {part!r}{where}: refused ('.', '..' or empty path segment: keys "
                           f"built from ids must stay under their prefix)")
    return part.rstrip("/")


def join(uri: str, *parts: str) -> str:
    """``uri/part/...``; each part is checked with :func:`check_key` (it cannot leave ``uri``)."""
    out = uri.rstrip("/")
    for p in parts:
        out = f"{out}/{check_key(p, out)}"
    return out


_TRANSIENT = ("503", "slowdown", "slow_down", "timed out", "timeout", "internal error", "internalerror",
              "connection reset", "throttl", "500 ", "network_connection", "curlcode", "could not connect",
              "couldn't connect", "connection refused", "broken pipe", "recv failure", "send failure",
              "failure when receiving", "empty reply", "service unavailable", "request_timeout",
              "unexpected end", "connection closed", "reset by peer", "internal_failure",
              "failed to flush response stream")


_HTTP_5XX = re.compile(r"(http status|status code:?|\bstatus) 5\d\d", re.IGNORECASE)


def _transient(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return any(s in msg for s in _TRANSIENT) or bool(_HTTP_5XX.search(msg))


def retrying(fn: Callable[[], T], what: str, attempts: int | None = None) -> T:
    """Run ``fn``, retrying transient store errors with capped exponential backoff, for at most
    ``attempts`` tries (default ``MEMSIFTER_STORE_ATTEMPTS``, 8, at least 1) and
    ``MEMSIFTER_STORE_RETRY_SECONDS`` (default 120 s, > 0); then one StorageError naming the
    URI/operation, the attempts and the last error."""
    attempts = max(1, attempts or int(setting("MEMSIFTER_STORE_ATTEMPTS")))
    budget = float(setting("MEMSIFTER_STORE_RETRY_SECONDS"))
    t0 = time.monotonic()
    for i in range(attempts):
        try:
            return fn()
        except FileNotFoundError as e:
            raise StorageError(f"{what}: not found") from e
        except PermissionError as e:
            raise StorageError(f"{what}: permission denied") from e
        except (NotADirectoryError, IsADirectoryError, FileExistsError) as e:
            raise StorageError(f"{what}: {e.strerror or type(e).__name__} ({e.filename or what})") from e
        except OSError as e:
            msg = str(e)
            if _transient(e):
                wait = min(0.5 * 2 ** i, 8.0)
                spent = time.monotonic() - t0
                if i + 1 < attempts and spent + wait <= budget:
                    _count("retries")
                    log.warning("%s: transient store error (attempt %d/%d), retrying in %.1fs: %s", what,
                                i + 1, attempts, wait, msg.splitlines()[0] if msg else type(e).__name__)
                    time.sleep(wait)
                    continue
                _count("gave_up")
                raise StorageError(f"{what}: object store unavailable: gave up after {i + 1} attempt(s) over "
                                   f"{spent:.0f}s (each with the S3 client's own retries); last error: "
                                   f"{msg.splitlines()[0] if msg else type(e).__name__}") from e
            if "ACCESS_DENIED" in msg or "InvalidAccessKeyId" in msg or "SignatureDoesNotMatch" in msg \
                    or "403" in msg:
                raise StorageError(f"{what}: access denied: check AWS_ACCESS_KEY_ID / "
                                   f"AWS_SECRET_ACCESS_KEY and the endpoint ({msg.splitlines()[0]})") from e
            if "NoSuchBucket" in msg or "NOT_FOUND" in msg.upper() and "bucket" in msg.lower():
                raise StorageError(f"{what}: bucket does not exist ({msg.splitlines()[0]})") from e
            raise StorageError(f"{what}: {msg.splitlines()[0] if msg else type(e).__name__}") from e
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- basic ops
def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    info = retrying(lambda: fs.get_file_info(path), f"{uri}")
    return info.type != pafs.FileType.NotFound


def is_file(uri: str) -> bool:
    fs, path = resolve(uri)
    return retrying(lambda: fs.get_file_info(path), uri).type == pafs.FileType.File


# URI -> (bytes, sha256, manifest attempt, prefix, stage) of files listed in manifests this process
# read: reads of those URIs are checked against the manifest, so a reader never mixes two publications.
_expected: dict[str, tuple[int, str, str, str, str]] = {}
_expected_lock = threading.Lock()


def _expect(root: str, manifest: dict) -> None:
    root = root.rstrip("/")
    with _expected_lock:
        if len(_expected) > 50000:
            _expected.clear()
        for name, meta in (manifest.get("files") or {}).items():
            if isinstance(meta, dict) and "sha256" in meta:
                _expected[join(root, name)] = (meta.get("bytes", -1), meta["sha256"],
                                               str(manifest.get("attempt", "")), root,
                                               str(manifest.get("stage", "")))


def _check_expected(uri: str, nbytes: int, sha: str) -> None:
    """A read of a file listed in a manifest this process read must match it. On a mismatch, the
    manifest now in place tells which case it is: the same publication still there (and no publish in
    progress) means the file was changed after publishing (:class:`ModifiedAfterPublishError`: re-run
    the producing stage with --force); else it was re-published while being read."""
    exp = _expected.get(uri.rstrip("/"))
    if exp is None:
        return
    _count("verified_reads")
    if sha == exp[1]:
        return
    root, stage = exp[3], exp[4]
    current: Any = None
    with contextlib.suppress(Exception):
        if not exists(join(root, JOURNAL)):
            current = json.loads(read_bytes(join(root, MANIFEST)))
    if isinstance(current, dict) and str(current.get("attempt", "")) == exp[2] and exp[2]:
        raise ModifiedAfterPublishError(
            f"{uri}: modified after publishing: its content ({nbytes} bytes, sha256 {sha[:12]}) is not what "
            f"{join(root, MANIFEST)} lists ({exp[0]} bytes, sha256 {exp[1][:12]}); re-run the stage that "
            f"produced it (stage '{stage}', output {root}) with --force to publish it again")
    raise ConcurrentPublishError(
        f"{uri}: content ({nbytes} bytes, sha256 {sha[:12]}) is not what the manifest read before "
        f"lists ({exp[0]} bytes, sha256 {exp[1][:12]}, attempt {exp[2]}): the output was re-published "
        f"while it was being read; read it again")


def read_bytes(uri: str, limit: int | None = None) -> bytes:
    """The whole file (pyarrow decompresses ``*.gz``/``*.bz2``/``*.zst`` by extension). ``limit``: raise
    :class:`TooLargeError` once more than that many bytes were read (checked while streaming, so a
    small compressed file that inflates without bound cannot exhaust memory)."""
    fs, path = resolve(uri)

    def _read() -> bytes:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type == pafs.FileType.Directory:
            raise StorageError(f"{uri}: is a directory, expected a file")
        with fs.open_input_stream(path) as f:
            if limit is None:
                return f.read()
            parts, n = [], 0
            while chunk := f.read(8 << 20):
                n += len(chunk)
                if n > limit:
                    raise TooLargeError(f"{uri}: larger than {limit} bytes")
                parts.append(chunk)
            return b"".join(parts)
    data = retrying(_read, uri)
    if uri.rstrip("/") in _expected:
        _check_expected(uri, len(data), sha256_bytes(data))
    return data


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = resolve(uri)

    def _write() -> None:
        parent = path.rsplit("/", 1)[0]
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(parent, recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)
    retrying(_write, uri)
    faults.checkpoint("write")


def write_atomic(uri: str, data: bytes) -> None:
    """Write a file that no reader ever sees half-written: one PUT on S3; temp file + rename locally."""
    if is_s3(uri):
        write_bytes(uri, data)
        return
    _, path = resolve(uri)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    write_bytes(tmp, data)
    os.replace(tmp, path)


def delete(uri: str) -> None:
    """Delete a file or a whole prefix; missing is fine."""
    fs, path = resolve(uri)

    def _del() -> None:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif info.type == pafs.FileType.File:
            fs.delete_file(path)
    retrying(_del, uri)


def list_files(uri: str, recursive: bool = True) -> list[str]:
    """Relative paths of the files under a prefix (empty when it does not exist)."""
    fs, path = resolve(uri)
    sel = pafs.FileSelector(path, recursive=recursive, allow_not_found=True)
    infos = retrying(lambda: fs.get_file_info(sel), uri)
    return sorted(i.path[len(path):].lstrip("/") for i in infos if i.type == pafs.FileType.File)


def list_dirs(uri: str) -> list[str]:
    fs, path = resolve(uri)
    sel = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = retrying(lambda: fs.get_file_info(sel), uri)
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def ensure_bucket(uri: str) -> None:
    """Create the bucket of an ``s3://`` URI if it does not exist (no-op for local paths)."""
    if not is_s3(uri):
        return
    fs, path = resolve(uri)
    bucket = path.split("/", 1)[0]
    if retrying(lambda: fs.get_file_info(bucket), uri).type == pafs.FileType.NotFound:
        retrying(lambda: fs.create_dir(bucket), f"s3://{bucket}")


def download_dir(uri: str, local_dir: str, skip_existing: bool = True) -> str:
    """Copy everything under ``uri`` to ``local_dir`` (local URIs are returned as they are)."""
    if not is_s3(uri):
        fs, path = resolve(uri)
        if retrying(lambda: fs.get_file_info(path), uri).type == pafs.FileType.NotFound:
            raise StorageError(f"{uri}: not found")
        return path
    files = list_files(uri)
    if not files:
        raise StorageError(f"{uri}: no files under this prefix")
    for rel in files:
        dest = os.path.join(local_dir, rel)
        if skip_existing and os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        copy_file(join(uri, rel), dest)
    return local_dir


def copy_file(src: str, dst: str, chunk: int = 8 << 20) -> tuple[int, str]:
    """Stream-copy one file between any two URIs; returns (bytes, sha256)."""
    sfs, spath = resolve(src)
    dfs, dpath = resolve(dst)

    def _copy() -> tuple[int, str]:
        if isinstance(dfs, pafs.LocalFileSystem):
            dfs.create_dir(dpath.rsplit("/", 1)[0], recursive=True)
        h, n = hashlib.sha256(), 0
        tmp = dpath + ".part" if isinstance(dfs, pafs.LocalFileSystem) else dpath
        with sfs.open_input_stream(spath) as fin, dfs.open_output_stream(tmp) as fout:
            while True:
                b = fin.read(chunk)
                if not b:
                    break
                h.update(b)
                n += len(b)
                fout.write(b)
        if tmp != dpath:
            os.replace(tmp, dpath)
        return n, h.hexdigest()
    n, sha = retrying(_copy, f"copy {src} -> {dst}")
    if src.rstrip("/") in _expected:
        _check_expected(src, n, sha)
    faults.checkpoint("write")
    return n, sha


def upload_dir(local_dir: str, uri: str) -> list[str]:
    out = []
    for root, _, files in os.walk(local_dir):
        for f in sorted(files):
            full = os.path.join(root, f)
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            copy_file(full, join(uri, rel))
            out.append(rel)
    return out


class RangeReader:
    """Ranged reads of one file (safetensors tensors, parquet pages) that survive store faults: a read
    cut off mid-answer closes the handle, re-opens the file and reads the same range again
    (:func:`retrying`'s bounds)."""

    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.path = resolve(uri)
        self._f: Any = None

    def read_into(self, offset: int, buf: Any) -> int:
        """Fill ``buf`` (anything with the buffer protocol) from ``offset``; returns the bytes read."""
        view = memoryview(buf).cast("B")

        def _read() -> int:
            if self._f is None:
                self._f = self.fs.open_input_file(self.path)
            try:
                self._f.seek(offset)
                got = self._f.readinto(view)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._f.close()
                self._f = None
                raise
            return got
        return retrying(_read, f"read {view.nbytes} bytes at {offset} of {self.uri}")

    def close(self) -> None:
        if self._f is not None:
            with contextlib.suppress(Exception):
                self._f.close()
            self._f = None


def read_parquet(uri: str, columns: list[str] | None = None) -> pa.Table:
    if uri.rstrip("/") in _expected:  # a published file: read whole, check against the manifest
        data = read_bytes(uri)
        return pq.read_table(pa.BufferReader(data), columns=columns)
    fs, path = resolve(uri)
    return retrying(lambda: pq.read_table(path, filesystem=fs, columns=columns), uri)


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def read_json(uri: str) -> Any:
    raw = read_bytes(uri)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise StorageError(f"{uri}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from e


# --------------------------------------------------------------------------- manifests
def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_manifest(manifest: Any, m_uri: str) -> dict:
    """``manifest`` if it is a valid manifest (an object with ``stage`` and ``files``, every file a
    key that stays under its prefix with integer ``bytes`` and a ``sha256``), else
    :class:`BadManifestError` naming ``m_uri`` and what is wrong."""
    def bad(why: str) -> BadManifestError:
        return BadManifestError(f"{m_uri}: not a valid manifest ({why}); re-run the stage that writes "
                                f"this output with --force to replace it")
    if not isinstance(manifest, dict):
        raise bad(f"a JSON {type(manifest).__name__}, expected an object")
    missing = [k for k in ("stage", "files") if k not in manifest]
    if missing:
        raise bad(f"missing key(s): {', '.join(missing)}")
    if not isinstance(manifest["stage"], str) or not isinstance(manifest["files"], dict):
        raise bad("'stage' must be a string and 'files' an object")
    for k in ("config_hash", "attempt"):
        if k in manifest and not isinstance(manifest[k], str):
            raise bad(f"'{k}' must be a string")
    if "attempt" in manifest:
        try:
            check_key(manifest["attempt"])
        except StorageError:
            raise bad(f"attempt {manifest['attempt']!r} is not a safe key") from None
    for name, meta in manifest["files"].items():
        try:
            check_key(name)
        except StorageError:
            raise bad(f"file key {name!r} leaves the prefix") from None
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int)
                and isinstance(meta.get("sha256"), str)):
            raise bad(f"file {name!r} lacks an integer 'bytes' or a 'sha256'")
    return manifest


def read_manifest(uri: str) -> dict:
    """The ``_SUCCESS`` manifest of a published prefix; raises NotPublishedError without one and
    :class:`BadManifestError` for one that is not valid (:func:`check_manifest`)."""
    m_uri = join(uri, MANIFEST)
    if not exists(m_uri):
        if not exists(uri):
            raise NotPublishedError(f"{uri}: does not exist")
        raise NotPublishedError(f"{uri}: no {MANIFEST} manifest: the data was never published or a "
                                f"stage crashed while writing it; re-run the stage that writes it")
    try:
        raw = read_bytes(m_uri)
    except StorageError as e:
        if "not found" in str(e):  # removed by a publish that started after the check
            raise NotPublishedError(f"{uri}: being re-published (no {MANIFEST} right now); retry later") from e
        if "is a directory" in str(e):
            raise BadManifestError(f"{m_uri}: a directory, not a manifest; re-run the stage that writes "
                                   f"this output with --force to replace it") from e
        raise
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise BadManifestError(f"{m_uri}: not a valid manifest (invalid JSON{where}); re-run the stage that "
                               f"writes this output with --force to replace it") from e
    check_manifest(manifest, m_uri)
    _expect(uri, manifest)
    return manifest


def damaged_file(uri: str, manifest: dict) -> str | None:
    """The first file of a published prefix that does not match its manifest, as ``"<uri>: why"``,
    or None when all match. Sizes are always compared; contents (sha256) when the output's total size
    is at most ``MEMSIFTER_VERIFY_BYTES`` (default 1 GiB). Used before skipping a re-run."""
    fs, _ = resolve(uri)
    files = manifest.get("files") or {}
    deep = sum(int(m.get("bytes", 0)) for m in files.values()) <= int(setting("MEMSIFTER_VERIFY_BYTES"))
    for name, meta in sorted(files.items()):
        f_uri = join(uri, name)
        _, path = resolve(f_uri)
        info = retrying(lambda p=path: fs.get_file_info(p), f_uri)
        if info.type != pafs.FileType.File:
            return f"{f_uri}: missing"
        if info.size != meta["bytes"]:
            return f"{f_uri}: {info.size} bytes, the manifest lists {meta['bytes']}"
        if deep and not _file_matches(fs, path, f_uri, meta):
            return f"{f_uri}: content differs from the manifest (sha256)"
    return None


def published_ancestor(uri: str) -> str | None:
    """The published (or being published) prefix that ``uri`` lies in or is, if any: the nearest of
    ``uri`` and its parents holding ``_SUCCESS`` or ``_PUBLISHING``. Writers of loose files (``data
    export``) refuse such destinations: they would change a publication behind its manifest."""
    if is_s3(uri):
        segs = s3_path(uri).split("/")
        cands = ["s3://" + "/".join(segs[:i]) for i in range(len(segs), 0, -1)]
    else:
        _, path = resolve(uri)
        cands, cur = [], path
        while True:
            cands.append(cur)
            parent = os.path.dirname(cur)
            if parent == cur:
                break
            cur = parent
    for cand in cands:
        for marker in (MANIFEST, JOURNAL):
            m = f"{cand.rstrip('/')}/{marker}"
            if not is_s3(m) and not os.path.lexists(m):
                continue
            if is_s3(m) and not exists(m):
                continue
            return cand
    return None


def try_manifest(uri: str) -> dict | None:
    try:
        return read_manifest(uri)
    except NotPublishedError:
        return None


def published_file(uri: str, name: str) -> str:
    """URI of a file listed in a published manifest (refuses unpublished or unlisted files)."""
    manifest = read_manifest(uri)
    if name not in manifest.get("files", {}):
        raise NotPublishedError(f"{uri}: manifest has no file '{name}' (stage {manifest.get('stage')}, "
                                f"files: {', '.join(sorted(manifest.get('files', {})))})")
    return join(uri, name)


def utcnow() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class Publication:
    """Stage output under construction; ``publish()`` makes it visible atomically.

    Files are written to ``<out>/_staging/<attempt>/<name>``; ``publish`` writes the journal
    ``_PUBLISHING`` (the manifest to be, naming the staging attempt), removes the old manifest, moves
    each staged file into place (idempotently) and writes ``_SUCCESS`` last. A crash before the journal
    leaves the old state; a crash after it leaves no manifest (readers refuse the prefix) and the next
    run of the same config rolls the journal forward (:func:`roll_forward`) without recomputing. A
    reader that read the old manifest and meets a new file gets :class:`ConcurrentPublishError`.
    """

    def __init__(self, uri: str, stage: str, config: dict, config_hash: str, code_version: str):
        self.uri = uri.rstrip("/")
        self.stage, self.config, self.config_hash, self.code_version = stage, config, config_hash, code_version
        self.attempt = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.staging = join(self.uri, STAGING, self.attempt)
        self.files: dict[str, dict] = {}
        self.stats: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}   # fingerprints of the inputs this output was built from
        self.started = utcnow()
        ensure_bucket(self.uri)

    @property
    def work(self) -> str:
        """Scratch prefix kept across attempts (for resumable partial progress)."""
        return join(self.uri, WORK)

    def _record(self, name: str, nbytes: int, sha: str, rows: int | None) -> None:
        self.files[name] = {"bytes": nbytes, "sha256": sha, **({"rows": rows} if rows is not None else {})}

    def write_bytes(self, name: str, data: bytes, rows: int | None = None) -> None:
        write_bytes(join(self.staging, name), data)
        self._record(name, len(data), sha256_bytes(data), rows)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_table(self, name: str, table: pa.Table) -> None:
        self.write_bytes(name, parquet_bytes(table), rows=table.num_rows)

    def add_file(self, name: str, local_path: str) -> None:
        n, sha = copy_file(local_path, join(self.staging, name))
        self._record(name, n, sha, None)

    def add_dir(self, name: str, local_dir: str) -> None:
        for root, _, files in os.walk(local_dir):
            for f in sorted(files):
                full = os.path.join(root, f)
                rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
                self.add_file(f"{name}/{rel}" if name else rel, full)

    def publish(self, stats: dict | None = None, check: Callable[[], None] | None = None) -> dict:
        """Move the staged files into place and write ``_SUCCESS``; ``check()`` runs just before the
        first visible change (the stage's lease check)."""
        if stats:
            self.stats.update(stats)
        manifest = {
            "stage": self.stage, "config": self.config, "config_hash": self.config_hash,
            "code_version": self.code_version, "started_at": self.started, "published_at": utcnow(),
            "attempt": self.attempt, "files": self.files, "stats": self.stats, "inputs": self.inputs,
            "run_id": os.environ.get("MEMSIFTER_RUN_ID"),
        }
        faults.checkpoint("publish-start")
        if check is not None:
            check()
        self.journalled = True   # from here on a crash is completed by roll_forward: keep the staging
        write_atomic(join(self.uri, JOURNAL), _dumps(manifest))
        return _complete(self.uri, manifest)

    def abort(self) -> None:
        if getattr(self, "journalled", False):
            return
        with contextlib.suppress(Exception):
            delete(self.staging)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True, default=str).encode()


def _file_matches(fs: pafs.FileSystem, path: str, uri: str, meta: dict) -> bool:
    info = retrying(lambda: fs.get_file_info(path), uri)
    if info.type != pafs.FileType.File or info.size != meta["bytes"]:
        return False

    def _hash() -> str:
        h = hashlib.sha256()
        with fs.open_input_stream(path) as f:
            while b := f.read(8 << 20):
                h.update(b)
        return h.hexdigest()
    return retrying(_hash, uri) == meta["sha256"]


def _complete(uri: str, manifest: dict) -> dict:
    """Carry out a journalled publish (idempotent: safe to repeat after a crash at any point). Every
    path is built with :func:`join` (attempt and file names pass :func:`check_key` first: a journal
    cannot move a file outside its prefix)."""
    fs, root = resolve(uri)
    local = isinstance(fs, pafs.LocalFileSystem)
    moves = [(resolve(join(uri, STAGING, manifest["attempt"], name))[1], resolve(join(uri, name))[1], meta)
             for name, meta in manifest["files"].items()]    # all keys checked before anything moves
    delete(join(uri, MANIFEST))
    for src, dst, meta in moves:
        shown = dst if local else f"s3://{dst}"

        def _move(s: str = src, d: str = dst) -> None:
            if local:
                os.makedirs(os.path.dirname(d), exist_ok=True)
                os.replace(s, d)
            else:
                fs.move(s, d)
        try:
            retrying(_move, f"publish {shown}")
        except StorageError:
            # already moved by an earlier attempt (a crash, or a move whose reply was lost)?
            if not _file_matches(fs, dst, shown, meta):
                raise
        faults.checkpoint("publish-move")
    faults.checkpoint("publish-commit")
    write_atomic(join(uri, MANIFEST), _dumps(manifest))
    _expect(uri, manifest)
    with contextlib.suppress(Exception):
        delete(join(uri, JOURNAL))
    with contextlib.suppress(Exception):
        delete(join(uri, STAGING))
    return manifest


def roll_forward(uri: str, stage: str, config_hash: str, inputs: dict) -> dict | None:
    """Finish a publish that a crash interrupted, when its journal is a valid manifest
    (:func:`check_manifest`: every key stays under the prefix) for this stage, config and inputs and
    every file is staged or already in place (checked by sha256); else drop the journal (the stage
    runs again; a journal with an unsafe key is named in a warning) and return None."""
    j_uri = join(uri, JOURNAL)
    if not exists(j_uri):
        return None
    try:
        manifest = check_manifest(read_json(j_uri), j_uri)
    except BadManifestError as e:
        log.warning("%s", str(e).split("; re-run")[0] + "; dropping it")
        manifest = {}
    except StorageError:
        manifest = {}
    fs, root = resolve(uri)
    ok = (manifest.get("stage") == stage and manifest.get("config_hash") == config_hash
          and manifest.get("inputs", {}) == inputs and isinstance(manifest.get("files"), dict)
          and "attempt" in manifest)
    if ok:
        for name, meta in manifest["files"].items():
            staged = join(uri, STAGING, manifest["attempt"], name)
            placed = join(uri, name)
            if not (_file_matches(fs, resolve(staged)[1], staged, meta)
                    or _file_matches(fs, resolve(placed)[1], placed, meta)):
                ok = False
                break
    if not ok:
        log.info("%s: dropping an interrupted publish that cannot be completed", uri)
        delete(j_uri)
        return None
    log.info("%s: completing the publish interrupted in attempt %s", uri, manifest["attempt"])
    manifest["resumed_publish_at"] = utcnow()
    return _complete(uri, manifest)

def verify(uri: str) -> dict:
    """Check every file of a manifest against its recorded size; returns the manifest."""
    manifest = read_manifest(uri)
    fs, root = resolve(uri)
    for name, meta in manifest.get("files", {}).items():
        info = retrying(lambda n=name: fs.get_file_info(resolve(join(uri, n))[1]), join(uri, name))
        if info.type != pafs.FileType.File or info.size != meta["bytes"]:
            raise NotPublishedError(f"{join(uri, name)}: missing or size differs from the manifest")
    return manifest


def iter_chunks(seq: list[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(seq), size):
        yield seq[i:i + size]
