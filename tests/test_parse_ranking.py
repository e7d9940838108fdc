"""Ranker output parsing (MEMSIFTER.md §4): memsifter.retrieval.rankings.parse_ranking."""

import pytest

from memsifter.retrieval.rankings import complete_ranking, parse_ranking, to_original


@pytest.mark.parametrize("text,n,k,ids,status", [
    # the normal case, with and without the opening <think> (Thinking-2507 pre-fills it)
    ("<think>hmm</think>\n<ranking>3, 1, 2</ranking>", 5, None, [3, 1, 2], "ok"),
    ("reasoning without an opening tag</think><ranking>4,0</ranking>", 5, None, [4, 0], "ok"),
    # no <think> at all
    ("<ranking>2, 0, 1</ranking>", 3, None, [2, 0, 1], "ok"),
    # only the text after the LAST </think> counts
    ("<think>a <ranking>1</ranking></think> b </think><ranking>0, 2</ranking>", 3, None, [0, 2], "ok"),
    # missing </ranking> (truncated output) -> invalid
    ("</think><ranking>1, 2, 3", 5, None, [], "invalid"),
    # out-of-range and duplicate ids are dropped, order kept
    ("</think><ranking>7, 1, -1, 1, 0, 5</ranking>", 5, None, [1, 0], "ok"),
    # non-integers dropped
    ("<ranking>one, 2, 1.5, x3, 4</ranking>", 5, None, [2, 4], "ok"),
    # empty output / whitespace / None
    ("", 5, None, [], "invalid"),
    ("   \n", 5, None, [], "invalid"),
    (None, 5, None, [], "invalid"),
    # ids given as session3 / <session3> / Session 3
    ("</think><ranking>session3, <session1>, Session 0</ranking>", 5, None, [3, 1, 0], "ok"),
    # empty ranking, or nothing valid inside
    ("</think><ranking></ranking>", 5, None, [], "invalid"),
    ("</think><ranking>9, 10</ranking>", 5, None, [], "invalid"),
    # no ranking tag after the last </think>
    ("<ranking>1</ranking></think> I think 1 is best", 5, None, [], "invalid"),
    # unfinished thinking
    ("<think> still thinking about session 2", 5, None, [], "invalid"),
    # with k: K = min(k, n) ids required, result cut to k
    ("<ranking>0,1,2,3,4,5,6,7,8,9,10,11</ranking>", 12, 10, list(range(10)), "ok"),
    ("<ranking>0,1</ranking>", 12, 10, [0, 1], "invalid"),
    ("<ranking>2,0,1</ranking>", 3, 10, [2, 0, 1], "ok"),
    # newlines and case in tags
    ("</think>\n<RANKING>\n1,\n0\n</Ranking>", 2, None, [1, 0], "ok"),
])
def test_parse_cases(text, n, k, ids, status):
    p = parse_ranking(text, n, k)
    assert p.status == status, p
    assert p.ids == ids
    if status != "ok":
        assert p.reason


def test_reasons_are_specific():
    assert "empty" in parse_ranking("", 3).reason
    assert "</ranking>" in parse_ranking("<ranking>1", 3).reason
    r = parse_ranking("<ranking>1, 1, 9, z</ranking>", 3).reason
    assert "duplicate 1" in r and "out-of-range 9" in r and "non-integer" in r


def test_local_to_original_and_completion():
    id_map = ["s_a", "s_b", "s_c", "s_d"]
    p = parse_ranking("</think><ranking>2, 0</ranking>", len(id_map))
    head = to_original(p.ids, id_map)
    assert head == ["s_c", "s_a"]
    assert complete_ranking(head, ["s_d", "s_a", "s_b", "s_c"]) == ["s_c", "s_a", "s_d", "s_b"]


def test_prompt_fill_is_single_pass():
    from memsifter.retrieval.prompting import fill

    tpl = "H:{history}\nQ:{current}"
    out = fill(tpl, history="session says {current} and {x}", current="what?")
    assert out == "H:session says {current} and {x}\nQ:what?"
