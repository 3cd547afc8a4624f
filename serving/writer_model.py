"""The memory writer as an MLflow pyfunc model ("models from code": MLflow logs this file as the model).

Artifacts: `base_model` (the policy's weights and tokenizer), `adapter` (the writer's LoRA and its
record) and `config` (the run's RunConfig as JSON: memory, retrieval and rollout budgets). Input: a list
of conversations, each `{"turns": [{"speaker", "text", "date"?}], "questions"?: [...], "id"?}`,
`{"chunks": [...]}` or `{"text": "..."}`. Output: one memory per conversation, `{"id", "core", "semantic",
"episodic", "chunks"}`, with `answers` where questions were given. Bad input is an MlflowException with
INVALID_PARAMETER_VALUE, which the scoring server answers with HTTP 400 and the message.

Requests are written one at a time (one policy, one thread of generation), the conversations of a
request together in one batch.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.pyfunc import PythonModel

MAX_REQUEST_CHARS = 2_000_000
"""Most characters of conversation one request may carry (about 500K tokens, a Mem-alpha evaluation instance)."""


def _conversations(model_input: Any) -> list[dict]:
    """The request's conversations as plain dicts, whatever container the scoring server built."""
    if hasattr(model_input, "to_dict"):  # a pandas DataFrame of records
        model_input = model_input.to_dict(orient="records")
    if isinstance(model_input, dict):
        model_input = [model_input]
    if not isinstance(model_input, list) or not model_input:
        raise MlflowException("inputs: expected a non-empty list of conversations", INVALID_PARAMETER_VALUE)
    return model_input


class MemoryWriterModel(PythonModel):
    def load_context(self, context) -> None:
        from memalpha.config import RunConfig
        from memalpha.writer import MemoryWriter

        config = RunConfig.model_validate(json.loads(open(context.artifacts["config"]).read()))
        self.writer = MemoryWriter(context.artifacts["adapter"], config, base_model=context.artifacts.get("base_model"))
        self.lock = threading.Lock()

    def predict(self, context, model_input: list[dict[str, Any]], params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        from memalpha.writer import WriteInputError, parse_conversation

        items = _conversations(model_input)
        size = len(json.dumps(items, default=str))
        if size > MAX_REQUEST_CHARS:
            raise MlflowException(f"inputs: {size:,} characters, more than the {MAX_REQUEST_CHARS:,} one request may carry; "
                                  "send the conversations in several requests", INVALID_PARAMETER_VALUE)
        try:
            conversations = [parse_conversation(_clean(item), f"inputs[{i}]") for i, item in enumerate(items)]
        except WriteInputError as exc:
            raise MlflowException(str(exc), INVALID_PARAMETER_VALUE) from None
        with self.lock:
            return self.writer.write(conversations)


def _clean(item: Any) -> Any:
    """A record of a DataFrame carries every column: drop the ones this conversation left empty."""
    if isinstance(item, dict):
        return {k: v for k, v in item.items() if v is not None and not (isinstance(v, float) and v != v)}
    return item


mlflow.models.set_model(MemoryWriterModel())
