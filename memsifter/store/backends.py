"""The storage layer's backends: where a URI's bytes live and how they are read and written.

Settings from the environment (:func:`setting`, :data:`SETTINGS`), the S3 client (:class:`S3Settings`,
:func:`resolve`), keys that cannot leave their prefix (:func:`join`, :func:`check_key`), retries with a
bounded budget and the circuit breaker of a store given up on (:func:`retrying`, :func:`store_down`), no
write through a symlink below an output (:func:`guard_prefix`, :func:`check_no_symlink`) and the file
operations (read, write, copy, list, delete), whose reads of published files are checked against the
manifest this process read (:func:`_expect`). Publication (manifests, atomic publish, roll-forward) is
:mod:`memsifter.store.publication`; stages use both through :mod:`memsifter.store.storage`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from . import hooks
from ..errors import ConfigError, NotPublishedError, StorageError

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
    "MEMSIFTER_LEASE_TTL": (60, False, 5, True, "lease expiry in seconds"),
    "MEMSIFTER_LEASE_WAIT": (0, False, 0, True, "seconds to wait for a live lease"),
    "MEMSIFTER_MAX_INPUT_BYTES": (4 << 30, True, 1, True, "largest input file an import reads, in bytes "
                                  "after decompression"),
    "MEMSIFTER_VERIFY_BYTES": (1 << 30, True, 0, True, "largest published output whose files are checked "
                               "by sha256 (not only by size) before a re-run is skipped"),
    "MEMSIFTER_MAX_TURN_BYTES": (1 << 20, True, 1, True, "largest turn (message) an import accepts, in "
                                 "UTF-8 bytes"),
}
# Upper bounds (inclusive) of the settings that have one: a lease of 0.0001 s renews thousands of
# times a second and one of 1e300 s overflows the heartbeat's wait (and never expires).
MAXIMA: dict[str, float] = {"MEMSIFTER_LEASE_TTL": 86400}


@functools.lru_cache(maxsize=64)
def _parse_setting(name: str, raw: str) -> float:
    default, integer, low, inclusive, what = SETTINGS[name]
    if not raw.strip():
        return default
    high = MAXIMA.get(name)
    bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:   # not a number, or an integer over Python's digit limit
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")) or not (value >= low if inclusive else value > low) \
            or (high is not None and value > high):
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
    S3Settings.from_env()   # the endpoint (MEMSIFTER_S3_ENDPOINT / AWS_ENDPOINT_URL*) is checked too


# Counters of what the retry layer did in this process (the fault tests print them).
STATS: dict[str, int] = {"retries": 0, "gave_up": 0, "verified_reads": 0}
_stats_lock = threading.Lock()


def _count(key: str, n: int = 1) -> None:
    with _stats_lock:
        STATS[key] = STATS.get(key, 0) + n


# --------------------------------------------------------------------------- filesystems
_ENDPOINT_VARS = ("MEMSIFTER_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def _endpoint() -> tuple[str | None, str]:
    """``(host[:port], scheme)`` of the S3 endpoint from the first variable of :data:`_ENDPOINT_VARS`
    that is set (``(None, "https")`` for none); a value that is not ``http(s)://host[:port]`` is one
    ConfigError naming the variable (``http://[::1``, ``ftp://...``, a path, a bad port)."""
    name = next((n for n in _ENDPOINT_VARS if os.environ.get(n)), None)
    if name is None:
        return None, "https"
    raw = os.environ[name].strip()

    def bad(why: str) -> ConfigError:
        return ConfigError(f"environment {name}={raw!r}: {why} (expected http://host[:port] or "
                           f"https://host[:port])")
    try:
        p = urlparse(raw if "://" in raw else f"https://{raw}")
        port = p.port   # parses the port: ValueError when it is not a number in range
    except ValueError as e:
        raise bad(f"not a valid URL ({e})") from None
    if p.scheme not in ("http", "https"):
        raise bad(f"unsupported scheme {p.scheme!r}")
    if not p.hostname:
        raise bad("no host")
    if p.path not in ("", "/") or p.query or p.fragment or p.username or p.password:
        raise bad("only a scheme, a host and a port are allowed")
    del port
    return p.netloc, p.scheme


def _sdk_backoff(attempts: int) -> float:
    """Worst-case sleep of the AWS SDK's standard retry strategy between ``attempts`` tries (about
    1, 2, 4, ... s with jitter, each at most 20 s; measured against a silent endpoint)."""
    return float(sum(min(20.0, 2.0 ** k) for k in range(max(0, attempts - 1))))


# A request that meets a silent server lasts its timeout plus up to this (curl checks the transfer
# rate once a second).
_TIMER_SLACK = 1.0


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

    @property
    def worst(self) -> float:
        """How long one SDK call can take against a store that accepts and never answers: every try
        times out (connect + silence), with the SDK's backoff in between. :func:`retrying` starts an
        attempt only when this much still fits in its budget."""
        return (self.attempts * (self.connect_timeout + self.request_timeout + _TIMER_SLACK)
                + _sdk_backoff(self.attempts))

    @classmethod
    def from_env(cls) -> "S3Settings":
        endpoint, scheme = _endpoint()
        attempts = int(setting("MEMSIFTER_S3_ATTEMPTS"))
        connect = float(setting("MEMSIFTER_S3_CONNECT_TIMEOUT"))
        request = float(setting("MEMSIFTER_S3_REQUEST_TIMEOUT"))
        # What the user did not set of the SDK's tries and timeouts is fitted into half the retry
        # budget: one SDK call that meets a server that accepts and never answers then ends within it
        # (tries x (connect + silence) + the SDK's backoff), and retrying() never starts an attempt
        # that would end past MEMSIFTER_STORE_RETRY_SECONDS: a failing operation is bounded by the
        # budget, end to end. (The request timeout is the SDK's silence timeout, not the length of a
        # transfer.)
        budget = float(setting("MEMSIFTER_STORE_RETRY_SECONDS"))
        fit_n, fit_c, fit_r = (name not in os.environ for name in (
            "MEMSIFTER_S3_ATTEMPTS", "MEMSIFTER_S3_CONNECT_TIMEOUT", "MEMSIFTER_S3_REQUEST_TIMEOUT"))
        target = budget / 2
        for n in range(attempts, 0, -1) if fit_n else (attempts,):   # what the user set is kept
            c = min(connect, max(0.5, target / n / 4)) if fit_c else connect
            per_try = (target - _sdk_backoff(n)) / n - _TIMER_SLACK - c
            if per_try >= 1.0 or n == 1 or not fit_n:
                attempts, connect = n, c
                if fit_r:
                    request = min(request, max(1.0, per_try))
                break
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
    """``bucket/key`` of an ``s3://`` URI; a URI without a bucket (``s3://``, ``s3:///x``) is refused, and
    so is a key with an empty, ``.`` or ``..`` segment (``s3://b//x``, ``s3://b/a/../x``): S3 keys are
    not paths, so the server would not resolve them but deny or miss them, which reads as a
    credentials problem or a missing object."""
    path = uri[len("s3://"):].rstrip("/")
    if not path or path.startswith("/") or not path.split("/", 1)[0].strip():
        raise StorageError(f"{uri}: no bucket name (expected s3://bucket/prefix)")
    segs = path.split("/")[1:]
    bad = next((seg for seg in segs if seg in ("", ".", "..")), None)
    if bad is not None:
        raise StorageError(f"{uri}: refused: {'an empty' if not bad else repr(bad)} path segment in the key "
                           f"(S3 keys are not resolved like paths; write s3://bucket/a/b)")
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


# When retrying() last gave up on an object store (monotonic time) and its budget then, per endpoint:
# for that budget, or until an operation on it succeeds, writes to it fail at once (retrying's ``write``).
_gave_up_at: dict[str, tuple[float, float]] = {}


def _store_key() -> str:
    return _endpoint()[0] or "aws"


def store_down(uri: str) -> bool:
    """Whether :func:`retrying` gave up on the object store of ``uri`` (an ``s3://`` URI) less than
    its ``MEMSIFTER_STORE_RETRY_SECONDS`` ago, with no operation on it succeeding since: cleanup after
    a failure (abort, lease heartbeat and release) skips it."""
    return is_s3(uri) and _store_given_up()


def _store_given_up() -> bool:
    if not _gave_up_at:
        return False
    at = _gave_up_at.get(_store_key())
    return at is not None and time.monotonic() - at[0] < at[1]


def retrying(fn: Callable[[], T], what: str, attempts: int | None = None, write: bool = False) -> T:
    """Run ``fn``, retrying transient store errors with capped exponential backoff, for at most
    ``attempts`` tries (default ``MEMSIFTER_STORE_ATTEMPTS``, 8, at least 1) and
    ``MEMSIFTER_STORE_RETRY_SECONDS`` (default 120 s, > 0); then one StorageError naming the
    URI/operation, the attempts and the last error.

    The budget bounds the whole operation, not only when the last attempt starts: an attempt is
    started only while one more attempt as long as the longest so far -- and on an object store
    (``what`` names an ``s3://`` URI) as long as one SDK call that meets a silent store
    (:attr:`S3Settings.worst`, fitted into half the budget) -- still fits, so a store that accepts
    and never answers fails the operation within the budget (give or take the SDK's timer slack).
    ``write``: once retrying gave up on a store, writes to it fail at once for one budget or until an
    operation on it succeeds (the failure's cleanup -- aborting the staging, the failure record --
    must not each wait out another budget); reads are still tried (the store may be back)."""
    attempts = max(1, attempts or int(setting("MEMSIFTER_STORE_ATTEMPTS")))
    budget = float(setting("MEMSIFTER_STORE_RETRY_SECONDS"))
    on_s3 = "s3://" in what
    if on_s3 and write and _store_given_up():
        raise StorageError(f"{what}: object store unavailable (gave up on it "
                           f"{time.monotonic() - _gave_up_at[_store_key()][0]:.0f}s ago); not retried")
    worst = S3Settings.from_env().worst if on_s3 else 0.0
    t0 = time.monotonic()
    longest = 0.0
    for i in range(attempts):
        t_try = time.monotonic()
        try:
            out = fn()
            if on_s3 and _gave_up_at:   # the store answers again
                _gave_up_at.pop(_store_key(), None)
            return out
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
                longest = max(longest, time.monotonic() - t_try)
                if i + 1 < attempts and spent + wait + max(worst, longest) <= budget:
                    _count("retries")
                    log.warning("%s: transient store error (attempt %d/%d), retrying in %.1fs: %s", what,
                                i + 1, attempts, wait, msg.splitlines()[0] if msg else type(e).__name__)
                    time.sleep(wait)
                    continue
                _count("gave_up")
                if on_s3:
                    _gave_up_at[_store_key()] = (time.monotonic(), budget)
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


# --------------------------------------------------------------------------- no write through a link
# Local output prefixes of this process (absolute paths): below them, writes, moves and deletes never
# follow a symlink (a link ``<out>/sub -> /elsewhere`` plus a journal listing ``sub/y.txt`` would
# otherwise write /elsewhere/y.txt). Registered by Publication, roll_forward and the lease.
_guarded: set[str] = set()
_guard_lock = threading.Lock()


def guard_prefix(uri: str) -> None:
    """Mark a local output prefix: from now on this process refuses any write, move or delete whose
    path, below it, passes through a symlink (:func:`check_no_symlink`). No-op for ``s3://``."""
    if is_s3(uri):
        return
    _, path = resolve(uri)
    with _guard_lock:
        _guarded.add(path.rstrip(os.sep) or os.sep)


def _guard_of(path: str) -> str | None:
    with _guard_lock:
        roots = [r for r in _guarded if path == r or path.startswith(r.rstrip(os.sep) + os.sep)]
    return max(roots, key=len) if roots else None


def check_no_symlink(path: str) -> None:
    """Refuse (StorageError naming the link) a local ``path`` that, below a guarded output prefix
    (:func:`guard_prefix`), is or passes through a symlink: each component is checked with
    ``os.lstat``. The prefix itself, and what lies above it, may be links (the user chose them)."""
    root = _guard_of(path)
    if root is None:
        return
    cur = root
    for part in path[len(root):].split(os.sep):
        if not part:
            continue
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except OSError:   # not there (yet): nothing below it can be a link
            return
        if stat.S_ISLNK(st.st_mode):
            raise StorageError(f"{cur}: a symlink inside the output {root}: refused (writes, moves and "
                               f"deletes below an output never follow a link); remove the link")


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = resolve(uri)
    local = isinstance(fs, pafs.LocalFileSystem)
    if local:
        check_no_symlink(path)

    def _write() -> None:
        if local:
            check_no_symlink(path)   # again, right before the write (each retry)
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as f:   # (pyarrow compresses *.gz etc. by extension)
            f.write(data)
    retrying(_write, uri, write=True)
    hooks.checkpoint("write")


def write_atomic(uri: str, data: bytes) -> None:
    """Write a file that no reader ever sees half-written: one PUT on S3; temp file + rename locally."""
    if is_s3(uri):
        write_bytes(uri, data)
        return
    _, path = resolve(uri)
    check_no_symlink(path)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    write_bytes(tmp, data)
    os.replace(tmp, path)


def delete(uri: str) -> None:
    """Delete a file or a whole prefix; missing is fine. Locally a link inside the deleted tree is
    removed, never followed (below a guarded output, a path through a link is refused)."""
    fs, path = resolve(uri)
    local = isinstance(fs, pafs.LocalFileSystem)
    if local:
        check_no_symlink(path)

    def _del() -> None:
        if local:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            return
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        elif info.type == pafs.FileType.File:
            fs.delete_file(path)
    retrying(_del, uri, write=True)


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
    # a local copy is written beside its destination under a name of its own, then renamed: two processes that
    # copy the same file at once (two Ray nodes on one host staging the same data, pods on a shared volume) each
    # write their own part and the last rename wins, whole
    part = f"{dpath}.{os.getpid()}-{threading.get_ident() % 10**6}.part"
    if isinstance(dfs, pafs.LocalFileSystem):
        check_no_symlink(dpath)
        check_no_symlink(part)

    def _copy() -> tuple[int, str]:
        if isinstance(dfs, pafs.LocalFileSystem):
            dfs.create_dir(dpath.rsplit("/", 1)[0], recursive=True)
        h, n = hashlib.sha256(), 0
        tmp = part if isinstance(dfs, pafs.LocalFileSystem) else dpath
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
    n, sha = retrying(_copy, f"copy {src} -> {dst}", write=is_s3(dst))
    if src.rstrip("/") in _expected:
        _check_expected(src, n, sha)
    hooks.checkpoint("write")
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


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def iter_chunks(seq: list[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(seq), size):
        yield seq[i:i + size]
