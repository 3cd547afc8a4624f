"""Batched rollouts: B instances x G episodes (memalpha.env.episode), one generate call per chunk position.

For chunk t, every episode still reading (episodes stop at their instance's last chunk) gives its writer
prompt, all of them are sampled in one batched call, and each output is stepped into its episode. Every
(rollout, chunk) pair becomes a `Sample`. After the last chunk the reader answers each instance's
questions from each rollout's memory (one batched call), r1 is the mean QA score, the per-chunk coverage
comes from the episodes' steps (and, for questions without evidence indices, from which chunk wrote the
entries the reader was shown), and `chunk_rewards` gives every sample its reward breakdown.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.env.episode import Episode, Step
from memalpha.env.parsing import ParseResult
from memalpha.env.tools import ToolResult
from memalpha.memory import MemoryStore
from memalpha.rewards.rubric import RewardBreakdown, score_episodes, score_step
from memalpha.training import engines
from memalpha.training.generation import Generation


@dataclass
class Sample:
    """One (rollout, chunk) pair: the episode step, the tokens behind it, its reward and advantage."""

    instance_index: int
    """Position of the instance in the batch."""
    instance_id: str
    rollout: int
    """0..G-1 within the instance."""
    step: Step
    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logps: list[float]
    """Per-token log-probs under the policy that sampled the completion."""
    truncated: bool
    """The completion hit max_completion_length without an end-of-turn token."""
    prompt_truncated: bool
    memory_json: str
    """The memory after this chunk's calls."""
    reward: RewardBreakdown | None = None
    advantage: float = 0.0

    @property
    def chunk(self) -> int:
        return self.step.chunk

    @property
    def prompt(self) -> str:
        return self.step.prompt

    @property
    def completion(self) -> str:
        return self.step.completion

    @property
    def parse(self) -> ParseResult:
        return self.step.parse

    @property
    def results(self) -> list[ToolResult]:
        return self.step.results

    @property
    def memory_tokens(self) -> int:
        return self.step.memory_tokens

    @property
    def memory_entries(self) -> int:
        return self.step.memory_entries


@dataclass
class RolloutBatch:
    """All samples of one batch of rollouts, their final memories and the reader's answers."""

    instances: list[Instance]
    num_generations: int
    samples: list[Sample] = field(default_factory=list)
    memories: list[MemoryStore] = field(default_factory=list)
    """Final memory of rollout r = instance_index * G + g."""
    answers: list[list[dict]] = field(default_factory=list)
    """Per rollout: one {question, prediction, answers, score} per question."""
    qa_scores: list[float] = field(default_factory=list)
    generate_s: float = 0.0
    reward_s: float = 0.0
    generate_calls: int = 0
    generated_tokens: int = 0
    trace: dict = field(default_factory=dict)


def _new_episodes(policy, instances: list[Instance], config: RunConfig, copies: int) -> list[Episode]:
    """`copies` fresh episodes of each instance, rendered with the policy's chat template."""
    schema = config.memory.schema()
    return [Episode(inst, schema, config.memory, config.retrieval, policy.count_tokens, policy.tokenizer,
                    shadowed_conflict_credit=config.reward.shadowed_conflict_credit)
            for inst in instances for _ in range(copies)]


def _sample(policy, prompts: list[str], config: RunConfig, batch: RolloutBatch, *, generator: torch.Generator | None,
            greedy: bool = False, copies: int = 1) -> tuple[list[list[int]], list[bool], Generation]:
    """Tokenise the prompts (keeping their last rollout.max_prompt_tokens: the chunk and the assistant turn
    opening), sample each `copies` times in one batched call (copies of a prompt are adjacent) and count
    the call on `batch`. Returns the prompt ids, which prompts were cut, and the generation."""
    rcfg = config.rollout
    ids = policy.tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
    cut = [len(x) > rcfg.max_prompt_tokens for x in ids]
    ids = [x[-rcfg.max_prompt_tokens:] for x in ids]
    start = time.perf_counter()
    out = engines.sample(policy, ids, rcfg, copies=copies, greedy=greedy, generator=generator)
    batch.generate_s += time.perf_counter() - start
    batch.generate_calls += 1
    batch.generated_tokens += out.num_tokens
    return ids, cut, out


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
    reader_view_mode: str | None = None,
    on_chunks: Callable[[int], None] | None = None,
) -> RolloutBatch:
    """Run G rollouts of each instance, chunk position by chunk position, and score every sample.

    `reader` answers questions (memalpha.models.readers); `judge` is an LLM judge for r4 (None: the
    rule judge). Greedy decoding (evaluation) ignores the generator. `reader_view_mode` overrides
    `reward.reader_view` (held-out evaluation reads through retrieval, as the paper does). `on_chunks`
    gets the number of chunks written after each batched call (progress).
    Instances are used as given: truncation for training happens when the data is loaded.
    """
    G = num_generations
    episodes = _new_episodes(policy, instances, config, G)
    per_rollout: list[list[Sample]] = [[] for _ in episodes]
    batch = RolloutBatch(list(instances), G, memories=[ep.store for ep in episodes])
    with engines.sampling(policy, config.rollout):
        while active := [r for r, ep in enumerate(episodes) if not ep.done]:
            prompts = [episodes[r].prompt() for r in active]
            ids, cut, out = _sample(policy, prompts, config, batch, generator=generator, greedy=greedy)
            for i, r in enumerate(active):
                episode = episodes[r]
                text = policy.tokenizer.decode(out.completion_ids[i], skip_special_tokens=True)
                step = episode.step(text, prompts[i])
                per_rollout[r].append(Sample(
                    instance_index=r // G, instance_id=episode.instance.instance_id, rollout=r % G, step=step,
                    prompt_ids=ids[i], completion_ids=out.completion_ids[i], sampling_logps=out.logps[i],
                    truncated=out.truncated[i], prompt_truncated=cut[i], memory_json=episode.store.to_json(),
                ))
            if on_chunks is not None:
                on_chunks(len(active))
    start = time.perf_counter()
    scores = score_episodes(episodes, config, reader, judge, reader_view_mode)
    batch.answers = [score.answers for score in scores]
    batch.qa_scores = [score.qa_score for score in scores]
    for samples, score in zip(per_rollout, scores):
        for sample, reward in zip(samples, score.rewards):
            sample.reward = reward
    batch.reward_s = time.perf_counter() - start
    batch.samples = [s for samples in per_rollout for s in samples]
    batch.trace = rollout_trace(batch, per_rollout[0], 0) if per_rollout else {}
    return batch


@dataclass
class Written:
    """One instance as a policy wrote it with its questions withheld: the final memory and its chunk steps."""

    instance: Instance
    """As given, questions included, for whoever scores the memory afterwards."""
    memory: MemoryStore
    samples: list[Sample]
    """In chunk order."""


def write_unasked(policy, instances: list[Instance], config: RunConfig, *, batch_size: int,
                  generator: torch.Generator | None = None, greedy: bool = True,
                  on_chunks: Callable[[int], None] | None = None,
                  ) -> Iterator[tuple[list[Written], RolloutBatch]]:
    """The policy writes `instances` (G=1, no reader) `batch_size` at a time, as evaluation and DAgger
    labelling do; yields each batch as written, with its RolloutBatch for the counters. `on_chunks`: see
    `collect_rollouts`."""
    for start in range(0, len(instances), batch_size):
        batch = instances[start:start + batch_size]
        rollouts = collect_rollouts(policy, [replace(i, questions=[]) for i in batch], config, num_generations=1,
                                    generator=generator, reader=None, greedy=greedy, on_chunks=on_chunks)
        yield [
            Written(instance, memory, [s for s in rollouts.samples if s.instance_index == b])
            for b, (instance, memory) in enumerate(zip(batch, rollouts.memories))
        ], rollouts


def collect_step_rollouts(
    policy,
    instances: list[Instance],
    config: RunConfig,
    *,
    num_generations: int,
    generator: torch.Generator | None,
    reader,
    judge=None,
    on_chunks: Callable[[int], None] | None = None,
) -> RolloutBatch:
    """Step-level sampling from a shared memory state (`grpo.sampling=step`).

    Each instance is walked along one memory state. At chunk t its one prompt is sampled G times (the G
    identical prompts sit next to each other in the batch), each candidate is stepped on a copy of the
    state and scored with the per-chunk reward (`episode.score_step`), so the G candidates of a group
    differ only in their action. The state then advances to a uniformly drawn candidate, which keeps the
    states on-policy. After the
    last chunk the reader answers from the advanced memory: `qa_scores` report the trajectory's QA; they
    are shared by every candidate of a group, so they would cancel in its advantage and are left out of it.
    `on_chunks`: see `collect_rollouts`.
    """
    G = num_generations
    states = _new_episodes(policy, instances, config, 1)
    chosen: list[list[Sample]] = [[] for _ in instances]
    batch = RolloutBatch(list(instances), 1)
    with engines.sampling(policy, config.rollout):
        while active := [b for b, state in enumerate(states) if not state.done]:
            prompts = [states[b].prompt() for b in active]
            ids, cut, out = _sample(policy, prompts, config, batch, generator=generator, copies=G)
            for i, b in enumerate(active):
                drafts = [(policy.tokenizer.decode(out.completion_ids[k], skip_special_tokens=True), out.completion_ids[k],
                           out.logps[k], out.truncated[k]) for k in range(i * G, (i + 1) * G)]
                candidates, group = [], []
                for g, (text, completion_ids, logps, truncated) in enumerate(drafts):
                    branch = states[b].copy()
                    step = branch.step(text, prompts[i])
                    group.append(Sample(
                        instance_index=b, instance_id=branch.instance.instance_id, rollout=g, step=step,
                        prompt_ids=ids[i], completion_ids=completion_ids, sampling_logps=logps, truncated=truncated,
                        prompt_truncated=cut[i], memory_json=branch.store.to_json(),
                        reward=score_step(branch, config, judge),
                    ))
                    candidates.append(branch)
                batch.samples.extend(group)
                pick = _advance(group, generator)
                states[b] = candidates[pick]
                chosen[b].append(group[pick])
            if on_chunks is not None:
                on_chunks(len(active))
    start = time.perf_counter()
    scores = score_episodes(states, config, reader, judge)
    batch.memories = [state.store for state in states]
    batch.answers = [score.answers for score in scores]
    batch.qa_scores = [score.qa_score for score in scores]
    batch.reward_s = time.perf_counter() - start
    batch.trace = rollout_trace(batch, chosen[0], 0) if chosen else {}
    return batch


def _advance(group: list[Sample], generator: torch.Generator | None) -> int:
    """Which candidate the shared state moves to: a uniform draw (the first without a generator)."""
    if generator is None:
        return 0
    return int(torch.randint(len(group), (1,), generator=generator, device=generator.device))


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
