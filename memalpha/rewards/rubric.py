"""The reward rubric of a (rollout, chunk) sample: the only place r1..r4 are combined. See docs/REWARDS.md.

r_t = r1 + w * coverage_t + g_t * (r2_t + gamma * r4_t) + beta * r3
- r1: mean QA score of the instance's questions on the final memory (shared by the rollout's chunks);
- coverage_t: how far what chunk t wrote makes the questions it holds evidence for answerable
  (1 for a chunk that holds no evidence); g_t = coverage_t on chunks with evidence (format cannot
  outscore content), 1 elsewhere;
- r2_t: share of chunk t's calls that executed (each unparseable fragment is one failed call);
- r3: 1 - memory tokens / input tokens, clipped to [0, 1] (shared), only for a useful non-empty memory;
- r4_t: share of chunk t's calls whose write a judge deems valid (failed calls are invalid writes).
An explicit nothing-to-store on a chunk known to hold no evidence is a correct action (r2 = r4 = 1); on
a chunk with evidence it earns nothing (coverage 0 gates everything). Elsewhere a chunk with no calls
gets r2 = r4 = 0, or r2 = cfg.nothing_to_store_r2 for an explicit skip in a useful, non-empty memory.
With coverage_weight = 0 and content_gate off this is the paper's reward.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from memalpha.config import RewardConfig, RunConfig
from memalpha.data.schema import Question
from memalpha.env.episode import Episode
from memalpha.env.tools import ToolResult
from memalpha.memory import MemoryStore, reader_view, view_ids, whole_view
from memalpha.models.readers import ReaderItem
from memalpha.rewards.coverage import (
    ChunkCoverage,
    answer_support,
    attribution_credit,
    chunk_coverage,
)
from memalpha.rewards.judge import WriteJudge, llm_verdicts, rule_judge, rule_verdicts
from memalpha.rewards.qa import score_answer

REWARD_COMPONENTS = ("r1", "r2", "r3", "r4", "coverage", "retention")
"""The named components of the rubric, each logged as `rewards/<name>/mean`."""


@dataclass
class RewardBreakdown:
    """Reward of one (rollout, chunk) sample, component by component."""

    r1: float
    r2: float
    r3: float
    r4: float
    total: float
    coverage: float = 0.0
    """Content credit of the chunk (1 for a chunk that holds no evidence), times its retention."""
    holds_evidence: bool | None = None
    calls: int = 0
    executed: int = 0
    valid: int = 0
    nothing_to_store: bool = False
    retention: float = 1.0
    """Share of the answer support the memory had before the chunk that survived it (`retention`)."""
    gate: float = 1.0
    """g_t, the factor r2 and r4 enter the total with (the content gate; 1 when `reward.content_gate` is off)."""

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


def compression(memory_tokens: int, input_tokens: int) -> float:
    """1 - memory tokens / input tokens, clipped to [0, 1] (0 when there was no input)."""
    if input_tokens <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - memory_tokens / input_tokens))


def chunk_rewards(
    qa_score: float,
    chunk_results: Sequence[Sequence[ToolResult]],
    nothing_flags: Sequence[bool],
    memory_tokens: int,
    input_tokens: int,
    cfg: RewardConfig,
    judge: WriteJudge = rule_judge,
    memory: MemoryStore | None = None,
    verdicts: Sequence[Sequence[bool]] | None = None,
    coverage: Sequence[ChunkCoverage] | None = None,
) -> list[RewardBreakdown]:
    """Rewards of every chunk of one rollout (docs/REWARDS.md).

    qa_score: r1, the mean QA score on the final memory. chunk_results[t]: the results of chunk t's
    calls (from `execute_text`, so parse errors are failed results). nothing_flags[t]: the output was an
    explicit NOTHING_TO_STORE. memory: the final memory, for the judge's duplicate and delete checks.
    verdicts: precomputed per-call validity (e.g. `llm_verdicts`); otherwise `judge` decides.
    coverage: `chunk_coverage` of the rollout; without it the content term is 0 and nothing is gated
    (the paper's reward).
    """
    if len(nothing_flags) != len(chunk_results):
        raise ValueError(f"nothing_flags has {len(nothing_flags)} items for {len(chunk_results)} chunks")
    if coverage is not None and len(coverage) != len(chunk_results):
        raise ValueError(f"coverage has {len(coverage)} items for {len(chunk_results)} chunks")
    if not 0.0 <= qa_score <= 1.0:
        raise ValueError(f"qa_score must be in [0, 1], got {qa_score}")
    if verdicts is None:
        verdicts = rule_verdicts(chunk_results, memory, judge)
    elif [len(v) for v in verdicts] != [len(r) for r in chunk_results]:
        raise ValueError("verdicts must hold one verdict per call of every chunk")
    useful = qa_score > 0 and memory_tokens > 0
    r3 = compression(memory_tokens, input_tokens) if useful else 0.0
    out = []
    for t, (results, nothing, valid) in enumerate(zip(chunk_results, nothing_flags, verdicts)):
        calls = len(results)
        executed = sum(1 for r in results if r.ok)
        n_valid = sum(1 for v in valid if v is True)
        credit = coverage[t] if coverage is not None else ChunkCoverage(0.0, None)
        evidence = credit.holds_evidence
        skip = bool(nothing) and not calls
        if calls:
            r2, r4 = executed / calls, n_valid / calls
        elif skip and cfg.content_gate and evidence is False:
            r2 = r4 = 1.0  # nothing here will be asked about: skipping is the correct action
        else:
            r2 = cfg.nothing_to_store_r2 if skip and useful else 0.0
            r4 = 0.0
        kept = credit.retention if cfg.retention else 1.0
        # a chunk without evidence has nothing to miss, but can still overwrite what earlier chunks stored
        content = (1.0 if evidence is False else credit.value) * kept
        gate = (content if evidence else kept) if cfg.content_gate else 1.0
        total = qa_score + cfg.coverage_weight * content + gate * (r2 + cfg.gamma * r4) + cfg.beta * r3
        out.append(RewardBreakdown(qa_score, r2, r3, r4, total, content, evidence, calls, executed, n_valid, skip,
                                   retention=credit.retention, gate=gate))
    return out


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
                                  [step.retention for step in episode.steps])
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
                                [step.retention])
    # input tokens 0: r3 needs a useful final memory, so it is 0 here whatever the input (no tokenising)
    rewards = chunk_rewards(0.0, results, [False] * t + [step.parse.nothing_to_store], episode.store.token_count(),
                            0, config.reward, memory=episode.store, verdicts=verdicts, coverage=[coverage] * (t + 1))
    return rewards[-1]


def _writing_chunks(store: MemoryStore, context: str, question: Question) -> list[int]:
    """The chunk that created or last updated each entry the reader was shown for `question`; only the
    entries that bear on its answer count when some do (a whole-memory view shows every entry)."""
    shown = [e for entry_id in sorted(view_ids(context))
             if (section := store.section_of(entry_id)) and (e := store.get(section, entry_id)) is not None]
    bearing = [e for e in shown if answer_support(question, e.content, e.content, lambda: "") > 0]
    return [e.updated_chunk for e in bearing or shown]
