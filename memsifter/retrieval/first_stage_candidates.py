"""First-stage candidates measured against the embed stage's default (issue 42 item 5), none needing an LLM
at query time. ``benchmarks/first_stage_cv.py`` cross-validates them; nothing here is fitted and nothing here
is the default (the default's code is the first stage's: ``zsum_scores``, ``cascade_candidates``,
``cascade_units`` and the BM25 tokens, ``memsifter.retrieval.first_stage``, formerly ``memsifter.stages.embed``).

- :class:`Legs`: the default's two BM25 legs (``bm25_dated``, ``bm25_window``) of one haystack with a chosen
  BM25 ``k1`` / ``b`` (the default: bm25s' 1.5 / 0.75), over units counted with or without **phrase keys**
  (:func:`counts`: every pair of adjacent words of a unit, after stop words, as one more token, in the
  documents and in the question), scored for a *weighted* query so that expansion terms can be added.
- :func:`rm3_terms`: **pseudo-relevance feedback** (RM3-style): the terms of the top ``docs`` sessions of a
  first ranking, each weighted by its mean relative frequency in them times its idf over the haystack, the
  question's own terms left out; :func:`expanded` interpolates the question (weight 1 - ``lam``) with the
  ``terms`` best of them (weight ``lam``), as RM3 interpolates the query model.
- :func:`pair_units`: **window units** for the dense leg: each unit followed by the next unit of the same
  turns (what :func:`cascade_units` embeds: the user's in LongMemEval, both speakers' in LoCoMo), so the
  words of a question and of its answer in the next turn meet in one vector.
- :func:`dense_pool`: the sessions the dense leg re-scores: the lexical top ``k``, or **every session** when
  the haystack has at most ``small`` sessions (LoCoMo conversations have 19-35, LongMemEval_S 38-56).

Round 3 (``R3``, ``first_stage_cv.py --set 2026-11-27-r3``): :func:`weighted` (the default's fusion with the dense
leg's vote weighted, or with more legs), the **turn-level leg** ``bm25_unit`` of :meth:`Legs.scores` (a session's
best single unit), a **deeper dense pool** (top 20), each alone and with Porter keys and BM25 k1 / b.
"""
from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from typing import Callable

import numpy as np

from . import first_stage as E   # the first stage's scoring (issue 45 item 1: out of the embed stage)


def phrase_tokens(tokens: list[str]) -> list[str]:
    """``tokens`` and, after them, each adjacent pair joined by ``_`` (a phrase key)."""
    return tokens + [f"{a}_{b}" for a, b in zip(tokens, tokens[1:])]


class Legs:
    """``bm25_dated`` and ``bm25_window`` of one haystack, the documents the embed stage's
    :class:`~memsifter.retrieval.first_stage.HaystackLexical` indexes (a session's date + its units; each window of three
    consecutive units + the date), scored with BM25 ``k1`` / ``b`` as chosen. BM25 is
    bm25s' Lucene variant computed here term by term (idf log(1 + (N - df + 0.5) / (df + 0.5)), tf / (tf + k1
    (1 - b + b dl / avgdl)); an empty document has length 1), so that a question can carry term weights and
    a grid of ``k1`` / ``b`` costs no re-indexing. ``unit_counts``: per session, a Counter of each unit's
    tokens; ``date_counts``: per session, a Counter of its date's tokens."""

    def __init__(self, unit_counts: list[list[Counter]], date_counts: list[Counter]):
        self.n = len(unit_counts)
        self.units = [u for us in unit_counts for u in us]
        self.unit_session = np.array([i for i, us in enumerate(unit_counts) for _ in us])
        self.owner = list(self.unit_session)
        self.dates = date_counts
        ulen = np.array([sum(u.values()) for u in self.units], dtype=float)
        dlen = np.array([sum(d.values()) for d in date_counts], dtype=float)
        first = np.zeros(len(self.units), dtype=bool)
        last = np.zeros(len(self.units), dtype=bool)
        start = 0
        for us in unit_counts:
            first[start], last[start + len(us) - 1] = True, True
            start += len(us)
        self._first, self._last = first, last
        self.len = {"bm25_dated": np.maximum(np.bincount(self.unit_session, ulen, self.n) + dlen, 1),
                    "bm25_window": np.maximum(self._window(ulen) + dlen[self.unit_session], 1),
                    "bm25_unit": np.maximum(ulen + dlen[self.unit_session], 1)}
        self._tfs: dict[str, dict[str, np.ndarray]] = {}
        self._cache: dict[tuple, np.ndarray] = {}

    def _window(self, per_unit: np.ndarray) -> np.ndarray:
        """Per unit, the sum over its window (the unit before, itself, the one after, within its session)."""
        prev = np.where(self._first, 0, np.roll(per_unit, 1))
        nxt = np.where(self._last, 0, np.roll(per_unit, -1))
        return per_unit + prev + nxt

    def _tf(self, term: str) -> dict[str, np.ndarray]:
        tu = np.array([u.get(term, 0) for u in self.units], dtype=float)
        td = np.array([d.get(term, 0) for d in self.dates], dtype=float)
        return {"bm25_dated": np.bincount(self.unit_session, tu, self.n) + td,
                "bm25_window": self._window(tu) + td[self.unit_session],
                "bm25_unit": tu + td[self.unit_session]}

    def _term(self, view: str, term: str, k1: float, b: float) -> np.ndarray:
        """BM25 of one term in each document of ``view`` (cached: expansions and grids share terms)."""
        key = (view, term, k1, b)
        if key not in self._cache:
            if term not in self._tfs:
                self._tfs[term] = self._tf(term)
            tf, dl = self._tfs[term][view], self.len[view]
            df = float((tf > 0).sum())
            idf = math.log(1 + (len(dl) - df + 0.5) / (df + 0.5))
            self._cache[key] = (idf * tf / (tf + k1 * (1 - b + b * dl / dl.mean())) if df
                                else np.zeros(len(dl)))
        return self._cache[key]

    def scores(self, terms: dict[str, float], k1: float = 1.5, b: float = 0.75,
               unit: bool = False) -> dict[str, np.ndarray]:
        """Per leg, each session's score for the weighted query ``terms``: the sum of the terms' BM25 scores
        times their weights (with counts as weights, BM25 of the question); ``bm25_window``: a session's best
        window; with ``unit``, also ``bm25_unit``: a session's best single unit (a turn, or a piece of a long
        one, with the session's date), BM25 over the haystack's units."""
        dated = np.zeros(self.n)
        window = np.zeros(len(self.units))
        one = np.zeros(len(self.units))
        for t, w in terms.items():
            dated += w * self._term("bm25_dated", t, k1, b)
            window += w * self._term("bm25_window", t, k1, b)
            if unit:
                one += w * self._term("bm25_unit", t, k1, b)
        out = {"bm25_dated": dated, "bm25_window": E.max_per_owner(window, self.owner, self.n)}
        if unit:
            out["bm25_unit"] = E.max_per_owner(one, self.owner, self.n)
        return out

    def session_counts(self) -> list[Counter]:
        """Per session, the tokens of its ``bm25_dated`` document."""
        out = [Counter(d) for d in self.dates]
        for u, i in zip(self.units, self.unit_session):
            out[i].update(u)
        return out


def counts(tokens: list[str], phrases: bool) -> Counter:
    """A unit's (or a question's) tokens as counts, with its phrase keys when ``phrases``."""
    return Counter(phrase_tokens(tokens) if phrases else tokens)


def rm3_terms(legs: Legs, feedback: list[int], query: dict[str, float], docs: int = 3,
              terms: int = 10) -> dict[str, float]:
    """The ``terms`` best expansion terms from the first ``docs`` sessions of ``feedback`` (a ranking):
    weight = mean over those sessions of (term frequency / session length) x log(N / df) over the haystack's
    ``bm25_dated`` documents; the question's terms and terms in every session are left out; weights sum to 1."""
    corpus = legs.session_counts()
    df = Counter(t for d in corpus for t in d)
    n = len(corpus)
    score: Counter = Counter()
    for i in feedback[:docs]:
        size = sum(corpus[i].values())
        for t, c in corpus[i].items():
            if t not in query and df[t] < n:
                score[t] += c / size * math.log(n / df[t]) / docs
    best = sorted(score.items(), key=lambda kv: (-kv[1], kv[0]))[:terms]
    total = sum(w for _, w in best)
    return {t: w / total for t, w in best} if total > 0 else {}


def expanded(query: dict[str, float], expansion: dict[str, float], lam: float) -> dict[str, float]:
    """RM3's interpolation: (1 - lam) x the question (its terms' weights over their sum) + lam x the expansion,
    scaled by the question's total weight (a z-scored leg does not see the scale)."""
    q = sum(query.values())
    out = {t: (1 - lam) * w for t, w in query.items()}
    for t, w in expansion.items():
        out[t] = out.get(t, 0.0) + lam * w * q
    return out


def pair_units(turns: list[dict], words: int) -> list[str]:
    """Each unit of :func:`cascade_units` joined with the next one (none for a session of one unit)."""
    units = E.cascade_units(turns, words)
    return [f"{a}\n{b}" for a, b in zip(units, units[1:])]


def dense_pool(lexical: dict[str, np.ndarray], k: int, rrf_k: int, small: int = 0) -> list[int]:
    """The sessions the dense leg re-scores: every session when the haystack has at most ``small``, else the
    lexical top ``k`` (:func:`cascade_candidates`)."""
    n = len(lexical["bm25_dated"])
    if n <= small:
        return E.order_by(E.rrf([E.order_by(lexical[m]) for m in E.LEXICAL_LEGS], n, rrf_k))
    return E.cascade_candidates(lexical, k, rrf_k)


def zsum(lexical: dict[str, np.ndarray], pool: list[int], sim: Callable[[int], float]) -> np.ndarray:
    """The default's fusion (:func:`zsum_scores`) with the dense leg ``sim`` over ``pool``."""
    return E.zsum_scores(lexical, pool, {j: sim(j) for j in pool})


def top2(sims: np.ndarray) -> float:
    """The mean of the two best similarities (the one there is, for a single unit)."""
    v = np.sort(np.asarray(sims, dtype=float))[::-1]
    return float(v[:2].mean())


# ---------------------------------------------------------------- one question, as the candidates see it
RRF_K, WORDS, K = 60, 200, 15


@lru_cache(maxsize=None)
def porter(word: str) -> str:
    """Porter's stemmer (nltk's, as LoCoMo's own evaluation uses) of one word."""
    return _porter().stem(word)


@lru_cache(maxsize=1)
def _porter():  # noqa: ANN202 - nltk's PorterStemmer, made once
    from nltk.stem import PorterStemmer

    return PorterStemmer()


class Tokens:
    """Per session, the BM25 tokens of each unit (:func:`memsifter.retrieval.first_stage.turn_units`) as counts, with and
    without phrase keys, stemmed as the stage does (the S-stemmer, plurals only) or with Porter's stemmer
    (``porter``: "researching" and "research", "camped" and "camping" become one word); a session's tokens do
    not depend on the question: kept across questions."""

    def __init__(self, ds):
        from bm25s.stopwords import STOPWORDS_EN

        self.ds, self.stop = ds, frozenset(STOPWORDS_EN)
        self._units: dict[tuple[str, bool, bool], list[Counter]] = {}

    def tokens(self, text: str, porter_stem: bool = False) -> list[str]:
        if porter_stem:
            return [porter(w) for w in E.bm25_tokens(text, self.stop, stem=False)]
        return E.bm25_tokens(text, self.stop, stem=True)

    def units(self, sid: str, phrases: bool, porter_stem: bool = False) -> list[Counter]:
        key = (sid, phrases, porter_stem)
        if key not in self._units:
            self._units[key] = [counts(self.tokens(u, porter_stem), phrases)
                                for u in E.turn_units(self.ds.sessions[sid].turns, WORDS)]
        return self._units[key]


class Ctx:
    """One question for the candidates: ``lexical``, the embed stage's BM25 legs of it (``Lexical.scores``); the
    default's dense pool; ``texts_sims(texts)``, the cosine of the question with each text (the driver's
    vectors; or a recorder that notes which texts a candidate needs). Legs and lexical scores are shared by
    :meth:`fork`; similarities are not (each fork records its own texts)."""

    def __init__(self, q, ds, lexical: dict[str, np.ndarray], tokens: Tokens,
                 texts_sims: Callable[[list[str]], np.ndarray], shared: dict | None = None):
        self.q, self.ds, self.lexical, self.tok, self.texts_sims = q, ds, lexical, tokens, texts_sims
        self.hay = q.haystack_session_ids
        self.shared = {} if shared is None else shared
        self._sims: dict = {}

    def fork(self, texts_sims: Callable[[list[str]], np.ndarray]) -> "Ctx":
        return Ctx(self.q, self.ds, self.lexical, self.tok, texts_sims, self.shared)

    def legs(self, phrases: bool = False, porter_stem: bool = False) -> Legs:
        key = ("legs", phrases, porter_stem)
        if key not in self.shared:
            dates = [Counter(self.tok.tokens(self.q.date_of(s, self.ds.sessions) or "", porter_stem))
                     for s in self.hay]
            self.shared[key] = Legs([self.tok.units(s, phrases, porter_stem) for s in self.hay], dates)
        return self.shared[key]

    def terms(self, phrases: bool = False, porter_stem: bool = False) -> dict[str, float]:
        return dict(counts(self.tok.tokens(self.q.question, porter_stem), phrases))

    def pool(self) -> list[int]:
        return dense_pool(self.lexical, K, RRF_K)

    def texts(self, j: int, kind: str) -> list[str]:
        turns = self.ds.sessions[self.hay[j]].turns
        return E.cascade_units(turns, WORDS) if kind == "units" else pair_units(turns, WORDS)

    def sims(self, j: int, kind: str = "units") -> np.ndarray:
        """The question's cosine with each text of session ``j``: ``units`` (what the default embeds) or
        ``pairs`` (:func:`pair_units`)."""
        if (j, kind) not in self._sims:
            t = self.texts(j, kind)
            self._sims[(j, kind)] = self.texts_sims(t) if t else np.zeros(0)
        return self._sims[(j, kind)]

    def maxsim(self, j: int) -> float:
        return float(self.sims(j).max())

    def default(self) -> np.ndarray:
        """The embed stage's default, ``zsum`` with k = 15."""
        if "default" not in self._sims:
            self._sims["default"] = zsum(self.lexical, self.pool(), self.maxsim)
        return self._sims["default"]


# ---------------------------------------------------------------- the candidates of 2026-11-27
def _pairs(c: Ctx) -> np.ndarray:
    def sim(j: int) -> float:
        p = c.sims(j, "pairs")
        return max(c.maxsim(j), float(p.max()) if len(p) else -np.inf)
    return zsum(c.lexical, c.pool(), sim)


def _rm3(docs: int, lam: float, terms: int = 10) -> Callable[[Ctx], np.ndarray]:
    def run(c: Ctx) -> np.ndarray:
        legs, q = c.legs(), c.terms()
        ex = rm3_terms(legs, E.order_by(c.default()), q, docs, terms)
        return zsum(legs.scores(expanded(q, ex, lam)), c.pool(), c.maxsim)
    return run


def _bm25(k1: float, b: float) -> Callable[[Ctx], np.ndarray]:
    return lambda c: zsum(c.legs().scores(c.terms(), k1, b), c.pool(), c.maxsim)


def _porter_legs(c: Ctx) -> dict[str, np.ndarray]:
    return c.legs(porter_stem=True).scores(c.terms(porter_stem=True))


DEFAULT = "zsum k=15 (default)"
GRID = [(k1, b) for k1 in (0.9, 1.2, 1.5, 2.0) for b in (0.5, 0.75, 0.9) if (k1, b) != (1.5, 0.75)]
CANDIDATES: dict[str, Callable[[Ctx], np.ndarray]] = {
    DEFAULT: lambda c: c.default(),
    "dense top-2": lambda c: zsum(c.lexical, c.pool(), lambda j: top2(c.sims(j))),
    "dense all (<= 30 sessions)": lambda c: zsum(c.lexical, dense_pool(c.lexical, K, RRF_K, small=2 * K),
                                                 c.maxsim),
    "dense pairs": _pairs,
    "rm3 (3 docs, λ 0.5)": _rm3(3, 0.5),
    "rm3 (5 docs, λ 0.3)": _rm3(5, 0.3),
    "phrase keys": lambda c: zsum(c.legs(True).scores(c.terms(True)), c.pool(), c.maxsim),
    "porter keys": lambda c: zsum(_porter_legs(c), c.pool(), c.maxsim),
    "porter keys, own pool": lambda c: zsum(_porter_legs(c), dense_pool(_porter_legs(c), K, RRF_K), c.maxsim),
    **{f"bm25 k1={k1} b={b}": _bm25(k1, b) for k1, b in GRID},
}
DESCRIPTIONS = {
    DEFAULT: "the embed stage's default: z(bm25_dated) + z(bm25_window) + z(max-sim over the non-assistant units "
             "of the lexical top 15)",
    "dense top-2": "the default, the dense leg the mean of a session's two best units (2026-11-26's candidate)",
    "dense all (<= 30 sessions)": "the default, the dense leg over every session when the haystack has at most 30 "
                                  "(LoCoMo: every session; LongMemEval_S: unchanged)",
    "dense pairs": "the default, the dense leg the max over the units and the pairs of adjacent units (window "
                   "units; embeds the pairs of the same 15 sessions)",
    "rm3 (3 docs, λ 0.5)": "both BM25 legs with the question expanded by 10 terms of the default's top 3 sessions "
                           "(RM3, original weight 0.5); the default's dense leg",
    "rm3 (5 docs, λ 0.3)": "the same from the top 5 sessions, expansion weight 0.3",
    "phrase keys": "both BM25 legs over the words and the adjacent word pairs (phrase keys) of units and question; "
                   "the default's dense leg",
    "porter keys": "both BM25 legs over Porter-stemmed words (the stage: the S-stemmer, plurals only); the default's "
                   "dense leg (the default's lexical top 15)",
    "porter keys, own pool": "the same, the dense leg over the top 15 of its own lexical order (what the stage would "
                             "embed with Porter keys)",
    **{f"bm25 k1={k1} b={b}": f"both BM25 legs with k1 = {k1}, b = {b} (default 1.5 / 0.75); the default's dense leg"
       for k1, b in GRID},
}


# ---------------------------------------------------------------- the candidates of 2026-11-27, third round
def weighted(lexical: dict[str, np.ndarray], pool: list[int], sim: Callable[[int], float], dense: float = 1.0,
             extra: tuple[str, ...] = ()) -> np.ndarray:
    """The default's fusion with the dense leg's z-score weighted ``dense`` (1: :func:`zsum` itself) and one equal
    vote more for each leg of ``lexical`` named in ``extra`` (z-scored over the haystack as the others)."""
    sims = {j: sim(j) for j in pool}
    out = E.zsum_scores(lexical, pool, sims)
    if dense != 1.0:   # the dense leg alone: the same fusion with both BM25 legs silent (z of a constant is 0)
        silent = {m: np.zeros(len(lexical["bm25_dated"])) for m in E.LEXICAL_LEGS}
        out = out + (dense - 1.0) * E.zsum_scores(silent, pool, sims)
    return out + sum((E.zscore(lexical[m]) for m in extra), np.zeros(len(out)))


def _porter_scores(c: Ctx, k1: float = 1.5, b: float = 0.75, unit: bool = False) -> dict[str, np.ndarray]:
    return c.legs(porter_stem=True).scores(c.terms(porter_stem=True), k1, b, unit)


def _r3(porter_keys: bool = False, dense: float = 1.0, unit: bool = False, k: int = K, k1: float = 1.5,
        b: float = 0.75) -> Callable[[Ctx], np.ndarray]:
    """One round-3 candidate: the BM25 legs (the stage's, or over Porter keys with ``k1`` / ``b``), the dense pool
    (the default's; with Porter keys the top ``k`` of their own lexical order), the dense weight, the unit leg."""
    def run(c: Ctx) -> np.ndarray:
        if porter_keys:
            lex = _porter_scores(c, k1, b, unit)
            pool = dense_pool(lex, k, RRF_K)
        else:
            lex = {**c.lexical, **({"bm25_unit": c.legs().scores(c.terms(), unit=True)["bm25_unit"]} if unit else {})}
            pool = dense_pool(c.lexical, k, RRF_K)
        return weighted(lex, pool, c.maxsim, dense, ("bm25_unit",) if unit else ())
    return run


P = "porter keys, own pool"
R3: dict[str, tuple[Callable[[Ctx], np.ndarray], str]] = {
    DEFAULT: (lambda c: c.default(), DESCRIPTIONS[DEFAULT]),
    P: (_r3(True), "both BM25 legs over Porter-stemmed words, the dense leg over the top 15 of their own lexical "
                   "order (2026-11-27's fold-A pick)"),
    "dense x0.5": (_r3(dense=0.5), "the default with the dense leg's z-score weighted 0.5 (the BM25 legs 1 each)"),
    "dense x1.5": (_r3(dense=1.5), "the default with the dense leg's z-score weighted 1.5"),
    "dense x2": (_r3(dense=2.0), "the default with the dense leg's z-score weighted 2 (as much as both BM25 legs)"),
    f"{P}, dense x1.5": (_r3(True, 1.5), "Porter keys, own pool, the dense leg weighted 1.5"),
    f"{P}, dense x2": (_r3(True, 2.0), "Porter keys, own pool, the dense leg weighted 2"),
    "unit leg": (_r3(unit=True), "the default + z(bm25_unit): BM25 of a session's best single unit (turn-level "
                                 "keys beside the session and the three-unit window)"),
    f"{P}, unit leg": (_r3(True, unit=True), "Porter keys, own pool, + z(bm25_unit) over Porter keys"),
    f"{P}, k1=1.2 b=0.5": (_r3(True, k1=1.2, b=0.5), "Porter keys with BM25 k1 = 1.2, b = 0.5 (2026-11-27's fold-B "
                                                     "pick), own pool"),
    "pool 20": (_r3(k=20), "the default with the dense leg over the lexical top 20 (the default: 15)"),
    f"{P}, pool 20": (_r3(True, k=20), "Porter keys, the dense leg over the top 20 of their own lexical order "
                                       "(embeds about a third more)"),
    f"{P}, pool 20, dense x1.5": (_r3(True, 1.5, k=20), "the same, the dense leg weighted 1.5"),
    f"{P}, k1=1.2 b=0.5, pool 20": (_r3(True, k=20, k1=1.2, b=0.5), "Porter keys with k1 = 1.2, b = 0.5, the dense "
                                                                    "leg over the top 20 of their own order"),
}
