"""The layout of training checkpoints in a store, shared by the stage that writes them (``train``) and
those that read them (``collect``).

``<train output>/checkpoints/global_step_<N>/`` holds verl's files for step N (``actor/…``, ``data.pt``);
``_COMPLETE.json`` in a step directory says every rank's shards of that step are in the store, and
``latest_checkpointed_iteration.txt`` at the root names the last complete step (verl's tracker file).
"""

from __future__ import annotations

import re

from ..store import storage

CHECKPOINTS = "checkpoints"                       # under the train output
COMPLETE_MARKER = "_COMPLETE.json"                # in a step directory, written last
TRACKER = "latest_checkpointed_iteration.txt"     # verl's "last step" file, at the checkpoint root
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_of(name: str) -> int | None:
    """N of a ``global_step_<N>`` directory name, else None."""
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def complete_steps(ckpt_uri: str) -> list[int]:
    """Steps under a checkpoint root that carry the completion marker, ascending."""
    out = []
    for name in storage.list_dirs(ckpt_uri):
        s = step_of(name)
        if s is not None and storage.exists(storage.join(ckpt_uri, name, COMPLETE_MARKER)):
            out.append(s)
    return sorted(out)
