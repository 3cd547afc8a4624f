"""The memory writer as an MLflow pyfunc model ("models from code": MLflow logs this file as the model).

Artifacts: `base_model` (the policy's weights and tokenizer), `adapter` (the writer's LoRA and its
record) and `config` (the run's RunConfig as JSON: memory, retrieval and rollout budgets). Input: a list
of conversations, each `{"turns": [{"speaker", "text", "date"?}], "questions"?: [...], "id"?}`,
`{"chunks": [...]}` or `{"text": "..."}`. Output: one memory per conversation, `{"id", "core", "semantic",
"episodic", "chunks"}`, with `answers` where questions were given. Bad input is an MlflowException with
INVALID_PARAMETER_VALUE, which the scoring server answers with HTTP 400 and the message.

One policy writes for every request: requests that arrive while it is busy wait and are then written
together, all their conversations in one batched writer call per chunk position (`RequestBatcher`).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from typing import Any, Callable

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


class RequestBatcher:
    """Concurrent requests share the writer: whoever finds it idle writes every request waiting, in one
    batch, and hands each request its memories; the others wait for theirs."""

    def __init__(self, write: Callable[[list], list]):
        self.write = write
        self.cond = threading.Condition()
        self.pending: list[tuple[list, Future]] = []
        self.busy = False
        self.batches: list[int] = []
        """Requests per batch written (for tests and the serving benchmark)."""

    def __call__(self, conversations: list) -> list:
        done: Future = Future()
        with self.cond:
            self.pending.append((conversations, done))
        while not done.done():
            with self.cond:
                if self.busy:
                    self.cond.wait(timeout=0.1)
                    continue
                if done.done():
                    break
                self.busy, batch, self.pending = True, self.pending, []
            self._run(batch)
        return done.result()

    def _run(self, batch: list[tuple[list, Future]]) -> None:
        try:
            memories = self.write([c for conversations, _ in batch for c in conversations])
            start = 0
            for conversations, done in batch:
                done.set_result(memories[start:start + len(conversations)])
                start += len(conversations)
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the error
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc)
        finally:
            with self.cond:
                self.batches.append(len(batch))
                self.busy = False
                self.cond.notify_all()


class MemoryWriterModel(PythonModel):
    def load_context(self, context) -> None:
        from memalpha.config import RunConfig
        from memalpha.writer import MemoryWriter

        config = RunConfig.model_validate(json.loads(open(context.artifacts["config"]).read()))
        self.writer = MemoryWriter(context.artifacts["adapter"], config, base_model=context.artifacts.get("base_model"))
        self.batcher = RequestBatcher(self.writer.write)

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
        return self.batcher(conversations)


def _clean(item: Any) -> Any:
    """A record of a DataFrame carries every column: drop the ones this conversation left empty."""
    if isinstance(item, dict):
        return {k: v for k, v in item.items() if v is not None and not (isinstance(v, float) and v != v)}
    return item


mlflow.models.set_model(MemoryWriterModel())
