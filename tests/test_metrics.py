"""Retrieval and answer metrics against hand-computed values."""

import math

import pytest

from memsifter.retrieval import metrics as M


def test_recall_precision_mrr_by_hand():
    ranked = ["a", "b", "c", "d", "e"]
    gold = ["c", "e"]
    assert M.recall_any(ranked, gold, 1) == 0.0
    assert M.recall_any(ranked, gold, 3) == 1.0
    assert M.recall_all(ranked, gold, 3) == 0.0
    assert M.recall_all(ranked, gold, 5) == 1.0
    assert M.precision(ranked, gold, 5) == pytest.approx(2 / 5)
    assert M.precision(ranked, gold, 1) == 0.0
    assert M.mrr(ranked, gold) == pytest.approx(1 / 3)
    assert M.mrr(ranked, ["zz"]) == 0.0


def test_ndcg_standard_by_hand():
    ranked = ["a", "b", "c", "d", "e"]
    gold = ["c", "e"]
    # DCG = 1/log2(4) + 1/log2(6); ideal = 1/log2(2) + 1/log2(3)
    dcg = 1 / math.log2(4) + 1 / math.log2(6)
    ideal = 1 + 1 / math.log2(3)
    assert M.ndcg(ranked, gold, 5) == pytest.approx(dcg / ideal)
    # k=1 with two gold: ideal is one hit on top.
    assert M.ndcg(["c"], gold, 1) == pytest.approx(1.0)
    assert M.ndcg(["e", "c"], gold, 10) == pytest.approx(1.0)


def test_ndcg_original_variant_differs():
    ranked = ["x", "c"]
    gold = ["c", "e", "f"]
    # original: DCG / |gold truncated to k| = (1/log2(3)) / 2 at k=2
    assert M.ndcg(ranked, gold, 2, variant="original") == pytest.approx((1 / math.log2(3)) / 2)
    # standard: ideal at k=2 is 1 + 1/log2(3)
    assert M.ndcg(ranked, gold, 2) == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)))
    with pytest.raises(ValueError):
        M.ndcg(ranked, gold, 2, variant="bogus")


def test_dcg_over_gold_and_question_metrics():
    assert M.dcg_over_gold(["g1", "x", "g2"], ["g1", "g2"]) == pytest.approx((1 + 0.5) / 2)
    q = M.question_metrics(["a", "g"], ["g"])
    assert q["recall_any@1"] == 0 and q["recall_any@5"] == 1 and q["mrr"] == 0.5
    assert set(q) >= {"recall_all@10", "ndcg@10", "precision@5"}
    assert M.mean_metrics([{"x": 1.0}, {"x": 0.0}]) == {"x": 0.5}


def test_answer_metrics():
    assert M.exact_match("The Music Shop!", "music shop") == 1.0
    assert M.exact_match("shop", "music shop") == 0.0
    # pred tokens: [music, shop, on, main], gold: [music, shop] -> P=2/4, R=1, F1=2/3
    assert M.token_f1("the music shop on Main", "Music shop") == pytest.approx(2 / 3)
    assert M.token_f1("", "x") == 0.0
    assert M.token_f1("", "") == 1.0
    assert M.token_f1("7", 7 and "7") == 1.0
