"""The first stage's scoring: BM25 views of a haystack, the dense leg over the lexical top sessions, and
their fusions (``cascade``, ``zsum``); what the ``embed`` stage publishes and the memory service serves per
query, with this one code (MEMSIFTER.md §3; why each method and default: :mod:`memsifter.stages.embed`).

A haystack's sessions are scored for one question: :class:`HaystackLexical` (its BM25 views, indexed
once), then :func:`rescored_scores` (the dense leg asked only for the lexical top sessions), together
:func:`score_haystack`. :func:`order_by` turns scores into the ranked order (ties: haystack order).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..data.model import Session
from .render import render_session, turn_texts

ZSUM_K = 15   # issue 34: the deepest lexical top-k within the 5-min cost bound (memsifter.stages.embed)

def chunk_texts(turns: list[dict], size: int, stride: int) -> list[str]:
    """Windows of ``size`` consecutive turns (rendered as in the whole session, so turn counters
    keep their values), ``stride`` apart; the last window ends at the last turn."""
    lines = turn_texts(turns)
    if len(lines) <= size:
        return ["".join(lines)]
    starts = list(range(0, len(lines) - size + 1, stride))
    if starts[-1] != len(lines) - size:
        starts.append(len(lines) - size)
    return ["".join(lines[s:s + size]) for s in starts]




MAX_PIECES = 32   # pieces of one turn that are embedded (32 x 200 words); the rest of a huge turn is not


def split_words(text: str, words: int, max_pieces: int | None = None) -> list[str]:
    """``text`` whole when it has at most ``words`` words, else consecutive pieces of ``words`` words
    (at most ``max_pieces`` of them: a 50 MB turn must not become 100k texts to embed)."""
    w = text.split()
    if len(w) <= words:
        return [text.strip()]
    stop = len(w) if max_pieces is None else min(len(w), words * max_pieces)
    return [" ".join(w[i:i + words]) for i in range(0, stop, words)]


def turn_units(turns: list[dict], words: int, max_pieces: int | None = MAX_PIECES) -> list[str]:
    """The units of ``turns`` (multi-vector max-sim, BM25 windows): ``"<speaker>: <content>"`` per
    turn, long turns split into pieces of at most ``words`` words (at most ``max_pieces`` per turn),
    each with its speaker."""
    out = [f"{t['role']}: {piece}" for t in turns
           for piece in split_words(str(t["content"]), words, max_pieces)]
    return out or [""]




_WORD = re.compile(r"[a-z0-9]+")


def s_stem(word: str) -> str:
    """Harman's S-stemmer (1991): plural endings only (-ies -> -y, -es -> -e, -s -> ''), with its
    exceptions; a fixed rule, nothing fitted."""
    if len(word) > 3 and word.endswith("ies") and not word.endswith(("eies", "aies")):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
        return word[:-1]
    if len(word) > 2 and word.endswith("s") and not word.endswith(("us", "ss")):
        return word[:-1]
    return word


def bm25_tokens(text: str, stop: frozenset[str], stem: bool = False) -> list[str]:
    words = [w for w in _WORD.findall(text.lower()) if w not in stop]
    return [s_stem(w) for w in words] if stem else words


def cascade_units(turns: list[dict], words: int) -> list[str]:
    """What the cascade embeds of a session: the units (:func:`turn_units`) of every turn not spoken by
    the assistant (role ``assistant``, any case); all units when the session has no such turn."""
    own = [t for t in turns if str(t["role"]).strip().lower() != "assistant"]
    return turn_units(own or turns, words)


def rrf(rank_lists: list[list[int]], n: int, k: int) -> np.ndarray:
    """Reciprocal-rank-fusion scores for items 0..n-1 given several rankings (best first)."""
    score = np.zeros(n)
    for order in rank_lists:
        for r, i in enumerate(order):
            score[i] += 1.0 / (k + r + 1)
    return score


def bm25_index(docs: list[list[str]]):  # noqa: ANN201 - a bm25s.BM25
    """A BM25 index (bm25s defaults) of tokenised documents (an empty one indexed as ``<empty>``)."""
    import bm25s

    retriever = bm25s.BM25()
    retriever.index([d or ["<empty>"] for d in docs], show_progress=False)
    return retriever


def bm25_query(retriever, n: int, question: str, stop: frozenset[str], stem: bool = False) -> np.ndarray:  # noqa: ANN001
    """BM25 of each of the ``n`` documents of ``retriever`` for the question; zeros when no question
    word occurs in the documents."""
    qt = [w for w in bm25_tokens(question, stop, stem) if w in retriever.vocab_dict]
    return np.asarray(retriever.get_scores(qt), dtype=float) if qt else np.zeros(n)


def bm25_scores(docs: list[list[str]], question: str, stop: frozenset[str], stem: bool = False) -> np.ndarray:
    """BM25 (bm25s defaults) of each tokenised document for the question; zeros when no question
    word occurs in the documents."""
    return bm25_query(bm25_index(docs), len(docs), question, stop, stem)


def max_per_owner(values: np.ndarray, owner: list[int], n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, np.asarray(owner, dtype=int), values)
    return out


def order_by(scores: np.ndarray) -> list[int]:
    """Indices by descending score; ties keep haystack (chronological) order: deterministic."""
    return sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))


class Lexical:
    """The BM25 views of haystacks drawn from ``sessions`` (id -> :class:`memsifter.data.model.Session`, or a
    :class:`memsifter.data.model.Dataset`: its sessions), word lists cached per session (a session's tokens do
    not depend on the question; its date does, and is added per question)."""

    def __init__(self, sessions: Mapping[str, Session] | Any, words: int, stem: bool):
        from bm25s.stopwords import STOPWORDS_EN

        self.sessions: Mapping[str, Session] = getattr(sessions, "sessions", sessions)
        self.words, self.stem = words, stem
        self.stop = frozenset(STOPWORDS_EN)
        self._session: dict[str, list[str]] = {}
        self._units: dict[str, list[list[str]]] = {}

    def _tok(self, text: str) -> list[str]:
        return bm25_tokens(text, self.stop, self.stem)

    def _load(self, sid: str) -> None:
        if sid not in self._session:
            turns = self.sessions[sid].turns
            self._session[sid] = self._tok(render_session(turns))
            self._units[sid] = [self._tok(u) for u in turn_units(turns, self.words)]

    def index(self, hay: list[str], dates: list[str | None],
              views: Iterable[str] = ("bm25", "bm25_dated", "bm25_window")) -> "HaystackLexical":
        """The BM25 views of the sessions ``hay`` (ids of ``sessions``), each with its date."""
        for s in hay:
            self._load(s)
        return HaystackLexical([self._session[s] for s in hay], [self._units[s] for s in hay],
                               [self._tok(d or "") for d in dates], self.stop, self.stem, views)

    def scores(self, q) -> dict[str, np.ndarray]:
        """``bm25`` (sessions rendered as in §2), ``bm25_dated`` (date + ``"<speaker>: <content>"``
        lines) and ``bm25_window`` (best window of three consecutive units, with the date)."""
        hay = q.haystack_session_ids
        return self.index(hay, [q.date_of(s, self.sessions) for s in hay]).scores(q.question)


class HaystackLexical:
    """The BM25 views of one haystack, indexed once (a view's documents do not depend on the question):
    :meth:`scores` of any question over it. The embed stage builds one per question (:class:`Lexical`);
    the retrieval service (:mod:`memsifter.service`) keeps one per corpus, so both score with this code.

    ``session_tokens``: per session, its words as rendered (§2); ``unit_tokens``: per session, the words
    of each of its units (:func:`turn_units`); ``date_tokens``: per session, the words of its date."""

    def __init__(self, session_tokens: list[list[str]], unit_tokens: list[list[list[str]]],
                 date_tokens: list[list[str]], stop: frozenset[str], stem: bool,
                 views: Iterable[str] = ("bm25", "bm25_dated", "bm25_window")):
        views = set(views)
        self.n, self.stop, self.stem = len(session_tokens), stop, stem
        self.views: dict = {}
        if "bm25" in views:
            self.views["bm25"] = bm25_index(session_tokens)
        if "bm25_dated" in views:
            self.views["bm25_dated"] = bm25_index([d + [w for u in ut for w in u]
                                                   for d, ut in zip(date_tokens, unit_tokens)])
        self.owner: list[int] = []
        if "bm25_window" in views:
            windows = []
            for i, (d, ut) in enumerate(zip(date_tokens, unit_tokens)):
                for j in range(len(ut)):
                    windows.append(d + [w for u in ut[max(0, j - 1):j + 2] for w in u])
                    self.owner.append(i)
            self.views["bm25_window"] = bm25_index(windows)

    def scores(self, question: str) -> dict[str, np.ndarray]:
        """Per view, the score of each session (``bm25_window``: its best window)."""
        out = {}
        for view in ("bm25", "bm25_dated"):
            if view in self.views:
                out[view] = bm25_query(self.views[view], self.n, question, self.stop, self.stem)
        if "bm25_window" in self.views:
            out["bm25_window"] = max_per_owner(bm25_query(self.views["bm25_window"], len(self.owner), question,
                                                          self.stop, self.stem), self.owner, self.n)
        return out


LEXICAL_LEGS = ("bm25_dated", "bm25_window")


def cascade_candidates(lexical: dict[str, np.ndarray], k: int, rrf_k: int) -> list[int]:
    """The cascade's first step: the top ``k`` sessions of RRF(bm25_dated, bm25_window)."""
    n = len(lexical["bm25_dated"])
    return order_by(rrf([order_by(lexical[m]) for m in LEXICAL_LEGS], n, rrf_k))[:k]


def cascade_scores(lexical: dict[str, np.ndarray], candidates: list[int], dense: dict[int, float],
                   rrf_k: int) -> np.ndarray:
    """RRF of ``bm25_dated``, ``bm25_window`` and the dense order of the candidates (sessions outside
    the candidates get nothing from that leg)."""
    n = len(lexical["bm25_dated"])
    dense_order = sorted(candidates, key=lambda i: (-dense[i], i))
    return rrf([order_by(lexical[m]) for m in LEXICAL_LEGS] + [dense_order], n, rrf_k)


def zscore(x: np.ndarray) -> np.ndarray:
    """``(x - mean) / std`` over one haystack (zeros when every score is the same); non-finite scores
    count as the lowest finite one."""
    x = np.asarray(x, dtype=float)
    finite = np.isfinite(x)
    if not finite.any():
        return np.zeros(len(x))
    x = np.where(finite, x, x[finite].min())
    sd = float(x.std())
    return (x - x.mean()) / sd if sd > 0 else np.zeros(len(x))


def zsum_scores(lexical: dict[str, np.ndarray], candidates: list[int], dense: dict[int, float]) -> np.ndarray:
    """Score fusion (CombSUM of z-scores, one equal vote per leg): z(``bm25_dated``) + z(``bm25_window``)
    + z(dense), each z-scored over the question's haystack. The dense leg is the max-sim of the
    candidates; a session outside them counts as the lowest candidate (not re-scored, so assumed no
    better)."""
    n = len(lexical["bm25_dated"])
    floor = min(dense[i] for i in candidates) if candidates else 0.0
    leg = np.array([dense.get(i, floor) for i in range(n)], dtype=float)
    return sum(zscore(lexical[m]) for m in LEXICAL_LEGS) + zscore(leg)


def rescored_scores(lexical: dict[str, np.ndarray], max_sim: Callable[[int], float], *, cascade_k: int = 0,
                    zsum_k: int = 0, rrf_k: int = 60) -> dict[str, np.ndarray]:
    """``cascade`` (``cascade_k`` > 0) and ``zsum`` (``zsum_k`` > 0) of one question over its haystack:
    the dense leg ``max_sim(i)`` (the max-sim of the question vector over haystack session ``i``'s
    :func:`cascade_units`) is asked only for the lexical top max(cascade_k, zsum_k) sessions
    (:func:`cascade_candidates`), and each method takes its own prefix of them."""
    k = max(cascade_k, zsum_k)
    if not k:
        return {}
    cand = cascade_candidates(lexical, k, rrf_k)   # the top of one lexical order: each top k is a prefix
    dense = {i: max_sim(i) for i in cand}
    out = {}
    if cascade_k:
        top = cand[:cascade_k]
        out["cascade"] = cascade_scores(lexical, top, {i: dense[i] for i in top}, rrf_k)
    if zsum_k:
        top = cand[:zsum_k]
        out["zsum"] = zsum_scores(lexical, top, {i: dense[i] for i in top})
    return out


def score_haystack(question: str, lexical: HaystackLexical, max_sim: Callable[[int], float], *,
                   cascade_k: int = 0, zsum_k: int = 0, rrf_k: int = 60) -> dict[str, np.ndarray]:
    """One question against one haystack: its BM25 views (:meth:`HaystackLexical.scores`), then
    :func:`rescored_scores`. What the embed stage computes for a question, in two passes (the BM25
    views of every question first, to know which units to embed), and what the retrieval service
    computes per query."""
    scores = lexical.scores(question)
    scores.update(rescored_scores(scores, max_sim, cascade_k=cascade_k, zsum_k=zsum_k, rrf_k=rrf_k))
    return scores
