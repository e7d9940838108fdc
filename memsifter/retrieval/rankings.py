"""Rankings: the one table every retrieval stage publishes, and parsing of ranker output.

``rankings.parquet`` has one row per question (:data:`RANKINGS_SCHEMA`):

- ``question_id``            string
- ``ranked_session_ids``     list<string>, best first (original session ids)
- ``scores``                 list<double> aligned with ``ranked_session_ids``, or null
- ``method``                 string, e.g. ``embed:dense``, ``embed:hybrid``, ``rank:MemSifter-4B``
- ``status``                 ``ok`` | ``fallback`` | ``error``
- ``reason``                 string or null (why a row is not ``ok``)
- ``raw_response``           string or null (the generative ranker's text, kept for audit)

``evaluate`` scores any such file against the dataset, so all methods are compared the same way.

:func:`parse_ranking` implements MEMSIFTER.md §4 parsing: the text after the last ``</think>``
(Thinking-2507 templates pre-fill ``<think>``, so the opening tag is often absent), the content of
``<ranking>…</ranking>``, split on commas, in-range integer local ids in order without duplicates.
Ids written as ``session3`` / ``<session3>`` are accepted. It never raises on model output.

Hostile input (session text is not escaped, MEMSIFTER.md §2, so a session may hold ``</think>``,
``<ranking>0</ranking>`` or ``</session>``): only the model's own output is ever parsed (the prompt
never reaches the parser), and inside that output :func:`answer_part` ignores everything up to the
last ``</session>`` after the last ``</think>``: a model that echoes part of the history in its answer
cannot make a ranking injected in a session count as its own. Ids are ASCII integers of at most 9
digits (longer ones, and other scripts' digits such as ``٣``, are dropped as non-integer); the scan
is linear in the length of the output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import pyarrow as pa

from ..store import storage

STATUSES = ("ok", "fallback", "error")

RANKINGS_SCHEMA = pa.schema([
    ("question_id", pa.string()),
    ("ranked_session_ids", pa.list_(pa.string())),
    ("scores", pa.list_(pa.float64())),
    ("method", pa.string()),
    ("status", pa.string()),
    ("reason", pa.string()),
    ("raw_response", pa.string()),
])

RANKINGS_FILE = "rankings.parquet"


# --------------------------------------------------------------------------- parsing
@dataclass
class ParsedRanking:
    """Result of parsing one ranker response.

    ``ids`` are local ids (positions in the history shown), most relevant first. ``status`` is
    ``ok`` when a ranking with at least one valid id was found (and, when ``k`` was given, at least
    ``k`` of them), else ``invalid``; ``reason`` says why (also set for soft problems on ``ok`` such
    as dropped out-of-range or duplicate ids, prefixed ``note:``).
    """

    ids: list[int] = field(default_factory=list)
    status: str = "invalid"
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_THINK_CLOSE = "</think>"
_SESSION_CLOSE = "</session>"
_RANKING_OPEN = re.compile(r"<\s*ranking\s*>", re.IGNORECASE)
_RANKING_CLOSE = re.compile(r"<\s*/\s*ranking\s*>", re.IGNORECASE)
# ASCII digits only (re.ASCII: \d and \s are not Unicode-wide), at most 9 of them (no id is that large,
# and int() refuses strings of more than 4,300 digits).
_ITEM = re.compile(r"^\s*(?:<\s*)?(?:session\s*[_#-]?\s*)?(?:id\s*)?([+-]?\d{1,9})\s*(?:>\s*)?$",
                   re.IGNORECASE | re.ASCII)


def answer_part(text: str) -> tuple[str, str | None]:
    """The part of a model's output that is its answer, and a note when an echo was cut off.

    The text after the last ``</think>`` (Thinking-2507 templates pre-fill ``<think>``); if that
    still holds a ``</session>``, the model is echoing the history shown to it (whose sessions may
    contain any text, tags included), so only what follows the last ``</session>`` counts.
    """
    pos = text.rfind(_THINK_CLOSE)
    answer = text[pos + len(_THINK_CLOSE):] if pos >= 0 else text
    echo = answer.rfind(_SESSION_CLOSE)
    if echo >= 0:
        return answer[echo + len(_SESSION_CLOSE):], "echoed history (</session>) ignored"
    return answer, None


def parse_ranking(text: str | None, n_sessions: int, k: int | None = None) -> ParsedRanking:
    """Parse a ranker response into local session ids (MEMSIFTER.md §4).

    ``n_sessions`` is the number of sessions shown (valid ids are ``0..n_sessions-1``). With ``k``
    given, at least ``min(k, n_sessions)`` valid ids are required for ``ok`` and the ids are cut to
    ``k`` (the reward's "K = min(10, N) ids required"); without ``k`` any non-empty ranking is ok.
    """
    if text is None or not str(text).strip():
        return ParsedRanking([], "invalid", "empty output")
    text = str(text)
    answer, echo = answer_part(text)
    opens = list(_RANKING_OPEN.finditer(answer))
    if not opens:
        if echo:
            return ParsedRanking([], "invalid", f"no <ranking> tag after the {echo.split(' (')[0]}")
        if _THINK_CLOSE not in text and "<think>" in text:
            return ParsedRanking([], "invalid", "unfinished <think> (no </think>) and no <ranking>")
        return ParsedRanking([], "invalid", "no <ranking> tag after the last </think>")
    # The last <ranking> that has a closing tag after it (i.e. the last opening tag before the last
    # closing tag; one linear scan); its body ends at the first closing tag after it.
    closes = list(_RANKING_CLOSE.finditer(answer))
    last_close = closes[-1].start() if closes else -1
    body = None
    for m in reversed(opens):
        if m.end() <= last_close:
            close = _RANKING_CLOSE.search(answer, m.end())
            body = answer[m.end():close.start()]
            break
    if body is None:
        return ParsedRanking([], "invalid", "missing </ranking>")
    notes: list[str] = []
    ids: list[int] = []
    seen: set[int] = set()
    items = [s for s in re.split(r"[,\n;]", body) if s.strip()]
    for raw in items:
        m = _ITEM.match(raw)
        if not m:
            notes.append(f"non-integer {raw.strip()[:20]!r}")
            continue
        i = int(m.group(1))
        if not 0 <= i < n_sessions:
            notes.append(f"out-of-range {i}")
            continue
        if i in seen:
            notes.append(f"duplicate {i}")
            continue
        seen.add(i)
        ids.append(i)
    note = ("dropped: " + ", ".join(notes[:5]) + (" …" if len(notes) > 5 else "")) if notes else None
    if echo:
        note = f"{echo}; {note}" if note else echo
    if not ids:
        return ParsedRanking([], "invalid", "no valid ids in <ranking>" + (f" ({note})" if note else ""))
    if k is not None:
        need = min(k, n_sessions)
        if len(ids) < need:
            return ParsedRanking(ids, "invalid", f"{len(ids)} valid ids, {need} required"
                                 + (f" ({note})" if note else ""))
        ids = ids[:k]
    return ParsedRanking(ids, "ok", f"note: {note}" if note else None)


def to_original(local_ids: Sequence[int], id_map: Sequence[str]) -> list[str]:
    """Map local ids (positions in the history shown) to original session ids."""
    return [id_map[i] for i in local_ids]


def complete_ranking(head: Sequence[str], fallback_order: Sequence[str]) -> list[str]:
    """``head`` then every id of ``fallback_order`` not already in it (a full ranking)."""
    seen = set(head)
    return list(head) + [s for s in fallback_order if s not in seen]


# --------------------------------------------------------------------------- table I/O
def rankings_table(rows: Iterable[dict]) -> pa.Table:
    rows = list(rows)
    cols = {name: [r.get(name) for r in rows] for name in RANKINGS_SCHEMA.names}
    for r in rows:
        if r.get("status") not in STATUSES:
            raise ValueError(f"rankings row {r.get('question_id')}: bad status {r.get('status')!r}")
    return pa.table(cols, schema=RANKINGS_SCHEMA)


def write_rankings(out: storage.Publication, rows: Iterable[dict], name: str = RANKINGS_FILE) -> pa.Table:
    table = rankings_table(rows)
    out.write_table(name, table)
    return table


def read_rankings(uri: str) -> list[dict]:
    """Rows of a published rankings file; ``uri`` is a stage output or the parquet file itself."""
    path = uri if uri.endswith(".parquet") else storage.published_file(uri, RANKINGS_FILE)
    table = storage.read_parquet(path)
    missing = [n for n in ("question_id", "ranked_session_ids", "status") if n not in table.column_names]
    if missing:
        raise ValueError(f"{path}: not a rankings file (missing {missing})")
    return table.to_pylist()


# --------------------------------------------------------------------------- resumable work
def read_partials(uri: str) -> list[dict]:
    """Rows of every ``*.parquet`` under a partial-results prefix (empty when there is none)."""
    rows: list[dict] = []
    for rel in storage.list_files(uri):
        if rel.endswith(".parquet"):
            rows.extend(storage.read_parquet(storage.join(uri, rel)).to_pylist())
    return rows


def write_partial(uri: str, index: int, rows: list[dict]) -> str:
    """One shard of partial results (written whole; readers never see half a shard)."""
    import uuid

    name = f"part-{index:05d}-{uuid.uuid4().hex[:8]}.parquet"
    atomic_write(storage.join(uri, name), storage.parquet_bytes(pa.Table.from_pylist(rows)))
    return name


def atomic_write(uri: str, data: bytes) -> None:
    """Write a file so that no reader (or crash) ever sees part of it: S3 puts are atomic; on a
    local disk write a temporary file, then rename it."""
    import os
    import uuid

    if storage.is_s3(uri):
        storage.write_bytes(uri, data)
        return
    _, path = storage.resolve(uri)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    storage.write_bytes(tmp, data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- a ranker's input
@dataclass
class RankerInput:
    """The order a re-ranker was given, read back from a rank stage output: ``source`` (the first-stage
    rankings it read: its config's ``embeddings``), ``orders`` (question id -> that first-stage order),
    ``shown`` (question id -> the sessions it was shown, from its ``prompts.parquet``; empty where not
    recorded) and ``k`` (the ids it was asked for: its ``top_k``)."""

    source: str
    orders: dict[str, list[str]]
    shown: dict[str, list[str]]
    k: int = 10


def ranker_input(uri: str) -> RankerInput | None:
    """The input of the rank stage output at ``uri``; None when ``uri`` is not one (a parquet file, a
    first stage). Raises (NotPublishedError, ValueError) when its input cannot be read back."""
    if uri.endswith(".parquet"):
        return None
    manifest = storage.read_manifest(uri)
    cfg = manifest.get("config") or {}
    if manifest.get("stage") != "rank" or not cfg.get("embeddings"):
        return None
    orders = {r["question_id"]: list(r["ranked_session_ids"] or []) for r in read_rankings(cfg["embeddings"])}
    shown: dict[str, list[str]] = {}
    if "prompts.parquet" in manifest.get("files", {}):
        table = storage.read_parquet(storage.join(uri, "prompts.parquet"))
        if "shown_session_ids" in table.column_names:
            shown = {r["question_id"]: list(r["shown_session_ids"] or []) for r in table.to_pylist()}
    return RankerInput(cfg["embeddings"], orders, shown, int(cfg.get("top_k") or 10))


def input_order(first_stage: Sequence[str] | None, haystack: Sequence[str]) -> list[str]:
    """The order the rank stage hands a ranker (and falls back to): the first stage's order over the
    haystack, then the haystack sessions the first stage left out, in haystack order."""
    hay = set(haystack)
    order = [s for s in dict.fromkeys(first_stage or []) if s in hay]
    seen = set(order)
    return order + [s for s in haystack if s not in seen]


def order_changes(rows: Sequence[dict], questions: Sequence, given: RankerInput) -> dict[str, dict]:
    """question id -> :func:`memsifter.retrieval.metrics.order_change` of each eligible question's ranking
    against the order it was given, over the sessions it was shown (else its top ``k``)."""
    from .metrics import order_change

    by_id = {r["question_id"]: r for r in rows}
    out = {}
    for q in questions:
        if not eligible(q) or q.question_id not in by_id:
            continue
        order = input_order(given.orders.get(q.question_id), q.haystack_session_ids)
        out[q.question_id] = order_change(by_id[q.question_id]["ranked_session_ids"] or [], order,
                                          given.shown.get(q.question_id) or None, given.k)
    return out


# --------------------------------------------------------------------------- scoring
def eligible(question) -> bool:
    """Questions that count in retrieval metrics: with gold sessions, not abstention."""
    return bool(question.gold_session_ids) and not question.abstention


def per_question_metrics(rows: Sequence[dict], questions: Sequence, ks: Sequence[int] = (1, 5, 10),
                         variant: str = "standard") -> dict[str, dict[str, float]]:
    """question_id -> retrieval metrics, for the eligible questions that have a ranking row."""
    from .metrics import question_metrics

    by_id = {r["question_id"]: r for r in rows}
    out = {}
    for q in questions:
        if not eligible(q) or q.question_id not in by_id:
            continue
        out[q.question_id] = question_metrics(by_id[q.question_id]["ranked_session_ids"] or [],
                                              q.gold_session_ids, ks, variant)
    return out


def summarize(rows: Sequence[dict], questions: Sequence, ks: Sequence[int] = (1, 5, 10)) -> dict:
    """Mean retrieval metrics (rounded) plus status counts, for a manifest's stats."""
    from .metrics import mean_metrics

    per_q = per_question_metrics(rows, questions, ks)
    status: dict[str, int] = {}
    for r in rows:
        status[r["status"]] = status.get(r["status"], 0) + 1
    return {"questions_scored": len(per_q), "status": status,
            **{k: round(v, 4) for k, v in mean_metrics(list(per_q.values())).items()}}
