"""The canonical dataset: one `Instance` per long conversation, with the `Question`s asked after its
last chunk. Everything else in `memalpha.data` converts to or from these two classes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memalpha.errors import UserError

SPLITS = ("train", "validation", "test")


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
