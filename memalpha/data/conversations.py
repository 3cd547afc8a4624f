"""Real conversations for training: fixed splits by conversation, and training windows.

A conversation is never divided between splits, so a test conversation is one the writer never read.
LoCoMo's split is fixed by sample id (in the spirit of Memory-R1's 1:1:8: two short conversations to
train on, one to validate, the seven others to test); PerLTQA's is the usual hash of the instance id (one
character, one instance). A training conversation is cut into **windows**: consecutive sessions (turns
that share a date) of at most `window_tokens` tokens, one starting at each session, each with the
questions whose evidence turns all lie inside it, so a training instance is a few chunks long like the
synthetic ones and fits a CPU step. Validation conversations are windowed the same way (validation during
GRPO then costs what a training step does); test conversations stay whole.
"""

from __future__ import annotations

from dataclasses import replace

from memalpha.data.chunking import TokenCounts, Turn
from memalpha.data.splits import split_of

LOCOMO_SPLITS = {"locomo-conv-26": "train", "locomo-conv-30": "train", "locomo-conv-41": "validation"}
"""The LoCoMo split of record by instance id; every other conversation (conv-42 to conv-50) is test."""
WINDOW_SOURCES = ("locomo", "perltqa")


def conversation_split(instance_id: str, data_source: str, ratios, seed: int) -> str:
    """The split of a whole conversation."""
    if data_source == "locomo":
        return LOCOMO_SPLITS.get(instance_id, "test")
    return split_of(instance_id, ratios, seed)


def sessions(turns: list[Turn]) -> list[list[Turn]]:
    """Runs of consecutive turns that share a date (a LoCoMo session, a PerLTQA dialogue)."""
    out: list[list[Turn]] = []
    for turn in turns:
        if out and turn.date == out[-1][-1].date:
            out[-1].append(turn)
        else:
            out.append([turn])
    return out


def training_windows(raw, counter: TokenCounts, window_tokens: int) -> list:
    """The windows of one raw conversation (`loaders.RawInstance`): from each session on, the following
    sessions while they fit `window_tokens` (a longer session is a window of its own), with the questions
    whose evidence lies inside. Windows without such a question are left out."""
    groups = sessions(raw.turns)
    sizes = [sum(counter.counts([f"{t.speaker}: {t.text}" for t in g])) for g in groups]
    windows = []
    for start in range(len(groups)):
        end, used = start + 1, sizes[start]
        while end < len(groups) and used + sizes[end] <= window_tokens:
            used += sizes[end]
            end += 1
        turns = [t for g in groups[start:end] for t in g]
        ids = {t.turn_id for t in turns}
        questions = [q for q in raw.questions
                     if raw.evidence_turns.get(q.question_id) and set(raw.evidence_turns[q.question_id]) <= ids]
        if not questions:
            continue
        evidence = {q.question_id: raw.evidence_turns[q.question_id] for q in questions}
        metadata = {**raw.metadata, "window": {"conversation": raw.instance_id, "first_session": start,
                                               "sessions": end - start}}
        windows.append(replace(raw, instance_id=f"{raw.instance_id}-w{start:02d}", turns=turns,
                               questions=questions, evidence_turns=evidence, metadata=metadata))
    return windows


def split_conversations(items: list, counter: TokenCounts, ratios, seed: int, window_tokens: int) -> list:
    """Raw conversations of a real source with their split set; training and validation ones cut into
    windows (`window_tokens` 0: kept whole), so validation during GRPO costs what a training instance
    does; test conversations stay whole. Other items pass through."""
    out = []
    for item in items:
        if getattr(item, "data_source", None) not in WINDOW_SOURCES or not hasattr(item, "turns"):
            out.append(item)
            continue
        item = replace(item, split=conversation_split(item.instance_id, item.data_source, ratios, seed))
        windowed = item.split in ("train", "validation") and window_tokens
        out.extend(training_windows(item, counter, window_tokens) if windowed else [item])
    return out
