"""The regression check fires on a planted regression and not on noise within the threshold."""

from __future__ import annotations

import random

import pytest

from memalpha.evaluation.regression import check_regression

PREVIOUS = {"policy/score": 0.60, "policy/accurate_retrieval/score": 0.70, "rag/score": 0.50}


def test_noise_within_threshold_passes():
    rng = random.Random(0)
    for _ in range(50):
        current = {key: value + rng.uniform(-0.049, 0.049) for key, value in PREVIOUS.items()}
        check = check_regression(current, PREVIOUS, threshold=0.05)
        assert not check.regressed, check.message


def test_planted_regression_fires_with_a_clear_message():
    current = dict(PREVIOUS, **{"policy/score": 0.48})
    check = check_regression(current, PREVIOUS, threshold=0.05)
    assert check.regressed
    assert "policy/score fell from 0.6000 to 0.4800 (-0.1200)" in check.message
    assert "| policy/score | 0.6000 | 0.4800 | -0.1200 | regressed |" in check.to_markdown()


def test_only_watched_metrics_count_and_patterns_work():
    current = dict(PREVIOUS, **{"rag/score": 0.1, "policy/accurate_retrieval/score": 0.5})
    assert not check_regression(current, PREVIOUS, 0.05, keys=["policy/score"]).regressed
    check = check_regression(current, PREVIOUS, 0.05, keys=["policy/*"])
    assert check.regressed and "policy/accurate_retrieval/score" in check.message


def test_improvement_and_missing_metric():
    assert not check_regression({"policy/score": 0.9}, PREVIOUS, 0.05).regressed
    check = check_regression({"rag/score": 0.5}, PREVIOUS, 0.05)
    assert check.regressed and "policy/score is missing" in check.message


def test_no_previous_run_and_new_metric():
    assert not check_regression({"policy/score": 0.1}, None, 0.05).regressed
    check = check_regression({"policy/score": 0.1}, {"rag/score": 0.4}, 0.05)
    assert not check.regressed and check.comparisons[0].status == "new"
    with pytest.raises(ValueError, match=">= 0"):
        check_regression({}, PREVIOUS, -1)
