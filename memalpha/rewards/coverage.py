"""The per-chunk content credit: how far what a chunk wrote makes the questions it holds evidence for
answerable (`answer_support`), how much of the memory's earlier support it kept (`retention`), and
Fine-Mem's attribution for questions without evidence indices (`attribution_credit`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from memalpha.config import SHADOWED_CONFLICT_CREDIT
from memalpha.data.schema import Question
from memalpha.rewards.qa import normalize_answer, score_answer

_ANSWER_STOPWORDS = frozenset("a an the of to in on at for and or is are was were be by with from as it its".split())


def _answer_words(text: str) -> set[str]:
    return {w for w in normalize_answer(text).split() if w not in _ANSWER_STOPWORDS}


def mentions(text: str, answer: str) -> bool:
    """`answer` occurs in `text`, normalised, on word boundaries (the convention of memalpha.rewards.qa)."""
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalize_answer(text)} "


def coverage_chunks(question: Question, chunks: Sequence[str]) -> list[int] | None:
    """The chunks that can make `question` answerable: its evidence chunks that state a current answer
    (a keyword, for summaries), or all its evidence chunks when none does (a worked-out answer).
    None for a question without evidence indices (its credit is attributed, see `attribution_credit`).
    Stating a superseded value does not count: storing it cannot answer the question."""
    if question.evidence_chunks is None:
        return None
    evidence = [c for c in question.evidence_chunks if 0 <= c < len(chunks)]
    stating = [c for c in evidence if any(mentions(chunks[c], a) for a in question.answers)]
    return stating or evidence


def answer_support(question: Question, written: str, chunk_text: str, memory_text: Callable[[], str],
                   shadowed_credit: float = SHADOWED_CONFLICT_CREDIT) -> float:
    """How far `written` (what one step wrote, as it reads after the step) supports the answer, in [0, 1].

    - summary keywords: the share of the keywords the chunk states that the writes kept;
    - classification: 1 when the evidence reader finds the right label among the written examples;
    - conflict: 1 when the writes state the current value and not a superseded one, times
      `shadowed_credit` while the whole memory (`memory_text()`, with what misaimed updates overwrote:
      `overwritten_unrelated`) still asserts a superseded value;
    - otherwise: 1 when a gold answer occurs in the writes, else the best share of a gold answer's
      words they hold (partial credit for lists and multi-word answers).
    """
    from memalpha.models.readers import (  # memalpha.models loads torch on import
        EvidenceReader,
        competency_of,
    )

    competency = competency_of(question)
    if competency == "long_range_understanding":
        offered = [k for k in question.answers if mentions(chunk_text, k)] or question.answers
        return sum(mentions(written, k) for k in offered) / len(offered) if offered else 0.0
    if competency == "test_time_learning" or (competency == "conflict_resolution" and question.superseded_answers):
        reader = EvidenceReader()
        score = score_answer(reader.answer_one(written, question), question.answers, question.question_type,
                             question.superseded_answers)
        if score and competency == "conflict_resolution":
            whole = reader.answer_one(memory_text(), question)
            score *= 1.0 if score_answer(whole, question.answers, question.question_type, question.superseded_answers) else shadowed_credit
        return score
    best = 0.0
    words = _answer_words(written)
    for gold in question.answers:
        if mentions(written, gold):
            return 1.0
        wanted = _answer_words(gold)
        if wanted:
            best = max(best, len(wanted & words) / len(wanted))
    return best


def attribution_credit(scores: Sequence[float], retrieved: Sequence[Sequence[int]], num_chunks: int) -> list[float]:
    """Fine-Mem's evidence-anchored attribution for questions without evidence indices: question j's
    final score s_j is shared equally by the entries M_j the reader was shown for it, and each entry's
    share goes to the chunk that created or last updated it: N_t = sum_j sum_{m in M_j, step(m)=t}
    s_j / (|M_j| n). `retrieved[j]` lists the writing chunk of each entry in M_j."""
    credit = [0.0] * num_chunks
    n = len(scores)
    for score, chunks in zip(scores, retrieved):
        for t in chunks:
            if 0 <= t < num_chunks:
                credit[t] += score / (len(chunks) * n)
    return credit


def memory_support(questions: Sequence[Question], memory_text: str) -> dict[int, float]:
    """Question index -> `answer_support` of the whole memory, for the questions it supports at all."""
    support = {}
    for j, question in enumerate(questions):
        value = answer_support(question, memory_text, memory_text, lambda: memory_text)
        if value > 0:
            support[j] = value
    return support


def retention(before: dict[int, float], after: dict[int, float]) -> float:
    """Share of the memory's answer support before a step that the step left (`memory_support` before and
    after it): 1 when nothing was supported or nothing was lost. A write that overwrites a stored answer
    with small talk lowers it; supporting more answers than before cannot make up for one lost."""
    total = sum(before.values())
    if total <= 0:
        return 1.0
    return sum(min(after.get(j, 0.0), value) for j, value in before.items()) / total


@dataclass(frozen=True)
class ChunkCoverage:
    """The content credit of one chunk (see `chunk_coverage`)."""

    value: float
    holds_evidence: bool | None
    """True: some question's coverage chunks include it; False: all questions have evidence indices and
    none points here; None: unknown (questions without evidence indices; `value` is attributed credit)."""
    retention: float = 1.0
    """`retention` of the step: the content credit and the gate are scaled by it."""


def chunk_coverage(
    supports: Sequence[dict[int, float]],
    relevant: Sequence[Sequence[int]],
    attributed: Sequence[float] | None = None,
    retained: Sequence[float] | None = None,
) -> list[ChunkCoverage]:
    """Coverage of every chunk of one rollout.

    supports[t]: question index -> `answer_support` of what chunk t wrote, for the questions in
    relevant[t] (those whose `coverage_chunks` include t). attributed: `attribution_credit` for the
    instance's questions without evidence indices, or None when every question has them. retained[t]:
    the `retention` of step t (None: every step kept everything).
    """
    out = []
    for t, questions in enumerate(relevant):
        kept = 1.0 if retained is None else retained[t]
        if questions:
            value, evidence = sum(supports[t].get(j, 0.0) for j in questions) / len(questions), True
        elif attributed is not None:
            value, evidence = attributed[t], None
        else:
            value, evidence = 0.0, False
        out.append(ChunkCoverage(value, evidence, kept))
    return out
