"""Rollout benchmark with the default policy (SmolLM2-135M-Instruct + LoRA, default dtype).

1. Generation throughput of `memalpha.generation.generate` on real writer prompts (synthetic
   accurate-retrieval chunks, empty memory): one batched call for B*G = 1, 8, 32 rollouts against the
   same prompts one at a time, with the LoRA deltas merged as rollouts run them, and B*G = 8 once more
   with the unmerged adapter. Every completion runs to `NEW_TOKENS` (no early stop), so all
   measurements generate the same number of tokens.
2. Seconds per GRPO step of configs/default.yaml (without the warm start), split into generate,
   reward and update. The untrained policy never writes a valid call, so its rewards tie and the
   trainer would skip the update; the update is therefore timed on the step's real samples with
   random advantages (what a step with non-tied rewards costs).

    python -m bench.run_all rollout      # writes bench/results/rollout.json and rollout.md
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BATCHES = (1, 8, 32)
NEW_TOKENS = 48
SEQUENTIAL_PROMPTS = 4
"""One-at-a-time throughput is measured on this many prompts (its rate does not depend on the count)."""
STEPS = 2
ROOT = Path(__file__).resolve().parents[1]


def _prompts(policy, config, n: int) -> list[list[int]]:
    from memalpha.data.synth import SynthConfig, generate as synth
    from memalpha.episode import Episode
    from memalpha.memory.schema import get_schema

    cfg = SynthConfig(instances=n, chunks_per_instance=(2,), chunk_tokens=512, competencies=("accurate_retrieval",))
    schema = get_schema(config.memory.schema_name, config.memory.core_max_tokens)
    tok = policy.tokenizer
    texts = [Episode(inst, schema, config.memory, config.retrieval, policy.count_tokens, tok).prompt()
             for inst in synth(cfg, tok)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _generate(policy, prompts, seed=0, merged=True) -> tuple[int, float, float, float]:
    from contextlib import nullcontext

    from memalpha.generation import generate

    start = time.perf_counter()
    with policy.merged_adapter() if merged else nullcontext():
        out = generate(policy.model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=[], temperature=1.0,
                       pad_token_id=policy.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed))
    return out.num_tokens, time.perf_counter() - start, out.prefill_s, out.decode_s


def _batched_row(policy, prompts, merged=True) -> dict[str, Any]:
    tokens, seconds, prefill, decode = _generate(policy, prompts, merged=merged)
    return {"rollouts": len(prompts), "tokens": tokens, "seconds": round(seconds, 2), "prefill_s": round(prefill, 2),
            "decode_s": round(decode, 2), "tokens_per_s": round(tokens / seconds, 2)}


def throughput(policy, config) -> dict[str, Any]:
    prompts = _prompts(policy, config, max(BATCHES))
    _generate(policy, prompts[:2])  # warm-up
    rows = {f"batched_{n}": _batched_row(policy, prompts[:n]) for n in BATCHES}
    rows["unmerged_8"] = _batched_row(policy, prompts[:8], merged=False)
    tokens = seconds = 0.0
    for prompt in prompts[:SEQUENTIAL_PROMPTS]:
        t, s, _, _ = _generate(policy, [prompt])
        tokens, seconds = tokens + t, seconds + s
    rows["one_at_a_time"] = {"rollouts": SEQUENTIAL_PROMPTS, "tokens": int(tokens), "seconds": round(seconds, 2),
                             "tokens_per_s": round(tokens / seconds, 2)}
    for row in [rows[f"batched_{n}"] for n in BATCHES] + [rows["unmerged_8"]]:
        row["speedup_vs_one_at_a_time"] = round(row["tokens_per_s"] / rows["one_at_a_time"]["tokens_per_s"], 2)
    rows["mean_prompt_tokens"] = round(sum(len(p) for p in prompts) / len(prompts), 1)
    return rows


def step_split() -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.rollout import collect_rollouts
    from memalpha.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(ROOT / "configs" / "default.yaml", ["sft.enabled=false", f"output_dir={tmp}"])
        trainer = Trainer(config, tmp)
        steps = []
        for _ in range(STEPS):
            batch = collect_rollouts(trainer.policy, trainer._next_instances(), config,
                                     num_generations=config.rollout.num_generations, generator=trainer.generator,
                                     reader=trainer.reader)
            advantages = torch.randn(len(batch.samples), generator=torch.Generator().manual_seed(len(steps)))
            start = time.perf_counter()
            trainer._update(batch.samples, advantages)
            update_s = time.perf_counter() - start
            steps.append({"generate_s": batch.generate_s, "reward_s": batch.reward_s, "update_s": update_s,
                          "samples": len(batch.samples), "generated_tokens": batch.generated_tokens,
                          "generate_calls": batch.generate_calls,
                          "mean_prompt_tokens": sum(len(s.prompt_ids) for s in batch.samples) / len(batch.samples)})
    mean = {k: round(sum(s[k] for s in steps) / len(steps), 2) for k in steps[0]}
    mean["step_s"] = round(mean["generate_s"] + mean["reward_s"] + mean["update_s"], 2)
    mean["generate_tokens_per_s"] = round(mean["generated_tokens"] / mean["generate_s"], 2)
    return {"config": "configs/default.yaml (sft off)", "B": config.rollout.instances_per_step,
            "G": config.rollout.num_generations, "chunks_per_instance": config.data.max_chunks_per_instance,
            "max_completion_length": config.rollout.max_completion_length, "steps_measured": STEPS,
            "mean": mean, "per_step": steps}


def run() -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.models.policy import load_policy

    config = load_config(ROOT / "configs" / "default.yaml")
    policy = load_policy(config.model)
    results = {"dtype": str(policy.dtype), "threads": torch.get_num_threads(), "new_tokens": NEW_TOKENS,
               "load_average_1m_at_start": round(os.getloadavg()[0], 2), "generation": throughput(policy, config)}
    del policy
    results["grpo_step"] = step_split()
    return results


def to_markdown(results: dict[str, Any]) -> str:
    gen = results["generation"]
    lines = [
        "# Benchmark: rollout", "",
        f"Default policy, {results['dtype']}, {results['threads']} threads, {results['new_tokens']} new tokens per "
        f"rollout, writer prompts of {gen['mean_prompt_tokens']} tokens on average; load average at start "
        f"{results['load_average_1m_at_start']} (shared CPU: higher load, lower numbers).", "",
        "| rollouts | mode | tokens/s | seconds | prefill s | decode s | speed-up |", "|---|---|---|---|---|---|---|",
    ]
    one = gen["one_at_a_time"]
    lines.append(f"| {one['rollouts']} | one at a time | {one['tokens_per_s']} | {one['seconds']} | | | 1.0 |")
    for n in BATCHES:
        row = gen[f"batched_{n}"]
        lines.append(f"| {n} | one batched call | {row['tokens_per_s']} | {row['seconds']} | {row['prefill_s']} | "
                     f"{row['decode_s']} | {row['speedup_vs_one_at_a_time']} |")
    row = gen["unmerged_8"]
    lines.append(f"| 8 | one batched call, unmerged LoRA | {row['tokens_per_s']} | {row['seconds']} | {row['prefill_s']} | "
                 f"{row['decode_s']} | {row['speedup_vs_one_at_a_time']} |")
    step = results["grpo_step"]
    m = step["mean"]
    lines += [
        "", f"## GRPO step ({step['config']}: B={step['B']}, G={step['G']}, {step['chunks_per_instance']} chunks, "
        f"max {step['max_completion_length']} new tokens; mean of {step['steps_measured']} steps)", "",
        "| generate s | reward s | update s | step s | generated tokens | generate tokens/s |", "|---|---|---|---|---|---|",
        f"| {m['generate_s']} | {m['reward_s']} | {m['update_s']} | {m['step_s']} | {m['generated_tokens']} | "
        f"{m['generate_tokens_per_s']} |",
    ]
    return "\n".join(lines) + "\n"
