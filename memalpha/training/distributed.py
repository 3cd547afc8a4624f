"""Data-parallel GRPO across processes with torch.distributed.

Launched by `torchrun --nproc_per_node N -m memalpha train ...` (or `accelerate launch`, which sets the same
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); gloo on a CPU, NCCL on GPUs. Every
rank walks the same data order and takes its share of each step's instances, so a group of rollouts
never straddles two ranks. Gradients are summed across ranks and the loss is normalised by the whole
step's sequences and tokens, so N processes take the step one process would take on the same samples.
Rank 0 alone logs, validates and writes checkpoints; every rank restores from them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (rank 0 of 1 when not launched distributed)."""

    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[Any]) -> list[Any]:
        """This rank's share: every size-th item from its rank on."""
        return list(items[self.rank::self.size])

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (the values themselves in one process)."""
        if self.size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def any(self, flag: bool) -> bool:
        """True when the flag is set on any rank (so every rank takes the same branch)."""
        return self.sum([float(flag)])[0] > 0

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum each parameter's gradient over the ranks, in one flat buffer (a rank without a micro-batch
        this step contributes zeros)."""
        if self.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (picklable objects)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def init_world() -> World:
    """The process group of a distributed launch (WORLD_SIZE > 1), created once; else a world of one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # rank 0 alone validates and may build the warm start while the others wait at the next collective
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(hours=2))
    return World(dist.get_rank(), dist.get_world_size())
