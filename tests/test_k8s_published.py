"""``memsifter k8s await-published``: the RayService's init container waits for the index it serves (issue 46,
item 4), against a real S3 server (SeaweedFS): it returns once the embed stage's ``_SUCCESS`` is written, says what
it waits for, gives up at its timeout, and refuses a manifest that is not valid at once."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from memsifter.k8s import cli, published
from memsifter.store import storage


def _publish(uri: str) -> None:
    pub = storage.Publication(uri, "embed", {"input": "s3://x/in"}, "h1", "0.0")
    pub.write_text("settings.json", "{}")
    pub.publish()


def test_waits_until_the_index_is_published(s3_root, caplog):
    uri = storage.join(s3_root, "embed")
    caplog.set_level(logging.INFO, logger="memsifter.k8s.published")
    t = threading.Timer(1.5, _publish, args=(uri,))
    t0 = time.monotonic()
    t.start()
    try:
        manifest = published.await_published(uri, poll=0.2, timeout=60)
    finally:
        t.join()
    waited = time.monotonic() - t0
    assert manifest["stage"] == "embed" and waited >= 1.4
    assert any(f"waiting for {uri}/_SUCCESS" in r.getMessage() for r in caplog.records)
    # published already: returns at once, through the CLI the init container runs
    t0 = time.monotonic()
    assert cli.main(["await-published", uri, "--poll", "0.2"]) == 0
    assert time.monotonic() - t0 < 10


def test_gives_up_at_its_timeout_and_refuses_a_bad_manifest(s3_root, capsys):
    uri = storage.join(s3_root, "never")
    assert cli.main(["await-published", uri, "--poll", "0.2", "--timeout", "0.5"]) == 1
    assert "not published after" in capsys.readouterr().out
    bad = storage.join(s3_root, "bad")
    storage.write_bytes(storage.join(bad, storage.MANIFEST), b"not json")
    t0 = time.monotonic()
    rc = cli.main(["await-published", bad, "--poll", "0.2", "--timeout", "30"])
    assert rc == 2 and time.monotonic() - t0 < 10, "a bad manifest is refused at once, not waited on"
    assert "manifest" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["await-published", uri, "--poll", "0"])
