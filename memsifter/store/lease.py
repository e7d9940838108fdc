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

Malformed leases are refused, not taken over: a ``_LEASE`` whose content is not a lease (bytes that
are not UTF-8, not JSON, a JSON value other than an object, an integer over Python's digit limit, a
``token``/``host``/``run_id`` that is not a string, an ``expires_at`` that is not a finite number such
as ``"tomorrow"`` or ``null``, a ``pid`` that is not an integer in 1..2**31-1 such as ``2**70``) is
one :class:`MalformedLeaseError` line naming the file and the field (exit 2), never a traceback. We
cannot tell whether a live writer is behind it (another version, a tool), so it is not treated as
expired; the documented recovery is ``--steal-lease`` (``memsifter run <stage> ... --steal-lease``,
``memsifter pipeline run ... --steal-lease``), which replaces it like any lease (compare-and-swap on
its etag, or locally on its sha256) -- nobody has to delete files by hand. A running writer whose
lease turns into garbage has lost it (:class:`LeaseLostError` at its next heartbeat or before it
publishes). A ``_LEASE`` that is a directory and an output that cannot be written (a regular file on
the way, a read-only filesystem) are one :class:`~memsifter.errors.StorageError` line naming the path
(exit 2). ``MEMSIFTER_LEASE_TTL`` must lie in 5 s .. 1 day and ``MEMSIFTER_LEASE_WAIT`` be >= 0
(:func:`memsifter.store.storage.setting`).

The heartbeat is watched: if its thread dies (any exception out of its loop), :meth:`Lease.check`
raises :class:`LeaseLostError` naming the exception, so the stage fails before it publishes instead
of publishing under a lease nobody renews. After the storage layer gave up on an object store
(:func:`memsifter.store.storage.store_down`), the heartbeat and the release skip it: the lease then
expires by itself, and the failing command ends within its retry budget.

For ``memsifter status``: :func:`read_holder` reads the holder of a prefix and :func:`holder_state`
says whether it is ``live``, ``stale`` (its pid is gone on this very host: a killed run, whose lease
has not expired yet), ``expired`` or ``malformed``. An ``expires_at`` further ahead than the longest
lease (a day) plus 5 minutes of clock skew counts as expired: no holder writes one, and it would keep a
stage "running" forever.

Limits: expiry uses the writers' wall clocks (keep them within a few seconds of each other, i.e.
NTP); release deletes only a lease whose token is still ours, but between that check and the delete
a steal could slip in (the thief then simply re-creates its lease at its next heartbeat).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any, Iterator

from . import storage
from ..errors import MemsifterError, StorageError

log = logging.getLogger(__name__)
LEASE = storage.LEASE_NAME   # "_LEASE"


class LeaseHeldError(MemsifterError):
    """Another live writer holds the output (exit code 3: busy, try later)."""

    exit_code = 3


class LeaseLostError(MemsifterError):
    """Our lease was taken over (stolen or expired) while we ran, or its heartbeat died: we must not
    publish."""

    exit_code = 3


class MalformedLeaseError(StorageError):
    """A ``_LEASE`` whose content is not a lease (exit 2); ``--steal-lease`` replaces it."""


MAX_TTL = 86400.0
# An expiry further ahead than the longest lease plus this much clock skew was not written by a holder
# (a lease runs MAX_TTL at most): such a lease is treated as expired, so it cannot hold an output forever.
CLOCK_SKEW = 300.0
_MAX_PID = 2 ** 31 - 1


def run_id() -> str:
    """This process's run id: ``MEMSIFTER_RUN_ID`` (the driver/pipeline sets it) or a random one."""
    rid = os.environ.get("MEMSIFTER_RUN_ID")
    if not rid:
        rid = os.environ["MEMSIFTER_RUN_ID"] = f"run-{uuid.uuid4().hex[:10]}"
    return rid


def _short(v: Any) -> str:
    text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def expired(holder: dict, now: float | None = None) -> bool:
    """Past its ``expires_at``, or with an ``expires_at`` more than :data:`MAX_TTL` +
    :data:`CLOCK_SKEW` ahead (no holder writes that: now + 1e8 would keep a stage "running" forever)."""
    now = time.time() if now is None else now
    exp = holder.get("expires_at", 0)
    return exp < now or exp > now + MAX_TTL + CLOCK_SKEW


def describe(holder: dict, now: float | None = None) -> str:
    if holder.get("malformed"):
        return f"a malformed lease ({holder['malformed']})"
    now = time.time() if now is None else now
    left = holder.get("expires_at", 0) - now
    state = (f"expires in {left:.0f}s" if 0 < left <= MAX_TTL + CLOCK_SKEW else f"expired {-left:.0f}s ago"
             if left <= 0 else f"expiry {left:.3g}s ahead, beyond the longest lease ({MAX_TTL:g}s): "
             f"treated as expired")
    return (f"run {_short(holder.get('run_id'))} ({_short(holder.get('purpose') or 'writer')}, host "
            f"{_short(holder.get('host'))}, pid {holder.get('pid')}, since {_short(holder.get('started_at'))}, "
            f"lease {state})")


def check_holder(data: Any, uri: str) -> dict:
    """``data`` (a parsed ``_LEASE``) if it is a lease, else ``{"malformed": why}`` naming ``uri`` and
    the field at fault (see the module docstring); never raises."""
    def bad(why: str, field: str | None = None) -> dict:
        return {"malformed": f"{uri}: malformed lease: " + (f"field '{field}': " if field else "") + why}
    if not isinstance(data, dict):
        return bad(f"a JSON {type(data).__name__}, expected an object")
    for key in ("token", "host"):
        if not isinstance(data.get(key), str):
            return bad(f"expected a string, got {type(data.get(key)).__name__}", key)
    for key in ("run_id", "purpose", "started_at"):
        if data.get(key) is not None and not isinstance(data.get(key), str):
            return bad(f"expected a string, got {type(data[key]).__name__}", key)
    exp = data.get("expires_at")
    if not ((isinstance(exp, float) and math.isfinite(exp))
            or (isinstance(exp, int) and not isinstance(exp, bool) and abs(exp) < 2 ** 53)):
        shown = f"an integer of {exp.bit_length()} bits" if isinstance(exp, int) and not isinstance(exp, bool) \
            else _short(repr(exp))
        return bad(f"expected a time in seconds since the epoch, got {shown}", "expires_at")
    pid = data.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _MAX_PID):
        shown = f"an integer of {pid.bit_length()} bits" if isinstance(pid, int) and pid.bit_length() > 64 \
            else _short(repr(pid))
        return bad(f"expected a process id (1..{_MAX_PID}), got {shown}", "pid")
    return data


def _parse_lease(raw: bytes, uri: str) -> dict:
    """A lease's bytes -> :func:`check_holder`'s dict (garbage -> ``{"malformed": ...}``)."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as e:
        return {"malformed": f"{uri}: malformed lease: not UTF-8 text (byte {e.start})"}
    except (ValueError, RecursionError) as e:   # not JSON, an integer over the digit limit, too deep
        why = f"line {e.lineno} column {e.colno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else \
            _short(str(e).split(":")[0])
        return {"malformed": f"{uri}: malformed lease: not JSON ({why})"}
    return check_holder(data, uri)


def holder_state(holder: dict | None, now: float | None = None) -> str:
    """The state of a lease holder (as :func:`read_holder` returns it), for ``memsifter status``:

    * ``"malformed"``: not a lease (garbage ``_LEASE``: ``holder["malformed"]`` says why);
    * ``"expired"``: past its ``expires_at`` (its run is dead or stuck; the next writer takes it over),
      or with one implausibly far ahead (:func:`expired`);
    * ``"stale"``: not expired, but held on this very host by a pid that is gone (a killed run: the
      next writer on this host takes it over at once; elsewhere it expires after the TTL);
    * ``"live"``: everything else (a holder on another host is judged by its expiry only).
    """
    if not holder or holder.get("malformed") or "malformed" in check_holder(holder, "_LEASE"):
        return "malformed"
    if expired(holder, now):
        return "expired"
    if _dead_here(holder):
        return "stale"
    return "live"


def read_holder(prefix: str) -> dict | None:
    """The holder of ``<prefix>/_LEASE``: None without a lease, a ``{"malformed": why}`` dict for
    garbage (see :func:`holder_state`); a ``_LEASE`` directory or an unreadable store is a
    StorageError."""
    uri = storage.join(prefix.rstrip("/"), LEASE)
    store = _S3Store(uri) if storage.is_s3(uri) else _LocalStore(uri)
    cur = store.read()
    return None if cur is None else cur[0]


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
    except (PermissionError, OverflowError, ValueError, OSError):
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
        # the same tries and timeouts as the storage layer's (fitted into MEMSIFTER_STORE_RETRY_SECONDS)
        kw: dict[str, Any] = dict(region_name=st.region, config=Config(
            retries={"total_max_attempts": st.attempts, "mode": "standard"},
            connect_timeout=st.connect_timeout, read_timeout=st.request_timeout))
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
        raw = self._call("read lease", lambda: r["Body"].read())
        return _parse_lease(raw, self.uri), r["ETag"]

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


class _LocalStore:
    def __init__(self, uri: str):
        _, self.path = storage.resolve(uri)
        self.uri = uri

    def _oserror(self, what: str, e: OSError) -> StorageError:
        return StorageError(f"{self.uri}: cannot {what} the lease: {e.strerror or type(e).__name__}"
                            f"{f' ({e.filename})' if e.filename and e.filename != self.path else ''}")

    def read(self) -> tuple[dict, str] | None:
        """(holder, etag): the etag is the holder's token, or for a malformed lease the sha256 of its
        bytes (so that --steal-lease replaces exactly what it saw)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read(1 << 20)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise StorageError(f"{self.uri}: is a directory, not a lease; if no run is writing this output, "
                               f"remove it") from None
        except OSError as e:
            raise self._oserror("read", e) from e
        data = _parse_lease(raw, self.uri)
        if data.get("malformed"):
            return data, "sha256:" + hashlib.sha256(raw).hexdigest()
        return data, data["token"]

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
        if ttl is not None and not (0 < ttl <= MAX_TTL):   # NaN too (callers; the variable has its range)
            raise ValueError(f"lease ttl must be > 0 and <= {MAX_TTL:g} s, got {ttl!r}")
        self.ttl = float(ttl or storage.setting("MEMSIFTER_LEASE_TTL"))   # 5 s .. 1 day: checked there
        storage.guard_prefix(self.prefix)   # nothing below a local output is written through a symlink
        self.token = uuid.uuid4().hex
        self.store = _S3Store(self.uri) if storage.is_s3(self.uri) else _LocalStore(self.uri)
        self.etag: str | None = None
        self.lost: str | None = None
        self.dead: str | None = None   # why the heartbeat thread died, if it did
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
            if other.get("malformed") and not steal:
                raise MalformedLeaseError(f"{other['malformed']}; if no run is writing this output, pass "
                                          f"--steal-lease to take the lease over")
            if other.get("token") == self.token:   # our create went through but its reply was lost
                self.etag = other_etag
                return self
            gone = not other.get("malformed") and (expired(other) or _dead_here(other))
            if not gone and not steal and time.time() < deadline:
                time.sleep(min(2.0, max(0.1, deadline - time.time())))
                continue
            if not gone and not steal:
                raise LeaseHeldError(
                    f"{self.prefix}: another writer holds this output: {describe(other)}. Wait for it to "
                    f"finish, or if that run is dead pass --steal-lease (a dead holder's lease also "
                    f"expires by itself; --force does not take a live lease)")
            etag = self.store.replace(self._body(), other_etag)
            if etag is not None:
                self.etag = etag
                log.warning("%s: took over the lease of %s (%s)", self.prefix, describe(other),
                            "stolen" if not gone else "expired")
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
        """Raise LeaseLostError unless the lease is still ours (a fresh read: used before publishing)
        and its heartbeat is alive."""
        if self.dead is None and self._thread is not None and not self._thread.is_alive() \
                and not self._stop.is_set() and not self.lost:
            self.dead = f"{self.prefix}: the lease heartbeat stopped without a reason"
        if self.dead:
            raise LeaseLostError(self.dead + "; not publishing (nothing renews the lease)")
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
        try:
            while not self._stop.wait(self.ttl / 3):
                if storage.store_down(self.uri):   # given up on: the command is failing, let it expire
                    continue
                try:
                    self.renew()
                except Exception as e:  # noqa: BLE001 - the store is down: keep trying until expiry
                    log.warning("%s: lease renewal failed: %s", self.prefix, e)
                if self.lost:
                    return
        except BaseException as e:  # noqa: BLE001 - the thread's death must fail the stage, not pass
            self.dead = (f"{self.prefix}: the lease heartbeat died ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})")
            log.error("%s", self.dead)

    def start(self) -> "Lease":
        self._thread = threading.Thread(target=self._beat, name=f"lease:{self.prefix}", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        down = storage.store_down(self.uri)
        if self._thread is not None:
            self._thread.join(timeout=0.1 if down else 5)
        if self.lost or down:   # a store given up on: the lease expires by itself
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
