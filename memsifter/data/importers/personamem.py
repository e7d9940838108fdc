"""Import format ``personamem``.

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
"""

from __future__ import annotations

import ast
import csv
import io
import json
import re
import sys
from collections import Counter
from typing import Any

from ...errors import InputError
from ..model import Dataset, DatasetBuilder, Question
from .reading import (_STRICT_DECODER, _fastjson, _huge_int_error, _HugeInt, _json_error_kind, _progress, _read_raw,
                      _text, _too_deep, _turn)

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
