"""Rollout benchmark with the default policy (SmolLM2-135M-Instruct + LoRA, default dtype).

1. Generation throughput of `memalpha.training.generation.generate` on the default config's writer prompts
   (synthetic accurate-retrieval chunks, empty memory), counted as generated tokens per second of the
   whole call, prefill included. B*G = 8 and 32 rows arrive as B distinct prompts each repeated G times
   (a step-level group; a trajectory's first chunk), once with the shared prefill (each distinct prompt
   prefilled once) and once prefilling every row, plus 32 distinct prompts (trajectory chunks after the
   first, nothing to share). Every completion runs to `NEW_TOKENS` (no early stop), so all rows generate
   the same number of tokens.
2. Seconds per GRPO step of configs/default.yaml (without the warm start), split into generate, reward
   and update, in trajectory and step sampling, with the shared update, with the shared update that
   leaves out the once-per-update system prefix (each group runs its whole prompt), and with the plain one.
   The untrained policy never writes a valid call, so its rewards tie and the trainer would skip the
   update; the update is therefore timed on the step's real samples with random advantages.
3. The compute floor of each step: FLOPs of its linear layers (2 x parameters per token, the LM head only
   where logits are taken; the update's backward counted as 2x its forward) at this machine's measured
   bf16 matmul rate. Attention and elementwise work are left out, so the floor is optimistic.

The policy runs on the CPU, whatever else the machine has; bench_rollout_gpu runs the same measurements
on a CUDA GPU.

    python -m bench.run_all rollout      # writes bench/results/rollout.json and rollout.md
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BEFORE = Path(__file__).resolve().parent / "results" / "rollout_before.json"
"""The same measurements taken with the code before prefix sharing (see its `code` field)."""
BATCHES = (8, 32)
NEW_TOKENS = 48
STEPS = 2
ROOT = Path(__file__).resolve().parents[1]


def _prompts(policy, config, n: int) -> list[list[int]]:
    from memalpha.data.synth import SynthConfig
    from memalpha.data.synth import generate as synth
    from memalpha.env.episode import Episode

    cfg = SynthConfig(instances=n, chunks_per_instance=(2,), chunk_tokens=512, competencies=("accurate_retrieval",))
    schema = config.memory.schema()
    tok = policy.tokenizer
    texts = [Episode(inst, schema, config.memory, config.retrieval, policy.count_tokens, tok).prompt()
             for inst in synth(cfg, tok)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _generate(policy, prompts, share: bool, seed: int = 0) -> dict[str, Any]:
    from memalpha.training.generation import generate, synchronize

    start = time.perf_counter()
    with policy.merged_adapter():
        out = generate(policy.model, prompts, max_new_tokens=NEW_TOKENS, eos_token_ids=[], temperature=1.0,
                       pad_token_id=policy.tokenizer.pad_token_id,
                       generator=torch.Generator(device=policy.device).manual_seed(seed), share_prefill=share)
        synchronize(policy.device)
    seconds = time.perf_counter() - start
    return {"rows": len(prompts), "prefilled_prompts": out.prefilled_prompts, "tokens": out.num_tokens,
            "seconds": round(seconds, 2), "prefill_s": round(out.prefill_s, 2), "decode_s": round(out.decode_s, 2),
            "tokens_per_s": round(out.num_tokens / seconds, 2)}


def throughput(policy, config) -> dict[str, Any]:
    G = config.rollout.num_generations
    prompts = _prompts(policy, config, max(BATCHES))
    _generate(policy, prompts[:2], share=True)  # warm-up
    rows: dict[str, Any] = {}
    for n in BATCHES:
        grouped = [p for p in prompts[: n // G] for _ in range(G)]
        rows[f"groups_{n}_shared"] = _generate(policy, grouped, share=True)
        rows[f"groups_{n}_unshared"] = _generate(policy, grouped, share=False)
    rows[f"distinct_{max(BATCHES)}"] = _generate(policy, prompts, share=True)
    rows["G"] = G
    rows["mean_prompt_tokens"] = round(sum(len(p) for p in prompts) / len(prompts), 1)
    return rows


def matmul_gflops(device: str = "cpu") -> float:
    """bf16 matmul rate on `device` (2048x2048 on the CPU, the issue's reference for the floor; 8192x8192 on
    a GPU, where a 2048 product is too small to fill it)."""
    from memalpha.training.generation import synchronize

    n, repeats = (2048, 5) if device == "cpu" else (8192, 20)
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    a @ b
    synchronize(a.device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(a.device)
    return repeats * 2 * n**3 / (time.perf_counter() - start) / 1e9


def _linear_params(model) -> tuple[int, int]:
    """(parameters of the transformer body's linear layers, of the LM head)."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lora_" not in name and not name.endswith("lm_head"))
    return body, head


def floor_flops(samples, body: int, head: int, shared: bool) -> float:
    """Linear-layer FLOPs of one step: the prefill (distinct prompts when shared), decoding, and the
    update's forward and backward (3x forward; when shared, the prompt once per group and the prefix
    common to all groups once)."""
    from memalpha.training.generation import shareable_prefix_length

    prompts = list({tuple(s.prompt_ids): None for s in samples}) if shared else [tuple(s.prompt_ids) for s in samples]
    # shared: the prefix of all distinct prompts (the system prompt) runs once in the prefill and the update
    prefix = shareable_prefix_length([list(p) for p in prompts]) if shared else 0
    prompt_tokens = sum(len(p) for p in prompts) - prefix * (len(prompts) - 1)
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    rollout = 2 * body * (prompt_tokens + completion_tokens) + 2 * head * (len(prompts) + completion_tokens)
    update = 3 * (2 * body * (prompt_tokens + completion_tokens) + 2 * head * completion_tokens)
    return rollout + update


def _timed_update(trainer, samples, advantages) -> float:
    from memalpha.training.generation import synchronize

    start = time.perf_counter()
    trainer._update(samples, advantages)
    synchronize(trainer.policy.device)
    return time.perf_counter() - start


def step_split(sampling: str, gflops: float, device: str = "cpu") -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.training.rollout import collect_rollouts, collect_step_rollouts
    from memalpha.training.trainer import Trainer

    collect = collect_step_rollouts if sampling == "step" else collect_rollouts
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(ROOT / "configs" / "default.yaml",
                             ["sft.enabled=false", f"output_dir={tmp}", f"grpo.sampling={sampling}", f"model.device={device}"])
        trainer = Trainer(config, tmp)
        body, head = _linear_params(trainer.policy.model)
        steps = []
        for index in range(STEPS):
            batch = collect(trainer.policy, trainer._next_instances(), config,
                            num_generations=config.rollout.num_generations, generator=trainer.generator,
                            reader=trainer.reader)
            advantages = torch.randn(len(batch.samples), generator=torch.Generator().manual_seed(index))
            row = {"generate_s": batch.generate_s, "reward_s": batch.reward_s, "samples": len(batch.samples),
                   "generated_tokens": batch.generated_tokens, "generate_calls": batch.generate_calls,
                   "mean_prompt_tokens": sum(len(s.prompt_ids) for s in batch.samples) / len(batch.samples)}
            for shared in (False, True):
                trainer.config = config.model_copy(update={"grpo": config.grpo.model_copy(update={"shared_prompt_update": shared})})
                row["update_shared_s" if shared else "update_plain_s"] = _timed_update(trainer, batch.samples, advantages)
                row["floor_shared_s" if shared else "floor_plain_s"] = floor_flops(batch.samples, body, head, shared) / gflops / 1e9
            # the shared update without its once-per-update system prefix: each group runs its whole prompt
            with_prefix = trainer._shared_prefix
            trainer._shared_prefix = lambda samples, micro: None
            row["update_group_only_s"] = _timed_update(trainer, batch.samples, advantages)
            trainer._shared_prefix = with_prefix
            steps.append(row)
    mean = {k: round(sum(s[k] for s in steps) / len(steps), 2) for k in steps[0]}
    mean["step_s"] = round(mean["generate_s"] + mean["reward_s"] + mean["update_shared_s"], 2)
    mean["step_plain_update_s"] = round(mean["generate_s"] + mean["reward_s"] + mean["update_plain_s"], 2)
    mean["floor_fraction"] = round(mean["floor_shared_s"] / mean["step_s"], 3)
    mean["generate_tokens_per_s"] = round(mean["generated_tokens"] / mean["generate_s"], 2)
    return {"sampling": sampling, "B": config.rollout.instances_per_step, "G": config.rollout.num_generations,
            "chunks_per_instance": config.data.max_chunks_per_instance,
            "max_completion_length": config.rollout.max_completion_length, "steps_measured": STEPS,
            "mean": mean, "per_step": steps}


def run(device: str = "cpu") -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.models.policy import load_policy

    config = load_config(ROOT / "configs" / "default.yaml", [f"model.device={device}"])
    policy = load_policy(config.model)
    gflops = matmul_gflops(device)
    results = {"device": _device_name(device), "dtype": str(policy.dtype), "threads": torch.get_num_threads(),
               "new_tokens": NEW_TOKENS, "load_average_1m_at_start": round(os.getloadavg()[0], 2),
               "matmul_bf16_gflops": round(gflops, 1), "generation": throughput(policy, config)}
    del policy
    results["grpo_step"] = {s: step_split(s, gflops, device) for s in ("trajectory", "step")}
    default = results["grpo_step"][config.grpo.sampling]["mean"]
    results["step_seconds"] = default["step_s"]
    results["floor_seconds"] = default["floor_shared_s"]
    results["generate_tokens_per_s"] = {str(n): results["generation"][f"groups_{n}_shared"]["tokens_per_s"]
                                        for n in BATCHES}
    if BEFORE.is_file() and device == "cpu":
        results["before"] = json.loads(BEFORE.read_text())
    return results


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"


def to_markdown(results: dict[str, Any]) -> str:
    gen = results["generation"]
    lines = [
        "# Benchmark: rollout", "",
        f"Default policy on {results.get('device', 'the CPU')}, {results['dtype']}, {results['threads']} CPU threads, "
        f"{results['new_tokens']} new tokens per "
        f"row, writer prompts of {gen['mean_prompt_tokens']} tokens on average, bf16 matmul "
        f"{results['matmul_bf16_gflops']} GFLOP/s; load average at start {results['load_average_1m_at_start']} "
        "(shared CPU: higher load, lower numbers).", "",
        f"## Generation (tokens per second of the whole call, prefill included; groups of G = {gen['G']})", "",
        "| rows | prompts | prefilled | tokens/s | seconds | prefill s | decode s |", "|---|---|---|---|---|---|---|",
    ]
    labels = {f"groups_{n}_{k}": f"{n // gen['G']} x {gen['G']} copies, {k}" for n in BATCHES for k in ("shared", "unshared")}
    labels[f"distinct_{max(BATCHES)}"] = f"{max(BATCHES)} distinct"
    for key, label in labels.items():
        row = gen[key]
        lines.append(f"| {row['rows']} | {label} | {row['prefilled_prompts']} | {row['tokens_per_s']} | {row['seconds']} | "
                     f"{row['prefill_s']} | {row['decode_s']} |")
    lines += ["", "## GRPO step of configs/default.yaml (sft off), mean of the measured steps", "",
              "| sampling | generate s | reward s | update s (shared / group prompts only / plain) | step s | floor s | "
              "floor / step | generated tokens | generate tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for sampling, step in results["grpo_step"].items():
        m = step["mean"]
        lines.append(f"| {sampling} | {m['generate_s']} | {m['reward_s']} | {m['update_shared_s']} / "
                     f"{m['update_group_only_s']} / {m['update_plain_s']} | "
                     f"{m['step_s']} | {m['floor_shared_s']} | {m['floor_fraction']} | {m['generated_tokens']} | "
                     f"{m['generate_tokens_per_s']} |")
    lines += ["", f"B={step['B']}, G={step['G']}, {step['chunks_per_instance']} chunks, at most "
              f"{step['max_completion_length']} new tokens. Step = generate + reward + shared update (each group's prompt "
              "once, and the system prompt all groups share once per update); \"group prompts only\" runs each group's "
              "whole prompt, \"plain\" every [prompt | completion] row. The floor counts linear-layer FLOPs only (prefill "
              "of distinct prompts with their common prefix once, decoding, update forward + 2x backward) at the "
              "measured matmul rate."]
    if "before" in results:
        b = results["before"]
        lines += ["", "## Before and after (default config, trajectory sampling; generation at B*G rows)", "",
                  "| | step s | generate s | update s | tokens/s at B*G = 8 | tokens/s at B*G = 32 |", "|---|---|---|---|---|---|",
                  f"| before | {b['step_seconds']} | {b['generate_s']} | {b['update_s']} | {b['generate_tokens_per_s']['8']} | "
                  f"{b['generate_tokens_per_s']['32']} |",
                  f"| after | {results['step_seconds']} | {results['grpo_step']['trajectory']['mean']['generate_s']} | "
                  f"{results['grpo_step']['trajectory']['mean']['update_shared_s']} | {results['generate_tokens_per_s']['8']} | "
                  f"{results['generate_tokens_per_s']['32']} |",
                  "", f"Before: {b['code']}; {b['generation_note']}."]
    return "\n".join(lines) + "\n"
