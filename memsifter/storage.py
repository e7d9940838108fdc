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
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .errors import NotPublishedError, StorageError

log = logging.getLogger(__name__)
MANIFEST = "_SUCCESS"
STAGING = "_staging"
WORK = "_work"
T = TypeVar("T")


# --------------------------------------------------------------------------- filesystems
@dataclass(frozen=True)
class S3Settings:
    endpoint: str | None
    scheme: str
    region: str
    access_key: str | None
    secret_key: str | None
    session_token: str | None

    @classmethod
    def from_env(cls) -> "S3Settings":
        raw = (os.environ.get("MEMSIFTER_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL_S3")
               or os.environ.get("AWS_ENDPOINT_URL") or "")
        endpoint, scheme = None, "https"
        if raw:
            p = urlparse(raw if "://" in raw else f"https://{raw}")
            endpoint, scheme = p.netloc, p.scheme or "https"
        return cls(endpoint=endpoint, scheme=scheme,
                   region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
                   access_key=os.environ.get("AWS_ACCESS_KEY_ID"),
                   secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                   session_token=os.environ.get("AWS_SESSION_TOKEN"))


@functools.lru_cache(maxsize=8)
def _s3(settings: S3Settings) -> pafs.S3FileSystem:
    kw: dict[str, Any] = dict(region=settings.region, scheme=settings.scheme,
                              retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=6),
                              connect_timeout=10, request_timeout=120,
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


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """Filesystem and path for a URI (``s3://b/k``, ``file:///p`` or a plain path)."""
    if not uri:
        raise StorageError("empty URI")
    if is_s3(uri):
        return _s3(S3Settings.from_env()), uri[len("s3://"):].rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" in uri:
        raise StorageError(f"{uri}: unsupported URI scheme (use a local path or s3://bucket/prefix)")
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def join(uri: str, *parts: str) -> str:
    out = uri.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def _transient(exc: BaseException) -> bool:
    msg = str(exc).lower()
    return any(s in msg for s in ("503", "slowdown", "timed out", "timeout", "internal error",
                                  "connection reset", "throttl", "500 "))


def retrying(fn: Callable[[], T], what: str, attempts: int = 4) -> T:
    """Run ``fn``, retrying transient S3 errors with exponential backoff; wrap the rest."""
    for i in range(attempts):
        try:
            return fn()
        except FileNotFoundError as e:
            raise StorageError(f"{what}: not found") from e
        except PermissionError as e:
            raise StorageError(f"{what}: permission denied") from e
        except OSError as e:
            if i + 1 < attempts and _transient(e):
                time.sleep(0.5 * 2 ** i)
                continue
            msg = str(e)
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


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)

    def _read() -> bytes:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type == pafs.FileType.Directory:
            raise StorageError(f"{uri}: is a directory, expected a file")
        with fs.open_input_stream(path) as f:
            return f.read()
    return retrying(_read, uri)


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
    return retrying(_copy, f"copy {src} -> {dst}")


def upload_dir(local_dir: str, uri: str) -> list[str]:
    out = []
    for root, _, files in os.walk(local_dir):
        for f in sorted(files):
            full = os.path.join(root, f)
            rel = os.path.relpath(full, local_dir).replace(os.sep, "/")
            copy_file(full, join(uri, rel))
            out.append(rel)
    return out


def read_parquet(uri: str, columns: list[str] | None = None) -> pa.Table:
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


def read_manifest(uri: str) -> dict:
    """The ``_SUCCESS`` manifest of a published prefix; raises NotPublishedError without one."""
    m_uri = join(uri, MANIFEST)
    if not exists(m_uri):
        if not exists(uri):
            raise NotPublishedError(f"{uri}: does not exist")
        raise NotPublishedError(f"{uri}: no {MANIFEST} manifest: the data was never published or a "
                                f"stage crashed while writing it; re-run the stage that writes it")
    return read_json(m_uri)


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

    Files are written to ``<out>/_staging/<attempt>/<name>``; ``publish`` first removes the old
    manifest (so readers never pair an old manifest with new files), moves each staged file into
    place and writes ``_SUCCESS`` last. A crash at any point leaves no manifest, so readers refuse
    the prefix and a re-run starts over (keeping ``_work/``).
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

    def publish(self, stats: dict | None = None) -> dict:
        if stats:
            self.stats.update(stats)
        fs, root = resolve(self.uri)
        delete(join(self.uri, MANIFEST))
        for name in self.files:
            src, dst = f"{root}/{STAGING}/{self.attempt}/{name}", f"{root}/{name}"
            if isinstance(fs, pafs.LocalFileSystem):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                retrying(lambda s=src, d=dst: os.replace(s, d), f"publish {dst}")
            else:
                retrying(lambda s=src, d=dst: fs.move(s, d), f"publish s3://{dst}")
        manifest = {
            "stage": self.stage, "config": self.config, "config_hash": self.config_hash,
            "code_version": self.code_version, "started_at": self.started, "published_at": utcnow(),
            "attempt": self.attempt, "files": self.files, "stats": self.stats, "inputs": self.inputs,
        }
        write_bytes(join(self.uri, MANIFEST), json.dumps(manifest, indent=2, sort_keys=True,
                                                          default=str).encode())
        with contextlib.suppress(Exception):
            delete(join(self.uri, STAGING))
        return manifest

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            delete(self.staging)


def verify(uri: str) -> dict:
    """Check every file of a manifest against its recorded size; returns the manifest."""
    manifest = read_manifest(uri)
    fs, root = resolve(uri)
    for name, meta in manifest.get("files", {}).items():
        info = retrying(lambda n=name: fs.get_file_info(f"{root}/{n}"), join(uri, name))
        if info.type != pafs.FileType.File or info.size != meta["bytes"]:
            raise NotPublishedError(f"{join(uri, name)}: missing or size differs from the manifest")
    return manifest


def iter_chunks(seq: list[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(seq), size):
        yield seq[i:i + size]
