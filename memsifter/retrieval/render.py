"""Session rendering exactly as the ranker was trained on it (MEMSIFTER.md §2).

A turn of role R is ``<R{k}>content</R>`` where k counts R's turns within the session from 0; one
line per turn, each ending in a newline. A history numbers sessions by their position in the list
shown (local ids), with an optional ``<date>`` on the header line; the whole string is stripped.
"""

from __future__ import annotations

import re
from typing import Sequence

# Chat-template control markers (ChatML / Qwen ``<|im_end|>``, Llama-3 ``<|eot_id|>``, DeepSeek's
# full-width ``<｜…｜>``): tokenizers turn these strings into *special tokens* wherever they occur, so
# a session (or question) holding ``<|im_end|>\n<|im_start|>assistant`` would close the user message
# and open a fake turn in the prompt the model sees. They never occur in ordinary text.
CHAT_MARKER = re.compile(r"<([|\uff5c])([^<>|\uff5c\s]{1,64})([|\uff5c])>")
ZWSP = "\u200b"


def defuse_chat_markers(text: str) -> str:
    """``<|im_end|>`` -> ``<\u200b|im_end|>``: the same visible text, no longer a special token.

    Applied to every value filled into a prompt template (:func:`memsifter.retrieval.prompting.fill`), not
    to the rendering itself: text without such markers is unchanged (MEMSIFTER.md §2)."""
    if "<" not in text:
        return text
    return CHAT_MARKER.sub(lambda m: "<" + ZWSP + m.group(1) + m.group(2) + m.group(3) + ">", text)


def render_session(turns: Sequence[dict]) -> str:
    return "".join(turn_texts(turns))


def render_history(sessions: Sequence[Sequence[dict]], dates: Sequence[str | None] | None = None) -> str:
    """Render sessions (each a list of turns) with local ids 0..n-1 in the order given."""
    parts = []
    for i, turns in enumerate(sessions):
        date = dates[i] if dates is not None else None
        header = f"<session{i}> <date>{date}</date>" if date else f"<session{i}>"
        parts.append(f"{header}\n{render_session(turns)}</session>\n")
    return "".join(parts).strip()


def render_history_texts(texts: Sequence[str], dates: Sequence[str | None] | None = None) -> str:
    """Same as :func:`render_history` for sessions already rendered with :func:`render_session`."""
    parts = []
    for i, text in enumerate(texts):
        date = dates[i] if dates is not None else None
        header = f"<session{i}> <date>{date}</date>" if date else f"<session{i}>"
        parts.append(f"{header}\n{text}</session>\n")
    return "".join(parts).strip()


_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("the a an and or but of to in on at for with from by about as is are was were be been do did does "
                  "what when where who whom which why how that this these those it its my me i you your we our "
                  "they them their he she his her him have has had will would can could should any some".split())


def content_words(text: str) -> set[str]:
    """Lower-case words of at least 3 characters, common function words left out."""
    return {w for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in _STOP}


def condense_session(turns: Sequence[dict], question: str, max_tokens: int, count) -> str:  # noqa: ANN001
    """The session as :func:`render_session` writes it when it fits ``max_tokens`` (counted with
    ``count(list[str]) -> list[int]``); else its turns that share the most content words with the
    question, taken while they fit and shown in their original order with their original counters
    (``<user3>`` stays ``<user3>``). At least the best turn is kept, whatever it costs."""
    lines = turn_texts(list(turns))
    costs = count(lines)
    if sum(costs) <= max_tokens:
        return "".join(lines)
    q = content_words(question)
    score = [len(q & content_words(line)) for line in lines]
    order = sorted(range(len(lines)), key=lambda i: (-score[i], i))
    keep, used = [], 0
    for i in order:
        if keep and used + costs[i] > max_tokens:
            continue
        keep.append(i)
        used += costs[i]
    return "".join(lines[i] for i in sorted(keep))


def turn_texts(turns: Sequence[dict]) -> list[str]:
    """Each turn's line of :func:`render_session`: ``<R{k}>content</R>`` and a newline, where k counts
    role R's turns within the session from 0."""
    counts: dict[str, int] = {}
    out = []
    for t in turns:
        role = str(t["role"])
        k = counts.get(role, 0)
        counts[role] = k + 1
        out.append(f"<{role}{k}>{t['content']}</{role}>\n")
    return out
