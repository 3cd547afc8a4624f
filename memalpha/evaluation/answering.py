"""Answering what one method built: the shared reader, the tokenizer that measures sizes, and the rows a
method's build gives once its contexts are answered and scored (the serial runner and each Ray worker
run the same code)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.evaluation.methods import Built, Method
from memalpha.models.readers import Reader, ReaderItem, make_reader
from memalpha.progress import duration
from memalpha.rewards.qa import score_answer
from memalpha.rewards.rubric import compression
from memalpha.tokens import TokenCounter, regex_token_count, tokenizer_counter

log = logging.getLogger(__name__)


def policy_tokenizer(config: RunConfig) -> tuple[Any, str]:
    """The policy's tokenizer, which measures every memory size, budget and input length here, or the
    regex counter when the tokenizer is not available; returns (tokenizer or counter, description)."""
    from memalpha.models.loading import (
        TINY_POLICY,
        ModelNotPreparedError,
        build_tiny,
        default_model_dir,
        is_prepared,
        load_tokenizer,
        resolve_model_path,
    )

    try:
        if config.model.policy == TINY_POLICY:
            # the tiny model uses the default policy's tokenizer when it is prepared (no need to build the model)
            tokenizer = load_tokenizer(str(default_model_dir())) if is_prepared() else build_tiny()[1]
            return tokenizer, "tiny policy tokenizer"
        return load_tokenizer(resolve_model_path(config.model.policy)), f"{config.model.policy} tokenizer"
    except (ModelNotPreparedError, OSError) as exc:
        log.warning("no tokenizer for %s (%s); counting tokens with the regex fallback", config.model.policy, exc)
        return regex_token_count, "regex (policy tokenizer unavailable)"


def token_counter(tokenizer: Any) -> TokenCounter:
    return tokenizer if tokenizer is regex_token_count else tokenizer_counter(tokenizer)


class LazyReader:
    """The shared reader, built on first use (the local reader loads the frozen base policy)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self._reader: Reader | None = None

    def get(self) -> Reader:
        if self._reader is None:
            policy = None
            if self.config.model.reader == "local":
                from memalpha.models.policy import load_policy

                policy = load_policy(self.config.model, trainable=False)
            self._reader = make_reader(self.config.model, policy)
        return self._reader


def _score(config: RunConfig, question, prediction: str) -> float:
    return score_answer(
        prediction, question.answers, question.question_type, question.superseded_answers,
        metric=config.reward.qa_metric, question=question.question,
    )


ANSWER_SLICE = 64
"""Questions answered per reader call when progress is shown (a line per slice at most every 10 s)."""


def run_method(
    method: Method, instances: list[Instance], seed: int, reader: Reader, config: RunConfig, input_tokens: list[int],
    say: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Build, answer and score one method for one seed; returns (question rows, instance rows, memories)."""
    started = time.perf_counter()
    built: list[Built] = method.build(instances, seed)
    return answer_built(method.name, instances, seed, built, time.perf_counter() - started, reader, config, input_tokens, say)


def answer_all(reader: Reader, items: list[ReaderItem], say: Callable[[str], None] | None, label: str) -> list[str]:
    """The reader's answers to `items`; with `say`, in slices with a progress line (answered, rate, ETA)."""
    if say is None or len(items) <= ANSWER_SLICE:
        return reader.answer(items) if items else []
    answers: list[str] = []
    started, last = time.perf_counter(), float("-inf")
    for start in range(0, len(items), ANSWER_SLICE):
        answers.extend(reader.answer(items[start:start + ANSWER_SLICE]))
        now = time.perf_counter()
        if now - last >= 10 or len(answers) == len(items):
            last = now
            rate = len(answers) / (now - started)
            say(f"  {label}: answered {len(answers)}/{len(items)} questions | {rate:.2f} questions/s | "
                f"ETA {duration((len(items) - len(answers)) / rate)}")
    return answers


def answer_built(
    method: str, instances: list[Instance], seed: int, built: list[Built], build_total: float, reader: Reader,
    config: RunConfig, input_tokens: list[int], say: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Answer and score the contexts one method built (so that several readers can read one build);
    `say` gets progress lines while the reader answers."""
    if len(built) != len(instances):
        raise RuntimeError(f"method {method} built {len(built)} contexts for {len(instances)} instances")
    items = []
    for inst, result in zip(instances, built):
        if len(result.contexts) != len(inst.questions):
            raise RuntimeError(f"method {method}: {len(result.contexts)} contexts for {len(inst.questions)} questions of {inst.instance_id}")
        items.extend(ReaderItem(context, q) for context, q in zip(result.contexts, inst.questions))
    started = time.perf_counter()
    predictions = answer_all(reader, items, say, method)
    answer_total = time.perf_counter() - started
    question_rows: list[dict[str, Any]] = []
    instance_rows: list[dict[str, Any]] = []
    memories = [
        {"method": method, "seed": seed, "instance_id": inst.instance_id, "memory": result.memory}
        for inst, result in zip(instances, built) if result.memory is not None
    ]
    position = 0
    for inst, result, tokens in zip(instances, built, input_tokens):
        for q in inst.questions:
            prediction = predictions[position]
            position += 1
            question_rows.append({
                "method": method, "seed": seed, "instance_id": inst.instance_id, "data_source": inst.data_source,
                "competency": inst.competency, "input_tokens": tokens, "question_id": q.question_id,
                "question_type": q.question_type, "question": q.question, "prediction": prediction,
                "score": _score(config, q, prediction),
            })
        share = len(inst.questions) / len(items) if items else 0.0
        build_seconds = result.seconds if result.seconds else build_total / len(instances)
        instance_rows.append({
            "method": method, "seed": seed, "instance_id": inst.instance_id, "data_source": inst.data_source,
            "competency": inst.competency, "num_chunks": len(inst.chunks), "num_questions": len(inst.questions),
            "input_tokens": tokens, "memory_tokens": result.memory_tokens,
            "compression": compression(result.memory_tokens, tokens), "tool_calls": result.tool_calls,
            "tool_calls_ok": result.tool_calls_ok, "answers_lost": result.answers_lost,
            "prompts_cut": result.prompts_cut, "rechunked": result.rechunked, "build_seconds": build_seconds,
            "answer_seconds": answer_total * share,
        })
    return question_rows, instance_rows, memories
