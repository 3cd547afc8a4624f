"""The one table of question types: the competency each belongs to and the metric that scores it."""

from __future__ import annotations

COMPETENCIES = ("accurate_retrieval", "test_time_learning", "long_range_understanding", "conflict_resolution")
"""The four memory competencies of MemoryAgentBench / the Mem-alpha paper."""

COMPETENCY_METRIC = {
    "accurate_retrieval": "substring_em",
    "test_time_learning": "boxed_em",
    "long_range_understanding": "keyword_hit",
    "conflict_resolution": "substring_em",
}
"""Metric `metrics.score_answer` uses for each competency when the metric is `auto`."""

QUESTION_TYPES: dict[str, str] = {
    "single_hop": "accurate_retrieval",
    "multi_hop": "accurate_retrieval",
    "temporal": "accurate_retrieval",
    "open_domain": "accurate_retrieval",
    "adversarial": "accurate_retrieval",
    "classification": "test_time_learning",
    "summary": "long_range_understanding",
    "conflict": "conflict_resolution",
    "sentence_answer": "accurate_retrieval",
    **{name: name for name in COMPETENCIES},
}
"""Allowed question types and the competency each belongs to. A competency name is itself a (coarse) type.
Scoring by type: classification -> boxed label exact match, summary -> keyword hit rate over the answers,
everything else -> substring match against any gold answer (conflict: and not a superseded value)."""

TYPE_METRIC = {"sentence_answer": "f1"}
"""Types scored otherwise than their competency: a whole answer sentence as gold (PerLTQA questions
without a short anchor) is scored by token F1, since no reader repeats a sentence word for word."""


def metric_for_question_type(question_type: str) -> str:
    """The `auto` metric of a question type; ValueError for a type outside QUESTION_TYPES."""
    if question_type in TYPE_METRIC:
        return TYPE_METRIC[question_type]
    if question_type not in QUESTION_TYPES:
        raise ValueError(f"question_type {question_type!r} has no default metric (known: {', '.join(QUESTION_TYPES)})")
    return COMPETENCY_METRIC[QUESTION_TYPES[question_type]]
