"""Storage layer on a local directory and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from memsifter.testing import faults
from memsifter.store import storage
from memsifter.errors import NotPublishedError, StorageError
from memsifter.testing.servers import env_vars


def test_bytes_roundtrip_and_listing(store_root):
    a = storage.join(store_root, "x", "a.txt")
    b = storage.join(store_root, "x", "sub", "b.bin")
    storage.write_bytes(a, b"hello")
    storage.write_bytes(b, bytes(range(256)) * 1000)
    assert storage.read_bytes(a) == b"hello"
    assert storage.read_bytes(b) == bytes(range(256)) * 1000
    assert storage.list_files(storage.join(store_root, "x")) == ["a.txt", "sub/b.bin"]
    assert storage.exists(a) and not storage.exists(storage.join(store_root, "nope"))
    storage.delete(storage.join(store_root, "x"))
    assert storage.list_files(storage.join(store_root, "x")) == []


def test_large_file_copy_is_multipart_safe(store_root, tmp_path):
    # 20 MiB crosses the 8 MiB chunk size (and S3 multipart thresholds).
    src = tmp_path / "big.bin"
    payload = (b"0123456789abcdef" * 65536) * 20
    src.write_bytes(payload)
    n, sha = storage.copy_file(str(src), storage.join(store_root, "big.bin"))
    assert n == len(payload) and sha == storage.sha256_bytes(payload)
    assert storage.read_bytes(storage.join(store_root, "big.bin")) == payload


def test_copies_of_one_file_to_one_local_path_at_once_leave_it_whole(tmp_path):
    """Two Ray nodes on one host (or pods on a shared volume) stage the same file to the same local path at the
    same time: each writes its own part and renames it, so the file is whole whichever rename comes last (one
    shared part file interleaves their writes, or loses the rename)."""
    import threading

    src = tmp_path / "model.bin"
    payload = bytes(range(256)) * 4096 * 8   # 8 MiB, copied 64 KiB at a time
    src.write_bytes(payload)
    dst = str(tmp_path / "node" / "model.bin")
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def copy() -> None:
        try:
            start.wait()
            storage.copy_file(str(src), dst, chunk=64 << 10)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=copy) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert open(dst, "rb").read() == payload
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["model.bin"], "no part file left behind"


def _publication(uri: str, cfg: dict | None = None) -> storage.Publication:
    return storage.Publication(uri, "test", cfg or {"a": 1}, "h1", "0.0")


def test_publish_is_atomic_and_manifest_lists_files(store_root):
    out = storage.join(store_root, "ds")
    pub = _publication(out)
    table = pa.table({"x": [1, 2, 3]})
    pub.write_table("t.parquet", table)
    pub.write_json("report.json", {"ok": True})
    # Before publish: readers refuse, final files are not in place.
    with pytest.raises(NotPublishedError):
        storage.read_manifest(out)
    assert not storage.exists(storage.join(out, "t.parquet"))
    m = pub.publish({"rows": 3})
    assert m["files"]["t.parquet"]["rows"] == 3
    assert m["stats"] == {"rows": 3} and m["config_hash"] == "h1"
    assert storage.read_parquet(storage.published_file(out, "t.parquet")).equals(table)
    assert json.loads(storage.read_bytes(storage.published_file(out, "report.json"))) == {"ok": True}
    assert storage.verify(out)["stage"] == "test"
    # Staging is cleaned up after publish.
    assert not [f for f in storage.list_files(out) if f.startswith(storage.STAGING)]
    with pytest.raises(NotPublishedError, match="no file 'missing.parquet'"):
        storage.published_file(out, "missing.parquet")


def test_crash_before_publish_leaves_nothing_readable(store_root):
    out = storage.join(store_root, "crashed")
    pub = _publication(out)
    pub.write_table("t.parquet", pa.table({"x": [1]}))
    # Simulated crash: publish() never runs.
    with pytest.raises(NotPublishedError, match="no _SUCCESS manifest"):
        storage.read_manifest(out)
    pub.abort()
    assert storage.list_files(out) == []


def test_republish_replaces_manifest_last(store_root):
    out = storage.join(store_root, "re")
    p1 = _publication(out)
    p1.write_table("t.parquet", pa.table({"x": [1]}))
    p1.publish()
    p2 = _publication(out, {"a": 2})
    p2.write_table("t.parquet", pa.table({"x": [1, 2]}))
    # While p2 is staged, readers still see p1's consistent data.
    assert storage.read_parquet(storage.published_file(out, "t.parquet")).num_rows == 1
    p2.publish()
    assert storage.read_manifest(out)["config"] == {"a": 2}
    assert storage.read_parquet(storage.published_file(out, "t.parquet")).num_rows == 2


def test_missing_uri_errors(store_root):
    with pytest.raises(StorageError, match="not found"):
        storage.read_bytes(storage.join(store_root, "does-not-exist.json"))
    with pytest.raises(NotPublishedError, match="does not exist"):
        storage.read_manifest(storage.join(store_root, "no-such-dataset"))


def test_invalid_json_names_position(store_root):
    uri = storage.join(store_root, "bad.json")
    storage.write_bytes(uri, b'{"a": 1,\n "b": }')
    with pytest.raises(StorageError, match=r"bad.json: invalid JSON at line 2"):
        storage.read_json(uri)


def test_unsupported_scheme():
    with pytest.raises(StorageError, match="unsupported URI scheme"):
        storage.resolve("gs://bucket/x")


def test_wrong_s3_credentials_is_a_clear_error(s3_root, s3_server):
    uri = storage.join(s3_root, "secret.txt")
    storage.write_bytes(uri, b"x")
    storage._s3.cache_clear()
    with env_vars({"AWS_SECRET_ACCESS_KEY": "wrong-secret"}):
        with pytest.raises(StorageError) as e:
            storage.read_bytes(uri)
    storage._s3.cache_clear()
    msg = str(e.value)
    assert "secret.txt" in msg and "wrong-secret" not in msg
    assert "denied" in msg or "not found" in msg or "credentials" in msg.lower()


def test_s3_endpoint_parsing():
    with env_vars({"MEMSIFTER_S3_ENDPOINT": "http://127.0.0.1:9000"}):
        s = storage.S3Settings.from_env()
    assert (s.endpoint, s.scheme) == ("127.0.0.1:9000", "http")
    with env_vars({"MEMSIFTER_S3_ENDPOINT": "minio.example:443"}):
        s = storage.S3Settings.from_env()
    assert (s.endpoint, s.scheme) == ("minio.example:443", "https")


def test_transient_errors_are_retried():
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] < 3:
            raise OSError("AWS Error SLOW_DOWN during GetObject: 503 SlowDown")
        return "ok"
    assert storage.retrying(flaky, "s3://b/k") == "ok" and calls["n"] == 3

    def broken():
        raise OSError("AWS Error ACCESS_DENIED during GetObject: 403")
    with pytest.raises(StorageError, match="access denied"):
        storage.retrying(broken, "s3://b/k")


# --------------------------------------------------------------------------- issue 10: keys, publish, reads
@pytest.mark.parametrize("part", ["../x", "a/../../b", "..", "./a", "/etc/passwd", "a/%2F..%2Fb", "a%2fb",
                                  "%2e%2e/x", "a\\..\\b", "a\x00b", "a//b", "q\n1"])
def test_keys_built_from_ids_cannot_leave_their_prefix(part):
    with pytest.raises(StorageError, match="refused"):
        storage.join("s3://bucket/run/out", part)
    with pytest.raises(StorageError, match="refused"):
        storage.Publication("/tmp/never-created-ms", "t", {}, "h", "0").write_bytes(part, b"x")


def test_ordinary_keys_still_join():
    assert storage.join("s3://b/run/", "out", "sub/q-1.parquet", "a.b_c") == "s3://b/run/out/sub/q-1.parquet/a.b_c"
    assert storage.join("/data", "conv-26_session_3/") == "/data/conv-26_session_3"


def test_store_errors_are_classified():
    for msg in ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect to server",
                "AWS Error UNKNOWN (HTTP status 500) during HeadObject operation: No response body.",
                "AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate.",
                "Recv failure: Connection reset by peer"):
        assert storage._transient(OSError(msg)), msg
    for msg in ("AWS Error ACCESS_DENIED during GetObject: 403", "NoSuchBucket"):
        assert not storage._transient(OSError(msg)), msg


def test_retries_are_bounded_by_time_and_name_the_uri(monkeypatch):
    # A new attempt starts only while one more attempt that meets a silent store still fits the budget
    # (issue 30): short S3 timeouts (one SDK call: 1 x (0.1 + 0.1 + 1 s timer slack)) leave room for 3.
    monkeypatch.setenv("MEMSIFTER_STORE_RETRY_SECONDS", "3")
    for k, v in (("MEMSIFTER_S3_CONNECT_TIMEOUT", "0.1"), ("MEMSIFTER_S3_REQUEST_TIMEOUT", "0.1"),
                 ("MEMSIFTER_S3_ATTEMPTS", "1")):
        monkeypatch.setenv(k, v)
    calls = {"n": 0}

    def down():
        calls["n"] += 1
        raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7, Could not connect")
    t0 = __import__("time").time()
    with pytest.raises(StorageError, match=r"s3://b/k: object store unavailable: gave up after 3 attempt\(s\)"):
        storage.retrying(down, "s3://b/k")
    storage._gave_up_at.clear()
    assert calls["n"] == 3 and __import__("time").time() - t0 < 3


def test_publish_journal_rolls_forward_after_a_crash_mid_publish(store_root, monkeypatch):
    out = storage.join(store_root, "j")
    pub = _publication(out)
    pub.inputs = {"input": ["x"]}
    pub.write_table("a.parquet", pa.table({"x": [1]}))
    pub.write_table("b.parquet", pa.table({"x": [2]}))
    moved = {"n": 0}

    def crash_after_first_move(point, **ctx):
        if point == "publish-move":
            moved["n"] += 1
            raise KeyboardInterrupt("simulated kill")   # what SIGKILL leaves behind, in-process
    monkeypatch.setattr(faults, "checkpoint", crash_after_first_move)
    with pytest.raises(KeyboardInterrupt):
        pub.publish()
    monkeypatch.undo()
    with pytest.raises(NotPublishedError):
        storage.read_manifest(out)
    assert storage.roll_forward(out, "test", "other-hash", {"input": ["x"]}) is None   # another config: dropped
    assert not storage.exists(storage.join(out, storage.JOURNAL))


def test_roll_forward_completes_the_same_config(store_root, monkeypatch):
    out = storage.join(store_root, "j2")
    pub = _publication(out)
    pub.write_table("a.parquet", pa.table({"x": [1]}))
    pub.write_table("b.parquet", pa.table({"x": [2]}))
    monkeypatch.setattr(faults, "checkpoint",
                        lambda p, **ctx: (_ for _ in ()).throw(KeyboardInterrupt()) if p == "publish-commit" else None)
    with pytest.raises(KeyboardInterrupt):
        pub.publish()
    monkeypatch.undo()
    m = storage.roll_forward(out, "test", "h1", {})
    assert m is not None and m["attempt"] == pub.attempt and "resumed_publish_at" in m
    assert storage.read_parquet(storage.published_file(out, "b.parquet")).to_pylist() == [{"x": 2}]
    assert storage.list_files(out) == ["_SUCCESS", "a.parquet", "b.parquet"]


def test_reader_of_an_old_manifest_never_gets_new_files(store_root):
    out = storage.join(store_root, "gen")
    p1 = _publication(out)
    p1.write_table("t.parquet", pa.table({"x": [1]}))
    p1.publish()
    storage.read_manifest(out)                       # a reader holds generation 1 ...
    p2 = _publication(out, {"a": 2})
    p2.write_table("t.parquet", pa.table({"x": [1, 2]}))
    fs, root = storage.resolve(out)
    # ... while generation 2's file replaces the old one (publish in progress, seen from outside: the
    # journal is written and the old _SUCCESS removed before the first file moves)
    storage.write_bytes(storage.join(out, storage.JOURNAL), b"{}")
    storage.delete(storage.join(out, storage.MANIFEST))
    storage.write_bytes(storage.join(out, "t.parquet"), storage.parquet_bytes(pa.table({"x": [1, 2]})))
    with pytest.raises(storage.ConcurrentPublishError, match="re-published while it was being read"):
        storage.read_parquet(storage.join(out, "t.parquet"))
    with pytest.raises(storage.ConcurrentPublishError):
        storage.read_bytes(storage.join(out, "t.parquet"))
    p2.publish()
    assert storage.read_parquet(storage.published_file(out, "t.parquet")).num_rows == 2   # fresh manifest


def test_seaweedfs_restarted_on_its_data_dir_keeps_objects(tmp_path):
    """The GPU driver runs train, then resume and collect, in separate calls against one SeaweedFS
    data dir: a restart on a kept dir (new ports, new credentials) must serve what the first stored."""
    from memsifter.testing.servers import seaweedfs, weed_binary

    if not weed_binary():
        pytest.skip("weed binary not installed")
    wd = str(tmp_path / "weed")
    with seaweedfs(workdir=wd) as s3, env_vars(s3.env()):
        storage.ensure_bucket("s3://keep/")
        storage.write_bytes("s3://keep/a/b.txt", b"step 2")
    with seaweedfs(workdir=wd) as s3, env_vars(s3.env()):
        assert storage.read_bytes("s3://keep/a/b.txt") == b"step 2"


def test_seaweedfs_takes_more_buckets_than_free_disk_would_allow(tmp_path):
    """Each bucket is a SeaweedFS collection with volumes of its own; left to itself ``weed mini``
    sizes its volume slots from the free disk (54 slots beside 55 GB free), so a test session that
    makes one bucket per test ran out of them ("no free volumes left") on a machine with a fuller disk.
    The test server sets its own slot count: 120 buckets, each written to, all readable."""
    import boto3

    from memsifter.testing.servers import seaweedfs, weed_binary

    if not weed_binary():
        pytest.skip("weed binary not installed")
    with seaweedfs(workdir=str(tmp_path / "weed")) as s3:
        c = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                         aws_secret_access_key=s3.secret_key, region_name="us-east-1")
        names = [f"many-{i:03d}" for i in range(120)]
        for b in names:
            c.create_bucket(Bucket=b)
            c.put_object(Bucket=b, Key="k", Body=b.encode())
        assert [c.get_object(Bucket=b, Key="k")["Body"].read().decode() for b in names] == names
