"""Publication: manifests, atomic publish and its roll-forward, and the places a plain write must not go.

A stage writes under ``<out>/_staging/<attempt>/`` (:class:`Publication`); ``publish()`` journals the
manifest to be (``_PUBLISHING``), moves every file into place and writes ``_SUCCESS`` last; a run killed
in between is completed by the next (:func:`roll_forward`). Readers get a manifest only when it is valid
(:func:`read_manifest`, :func:`check_manifest`). The bytes move through :mod:`memsifter.store.backends`;
stages use both through :mod:`memsifter.store.storage`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import io
import json
import logging
import os
import time
import uuid
from typing import Any, Callable

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from . import hooks
from .backends import (JOURNAL, MANIFEST, STAGING, WORK, _expect, check_key, check_no_symlink, copy_file,
                       delete, ensure_bucket, exists, guard_prefix, is_s3, join, parquet_bytes,
                       read_bytes, read_json, resolve, retrying, s3_path, setting, sha256_bytes, store_down,
                       write_atomic, write_bytes)
from ..errors import NotPublishedError, StorageError

log = logging.getLogger(__name__)


class BadManifestError(StorageError):
    """A ``_SUCCESS`` that is not a valid manifest (not JSON, not an object, keys missing or unsafe)."""


class SecretFoundError(StorageError):
    """A publication that still holds a credential after redaction (:meth:`Publication.publish` refuses it)."""


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
    return _marked_ancestor(uri, (MANIFEST, JOURNAL))


LEASE_NAME = "_LEASE"   # memsifter.store.lease.LEASE (the lease module imports this one)
# Names that only memsifter writes, in any prefix: a plain write (``data export``) never targets them.
CONTROL_NAMES = (MANIFEST, JOURNAL, LEASE_NAME, STAGING, WORK, "_run")


def check_plain_target(uri: str) -> None:
    """Refuse (StorageError, one line) a destination of a write that is not a publication (``data
    export``): a control file or folder (``_SUCCESS``, ``_PUBLISHING``, ``_LEASE``, ``_staging/``,
    ``_work/``, ``_run/``: anywhere in the path), a path inside a published (or being published)
    prefix, or inside a prefix a run holds (``_LEASE``: a stage is writing it)."""
    segs = s3_path(uri).split("/")[1:] if is_s3(uri) else resolve(uri)[1].split(os.sep)
    for seg in segs:
        if seg in CONTROL_NAMES:
            raise StorageError(f"{uri}: '{seg}' is a memsifter control "
                               f"{'file' if seg in (MANIFEST, JOURNAL, LEASE_NAME) else 'folder'} (publication, "
                               f"lease or scratch): not a target of a plain write; choose another destination")
    inside = published_ancestor(uri)
    if inside is not None:
        raise StorageError(f"{uri}: inside the published output {inside}: writing there would change "
                           f"published files behind its manifest; export to another location")
    held = _marked_ancestor(uri, (LEASE_NAME,))
    if held is not None:
        raise StorageError(f"{uri}: inside {held}, which a run is writing (it holds {held}/{LEASE_NAME}); "
                           f"export to another location")


def _marked_ancestor(uri: str, markers: tuple[str, ...]) -> str | None:
    """The nearest of ``uri`` and its parents that holds one of ``markers``, if any."""
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
        for marker in markers:
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

    No credential is published: every string a stage writes (table columns, nested ones included; text and
    JSON files; the manifest's config and stats) has the credentials the process knows removed first, in
    all their forms (:func:`memsifter.security.redact.known_secrets`: keys, URL passwords, Basic/base64,
    percent-encoded), and the token shapes the secret scan reports (:mod:`memsifter.security.secretscan`).
    Every file is then scanned as it is staged (gzip, zip, tar and parquet opened; a file copied in as it
    is, too): ``publish`` refuses one that still holds a finding (:class:`SecretFoundError`, one line
    naming the file and the kind, never the value) before anything is visible.

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
        self.findings: list[Any] = []   # secretscan findings in what was staged (publish refuses them)
        self.stats: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}   # fingerprints of the inputs this output was built from
        self.started = utcnow()
        guard_prefix(self.uri)
        ensure_bucket(self.uri)

    @property
    def work(self) -> str:
        """Scratch prefix kept across attempts (for resumable partial progress)."""
        return join(self.uri, WORK)

    def _record(self, name: str, nbytes: int, sha: str, rows: int | None) -> None:
        self.files[name] = {"bytes": nbytes, "sha256": sha, **({"rows": rows} if rows is not None else {})}

    def _stage(self, name: str, data: bytes, rows: int | None = None) -> None:
        write_bytes(join(self.staging, name), data)
        self._record(name, len(data), sha256_bytes(data), rows)

    def write_bytes(self, name: str, data: bytes, rows: int | None = None) -> None:
        """Stage a file: UTF-8 text is redacted first (:func:`memsifter.security.secretscan.scrub_text`),
        then the bytes are scanned (a gzip or parquet file opened; a file larger than the scanner's limit,
        for the run's credentials only)."""
        from ..security import secretscan
        from ..security.redact import known_secrets

        known = known_secrets()
        if data[:4] == b"PAR1":
            self.findings += secretscan.scan_table(pq.read_table(io.BytesIO(data)), name, known)
        else:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None:
                clean = secretscan.scrub_text(text, known)
                data = clean.encode("utf-8") if clean != text else data
            # past the scanner's size limit (weights): the run's credentials only, block by block
            self.findings += secretscan.scan_stream(lambda: io.BytesIO(data), len(data), name, known)
        self._stage(name, data, rows)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_table(self, name: str, table: pa.Table) -> None:
        """Stage a parquet table, its strings redacted and then scanned (binary columns scanned only)."""
        from ..security import secretscan
        from ..security.redact import known_secrets

        known = known_secrets()
        table = secretscan.scrub_table(table, known)
        self.findings += secretscan.scan_table(table, name, known)
        self._stage(name, parquet_bytes(table), rows=table.num_rows)

    def add_file(self, name: str, local_path: str) -> None:
        """Copy a file in as it is (model weights, checkpoints; a local path or a URI): scanned, never
        rewritten."""
        from ..security import secretscan
        from ..security.redact import known_secrets

        fs, path = resolve(local_path)
        size = retrying(lambda: fs.get_file_info(path), local_path).size
        self.findings += secretscan.scan_stream(lambda: fs.open_input_stream(path), size, name, known_secrets())
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
        from ..security import secretscan
        from ..security.redact import known_secrets, redact_obj

        if stats:
            self.stats.update(stats)
        manifest = {
            "stage": self.stage, "config": redact_obj(self.config), "config_hash": self.config_hash,
            "code_version": self.code_version, "started_at": self.started, "published_at": utcnow(),
            "attempt": self.attempt, "files": self.files, "stats": redact_obj(self.stats), "inputs": self.inputs,
            "run_id": os.environ.get("MEMSIFTER_RUN_ID"),
        }
        found = self.findings + secretscan.scan_text(_dumps(manifest).decode(), MANIFEST, known_secrets())
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise SecretFoundError(f"{self.uri}: refusing to publish: a credential is still in the output after "
                                   f"redaction: {found[0]}{more}; nothing was published")
        hooks.checkpoint("publish-start")
        if check is not None:
            check()
        self.journalled = True   # from here on a crash is completed by roll_forward: keep the staging
        write_atomic(join(self.uri, JOURNAL), _dumps(manifest))
        return _complete(self.uri, manifest)

    def abort(self) -> None:
        if getattr(self, "journalled", False) or store_down(self.uri):   # a store given up on: not again
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
    guard_prefix(uri)
    moves = [(resolve(join(uri, STAGING, manifest["attempt"], name))[1], resolve(join(uri, name))[1], meta)
             for name, meta in manifest["files"].items()]    # all keys checked before anything moves
    if local:   # and no move goes through a symlink, checked before anything changes
        for src, dst, _ in moves:
            check_no_symlink(src)
            check_no_symlink(dst)
    delete(join(uri, MANIFEST))
    for src, dst, meta in moves:
        shown = dst if local else f"s3://{dst}"

        def _move(s: str = src, d: str = dst) -> None:
            if local:
                check_no_symlink(s)   # again, right before the move (a link planted meanwhile)
                check_no_symlink(d)
                os.makedirs(os.path.dirname(d), exist_ok=True)
                os.replace(s, d)
            else:
                fs.move(s, d)
        try:
            retrying(_move, f"publish {shown}", write=True)
        except StorageError:
            # already moved by an earlier attempt (a crash, or a move whose reply was lost)?
            if not _file_matches(fs, dst, shown, meta):
                raise
        hooks.checkpoint("publish-move")
    hooks.checkpoint("publish-commit")
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
    guard_prefix(uri)
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
