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

This module is the storage layer's one namespace (``storage.join``, ``storage.Publication``, ...); the
code lives in two modules: :mod:`memsifter.store.backends` (settings, the S3 client, retries and the
circuit breaker, key and symlink guards, file I/O, reads checked against manifests) and
:mod:`memsifter.store.publication` (manifests, atomic publish and roll-forward, plain-write targets).
Fault points (:mod:`memsifter.store.hooks`) mark where a crash matters.

Guarantees (tests/test_faults.py, tests/test_kill.py):

* Transient store errors (resets, stalls, 5xx/SlowDown, a store down for a while) are retried by the
  AWS SDK (``MEMSIFTER_S3_ATTEMPTS`` tries per request) and then by :func:`retrying` for at most
  ``MEMSIFTER_STORE_RETRY_SECONDS`` (default 120 s); then one :class:`StorageError` names the URI, the
  operation, the attempts and the last error. Nothing hangs: every request has a timeout
  (``MEMSIFTER_S3_CONNECT_TIMEOUT`` / ``MEMSIFTER_S3_REQUEST_TIMEOUT``), fitted with the SDK's tries into
  half the budget unless set, and an attempt starts only while one more that meets a silent store
  still fits: a failing operation ends within the budget (tests/test_probe_store.py measures it
  against a socket that accepts and never answers). Once it gave up on a store, writes to it fail at
  once until one operation succeeds or a budget has passed, so the failure's cleanup does not wait
  out more budgets (:func:`store_down`).
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
  :data:`SETTINGS`, upper bounds in :data:`MAXIMA`) with ranges; a bad value is one
  :class:`~memsifter.errors.ConfigError` naming the variable, and so is an S3 endpoint that is not
  ``http(s)://host[:port]``. ``s3://`` URIs without a bucket, or with an empty, ``.`` or ``..``
  segment in the key, are refused (:func:`s3_path`).
* Local writes never follow a symlink inside an output prefix (:func:`guard_prefix`,
  :func:`check_no_symlink`: every component below the prefix is checked with ``os.lstat``, before
  writes, deletes and each move of a publish); local deletes remove links, never follow them.
* Control files and folders (``_SUCCESS``, ``_PUBLISHING``, ``_LEASE``, ``_staging/``, ``_work/``,
  ``_run/``) and prefixes that are published or held by a run are not targets of plain writes
  (:func:`check_plain_target`, used by ``data export``).
"""

from __future__ import annotations

# The storage layer's names, re-exported (``_s3``, ``_transient``, ``_gave_up_at``: the S3 client cache, the
# transient-error test and the circuit breaker's state, which the storage tests reach).
from ..errors import NotPublishedError, StorageError  # noqa: F401
from .backends import (JOURNAL, MANIFEST, MAXIMA, SETTINGS, STAGING, STATS, WORK,  # noqa: F401
                       ConcurrentPublishError, ModifiedAfterPublishError, RangeReader, S3Settings, TooLargeError,
                       _gave_up_at, _s3, _transient, check_env, check_key, check_no_symlink, copy_file, delete,
                       download_dir, ensure_bucket, exists, guard_prefix, is_file, is_s3, iter_chunks, join, list_dirs,
                       list_files, parquet_bytes, read_bytes, read_json, read_parquet, read_text, resolve, retrying,
                       s3_path, setting, sha256_bytes, store_down, upload_dir, write_atomic, write_bytes)
from .publication import (CONTROL_NAMES, LEASE_NAME, BadManifestError, Publication,  # noqa: F401
                          SecretFoundError, check_manifest, check_plain_target, damaged_file, published_ancestor,
                          published_file, read_manifest, roll_forward, try_manifest, utcnow, verify)
