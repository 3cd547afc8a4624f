"""LLM judges of write validity (r4): the frozen local base model or an OpenAI-compatible endpoint.

The rule judge (the default) lives in memalpha/rewards.py. Verdict parsing is strict: only an explicit
VALID counts; INVALID, NOT VALID, both words, or no verdict are invalid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from memalpha.config import ModelConfig
from memalpha.env.prompts import judge_messages, render_chat
from memalpha.models.openai_client import OpenAIChatClient

_WORD = re.compile(r"[A-Za-z]+")


@dataclass
class JudgeItem:
    """One write to judge: what was written into which memory type, and the chunk it came from."""

    memory_type: str
    content: str
    chunk_text: str
    type_description: str = ""


class Judge(Protocol):
    """Judges a batch of writes; one verdict per item, in order."""

    def judge(self, items: list[JudgeItem]) -> list[bool]: ...


def parse_verdict(text: str) -> bool:
    """True only for an explicit VALID verdict (not INVALID, not "not valid", not both)."""
    words = [w.upper() for w in _WORD.findall(text or "")]
    if "INVALID" in words or "VALID" not in words:
        return False
    first = words.index("VALID")
    return not (first > 0 and words[first - 1] == "NOT")


class LocalModelJudge:
    """The frozen base policy (adapters disabled) judges with greedy generation."""

    def __init__(self, policy, max_new_tokens: int = 4, batch_size: int = 16):
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def raw_verdicts(self, items: list[JudgeItem]) -> list[str]:
        prompts = [
            render_chat(self.policy.tokenizer, judge_messages(i.memory_type, i.type_description, i.content, i.chunk_text))
            for i in items
        ]
        with self.policy.adapters_disabled():
            return self.policy.generate_text(prompts, self.max_new_tokens, batch_size=self.batch_size)

    def judge(self, items: list[JudgeItem]) -> list[bool]:
        return [parse_verdict(text) for text in self.raw_verdicts(items)] if items else []


class OpenAIJudge:
    """A judge served behind an OpenAI-compatible chat-completions endpoint."""

    def __init__(self, client: OpenAIChatClient, max_new_tokens: int = 4):
        self.client = client
        self.max_new_tokens = max_new_tokens

    def judge(self, items: list[JudgeItem]) -> list[bool]:
        conversations = [judge_messages(i.memory_type, i.type_description, i.content, i.chunk_text) for i in items]
        return [parse_verdict(text) for text in self.client.complete_many(conversations, self.max_new_tokens)]


def make_judge(model_cfg: ModelConfig, policy=None) -> Judge:
    """The LLM judge named by `model_cfg.judge`; `local` needs the loaded policy."""
    if model_cfg.judge == "local":
        if policy is None:
            raise ValueError("model.judge=local needs the loaded policy (its frozen base model judges)")
        return LocalModelJudge(policy)
    if model_cfg.judge == "openai":
        return OpenAIJudge(OpenAIChatClient.from_config(model_cfg))
    raise ValueError(f"model.judge: unknown judge {model_cfg.judge!r}")
