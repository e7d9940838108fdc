"""The data model (MEMSIFTER.md §1): a dataset is two parquet tables.

``sessions.parquet``: session_id, content_hash, date, turns (list of {role, content}); one row per
distinct session even when many questions share it.

``questions.parquet``: question_id, dataset, question, answer (string), question_date,
question_type, haystack_session_ids (chronological), haystack_dates (per question: LongMemEval gives
the same filler session different dates in different questions), gold_session_ids, extra (JSON text
of source-specific fields, e.g. ``abstention``, ``adversarial_answer``, ``options``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow as pa

from ..store import storage
from ..errors import InputError

TURN = pa.struct([("role", pa.string()), ("content", pa.string())])
SESSION_SCHEMA = pa.schema([
    ("session_id", pa.string()), ("content_hash", pa.string()), ("date", pa.string()),
    ("turns", pa.list_(TURN)),
])
QUESTION_SCHEMA = pa.schema([
    ("question_id", pa.string()), ("dataset", pa.string()), ("question", pa.string()),
    ("answer", pa.string()), ("question_date", pa.string()), ("question_type", pa.string()),
    ("haystack_session_ids", pa.list_(pa.string())), ("haystack_dates", pa.list_(pa.string())),
    ("gold_session_ids", pa.list_(pa.string())), ("extra", pa.string()),
])
SESSIONS_FILE, QUESTIONS_FILE = "sessions.parquet", "questions.parquet"


@dataclass
class Session:
    session_id: str
    turns: list[dict]          # [{"role": str, "content": str}]
    date: str | None = None
    content_hash: str = ""

    def __post_init__(self) -> None:
        if not self.content_hash:
            self.content_hash = content_hash(self.turns)


@dataclass
class Question:
    question_id: str
    dataset: str
    question: str
    answer: str
    haystack_session_ids: list[str]
    gold_session_ids: list[str]
    question_date: str | None = None
    question_type: str | None = None
    haystack_dates: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def date_of(self, session_id: str, sessions: dict[str, Session]) -> str | None:
        if self.haystack_dates:
            try:
                return self.haystack_dates[self.haystack_session_ids.index(session_id)]
            except ValueError:
                pass
        s = sessions.get(session_id)
        return s.date if s else None

    @property
    def abstention(self) -> bool:
        return bool(self.extra.get("abstention"))


# Text rules for imported data (shared by every importer through DatasetBuilder; see
# tests/test_hostile_input.py for the full table of hostile inputs and their outcomes):
# - any valid Unicode text is kept as it is, byte for byte: tags such as </session>, <ranking>,
#   </think>, braces such as {history}, prompt-injection sentences, control characters, 1 MB turns
#   and empty turn contents are data (session content is not escaped, MEMSIFTER.md §2);
# - text that UTF-8 cannot encode (a lone surrogate such as "\ud800", which JSON escapes can produce)
#   is an InputError naming file, item and field: parquet strings are UTF-8;
# - a role is the tag name of its turns (<R{k}>…</R>): it must be non-empty and hold no '<', '>' or
#   control character (newline included), or the rendering would break; an InputError otherwise.
_BAD_ROLE = re.compile(r"[<>\x00-\x1f\x7f]")


def check_text(value: Any, *, file: str, item: str | None, field: str) -> None:
    """Refuse text that is not valid Unicode (UTF-8 cannot encode it), naming where it is."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"not valid Unicode text: lone surrogate U+{ord(value[e.start]):04X} at character "
                         f"{e.start}", file=file, item=item, field=field) from None


def check_role(role: str, *, file: str, item: str | None, field: str) -> None:
    check_text(role, file=file, item=item, field=field)
    if not role.strip():
        raise InputError("empty role (a role is the tag name of its turns)", file=file, item=item, field=field)
    m = _BAD_ROLE.search(role)
    if m:
        raise InputError(f"role {role[:40]!r} contains {m.group(0)!r} (a role is the tag name of its turns: no "
                         f"'<', '>' or control characters)", file=file, item=item, field=field)


def content_hash(turns: list[dict]) -> str:
    canon = json.dumps([[t["role"], t["content"]] for t in turns], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


@dataclass
class Dataset:
    sessions: dict[str, Session]
    questions: list[Question]

    def question(self, qid: str) -> Question:
        for q in self.questions:
            if q.question_id == qid:
                return q
        raise KeyError(qid)

    def haystack(self, q: Question) -> list[Session]:
        return [self.sessions[s] for s in q.haystack_session_ids]

    # ---- arrow
    def sessions_table(self) -> pa.Table:
        rows = sorted(self.sessions.values(), key=lambda s: s.session_id)
        return pa.table({
            "session_id": [s.session_id for s in rows], "content_hash": [s.content_hash for s in rows],
            "date": [s.date for s in rows],
            "turns": [[{"role": t["role"], "content": t["content"]} for t in s.turns] for s in rows],
        }, schema=SESSION_SCHEMA)

    def questions_table(self) -> pa.Table:
        qs = self.questions
        return pa.table({
            "question_id": [q.question_id for q in qs], "dataset": [q.dataset for q in qs],
            "question": [q.question for q in qs], "answer": [q.answer for q in qs],
            "question_date": [q.question_date for q in qs], "question_type": [q.question_type for q in qs],
            "haystack_session_ids": [q.haystack_session_ids for q in qs],
            "haystack_dates": [q.haystack_dates for q in qs],
            "gold_session_ids": [q.gold_session_ids for q in qs],
            "extra": [json.dumps(q.extra, ensure_ascii=False, sort_keys=True) if q.extra else None for q in qs],
        }, schema=QUESTION_SCHEMA)

    def write(self, out: storage.Publication) -> dict:
        out.write_table(SESSIONS_FILE, self.sessions_table())
        out.write_table(QUESTIONS_FILE, self.questions_table())
        return self.summary()

    def summary(self) -> dict:
        by_ds: dict[str, int] = {}
        by_type: dict[str, int] = {}
        gold = 0
        refs = 0
        for q in self.questions:
            by_ds[q.dataset] = by_ds.get(q.dataset, 0) + 1
            by_type[q.question_type or "-"] = by_type.get(q.question_type or "-", 0) + 1
            gold += len(q.gold_session_ids)
            refs += len(q.haystack_session_ids)
        return {"questions": len(self.questions), "sessions": len(self.sessions),
                "session_references": refs, "gold_sessions": gold,
                "questions_by_dataset": by_ds, "questions_by_type": by_type}


def read_dataset(uri: str) -> Dataset:
    """Load a published dataset (refuses one without a manifest)."""
    st = storage.read_parquet(storage.published_file(uri, SESSIONS_FILE)).to_pylist()
    qt = storage.read_parquet(storage.published_file(uri, QUESTIONS_FILE)).to_pylist()
    sessions = {r["session_id"]: Session(r["session_id"], r["turns"], r["date"], r["content_hash"]) for r in st}
    questions = [Question(
        question_id=r["question_id"], dataset=r["dataset"], question=r["question"], answer=r["answer"],
        haystack_session_ids=r["haystack_session_ids"], gold_session_ids=r["gold_session_ids"],
        question_date=r["question_date"], question_type=r["question_type"],
        haystack_dates=r["haystack_dates"], extra=json.loads(r["extra"]) if r["extra"] else {},
    ) for r in qt]
    return Dataset(sessions, questions)


class DatasetBuilder:
    """Collects sessions and questions from a converter, validating as it goes.

    Sessions are de-duplicated by id + content hash. Two different contents under one id (seen when
    sources reuse ids) are both kept: the later one gets the id ``<id>#<hash8>``, and the question that
    referenced it is rewritten to point to it.
    """

    def __init__(self, file: str):
        self.file = file
        self.sessions: dict[str, Session] = {}
        self.questions: list[Question] = []
        self._qids: set[str] = set()

    def add_session(self, session_id: str, turns: list[dict], date: str | None, *, item: str,
                    field: str = "turns") -> str:
        """``field``: where the session's turns are in the source (``haystack_sessions[3]``), for errors."""
        if not session_id:
            raise InputError("empty session id", file=self.file, item=item, field="session_id")
        check_text(session_id, file=self.file, item=item, field="session_id")
        check_text(date, file=self.file, item=item, field=f"{field} (date)")
        if not turns:
            raise InputError(f"session '{session_id}' has no turns", file=self.file, item=item, field=field)
        clean = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or "role" not in t or "content" not in t:
                raise InputError(f"session '{session_id}' turn {i} needs 'role' and 'content'",
                                 file=self.file, item=item, field=field)
            if not isinstance(t["content"], str):
                raise InputError(f"session '{session_id}' turn {i}: content must be text, got "
                                 f"{type(t['content']).__name__}", file=self.file, item=item,
                                 field=f"{field}[{i}].content")
            role = str(t["role"])
            check_role(role, file=self.file, item=item, field=f"{field}[{i}].role")
            check_text(t["content"], file=self.file, item=item, field=f"{field}[{i}].content")
            clean.append({"role": role, "content": t["content"]})
        h = content_hash(clean)
        existing = self.sessions.get(session_id)
        if existing is None:
            self.sessions[session_id] = Session(session_id, clean, date, h)
            return session_id
        if existing.content_hash == h:
            return session_id
        alt = f"{session_id}#{h[:8]}"
        self.sessions.setdefault(alt, Session(alt, clean, date, h))
        return alt

    def add_question(self, q: Question) -> None:
        item = f"question '{q.question_id}'"
        if not q.question_id:
            raise InputError("empty question id", file=self.file, item=item, field="question_id")
        if q.question_id in self._qids:
            raise InputError("duplicate question id", file=self.file, item=item, field="question_id")
        if not isinstance(q.question, str) or not q.question.strip():
            raise InputError("empty question text", file=self.file, item=item, field="question")
        for name in ("question_id", "dataset", "question", "answer", "question_date", "question_type"):
            check_text(getattr(q, name), file=self.file, item=item, field=name)
        for k, d in enumerate(q.haystack_dates or []):
            check_text(d, file=self.file, item=item, field=f"haystack_dates[{k}]")
        if q.extra:
            check_text(json.dumps(q.extra, ensure_ascii=False), file=self.file, item=item, field="extra")
        if not q.haystack_session_ids:
            raise InputError("empty haystack", file=self.file, item=item, field="haystack_session_ids")
        if len(set(q.haystack_session_ids)) != len(q.haystack_session_ids):
            raise InputError("haystack lists a session twice", file=self.file, item=item,
                             field="haystack_session_ids")
        missing = [s for s in q.haystack_session_ids if s not in self.sessions]
        if missing:
            raise InputError(f"unknown session ids {missing[:3]}", file=self.file, item=item,
                             field="haystack_session_ids")
        hay = set(q.haystack_session_ids)
        bad = [g for g in q.gold_session_ids if g not in hay]
        if bad:
            raise InputError(f"gold session ids {bad[:3]} are not in the haystack", file=self.file,
                             item=item, field="gold_session_ids")
        if q.haystack_dates is not None and len(q.haystack_dates) != len(q.haystack_session_ids):
            raise InputError(f"{len(q.haystack_dates)} dates for {len(q.haystack_session_ids)} sessions",
                             file=self.file, item=item, field="haystack_dates")
        self._qids.add(q.question_id)
        self.questions.append(q)

    def build(self) -> Dataset:
        if not self.questions:
            raise InputError("no questions found", file=self.file)
        used = {s for q in self.questions for s in q.haystack_session_ids}
        return Dataset({k: v for k, v in self.sessions.items() if k in used}, self.questions)


def answer_text(value: Any, *, file: str, item: str, field: str = "answer") -> str:
    """Answers are strings; some sources give ints (kept as their decimal text)."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise InputError(f"answer must be a string or number, got {type(value).__name__}",
                         file=file, item=item, field=field)
    return str(value)


def require(obj: dict, key: str, types: type | tuple, *, file: str, item: str) -> Any:
    if not isinstance(obj, dict):
        raise InputError(f"expected an object, got {type(obj).__name__}", file=file, item=item)
    if key not in obj:
        raise InputError("missing", file=file, item=item, field=key)
    v = obj[key]
    if not isinstance(v, types):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise InputError(f"expected {names}, got {type(v).__name__}", file=file, item=item, field=key)
    return v


def iter_unique(xs: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
