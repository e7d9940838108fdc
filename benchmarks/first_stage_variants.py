"""The candidates of ``first_stage_cv.py`` (issue 42 item 5): the default ``zsum`` k = 15 and variants that need
no LLM. Every leg is built with the embed stage's functions; nothing here is fitted.

- subject turns: the turns of whom the question asks about. A session with ``assistant`` turns (LongMemEval):
  the other turns (the user's: the stage's ``cascade_units`` already embeds only those); a session of named
  speakers (LoCoMo): the turns of the one speaker the question names (by first name, as a word), all turns when
  it names none or several.
- time-aware: a question that states a time relative to its date ("3 weeks ago", "last Saturday", "yesterday",
  "last month", "in the past 2 weeks") or a month ("in May") gets one more zsum leg: 1 for the sessions dated in
  that window, 0 for the others (z-scored as every leg, or added as it is: +1, one leg's standard deviation; no
  window, no leg).
"""
from __future__ import annotations

import re
from datetime import datetime, timedelta

import numpy as np

from memsifter.stages import embed as E

RRF_K, WORDS, K = 60, 200, 15


def subject_turns(q, turns: list[dict]) -> list[dict]:
    roles = {str(t["role"]) for t in turns}
    if any(r.strip().lower() == "assistant" for r in roles):
        return [t for t in turns if str(t["role"]).strip().lower() != "assistant"] or turns
    named = [r for r in roles if r.split() and re.search(rf"\b{re.escape(r.split()[0])}\b", q.question, re.I)]
    if len(named) == 1:
        return [t for t in turns if str(t["role"]) == named[0]] or turns
    return turns


def _subject_lexical(lx, ds, q) -> dict[str, np.ndarray]:
    hay = q.haystack_session_ids
    sess, units = [], []
    for s in hay:
        turns = subject_turns(q, ds.sessions[s].turns)
        sess.append(lx._tok("".join(f"{t['role']}: {t['content']}\n" for t in turns)))
        units.append([lx._tok(u) for u in E.turn_units(turns, WORDS)])
    dates = [lx._tok(q.date_of(s, ds.sessions) or "") for s in hay]
    return E.HaystackLexical(sess, units, dates, lx.stop, lx.stem).scores(q.question)


LEXICAL = {"base": lambda lx, ds, q: lx.scores(q), "subject": _subject_lexical}

# ---------------------------------------------------------------- time
_NUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
        "nine": 9, "ten": 10, "couple of": 2, "few": 3}
_UNIT = {"day": 1, "week": 7, "month": 30, "year": 365}
_WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
_MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december"]
_NUMS = r"(\d+|a|an|one|two|three|four|five|six|seven|eight|nine|ten|couple of|few)"


def parse_date(s: str | None) -> datetime | None:
    if not s:
        return None
    m = re.match(r"(\d{4})/(\d{2})/(\d{2})", s)
    if m:
        return datetime(int(m[1]), int(m[2]), int(m[3]))
    m = re.search(r"(\d{1,2}) (\w+),? (\d{4})", s)   # LoCoMo: "1:56 pm on 8 May, 2023"
    if m and m[2].lower() in _MONTHS:
        return datetime(int(m[3]), _MONTHS.index(m[2].lower()) + 1, int(m[1]))
    return None


def time_window(question: str, qdate: datetime | None) -> tuple[datetime, datetime] | None:
    """The days a question's time phrase points to, relative to its date (None: no phrase or no date)."""
    if qdate is None:
        return None
    t = question.lower()
    m = re.search(rf"\b{_NUMS} (day|week|month|year)s? ago\b", t)
    if m:
        n = int(m[1]) if m[1].isdigit() else _NUM[m[1]]
        u = _UNIT[m[2]]
        c = qdate - timedelta(days=n * u)
        return c - timedelta(days=u), c + timedelta(days=u)
    m = re.search(rf"\b(?:past|last) {_NUMS} (day|week|month|year)s?\b", t)
    if m:
        n = int(m[1]) if m[1].isdigit() else _NUM[m[1]]
        return qdate - timedelta(days=n * _UNIT[m[2]]), qdate
    if re.search(r"\byesterday\b", t):
        return qdate - timedelta(days=2), qdate
    m = re.search(r"\blast (" + "|".join(_WEEKDAYS) + r")\b", t)
    if m:
        back = (qdate.weekday() - _WEEKDAYS.index(m[1])) % 7 or 7
        c = qdate - timedelta(days=back)
        return c - timedelta(days=1), c + timedelta(days=1)
    m = re.search(r"\b(?:last|past|previous) (week|weekend|month|year)\b", t)
    if m:
        u = {"week": 7, "weekend": 7, "month": 30, "year": 365}[m[1]]
        return qdate - timedelta(days=2 * u), qdate
    m = re.search(r"\bin (" + "|".join(_MONTHS) + r")\b", t)
    if m:
        mo = _MONTHS.index(m[1]) + 1
        y = qdate.year if mo <= qdate.month else qdate.year - 1
        start = datetime(y, mo, 1)
        return start, (datetime(y + (mo == 12), mo % 12 + 1, 1) - timedelta(days=1))
    return None


def time_leg(q, ds) -> np.ndarray | None:
    w = time_window(q.question, parse_date(q.question_date))
    if w is None:
        return None
    d = [parse_date(q.date_of(s, ds.sessions)) for s in q.haystack_session_ids]
    leg = np.array([1.0 if x is not None and w[0] <= x <= w[1] else 0.0 for x in d])
    return leg if 0 < leg.sum() < len(leg) else None


def time_stats(every: list, scored: list, ds) -> dict:
    """How many questions state a time window, get a leg, have a gold session dated outside their window."""
    def window(q):
        return time_window(q.question, parse_date(q.question_date))
    outside = 0
    for q in every:
        w = window(q)
        if w is not None:
            d = [parse_date(q.date_of(s, ds.sessions)) for s in q.gold_session_ids]
            outside += any(x is None or not w[0] <= x <= w[1] for x in d)
    return {"scored": len(scored), "scored_with_window": sum(window(q) is not None for q in scored),
            "scored_with_leg": sum(time_leg(q, ds) is not None for q in scored), "all": len(every),
            "all_with_window": sum(window(q) is not None for q in every), "all_gold_outside": outside}


# ---------------------------------------------------------------- candidates
def _zsum(lex: dict, q, ds, unit_sims, *, subject_dense: bool = False, time: str = "", family: bool = False,
          top2: bool = False) -> np.ndarray:
    cand = E.cascade_candidates(lex, K, RRF_K)

    def sim(j: int) -> float:
        turns = ds.sessions[q.haystack_session_ids[j]].turns
        sub = subject_turns(q, turns) if subject_dense else turns
        v = np.sort(unit_sims(j, None if len(sub) == len(turns) else sub))[::-1]
        return float(v[:2].mean()) if top2 else float(v[0])
    dense = {j: sim(j) for j in cand}
    if family:   # one vote per family: the mean of the lexical legs' z-scores, plus the dense leg's
        floor = min(dense.values())
        leg = np.array([dense.get(i, floor) for i in range(len(lex["bm25_dated"]))])
        score = sum(E.zscore(lex[m]) for m in E.LEXICAL_LEGS) / len(E.LEXICAL_LEGS) + E.zscore(leg)
    else:
        score = E.zsum_scores(lex, cand, dense)
    if time:
        leg = time_leg(q, ds)
        if leg is not None:
            score = score + (E.zscore(leg) if time == "z" else leg)
    return score


DEFAULT = "zsum k=15 (default)"
CANDIDATES = {
    DEFAULT: lambda L, q, ds, ms: _zsum({m: L("base")[m] for m in E.LEXICAL_LEGS}, q, ds, ms),
    "subject keys": lambda L, q, ds, ms: _zsum({m: L("subject")[m] for m in E.LEXICAL_LEGS}, q, ds, ms),
    "subject dense": lambda L, q, ds, ms: _zsum({m: L("base")[m] for m in E.LEXICAL_LEGS}, q, ds, ms,
                                                subject_dense=True),
    "subject keys+dense": lambda L, q, ds, ms: _zsum({m: L("subject")[m] for m in E.LEXICAL_LEGS}, q, ds, ms,
                                                     subject_dense=True),
    "time-aware": lambda L, q, ds, ms: _zsum({m: L("base")[m] for m in E.LEXICAL_LEGS}, q, ds, ms, time="z"),
    "time-aware (+1)": lambda L, q, ds, ms: _zsum({m: L("base")[m] for m in E.LEXICAL_LEGS}, q, ds, ms, time="1"),
    "subject keys+dense+time": lambda L, q, ds, ms: _zsum({m: L("subject")[m] for m in E.LEXICAL_LEGS}, q, ds, ms,
                                                          subject_dense=True, time="1"),
    "zsum family": lambda L, q, ds, ms: _zsum({m: L("base")[m] for m in E.LEXICAL_LEGS}, q, ds, ms, family=True),
    "dense top-2": lambda L, q, ds, ms: _zsum({m: L("base")[m] for m in E.LEXICAL_LEGS}, q, ds, ms, top2=True),
    "lexical (no dense)": lambda L, q, ds, ms: E.rrf([E.order_by(L("base")[m]) for m in E.LEXICAL_LEGS],
                                                     len(q.haystack_session_ids), RRF_K),
    "lexical subject keys (no dense)": lambda L, q, ds, ms: E.rrf([E.order_by(L("subject")[m]) for m in E.LEXICAL_LEGS],
                                                                  len(q.haystack_session_ids), RRF_K),
}
DESCRIPTIONS = {
    DEFAULT: "the embed stage's default: z(bm25_dated) + z(bm25_window) + z(max-sim over the non-assistant units "
             "of the lexical top 15)",
    "subject keys": "the same, both BM25 legs over the subject turns only (LongMemEval: user turns; LoCoMo: the "
                    "named speaker's)",
    "subject dense": "the default, the dense leg over the subject turns (LongMemEval: unchanged)",
    "subject keys+dense": "both",
    "time-aware": "the default + z(1 for sessions dated in the question's time window) when it states one",
    "time-aware (+1)": "the default + 1 (one leg's standard deviation) for the sessions dated in that window",
    "subject keys+dense+time": "subject keys + subject dense + time-aware (+1)",
    "zsum family": "one vote per family: (z(bm25_dated) + z(bm25_window)) / 2 + z(dense), the same legs",
    "dense top-2": "the default, the dense leg the mean of a session's two best units (one unit: its own)",
    "lexical (no dense)": "RRF(bm25_dated, bm25_window): the default's candidate order (diagnostic, no embedding)",
    "lexical subject keys (no dense)": "the same over the subject turns (diagnostic)",
}
