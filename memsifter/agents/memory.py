"""``agent:memory`` (MemAgent-style) and ``agent:memory+recall`` (ReMemR1-style): read the haystack one
section at a time, keeping bounded notes, then answer from the notes alone.

Episode (:meth:`MemoryAgent.episode`):

* one request per section (``kind="chunk"``), each a fresh conversation (``continues=False``): the
  question, the current notes (first: :data:`EMPTY_MEMORY`), and the section (one haystack session,
  chronological, with its date; a session longer than ``chunk_tokens`` is split at line boundaries into
  parts, a single longer line cut). The reply is the new notes, ``<memory>…</memory>`` (stop
  ``</memory>``), cut to ``memory_tokens`` when longer; a reply without well-formed notes keeps the
  previous notes and marks the episode malformed.
* ``recall=True``: the reply is ``<update>notes</update>`` optionally followed by ``<recall>query</recall>``
  (stop ``</recall>``). A recall query picks, by TF-IDF cosine (:func:`best_match`), the best-matching
  *earlier* notes of this episode (states before the one just written; not the empty start); they are
  shown in the next section's prompt (and in the final answer prompt after the last section).
* a last fresh request (``kind="answer"``): the question and the notes alone, reply ``<answer>…</answer>``.

Constructor kwargs (defaults fit SmolLM2-135M-Instruct's 8,192 tokens with ``count_tokens`` =
:func:`approx_tokens`, which over-counts SmolLM2 by ~20%): ``recall=False``, ``chunk_tokens=4096``,
``memory_tokens=768``, ``max_tokens=None`` (reply budget: ``memory_tokens + 64``, the recall query's room
included), ``answer_tokens=64``, ``question_tokens=256``, ``context_tokens=8192`` (the constructor refuses
budgets whose prompt + question + notes (x2 with recall) + section + reply do not fit),
``count_tokens: Callable[[str], int] | None``.

Oracle evidence format (:meth:`MemoryAgent.oracle`, built by :func:`gold_evidence`): a list of strings,
each one evidence turn exactly as the agent sees it in a section, i.e. its line of
:func:`memsifter.retrieval.render.render_session` without the newline (``<Caroline3>I went to a pride
parade</Caroline>``). From LongMemEval: the turns flagged ``has_answer`` (``extra.answer_turns``); from
LoCoMo: the evidence dia ids (``extra.evidence``, ``D{n}:{t}`` = turn t-1 of session n); where a question
has gold sessions but no turn-level evidence, each gold session's turn sharing the most words with the
answer (then the question). The oracle notes each evidence line found in a section (with the section's
date), keeps the notes unchanged on sections without evidence, and answers ``<answer>{answer}</answer>``.

:func:`chunks_for` ``(dataset, question, first_stage_order=None, max_chunks=32) -> list[Session]``: the
question's haystack in chronological order; when it holds more than ``max_chunks`` sessions, the first
stage's top ``max_chunks`` (``first_stage_order``: session ids best first, e.g. a rankings row's
``ranked_session_ids``) put back in chronological order.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Callable, Generator, Sequence

from ..retrieval.render import content_words, render_session, turn_texts
from .base import (Request, Result, Session, Task, TokenCounter, approx_tokens, clip, close_stop, scan_tags,
                   trim_to_tokens)

EMPTY_MEMORY = "(no notes yet)"
STOP_MEMORY, STOP_RECALL, STOP_ANSWER = "</memory>", "</recall>", "</answer>"

CHUNK_PROMPT = """You are going through a user's past conversations one part at a time, to answer a question about them at the end. You cannot see earlier parts again: only your notes carry over.

Question{date}: {question}

Your notes so far:
{memory}
{recalled}
Part {n} of {total}{when}:
{section}

(end of part {n})

{instruction}"""

INSTRUCTION = ("Write your notes again, updated with this part: keep what can help answer the question, add new "
               "facts from this part with their dates, leave out the rest. At most about {words} words. Write "
               "them between <memory> and </memory>.")
INSTRUCTION_RECALL = ("Write your notes again, updated with this part: keep what can help answer the question, add "
                      "new facts from this part with their dates, leave out the rest. At most about {words} words. "
                      "Write them between <update> and </update>. If an older version of your notes could help, "
                      "add a short query between <recall> and </recall> after them, and the best-matching older "
                      "notes will be shown next time.")
RECALLED = "\nOlder notes you asked to see again (query: {query}):\n{state}\n"
NOTHING_RECALLED = "\nNo older notes matched your query ({query}).\n"

ANSWER_PROMPT = """Here are your notes from reading a user's past conversations:
{memory}
{recalled}
Question{date}: {question}

Answer from the notes alone, in a few words, between <answer> and </answer>. For example: <answer>in March</answer>"""


# --------------------------------------------------------------------------- TF-IDF recall
_TOKEN = re.compile(r"[a-z0-9]+")


def _terms(text: str) -> list[str]:
    return [w for w in _TOKEN.findall(text.lower()) if len(w) > 1]


def tfidf_scores(query: str, docs: Sequence[str]) -> list[float]:
    """Cosine between ``query`` and each of ``docs`` in TF-IDF space fitted on ``docs`` (raw term counts,
    smoothed idf ``ln((1+N)/(1+df)) + 1``, L2-normalised vectors). 0.0 for a document sharing no term."""
    if not docs:
        return []
    counts = [Counter(_terms(d)) for d in docs]
    n = len(docs)
    df: Counter = Counter()
    for c in counts:
        df.update(c.keys())
    idf = {t: math.log((1 + n) / (1 + f)) + 1.0 for t, f in df.items()}

    def vec(c: Counter) -> dict[str, float]:
        v = {t: k * idf[t] for t, k in c.items() if t in idf}
        norm = math.sqrt(sum(x * x for x in v.values()))
        return {t: x / norm for t, x in v.items()} if norm else {}

    q = vec(Counter(_terms(query)))
    return [sum(w * d.get(t, 0.0) for t, w in q.items()) for d in map(vec, counts)]


def best_match(query: str, states: Sequence[str]) -> int | None:
    """Index of the state that matches ``query`` best (ties: the latest); None when none shares a term."""
    scores = tfidf_scores(query, states)
    best = None
    for i, s in enumerate(scores):
        if s > 0 and (best is None or s >= scores[best]):
            best = i
    return best


# --------------------------------------------------------------------------- parsing
class ParsedNotes:
    __slots__ = ("memory", "recall", "problems")

    def __init__(self, memory: str | None, recall: str | None, problems: list[str]):
        self.memory, self.recall, self.problems = memory, recall, problems


def parse_notes(text: str, recall: bool) -> ParsedNotes:
    """A chunk reply: ``<memory>…</memory>`` (or, with ``recall``, ``<update>…</update>`` then an optional
    ``<recall>…</recall>``). The last notes tag wins; problems: malformed tags, no notes, a second recall."""
    if recall:
        tags = scan_tags(text, ("think", "update", "recall"), ("memory", "answer"))
        notes, query = tags.last("update"), tags.last("recall")
        problems = list(tags.problems)
        if notes is None:
            problems.append("no <update>")
        if tags.count("recall") > 1:
            problems.append("more than one <recall>")
        if query is not None and not query:
            problems.append("empty <recall>")
            query = None
        return ParsedNotes(notes, query, problems)
    tags = scan_tags(text, ("think", "memory"), ("update", "recall", "answer"))
    notes = tags.last("memory")
    problems = list(tags.problems) + ([] if notes is not None else ["no <memory>"])
    return ParsedNotes(notes, None, problems)


def parse_answer(text: str) -> tuple[str | None, list[str]]:
    tags = scan_tags(text, ("think", "answer"), ("memory", "update", "recall"))
    a = tags.last("answer")
    problems = list(tags.problems)
    if a is None:
        problems.append("no <answer>")
    elif not a:
        problems.append("empty <answer>")
        a = None
    return a, problems


# --------------------------------------------------------------------------- sections
def split_section(text: str, budget: int, count: TokenCounter) -> list[str]:
    """``text`` in parts of at most ``budget`` tokens, split between lines (turns); a longer line is cut
    into pieces at characters."""
    if count(text) <= budget:
        return [text]
    parts, cur, used = [], [], 0
    for line in text.splitlines(keepends=True):
        c = count(line)
        if c > budget:
            if cur:
                parts.append("".join(cur))
                cur, used = [], 0
            rest = line
            while rest:
                piece = trim_to_tokens(rest, budget, count, mark="")
                if not piece:   # one character over the budget: cannot happen for budget >= a few tokens
                    piece = rest[:1]
                parts.append(piece)
                rest = rest[len(piece):]
            continue
        if cur and used + c > budget:
            parts.append("".join(cur))
            cur, used = [], 0
        cur.append(line)
        used += c
    if cur:
        parts.append("".join(cur))
    return parts


def chunks_for(dataset, question, first_stage_order: Sequence[str] | None = None,  # noqa: ANN001
               max_chunks: int = 32) -> list[Session]:
    """The sessions a memory agent reads for ``question`` of ``dataset`` (:mod:`memsifter.data.model`):
    the haystack in its (chronological) order, each rendered as the rank stage renders it; more than
    ``max_chunks`` sessions: the first stage's top ``max_chunks`` (``first_stage_order``, session ids best
    first) in haystack order. A ValueError when the haystack is too long and no order is given."""
    ids = list(question.haystack_session_ids)
    if len(ids) > max_chunks:
        if first_stage_order is None:
            raise ValueError(f"question {question.question_id}: {len(ids)} haystack sessions, more than "
                             f"max_chunks={max_chunks}, and no first-stage order to choose from")
        hay = set(ids)
        top = []
        for s in first_stage_order:
            if s in hay and s not in top:
                top.append(s)
            if len(top) == max_chunks:
                break
        keep = set(top)
        ids = [s for s in ids if s in keep]
    return [Session(session_id=s, date=question.date_of(s, dataset.sessions),
                    text=render_session(dataset.sessions[s].turns)) for s in ids]


def _lines(turns: Sequence[dict]) -> list[str]:
    return [t.rstrip("\n") for t in turn_texts(turns)]


def gold_evidence(dataset, question) -> list[str]:  # noqa: ANN001
    """The oracle's evidence for ``question``: the evidence turns' rendered lines (see the module doc)."""
    ex = question.extra or {}
    out: list[str] = []
    turns_of = ex.get("answer_turns")             # LongMemEval: {session_id: [turn index, ...]}
    if isinstance(turns_of, dict):
        for sid in question.haystack_session_ids:
            if sid in turns_of and sid in dataset.sessions:
                lines = _lines(dataset.sessions[sid].turns)
                out += [lines[i] for i in turns_of[sid] if 0 <= i < len(lines)]
    ids = ex.get("evidence")                      # LoCoMo: ["D8:6", ...], session n is "<conv>_session_<n>"
    if isinstance(ids, list):
        by_n = {}
        for sid in question.haystack_session_ids:
            m = re.search(r"_session_(\d+)$", sid)
            if m:
                by_n[int(m.group(1))] = sid
        for dia in ids:
            m = re.fullmatch(r"D(\d+):(\d+)", str(dia))
            if not m or int(m.group(1)) not in by_n:
                continue
            lines = _lines(dataset.sessions[by_n[int(m.group(1))]].turns)
            t = int(m.group(2)) - 1
            if 0 <= t < len(lines) and lines[t] not in out:
                out.append(lines[t])
    if out:
        return out
    want_a, want_q = content_words(question.answer or ""), content_words(question.question)
    for sid in question.gold_session_ids:
        if sid not in dataset.sessions:
            continue
        lines = _lines(dataset.sessions[sid].turns)
        if lines:
            best = max(range(len(lines)), key=lambda i: (len(want_a & content_words(lines[i])),
                                                         len(want_q & content_words(lines[i])), -i))
            out.append(lines[best])
    return out


_LINE = re.compile(r"^<([^<>]+?)\d+>(.*)</\1>$", re.S)


def note_of(line: str, date: str | None) -> str:
    """An evidence line as a note: ``- (date) role: content``."""
    m = _LINE.match(line)
    body = f"{m.group(1)}: {m.group(2)}" if m else line
    return f"- ({date}) {body}" if date else f"- {body}"


# --------------------------------------------------------------------------- the agent
class MemoryAgent:
    def __init__(self, recall: bool = False, chunk_tokens: int = 4096, memory_tokens: int = 768,
                 max_tokens: int | None = None, answer_tokens: int = 64, question_tokens: int = 256,
                 context_tokens: int = 8192, count_tokens: TokenCounter | None = None):
        self.recall = recall
        self.method = "agent:memory+recall" if recall else "agent:memory"
        self.chunk_tokens, self.memory_tokens = chunk_tokens, memory_tokens
        self.max_tokens = max_tokens if max_tokens is not None else memory_tokens + 64
        self.answer_tokens, self.question_tokens, self.context_tokens = answer_tokens, question_tokens, context_tokens
        self.count = count_tokens or approx_tokens
        if min(chunk_tokens, memory_tokens, self.max_tokens, answer_tokens, question_tokens) < 8:
            raise ValueError(f"{self.method}: every token budget must be at least 8")
        worst = self.worst_case_tokens()
        if worst > context_tokens:
            raise ValueError(f"{self.method}: a chunk step may need {worst} tokens (prompt, question, notes"
                             f"{' x2' if recall else ''}, a {chunk_tokens}-token section, a {self.max_tokens}-token "
                             f"reply), more than context_tokens={context_tokens}: lower chunk_tokens or memory_tokens")

    _MSG = 16

    def instruction(self) -> str:
        words = max(10, int(self.memory_tokens * 0.6))
        return (INSTRUCTION_RECALL if self.recall else INSTRUCTION).format(words=words)

    def worst_case_tokens(self) -> int:
        fixed = self.count(CHUNK_PROMPT) + self.count(self.instruction()) + 48 + self._MSG
        recalled = self.count(RECALLED) + 64 + self.memory_tokens if self.recall else 0
        return fixed + self.question_tokens + self.memory_tokens + recalled + self.chunk_tokens + self.max_tokens

    # ------------------------------------------------------------------ prompts
    def sections(self, task: Task) -> list[tuple[Session, int, int]]:
        """(session, part, parts) per section, in order."""
        out = []
        for s in task.sessions:
            parts = split_section(s.text, self.chunk_tokens, self.count)
            out += [(Session(s.session_id, s.date, p), i, len(parts)) for i, p in enumerate(parts)]
        return out

    def _question(self, task: Task) -> tuple[str, str]:
        q = trim_to_tokens(task.question.strip(), self.question_tokens, self.count)
        return q, (f" (asked on {task.question_date})" if task.question_date else "")

    def chunk_message(self, task: Task, memory: str, recalled: str, section: Session, n: int, total: int,
                      part: int, parts: int) -> str:
        q, date = self._question(task)
        when = f", a conversation of {section.date}" if section.date else ", a conversation"
        if parts > 1:
            when += f" (piece {part + 1} of {parts} of it)"
        return CHUNK_PROMPT.format(date=date, question=q, memory=memory, recalled=recalled, n=n, total=total,
                                   when=when, section=section.text.rstrip("\n"), instruction=self.instruction())

    def answer_message(self, task: Task, memory: str, recalled: str) -> str:
        q, date = self._question(task)
        return ANSWER_PROMPT.format(memory=memory, recalled=recalled, date=date, question=q)

    # ------------------------------------------------------------------ the episode
    def episode(self, task: Task) -> Generator[Request, str, Result]:
        res = Result(answer=None, format_ok=True)
        memory = EMPTY_MEMORY
        states: list[str] = []      # memory after each chunk step (recall searches the earlier ones)
        recalled = ""
        secs = self.sections(task)
        chunk_stop = [STOP_RECALL] if self.recall else [STOP_MEMORY]
        for n, (sec, part, parts) in enumerate(secs, 1):
            content = self.chunk_message(task, memory, recalled, sec, n, len(secs), part, parts)
            req = Request(messages=[{"role": "user", "content": content}], stop=chunk_stop,
                          max_tokens=self.max_tokens, continues=False, kind="chunk",
                          meta={"chunk": n - 1, "chunks": len(secs), "session_id": sec.session_id,
                                "date": sec.date, "part": part, "parts": parts, "section": sec.text,
                                "memory": memory, "question_id": task.question_id})
            raw = yield req
            text = close_stop(raw or "", chunk_stop)
            p = parse_notes(text, self.recall)
            step = {"kind": "chunk", "session_id": sec.session_id, "reply": clip(text),
                    "est_prompt_tokens": self.count(content) + self._MSG}
            res.chunks += 1
            if p.problems:
                step["problems"] = p.problems
                res.format_ok = False
            if p.memory is not None:
                new = p.memory or EMPTY_MEMORY
                cut = trim_to_tokens(new, self.memory_tokens, self.count)
                if cut != new:
                    step["memory_truncated"] = True
                memory = cut
            states.append(memory)
            recalled = ""
            if self.recall and p.recall is not None:
                res.recalls += 1
                earlier = states[:-1]
                i = best_match(p.recall, earlier)
                step["recall"] = p.recall
                step["recalled_step"] = i
                q = clip(p.recall, 200)
                recalled = (RECALLED.format(query=q, state=earlier[i]) if i is not None
                            else NOTHING_RECALLED.format(query=q))
            res.steps.append(step)
        content = self.answer_message(task, memory, recalled)
        req = Request(messages=[{"role": "user", "content": content}], stop=[STOP_ANSWER],
                      max_tokens=self.answer_tokens, continues=False, kind="answer",
                      meta={"memory": memory, "question_id": task.question_id})
        raw = yield req
        text = close_stop(raw or "", [STOP_ANSWER])
        answer, problems = parse_answer(text)
        step = {"kind": "answer", "reply": clip(text), "est_prompt_tokens": self.count(content) + self._MSG}
        if problems:
            step["problems"] = problems
            res.format_ok = False
        res.steps.append(step)
        res.answer = answer
        if answer is None:
            res.format_ok = False
        return res

    # ------------------------------------------------------------------ warm start
    def oracle(self, task: Task, answer: str, evidence: Sequence[str]) -> Callable[[Request], str]:
        """A policy writing what a correct agent writes: on each section, the notes so far plus a note for
        every evidence line (:func:`gold_evidence`) found in it (unchanged notes when none is), kept within
        ``memory_tokens``; then ``<answer>{answer}</answer>``."""
        ev = [e for e in evidence if e]
        open_tag, close_tag = ("<update>", "</update>") if self.recall else ("<memory>", "</memory>")
        per_note = max(16, self.memory_tokens // max(1, len(ev)) - 4)

        def policy(req: Request) -> str:
            if req.kind == "answer":
                return f"<answer>{answer}</answer>"
            memory = req.meta.get("memory", EMPTY_MEMORY)
            section = req.meta.get("section", "")
            found = [e for e in ev if e in section]
            notes = [] if memory == EMPTY_MEMORY else memory.splitlines()
            for e in found:
                note = trim_to_tokens(note_of(e, req.meta.get("date")), per_note, self.count)
                if note not in notes:
                    notes.append(note)
            text = "\n".join(notes) if notes else EMPTY_MEMORY
            text = trim_to_tokens(text, self.memory_tokens, self.count)
            return f"{open_tag}{text}{close_tag}"

        return policy
