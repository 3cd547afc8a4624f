"""Teacher demonstrations: prompt/completion pairs built exactly as rollouts see chunks.

A teacher runs over each training instance with an evolving memory; each prompt is the prompt of a
`memalpha.env.episode` over that instance at that chunk, each completion the teacher's calls. Real
conversations that carry their questions' evidence turns are labelled by the evidence writer
(`teacher.evidence_writer`), the synthetic ones by the rule writer; an LLM teacher
(`teacher.llm_teacher`) labels every instance it keeps with its best sampled episode instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.env.episode import Episode
from memalpha.env.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.memory.schema import MemorySchema
from memalpha.teacher.evidence_writer import EvidenceWriter
from memalpha.teacher.rule_writer import rule_writer_for
from memalpha.tokens import TokenCounter, tokenizer_counter

if TYPE_CHECKING:
    from memalpha.teacher.llm_teacher import LLMTeacher

Label = Callable[[Instance, Episode], "str | None"]
"""A teacher's completion for an episode's current chunk; None: nothing to teach there (no demonstration, and
the episode moves on with its memory unchanged)."""


@dataclass
class Demonstration:
    """One prompt/completion pair (prompt: the rendered writer prompt; completion: JSON lines)."""

    prompt: str
    completion: str
    instance_id: str
    chunk_index: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def nothing_to_store(self) -> bool:
        return self.completion.strip() == NOTHING_TO_STORE

    updates_entry: bool = False
    """The completion rewrites a stored list entry (what a conflicting chunk needs)."""


@dataclass
class DemoStats:
    """What build_demonstrations saw and kept, added up over the calls that share it."""

    chunks: int = 0
    kept: int = 0
    nothing_to_store: int = 0
    updates: int = 0
    too_long: int = 0
    unlabelled: int = 0
    """Chunks the teacher gave no label (an LLM teacher's output without an executed call or NOTHING_TO_STORE)."""
    calls_ok: float = 0.0
    """Share of the teacher's calls that executed."""


def demonstration_max_length(config: RunConfig) -> int:
    """`sft.max_length`, else the longest writer step a rollout takes (prompt budget + completion budget)."""
    return config.sft.max_length or config.rollout.max_prompt_tokens + config.rollout.max_completion_length


def build_demonstrations(
    instances: list[Instance],
    config: RunConfig,
    tokenizer,
    *,
    count: int | None = None,
    nothing_share: float | None = None,
    seed: int = 0,
    stats: DemoStats | None = None,
    teacher: LLMTeacher | None = None,
) -> list[Demonstration]:
    """Rule-writer demonstrations (evidence-writer ones for real dialogue; `teacher`'s when given) for the
    chunks of `instances`, as prompt/completion pairs.

    Completions are cut to `rollout.max_completion_length` tokens (what a rollout may generate), pairs
    longer than `demonstration_max_length` are dropped (truncation would cut the completion), and a sample of
    `count` (default `sft.num_demonstrations`) is drawn with `nothing_share` (default
    `sft.nothing_to_store_share`) of NOTHING_TO_STORE chunks
    (when there are enough), so the model learns to skip small talk without learning to skip everything.
    The sample is shuffled; `stats` records what was seen and kept.
    """
    count = config.sft.num_demonstrations if count is None else count
    nothing_share = config.sft.nothing_to_store_share if nothing_share is None else nothing_share
    stats = stats if stats is not None else DemoStats()
    store_demos, skip_demos = _label_states(instances, config, tokenizer, stats, teacher)
    rng = random.Random(seed)
    n_skip = min(len(skip_demos), round(count * nothing_share))
    n_store = min(len(store_demos), count - n_skip)
    n_skip = min(len(skip_demos), count - n_store)  # top up with skips when writes run short
    chosen = rng.sample(store_demos, n_store) + rng.sample(skip_demos, n_skip)
    rng.shuffle(chosen)
    stats.kept += len(chosen)
    stats.nothing_to_store += sum(d.nothing_to_store for d in chosen)
    stats.updates += sum(d.updates_entry for d in chosen)
    return chosen


def build_mixed_demonstrations(groups: list[list[Instance]], weights: list[float], config: RunConfig, tokenizer,
                               *, seed: int = 0, stats: DemoStats | None = None,
                               teacher: LLMTeacher | None = None) -> list[Demonstration]:
    """`sft.num_demonstrations` demonstrations drawn from several datasets, each its weight's share (each
    with `sft.nothing_to_store_share` of skips), shuffled together."""
    total = config.sft.num_demonstrations
    demos: list[Demonstration] = []
    for i, (instances, weight) in enumerate(zip(groups, weights)):
        count = round(total * weight / sum(weights))
        if count and instances:
            demos.extend(build_demonstrations(instances, config, tokenizer, count=count, seed=seed + i, stats=stats,
                                              teacher=teacher))
    random.Random(seed).shuffle(demos)
    return demos


def _updates_entry(completion: str, schema: MemorySchema) -> bool:
    """`completion` calls memory_update on a list section."""
    lists = {spec.name for spec in schema.list_sections}
    return any(call.name == "memory_update" and call.arguments.get("memory_type") in lists
               for call in parse_tool_calls(completion).calls)


def _rule_labels(config: RunConfig, counter: TokenCounter) -> Label:
    """The evidence writer's label for an instance that carries evidence turns, the rule writer's otherwise."""
    writer = rule_writer_for(config, counter)
    dialogue = EvidenceWriter(config.memory.schema(), config.rollout.max_completion_length, counter)

    def label(instance: Instance, episode: Episode) -> str:
        if dialogue.applies(instance):
            return dialogue.write(instance, episode.position, episode.store)
        return writer.write(episode.chunk_text, episode.store, episode.visible_ids())

    return label


def _label_states(instances: list[Instance], config: RunConfig, tokenizer, stats: DemoStats,
                  teacher: LLMTeacher | None = None) -> tuple[list[Demonstration], list[Demonstration]]:
    """Walk each instance's episode, labelling the state before every chunk with the teacher's completion
    (`_rule_labels` without a `teacher` or where it does not teach), and advance by that label. Returns the writes and the skips that fit
    `demonstration_max_length`; `stats` counts chunks, drops and the share of the calls that executed."""
    counter = tokenizer_counter(tokenizer)
    schema = config.memory.schema()
    if teacher is None or not teacher.teaches(instances):
        label_of = _rule_labels(config, counter)
    else:
        instances, label_of = teacher.labels(instances, config, counter)
    max_length = demonstration_max_length(config)
    store_demos: list[Demonstration] = []
    skip_demos: list[Demonstration] = []
    results_ok: list[bool] = []
    for instance in instances:
        episode = Episode(instance, schema, config.memory, config.retrieval, counter, tokenizer)
        while not episode.done:
            prompt = episode.prompt()
            label = label_of(instance, episode)
            stats.chunks += 1
            if label is None:
                stats.unlabelled += 1
                episode.step(NOTHING_TO_STORE, prompt)
                continue
            demo = Demonstration(prompt, label, instance.instance_id, episode.position,
                                 counter(prompt), counter(label) + 1,  # + the end-of-turn token
                                 _updates_entry(label, schema))
            if demo.prompt_tokens + demo.completion_tokens > max_length:
                stats.too_long += 1
            else:
                (skip_demos if demo.nothing_to_store else store_demos).append(demo)
            step = episode.step(label)
            results_ok.extend(r.ok for r in step.results)
    stats.calls_ok = sum(results_ok) / len(results_ok) if results_ok else 0.0
    return store_demos, skip_demos
