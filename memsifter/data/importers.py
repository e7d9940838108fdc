"""Stage ``import``: raw benchmark files -> a memsifter dataset (MEMSIFTER.md §1, §8).

Formats (``format`` field; ``source`` and ``questions_file`` are URIs, local or ``s3://``):

``longmemeval``
    The LongMemEval JSON list (S, M or oracle; ``.json`` or ``.json.gz``). One question per item;
    ``haystack_dates`` are kept per question (the same filler session carries different dates in
    different questions). ``answer_session_ids`` -> gold. ``*_abs`` ids get ``extra.abstention``;
    the turn indices flagged ``has_answer`` go to ``extra.answer_turns`` ({session_id: [i, ...]}).
    The source order of the haystack is kept (it is chronological by day; times within one day are
    sometimes out of order in the source). A session id listed twice in one haystack (seen in the
    real data, same content) is kept once, at its first position; the drop is recorded in
    ``extra.duplicate_haystack_ids`` and in the stats. Dataset name from the file name
    (``longmemeval_s`` / ``_m`` / ``_oracle``, default ``longmemeval_s``).

``locomo``
    ``locomo10.json``. Session ``{sample_id}_session_{N}`` per ``session_N`` (date keys without a
    session are skipped); role = speaker name; an image turn's content gets
    `` [shares image: {blip_caption}]``. Every QA becomes question ``{sample_id}_q{idx}`` whose
    haystack is all sessions of its conversation in N order. Gold = the sessions named by the
    evidence dia_ids, after normalising malformed ids (``"D8:6; D9:17"`` -> two ids, ``"D:11:26"``
    -> ``D11:26``, ``"D30:05"`` -> ``D30:5``). Decisions: by default (``on_bad_evidence: drop``, as the
    official file needs) a token that cannot be parsed (``"D"``) or an id whose *session* does not
    exist is dropped with a warning naming conversation, QA and value, recorded in the question's
    ``extra.evidence_dropped`` and in the import summary (``on_bad_evidence: error`` stops); an id whose
    session exists but whose turn does not is recoverable (the gold unit is the session): kept, with
    a warning and ``extra.evidence_unresolved_turns``; an empty evidence string is skipped.
    Category 5 (adversarial) QAs without ``answer`` are kept with ``answer`` = ``adversarial_answer``
    (or ``""``) and ``extra`` ``{"adversarial": true, "no_answer": true}``.

``personamem``
    ``source`` = ``shared_contexts_*.jsonl`` (each line ``{context_id: [messages]}``; also accepted:
    ``{"shared_context_id": id, "messages": [...]}``), ``questions_file`` = ``questions_*.csv``.
    Session rule: a shared context is cut into sessions at every ``system`` message and every
    ``session_messages`` messages (default 20), counted from the start of the context, so all
    questions on one context share the same sessions ``{context_id}_s{k}``. A question's haystack is
    the sessions covering messages ``[0, end_index_in_shared_context)``; a session cut by that end is
    truncated and stored as ``{context_id}_s{k}_upto{end}`` (no message after the question leaks in).
    Gold: PersonaMem v1 has no per-question evidence index (only ``distance_to_ref_*``, kept in
    ``extra``), so gold is empty unless the CSV has ``gold_session_indices`` (indices into the
    question's haystack) or ``gold_turn_indices`` (message indices in the shared context, mapped to
    their sessions); such questions get ``extra.no_gold``. The question text is ``question`` or
    ``user_question_or_message``; ``answer`` is the text of the correct option (``correct_answer`` =
    ``(c)`` resolved against ``all_options``), with the letter and options in ``extra``; every other
    column is kept in ``extra``.

``memsifter``
    MemSifter-style parquet, one row per question: the question-table columns plus
    ``haystack_sessions``, a JSON string holding the sessions aligned with ``haystack_session_ids``
    (each a list of ``{role, content}`` turns, or an object with ``turns``). Gold from
    ``gold_session_ids`` or ``answer_session_ids``. :func:`export_memsifter` writes this layout.

Every converter goes through :class:`~memsifter.data.model.DatasetBuilder` (shared validation);
bad input raises :class:`~memsifter.errors.InputError` naming file, item and field.

Bounds: a source file is read up to ``MEMSIFTER_MAX_INPUT_BYTES`` (default 4 GiB) *after
decompression* (``.gz`` by extension or by magic bytes; counted while inflating, so a small file that
inflates without bound stops early with one line naming the file; streamed into one buffer, never held
twice); JSON nested deeper than the parser allows (orjson: 1024 levels) is one line naming the file,
never a RecursionError; an integer literal over Python's 4300-digit limit is one line naming file, item
and field; a turn (message) over ``MEMSIFTER_MAX_TURN_BYTES`` (default 1 MiB of UTF-8) stops the import
with one line naming file, item and field (:func:`check_turn_size`).
"""

from __future__ import annotations

import ast
import csv
import gzip
import io
import json
import logging
import re
import sys
import zlib
from collections import Counter
from typing import Any, Callable, Literal

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import Field
from tqdm import tqdm

from .. import storage
from ..errors import InputError, StorageError
from ..stage import StageConfig, stage, uri_field
from .model import (Dataset, DatasetBuilder, Question, answer_text, check_role, check_text, read_dataset,
                    require)

try:  # ~3x faster on the 270 MB LongMemEval_S file; the stdlib is the fallback
    import orjson as _fastjson
except ImportError:  # pragma: no cover - depends on the installation
    _fastjson = None

log = logging.getLogger(__name__)

FORMATS = ("longmemeval", "locomo", "personamem", "memsifter")
LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


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


# --------------------------------------------------------------------------- reading
def _progress(it=None, **kw):
    return tqdm(it, disable=None, mininterval=1.0, **kw)


def _too_large(uri: str, cap: int) -> InputError:
    return InputError(f"more than {cap} bytes after decompression: over the input size cap "
                      f"(MEMSIFTER_MAX_INPUT_BYTES={cap}); raise it if this file is meant to be that large",
                      file=uri)


_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"


def _read_raw(uri: str) -> bytearray:
    """A source file's bytes, gunzipped, at most ``MEMSIFTER_MAX_INPUT_BYTES`` of them.

    Streamed: the file is read (decompressed by pyarrow by extension, ``.gz``/``.bz2``/``.zst``, then
    gunzipped when what it reads starts with the gzip magic bytes) in 1 MiB chunks into one buffer,
    which is all that is held; the cap is checked after each chunk, so a small file that inflates
    without bound stops early, and nothing is buffered twice (no list of chunks joined at the end, no
    compressed copy next to the decompressed one)."""
    cap = int(storage.setting("MEMSIFTER_MAX_INPUT_BYTES"))
    fs, path = storage.resolve(uri)

    def _read() -> bytearray:
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(path)
        if info.type == pafs.FileType.Directory:
            raise StorageError(f"{uri}: is a directory, expected a file")
        buf = bytearray()
        with fs.open_input_stream(path) as raw:   # pyarrow inflates *.gz/*.bz2/*.zst by extension
            first = raw.read(_CHUNK)
            while 0 < len(first) < 2:   # a stream may answer short reads: the magic needs 2 bytes
                more = raw.read(_CHUNK)
                if not more:
                    break
                first += more
            try:
                if first[:2] == _GZIP_MAGIC:
                    with gzip.GzipFile(fileobj=_Prepended(first, raw)) as f:
                        _fill(buf, f, cap, uri)
                else:
                    buf += first
                    if len(buf) > cap:
                        raise _too_large(uri, cap)
                    _fill(buf, raw, cap, uri)
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise InputError(f"not a valid gzip file ({e})", file=uri) from e
        return buf
    return storage.retrying(_read, uri)


class _Prepended:
    """A read-only stream: ``head`` (already read) then the rest of ``rest``."""

    def __init__(self, head: bytes, rest: Any):
        self._head, self._rest = head, rest

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n is None or n < 0:
                out, self._head = self._head + self._rest.read(), b""
                return out
            out, self._head = self._head[:n], self._head[n:]
            return out
        return self._rest.read() if n is None or n < 0 else self._rest.read(n)


def _fill(buf: bytearray, f: Any, cap: int, uri: str) -> None:
    while chunk := f.read(_CHUNK):
        if len(buf) + len(chunk) > cap:
            raise _too_large(uri, cap)
        buf += chunk


_MAX_INT_DIGITS = 4300   # Python's int <-> str limit (sys.get_int_max_str_digits)


class _HugeInt(Exception):
    """An integer literal longer than Python converts (raised by :func:`_parse_int`)."""

    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _MAX_INT_DIGITS:
        raise _HugeInt(digits)
    return int(text)


_STRICT_DECODER = json.JSONDecoder(parse_int=_parse_int)


def _huge_int_error(text: str, uri: str, *, what: str | None, id_key: str, digits: int,
                    item: str | None = None) -> InputError:
    """One line for an integer of more than 4300 digits: the file, the list item that holds it (for a
    JSON list of ``what``) and the key whose value it is."""
    m = re.search(r'"((?:[^"\\]|\\.){0,200})"\s*:\s*-?\d{%d,}' % (_MAX_INT_DIGITS + 1), text)
    field = m.group(1) if m else None
    if item is None and what:
        pos = m.start() if m else -1
        item = _list_item_at(text, pos, what, id_key) if pos >= 0 else None
    return InputError(f"an integer of {digits} digits (more than {_MAX_INT_DIGITS}): too long to read; write "
                      f"ids as strings", file=uri, item=item, field=field)


def _list_item_at(text: str, pos: int, what: str, id_key: str) -> str | None:
    """``"{what} #i ('id')"``: the item of the JSON list ``text`` that spans character ``pos``."""
    i = _WS.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        return None
    i = _WS.match(text, i + 1).end()
    idx = 0
    while i < len(text):
        start = i
        try:
            obj, i = _STRICT_DECODER.raw_decode(text, i)
        except _HugeInt:
            obj, i = None, len(text)
        except ValueError:
            return None
        if start <= pos < i:
            ident = obj.get(id_key) if isinstance(obj, dict) else _guess_id(text, start, len(text), id_key)
            return f"{what} #{idx}" + (f" ('{ident}')" if ident not in (None, "") else "")
        i = _WS.match(text, i).end()
        if i >= len(text) or text[i] != ",":
            return None
        i = _WS.match(text, i + 1).end()
        idx += 1
    return None


def _too_deep(uri: str, item: str | None = None) -> InputError:
    return InputError("JSON nested too deeply to parse (more than 1024 levels)", file=uri, item=item)


def _text(data: bytes, uri: str, *, what: str | None = None, id_key: str = "") -> str:
    """UTF-8 text of a source file; bytes that are not UTF-8 are an error naming byte, line and, for a
    JSON list of ``what`` items, the item that holds them."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        item = _item_at(data, e.start, what, id_key) if what else None
        raise InputError(f"not UTF-8 text (byte {e.start}, line {line}: {e.reason})", file=uri, item=item) from None


def _item_at(data: bytes, byte: int, what: str, id_key: str) -> str | None:
    """Which item of a JSON list holds byte ``byte`` (the file decoded with replacement characters)."""
    text = data.decode("utf-8-sig", errors="replace")
    pos = len(data[:byte].decode("utf-8-sig", errors="replace"))
    dec = _STRICT_DECODER
    i = _WS.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        return None
    i = _WS.match(text, i + 1).end()
    idx = 0
    while i < len(text):
        start = i
        try:
            obj, i = dec.raw_decode(text, i)
        except (ValueError, _HugeInt):
            return None
        if start <= pos < i:
            ident = obj.get(id_key) if isinstance(obj, dict) else None
            return f"{what} #{idx}" + (f" ('{ident}')" if ident not in (None, "") else "")
        i = _WS.match(text, i).end()
        if i >= len(text) or text[i] != ",":
            return None
        i = _WS.match(text, i + 1).end()
        idx += 1
    return None


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


_WS = re.compile(r"[ \t\n\r]*")


def _guess_id(text: str, start: int, end: int, key: str) -> str | None:
    m = re.search(r'"%s"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)' % re.escape(key), text[start:min(end, start + 1_000_000)])
    if not m:
        return None
    try:
        return str(json.loads(m.group(1)))
    except ValueError:
        return None


def _json_error_kind(e: json.JSONDecodeError, n: int) -> str:
    # JSON strings cannot hold raw newlines, so an unterminated string ran into the end of the text.
    return "truncated JSON" if e.pos >= n or e.msg.startswith("Unterminated string") else "invalid JSON"


def _load_json_list(data: bytes, uri: str, *, what: str, id_key: str) -> list:
    """Parse a JSON list; on failure, name the list item (number and id) and line/column."""
    try:
        obj = _fastjson.loads(data) if _fastjson is not None else json.loads(data)
    except RecursionError:
        raise _too_deep(uri) from None
    except ValueError as e:
        if "recursion" in str(e).lower():   # orjson's depth limit
            raise _too_deep(uri) from None
        text = _text(data, uri, what=what, id_key=id_key)
        try:  # what orjson refuses (a BOM, huge integers) the stdlib may still read
            obj = _STRICT_DECODER.decode(text)
        except RecursionError:
            raise _too_deep(uri) from None
        except _HugeInt as e:
            raise _huge_int_error(text, uri, what=what, id_key=id_key, digits=e.digits) from None
        except ValueError:
            try:
                _locate_json_error(text, uri, what=what, id_key=id_key)
            except RecursionError:
                raise _too_deep(uri) from None
            raise AssertionError("unreachable")  # _locate_json_error always raises here
    if not isinstance(obj, list):
        raise InputError(f"expected a JSON list of {what}s, got {type(obj).__name__}", file=uri)
    return obj


def _locate_json_error(text: str, uri: str, *, what: str, id_key: str) -> None:
    """Re-parse item by item with the stdlib decoder to say where the JSON is broken."""
    dec = _STRICT_DECODER
    n = len(text)
    pos = _WS.match(text, 0).end()
    if pos >= n:
        raise InputError("empty file (no JSON)", file=uri)
    if text[pos] != "[":
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", file=uri) from e
        raise InputError(f"expected a JSON list of {what}s", file=uri)
    pos = _WS.match(text, pos + 1).end()
    idx = 0
    if pos < n and text[pos] == "]":
        pos += 1
    else:
        while True:
            start = pos
            try:
                obj, pos = dec.raw_decode(text, pos)
            except _HugeInt as e:
                raise _huge_int_error(text, uri, what=what, id_key=id_key, digits=e.digits) from None
            except json.JSONDecodeError as e:
                ident = _guess_id(text, start, e.pos, id_key)
                item = f"{what} #{idx}" + (f" ('{ident}')" if ident else "")
                kind = _json_error_kind(e, n)
                raise InputError(f"{kind} at line {e.lineno} column {e.colno}: {e.msg}", file=uri,
                                 item=item) from e
            ident = obj.get(id_key) if isinstance(obj, dict) else None
            pos = _WS.match(text, pos).end()
            if pos >= n:
                line, col = _line_col(text, pos)
                raise InputError(f"truncated JSON at line {line} column {col}: the list ends without ']' "
                                 f"after {what} #{idx}" + (f" ('{ident}')" if ident else ""), file=uri)
            if text[pos] == ",":
                pos = _WS.match(text, pos + 1).end()
                idx += 1
                continue
            if text[pos] == "]":
                pos += 1
                break
            line, col = _line_col(text, pos)
            raise InputError(f"invalid JSON at line {line} column {col}: expected ',' or ']' after this "
                             f"{what}", file=uri, item=f"{what} #{idx}" + (f" ('{ident}')" if ident else ""))
    pos = _WS.match(text, pos).end()
    if pos < n:
        line, col = _line_col(text, pos)
        raise InputError(f"invalid JSON at line {line} column {col}: extra data after the list", file=uri)
    raise InputError("invalid JSON", file=uri)  # the fast parser refused what the stdlib accepts


def _turn(t: Any, *, uri: str, item: str, field: str) -> dict:
    if not isinstance(t, dict):
        raise InputError(f"a turn must be an object, got {type(t).__name__}", file=uri, item=item, field=field)
    for k in ("role", "content"):
        if k not in t:
            raise InputError("missing", file=uri, item=item, field=f"{field}.{k}")
        if not isinstance(t[k], str):
            raise InputError(f"expected str, got {type(t[k]).__name__}", file=uri, item=item,
                             field=f"{field}.{k}")
    check_role(t["role"], file=uri, item=item, field=f"{field}.role")
    check_text(t["content"], file=uri, item=item, field=f"{field}.content")
    check_turn_size(t["content"], file=uri, item=item, field=f"{field}.content")
    return {"role": t["role"], "content": t["content"]}


def check_turn_size(text: str, *, file: str, item: str | None, field: str) -> None:
    """Refuse a turn longer than ``MEMSIFTER_MAX_TURN_BYTES`` (UTF-8 bytes, default 1 MiB) at import:
    a 50 MB message would otherwise pass the import and blow up rendering and ranking later."""
    cap = int(storage.setting("MEMSIFTER_MAX_TURN_BYTES"))
    if len(text) * 4 <= cap:   # no UTF-8 character is longer than 4 bytes: surely under the cap
        return
    n = len(text.encode("utf-8", errors="surrogatepass"))
    if n > cap:
        raise InputError(f"a turn of {n} bytes: over the per-turn cap (MEMSIFTER_MAX_TURN_BYTES={cap}); raise it "
                         f"if turns this long are meant to be there", file=file, item=item, field=field)


def _opt_str(obj: dict, key: str, *, uri: str, item: str) -> str | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise InputError(f"expected str, got {type(v).__name__}", file=uri, item=item, field=key)
    return str(v)


# --------------------------------------------------------------------------- LongMemEval
def longmemeval_name(uri: str) -> str:
    base = uri.rstrip("/").rsplit("/", 1)[-1].lower()
    m = re.search(r"(?:^|[^a-z])(s|m|oracle)(?:[^a-z]|$)", base.replace("longmemeval", ""))
    return f"longmemeval_{m.group(1)}" if m else "longmemeval_s"


def convert_longmemeval(uri: str, dataset: str | None = None) -> tuple[Dataset, dict]:
    items = _load_json_list(_read_raw(uri), uri, what="question", id_key="question_id")
    dataset = dataset or longmemeval_name(uri)
    b = DatasetBuilder(uri)
    refs = dup_refs = abstention = 0
    for i, it in enumerate(_progress(items, desc="longmemeval", unit="q")):
        item = f"question #{i}"
        qid = require(it, "question_id", (str, int), file=uri, item=item)
        qid = str(qid)
        item = f"question '{qid}'"
        qtype = _opt_str(it, "question_type", uri=uri, item=item)
        question = require(it, "question", str, file=uri, item=item)
        if "answer" not in it:
            raise InputError("missing", file=uri, item=item, field="answer")
        answer = answer_text(it["answer"], file=uri, item=item)
        qdate = _opt_str(it, "question_date", uri=uri, item=item)
        sids = require(it, "haystack_session_ids", list, file=uri, item=item)
        sessions = require(it, "haystack_sessions", list, file=uri, item=item)
        gold_src = require(it, "answer_session_ids", list, file=uri, item=item)
        dates = it.get("haystack_dates")
        if dates is not None and not isinstance(dates, list):
            raise InputError(f"expected list, got {type(dates).__name__}", file=uri, item=item, field="haystack_dates")
        if len(sessions) != len(sids):
            raise InputError(f"{len(sessions)} sessions for {len(sids)} haystack_session_ids", file=uri,
                             item=item, field="haystack_sessions")
        if dates is not None and len(dates) != len(sids):
            raise InputError(f"{len(dates)} dates for {len(sids)} haystack_session_ids", file=uri, item=item,
                             field="haystack_dates")
        ids: list[str] = []
        qdates: list[str] | None = [] if dates is not None else None
        idmap: dict[str, str] = {}
        dups: list[str] = []
        answer_turns: dict[str, list[int]] = {}
        for j, (sid, sess) in enumerate(zip(sids, sessions)):
            refs += 1
            if not isinstance(sid, str) or not sid:
                raise InputError(f"expected a non-empty string, got {sid!r}", file=uri, item=item,
                                 field=f"haystack_session_ids[{j}]")
            if not isinstance(sess, list):
                raise InputError(f"session '{sid}': expected a list of turns, got {type(sess).__name__}",
                                 file=uri, item=item, field=f"haystack_sessions[{j}]")
            if not sess:
                raise InputError(f"session '{sid}' is empty (no turns)", file=uri, item=item,
                                 field=f"haystack_sessions[{j}]")
            date = dates[j] if dates is not None else None
            if date is not None and not isinstance(date, str):
                raise InputError(f"expected str, got {type(date).__name__}", file=uri, item=item,
                                 field=f"haystack_dates[{j}]")
            if sid in idmap:
                dup_refs += 1
                dups.append(sid)
                continue
            turns = [_turn(t, uri=uri, item=item, field=f"haystack_sessions[{j}][{k}]") for k, t in enumerate(sess)]
            flagged = [k for k, t in enumerate(sess) if t.get("has_answer")]
            real = b.add_session(sid, turns, date, item=item, field=f"haystack_sessions[{j}]")
            idmap[sid] = real
            ids.append(real)
            if qdates is not None:
                qdates.append(date)
            if flagged:
                answer_turns[real] = flagged
        gold: list[str] = []
        for k, g in enumerate(gold_src):
            if g not in idmap:
                raise InputError(f"answer session id {g!r} is not in haystack_session_ids", file=uri, item=item,
                                 field="answer_session_ids")
            if idmap[g] not in gold:
                gold.append(idmap[g])
        extra: dict[str, Any] = {}
        if qid.endswith("_abs"):
            extra["abstention"] = True
            abstention += 1
        if answer_turns:
            extra["answer_turns"] = answer_turns
        if dups:
            extra["duplicate_haystack_ids"] = dups
            log.warning("%s: %s: session ids listed twice in the haystack, kept once: %s", uri, item, dups)
        b.add_question(Question(qid, dataset, question, answer, ids, gold, question_date=qdate,
                                question_type=qtype, haystack_dates=qdates, extra=extra))
    ds = b.build()
    return ds, {"items": len(items), "session_references_in_source": refs,
                "duplicate_haystack_references_dropped": dup_refs, "abstention_questions": abstention}


# --------------------------------------------------------------------------- LoCoMo
_EVIDENCE = re.compile(r"D:?(\d+):(\d+)", re.IGNORECASE)


def normalise_evidence(raw: str) -> tuple[list[tuple[int, int]], list[str]]:
    """``"D8:6; D9:17"`` -> [(8, 6), (9, 17)]; ``"D:11:26"`` -> (11, 26); ``"D30:05"`` -> (30, 5).

    Returns the parsed (session, turn) pairs and the tokens that could not be parsed.
    """
    pairs, bad = [], []
    for tok in re.split(r"[;,\s]+", raw):
        tok = tok.strip().strip(".:")
        if not tok:
            continue
        m = _EVIDENCE.fullmatch(tok)
        if m:
            pairs.append((int(m.group(1)), int(m.group(2))))
        else:
            bad.append(tok)
    return pairs, bad


def convert_locomo(uri: str, dataset: str | None = None, on_bad_evidence: str = "drop") -> tuple[Dataset, dict]:
    convs = _load_json_list(_read_raw(uri), uri, what="conversation", id_key="sample_id")
    dataset = dataset or "locomo"
    b = DatasetBuilder(uri)
    st: Counter = Counter()
    examples: list[dict] = []  # dropped evidence values, for the import summary (first 20)
    for ci, conv in enumerate(_progress(convs, desc="locomo", unit="conv")):
        citem = f"conversation #{ci}"
        if not isinstance(conv, dict):
            raise InputError(f"expected an object, got {type(conv).__name__}", file=uri, item=citem)
        sample = conv.get("sample_id")
        sample = str(sample) if sample not in (None, "") else f"conv{ci}"
        citem = f"conversation '{sample}'"
        c = require(conv, "conversation", dict, file=uri, item=citem)
        numbers = sorted(int(m.group(1)) for k in c if (m := re.fullmatch(r"session_(\d+)", k)))
        if not numbers:
            raise InputError("no session_N keys", file=uri, item=citem, field="conversation")
        hay, dates = [], []
        turns_of: dict[int, set[int]] = {}
        sid_of: dict[int, str] = {}
        for n in numbers:
            key = f"session_{n}"
            sess = c[key]
            if not isinstance(sess, list):
                raise InputError(f"expected a list of turns, got {type(sess).__name__}", file=uri, item=citem,
                                 field=f"conversation.{key}")
            if not sess:
                raise InputError("session is empty (no turns)", file=uri, item=citem, field=f"conversation.{key}")
            turns, dia = [], set()
            for k, t in enumerate(sess):
                f = f"conversation.{key}[{k}]"
                if not isinstance(t, dict):
                    raise InputError(f"a turn must be an object, got {type(t).__name__}", file=uri, item=citem, field=f)
                for name in ("speaker", "text"):
                    if name not in t:
                        raise InputError("missing", file=uri, item=citem, field=f"{f}.{name}")
                    if not isinstance(t[name], str):
                        raise InputError(f"expected str, got {type(t[name]).__name__}", file=uri, item=citem,
                                         field=f"{f}.{name}")
                speaker, text = t["speaker"], t["text"]
                check_role(speaker, file=uri, item=citem, field=f"{f}.speaker")
                check_text(text, file=uri, item=citem, field=f"{f}.text")
                if t.get("blip_caption"):
                    text = f"{text} [shares image: {t['blip_caption']}]"
                    st["image_turns"] += 1
                check_turn_size(text, file=uri, item=citem, field=f"{f}.text")
                turns.append({"role": speaker, "content": text})
                pairs, _ = normalise_evidence(str(t.get("dia_id", "")))
                dia.update(tt for ss, tt in pairs if ss == n)
            date = c.get(f"{key}_date_time")
            date = str(date) if date not in (None, "") else None
            sid = b.add_session(f"{sample}_session_{n}", turns, date, item=citem, field=f"conversation.{key}")
            hay.append(sid)
            dates.append(date)
            turns_of[n], sid_of[n] = dia, sid
            st["sessions"] += 1
            st["turns"] += len(turns)
        st["date_keys_without_session"] += sum(
            1 for k in c if (m := re.fullmatch(r"session_(\d+)_date_time", k)) and f"session_{m.group(1)}" not in c)
        qas = require(conv, "qa", list, file=uri, item=citem)
        for qi, qa in enumerate(qas):
            qitem = f"{citem} qa #{qi}"
            question = require(qa, "question", str, file=uri, item=qitem)
            category = require(qa, "category", (int, str), file=uri, item=qitem)
            try:
                category = int(category)
            except ValueError as e:
                raise InputError(f"expected an integer category, got {category!r}", file=uri, item=qitem,
                                 field="category") from e
            extra: dict[str, Any] = {"category": category}
            if "answer" in qa and qa["answer"] is not None:
                answer = answer_text(qa["answer"], file=uri, item=qitem)
            elif category == 5:
                adv = qa.get("adversarial_answer")
                answer = answer_text(adv, file=uri, item=qitem, field="adversarial_answer") if adv is not None else ""
                extra.update(adversarial=True, no_answer=True)
                st["adversarial_without_answer"] += 1
            else:
                raise InputError("missing", file=uri, item=qitem, field="answer")
            if category == 5:
                extra["adversarial"] = True
            if qa.get("adversarial_answer") is not None:
                extra["adversarial_answer"] = str(qa["adversarial_answer"])
            evidence = qa.get("evidence", [])
            if not isinstance(evidence, list):
                raise InputError(f"expected list, got {type(evidence).__name__}", file=uri, item=qitem,
                                 field="evidence")
            gold_n: list[int] = []
            ids, dropped, unresolved = [], [], []
            for ei, raw in enumerate(evidence):
                if not isinstance(raw, str):
                    raise InputError(f"expected a dia_id string, got {raw!r}", file=uri, item=qitem,
                                     field=f"evidence[{ei}]")
                pairs, bad = normalise_evidence(raw)
                if bad:
                    if on_bad_evidence != "drop":
                        raise InputError(f"malformed dia_id {bad[0]!r} in {raw!r}", file=uri, item=qitem,
                                         field=f"evidence[{ei}]")
                    # parse what can be parsed ('D8:6 D' keeps D8:6), drop the rest, say so
                    for tok in bad:
                        dropped.append(tok)
                        log.warning("%s: %s: evidence[%d]: malformed dia_id %r in %r: dropped", uri, qitem, ei,
                                    tok, raw)
                        if len(examples) < 20:
                            examples.append({"item": qitem, "value": raw, "dropped": tok})
                if len(pairs) != 1 or raw.strip() != f"D{pairs[0][0]}:{pairs[0][1]}":
                    st["evidence_ids_normalised"] += 1
                for sn, tn in pairs:
                    norm = f"D{sn}:{tn}"
                    if sn not in sid_of:
                        if on_bad_evidence == "drop":
                            dropped.append(norm)
                            log.warning("%s: %s: evidence %s names session %d, which does not exist: dropped",
                                        uri, qitem, norm, sn)
                            if len(examples) < 20:
                                examples.append({"item": qitem, "value": raw,
                                                                        "dropped": norm})
                            continue
                        raise InputError(f"evidence {raw!r} names session {sn}, which does not exist "
                                         f"(sessions: {numbers[0]}..{numbers[-1]})", file=uri, item=qitem,
                                         field=f"evidence[{ei}]")
                    if tn not in turns_of[sn]:
                        unresolved.append(norm)
                        log.warning("%s: %s: evidence %s: session %d has no turn %d; keeping the session as gold",
                                    uri, qitem, norm, sn, tn)
                    ids.append(norm)
                    if sn not in gold_n:
                        gold_n.append(sn)
            if ids:
                extra["evidence"] = ids
            if dropped:
                extra["evidence_dropped"] = dropped
                st["evidence_ids_dropped"] += len(dropped)
            if unresolved:
                extra["evidence_unresolved_turns"] = unresolved
                st["evidence_ids_unresolved_turn"] += len(unresolved)
            if not gold_n:
                extra["no_evidence"] = True
                st["qa_without_evidence"] += 1
            gold = [sid_of[n] for n in numbers if n in gold_n]
            b.add_question(Question(f"{sample}_q{qi}", dataset, question, answer, list(hay), gold,
                                    question_type=LOCOMO_CATEGORIES.get(category, f"category-{category}"),
                                    haystack_dates=list(dates), extra=extra))
            st["qa"] += 1
    ds = b.build()
    out = {"conversations": len(convs), **dict(sorted(st.items()))}
    if examples:
        out["evidence_dropped_examples"] = examples
    return ds, out


# --------------------------------------------------------------------------- PersonaMem
_PM_QUESTION_COLS = ("question", "user_question_or_message")
_PM_USED = {"question_id", "question", "user_question_or_message", "correct_answer", "all_options",
            "shared_context_id", "end_index_in_shared_context", "question_type", "gold_session_indices",
            "gold_turn_indices"}


def _parse_int_list(raw: Any, *, uri: str, item: str, field: str) -> list[int]:
    if isinstance(raw, list):
        vals = raw
    else:
        s = str(raw).strip()
        if not s:
            return []
        try:
            vals = json.loads(s)
        except ValueError:
            try:
                vals = ast.literal_eval(s)
            except (ValueError, SyntaxError):
                vals = [v for v in re.split(r"[;,\s]+", s.strip("[]()")) if v]
        if not isinstance(vals, (list, tuple)):
            vals = [vals]
    try:
        return [int(v) for v in vals]
    except (TypeError, ValueError) as e:
        raise InputError(f"expected a list of integers, got {raw!r}", file=uri, item=item, field=field) from e


def _load_personamem_contexts(uri: str) -> dict[str, list[dict]]:
    text = _text(_read_raw(uri), uri)
    contexts: dict[str, list[dict]] = {}
    for ln, line in enumerate(_progress(text.splitlines(), desc="personamem contexts", unit="line"), start=1):
        if not line.strip():
            continue
        item = f"line {ln}"
        try:
            obj = _fastjson.loads(line) if _fastjson is not None else json.loads(line)
        except RecursionError:
            raise _too_deep(uri, item) from None
        except ValueError as e:
            if "recursion" in str(e).lower():
                raise _too_deep(uri, item) from None
            try:
                _STRICT_DECODER.decode(line)
            except RecursionError:
                raise _too_deep(uri, item) from None
            except _HugeInt as e:
                raise _huge_int_error(line, uri, what=None, id_key="", digits=e.digits, item=item) from None
            except json.JSONDecodeError as e:
                kind = _json_error_kind(e, len(line))
                raise InputError(f"{kind} at line {ln} column {e.colno}: {e.msg}", file=uri, item=item) from e
            raise InputError(f"invalid JSON at line {ln}", file=uri, item=item)
        if not isinstance(obj, dict) or not obj:
            raise InputError("expected an object {context_id: [messages]}", file=uri, item=item)
        if "messages" in obj and "shared_context_id" in obj:
            obj = {str(obj["shared_context_id"]): obj["messages"]}
        for cid, msgs in obj.items():
            citem = f"{item} (context '{cid}')"
            if not isinstance(msgs, list):
                raise InputError(f"expected a list of messages, got {type(msgs).__name__}", file=uri, item=citem,
                                 field=cid)
            if not msgs:
                raise InputError("context has no messages", file=uri, item=citem, field=cid)
            if cid in contexts:
                raise InputError("context id appears twice", file=uri, item=citem, field=cid)
            contexts[cid] = [_turn(m, uri=uri, item=citem, field=f"{cid}[{k}]") for k, m in enumerate(msgs)]
    if not contexts:
        raise InputError("no shared contexts found", file=uri)
    return contexts


def personamem_blocks(messages: list[dict], size: int) -> list[tuple[int, int]]:
    """Session boundaries [start, end): at every system message and every ``size`` messages."""
    blocks: list[tuple[int, int]] = []
    start = 0
    for i, m in enumerate(messages):
        if i > start and (m["role"] == "system" or i - start >= size):
            blocks.append((start, i))
            start = i
    blocks.append((start, len(messages)))
    return blocks


def _resolve_option(correct: str, options_raw: str) -> tuple[str | None, list[str] | None]:
    options = None
    s = (options_raw or "").strip()
    if s:
        for parse in (json.loads, ast.literal_eval):
            try:
                v = parse(s)
            except (ValueError, SyntaxError):
                continue
            if isinstance(v, (list, tuple)) and all(isinstance(o, str) for o in v):
                options = list(v)
                break
    m = re.fullmatch(r"\(?\s*([a-zA-Z])\s*\)?", correct.strip())
    if not options or not m:
        return None, options
    letter = m.group(1).lower()
    for o in options:
        om = re.match(r"\s*\(\s*([a-zA-Z])\s*\)\s*", o)
        if om and om.group(1).lower() == letter:
            return o[om.end():].strip(), options
    idx = ord(letter) - ord("a")
    if 0 <= idx < len(options) and not any(re.match(r"\s*\(\s*[a-zA-Z]\s*\)", o) for o in options):
        return options[idx].strip(), options
    return None, options


def convert_personamem(uri: str, questions_uri: str | None, dataset: str | None = None,
                       session_messages: int = 20) -> tuple[Dataset, dict]:
    if not questions_uri:
        raise InputError("personamem needs the questions CSV (questions_file / --questions)", file=uri,
                         field="questions_file")
    contexts = _load_personamem_contexts(uri)
    qtext = _text(_read_raw(questions_uri), questions_uri)
    dataset = dataset or "personamem"
    csv.field_size_limit(sys.maxsize)
    reader = csv.DictReader(io.StringIO(qtext, newline=""))
    try:
        header = reader.fieldnames
    except csv.Error as e:
        raise InputError(f"invalid CSV header: {e}", file=questions_uri, item="header") from e
    if not header:
        raise InputError("empty CSV (no header)", file=questions_uri, item="header")
    qcol = next((c for c in _PM_QUESTION_COLS if c in header), None)
    for col in ("question_id", "correct_answer", "shared_context_id", "end_index_in_shared_context"):
        if col not in header:
            raise InputError("missing column", file=questions_uri, item="header", field=col)
    if qcol is None:
        raise InputError("missing column (or 'user_question_or_message')", file=questions_uri, item="header",
                         field="question")
    blocks = {cid: personamem_blocks(m, session_messages) for cid, m in contexts.items()}
    b = DatasetBuilder(questions_uri)
    st: Counter = Counter()
    rows = 0
    try:
        for row in _progress(reader, desc="personamem questions", unit="q"):
            rows += 1
            item = f"row {rows} (line {reader.line_num})"
            if None in row or any(v is None for v in row.values()):
                raise InputError(f"{len(header)} columns expected", file=questions_uri, item=item)
            qid = row["question_id"].strip()
            if not qid:
                raise InputError("empty", file=questions_uri, item=item, field="question_id")
            item = f"row {rows} (question '{qid}')"
            cid = row["shared_context_id"].strip()
            if cid not in contexts:
                raise InputError(f"shared context {cid!r} is not in {uri}", file=questions_uri, item=item,
                                 field="shared_context_id")
            msgs = contexts[cid]
            try:
                end = int(row["end_index_in_shared_context"].strip())
            except ValueError as e:
                raise InputError(f"expected an integer, got {row['end_index_in_shared_context']!r}",
                                 file=questions_uri, item=item, field="end_index_in_shared_context") from e
            if not 0 < end <= len(msgs):
                raise InputError(f"{end} is outside the shared context (1..{len(msgs)} messages)",
                                 file=questions_uri, item=item, field="end_index_in_shared_context")
            hay: list[str] = []
            spans: list[tuple[int, int]] = []
            for k, (s, e) in enumerate(blocks[cid]):
                if s >= end:
                    break
                if e <= end:
                    sid = b.add_session(f"{cid}_s{k}", msgs[s:e], None, item=item)
                else:
                    sid = b.add_session(f"{cid}_s{k}_upto{end}", msgs[s:end], None, item=item)
                    st["truncated_sessions"] += 1
                hay.append(sid)
                spans.append((s, min(e, end)))
            gold: list[str] = []
            extra: dict[str, Any] = {}
            if (row.get("gold_session_indices") or "").strip():
                for gi in _parse_int_list(row["gold_session_indices"], uri=questions_uri, item=item,
                                          field="gold_session_indices"):
                    if not 0 <= gi < len(hay):
                        raise InputError(f"session index {gi} is outside the haystack (0..{len(hay) - 1})",
                                         file=questions_uri, item=item, field="gold_session_indices")
                    if hay[gi] not in gold:
                        gold.append(hay[gi])
            if (row.get("gold_turn_indices") or "").strip():
                for ti in _parse_int_list(row["gold_turn_indices"], uri=questions_uri, item=item,
                                          field="gold_turn_indices"):
                    if not 0 <= ti < end:
                        raise InputError(f"message index {ti} is not before end_index_in_shared_context ({end})",
                                         file=questions_uri, item=item, field="gold_turn_indices")
                    sid = next(h for h, (s, e) in zip(hay, spans) if s <= ti < e)
                    if sid not in gold:
                        gold.append(sid)
            gold = [h for h in hay if h in gold]  # chronological
            if not gold:
                extra["no_gold"] = True
                st["questions_without_gold"] += 1
            correct = row["correct_answer"].strip()
            text, options = _resolve_option(correct, row.get("all_options", ""))
            if text is None:
                st["answers_not_resolved_to_an_option"] += 1
            extra["correct_option"] = correct
            if options is not None:
                extra["options"] = options
            for k, v in row.items():
                if k not in _PM_USED and k is not None and v not in (None, ""):
                    extra[k] = v
            b.add_question(Question(qid, dataset, row[qcol], text if text is not None else correct, hay, gold,
                                    question_type=(row.get("question_type") or None), haystack_dates=None,
                                    extra=extra))
    except csv.Error as e:
        raise InputError(f"invalid CSV at line {reader.line_num}: {e}", file=questions_uri,
                         item=f"row {rows + 1}") from e
    ds = b.build()
    return ds, {"contexts": len(contexts), "context_messages": sum(len(m) for m in contexts.values()),
                "question_rows": rows, **dict(sorted(st.items()))}


# --------------------------------------------------------------------------- MemSifter parquet
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
    prefix a run holds (:func:`memsifter.storage.check_plain_target`).
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


# --------------------------------------------------------------------------- the stage
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
