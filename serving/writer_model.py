"""The memory writer as an MLflow pyfunc model ("models from code": MLflow logs this file as the model).

Artifacts: `base_model` (the policy's weights and tokenizer), `adapter` (the writer's LoRA and its
record) and `config` (the run's RunConfig as JSON: memory, retrieval and rollout budgets). Input: a list
of conversations, each `{"turns": [{"speaker", "text", "date"?}], "questions"?: [...], "id"?}`,
`{"chunks": [...]}` or `{"text": "..."}`. Output: one memory per conversation, `{"id", "core", "semantic",
"episodic", "chunks"}`, with `answers` where questions were given. Bad input is an MlflowException with
INVALID_PARAMETER_VALUE, which the scoring server answers with HTTP 400 and the message alone, at most
MAX_ERROR_CHARS (`short_scoring_errors`: MLflow's server would echo the whole request). A server the writer
needs that is down (its llama.cpp reader or writer) is TEMPORARILY_UNAVAILABLE, HTTP 503, with its message.

One policy writes for every request: requests that arrive while it is busy wait and are then written
together, all their conversations in one batched writer call per chunk position (`RequestBatcher`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
from concurrent.futures import Future
from typing import Any, Callable

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE
from mlflow.pyfunc import PythonModel

MAX_REQUEST_CHARS = 2_000_000
"""Most characters of conversation one request may carry (about 500K tokens, a Mem-alpha evaluation instance)."""
ENGINE_ENV = "MEMALPHA_WRITER_ENGINE"
"""Overrides the logged config's rollout.engine where the model is served (`llamacpp`: infra/servers.sh start-serve)."""
READER_ENV = "MEMALPHA_WRITER_READER"
"""Overrides the logged config's model.reader, the reader of the questions a request asks (`make serve READER=...`)."""
MAX_ERROR_CHARS = 1000
"""Most characters of an error message the server answers with."""

_logger = logging.getLogger(__name__)
_LONG_QUOTED = re.compile("'[^']{100,}'|\"[^\"]{100,}\"")


def _short(message: str) -> str:
    message = message.split("\nInput: ", 1)[0]  # MLflow's JSON parse error appends the whole body after this
    if len(message) > MAX_ERROR_CHARS:  # MLflow's type-hint and UTF-8 errors quote the input: elide long literals
        message = _LONG_QUOTED.sub(lambda m: f"{m[0][0]}...{m[0][0]}", message)
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS:,} characters cut)"
    return message


def short_scoring_errors() -> None:
    """Make MLflow's scoring server answer an error with its message alone. MLflow 3.17's `invocations` puts
    the whole request in it (`Failed to predict data '<input>'` around any MlflowException of predict, `Input:
    <body>` after a JSON parse error) and a traceback beside it; `mlflow models serve` has no hook for its app,
    and `invocations` is looked up per request, so the model wraps it when it is loaded."""
    from mlflow.pyfunc import scoring_server

    if getattr(scoring_server.invocations, "short_errors", False):
        return
    invocations = scoring_server.invocations

    @functools.wraps(invocations)
    def wrapper(*args, **kwargs):
        try:
            return invocations(*args, **kwargs)
        except MlflowException as exc:
            exc.message = _short(str(exc))  # str(): the message as raised, before the server prefixed the input
            trace = exc.json_kwargs.pop("stack_trace", None)
            if trace:  # an unexpected error: its traceback goes to the log, lines cut short, not to the client
                _logger.error("predict failed:\n%s", "\n".join(line[:200] for line in trace.splitlines()[-60:]))
            raise

    wrapper.short_errors = True
    scoring_server.invocations = wrapper


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

        config = served_config(RunConfig.model_validate(json.loads(open(context.artifacts["config"]).read())))
        self.writer = MemoryWriter(context.artifacts["adapter"], config, base_model=context.artifacts.get("base_model"))
        self.batcher = RequestBatcher(self.writer.write)
        short_scoring_errors()  # the scoring server loads the model before it serves

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
            raise MlflowException(_short(str(exc)), INVALID_PARAMETER_VALUE) from None
        return write_or_explain(self.batcher, conversations)


def write_or_explain(write: Callable[[list], list], conversations: list) -> list:
    """`write(conversations)`, its known failures as short MLflow errors: a server it needs is down (503; checked
    first, as a server that is not up is both), the request cannot be written as configured (400). Anything else
    keeps the scoring server's own answer, its traceback in the log (`short_scoring_errors`)."""
    from memalpha.errors import ServiceError, UserError

    try:
        return write(conversations)
    except ServiceError as exc:
        raise MlflowException(_short(str(exc)), TEMPORARILY_UNAVAILABLE) from None
    except UserError as exc:
        raise MlflowException(_short(str(exc)), INVALID_PARAMETER_VALUE) from None


def served_config(config):
    """The logged config with where-it-is-served overrides: `ENGINE_ENV` (`make serve ENGINE=llamacpp`: the
    adapter's export on its llama.cpp server) and `READER_ENV` (`make serve READER=qwen2.5-coder-1.5b`).
    Validated: an unknown engine or reader fails when the model loads, naming the variable."""
    from pydantic import ValidationError

    from memalpha.errors import UserError

    for env, section, field in ((ENGINE_ENV, "rollout", "engine"), (READER_ENV, "model", "reader")):
        if os.environ.get(env):
            part = getattr(config, section)
            try:
                part = type(part).model_validate({**part.model_dump(), field: os.environ[env]})
            except ValidationError as exc:
                raise UserError(f"{env}={os.environ[env]!r}: {exc.errors()[0]['msg']}") from None
            config = config.model_copy(update={section: part})
    return config


def _clean(item: Any) -> Any:
    """A record of a DataFrame carries every column: drop the ones this conversation left empty."""
    if isinstance(item, dict):
        return {k: v for k, v in item.items() if v is not None and not (isinstance(v, float) and v != v)}
    return item


mlflow.models.set_model(MemoryWriterModel())
