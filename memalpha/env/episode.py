"""One writer episode: an instance's chunks read in order into one memory.

The single home of the writer's chunk loop. An `Episode` owns the memory store, its retrieval index and
the writer view of one instance; `prompt()` gives the writer prompt for the current chunk and
`step(completion)` parses and executes a completion and moves to the next chunk. Batched rollouts, the
rule writer (SFT demonstrations and the evaluation baseline) and evaluation all drive this class, so a
writer sees the same thing whoever writes.

Each step also records, for the questions the chunk can make answerable (`rewards.coverage_chunks`), how
far what it wrote supports their answers (`rewards.answer_support`): the per-chunk content reward needs
the memory right after the step, which only the episode has.

`copy()` branches an episode cheaply (entries are immutable and shared; the index is rebuilt over the
copy), so several completions can be tried from one memory state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from memalpha.config import SHADOWED_CONFLICT_CREDIT, MemoryConfig, RetrievalConfig
from memalpha.data.schema import Instance
from memalpha.env.parsing import ParseResult
from memalpha.env.prompts import render_writer_prompt, writer_user_message
from memalpha.env.tools import ToolResult, execute_text
from memalpha.memory import MemorySchema, MemoryStore, view_ids, whole_view, writer_view
from memalpha.retrieval import MemoryIndex
from memalpha.rewards.coverage import (
    answer_support,
    coverage_chunks,
    memory_support,
    retention,
)
from memalpha.rewards.judge import overwritten_unrelated
from memalpha.tokens import TokenCounter


@dataclass
class Step:
    """One chunk of an episode: what the writer saw and wrote, and what it did to the memory."""

    chunk: int
    prompt: str
    completion: str
    parse: ParseResult
    results: list[ToolResult]
    memory_tokens: int
    """Memory size after this step."""
    memory_entries: int
    support: dict[int, float] = field(default_factory=dict)
    """Question index -> how far this step's writes support its answer, for the questions this chunk
    can make answerable."""
    memory_support: dict[int, float] = field(default_factory=dict)
    """Question index -> how far the whole memory after this step supports its answer (`memory_support`)."""
    retention: float = 1.0
    """Share of the memory's answer support before this step that survived it (`rewards.retention`)."""


def answers_lost(supports: Sequence[dict[int, float]]) -> int:
    """Questions whose answer the whole memory fully supported after some step but no longer does after
    the last one (stored, then overwritten or deleted). supports[t]: `memory_support` after step t."""
    if not supports:
        return 0
    held = {j for support in supports for j, value in support.items() if value >= 1.0}
    return sum(supports[-1].get(j, 0.0) < 1.0 for j in held)


def whole_memory_text(store: MemoryStore) -> str:
    """Every paragraph and entry of `store`, rendered as a view without a budget."""
    return whole_view(store, budget_tokens=10**9) or ""


class Episode:
    """The memory of one instance being written chunk by chunk.

    With `tokenizer`, prompts are rendered with its chat template (what a policy reads); without, the
    prompt is the plain writer message (for writers that need no model, such as the rule writer).
    `shadowed_conflict_credit` is `reward.shadowed_conflict_credit`, applied in each step's answer support.
    """

    def __init__(
        self,
        instance: Instance,
        schema: MemorySchema,
        memory_cfg: MemoryConfig,
        retrieval_cfg: RetrievalConfig,
        count_tokens: TokenCounter,
        tokenizer=None,
        embedder=None,
        shadowed_conflict_credit: float = SHADOWED_CONFLICT_CREDIT,
    ):
        self.instance = instance
        self.shadowed_conflict_credit = shadowed_conflict_credit
        self.memory_cfg = memory_cfg
        self.retrieval_cfg = retrieval_cfg
        self.tokenizer = tokenizer
        self.embedder = embedder
        self.store = MemoryStore(schema, count_tokens)
        self.index = MemoryIndex(self.store, retrieval_cfg, embedder)
        self.steps: list[Step] = []
        self._relevant = self._questions_by_chunk()
        self._view: str | None = None

    def _questions_by_chunk(self) -> list[list[int]]:
        by_chunk: list[list[int]] = [[] for _ in self.instance.chunks]
        for j, question in enumerate(self.instance.questions):
            for t in coverage_chunks(question, self.instance.chunks) or ():
                by_chunk[t].append(j)
        return by_chunk

    @property
    def position(self) -> int:
        """Index of the chunk the writer reads next."""
        return len(self.steps)

    @property
    def done(self) -> bool:
        return self.position >= len(self.instance.chunks)

    @property
    def chunk_text(self) -> str:
        return self.instance.chunks[self.position]

    @property
    def relevant_questions(self) -> list[list[int]]:
        """Per chunk, the indices of the questions it can make answerable."""
        return self._relevant

    def view(self) -> str:
        """The writer view of the memory for the current chunk (newest and relevant entries)."""
        if self._view is None:
            cfg = self.memory_cfg
            self._view = writer_view(self.store, self.chunk_text, self.index.search, cfg.writer_view_tokens,
                                     cfg.writer_newest_entries, cfg.writer_relevant_entries)
        return self._view

    def visible_ids(self) -> set[str]:
        """Entry ids the writer can see now, so the only ones it can update or delete knowingly."""
        return view_ids(self.view())

    def prompt(self) -> str:
        """The writer prompt for the current chunk."""
        if self.tokenizer is None:
            return writer_user_message(self.view(), self.chunk_text)
        return render_writer_prompt(self.tokenizer, self.store.schema, self.view(), self.chunk_text)

    def step(self, completion: str, prompt: str | None = None) -> Step:
        """Parse and execute `completion` on the memory for the current chunk, then move on.
        `prompt` is what the writer was shown (default: `prompt()`), kept on the step."""
        if self.done:
            raise IndexError(f"{self.instance.instance_id}: all {len(self.instance.chunks)} chunks were already read")
        t = self.position
        chunk_text = self.chunk_text
        prompt = self.prompt() if prompt is None else prompt
        parsed, results = execute_text(self.store, completion, t)
        whole = whole_memory_text(self.store) if self.instance.questions else ""  # rendered once, read by both supports
        support = {}
        if self._relevant[t]:
            overwritten = overwritten_unrelated(results)
            unresolved = f"{whole}\n{overwritten}" if overwritten else whole
            written = "\n".join(self._written(results))
            support = {j: answer_support(self.instance.questions[j], written, chunk_text, lambda: unresolved,
                                         self.shadowed_conflict_credit) for j in self._relevant[t]}
        supported = memory_support(self.instance.questions, whole)
        kept = retention(self.steps[-1].memory_support if self.steps else {}, supported)
        step = Step(t, prompt, completion, parsed, results, self.store.token_count(), self.store.entry_count(), support,
                    supported, kept)
        self.steps.append(step)
        self._view = None
        return step

    def _written(self, results: list[ToolResult]) -> list[str]:
        """What this step's executed writes say now, one text per entry or paragraph written (a later
        call of the same step may have changed or deleted an entry)."""
        lines: dict[str, str] = {}
        for result in results:
            if not result.ok or result.name == "memory_delete" or result.memory_type is None:
                continue
            spec = self.store.spec(result.memory_type)
            if spec is not None and not spec.is_list:
                lines[result.memory_type] = self.store.paragraph(result.memory_type)
            elif result.entry_id and (entry := self.store.get(result.memory_type, result.entry_id)) is not None:
                lines[entry.id] = entry.content
        return list(lines.values())

    def copy(self) -> Episode:
        """An independent episode at the same position with the same memory."""
        new = Episode.__new__(Episode)
        new.__dict__.update(self.__dict__)
        new.store = self.store.copy()
        new.index = MemoryIndex(new.store, self.retrieval_cfg, self.embedder)
        new.steps = list(self.steps)
        return new
