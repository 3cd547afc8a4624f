"""Rollout engines side by side: memalpha's transformers loop (`hf`) and a vLLM server (`vllm`), in one run.

1. `generate_tokens_per_s` {engine: {B*G: tokens/s}}: the default writer prompts (synthetic 512-token
   chunks, empty memory, ~770 tokens), B*G = 8 and 32 rows as B distinct prompts sampled G times, 48 new
   tokens a row (no early stop), the whole call timed, prefill included; the policy's LoRA is loaded in
   the server beforehand (as in training, where it is swapped once a step).
2. `step_seconds` {engine: seconds}: a GRPO step of configs/default.yaml from the shipped warm start
   (step-level sampling, B=1, G=8), the mean of steps 2 and 3 (step 1 includes the first adapter load).

3. `rollouts_32` {policy: {engine: tokens/s}}: B*G = 32 rows as in 1, for the 135M writer (its warm start)
   and the untrained Qwen2.5-Coder 0.5B, on `hf`, `vllm` and `llamacpp` (a llama-server with 4 slots serving
   the GGUF: the 135M's packaged Q4_1 base with the warm start exported as a GGUF LoRA, the 0.5B's Q5_0 file;
   hf and vLLM run the dequantised weights of the same files). Same prompts on every engine of a policy.
4. `grpo_step_seconds` {policy: {engine: seconds, ...}}: a GRPO step of configs/default.yaml, the mean of steps 2
   and 3, on `hf` and on `llamacpp` (rollouts on the rollout server, restarted on each step's LoRA after its
   conversion to GGUF: memalpha.training.engines.LlamaRolloutServer), for the 135M writer from its warm start
   and the untrained Qwen2.5-Coder 0.5B (a fresh LoRA); with the seconds of the last restart (save, convert,
   stop, start), the number of starts over the 3 steps (a step whose update was skipped keeps its LoRA) and each
   llama.cpp step's mean |llama.cpp - trainer| log-prob a sampled token (`sampling/logp_abs_diff`).

The vLLM server runs the policy's dtype (bf16 on a CPU with native bf16, fp32 otherwise) from `.venv-vllm`,
started by `infra/servers.sh start-vllm`. On a GPU machine (`make gpu-check`) both engines run on CUDA.

    python -m bench.run_all engines      # writes bench/results/engines.json and engines.md
    MEMALPHA_BENCH_ENGINES_PART=rollouts_32 python -m bench.run_all engines   # part 3 alone, the rest kept
    MEMALPHA_BENCH_ENGINES_PART=grpo_steps python -m bench.run_all engines    # part 4 alone, the rest kept
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.bench_rollout import BATCHES, NEW_TOKENS, _prompts
from bench.llama_server import installed as llama_installed
from bench.llama_server import local_llama_server
from bench.vllm_server import installed, local_vllm_server

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("hf", "vllm")
STEPS = 3


def _throughput(policy, config, prompts: list[list[int]], engine: str, batches=BATCHES) -> dict[str, float]:
    from memalpha.training import engines

    G = config.rollout.num_generations
    rcfg = config.rollout.model_copy(update={"engine": engine, "max_completion_length": NEW_TOKENS})
    generator = torch.Generator(device=policy.device).manual_seed(0)
    out: dict[str, float] = {}
    with engines.sampling(policy, rcfg):
        engines.sample(policy, prompts[:1], rcfg, copies=2, greedy=False, generator=generator, eos_token_ids=[])  # warm-up
        for n in batches:
            start = time.perf_counter()
            gen = engines.sample(policy, prompts[: n // G], rcfg, copies=G, greedy=False, generator=generator,
                                 eos_token_ids=[])
            seconds = time.perf_counter() - start
            assert gen.num_tokens == n * NEW_TOKENS, (engine, n, gen.num_tokens)
            out[str(n)] = round(gen.num_tokens / seconds, 2)
    return out


def _step_seconds(config, adapter: Path | None, gaps: list[float | None] | None = None) -> float:
    """Mean seconds of GRPO steps 2 and 3 of `config` from `adapter` (None: a fresh LoRA); each step's mean
    |sampler - trainer| log-prob a token appended to `gaps` when given."""
    from memalpha.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(config.model_copy(update={"output_dir": tmp}), tmp)
        if adapter is not None:
            trainer.policy.load_adapter(adapter)
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            metrics = trainer.train_step().metrics
            times.append(time.perf_counter() - start)
            if gaps is not None:  # None: every group's rewards were equal, no update, nothing compared
                gaps.append(None if metrics["frac_reward_zero_std"] == 1.0 else metrics["sampling/logp_abs_diff"])
    return round(sum(times[1:]) / (len(times) - 1), 1)


def _rows_32(policy, config, prompts: list[list[int]], engine: str) -> float:
    """tokens/s of B*G = 32 rows of 48 new tokens on `engine` (after a warm-up call)."""
    return _throughput(policy, config, prompts, engine, batches=(32,))["32"]


def _rollouts_32(config, warm_start: Path, dtype: str) -> dict[str, dict[str, float]]:
    """{policy: {engine: tokens/s}} at B*G = 32 for the 135M writer and the untrained 0.5B."""
    from memalpha.commands.export import export
    from memalpha.models.llamacpp import served_policy
    from memalpha.models.loading import resolve_model_path
    from memalpha.models.policy import load_policy

    out: dict[str, dict[str, float]] = {}
    for name, adapter in (("smollm2-135m-instruct", warm_start), ("qwen2.5-coder-0.5b", None)):
        model_cfg = config.model.model_copy(update={"policy": name})
        policy_config = config.model_copy(update={"model": model_cfg})
        policy = load_policy(model_cfg, adapter=adapter, trainable=False)
        prompts = _prompts(policy, policy_config, max(BATCHES) // config.rollout.num_generations)
        rates = {"hf": _rows_32(policy, policy_config, prompts, "hf")}
        with tempfile.TemporaryDirectory() as state:
            with local_vllm_server(Path(state) / "vllm", model=resolve_model_path(name), dtype=dtype) as server:
                vllm_config = policy_config.model_copy(update={"rollout": policy_config.rollout.model_copy(update={"vllm_url": server["url"]})})
                rates["vllm"] = _rows_32(policy, vllm_config, prompts, "vllm")
            del policy
            if llama_installed():
                server_name = "writer" if adapter else name
                if adapter:
                    export(adapter, Path(state) / "export", name)
                    os.environ["MEMALPHA_LLAMA_WRITER"] = str(Path(state) / "export")
                try:
                    with local_llama_server(Path(state) / "llama", server_name):
                        served = served_policy(model_cfg, config.memory.schema(), adapter)
                        rates["llamacpp"] = _rows_32(served, policy_config, prompts, "llamacpp")
                finally:
                    os.environ.pop("MEMALPHA_LLAMA_WRITER", None)
        out[name] = rates
        print(f"rollouts at B*G=32, {name}: {rates}", flush=True)
    return out


def _grpo_steps(config, warm_start: Path) -> dict[str, dict[str, float]]:
    """{policy: {"hf": s, "llamacpp": s, "llamacpp_restart_s": s, "llamacpp_starts": n}}: part 4."""
    from memalpha.training import engines

    if not llama_installed():
        raise RuntimeError("no llama-server: run `make llm` first")
    out: dict[str, dict[str, float]] = {}
    # the rollout server's PID file and log in a folder of its own, its port off the ones users' servers take
    with tempfile.TemporaryDirectory() as state, \
            mock.patch.dict(os.environ, {"MEMALPHA_STATE": state, "MEMALPHA_LLAMA_PORT_OFFSET": "100"}):
        for name, adapter in (("smollm2-135m-instruct", warm_start), ("qwen2.5-coder-0.5b", None)):
            policy_config = config.model_copy(update={"model": config.model.model_copy(update={"policy": name})})
            row: dict[str, float] = {}
            gaps: list[float | None] = []
            for engine in ("hf", "llamacpp"):
                row[engine] = _step_seconds(policy_config.model_copy(update={
                    "rollout": policy_config.rollout.model_copy(update={"engine": engine})}), adapter,
                    gaps if engine == "llamacpp" else None)
            row["llamacpp_logp_abs_diff"] = [None if g is None else round(g, 4) for g in gaps]
            server = engines.llama_rollout_server()
            row["llamacpp_restart_s"], row["llamacpp_starts"] = round(server.sync_s, 1), server.starts
            server.close()
            out[name] = row
            print(f"GRPO step seconds, {name}: {row}", flush=True)
    return out


def run() -> dict[str, Any]:
    import json

    from memalpha.config import load_config
    from memalpha.models.loading import resolve_model_path
    from memalpha.models.policy import load_policy

    part = os.environ.get("MEMALPHA_BENCH_ENGINES_PART")
    if part != "grpo_steps" and not installed():  # the GRPO-step part compares hf and llama.cpp only
        raise RuntimeError("no .venv-vllm: run `make vllm` first")
    warm_start = ROOT / "adapters" / "warm-start"
    config = load_config(ROOT / "configs" / "default.yaml", ["sft.enabled=false", "grpo.eval_every=100"])
    if part:  # one part; the others kept from the last run
        kept = json.loads((ROOT / "bench" / "results" / "engines.json").read_text())["results"]
        load = round(os.getloadavg()[0], 2)
        if part == "rollouts_32":
            return {**kept, "rollouts_32": _rollouts_32(config, warm_start, kept.get("dtype", "bfloat16")),
                    "rollouts_32_load_average_1m_at_start": load}
        if part == "grpo_steps":
            return {**kept, "grpo_step_seconds": _grpo_steps(config, warm_start),
                    "grpo_step_seconds_load_average_1m_at_start": load}
        raise RuntimeError(f"MEMALPHA_BENCH_ENGINES_PART={part!r}: choose rollouts_32 or grpo_steps")
    policy = load_policy(config.model, adapter=warm_start, trainable=False)
    dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[policy.dtype]
    prompts = _prompts(policy, config, max(BATCHES) // config.rollout.num_generations)
    results: dict[str, Any] = {"dtype": dtype, "new_tokens": NEW_TOKENS, "G": config.rollout.num_generations,
                               "mean_prompt_tokens": round(sum(map(len, prompts)) / len(prompts), 1),
                               "load_average_1m_at_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory() as state, \
            local_vllm_server(Path(state), model=resolve_model_path(config.model.policy), dtype=dtype) as server:
        config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"vllm_url": server["url"]})})
        results["generate_tokens_per_s"] = {engine: _throughput(policy, config, prompts, engine) for engine in ENGINES}
        del policy
        results["step_seconds"] = {}
        for engine in ENGINES:
            engine_config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"engine": engine})})
            results["step_seconds"][engine] = _step_seconds(engine_config, warm_start)
    results["rollouts_32"] = _rollouts_32(config, warm_start, dtype)
    return results


def to_markdown(results: dict[str, Any]) -> str:
    tps, steps = results["generate_tokens_per_s"], results["step_seconds"]
    lines = ["# Benchmark: engines", "",
             f"Rollout engines on this machine, measured in the same run: memalpha's transformers loop (`hf`) and a "
             f"vLLM server (`vllm`, from `.venv-vllm`), both in {results['dtype']}. Generation: the default writer "
             f"prompts ({results['mean_prompt_tokens']} tokens on average), B*G rows as B prompts sampled "
             f"G={results['G']} times, {results['new_tokens']} new tokens a row, the whole call timed. GRPO step: "
             "configs/default.yaml from the shipped warm start, the mean of steps 2 and 3.", "",
             "| engine | " + " | ".join(f"tokens/s at B*G={n}" for n in tps["hf"]) + " | GRPO step seconds |",
             "|---|" + "---|" * (len(tps["hf"]) + 1)]
    for engine in tps:
        lines.append(f"| {engine} | " + " | ".join(str(v) for v in tps[engine].values()) + f" | {steps[engine]} |")
    if "rollouts_32" in results:
        rows = results["rollouts_32"]
        engines = list(next(iter(rows.values())))
        lines += ["", "## B*G = 32 rollouts per policy and engine (tokens/s, same prompts per policy; load average "
                  f"{results.get('rollouts_32_load_average_1m_at_start', results['load_average_1m_at_start'])} at its start)", "",
                  "| policy | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
        lines += [f"| {name} | " + " | ".join(str(r.get(e, "-")) for e in engines) + " |" for name, r in rows.items()]
    if "grpo_step_seconds" in results:
        lines += ["", "## GRPO step seconds, hf and llama.cpp rollouts (configs/default.yaml, mean of steps 2 and 3; load "
                  f"average {results['grpo_step_seconds_load_average_1m_at_start']} at its start)", "",
                  "On llama.cpp a step includes the restart of its rollout server on the step's LoRA (saved, converted "
                  "to GGUF, server stopped and started): its last restart's seconds and the starts over the 3 steps. "
                  "Log-prob gap: each step's mean |llama.cpp - trainer| log-prob a sampled token (the trainer's first "
                  "forward pass against the log-probs llama.cpp sampled with; - where every group's rewards were equal, "
                  "so no update was computed).", "",
                  "| policy | hf | llamacpp | llama.cpp restart seconds | llama.cpp starts | log-prob gap by step |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {name} | {r['hf']} | {r['llamacpp']} | {r['llamacpp_restart_s']} | {r['llamacpp_starts']} | "
                  + (", ".join("-" if g is None else f"{g:.3f}" for g in r["llamacpp_logp_abs_diff"])
                     if r.get("llamacpp_logp_abs_diff") else "-")
                  + " |" for name, r in results["grpo_step_seconds"].items()]
    return "\n".join(lines) + "\n"
