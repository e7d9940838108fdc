"""Held-out splits that hold (issue 42 item 4): the one split of every training stage.

``prepare-rl`` and ``prepare-agents`` choose their questions per split with :func:`choose`; ``sft`` and the GPU
drivers read the split a prepare stage published (``split.json``) and check it with :func:`check` before they
train or publish held-out questions.

What a split separates:

- **by conversation**: questions whose haystacks hold the same session *texts* (a LoCoMo conversation: every
  question of it shares its sessions) form one group, and a group goes to one split only. The group key is the
  content hash of the haystack's sessions (:func:`memsifter.data.model.content_hash` of their turns), not their
  ids, so a conversation imported twice under other ids is still one group;
- **by session text**: a session whose text is in a question of one split is in no haystack of another split.
  Splits choose in order, the one asking for the fewest questions first (the held-out one in a usual recipe): it
  owns the texts of its haystacks. A later split leaves out a question whose gold session's text is
  owned by an earlier split (``excluded_gold_shared``), and removes the other owned texts from the haystacks of
  the questions it takes (``haystack_sessions_removed``: LongMemEval_S haystacks share filler sessions, so
  leaving out every question that shares one would leave nearly no training question).

Splits choose in the order of the questions they ask for in all (the fewest first), whatever their datasets are
called. Within a dataset a split takes the largest group that fits what it still wants; when none fits, an empty split
takes the smallest group (part of it: the rest is stranded, it goes to no other split) and one with questions
stops short (``shortfall``). Groups of one size in a seeded order, or in ``priority`` order when given
(prepare-rl's anchor curriculum); ``accept`` may refuse a question (prepare-rl: a prompt over its limit), and the
next one is taken.

The split is published as ``split.json`` (:func:`document`: per split the question ids, conversations and the
sessions' content hashes, 16 hex digits each) and summarised in the manifest's stats (:func:`summary`: seed,
question ids, conversations, hash counts). :func:`check` refuses a split document whose splits share a question,
a conversation or a session text: one line naming the file, the split and the field.

Also here, one place for what the prepare stages and ``sft`` share: :func:`tiebreak`, :func:`shard_sizes`,
:func:`read_rows` and :func:`load_orders`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import InputError
from ..store import storage
from .model import Question, Session

log = logging.getLogger(__name__)

SPLIT_FILE = "split.json"
HASH_DIGITS = 16


def tiebreak(seed: int, *parts: str) -> float:
    """A seeded draw in [0, 1) for ``parts`` (the same for the same seed and parts on every machine)."""
    h = hashlib.sha256(":".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


def shard_sizes(n: int, max_rows: int) -> list[int]:
    """Split n rows into ceil(n / max_rows) files of near-equal size (no tiny trailing shard)."""
    if n == 0:
        return []
    k = math.ceil(n / max_rows)
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def read_rows(uri: str, split: str = "train") -> list[dict]:
    """All rows of one split of a published prepare-rl or prepare-agents output (the files its manifest lists;
    an output without that list: ``{split}.parquet``, or ``train_*.parquet`` for train)."""
    manifest = storage.read_manifest(uri)
    names = (manifest.get("stats") or {}).get("files", {}).get(split)
    if names is None:
        names = sorted(f for f in manifest.get("files", {}) if f == f"{split}.parquet"
                       or (split == "train" and f.startswith("train_") and f.endswith(".parquet")))
    rows: list[dict] = []
    for n in names:
        rows.extend(storage.read_parquet(storage.published_file(uri, n)).to_pylist())
    return rows


def load_orders(uris: list[str], field: str) -> dict[str, tuple[str, list[str]]]:
    """question_id -> (rankings output, session ids best first) of rank/embed outputs (the first output that
    ranks a question wins); an unreadable one is one line naming it and ``field``."""
    from ..retrieval import rankings

    out: dict[str, tuple[str, list[str]]] = {}
    for uri in uris:
        try:
            rows = rankings.read_rankings(uri)
        except (ValueError, FileNotFoundError) as e:
            raise InputError(str(e).splitlines()[0] if str(e) else type(e).__name__, file=uri,
                             field=field) from None
        for r in rows:
            ids = list(r.get("ranked_session_ids") or [])
            scores = r.get("scores")
            if scores and len(scores) == len(ids):
                ids = [s for _, s in sorted(zip(scores, ids), key=lambda x: -x[0])]
            if ids:
                out.setdefault(r["question_id"], (uri, ids))
    return out


# --------------------------------------------------------------------------- the split
def short_hash(h: str) -> str:
    return h[:HASH_DIGITS]


def texts_of(q: Question, sessions: dict[str, Session]) -> list[str]:
    """The content hashes of a question's haystack sessions (short form), in haystack order (a session the
    dataset lacks counts by its id)."""
    return [short_hash(sessions[s].content_hash) if s in sessions else f"id:{s}" for s in q.haystack_session_ids]


def group_key(q: Question, sessions: dict[str, Session]) -> str:
    """Questions over the same session texts share a key (a LoCoMo conversation); by content, not by ids."""
    return hashlib.sha256("\x00".join(sorted(set(texts_of(q, sessions)))).encode()).hexdigest()[:16]


def group_label(members: list[Question], key: str) -> str:
    """A readable name of a group: the conversation (LoCoMo ``conv-26`` of ``conv-26_q3``; ``a+b`` for one
    conversation imported under two names), the question id of a one-question group, else the key."""
    if len(members) == 1:
        return members[0].question_id
    stems = sorted({q.question_id.rsplit("_q", 1)[0] for q in members})
    return "+".join(stems) if len(stems) <= 3 else key


@dataclass
class Split:
    """The questions per split (haystacks cut of other splits' texts) and what the choice left out."""
    seed: int
    chosen: dict[str, list[Question]]
    shortfall: dict[str, dict[str, int]] = field(default_factory=dict)
    stranded: int = 0
    excluded_gold_shared: dict[str, int] = field(default_factory=dict)
    haystack_sessions_removed: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)    # split -> group labels
    hashes: dict[str, set[str]] = field(default_factory=dict)      # split -> session texts of its haystacks

    def document(self) -> dict:
        """``split.json``: per split the question ids, conversations and sorted session hashes."""
        return {"seed": self.seed, "hash": f"sha256 of the session turns, first {HASH_DIGITS} hex digits",
                "splits": {s: {"question_ids": [q.question_id for q in qs],
                               "conversations": self.conversations(s),
                               "session_hashes": sorted(self.hashes.get(s, set()))}
                           for s, qs in self.chosen.items()}}

    def summary(self) -> dict:
        """The manifest's ``split`` stats: seed, and per split question ids, conversations (groups of more than
        one question), counts of groups and session hashes, what was left out."""
        out: dict[str, Any] = {"seed": self.seed, "file": SPLIT_FILE,
                               "by": "conversation (haystack session texts) and session text (content hash)",
                               "splits": {}}
        for s, qs in self.chosen.items():
            labels = self.groups.get(s, [])
            out["splits"][s] = {
                "questions": len(qs), "question_ids": [q.question_id for q in qs],
                "conversations": self.conversations(s),
                "groups": len(set(labels)), "session_hashes": len(self.hashes.get(s, set())),
                "excluded_gold_shared": self.excluded_gold_shared.get(s, 0),
                "haystack_sessions_removed": self.haystack_sessions_removed.get(s, 0)}
        out["shortfall"], out["stranded_in_taken_groups"] = self.shortfall, self.stranded
        return out

    def conversations(self, s: str) -> list[str]:
        """The groups of more than one question the split took from (LoCoMo conversations), sorted (a group of one
        question is labelled by its question id)."""
        return sorted(set(self.groups.get(s, [])) - {q.question_id for q in self.chosen.get(s, [])})


def choose(questions: list[Question], sessions: dict[str, Session], recipe: dict[str, dict[str, int]], seed: int,
           *, by_group: bool = True, priority: Callable[[str, str, Question], Any] | None = None,
           accept: Callable[[Question], bool] | None = None) -> Split:
    """Questions per split (the module doc): disjoint by question, by conversation (``by_group``) and by session
    text. ``priority(split, dataset, q)``: lower first (default: a seeded draw); ``accept(q)``: False skips it
    (counted in ``refused``). A question a later split takes has the texts of earlier splits cut from its
    haystack (a new :class:`Question`; ``haystack_dates`` cut alike)."""
    by_ds: dict[str, list[Question]] = {}
    for q in questions:
        by_ds.setdefault(q.dataset, []).append(q)
    out = Split(seed, {split: [] for split in recipe})
    owner: dict[str, str] = {}         # group -> split
    text_owner: dict[str, str] = {}    # session text -> split
    groups_of: dict[str, dict[str, list[Question]]] = {}
    for name in sorted({d for entries in recipe.values() for d in entries}):
        groups_of[name] = {}
        for q in by_ds.get(name, []):
            groups_of[name].setdefault(group_key(q, sessions) if by_group else q.question_id, []).append(q)
    # the split asking for the fewest questions first (the held-out one, in a usual recipe), whatever its datasets
    # are called: it owns its haystacks' texts before any other split chooses
    for split in sorted(recipe, key=lambda s: (sum(recipe[s].values()), list(recipe).index(s))):
        for name in sorted(recipe[split]):
            groups = groups_of[name]
            want = recipe[split][name]

            def rank(q: Question, split: str = split) -> Any:
                return priority(split, name, q) if priority else tiebreak(seed, split, name, q.question_id)
            free = [g for g in groups if g not in owner]
            draw = {g: min(rank(q) for q in groups[g]) for g in free}
            taken = 0
            while taken < want and free:
                # the largest group that fits what is still wanted, else (a split still empty) the smallest one:
                # fewest questions stranded, and a split with some questions leaves the larger groups to the others
                fits = [g for g in free if len(groups[g]) <= want - taken]
                if not fits and taken:
                    break
                g = (min(fits, key=lambda g: (-len(groups[g]), draw[g])) if fits
                     else min(free, key=lambda g: (len(groups[g]), draw[g])))
                free.remove(g)
                owner[g] = split
                members = sorted(groups[g], key=rank)
                seen = 0
                for q in members:
                    if taken >= want:
                        break
                    seen += 1
                    texts = texts_of(q, sessions)
                    other = {t for t in texts if text_owner.get(t, split) != split}
                    gold = {short_hash(sessions[s].content_hash) for s in q.gold_session_ids if s in sessions}
                    if gold & other:
                        out.excluded_gold_shared[split] = out.excluded_gold_shared.get(split, 0) + 1
                        continue
                    if other:
                        q = cut(q, sessions, other)
                        out.haystack_sessions_removed[split] = (out.haystack_sessions_removed.get(split, 0)
                                                                + len(texts) - len(q.haystack_session_ids))
                    if accept is not None and not accept(q):
                        out.refused[split] = out.refused.get(split, 0) + 1
                        continue
                    for t in texts_of(q, sessions):
                        text_owner[t] = split
                    out.hashes.setdefault(split, set()).update(texts_of(q, sessions))
                    out.chosen[split].append(q)
                    out.groups.setdefault(split, []).append(group_label(groups[g], g))
                    taken += 1
                out.stranded += len(members) - seen   # left in a taken group: they go to no other split
            if taken < want:
                out.shortfall.setdefault(split, {})[name] = want - taken
                log.warning("split: %s/%s: %d of %d questions available", split, name, taken, want)
    return out


def cut(q: Question, sessions: dict[str, Session], texts: set[str]) -> Question:
    """``q`` with the haystack sessions whose text is in ``texts`` removed (dates alike)."""
    own = texts_of(q, sessions)
    keep = [i for i in range(len(own)) if own[i] not in texts]
    dates = [q.haystack_dates[i] for i in keep] if q.haystack_dates else q.haystack_dates
    return dataclasses.replace(q, haystack_session_ids=[q.haystack_session_ids[i] for i in keep],
                               haystack_dates=dates)


# --------------------------------------------------------------------------- checking a published split
def check(doc: Any, where: str) -> dict[str, dict[str, set[str]]]:
    """Refuse a split document (``split.json``) whose splits share a question id, a conversation or a session
    text: one :class:`InputError` naming the file, the split and the field. Returns per split its sets."""
    if not isinstance(doc, dict) or not isinstance(doc.get("splits"), dict) or not doc["splits"]:
        raise InputError("not a split document (expected {seed, splits: {name: {question_ids, conversations, "
                         "session_hashes}}})", file=where, field="splits")
    sets: dict[str, dict[str, set[str]]] = {}
    for name, entry in doc["splits"].items():
        sets[name] = {}
        for f in ("question_ids", "conversations", "session_hashes"):
            v = entry.get(f) if isinstance(entry, dict) else None
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise InputError("expected a list of strings", file=where, item=f"split '{name}'", field=f)
            sets[name][f] = set(v)
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for f in ("question_ids", "conversations", "session_hashes"):
                both = sets[a][f] & sets[b][f]
                if both:
                    raise InputError(f"splits '{a}' and '{b}' share {len(both)} {f.replace('_', ' ')} (e.g. "
                                     f"{sorted(both)[0]}): a held-out split must share no question, conversation or "
                                     f"session text with another", file=where, item=f"split '{b}'", field=f)
    return sets


def read_split(uri: str) -> dict:
    """The checked ``split.json`` of a prepare-rl / prepare-agents output."""
    where = storage.join(uri, SPLIT_FILE)
    if SPLIT_FILE not in (storage.read_manifest(uri).get("files") or {}):
        raise InputError(f"no {SPLIT_FILE}: prepared before held-out splits were recorded (re-run the prepare "
                         f"stage)", file=uri, field=SPLIT_FILE)
    import json

    try:
        doc = json.loads(storage.read_text(storage.published_file(uri, SPLIT_FILE)))
    except ValueError as e:
        raise InputError(f"not JSON ({e})", file=where) from None
    check(doc, where)
    return doc


def check_rows(doc: dict, split: str, question_ids: Iterable[tuple[int, str]], where: str, field: str) -> None:
    """Every row of ``split`` (``(row number, question id)``) belongs to that split of ``doc``, else one line
    naming the row (a row of a held-out question among the training rows, or one the split never chose)."""
    mine = set(doc["splits"].get(split, {}).get("question_ids", []))
    others = {qid: s for s, e in doc["splits"].items() if s != split for qid in e["question_ids"]}
    for n, qid in question_ids:
        if qid in others:
            raise InputError(f"question '{qid}' of split '{others[qid]}' is among the '{split}' rows", file=where,
                             item=f"row {n}", field=field)
        if qid not in mine:
            raise InputError(f"question '{qid}' is in no split of {SPLIT_FILE}", file=where, item=f"row {n}",
                             field=field)
