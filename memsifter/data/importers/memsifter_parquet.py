"""Import format ``memsifter`` and its exporter.

MemSifter-style parquet, one row per question: the question-table columns plus
``haystack_sessions``, a JSON string holding the sessions aligned with ``haystack_session_ids``
(each a list of ``{role, content}`` turns, or an object with ``turns``). Gold from
``gold_session_ids`` or ``answer_session_ids``. :func:`export_memsifter` writes this layout.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ...store import storage
from ...errors import InputError
from ..model import Dataset, DatasetBuilder, Question, answer_text, read_dataset
from .reading import _opt_str, _progress, _too_large, _turn

log = logging.getLogger(__name__)


def _read_parquet_bytes(uri: str) -> pa.Table:
    cap = int(storage.setting("MEMSIFTER_MAX_INPUT_BYTES"))
    try:
        data = storage.read_bytes(uri, limit=cap)
    except storage.TooLargeError:
        raise _too_large(uri, cap) from None
    try:
        return pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"not a valid parquet file ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                         file=uri) from e


def _str_list(v: Any, *, uri: str, item: str, field: str, required: bool = True) -> list[str] | None:
    if v is None:
        if required:
            raise InputError("missing (null)", file=uri, item=item, field=field)
        return None
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise InputError(f"expected a list, got a string that is not JSON ({e})", file=uri, item=item,
                             field=field) from e
    if not isinstance(v, (list, tuple)):
        raise InputError(f"expected a list, got {type(v).__name__}", file=uri, item=item, field=field)
    out = []
    for k, x in enumerate(v):
        if x is None and not required:
            out.append(None)
            continue
        if not isinstance(x, (str, int)) or isinstance(x, bool):
            raise InputError(f"expected strings, got {x!r}", file=uri, item=item, field=f"{field}[{k}]")
        out.append(str(x))
    return out


def _batch_rows(batch: pa.RecordBatch, uri: str, before: int) -> list[dict]:
    """Rows of a parquet batch; a string that is not valid UTF-8 names its row and column."""
    try:
        return batch.to_pylist()
    except UnicodeDecodeError as e:
        for name, col in zip(batch.schema.names, batch.columns):
            for i in range(len(col)):
                try:
                    col[i].as_py()
                except UnicodeDecodeError as ce:
                    raise InputError(f"not valid UTF-8 text ({ce.reason} at byte {ce.start})", file=uri,
                                     item=f"row {before + i + 1}", field=name) from None
        raise InputError(f"not valid UTF-8 text ({e.reason})", file=uri) from None


def convert_memsifter(uri: str, dataset: str | None = None) -> tuple[Dataset, dict]:
    table = _read_parquet_bytes(uri)
    cols = set(table.column_names)
    for col in ("question_id", "question", "answer", "haystack_session_ids", "haystack_sessions"):
        if col not in cols:
            raise InputError("missing column", file=uri, item="schema", field=col)
    gold_col = next((c for c in ("gold_session_ids", "answer_session_ids") if c in cols), None)
    if gold_col is None:
        raise InputError("missing column (or 'answer_session_ids')", file=uri, item="schema", field="gold_session_ids")
    b = DatasetBuilder(uri)
    rows = 0
    known = {"question_id", "dataset", "question", "answer", "question_date", "question_type", "haystack_session_ids",
             "haystack_dates", "gold_session_ids", "answer_session_ids", "extra", "haystack_sessions"}
    with _progress(total=table.num_rows, desc="memsifter", unit="q") as bar:
        for batch in table.to_batches(max_chunksize=256):
            for r in _batch_rows(batch, uri, rows):
                rows += 1
                bar.update(1)
                item = f"row {rows}"
                qid = r.get("question_id")
                if qid in (None, ""):
                    raise InputError("empty", file=uri, item=item, field="question_id")
                item = f"row {rows} (question '{qid}')"
                sids = _str_list(r["haystack_session_ids"], uri=uri, item=item, field="haystack_session_ids")
                raw = r["haystack_sessions"]
                if isinstance(raw, (bytes, str)):
                    try:
                        sessions = json.loads(raw)
                    except ValueError as e:
                        raise InputError(f"not valid JSON: {e}", file=uri, item=item, field="haystack_sessions") from e
                else:
                    sessions = raw
                if not isinstance(sessions, list) or len(sessions) != len(sids):
                    n = len(sessions) if isinstance(sessions, list) else type(sessions).__name__
                    raise InputError(f"expected a list of {len(sids)} sessions (one per haystack_session_ids), got {n}",
                                     file=uri, item=item, field="haystack_sessions")
                dates = _str_list(r.get("haystack_dates"), uri=uri, item=item, field="haystack_dates", required=False)
                if dates is not None and len(dates) != len(sids):
                    raise InputError(f"{len(dates)} dates for {len(sids)} sessions", file=uri, item=item,
                                     field="haystack_dates")
                idmap: dict[str, str] = {}
                ids = []
                for j, (sid, sess) in enumerate(zip(sids, sessions)):
                    f = f"haystack_sessions[{j}]"
                    date = dates[j] if dates is not None else None
                    if isinstance(sess, dict):
                        date = sess.get("date", date)
                        sess = sess.get("turns")
                    if not isinstance(sess, list) or not sess:
                        raise InputError(f"session '{sid}' is empty or not a list of turns", file=uri, item=item,
                                         field=f)
                    turns = [_turn(t, uri=uri, item=item, field=f"{f}[{k}]") for k, t in enumerate(sess)]
                    real = b.add_session(sid, turns, date, item=item, field=f)
                    idmap[sid] = real
                    ids.append(real)
                gold = []
                for g in _str_list(r[gold_col], uri=uri, item=item, field=gold_col):
                    if g not in idmap:
                        raise InputError(f"gold session id {g!r} is not in haystack_session_ids", file=uri, item=item,
                                         field=gold_col)
                    gold.append(idmap[g])
                extra = r.get("extra")
                if isinstance(extra, str):
                    try:
                        extra = json.loads(extra) if extra else {}
                    except ValueError as e:
                        raise InputError(f"not valid JSON: {e}", file=uri, item=item, field="extra") from e
                extra = dict(extra or {})
                for k in sorted(cols - known):
                    v = r.get(k)
                    if v is not None:
                        extra.setdefault(k, v if isinstance(v, (str, int, float, bool, list, dict)) else str(v))
                ds_name = dataset or r.get("dataset") or "memsifter"
                b.add_question(Question(
                    str(qid), str(ds_name), r["question"], answer_text(r["answer"], file=uri, item=item),
                    ids, gold, question_date=_opt_str(r, "question_date", uri=uri, item=item),
                    question_type=_opt_str(r, "question_type", uri=uri, item=item),
                    haystack_dates=dates, extra=extra))
    ds = b.build()
    return ds, {"rows": rows}


def export_memsifter(src_uri: str, dest_uri: str) -> int:
    """Write a published dataset as MemSifter-style parquet (one row per question); returns the row count.

    Columns: the question table's, plus ``answer_session_ids`` (= ``gold_session_ids``, the original
    code's name) and ``haystack_sessions``: a JSON string, a list of sessions aligned with
    ``haystack_session_ids``, each a list of ``{role, content}`` turns.

    A destination inside a published prefix (one holding ``_SUCCESS`` or ``_PUBLISHING``, the source's
    included) is refused: the file would change a publication behind its manifest; so are control files
    and folders (``_LEASE``, ``_SUCCESS``, ``_PUBLISHING``, ``_staging/``, ``_work/``, ``_run/``) and a
    prefix a run holds (:func:`memsifter.store.storage.check_plain_target`).
    """
    storage.check_plain_target(dest_uri)
    ds = read_dataset(src_uri)
    qt = ds.questions_table()
    hs, dates = [], []
    for q in _progress(ds.questions, desc="export", unit="q"):
        hs.append(json.dumps([ds.sessions[s].turns for s in q.haystack_session_ids], ensure_ascii=False))
        if q.haystack_dates is not None:
            dates.append(q.haystack_dates)
        else:
            d = [ds.sessions[s].date for s in q.haystack_session_ids]
            dates.append(d if any(x is not None for x in d) else None)
    qt = qt.set_column(qt.schema.get_field_index("haystack_dates"), "haystack_dates",
                       pa.array(dates, type=pa.list_(pa.string())))
    qt = qt.append_column("answer_session_ids", qt.column("gold_session_ids"))
    qt = qt.append_column("haystack_sessions", pa.array(hs, type=pa.string()))
    storage.write_bytes(dest_uri, storage.parquet_bytes(qt))
    log.info("exported %d questions (%d sessions) to %s", qt.num_rows, len(ds.sessions), dest_uri)
    return qt.num_rows
