"""Stage ``import``: raw benchmark files -> a memsifter dataset (MEMSIFTER.md §1, §8).

Formats (``format`` field; ``source`` and ``questions_file`` are URIs, local or ``s3://``): ``longmemeval``,
``locomo``, ``personamem`` and ``memsifter`` (MemSifter-style parquet). Their readers, one module each,
are :mod:`memsifter.data.importers`; every converter goes through
:class:`~memsifter.data.model.DatasetBuilder` (shared validation), and bad input raises
:class:`~memsifter.errors.InputError` naming file, item and field.
"""

from __future__ import annotations

import logging
from typing import Callable, Literal

from pydantic import Field

from ..data.importers import (FORMATS, convert_locomo, convert_longmemeval, convert_memsifter,
                              convert_personamem)
from ..data.model import Dataset
from ..errors import InputError
from ..stage import StageConfig, stage, uri_field
from ..store import storage

log = logging.getLogger(__name__)


class ImportConfig(StageConfig):
    format: Literal["longmemeval", "locomo", "personamem", "memsifter"] = Field(
        description="source format: longmemeval | locomo | personamem | memsifter")
    source: str = uri_field("source file (json, json.gz, jsonl, parquet; local path or s3://)")
    questions_file: str | None = uri_field("personamem: the questions CSV (source is then the "
                                           "shared-contexts JSONL)", default=None)
    dataset_name: str | None = Field(None, description="value of the 'dataset' column (default: per format)")
    session_messages: int = Field(20, ge=1, description="personamem: messages per session block "
                                                       "(sessions also start at every system message)")
    limit: int | None = Field(None, ge=1, description="keep only the first N questions (and the sessions they "
                                                     "reference): samples, demos, smoke runs")
    on_bad_evidence: Literal["error", "drop"] = Field(
        "drop", description="locomo: an evidence id that cannot be parsed (e.g. 'D') or names a session that "
                            "does not exist is dropped with a warning (recorded in the question's extra and in "
                            "the import summary), or is an error")


def load(config: ImportConfig) -> tuple[Dataset, dict]:
    """Convert without publishing: (dataset, per-format read counts)."""
    converters: dict[str, Callable[[], tuple[Dataset, dict]]] = {
        "longmemeval": lambda: convert_longmemeval(config.source, config.dataset_name),
        "locomo": lambda: convert_locomo(config.source, config.dataset_name, config.on_bad_evidence),
        "personamem": lambda: convert_personamem(config.source, config.questions_file, config.dataset_name,
                                                 config.session_messages),
        "memsifter": lambda: convert_memsifter(config.source, config.dataset_name),
    }
    if config.format not in converters:  # pydantic already refuses it; kept for direct callers
        raise InputError(f"unknown format {config.format!r} (known: {', '.join(FORMATS)})", file=config.source,
                         field="format")
    return converters[config.format]()


@stage("import", ImportConfig, family="chat",
       help="Convert a raw dataset (LongMemEval, LoCoMo, PersonaMem, MemSifter parquet) into a memsifter dataset")
def run(config: ImportConfig, out: storage.Publication) -> dict:
    log.info("import: reading %s (%s)", config.source, config.format)
    if config.questions_file and config.format != "personamem":
        log.warning("import: questions_file is only read for format personamem; ignoring %s", config.questions_file)
    ds, read = load(config)
    if config.limit and len(ds.questions) > config.limit:
        keep = ds.questions[:config.limit]
        used = {s for q in keep for s in q.haystack_session_ids}
        ds = Dataset({k: v for k, v in ds.sessions.items() if k in used}, keep)
        read["limited_to_questions"] = config.limit
    stats = ds.write(out)
    log.info("import: read %s", ", ".join(f"{k}={v}" for k, v in read.items()))
    log.info("import: writing %d questions, %d sessions (%d references, %d gold) to %s", stats["questions"],
             stats["sessions"], stats["session_references"], stats["gold_sessions"], config.output)
    for t, n in sorted(stats["questions_by_type"].items()):
        log.info("import:   %-28s %d", t, n)
    return {**stats, "format": config.format, "source": config.source, "read": read}
