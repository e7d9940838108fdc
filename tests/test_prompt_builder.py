"""One prompt builder (memsifter.retrieval.window): the ranker is trained on the prompts it is served.

prepare-rl's rows and the rank stage's prompts are built from one small synthetic dataset, with the
tiny model's tokenizer and the same settings, and compared byte for byte; then the ``shuffled``
listing (issue 34): deterministic per seed, not the first stage's order, gold ids renumbered with it.
Everything is real (stages, tokenizer, parquet); nothing is mocked.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from memsifter.retrieval import rankings
from memsifter.training import rewards
from memsifter.retrieval.context import TokenCounter, load_tokenizer
from memsifter.data.model import read_dataset
from memsifter.retrieval.prompting import RANKER_PROMPTS, load_prompt
from memsifter.retrieval.render import render_history_texts, render_session
from memsifter.stage import get_stage
from memsifter.stages.prepare_rl import ground_truth, read_rows
from memsifter.stages.rank import RankConfig, build_prompt, resolve_prefix
from memsifter.retrieval.window import NO_ROOM, NOT_A_CANDIDATE, NOT_REACHED, OVER_BUDGET, TRIMMED, PromptBuilder


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_model_dir):
    """10 questions of 9 sessions (1 gold); a first-stage order that is neither chronological nor its
    reverse, with the gold session first (so a budget that leaves sessions out keeps the gold one in
    the rank stage too, and both stages may be compared on tight budgets)."""
    root = tmp_path_factory.mktemp("pb")
    uri = str(root / "ds")
    get_stage("synth").run({"output": uri, "questions": 10, "sessions_per_question": 9, "seed": 5})
    ds = read_dataset(uri)
    order = {}
    for q in ds.questions:
        others = [s for s in q.haystack_session_ids if s not in q.gold_session_ids]
        order[q.question_id] = q.gold_session_ids + others[3:] + others[:3][::-1]
    sims = str(root / "sims.parquet")
    pq.write_table(rankings.rankings_table([
        {"question_id": qid, "ranked_session_ids": ids, "scores": [1.0 - i / 100 for i in range(len(ids))],
         "method": "embed:dense", "status": "ok"} for qid, ids in order.items()]), sims)
    counter = TokenCounter(load_tokenizer(tiny_model_dir))
    sizes = [counter.count(render_session(ds.sessions[s].turns)) for s in ds.questions[0].haystack_session_ids]
    return {"uri": uri, "ds": ds, "sims": sims, "order": order, "root": root, "counter": counter,
            "all_fit": 4 * sum(sizes) + 2000, "tight": 700 + int(sum(sizes) * 0.5), "small": 600}


# settings shared by both stages; "limit": which budget of the fixture becomes context_limit
CASES = [
    ("defaults, everything fits", {"limit": "all_fit"}),
    ("tight budget, stop at first overflow", {"limit": "tight"}),
    ("tight budget, keep trying smaller sessions", {"limit": "tight", "stop_at_first_overflow": False}),
    ("direct prompt, condensed sessions, first-stage listing",
     {"limit": "small", "prompt_style": "direct", "session_tokens": 120, "history_order": "first_stage"}),
    ("shuffled listing", {"limit": "tight", "history_order": "shuffled", "shuffle_seed": 11}),
]


def _prepare(data, tiny_model_dir, name, settings, **extra):
    out = str(data["root"] / name)
    get_stage("prepare-rl").run({
        "output": out, "datasets": [data["uri"]], "tokenizer": tiny_model_dir, "similarities": [data["sims"]],
        "recipe": {"train": {"synth": 10}}, **settings, **extra})
    return read_rows(out)


def _settings(data, case: dict) -> dict:
    s = {k: v for k, v in case.items() if k != "limit"}
    return {**s, "context_limit": data[case["limit"]]}


@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_prepare_rl_prompt_is_the_rank_stages_prompt_byte_for_byte(data, tiny_model_dir, name, case):
    settings = _settings(data, case)
    rows = _prepare(data, tiny_model_dir, name.replace(" ", "_").replace(",", ""), settings)
    assert len(rows) == 10
    style = settings.get("prompt_style", "thinking")
    rank_cfg = RankConfig(output="x", input=data["uri"], embeddings="e", model=tiny_model_dir,
                          vllm={"max_model_len": settings["context_limit"] + 20000},
                          **{k: v for k, v in settings.items() if k != "prompt_style"}, prompt_style=style)
    rank_cfg = rank_cfg.model_copy(update={"answer_prefix": resolve_prefix(rank_cfg, style)})  # as rank's run
    template = load_prompt(None, RANKER_PROMPTS[style], ("history", "current"))
    partial = 0
    for r in rows:
        ei = r["extra_info"]
        q = data["ds"].question(ei["question_id"])
        p = build_prompt(rank_cfg, data["ds"], q, {"ranked_session_ids": data["order"][q.question_id]},
                         data["counter"], template)
        assert r["prompt"][0]["content"].encode() == p.messages[0]["content"].encode(), name
        assert r["prompt"] == p.messages[:1]  # the row holds the user message; rank may add a prefill
        assert ei["session_ids"] == p.id_map and ei["prompt_tokens"] == p.prompt_tokens
        partial += len(p.id_map) < len(q.haystack_session_ids)
    # a tight budget must leave sessions out, or it would not test the window at all
    assert (partial > 0) == (case["limit"] != "all_fit"), partial


def test_shuffled_listing_is_seeded_renumbers_ids_and_keeps_gold(data, tiny_model_dir):
    """history_order shuffled: each row lists its sessions in a permutation drawn from the seed and the
    question, not chronologically and not in the first stage's order; the local ids (gold_local,
    ground_truth, first_stage_local, haystack_index) follow that listing, and the reward reads them so."""
    fits = {"context_limit": data["all_fit"]}
    a = _prepare(data, tiny_model_dir, "sh_a", {**fits, "history_order": "shuffled", "shuffle_seed": 1})
    again = _prepare(data, tiny_model_dir, "sh_again", {**fits, "history_order": "shuffled", "shuffle_seed": 1})
    other = _prepare(data, tiny_model_dir, "sh_b", {**fits, "history_order": "shuffled", "shuffle_seed": 2})
    by_q = lambda rows: {r["extra_info"]["question_id"]: r for r in rows}  # noqa: E731
    a, again, other = by_q(a), by_q(again), by_q(other)
    assert {q: r["prompt"] for q, r in a.items()} == {q: r["prompt"] for q, r in again.items()}  # deterministic
    assert sum(a[q]["extra_info"]["session_ids"] != other[q]["extra_info"]["session_ids"] for q in a) >= 8
    for qid, r in a.items():
        ei = r["extra_info"]
        q = data["ds"].question(qid)
        shown = ei["session_ids"]
        assert sorted(shown) == sorted(q.haystack_session_ids)  # everything fits: only the listing differs
        assert shown != q.haystack_session_ids and shown != data["order"][qid]
        # ids renumbered with the listing: local id i is the i-th session of the prompt
        content = r["prompt"][0]["content"]
        for i, (text, date) in enumerate(zip(ei["sessions"], ei["dates"])):
            assert text == render_session(data["ds"].sessions[shown[i]].turns)
            assert f"<session{i}> <date>{date}</date>\n{text}</session>" in content
        assert [shown[i] for i in ei["gold_local"]] == q.gold_session_ids
        gold, n = ground_truth(r)
        assert (gold, n) == (ei["gold_local"], len(shown)) == rewards.parse_ground_truth(
            r["reward_model"]["ground_truth"])
        assert [shown[i] for i in ei["first_stage_local"]] == data["order"][qid]
        assert [q.haystack_session_ids[i] for i in ei["haystack_index"]] == shown
        # the reward: gold first scores the best DCG, and the working LLM still sees its sessions in time order
        assert rewards.dcg_reward(gold + [i for i in range(n) if i not in gold], gold, 10) == 1.0
        assert rewards.dcg_reward([i for i in range(n) if i not in gold] + gold, gold, 10) < 1.0
        (msgs,) = rewards.tier_prompts(list(range(n)), [n], ei)
        chrono = render_history_texts([render_session(data["ds"].sessions[s].turns) for s in q.haystack_session_ids],
                                      [q.date_of(s, data["ds"].sessions) for s in q.haystack_session_ids])
        assert chrono in msgs[-1]["content"]


class _WordCounter:
    """A whitespace 'tokenizer' (counts words), enough to check the cost model's arithmetic by hand."""

    hits = misses = 0

    def count_many(self, texts, cap=None):
        return [len(t.split()) for t in texts]

    def chat_prompt_tokens(self, messages):
        return sum(len(str(m["content"]).split()) for m in messages)


class _S:
    def __init__(self, words: int):
        self.turns = [{"role": "user", "content": " ".join(["w"] * words)}]


@pytest.mark.parametrize("stop,history_budget,order,required,shown,why", [
    # costs: a session of k words = k + 2 (its header line and footer, worst-case id): s0=12, s1=52, s2=7, s3=7
    (True, 30, ["s0", "s1", "s2", "s3"], [], ["s0"], {"s1": OVER_BUDGET, "s2": NOT_REACHED, "s3": NOT_REACHED}),
    (False, 30, ["s0", "s1", "s2", "s3"], [], ["s0", "s2", "s3"], {"s1": OVER_BUDGET}),
    (False, 20, ["s2", "s0", "s3"], [], ["s0", "s2"], {"s3": NO_ROOM, "s1": NOT_A_CANDIDATE}),
    (True, 20, ["s2", "s0", "s3"], ["s1"], ["s1"], {"s2": NO_ROOM, "s0": NOT_REACHED, "s3": NOT_REACHED}),
])
def test_window_costs_and_says_why_a_session_is_left_out(stop, history_budget, order, required, shown, why):
    sessions = {"s0": _S(10), "s1": _S(50), "s2": _S(5), "s3": _S(5)}
    b = PromptBuilder(_WordCounter(), "H {history} Q {current}", history_budget=history_budget,
                      stop_at_first_overflow=stop, include_dates=False)
    w = b.build("q", list(sessions), sessions, [None] * 4, order, key="q1", required=required)
    assert w.costs == [12, 52, 7, 7]
    assert w.session_ids == shown and w.left_out == why
    assert w.empty_tokens == 3 and w.limit == 3 + history_budget  # "H", "Q" and "q"
    assert w.history_tokens == sum(w.costs[int(s[1])] for s in shown)


@pytest.mark.parametrize("limit,shown,tokens,left_out", [
    (200, ["a", "b", "c"], 125, {}),                              # 3 x 42 characters, the last newline stripped
    (60, ["a"], 41, {"b": TRIMMED, "c": TRIMMED}),                 # b, c taken by the estimate, then dropped
    (3, ["a"], 41, {"b": OVER_BUDGET, "c": OVER_BUDGET}),          # required: shown even over the limit
])
def test_exact_count_trims_the_last_taken_never_a_required_one(limit, shown, tokens, left_out):
    """The per-session estimate can be short (here the prompt is counted per character, the sessions
    per word): the exact count drops the last session taken until the prompt fits, never a required one."""
    class Chars(_WordCounter):
        def chat_prompt_tokens(self, messages):
            return len(messages[0]["content"])

    sessions = {"a": _S(3), "b": _S(3), "c": _S(3)}
    b = PromptBuilder(Chars(), "{history}{current}", limit=limit, include_dates=False)
    w = b.build("", list(sessions), sessions, [None] * 3, ["b", "c", "a"], key="k", required=["a"])
    assert w.costs == [5, 5, 5] and w.empty_tokens == 0
    assert (w.session_ids, w.prompt_tokens, w.left_out) == (shown, tokens, left_out)
