"""The first-stage candidates of issue 42 item 5 (memsifter/retrieval/first_stage_candidates.py): their BM25 is the
embed stage's BM25 at the default k1 / b (so a candidate's difference is its idea, not a re-implementation), and
the pieces they add (RM3 terms, window units, the small-haystack pool) do what they say. Real bm25s, no mocks."""
from collections import Counter

import numpy as np

from memsifter.retrieval import first_stage_candidates as C
from memsifter.retrieval.first_stage_candidates import E
from memsifter.retrieval.render import render_session

STOP = frozenset({"the", "a", "i", "to", "my", "and", "of", "in", "is", "what", "did", "where"})
SESSIONS = [
    [{"role": "user", "content": "I adopted a rescue dog named Biscuit last weekend"},
     {"role": "assistant", "content": "Congratulations on adopting Biscuit, rescue dogs make loyal friends"},
     {"role": "user", "content": "Biscuit loves the dog park and long walks"}],
    [{"role": "user", "content": "My yoga class moved to the community center downtown"},
     {"role": "assistant", "content": "Yoga at a community center sounds relaxing"}],
    [{"role": "user", "content": "I baked sourdough bread with a new starter"}],
    [],
    [{"role": "user", "content": "The dog park near the community center closed for repairs " * 3}],
]
DATES = ["2023/05/01 (Mon) 10:00", "2023/05/08 (Mon) 10:00", None, "2023/05/20 (Sat) 09:00", "2023/06/01 (Thu) 12:00"]


def _legs(phrases: bool = False) -> C.Legs:
    units = [[C.counts(E.bm25_tokens(u, STOP, True), phrases) for u in E.turn_units(t, 6)] for t in SESSIONS]
    return C.Legs(units, [Counter(E.bm25_tokens(d or "", STOP, True)) for d in DATES])


def test_legs_at_the_default_k1_b_are_the_embed_stages_bm25():
    hl = E.HaystackLexical([E.bm25_tokens(render_session(t), STOP, True) for t in SESSIONS],
                           [[E.bm25_tokens(u, STOP, True) for u in E.turn_units(t, 6)] for t in SESSIONS],
                           [E.bm25_tokens(d or "", STOP, True) for d in DATES], STOP, True)
    legs = _legs()
    for question in ("Where did I take my dog Biscuit?", "community center yoga", "sourdough May 2023", "nothing"):
        ref = hl.scores(question)
        got = legs.scores(dict(Counter(E.bm25_tokens(question, STOP, True))))
        for leg in E.LEXICAL_LEGS:
            np.testing.assert_allclose(got[leg], ref[leg], rtol=1e-5, atol=1e-6, err_msg=f"{leg}: {question}")
    # another k1 / b changes the scores (the grid is not the default under another name)
    q = dict(Counter(E.bm25_tokens("dog park community center", STOP, True)))
    assert not np.allclose(legs.scores(q, 0.9, 0.5)["bm25_dated"], legs.scores(q)["bm25_dated"])


def test_phrase_keys_reward_the_words_in_their_order():
    q = C.counts(E.bm25_tokens("dog park", STOP, True), True)
    assert q == Counter({"dog": 1, "park": 1, "dog_park": 1})
    plain, phr = _legs().scores(dict(C.counts(["dog", "park"], False))), _legs(True).scores(dict(q))
    # session 0 says "dog park" as a phrase, as session 4 does; the phrase key lifts both over words alone
    assert phr["bm25_dated"][0] > 0 and phr["bm25_dated"][0] / plain["bm25_dated"][0] > 1


def test_porter_keys_join_the_forms_of_a_word_the_s_stemmer_keeps_apart():
    class DS:   # the two attributes Tokens reads of a Dataset
        sessions = {"s": type("S", (), {"turns": [{"role": "user", "content": "I was researching adoption agencies"}]})}
    tok = C.Tokens(DS)
    assert "research" in tok.tokens("What did Caroline research?", porter_stem=True)
    assert tok.units("s", False, porter_stem=True)[0]["research"] == 1
    assert tok.units("s", False)[0]["research"] == 0 and tok.units("s", False)[0]["researching"] == 1


def test_rm3_terms_come_from_the_feedback_sessions_not_the_question_nor_everywhere():
    legs = _legs()
    query = dict(Counter(E.bm25_tokens("my dog", STOP, True)))
    terms = C.rm3_terms(legs, [0, 4, 1, 2, 3], query, docs=1, terms=4)
    assert terms and abs(sum(terms.values()) - 1) < 1e-9
    assert "dog" not in terms and "biscuit" in terms
    assert set(terms) <= set(legs.session_counts()[0])
    q2 = C.expanded(query, terms, 0.5)
    assert abs(q2["dog"] - 0.5) < 1e-9 and abs(sum(q2.values()) - 1) < 1e-9
    # feedback that puts the sourdough session first draws its words instead
    assert "sourdough" in C.rm3_terms(legs, [2, 0, 1, 3, 4], query, docs=1, terms=4)


def test_pair_units_join_adjacent_units_of_the_same_turns():
    pairs = C.pair_units(SESSIONS[0], 200)
    assert pairs == ["user: I adopted a rescue dog named Biscuit last weekend\nuser: Biscuit loves the dog park "
                     "and long walks"]   # the assistant's turn is not a unit (as the default embeds)
    assert C.pair_units(SESSIONS[2], 200) == []
    named = [{"role": "Caroline", "content": "Hey Mel"}, {"role": "Melanie", "content": "Hi!"},
             {"role": "Caroline", "content": "Guess what"}]
    assert C.pair_units(named, 200) == ["Caroline: Hey Mel\nMelanie: Hi!", "Melanie: Hi!\nCaroline: Guess what"]


def test_dense_pool_takes_every_session_of_a_small_haystack_only():
    lex = {"bm25_dated": np.array([0.1, 3.0, 0.0, 2.0, 1.0]), "bm25_window": np.array([0.2, 2.5, 0.0, 1.0, 3.0])}
    assert C.dense_pool(lex, 2, 60) == E.cascade_candidates(lex, 2, 60) == [1, 4]
    assert sorted(C.dense_pool(lex, 2, 60, small=5)) == [0, 1, 2, 3, 4]
    assert C.dense_pool(lex, 2, 60, small=4) == [1, 4]


def test_unit_leg_is_bm25_of_each_sessions_best_single_unit():
    """``bm25_unit`` (round 3): bm25s over one document per unit (the unit's words and its session's date), a
    session's best; the round-3 legs keep the two default legs unchanged."""
    units = [[E.bm25_tokens(u, STOP, True) for u in E.turn_units(t, 6)] for t in SESSIONS]
    dates = [E.bm25_tokens(d or "", STOP, True) for d in DATES]
    docs = [d + u for d, us in zip(dates, units) for u in us]
    owner = [i for i, us in enumerate(units) for _ in us]
    legs = _legs()
    for question in ("Where did I take my dog Biscuit?", "community center yoga", "dog park repairs May 2023"):
        q = dict(Counter(E.bm25_tokens(question, STOP, True)))
        got = legs.scores(q, unit=True)
        ref = E.max_per_owner(E.bm25_scores(docs, question, STOP, True), owner, len(SESSIONS))
        np.testing.assert_allclose(got["bm25_unit"], ref, rtol=1e-5, atol=1e-6, err_msg=question)
        for leg in E.LEXICAL_LEGS:
            np.testing.assert_array_equal(got[leg], legs.scores(q)[leg])
    assert "bm25_unit" not in legs.scores({"dog": 1.0})


def test_weighted_fusion_is_the_default_at_weight_one_and_adds_dense_votes_above():
    lex = {"bm25_dated": np.array([0.1, 3.0, 0.0, 2.0, 1.0]), "bm25_window": np.array([0.2, 2.5, 0.0, 1.0, 3.0]),
           "bm25_unit": np.array([0.0, 1.0, 0.0, 4.0, 0.5])}
    sims = {0: 0.9, 1: 0.2, 3: 0.4, 4: 0.1}   # session 0 is outside the pool: its similarity is never asked
    pool = [1, 4, 3]
    base = E.zsum_scores(lex, pool, {j: sims[j] for j in pool})
    np.testing.assert_array_equal(C.weighted(lex, pool, sims.get), base)
    dense_leg = E.zscore(np.array([0.1, 0.2, 0.1, 0.4, 0.1]))   # outside the pool: the pool's lowest
    np.testing.assert_allclose(C.weighted(lex, pool, sims.get, dense=2.0), base + dense_leg)
    np.testing.assert_allclose(C.weighted(lex, pool, sims.get, dense=0.5), base - 0.5 * dense_leg)
    np.testing.assert_allclose(C.weighted(lex, pool, sims.get, extra=("bm25_unit",)),
                               base + E.zscore(lex["bm25_unit"]))
    # the dense weight can reorder: session 3 (second by dense) over session 1 (first by BM25) at weight 2
    assert E.order_by(base)[0] == 1 and E.order_by(C.weighted(lex, pool, sims.get, dense=2.0))[0] == 3


def test_round_3_table_is_what_its_committed_files_give():
    """benchmarks/results/first-stage-2026-11-27-r3/table.md is ``first_stage_cv.py --table`` of that folder's
    per-question files, as committed (a file changed under it, or a figure edited by hand, fails here)."""
    import contextlib
    import io
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    import first_stage_cv

    folder = os.path.join(root, "benchmarks", "results", "first-stage-2026-11-27-r3")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        first_stage_cv.table(folder, detail=True)
    with open(os.path.join(folder, "table.md"), encoding="utf-8") as f:
        assert out.getvalue() == f.read()
