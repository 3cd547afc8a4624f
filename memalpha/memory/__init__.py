"""The memory: layout (schema), store and the views shown to the writer and the reader."""

from memalpha.memory.schema import (
    MEMALPHA_SCHEMA,
    PERSONA_SCHEMA,
    MemorySchema,
    SectionSpec,
    get_schema,
)
from memalpha.memory.store import (
    Entry,
    FailureReason,
    MemoryStore,
    OpResult,
    truncate_to_tokens,
)
from memalpha.memory.views import reader_view, view_ids, whole_view, writer_view

__all__ = [
    "MEMALPHA_SCHEMA",
    "PERSONA_SCHEMA",
    "Entry",
    "FailureReason",
    "MemorySchema",
    "MemoryStore",
    "OpResult",
    "SectionSpec",
    "get_schema",
    "reader_view",
    "truncate_to_tokens",
    "view_ids",
    "whole_view",
    "writer_view",
]
