"""One writer per output: a lease object ``<prefix>/_LEASE`` with an expiry, renewed by a heartbeat.

A stage takes the lease on its output before it stages anything, and the pipeline driver takes it on
``<run root>/_run`` before it creates any RayJob. A second writer is refused with
:class:`LeaseHeldError`, which names the holder (run id, host, pid, what it runs, since when, when
the lease expires). A holder that dies stops renewing, so its lease expires after ``ttl`` seconds
(``MEMSIFTER_LEASE_TTL``, default 60) and the next writer takes it over (at once when the dead holder
ran on the same host: its pid is checked); ``steal=True``
(``--steal-lease``) takes a live lease at once, and the robbed holder notices at its next heartbeat or
at the latest just before it publishes, and stops without publishing.

How the lease is taken:

* S3: conditional writes. Create is ``PutObject`` with ``If-None-Match: *``; renew, take-over of an
  expired lease and stealing are ``PutObject`` with ``If-Match: <etag>`` (compare-and-swap), so two
  writers can never both hold it (SeaweedFS and AWS S3 honour both headers).
* Local disk: ``O_CREAT|O_EXCL`` create; take-over and renew write a temp file, rename it over the
  lease and read it back. Remaining race: two processes taking over the *same expired* lease within
  the same few milliseconds can both pass the read-back; the later rename wins and the earlier one
  finds out at its next heartbeat or before publishing.

A ``_LEASE`` that is not a lease (a JSON value other than an object, a directory, an unreadable
file) and an output that cannot be written (a regular file on the way, a read-only filesystem) are
one :class:`~memsifter.errors.StorageError` line naming the path (exit 2). ``MEMSIFTER_LEASE_TTL``
must be > 0 and ``MEMSIFTER_LEASE_WAIT`` >= 0 (:func:`memsifter.storage.setting`).

Limits: expiry uses the writers' wall clocks (keep them within a few seconds of each other, i.e.
NTP); release deletes only a lease whose token is still ours, but between that check and the delete
a steal could slip in (the thief then simply re-creates its lease at its next heartbeat).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Iterator

from . import storage
from .errors import MemsifterError, StorageError

log = logging.getLogger(__name__)
LEASE = "_LEASE"


class LeaseHeldError(MemsifterError):
    """Another live writer holds the output (exit code 3: busy, try later)."""

    exit_code = 3


class LeaseLostError(MemsifterError):
    """Our lease was taken over (stolen or expired) while we ran: we must not publish."""

    exit_code = 3


def run_id() -> str:
    """This process's run id: ``MEMSIFTER_RUN_ID`` (the driver/pipeline sets it) or a random one."""
    rid = os.environ.get("MEMSIFTER_RUN_ID")
    if not rid:
        rid = os.environ["MEMSIFTER_RUN_ID"] = f"run-{uuid.uuid4().hex[:10]}"
    return rid


def describe(holder: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    left = holder.get("expires_at", 0) - now
    state = f"expires in {left:.0f}s" if left > 0 else f"expired {-left:.0f}s ago"
    return (f"run {holder.get('run_id')} ({holder.get('purpose') or 'writer'}, host {holder.get('host')}, "
            f"pid {holder.get('pid')}, since {holder.get('started_at')}, lease {state})")


def _dead_here(holder: dict) -> bool:
    """A holder on this very host whose process is gone (a killed run restarted on the same machine
    need not wait for the expiry). Other hosts' holders are judged by expiry only."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    if holder["pid"] == os.getpid():
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# --------------------------------------------------------------------------- store backends
class _S3Store:
    def __init__(self, uri: str):
        import boto3
        from botocore.config import Config

        st = storage.S3Settings.from_env()
        _, path = storage.resolve(uri)
        self.bucket, self.key = path.split("/", 1)
        kw: dict[str, Any] = dict(region_name=st.region, config=Config(
            retries={"max_attempts": max(st.attempts, 5), "mode": "standard"},
            connect_timeout=st.connect_timeout, read_timeout=min(st.request_timeout, 30)))
        if st.endpoint:
            kw["endpoint_url"] = f"{st.scheme}://{st.endpoint}"
        if st.access_key and st.secret_key:
            kw.update(aws_access_key_id=st.access_key, aws_secret_access_key=st.secret_key,
                      aws_session_token=st.session_token)
        self.client = boto3.client("s3", **kw)
        self.uri = uri

    def _call(self, what: str, fn):  # noqa: ANN001, ANN202
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn()
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                return None
            if code in ("NoSuchKey", "404") or status == 404:
                return "missing"
            raise StorageError(f"{self.uri}: {what}: {code or status}: {e}") from e
        except BotoCoreError as e:
            raise StorageError(f"{self.uri}: {what}: object store unavailable after retries: {e}") from e

    def read(self) -> tuple[dict, str] | None:
        r = self._call("read lease", lambda: self.client.get_object(Bucket=self.bucket, Key=self.key))
        if r in (None, "missing"):
            return None
        try:
            data = json.loads(r["Body"].read())
        except ValueError:   # a PUT is atomic, so this is not ours: expired, replaceable by its etag
            return {"token": "", "expires_at": 0}, r["ETag"]
        return _lease_object(data, self.uri), r["ETag"]

    def create(self, body: bytes) -> str | None:
        r = self._call("create lease", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self.key, Body=body, IfNoneMatch="*"))
        return None if r in (None, "missing") else r["ETag"]

    def replace(self, body: bytes, etag: str) -> str | None:
        r = self._call("replace lease", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self.key, Body=body, IfMatch=etag))
        return None if r in (None, "missing") else r["ETag"]

    def delete(self) -> None:
        self._call("release lease", lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key))


def _lease_object(data: Any, uri: str) -> dict:
    """A lease must be a JSON object; anything else is one StorageError naming it."""
    if not isinstance(data, dict):
        raise StorageError(f"{uri}: not a lease (a JSON {type(data).__name__}, expected an object); if no "
                           f"run is writing this output, delete it")
    return data


class _LocalStore:
    def __init__(self, uri: str):
        _, self.path = storage.resolve(uri)
        self.uri = uri

    def _oserror(self, what: str, e: OSError) -> StorageError:
        return StorageError(f"{self.uri}: cannot {what} the lease: {e.strerror or type(e).__name__}"
                            f"{f' ({e.filename})' if e.filename and e.filename != self.path else ''}")

    def read(self) -> tuple[dict, str] | None:
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read())
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise StorageError(f"{self.uri}: is a directory, not a lease; if no run is writing this output, "
                               f"remove it") from None
        except json.JSONDecodeError:   # a half-written lease cannot exist (rename), but be safe
            return {"token": "", "expires_at": 0}, ""
        except OSError as e:
            raise self._oserror("read", e) from e
        data = _lease_object(data, self.uri)
        return data, str(data.get("token", ""))

    def create(self, body: bytes) -> str | None:
        tmp = f"{self.path}.{uuid.uuid4().hex[:8]}.new"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
        except OSError as e:   # a regular file on the way, a read-only filesystem, no permission
            raise self._oserror("create", e) from e
        try:
            os.link(tmp, self.path)   # atomic; fails when the lease exists
        except FileExistsError:
            return None
        except OSError as e:
            raise self._oserror("create", e) from e
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return json.loads(body)["token"]

    def replace(self, body: bytes, etag: str) -> str | None:
        cur = self.read()
        if cur is None or cur[1] != etag:
            return None
        tmp = f"{self.path}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise self._oserror("write", e) from e
        token = json.loads(body)["token"]
        back = self.read()
        return token if back is not None and back[1] == token else None

    def delete(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# --------------------------------------------------------------------------- the lease
class Lease:
    """A held lease; :meth:`check` raises :class:`LeaseLostError` once it is no longer ours."""

    def __init__(self, prefix: str, purpose: str = "", ttl: float | None = None):
        self.prefix = prefix.rstrip("/")
        self.uri = storage.join(self.prefix, LEASE)
        self.purpose = purpose
        if ttl is not None and not ttl > 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl!r}")
        self.ttl = float(ttl or storage.setting("MEMSIFTER_LEASE_TTL"))   # > 0: checked there
        self.token = uuid.uuid4().hex
        self.store = _S3Store(self.uri) if storage.is_s3(self.uri) else _LocalStore(self.uri)
        self.etag: str | None = None
        self.lost: str | None = None
        self.holder: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        now = time.time()
        if not self.holder:
            self.holder = {"run_id": run_id(), "host": socket.gethostname(), "pid": os.getpid(),
                           "purpose": self.purpose, "token": self.token,
                           "started_at": storage.utcnow()}
        self.holder.update(renewed_at=storage.utcnow(), expires_at=round(now + self.ttl, 3), ttl=self.ttl)
        return json.dumps(self.holder, indent=2, sort_keys=True).encode()

    def acquire(self, steal: bool = False, wait: float | None = None) -> "Lease":
        """Take the lease; a live holder's lease is waited for up to ``wait`` seconds (default
        ``MEMSIFTER_LEASE_WAIT``, 0: refuse at once), then refused with LeaseHeldError."""
        if storage.is_s3(self.uri):
            storage.ensure_bucket(self.uri)
        wait = float(storage.setting("MEMSIFTER_LEASE_WAIT")) if wait is None else wait
        deadline = time.time() + wait
        races = 0
        while races < 5:   # a lease that changes under us (released, renewed) is read again
            etag = self.store.create(self._body())
            if etag is not None:
                self.etag = etag
                log.info("%s: lease taken (run %s)", self.prefix, self.holder["run_id"])
                return self
            cur = self.store.read()
            if cur is None:
                races += 1
                continue   # released meanwhile
            other, other_etag = cur
            if other.get("token") == self.token:   # our create went through but its reply was lost
                self.etag = other_etag
                return self
            expired = other.get("expires_at", 0) < time.time() or _dead_here(other)
            if not expired and not steal and time.time() < deadline:
                time.sleep(min(2.0, max(0.1, deadline - time.time())))
                continue
            if not expired and not steal:
                raise LeaseHeldError(
                    f"{self.prefix}: another writer holds this output: {describe(other)}. Wait for it to "
                    f"finish, or if that run is dead pass --steal-lease (a dead holder's lease also "
                    f"expires by itself; --force does not take a live lease)")
            etag = self.store.replace(self._body(), other_etag)
            if etag is not None:
                self.etag = etag
                log.warning("%s: took over the lease of %s (%s)", self.prefix, describe(other),
                            "stolen" if not expired else "expired")
                self.holder["took_over"] = {k: other.get(k) for k in ("run_id", "host", "pid", "token")}
                return self
            races += 1
        raise LeaseHeldError(f"{self.prefix}: could not take the lease: it changed hands 5 times in a row")

    def renew(self) -> None:
        if self.lost:
            return
        etag = self.store.replace(self._body(), self.etag or "")
        if etag is None:
            cur = self.store.read()
            if cur is not None and cur[0].get("token") == self.token:   # done, but the reply was lost
                self.etag = cur[1]
                return
            self.lost = (f"{self.prefix}: our lease (run {self.holder.get('run_id')}) was taken over by "
                         + (describe(cur[0]) if cur else "nobody (it was deleted)"))
            log.error("%s", self.lost)
        else:
            self.etag = etag

    def check(self) -> None:
        """Raise LeaseLostError unless the lease is still ours (a fresh read: used before publishing)."""
        if not self.lost:
            cur = self.store.read()
            if cur is None or cur[0].get("token") != self.token:
                self.lost = (f"{self.prefix}: our lease (run {self.holder.get('run_id')}) was taken over by "
                             + (describe(cur[0]) if cur else "nobody (it was deleted)"))
            elif cur[0].get("expires_at", 0) < time.time():
                self.renew()
        if self.lost:
            raise LeaseLostError(self.lost + "; not publishing (the other writer owns the output now)")

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - the store is down: keep trying until expiry
                log.warning("%s: lease renewal failed: %s", self.prefix, e)
            if self.lost:
                return

    def start(self) -> "Lease":
        self._thread = threading.Thread(target=self._beat, name=f"lease:{self.prefix}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost:
            return
        with contextlib.suppress(Exception):
            cur = self.store.read()
            if cur is not None and cur[0].get("token") == self.token:
                self.store.delete()


@contextlib.contextmanager
def hold(prefix: str, purpose: str = "", steal: bool = False, ttl: float | None = None,
         wait: float | None = None) -> Iterator[Lease]:
    """Take the lease on ``prefix``, renew it while the block runs, release it after."""
    lease = Lease(prefix, purpose, ttl).acquire(steal=steal, wait=wait).start()
    try:
        yield lease
    finally:
        lease.release()
