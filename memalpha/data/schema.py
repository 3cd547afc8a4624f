"""The canonical dataset: one `Instance` per long conversation, with the `Question`s asked after its
last chunk. Everything else in `memalpha.data` converts to or from these two classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memalpha.errors import UserError

COMPETENCIES = ("accurate_retrieval", "test_time_learning", "long_range_understanding", "conflict_resolution")
"""The four memory competencies of MemoryAgentBench / the Mem-alpha paper."""

SPLITS = ("train", "validation", "test")

QUESTION_TYPES: dict[str, str] = {
    "single_hop": "accurate_retrieval",
    "multi_hop": "accurate_retrieval",
    "temporal": "accurate_retrieval",
    "open_domain": "accurate_retrieval",
    "adversarial": "accurate_retrieval",
    "classification": "test_time_learning",
    "summary": "long_range_understanding",
    "conflict": "conflict_resolution",
    **{name: name for name in COMPETENCIES},
}
"""Allowed question types and the competency each belongs to. A competency name is itself a (coarse) type.
Scoring by type: classification -> boxed label exact match, summary -> keyword hit rate over the answers,
everything else -> substring match against any gold answer (conflict: and not a superseded value)."""


class DataError(UserError):
    """Bad input data; the message names the file, the row and the field."""


def where(path: object, row: int | None = None, field_name: str | None = None, instance_id: str | None = None) -> str:
    """Location prefix for error messages: `file.parquet: row 3 (instance_id='x'): field 'chunks'`."""
    parts = [str(path)]
    if row is not None:
        parts.append(f"row {row}" + (f" (instance_id={instance_id!r})" if instance_id is not None else ""))
    if field_name is not None:
        parts.append(f"field {field_name!r}")
    return ": ".join(parts)


def answer_to_str(value: Any, location: str) -> str:
    """Canonical answer string: strings stripped, numbers accepted and formatted (3.0 -> "3")."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{location}: answer must be a string or a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


@dataclass
class Question:
    """A question about an instance. `answers` are gold strings (any one is correct; for summaries they are
    the keywords); `evidence_chunks` are chunk indices that hold the answer, when known."""

    question_id: str
    question: str
    answers: list[str]
    question_type: str
    evidence_chunks: list[int] | None = None
    superseded_answers: list[str] = field(default_factory=list)

    @property
    def answer(self) -> str:
        """The first gold answer (the Memalpha format's single `answer`)."""
        return self.answers[0] if self.answers else ""


@dataclass
class Instance:
    """One training/evaluation unit: chunks fed to the writer in order, then questions for the reader."""

    instance_id: str
    data_source: str
    competency: str
    chunks: list[str]
    questions: list[Question]
    metadata: dict[str, Any] = field(default_factory=dict)
    split: str = ""
