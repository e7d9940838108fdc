"""``memsifter k8s await-published URI``: wait until a stage output is published (its ``_SUCCESS``).

The chart's RayService serves an embed stage's publication. Its head pod runs this as an init container, so the
Ray cluster (and with it the Serve application, which loads the index at start) comes up only once the index
exists: a release installed before, or together with, the run that embeds serves as soon as the embed stage
publishes, instead of failing its replicas until Serve stops retrying. A manifest that is not valid fails at once
(exit 1); an unpublished prefix is polled (a line every ``--log-every`` seconds says what it waits for).
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Callable, Sequence

log = logging.getLogger(__name__)


def await_published(uri: str, poll: float = 15.0, timeout: float = 0.0, log_every: float = 300.0,
                    sleep: Callable[[float], None] = time.sleep) -> dict:
    """The manifest of ``uri`` once it is published; raises TimeoutError after ``timeout`` s (0: never)."""
    from ..errors import NotPublishedError
    from ..store import storage

    start = last = time.monotonic()
    first = True
    while True:
        try:
            manifest = storage.read_manifest(uri)
            log.info("%s is published (stage %s)", uri, manifest.get("stage"))
            return manifest
        except NotPublishedError as e:
            now = time.monotonic()
            if first or now - last >= log_every:
                log.info("waiting for %s/%s: %s", uri.rstrip("/"), storage.MANIFEST, e)
                first, last = False, now
            if timeout and now - start >= timeout:
                raise TimeoutError(f"{uri}: not published after {timeout:.0f}s ({e})") from None
        sleep(poll)


def main(argv: Sequence[str]) -> int:
    from ..errors import MemsifterError

    p = argparse.ArgumentParser(prog="memsifter k8s await-published", description=__doc__.splitlines()[0])
    p.add_argument("uri", help="a stage output (s3:// or a local directory)")
    p.add_argument("--poll", type=float, default=15.0, help="seconds between checks")
    p.add_argument("--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
    p.add_argument("--log-every", type=float, default=300.0, help="seconds between 'waiting' lines")
    args = p.parse_args(argv)
    if args.poll <= 0 or args.timeout < 0:
        p.error("--poll must be > 0 and --timeout >= 0")
    try:
        await_published(args.uri, args.poll, args.timeout, args.log_every)
    except TimeoutError as e:
        print(f"error: {e}")
        return 1
    except MemsifterError as e:
        print(f"error: {e}")
        return e.exit_code
    return 0
