"""bench_rollout's measurements on a CUDA GPU: generation throughput at B*G = 8 and 32 and the default
config's GRPO step split into generate / reward / update, with the policy, rollouts, update and reader
on the GPU (bf16). Skipped on a machine without CUDA.

    python -m bench.run_all rollout_gpu  # writes bench/results/rollout_gpu.json and rollout_gpu.md
"""

from __future__ import annotations

from typing import Any

import torch

from bench import BenchmarkSkipped, bench_rollout


def run() -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise BenchmarkSkipped("needs a CUDA GPU")
    return bench_rollout.run(device="cuda")


def to_markdown(results: dict[str, Any]) -> str:
    return bench_rollout.to_markdown(results).replace("# Benchmark: rollout", "# Benchmark: rollout on a GPU", 1)
