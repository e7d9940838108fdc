"""The supervisor of a detached run (:mod:`memsifter.runs.detached`): runs the command its ``run.json``
names, output to ``driver.log``, and records how it ended. Standard library only: it starts in a moment.

    python -m memsifter.runs._supervise RUN_DIR      # started by `detached start`, not by hand
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def _read(d: str) -> dict:
    try:
        return json.load(open(os.path.join(d, "run.json")))
    except (OSError, ValueError):
        return {}


def _write(d: str, **fields: Any) -> dict:
    doc = {**_read(d), **fields}
    tmp = os.path.join(d, f"run.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, os.path.join(d, "run.json"))
    return doc


def supervise(d: str) -> int:
    """Run the command ``run.json`` names (its output to ``driver.log``) and record how it ended."""
    doc = _read(d)
    stopped = []

    def on_term(signum: int, frame: object) -> None:  # `stop` signals the whole group: the command ends too
        stopped.append(signum)

    signal.signal(signal.SIGTERM, on_term)
    with open(os.path.join(d, "driver.log"), "ab") as log:
        try:
            child = subprocess.Popen(doc["argv"], cwd=doc["cwd"], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **doc.get("env", {})})
        except OSError as e:
            log.write(f"detached: cannot start {doc['argv'][0]}: {e}\n".encode())
            _write(d, state="failed", rc=127, ended=time.time())
            return 127
        _write(d, state="running", command_pid=child.pid)
        rc = child.wait()
    state = "stopped" if stopped else ("done" if rc == 0 else "failed")
    _write(d, state=state, rc=rc, ended=time.time())
    return rc


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1]))
