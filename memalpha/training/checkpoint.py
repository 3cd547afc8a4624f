"""Training checkpoints: everything needed to continue a run exactly where it stopped.

Layout of `run_dir/checkpoints/step-000010/`:
    adapter/            LoRA weights (safetensors) + adapter config
    optimizer.pt        AdamW state          scheduler.pt   LR schedule state
    rng.pt              python, numpy, torch and the rollout sampler's generator states
    rng-rank-N.pt       the same for rank N > 0 of a data-parallel run (memalpha.training.distributed)
    state.json          step, data position, config training hash, metrics of steps 1..step, processes
A checkpoint is written into a temporary folder and renamed, so a crash never leaves a partial one.

`run_dir/best/` holds the adapter with the best held-out QA seen so far (the warm start included) and
`best.json` (its step and score): model selection on the validation split, for the test set to judge.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SFT_DIR = "sft"
"""The warm-start adapter of a run: run_dir/sft."""
CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
ADAPTER = "adapter"
BEST = "best"
BEST_FILE = "best.json"


@dataclass
class CheckpointState:
    """The JSON part of a checkpoint."""

    step: int
    training_hash: str
    data_position: dict[str, int]
    metrics: list[dict[str, float]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    """The run config (to name the fields that changed when a resume is refused)."""
    processes: int = 1
    """Training processes that wrote it (each has its own sampler state)."""


def step_name(step: int) -> str:
    """`step-000010`: the folder of a checkpoint, and the name of a step's artifacts."""
    return f"step-{step:06d}"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / step_name(step)


def capture_rng(generator: torch.Generator) -> dict[str, Any]:
    """Every random state that influences the next training step."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }


def restore_rng(states: dict[str, Any], generator: torch.Generator) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    generator.set_state(states["generator"])


def save_checkpoint(
    run_dir: Path,
    state: CheckpointState,
    *,
    policy,
    optimizer: torch.optim.Optimizer,
    scheduler,
    generator: torch.Generator,
    other_ranks_rng: list[dict[str, Any]] = (),
) -> Path:
    """Write the checkpoint for `state.step` atomically; returns its folder. `other_ranks_rng`: the
    `capture_rng` states of ranks 1.. of a data-parallel run."""
    final = checkpoint_dir(run_dir, state.step)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    policy.save_adapter(tmp / ADAPTER)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(capture_rng(generator), tmp / "rng.pt")
    for rank, states in enumerate(other_ranks_rng, 1):
        torch.save(states, tmp / f"rng-rank-{rank}.pt")
    (tmp / STATE_FILE).write_text(
        json.dumps(
            {"step": state.step, "training_hash": state.training_hash,
             "data_position": state.data_position, "metrics": state.metrics, "config": state.config,
             "processes": state.processes},
            indent=1,
        )
    )
    if final.exists():  # re-saving the same step (e.g. final save right after a periodic one)
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def save_best(run_dir: Path, policy, step: int, score: float) -> Path:
    """Replace run_dir/best with the policy's adapter and its held-out score; the old one stays whole
    until the new one is complete."""
    return _replace_best(run_dir, policy.save_adapter, step, score)


def adopt_best(run_dir: Path, adapter: Path, step: int, score: float) -> Path:
    """Make an adapter folder trained elsewhere (a shipped writer) run_dir/best, with its held-out score."""
    return _replace_best(run_dir, lambda out: shutil.copytree(adapter, out), step, score)


def _replace_best(run_dir: Path, write_adapter, step: int, score: float) -> Path:
    final = Path(run_dir) / BEST
    tmp = final.with_name(f".tmp-{BEST}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_adapter(tmp / ADAPTER)
    (tmp / BEST_FILE).write_text(json.dumps({"step": step, "score": score}))
    old = final.with_name(f".old-{BEST}-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_best(run_dir: Path) -> dict[str, Any] | None:
    """{"step", "score"} of run_dir/best, or None before any held-out evaluation."""
    path = Path(run_dir) / BEST / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def policy_adapter(checkpoint: Path) -> Path:
    """The adapter folder of a checkpoint."""
    return Path(checkpoint) / ADAPTER


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step under run_dir/checkpoints, if any."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step-*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def read_state(path: Path) -> CheckpointState:
    """The JSON part of the checkpoint at `path`."""
    data = json.loads((Path(path) / STATE_FILE).read_text())
    return CheckpointState(
        step=int(data["step"]), training_hash=data["training_hash"],
        data_position=data["data_position"], metrics=data.get("metrics", []), config=data.get("config"),
        processes=int(data.get("processes", 1)),
    )


def load_checkpoint(
    path: Path, *, policy, optimizer: torch.optim.Optimizer, scheduler, generator: torch.Generator, rank: int = 0,
) -> None:
    """Restore adapter, optimizer, scheduler and the RNG states of `rank` in place."""
    path = Path(path)
    policy.load_adapter(path / ADAPTER)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    # our own file: python/numpy RNG states are tuples and arrays, which weights_only rejects
    restore_rng(torch.load(path / ("rng.pt" if rank == 0 else f"rng-rank-{rank}.pt"), weights_only=False), generator)
