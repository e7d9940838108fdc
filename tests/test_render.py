"""Session rendering (MEMSIFTER.md §2) and budgeted selection."""

from memsifter.retrieval.context import TokenCounter, fill_budget
from memsifter.retrieval.render import render_history, render_history_texts, render_session


def test_render_session_counts_turns_per_role():
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "<b>raw</b>"}, {"role": "Caroline", "content": "x"}]
    assert render_session(turns) == ("<user0>hi</user>\n<assistant0>hello</assistant>\n"
                                     "<user1><b>raw</b></user>\n<Caroline0>x</Caroline>\n")


def test_render_history_local_ids_dates_and_strip():
    s1 = [{"role": "user", "content": "a"}]
    s2 = [{"role": "user", "content": "b"}]
    assert render_history([s1, s2]) == "<session0>\n<user0>a</user>\n</session>\n<session1>\n<user0>b</user>\n</session>"
    dated = render_history([s1, s2], ["2023/01/01", None])
    assert dated.startswith("<session0> <date>2023/01/01</date>\n") and "\n<session1>\n" in dated
    assert render_history_texts([render_session(s1), render_session(s2)], ["2023/01/01", None]) == dated


def test_fill_budget_modes():
    costs = [5, 50, 5, 5]
    assert fill_budget([0, 1, 2, 3], costs, 20) == [0, 2, 3]
    assert fill_budget([0, 1, 2, 3], costs, 20, stop_at_first_overflow=True) == [0]
    assert fill_budget([0, 2], costs, 20, required=[1]) == [1]
    assert fill_budget([3, 2, 0], costs, 59, required=[1]) == [1, 3]
    assert fill_budget([3, 2, 0], costs, 60, required=[1]) == [1, 3, 2]


class _Tok:
    calls = 0

    def __call__(self, texts, add_special_tokens=False):
        _Tok.calls += 1
        return {"input_ids": [t.split() for t in texts]}


def test_token_counter_caches_by_text():
    tc = TokenCounter(_Tok())
    assert tc.count_many(["a b c", "d", "a b c"]) == [3, 1, 3]
    assert tc.count("a b c") == 3
    assert tc.misses == 2 and tc.hits >= 2
