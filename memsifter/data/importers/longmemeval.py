"""Import format ``longmemeval``.

The LongMemEval JSON list (S, M or oracle; ``.json`` or ``.json.gz``). One question per item;
``haystack_dates`` are kept per question (the same filler session carries different dates in
different questions). ``answer_session_ids`` -> gold. ``*_abs`` ids get ``extra.abstention``;
the turn indices flagged ``has_answer`` go to ``extra.answer_turns`` ({session_id: [i, ...]}).
The source order of the haystack is kept (it is chronological by day; times within one day are
sometimes out of order in the source). A session id listed twice in one haystack (seen in the
real data, same content) is kept once, at its first position; the drop is recorded in
``extra.duplicate_haystack_ids`` and in the stats. Dataset name from the file name
(``longmemeval_s`` / ``_m`` / ``_oracle``, default ``longmemeval_s``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ...errors import InputError
from ..model import Dataset, DatasetBuilder, Question, answer_text, require
from .reading import _load_json_list, _opt_str, _progress, _read_raw, _turn

log = logging.getLogger(__name__)


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
