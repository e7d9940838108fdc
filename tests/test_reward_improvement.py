"""The ranker's improvement reward (issue 44 item 2): NDCG@k of its ranking minus NDCG@k of the listing it was
shown, so copying the shown order earns nothing whatever that order is. Pure reward function, no LLM, no verl."""
from __future__ import annotations

import itertools
import random

import pytest
from pydantic import ValidationError

from memsifter.training.reward_settings import RewardSettings
from memsifter.training.rewards import LISTING, compute_score_sync

N = 6
GOLD = [1, 4]              # the row's local ids of the gold sessions
GT = "1,4;6"               # prepare-rl's ground truth: row-local gold ids; N sessions


def ranking(ids) -> str:
    return "<ranking>" + ", ".join(map(str, ids)) + "</ranking>"


def score(resp: str, listing=None, **kw) -> dict:
    info = {} if listing is None else {LISTING: list(listing)}
    return compute_score_sync("memsifter_locomo", resp, GT, info, mode="improvement", format="partial", **kw)


@pytest.mark.parametrize("listing", [list(range(N)), [4, 1, 0, 2, 3, 5], [0, 2, 3, 5, 1, 4], [5, 4, 3, 2, 1, 0]])
def test_copying_the_shown_order_earns_nothing_whatever_the_order(listing):
    # the ranker's ids are the ids of its prompt: 0 is the first session it was shown
    r = score(ranking(range(N)), listing)
    assert r["score"] == 0.0 and r["order_changed"] == 0.0 and r["listing_from_rollout"] == 1.0
    assert r["format_ok"] == 1.0


def test_copying_earns_nothing_over_random_listings_too():
    rng = random.Random(7)
    for _ in range(50):
        listing = rng.sample(range(N), N)
        assert score(ranking(range(N)), listing)["score"] == 0.0


def test_moving_gold_up_earns_more_than_zero_and_down_less():
    listing = [0, 2, 3, 1, 5, 4]          # gold (row ids 1 and 4) shown at positions 3 and 5
    up = score(ranking([3, 5, 0, 1, 2, 4]), listing)     # the gold sessions first
    down = score(ranking([2, 3, 4, 5, 0, 1]), [1, 4, 0, 2, 3, 5])  # shown first, ranked last
    assert up["score"] > 0 and up["order_changed"] == 1.0
    assert down["score"] < 0
    # by hand: NDCG@6 of gold at ranks 1-2 is 1; the listing has them at ranks 4 and 6
    from math import log2

    ideal = 1 + 1 / log2(3)
    shown = (1 / log2(5) + 1 / log2(7)) / ideal
    assert up["score"] == pytest.approx(1 - shown) and up["shown_ndcg"] == pytest.approx(shown)


def test_the_ranking_is_read_in_the_rollouts_ids():
    # the same answer means different sessions under different listings: "0" is the first one shown
    answer = ranking([5, 4, 0, 1, 2, 3])  # the last two shown first
    gold_last = score(answer, [0, 2, 3, 5, 1, 4])
    gold_first = score(answer, [1, 4, 0, 2, 3, 5])
    assert gold_last["score"] > 0 > gold_first["score"]


def test_every_possible_ranking_of_one_listing_is_measured_against_that_listing():
    listing = [2, 4, 0, 5, 1, 3]
    from memsifter.retrieval.metrics import ndcg

    base = ndcg([str(i) for i in listing], [str(g) for g in GOLD], N)
    for perm in itertools.islice(itertools.permutations(range(N)), 0, 720, 37):
        mapped = [listing[i] for i in perm]
        want = ndcg([str(i) for i in mapped], [str(g) for g in GOLD], N) - base
        assert score(ranking(perm), listing)["score"] == pytest.approx(want)


def test_an_answer_that_does_not_parse_scores_below_every_ranking():
    r = score("I cannot rank these", [0, 1, 2, 3, 4, 5])
    assert r["score"] == -1.0 and r["format_ok"] == 0.0
    # exact format: fewer than K = min(10, N) ids does not parse either
    r = compute_score_sync("memsifter_locomo", ranking([1, 4]), GT, {LISTING: list(range(N))}, mode="improvement")
    assert r["score"] == -1.0


def test_without_a_rollout_listing_the_rows_own_listing_is_the_baseline_and_says_so():
    r = score(ranking([1, 4, 0, 2, 3, 5]))
    assert r["listing_from_rollout"] == 0.0
    assert r["score"] == pytest.approx(score(ranking([1, 4, 0, 2, 3, 5]), list(range(N)))["score"])


def test_a_listing_that_is_not_a_permutation_of_the_shown_sessions_is_an_error_not_a_score():
    r = score(ranking(range(N)), [0, 1, 2, 3, 4, 4])
    assert r["reward_error"] == 1.0 and r["score"] == 0.0


def test_the_dcg_mode_reads_a_rollout_listing_too():
    a = compute_score_sync("s", ranking([0, 1, 2, 3, 4, 5]), GT, {LISTING: [1, 4, 0, 2, 3, 5]}, mode="dcg")
    b = compute_score_sync("s", ranking([1, 4, 0, 2, 3, 5]), GT, {}, mode="dcg")
    assert a["dcg"] == pytest.approx(b["dcg"]) and a["score"] == pytest.approx(b["score"])


def test_the_mode_is_a_validated_setting():
    assert RewardSettings(mode="improvement").mode == "improvement"
    assert RewardSettings.resolve(mode="Improvement").mode == "improvement"
    with pytest.raises(ValueError, match="improvement"):
        RewardSettings.resolve(mode="improve")
    with pytest.raises(ValidationError):
        RewardSettings(mode="gain")
    desc = RewardSettings.model_fields["mode"].description
    assert "improvement" in desc and "listing" in desc
