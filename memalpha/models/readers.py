"""Readers answer questions from a memory context (r1). Three interchangeable backends:

- `EvidenceReader`: deterministic, no model. Answers with the gold answer only when the retrieved memory
  context supports it. The fast default for CPU training: r1 then measures what the memory holds,
  independent of a weak reader's reading skill.
- `LocalModelReader`: the base policy with adapters disabled (frozen), batched greedy generation.
- `OpenAIReader`: an OpenAI-compatible endpoint (a large served reader, as in the paper); the packaged
  LLM readers (`qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`) are this reader on their llama.cpp server, the
  context first and the question last so the server's prompt cache reuses a shared context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol

from memalpha.config import ModelConfig
from memalpha.data.schema import Question
from memalpha.env.prompts import reader_messages, render_reader_prompt
from memalpha.models import llamacpp
from memalpha.models.loading import LLM_MODELS
from memalpha.models.openai_client import OpenAIChatClient
from memalpha.rewards.qa import normalize_answer
from memalpha.rewards.question_types import QUESTION_TYPES

NO_ANSWER = ""
"""What the evidence reader says when the memory does not support an answer (scores 0 under every metric)."""

_STOPWORDS = frozenset(
    "a an the of to in on at for and or but is are was were be been it this that with as by from what which who "
    "whom whose when where why how do does did i you he she we they my your his her our their me him us them "
    "input label text example sentence question answer".split()
)


@dataclass
class ReaderItem:
    """One question to answer from one memory context (the reader view of a memory)."""

    context: str
    question: Question


class Reader(Protocol):
    """Answers a batch of questions; one answer string per item, in order."""

    def answer(self, items: list[ReaderItem]) -> list[str]: ...


def competency_of(question: Question) -> str:
    """The competency a question type belongs to (unknown types count as accurate retrieval)."""
    return QUESTION_TYPES.get(question.question_type, "accurate_retrieval")


def is_boxed(question: Question) -> bool:
    """Test-time-learning (classification) questions are answered with a \\boxed{label}."""
    return competency_of(question) == "test_time_learning"


def _contains(haystack: str, needle: str) -> bool:
    # normalised text, word boundaries (the same convention as memalpha.rewards.qa)
    return bool(needle) and f" {needle} " in f" {haystack} "


def _lines(context: str) -> list[str]:
    """Units of evidence: view lines (one entry each) and the sentences of paragraphs."""
    units: list[str] = []
    for line in context.splitlines():
        units.extend(part for part in re.split(r"(?<=[.!?;])\s+", line) if part.strip())
    return [normalize_answer(u) for u in units]


_ENTRY_ID = re.compile(r"^\s*-\s*[a-z_]+-\d+:\s*")
_QUOTED = re.compile(r'"([^"]{3,})"')
_LINE_LABEL = re.compile(r"(?:\b(?:label|category|class)\b\s*(?:is\s*|[:=#]\s*)?|\\boxed\{|=>|->|→)\s*(?P<label>[\w-]+)", re.I)


def _content_words(text: str) -> set[str]:
    return {w for w in normalize_answer(text).split() if w not in _STOPWORDS and len(w) > 1}


class EvidenceReader:
    """Deterministic reader: the gold answer iff the memory context supports it, else NO_ANSWER.

    Per competency:
    - accurate retrieval: a gold answer (normalised, on word boundaries) occurs in the context.
    - test-time learning: nearest-neighbour classification over the labelled examples in the context
      (lines with "label N", "category N", "-> N" or a boxed label): the label of the example whose
      content words overlap most (Jaccard >= `min_overlap`) with the question's input (quoted parts
      are compared when present), as `\\boxed{label}`; no stored example close enough -> NO_ANSWER.
    - long-range understanding: the gold keywords present in the context, joined by ", " (keyword
      hit rate then equals the share of keywords the memory kept).
    - conflict resolution: a line asserts the values it mentions without an obsolescence cue ("moved
      from X to Y", "the old X", "X anymore" assert only Y). Only the current value asserted -> the
      current value; a superseded value still asserted too -> both values, which scores 0 (a memory
      still asserting the stale fact is ambiguous to a reader, so the writer is rewarded for updating
      or deleting it, not for adding a second copy).
    """

    def __init__(self, min_overlap: float = 0.2):
        self.min_overlap = min_overlap

    def answer(self, items: list[ReaderItem]) -> list[str]:
        return [self.answer_one(item.context, item.question) for item in items]

    def answer_one(self, context: str, question: Question) -> str:
        competency = competency_of(question)
        if competency == "test_time_learning":
            return self._label(context, question)
        if competency == "long_range_understanding":
            return self._keywords(context, question)
        if competency == "conflict_resolution" and question.superseded_answers:
            return self._conflict(context, question)
        return self._extractive(context, question)

    @staticmethod
    def _extractive(context: str, question: Question) -> str:
        text = normalize_answer(context)
        for gold in question.answers:
            if _contains(text, normalize_answer(gold)):
                return gold
        return NO_ANSWER

    def _label(self, context: str, question: Question) -> str:
        # nearest stored labelled example to the question's input; the gold label is not consulted
        quoted = _QUOTED.findall(question.question)
        wanted = _content_words(quoted[-1] if quoted else question.question)
        best: tuple[float, str] | None = None
        for line in context.splitlines():
            line = _ENTRY_ID.sub("", line)
            match = _LINE_LABEL.search(line)
            if not match:
                continue
            example = _QUOTED.findall(line)  # compare input with input when the example is quoted
            words = _content_words(example[-1] if example else _LINE_LABEL.sub(" ", line))
            overlap = len(wanted & words) / len(wanted | words) if wanted and words else 0.0
            if overlap >= self.min_overlap and (best is None or overlap > best[0]):
                best = (overlap, match.group("label"))
        return f"\\boxed{{{best[1]}}}" if best else NO_ANSWER

    @staticmethod
    def _keywords(context: str, question: Question) -> str:
        text = normalize_answer(context)
        return ", ".join(k for k in question.answers if _contains(text, normalize_answer(k)))

    @staticmethod
    def _conflict(context: str, question: Question) -> str:
        values = [(g, normalize_answer(g), True) for g in question.answers]
        values += [(g, normalize_answer(g), False) for g in question.superseded_answers]
        current_found: str | None = None
        stale_found: str | None = None
        for line in _lines(context):
            for gold, is_current in _asserted(line, values):
                if is_current:
                    current_found = current_found or gold
                else:
                    stale_found = stale_found or gold
        if current_found and stale_found:
            return f"{stale_found}; {current_found}"
        return current_found or stale_found or NO_ANSWER


_STALE_BEFORE = frozenset("old from former previous previously longer more quit left goodbye sold replaced ex up used instead".split())
_STALE_AFTER = frozenset("anymore stopped".split())


def _asserted(line: str, values: list[tuple[str, str, bool]]) -> list[tuple[str, bool]]:
    """The values a normalised line asserts: mentions not marked as obsolete by a nearby cue ("from X",
    "the old X", "X anymore"). When every mention is marked, the line asserts nothing."""
    words = line.split()
    asserted = []
    for gold, norm, is_current in values:
        size = len(norm.split())
        for i in range(len(words) - size + 1):
            if norm and " ".join(words[i : i + size]) == norm:
                before, after = set(words[max(0, i - 2) : i]), set(words[i + size : i + size + 2])
                if not (before & _STALE_BEFORE or after & _STALE_AFTER):
                    asserted.append((gold, is_current))
                    break
    return asserted


class LocalModelReader:
    """The base policy with adapters disabled answers with batched greedy generation."""

    def __init__(self, policy, max_new_tokens: int = 32, batch_size: int = 16, max_prompt_tokens: int | None = None):
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens

    def answer(self, items: list[ReaderItem]) -> list[str]:
        prompts = [
            render_reader_prompt(self.policy.tokenizer, item.context, item.question.question, is_boxed(item.question))
            for item in items
        ]
        with self.policy.adapters_disabled():
            return self.policy.generate_text(
                prompts, self.max_new_tokens, batch_size=self.batch_size, max_prompt_tokens=self.max_prompt_tokens
            )


class OpenAIReader:
    """A reader served behind an OpenAI-compatible chat-completions endpoint."""

    def __init__(self, client: OpenAIChatClient, max_new_tokens: int = 32):
        self.client = client
        self.max_new_tokens = max_new_tokens

    def answer(self, items: list[ReaderItem]) -> list[str]:
        conversations = [reader_messages(i.context, i.question.question, is_boxed(i.question)) for i in items]
        return [text.strip() for text in self.client.complete_many(conversations, self.max_new_tokens)]


def closed_book(reader: Reader) -> Callable[[str], str]:
    """The reader asked with an empty memory: question -> answer (data prep's closed-book filter drops
    questions it answers correctly, since they test the reader's world knowledge, not the memory)."""

    def ask(question: str) -> str:
        return reader.answer([ReaderItem("", Question("closed-book", question, [], "single_hop"))])[0]

    return ask


def make_reader(model_cfg: ModelConfig, policy=None) -> Reader:
    """The reader named by `model_cfg.reader`; `local` needs the loaded policy."""
    if model_cfg.reader == "evidence":
        return EvidenceReader()
    if model_cfg.reader == "local":
        if policy is None:
            raise ValueError("model.reader=local needs the loaded policy (its frozen base model answers)")
        return LocalModelReader(policy, model_cfg.reader_max_new_tokens)
    if model_cfg.reader == "openai":
        return OpenAIReader(OpenAIChatClient.from_config(model_cfg), model_cfg.reader_max_new_tokens)
    if model_cfg.reader in LLM_MODELS:
        llamacpp.check_server(model_cfg.reader)
        client = OpenAIChatClient(llamacpp.server_url(model_cfg.reader) + "/v1", model_cfg.reader,
                                  timeout=llamacpp.REQUEST_TIMEOUT_S, concurrency=2 * llamacpp.PARALLEL,
                                  start_hint=f"restart it with `bash infra/servers.sh start-llama {model_cfg.reader}`")
        return OpenAIReader(client, model_cfg.reader_max_new_tokens)
    raise ValueError(f"model.reader: unknown reader {model_cfg.reader!r}")
