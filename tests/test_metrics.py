"""Worked examples for every QA metric, with values computed by hand."""

from __future__ import annotations

import pytest

from memalpha.rewards.qa import (
    boxed_em,
    conflict_memory_state,
    exact_match,
    keyword_hit_rate,
    last_boxed,
    normalize_answer,
    score_answer,
    substring_em,
    token_f1,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  An   apple, a day ", "apple day"),
        ("New-York", "newyork"),
        ("1,000 people", "1000 people"),
        ("3.50", "3.5"),
        ("It is 3.0.", "it is 3"),
        ("$4.99!", "4.99"),
        (3, "3"),
        (3.0, "3"),
        (2.5, "2.5"),
        ("the", ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_numbers_compare_as_normalised_strings():
    assert exact_match("3", 3) == exact_match("3.0", 3) == exact_match("3", 3.0) == 1.0
    assert exact_match("35", "3.5") == 0.0  # decimal points survive normalisation


def test_substring_em_matches_on_word_boundaries():
    assert substring_em("She finally moved to Lisbon, Portugal.", ["lisbon"]) == 1.0
    assert substring_em("He paid 13 dollars", 3) == 0.0
    assert substring_em("We went to a party", "art") == 0.0
    assert substring_em("Maybe Rome", ["Paris", "Rome"]) == 1.0  # max over golds
    assert substring_em("anything", ["the"]) == 0.0  # gold empty after normalisation never matches


def test_exact_match():
    assert exact_match("The Beatles.", "beatles") == 1.0
    assert exact_match("The Beatles were great", "beatles") == 0.0


def test_token_f1_worked_example():
    # pred tokens: cat sat on mat (articles dropped) -> 4; gold: cat on mat -> 3; common 3
    # precision 3/4, recall 3/3, F1 = 2*0.75*1/(1.75) = 6/7
    assert token_f1("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    assert token_f1("dog", ["cat", "dog house"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert token_f1("nothing here", "cat") == 0.0


def test_boxed_em_uses_the_last_box():
    assert last_boxed(r"x \boxed{a{b}c} y") == "a{b}c"
    assert last_boxed(r"\boxed{unclosed") is None
    assert boxed_em(r"first \boxed{negative}, finally \boxed{Positive}.", ["positive"]) == 1.0
    assert boxed_em(r"\boxed{positive} then \boxed{negative}", "positive") == 0.0
    assert boxed_em("positive", "positive") == 0.0  # the label must be boxed
    assert boxed_em(r"label: \boxed{ 7 }", 7) == 1.0


def test_keyword_hit_rate_worked_example():
    # 2 of the 3 keywords occur
    assert keyword_hit_rate("Alice moved to Lisbon and adopted a cat.", ["Lisbon", "cat", "job"]) == pytest.approx(2 / 3)
    assert keyword_hit_rate("anything", []) == 0.0


def test_score_answer_picks_metric_by_question_type():
    assert score_answer("It was in Lisbon.", ["Lisbon"], "accurate_retrieval") == 1.0
    assert score_answer(r"\boxed{sports}", ["sports"], "test_time_learning") == 1.0
    assert score_answer("sports", ["sports"], "test_time_learning") == 0.0
    assert score_answer("Lisbon and a cat", ["Lisbon", "cat", "job", "tea"], "long_range_understanding") == 0.5
    assert score_answer("It was in Lisbon.", ["Lisbon"], "accurate_retrieval", metric="exact_match") == 0.0
    with pytest.raises(ValueError, match="question_type"):
        score_answer("x", ["x"], "mystery")
    with pytest.raises(ValueError, match="unknown QA metric"):
        score_answer("x", ["x"], "accurate_retrieval", metric="bleu")


def test_conflict_resolution_scores_zero_when_an_old_value_is_stated():
    assert score_answer("She lives in Paris.", ["Paris"], "conflict", superseded=["Lyon"]) == 1.0
    assert score_answer("She lives in Paris, before that Lyon.", ["Paris"], "conflict", superseded=["Lyon"]) == 0.0
    assert score_answer("Lyon", ["Paris"], "conflict", superseded=["Lyon"]) == 0.0
    # the old value is part of the new one: stating the new value is not stating the old
    assert score_answer("New York City", ["New York City"], "conflict", superseded=["New York"]) == 1.0
    assert score_answer("New York City, not New York", ["New York City"], "conflict", superseded=["New York"]) == 0.0


def test_llm_judge_hook_is_called_and_clipped():
    seen = []

    def judge(question, prediction, answers):
        seen.append((question, prediction, answers))
        return 1.7

    assert score_answer("yes", [3], "accurate_retrieval", metric="llm_judge", judge=judge, question="q?") == 1.0
    assert seen == [("q?", "yes", ["3"])]
    with pytest.raises(ValueError, match="judge"):
        score_answer("yes", ["yes"], "accurate_retrieval", metric="llm_judge")


def test_finer_question_types_use_their_competency_metric():
    from memalpha.rewards.qa import score_answer

    assert score_answer("She lives in Paris.", ["Paris"], "single_hop") == 1.0
    assert score_answer(r"\boxed{3}", ["3"], "classification") == 1.0
    assert score_answer("red and blue", ["red", "blue", "green", "teal"], "summary") == 0.5


@pytest.mark.parametrize(
    ("asserted", "state"),
    [("Paris", "current"), ("Lyon; Paris", "both"), ("Lyon", "superseded"), ("", "neither"), ("Marseille", "neither")],
)
def test_conflict_memory_state_names_which_values_the_memory_asserts(asserted, state):
    assert conflict_memory_state(asserted, ["Paris"], ["Lyon"]) == state


def test_an_old_value_inside_the_new_one_is_not_a_shadow():
    assert conflict_memory_state("New York City", ["New York City"], ["New York"]) == "current"
    assert conflict_memory_state("New York; New York City", ["New York City"], ["New York"]) == "both"
