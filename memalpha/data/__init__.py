"""Canonical dataset, loaders, chunking, validation and the synthetic generator (see docs/DATA.md)."""

from memalpha.data.chunking import Chunked, TokenCounts, Turn, chunk_turns, text_turns
from memalpha.data.io import read_dataset, read_manifest, write_dataset
from memalpha.data.loaders import SOURCES, RawInstance, load_source, to_instance
from memalpha.data.schema import SPLITS, DataError, Instance, Question
from memalpha.data.splits import assign_splits, split_of
from memalpha.data.synth import PRESETS, SynthConfig, generate
from memalpha.data.validation import Limits, ValidationResult, validate
from memalpha.rewards.question_types import COMPETENCIES, QUESTION_TYPES

__all__ = [
    "COMPETENCIES", "PRESETS", "QUESTION_TYPES", "SOURCES", "SPLITS", "Chunked", "DataError", "Instance", "Limits",
    "Question", "RawInstance", "SynthConfig", "TokenCounts", "Turn", "ValidationResult", "assign_splits", "chunk_turns",
    "generate", "load_source", "read_dataset", "read_manifest", "split_of", "text_turns", "to_instance", "validate",
    "write_dataset",
]
