"""Batched rollouts: B instances x G memories, one generate call per chunk position.

For chunk t, the writer prompt of every rollout still reading (rollouts stop at their instance's last
chunk) is rendered from its own memory, all of them are sampled in one batched call, and each output is
parsed and executed on its memory. Every (rollout, chunk) pair becomes a `Sample`. After the last chunk
the reader answers each instance's questions from each rollout's memory (one batched call), r1 is the
mean QA score, and `chunk_rewards` gives every sample its reward breakdown.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

import torch

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.generation import generate
from memalpha.memory.schema import get_schema
from memalpha.memory.store import MemoryStore
from memalpha.memory.views import reader_view
from memalpha.metrics import score_answer
from memalpha.models.readers import ReaderItem
from memalpha.parsing import ParseResult
from memalpha.prompts import render_writer_prompt
from memalpha.retrieval import MemoryIndex
from memalpha.rewards import RewardBreakdown, chunk_rewards, llm_verdicts
from memalpha.tools import ToolResult, execute_text


@dataclass
class Sample:
    """One (rollout, chunk) pair: what the policy saw and wrote, what it did to the memory, its reward."""

    instance_index: int
    """Position of the instance in the batch."""
    instance_id: str
    rollout: int
    """0..G-1 within the instance."""
    chunk: int
    prompt: str
    prompt_ids: list[int]
    completion: str
    completion_ids: list[int]
    sampling_logps: list[float]
    """Per-token log-probs under the policy that sampled the completion."""
    truncated: bool
    """The completion hit max_completion_length without an end-of-turn token."""
    prompt_truncated: bool
    parse: ParseResult
    results: list[ToolResult]
    memory_tokens: int
    """Memory size after this chunk's calls."""
    memory_entries: int
    memory_json: str
    reward: RewardBreakdown | None = None
    advantage: float = 0.0


@dataclass
class RolloutBatch:
    """All samples of one batch of rollouts, their final memories and the reader's answers."""

    instances: list[Instance]
    num_generations: int
    samples: list[Sample]
    memories: list[MemoryStore]
    """Final memory of rollout r = instance_index * G + g."""
    answers: list[list[dict]]
    """Per rollout: one {question, prediction, answers, score} per question."""
    qa_scores: list[float]
    input_tokens: list[int]
    """Tokens of the chunks each instance's rollouts read."""
    generate_s: float = 0.0
    reward_s: float = 0.0
    generate_calls: int = 0
    generated_tokens: int = 0
    trace: dict = field(default_factory=dict)


def truncate_instance(instance: Instance, max_chunks: int) -> Instance:
    """The first `max_chunks` chunks (0: all), keeping only questions answerable from them (questions
    without known evidence are kept)."""
    if not max_chunks or len(instance.chunks) <= max_chunks:
        return instance
    questions = [q for q in instance.questions if q.evidence_chunks is None or any(c < max_chunks for c in q.evidence_chunks)]
    return replace(instance, chunks=instance.chunks[:max_chunks], questions=questions)


def collect_rollouts(
    policy,
    instances: list[Instance],
    config: RunConfig,
    *,
    num_generations: int,
    generator: torch.Generator | None,
    reader,
    judge=None,
    greedy: bool = False,
) -> RolloutBatch:
    """Run G rollouts of each instance, chunk position by chunk position, and score every sample.

    `reader` answers questions (memalpha.models.readers); `judge` is an LLM judge for r4 (None: the
    rule judge). Greedy decoding (evaluation) ignores the generator.
    """
    rcfg = config.rollout
    schema = get_schema(config.memory.schema_name, config.memory.core_max_tokens)
    tokenizer = policy.tokenizer
    eos_ids = [tokenizer.eos_token_id] + ([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])
    instances = [truncate_instance(inst, config.data.max_chunks_per_instance) for inst in instances]
    chunks = [inst.chunks for inst in instances]
    G = num_generations
    owners = [b for b in range(len(instances)) for _ in range(G)]
    stores = [MemoryStore(schema, policy.count_tokens) for _ in owners]
    indexes = [MemoryIndex(store, config.retrieval) for store in stores]
    per_rollout: list[list[Sample]] = [[] for _ in owners]
    batch = RolloutBatch(list(instances), G, [], stores, [], [], [sum(policy.count_tokens(c) for c in cs) for cs in chunks])
    with policy.merged_adapter():  # sampling only (eval mode); the update runs the unmerged adapter
        for t in range(max(len(cs) for cs in chunks)):
            active = [r for r, b in enumerate(owners) if t < len(chunks[b])]
            prompts = [
                render_writer_prompt(tokenizer, stores[r], chunks[owners[r]][t], config.memory, indexes[r].search)
                for r in active
            ]
            ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
            cut = [len(x) > rcfg.max_prompt_tokens for x in ids]
            ids = [x[-rcfg.max_prompt_tokens:] for x in ids]  # keep the chunk and the assistant turn opening
            start = time.perf_counter()
            out = generate(
                policy.model, ids, max_new_tokens=rcfg.max_completion_length, eos_token_ids=eos_ids,
                pad_token_id=tokenizer.pad_token_id, temperature=rcfg.temperature, top_p=rcfg.top_p,
                greedy=greedy, generator=generator,
            )
            batch.generate_s += time.perf_counter() - start
            batch.generate_calls += 1
            batch.generated_tokens += out.num_tokens
            for i, r in enumerate(active):
                text = tokenizer.decode(out.completion_ids[i], skip_special_tokens=True)
                parsed, results = execute_text(stores[r], text, t)
                per_rollout[r].append(Sample(
                    instance_index=owners[r], instance_id=instances[owners[r]].instance_id, rollout=r % G, chunk=t,
                    prompt=prompts[i], prompt_ids=ids[i], completion=text, completion_ids=out.completion_ids[i],
                    sampling_logps=out.logps[i], truncated=out.truncated[i], prompt_truncated=cut[i],
                    parse=parsed, results=results, memory_tokens=stores[r].token_count(),
                    memory_entries=stores[r].entry_count(), memory_json=stores[r].to_json(),
                ))
    start = time.perf_counter()
    _score(batch, per_rollout, owners, indexes, chunks, config, reader, judge)
    batch.reward_s = time.perf_counter() - start
    batch.samples = [s for samples in per_rollout for s in samples]
    batch.trace = rollout_trace(batch, per_rollout[0], 0) if per_rollout else {}
    return batch


def _score(batch, per_rollout, owners, indexes, chunks, config: RunConfig, reader, judge) -> None:
    """Reader answers (one batched call for all rollouts), r1 per rollout, then per-chunk rewards."""
    items, where = [], []
    for r, b in enumerate(owners):
        for question in batch.instances[b].questions:
            context = reader_view(batch.memories[r], question.question, indexes[r].search,
                                  config.memory.reader_view_tokens, config.retrieval.top_k)
            items.append(ReaderItem(context, question))
            where.append(r)
    predictions = reader.answer(items) if items else []
    batch.answers = [[] for _ in owners]
    for item, prediction, r in zip(items, predictions, where):
        q = item.question
        score = score_answer(prediction, q.answers, q.question_type, q.superseded_answers,
                             metric=config.reward.qa_metric, question=q.question)
        batch.answers[r].append({"question": q.question, "prediction": prediction, "answers": q.answers, "score": score})
    batch.qa_scores = [sum(a["score"] for a in answers) / len(answers) if answers else 0.0 for answers in batch.answers]
    descriptions = {s.name: s.description for s in batch.memories[0].schema.sections} if owners else {}
    for r, samples in enumerate(per_rollout):
        results = [s.results for s in samples]
        verdicts = None
        if judge is not None:
            verdicts = llm_verdicts(results, chunks[owners[r]], judge, batch.memories[r], descriptions)
        rewards = chunk_rewards(
            batch.qa_scores[r], results, [s.parse.nothing_to_store for s in samples],
            batch.memories[r].token_count(), batch.input_tokens[owners[r]], config.reward,
            memory=batch.memories[r], verdicts=verdicts,
        )
        for sample, reward in zip(samples, rewards):
            sample.reward = reward


def rollout_trace(batch: RolloutBatch, samples: list[Sample], r: int) -> dict:
    """Span tree of one rollout (chunk -> generation -> tool calls, then the reader's answers) as plain
    dicts: {"name", "span_type", "inputs", "outputs", "attributes", "children"}."""
    chunks = []
    for s in samples:
        tools = [
            {"name": res.name or "unparseable", "span_type": "TOOL", "inputs": res.call.arguments if res.call else {},
             "outputs": {"ok": res.ok, "message": res.message, "entry_id": res.entry_id},
             "attributes": {"reason": str(res.reason) if res.reason else ""}, "children": []}
            for res in s.results
        ]
        generation = {
            "name": "generate", "span_type": "LLM", "inputs": {"prompt": s.prompt}, "outputs": {"completion": s.completion},
            "attributes": {"completion_tokens": len(s.completion_ids), "truncated": s.truncated}, "children": [],
        }
        reward = s.reward.to_dict() if s.reward else {}
        chunks.append({
            "name": f"chunk-{s.chunk}", "span_type": "CHAIN", "inputs": {"chunk": s.chunk},
            "outputs": {"memory_tokens": s.memory_tokens, "memory_entries": s.memory_entries, "reward": reward},
            "attributes": {"format": s.parse.format, "nothing_to_store": s.parse.nothing_to_store},
            "children": [generation, *tools],
        })
    answers = {"name": "answer", "span_type": "RETRIEVER", "inputs": {"questions": len(batch.answers[r])},
               "outputs": {"answers": batch.answers[r], "qa_score": batch.qa_scores[r]}, "attributes": {}, "children": []}
    instance = batch.instances[samples[0].instance_index] if samples else None
    return {
        "name": "rollout", "span_type": "AGENT",
        "inputs": {"instance_id": instance.instance_id if instance else "", "chunks": len(samples)},
        "outputs": {"memory": json.loads(batch.memories[r].to_json()), "qa_score": batch.qa_scores[r]},
        "attributes": {"rollout": r}, "children": [*chunks, answers],
    }
