"""Held-out extraction checks of a warm start: greedy outputs on held-out chunks, each on the memory
the rule writer built before it, scored for valid calls, evidence recall, skipping and update aim."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.env.episode import Episode
from memalpha.rewards.judge import is_entry_update
from memalpha.teacher.rule_writer import rule_writer_for
from memalpha.text import keeps_subject
from memalpha.tokens import tokenizer_counter
from memalpha.training.generation import generate


@dataclass
class Probe:
    """A held-out writer step: the episode just before a chunk, as the rule writer left it."""

    episode: Episode
    holds_evidence: bool


def extraction_probes(instances: list[Instance], config: RunConfig, tokenizer, count: int) -> list[Probe]:
    """Up to `count` held-out chunks (evidence and no-evidence chunks in the data's proportion, spread over
    the instances), each with the memory the rule writer built before it."""
    counter = tokenizer_counter(tokenizer)
    schema = config.memory.schema()
    writer = rule_writer_for(config, counter)
    probes: list[Probe] = []
    for instance in instances:
        episode = Episode(instance, schema, config.memory, config.retrieval, counter, tokenizer)
        while not episode.done:
            probes.append(Probe(episode.copy(), bool(episode.relevant_questions[episode.position])))
            episode.step(writer.write(episode.chunk_text, episode.store, episode.visible_ids()))
    random.Random(0).shuffle(probes)
    return probes[:count]


@dataclass
class ProbeScore:
    """What one greedy output on a held-out chunk did (see `extraction_metrics`)."""

    valid: bool
    skip_correct: bool
    recall: float | None
    """Mean support of the chunk's gold facts; None for a chunk without evidence."""
    updates: int
    aimed: int


def score_probe(probe: Probe, completion: str) -> ProbeScore:
    """Step `completion` on a copy of the probe's memory and score it."""
    step = probe.episode.copy().step(completion)
    skipped = step.parse.nothing_to_store
    list_updates = [r for r in step.results if is_entry_update(r)]
    return ProbeScore(
        valid=not step.parse.errors and (skipped or bool(step.parse.calls)),
        skip_correct=skipped != probe.holds_evidence,
        recall=sum(step.support.values()) / len(step.support) if probe.holds_evidence else None,
        updates=len(list_updates),
        aimed=sum(keeps_subject(r.previous_content or "", r.content or "") for r in list_updates),
    )


def extraction_metrics(policy, probes: list[Probe], max_new_tokens: int) -> dict[str, float]:
    """Greedy outputs on held-out chunks: `valid_calls` (share of outputs that parse whole: calls or an
    explicit skip), `evidence_recall` (mean coverage support of the gold facts of evidence chunks),
    `skip_accuracy` (share of chunks where the writer skipped exactly when the chunk holds no evidence),
    `updates` (list-entry updates a chunk) and `update_aim` (share of them that keep the subject of the entry
    they replace, `text.keeps_subject`; 1 when there were none, as none missed)."""
    tokenizer = policy.tokenizer
    ids = [tokenizer(p.episode.prompt(), add_special_tokens=False)["input_ids"] for p in probes]
    eos = [tokenizer.eos_token_id] + ([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.no_grad():
            out = generate(policy.model, ids, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                           pad_token_id=tokenizer.pad_token_id, greedy=True)
    finally:
        policy.model.train(was_training)
    scores = [score_probe(p, tokenizer.decode(c, skip_special_tokens=True)) for p, c in zip(probes, out.completion_ids)]
    recalls = [s.recall for s in scores if s.recall is not None]
    updates = sum(s.updates for s in scores)
    n = max(len(scores), 1)
    return {"valid_calls": sum(s.valid for s in scores) / n, "evidence_recall": sum(recalls) / max(len(recalls), 1),
            "skip_accuracy": sum(s.skip_correct for s in scores) / n, "updates": updates / n,
            "update_aim": sum(s.aimed for s in scores) / updates if updates else 1.0}
