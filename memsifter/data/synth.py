"""The ``synth`` stage's module moved to :mod:`memsifter.stages.synth` (issue 45); its names are found
here until the last callers outside the stage's area import them from there. Found through the stage
registry, by the stage's name: a library package does not import a stage module."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    from ..stage import get_stage

    return getattr(importlib.import_module(get_stage("synth").module), name)
