"""Models: the policy (default, tiny, hub id or local path, wrapped with LoRA), readers and LLM judges."""

from memalpha.models.judges import (
    Judge,
    JudgeItem,
    LocalModelJudge,
    OpenAIJudge,
    make_judge,
    parse_verdict,
)
from memalpha.models.loading import (
    ModelNotPreparedError,
    cache_dir,
    default_model_dir,
    is_prepared,
)
from memalpha.models.policy import AdapterError, Policy, load_policy
from memalpha.models.readers import (
    EvidenceReader,
    LocalModelReader,
    OpenAIReader,
    Reader,
    ReaderItem,
    make_reader,
)

__all__ = [
    "AdapterError",
    "EvidenceReader",
    "Judge",
    "JudgeItem",
    "LocalModelJudge",
    "LocalModelReader",
    "ModelNotPreparedError",
    "OpenAIJudge",
    "OpenAIReader",
    "Policy",
    "Reader",
    "ReaderItem",
    "cache_dir",
    "default_model_dir",
    "is_prepared",
    "load_policy",
    "make_judge",
    "make_reader",
    "parse_verdict",
]
