"""Raw instances as loaders return them: turns plus questions whose evidence is given as turn ids, before
chunking (`loaders.to_instance`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memalpha.data.chunking import Turn
from memalpha.data.schema import Instance, Question


@dataclass
class RawInstance:
    """An instance before chunking: turns plus questions whose evidence is given as turn ids."""

    instance_id: str
    data_source: str
    competency: str
    turns: list[Turn]
    questions: list[Question]
    evidence_turns: dict[str, list[str]] = field(default_factory=dict)
    """question_id -> ids of the turns that hold the answer."""
    metadata: dict[str, Any] = field(default_factory=dict)
    split: str = ""
    """train/validation/test when the source fixes it (by conversation), else empty."""


@dataclass
class Loaded:
    """What a loader returns: items in file order and where each came from (for error messages)."""

    items: list[Instance | RawInstance]
    origins: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    """Questions the loader dropped, as rows of the rejected table (io.REJECTED_COLUMNS)."""
