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

import random
from dataclasses import dataclass, field, replace
from typing import Sequence

from memalpha.config import SHADOWED_CONFLICT_CREDIT, MemoryConfig, RetrievalConfig, RunConfig
from memalpha.data.schema import Instance, Question
from memalpha.memory import MemorySchema, MemoryStore, reader_view, view_ids, whole_view, writer_view
from memalpha.metrics import score_answer
from memalpha.models.readers import ReaderItem
from memalpha.parsing import ParseResult
from memalpha.prompts import render_writer_prompt, writer_user_message
from memalpha.retrieval import MemoryIndex
from memalpha.rewards import (
    RewardBreakdown,
    answer_support,
    attribution_credit,
    chunk_coverage,
    chunk_rewards,
    coverage_chunks,
    llm_verdicts,
    memory_support,
    overwritten_unrelated,
    retention,
)
from memalpha.tokens import TokenCounter
from memalpha.tools import ToolResult, execute_text


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
    content_writes: int = 0
    """Executed inserts, updates and paragraph writes of this step (one per entry or paragraph written)."""
    answer_writes: int = 0
    """Of `content_writes`, those that hold an answer of a question this chunk can make answerable."""


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


def truncate_for_training(instances: list[Instance], max_chunks: int) -> tuple[list[Instance], int]:
    """The first `max_chunks` chunks of each instance (0: all), keeping only the questions whose evidence
    all survives (questions without evidence indices are kept); instances left without a question are
    dropped. Returns the kept instances and how many were dropped."""
    if not max_chunks:
        return list(instances), 0
    kept = []
    for instance in instances:
        if len(instance.chunks) > max_chunks:
            questions = [q for q in instance.questions
                         if q.evidence_chunks is None or all(c < max_chunks for c in q.evidence_chunks)]
            instance = replace(instance, chunks=instance.chunks[:max_chunks], questions=questions)
        if instance.questions:
            kept.append(instance)
    return kept, len(instances) - len(kept)


def thin_distractors(instance: Instance, keep_share: float) -> Instance:
    """The instance with only `keep_share` of its distractor chunks (chunks that no question cites as
    evidence), a fixed subset per instance, evidence indices renumbered. Unchanged at 1, and when a
    question's evidence is unknown (distractors cannot be told apart then)."""
    if keep_share >= 1 or any(q.evidence_chunks is None for q in instance.questions):
        return instance
    evidence = {c for q in instance.questions for c in q.evidence_chunks}
    distractors = [i for i in range(len(instance.chunks)) if i not in evidence]
    kept_distractors = set(random.Random(instance.instance_id).sample(distractors, round(keep_share * len(distractors))))
    kept = [i for i in range(len(instance.chunks)) if i in evidence or i in kept_distractors]
    renumber = {old: new for new, old in enumerate(kept)}
    questions = [replace(q, evidence_chunks=[renumber[c] for c in q.evidence_chunks]) for q in instance.questions]
    return replace(instance, chunks=[instance.chunks[i] for i in kept], questions=questions)


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
                                     cfg.writer_newest_entries, cfg.writer_relevant_entries, cfg.writer_view_order)
        return self._view

    def visible_ids(self) -> set[str]:
        """Entry ids the writer can see now, so the only ones it can update or delete knowingly."""
        return view_ids(self.view(), self.store)

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
        writes = self._written(results)
        support, answer_writes = {}, 0
        if self._relevant[t]:
            overwritten = overwritten_unrelated(results)
            unresolved = f"{whole}\n{overwritten}" if overwritten else whole

            def supports(j: int, text: str) -> float:
                return answer_support(self.instance.questions[j], text, chunk_text, lambda: unresolved,
                                      self.shadowed_conflict_credit)

            support = {j: supports(j, "\n".join(writes)) for j in self._relevant[t]}
            answer_writes = sum(any(supports(j, text) > 0 for j in self._relevant[t]) for text in writes)
        supported = memory_support(self.instance.questions, whole)
        kept = retention(self.steps[-1].memory_support if self.steps else {}, supported)
        step = Step(t, prompt, completion, parsed, results, self.store.token_count(), self.store.entry_count(), support,
                    supported, kept, len(writes), answer_writes)
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


@dataclass
class EpisodeScore:
    """A finished episode scored: the reader's answers, r1 and the reward breakdown of every step."""

    answers: list[dict]
    """One {question, prediction, answers, score} per question."""
    qa_score: float
    rewards: list[RewardBreakdown]


def reader_context(episode: Episode, question: str, config: RunConfig, mode: str) -> str:
    """What the reader sees of an episode's memory for one question: the whole memory when `mode` is
    `whole_if_fits` and it fits the reader budget, else the retrieved entries (the paper's setting)."""
    budget = config.memory.reader_view_tokens
    if mode == "whole_if_fits" and (whole := whole_view(episode.store, budget)) is not None:
        return whole
    return reader_view(episode.store, question, episode.index.search, budget, config.retrieval.top_k)


def score_episodes(episodes: list[Episode], config: RunConfig, reader, judge=None,
                   view_mode: str | None = None) -> list[EpisodeScore]:
    """Score finished episodes: the reader answers every question (one batched call), r1 is the mean QA
    score, coverage comes from the steps (and, for questions without evidence indices, from which chunk
    wrote the entries the reader was shown), and `chunk_rewards` gives each step its breakdown.
    `view_mode` overrides `reward.reader_view`; `judge` is an LLM judge for r4 (None: the rule judge)."""
    view_mode = view_mode or config.reward.reader_view
    items, where = [], []
    for r, episode in enumerate(episodes):
        for question in episode.instance.questions:
            items.append(ReaderItem(reader_context(episode, question.question, config, view_mode), question))
            where.append(r)
    predictions = reader.answer(items) if items else []
    answers: list[list[dict]] = [[] for _ in episodes]
    shown: list[list[list[int]]] = [[] for _ in episodes]
    for item, prediction, r in zip(items, predictions, where):
        q = item.question
        score = score_answer(prediction, q.answers, q.question_type, q.superseded_answers,
                             metric=config.reward.qa_metric, question=q.question)
        answers[r].append({"question": q.question, "prediction": prediction, "answers": q.answers, "score": score})
        shown[r].append(_writing_chunks(episodes[r].store, item.context, q))
    out = []
    for episode, episode_answers, episode_shown in zip(episodes, answers, shown):
        qa_score = sum(a["score"] for a in episode_answers) / len(episode_answers) if episode_answers else 0.0
        results = [step.results for step in episode.steps]
        verdicts = None
        if judge is not None:
            descriptions = {s.name: s.description for s in episode.store.schema.sections}
            verdicts = llm_verdicts(results, episode.instance.chunks, judge, episode.store, descriptions)
        unanchored = [j for j, q in enumerate(episode.instance.questions) if q.evidence_chunks is None]
        attributed = None
        if unanchored:
            attributed = attribution_credit([episode_answers[j]["score"] for j in unanchored],
                                            [episode_shown[j] for j in unanchored], len(episode.steps))
        coverage = chunk_coverage([step.support for step in episode.steps],
                                  episode.relevant_questions[: len(episode.steps)], attributed,
                                  [step.retention for step in episode.steps],
                                  [(step.answer_writes, step.content_writes) for step in episode.steps])
        rewards = chunk_rewards(
            qa_score, results, [step.parse.nothing_to_store for step in episode.steps], episode.store.token_count(),
            sum(episode.store.count_tokens(c) for c in episode.instance.chunks[: len(episode.steps)]), config.reward,
            memory=episode.store, verdicts=verdicts, coverage=coverage,
        )
        out.append(EpisodeScore(episode_answers, qa_score, rewards))
    return out


def score_step(episode: Episode, config: RunConfig, judge=None) -> RewardBreakdown:
    """The per-chunk reward of an episode's last step, judged on the memory right after it: coverage,
    and r2/r4 under the content gate. The trajectory terms (r1, r3) are 0: they need the final memory.
    Step-level GRPO compares the G candidates of one memory state with it."""
    step = episode.steps[-1]
    t = step.chunk
    # earlier chunks as empty positions, so the judge sees this step's real chunk index
    results = [[] for _ in range(t)] + [step.results]
    verdicts = None
    if judge is not None:
        descriptions = {s.name: s.description for s in episode.store.schema.sections}
        verdicts = llm_verdicts(results, episode.instance.chunks[: t + 1], judge, episode.store, descriptions)
    unanchored = any(q.evidence_chunks is None for q in episode.instance.questions)
    [coverage] = chunk_coverage([step.support], [episode.relevant_questions[t]], [0.0] if unanchored else None,
                                [step.retention], [(step.answer_writes, step.content_writes)])
    # input tokens 0: r3 needs a useful final memory, so it is 0 here whatever the input (no tokenising)
    rewards = chunk_rewards(0.0, results, [False] * t + [step.parse.nothing_to_store], episode.store.token_count(),
                            0, config.reward, memory=episode.store, verdicts=verdicts, coverage=[coverage] * (t + 1))
    return rewards[-1]


def _writing_chunks(store: MemoryStore, context: str, question: Question) -> list[int]:
    """The chunk that created or last updated each entry the reader was shown for `question`; only the
    entries that bear on its answer count when some do (a whole-memory view shows every entry)."""
    shown = [e for entry_id in sorted(view_ids(context, store))
             if (section := store.section_of(entry_id)) and (e := store.get(section, entry_id)) is not None]
    bearing = [e for e in shown if answer_support(question, e.content, e.content, lambda: "") > 0]
    return [e.updated_chunk for e in bearing or shown]
