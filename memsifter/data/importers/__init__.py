"""The import formats' readers: raw benchmark files -> a memsifter dataset (MEMSIFTER.md §1, §8); the
stage that runs them is ``import`` (:mod:`memsifter.stages.importer`).

One module per format, whose docstring says how it is read: ``longmemeval`` (:mod:`.longmemeval`),
``locomo`` (:mod:`.locomo`), ``personamem`` (:mod:`.personamem`) and ``memsifter`` (MemSifter-style
parquet, :mod:`.memsifter_parquet`, with :func:`export_memsifter`, which writes that layout). What they
share (reading a source file within the input bounds, JSON parsing with one-line errors, turn checks) is
:mod:`.reading`.

Every converter goes through :class:`~memsifter.data.model.DatasetBuilder` (shared validation);
bad input raises :class:`~memsifter.errors.InputError` naming file, item and field.
"""

from __future__ import annotations

from typing import Any

from .locomo import convert_locomo, normalise_evidence  # noqa: F401 - re-exported
from .longmemeval import convert_longmemeval, longmemeval_name  # noqa: F401 - re-exported
from .memsifter_parquet import convert_memsifter, export_memsifter  # noqa: F401 - re-exported
from .personamem import convert_personamem, personamem_blocks  # noqa: F401 - re-exported

FORMATS = ("longmemeval", "locomo", "personamem", "memsifter")

# The stage's names, here until the last callers outside the stage's area import them from
# memsifter.stages.importer (issue 45 moved the stage there). Found through the stage registry, by the
# stage's name: a library package does not import a stage module.
_STAGE_NAMES = ("ImportConfig", "load", "run")


def __getattr__(name: str) -> Any:
    if name in _STAGE_NAMES:
        import importlib

        from ...stage import get_stage

        return getattr(importlib.import_module(get_stage("import").module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
