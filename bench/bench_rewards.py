"""Reward benchmark: does the reward rank writers by what they remember?

On `INSTANCES` training instances of configs/default.yaml (loaded and truncated as training loads them),
scores five writers with the training reward (memalpha.env.episode.score_episodes, evidence reader):
- `rule_writer`: the rule-based writer (the SFT teacher);
- `small_talk`: one well-formed small-talk entry per chunk, built from the chunk's opening line;
- `skip_all`: NOTHING_TO_STORE on every chunk;
- `verbatim`: every line of the chunk inserted as it is;
- `warm_start`: the SFT warm start of the default config, G rollouts per instance sampled at temperature 1.

Per writer and component: the mean over all (rollout, chunk) samples and the mean within-group std
(a group: every sample of one instance, the paper's GRPO group). Targets: the rule writer ranks first
on the total, and its coverage exceeds the small-talk writer's by more than the group std.

    python -m bench.run_all rewards
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
INSTANCES = 32
GENERATIONS = 4
SAMPLING_BATCH = 4
RUN_DIR = ROOT / "runs" / "bench-rewards"
COMPONENTS = ("total", "coverage", "r1", "r2", "r3", "r4")
_SPEAKER_LINE = re.compile(r"^(?P<speaker>[A-Z][\w.'-]*): (?P<text>.+)$")


def _insert(content: str) -> str:
    return json.dumps({"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": content}})


def small_talk(chunk: str) -> str:
    """A clean statement about the chunk's opening line ("Maya and Leo chatted: hi leo how are you")."""
    lines = [m for line in chunk.splitlines() if (m := _SPEAKER_LINE.match(line.strip()))]
    speakers = list(dict.fromkeys(m.group("speaker") for m in lines)) or ["The speakers"]
    opening = " ".join(re.sub(r"[^\w\s]", " ", lines[0].group("text")).lower().split()[:8]) if lines else "the day"
    return _insert(f"{' and '.join(speakers[:2])} chatted: {opening}.")


def verbatim(chunk: str) -> str:
    return "\n".join(_insert(line.strip()) for line in chunk.splitlines() if line.strip())


def summarise(rewards_by_group: list[list[Any]]) -> dict[str, Any]:
    """Component means over all samples and mean within-group std."""
    samples = [r for group in rewards_by_group for r in group]
    out: dict[str, Any] = {c: statistics.mean(getattr(r, c) for r in samples) for c in COMPONENTS}
    out["group_std"] = {
        c: statistics.mean(statistics.pstdev([getattr(r, c) for r in group]) for group in rewards_by_group if group)
        for c in COMPONENTS
    }
    out["samples"] = len(samples)
    return out


def scripted(instances, config, counter, writer: Callable[[Any], str]) -> list[list[Any]]:
    from memalpha.env.episode import Episode
    from memalpha.models.readers import EvidenceReader
    from memalpha.rewards.rubric import score_episodes

    schema = config.memory.schema()
    episodes = []
    for instance in instances:
        episode = Episode(instance, schema, config.memory, config.retrieval, counter)
        while not episode.done:
            episode.step(writer(episode))
        episodes.append(episode)
    return [score.rewards for score in score_episodes(episodes, config, EvidenceReader())]


def run() -> dict[str, Any]:
    import torch

    from memalpha.config import load_config
    from memalpha.models.policy import load_policy
    from memalpha.models.readers import EvidenceReader
    from memalpha.teacher.rule_writer import rule_writer_for
    from memalpha.teacher.warm_start import prepare_warm_start
    from memalpha.training.data import load_training_data
    from memalpha.training.rollout import collect_rollouts

    started = time.perf_counter()
    config = load_config(ROOT / "configs" / "default.yaml", [f"output_dir={RUN_DIR}"])
    policy = load_policy(config.model, seed=config.grpo.seed)
    data = load_training_data(config, policy.tokenizer)
    instances = data.splits["train"][:INSTANCES]
    counter = policy.count_tokens
    rule = rule_writer_for(config, counter)
    writers: dict[str, Callable[[Any], str]] = {
        "rule_writer": lambda ep: rule.write(ep.chunk_text, ep.store, ep.visible_ids()),
        "small_talk": lambda ep: small_talk(ep.chunk_text),
        "skip_all": lambda ep: "NOTHING_TO_STORE",
        "verbatim": lambda ep: verbatim(ep.chunk_text),
    }
    results: dict[str, Any] = {name: summarise(scripted(instances, config, counter, w)) for name, w in writers.items()}
    print(f"scripted writers scored in {time.perf_counter() - started:.0f} s; warm start next", flush=True)

    warm_started = time.perf_counter()
    adapter = prepare_warm_start(config, RUN_DIR) or RUN_DIR / "sft"
    policy.load_adapter(adapter)
    warm_s = time.perf_counter() - warm_started
    sample_started = time.perf_counter()
    generator = torch.Generator().manual_seed(1234)
    groups = []
    for start in range(0, len(instances), SAMPLING_BATCH):  # B*G = 16 sequences a call: larger batches gain nothing here
        part = instances[start:start + SAMPLING_BATCH]
        batch = collect_rollouts(policy, part, config, num_generations=GENERATIONS, generator=generator,
                                 reader=EvidenceReader())
        groups += [[s.reward for s in batch.samples if s.instance_index == b] for b in range(len(part))]
        print(f"warm start sampled on {start + len(part)}/{len(instances)} instances "
              f"({time.perf_counter() - sample_started:.0f} s)", flush=True)
    results["warm_start"] = summarise(groups)
    rule, talk = results["rule_writer"], results["small_talk"]
    ranking = sorted((n for n in results), key=lambda n: -results[n]["total"])
    gap = rule["coverage"] - talk["coverage"]
    std = max(rule["group_std"]["coverage"], talk["group_std"]["coverage"])
    results["checks"] = {
        "ranking_by_total": ranking,
        "rule_writer_first": ranking[0] == "rule_writer",
        "coverage_gap_rule_vs_small_talk": gap,
        "coverage_group_std_max": std,
        "coverage_separates": gap > std,
    }
    results["settings"] = {
        "config": "configs/default.yaml", "instances": len(instances), "chunks": sum(len(i.chunks) for i in instances),
        "questions": sum(len(i.questions) for i in instances), "warm_start_rollouts_per_instance": GENERATIONS,
        "temperature": config.rollout.temperature, "reader": "evidence", "reader_view": config.reward.reader_view,
        "coverage_weight": config.reward.coverage_weight, "content_gate": config.reward.content_gate,
        "dropped_instances": data.dropped["train"], "warm_start_s": round(warm_s, 1),
        "warm_start_sampling_s": round(time.perf_counter() - sample_started, 1),
        "seconds": round(time.perf_counter() - started, 1),
    }
    return results


def to_markdown(results: dict[str, Any]) -> str:
    writers = [n for n in results if n not in ("checks", "settings")]
    s, c = results["settings"], results["checks"]
    lines = [
        "# Reward benchmark: the training reward on scripted writers and the warm start",
        "",
        f"{s['instances']} training instances of {s['config']} ({s['chunks']} chunks, {s['questions']} questions; "
        f"{s['dropped_instances']} training instances dropped by truncation), evidence reader (an upper bound: it "
        "answers whenever a gold answer occurs in the context), "
        f"reader view `{s['reader_view']}`, coverage weight {s['coverage_weight']}, content gate {s['content_gate']}. "
        f"Warm start: {s['warm_start_rollouts_per_instance']} rollouts per instance at temperature {s['temperature']}. "
        "Each cell: mean over all (rollout, chunk) samples, then the mean within-group std (group: all samples of one "
        "instance).",
        "",
        "| writer | " + " | ".join(COMPONENTS) + " |",
        "|---|" + "---|" * len(COMPONENTS),
    ]
    for name in writers:
        r = results[name]
        lines.append(f"| {name} | " + " | ".join(f"{r[k]:.3f} ± {r['group_std'][k]:.3f}" for k in COMPONENTS) + " |")
    lines += [
        "",
        f"- Ranking by total: {', '.join(c['ranking_by_total'])} (rule writer first: {c['rule_writer_first']}).",
        f"- Coverage, rule writer minus small talk: {c['coverage_gap_rule_vs_small_talk']:.3f}; largest group std of "
        f"the two: {c['coverage_group_std_max']:.3f}; separates: {c['coverage_separates']}.",
        f"- Warm start trained in {s['warm_start_s']} s (0 when its adapter already existed), sampled in "
        f"{s['warm_start_sampling_s']} s; {s['seconds']} s in all.",
        "",
    ]
    return "\n".join(lines)
