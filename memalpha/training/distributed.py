"""Data-parallel GRPO across processes with torch.distributed.

Launched by `torchrun --nproc_per_node N -m memalpha train ...` (or `accelerate launch`, which sets the same
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); gloo on a CPU, NCCL on GPUs. Every
rank walks the same data order and takes its share of each step's instances, so a group of rollouts
never straddles two ranks. Gradients are summed across ranks and the loss is normalised by the whole
step's sequences and tokens, so N processes take the step one process would take on the same samples.
Rank 0 alone logs, validates and writes checkpoints; every rank restores from them.

With `model.fsdp` the frozen base weights are sharded over the ranks with FSDP2 (`load_sharded_policy`), for
a policy that does not fit one device. The LoRA parameters are left out of the sharding: they are small,
stay whole on every rank and are summed like the unsharded run's, so checkpoints, adapter saving and the
vLLM hot-swap are unchanged. A sharded forward pass gathers each layer's weights from all ranks, so every
rank must run the same passes: sampling goes to vLLM, and the update pads the ranks to the same number
of micro-batches (`Trainer._update`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from memalpha.config import ModelConfig
from memalpha.errors import UserError

if TYPE_CHECKING:
    from memalpha.models.policy import Policy


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

    def max(self, value: int) -> int:
        """The largest of the ranks' values."""
        return max(self.gather(value))

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


def load_sharded_policy(model_cfg: ModelConfig, world: World, seed: int = 0) -> Policy:
    """The policy with its base weights sharded over the ranks (FSDP2 `fully_shard`, one unit per decoder
    layer and one for the rest); the LoRA is whole on every rank. Rank 0 reads the weights into CPU memory,
    the other ranks build the model empty (meta device); rank 0 then broadcasts one full tensor at a time
    and each rank keeps its shard, so no device ever holds the whole model."""
    from peft import get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from memalpha.models.loading import choose_device, choose_dtype, load_base
    from memalpha.models.policy import Policy, lora_config

    if world.size == 1:
        raise UserError("model.fsdp=true shards the policy over the training processes: launch with "
                        "`torchrun --nproc_per_node N -m memalpha train ...` (N > 1), or set model.fsdp=false")
    device = choose_device(model_cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = choose_dtype(model_cfg.dtype, device)
    base, tokenizer = load_base(model_cfg.policy, dtype, torch.device("cpu"), seed=seed, empty=not world.main)
    torch.manual_seed(seed)
    model = get_peft_model(base, lora_config(model_cfg))
    full = model.state_dict() if world.main else {}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()} if world.main else {}
    lora = {p for p in model.parameters() if p.requires_grad}
    layers = _decoder_layers(model)
    mesh = init_device_mesh(device.type, (world.size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=lora)
    fully_shard(model, mesh=mesh, ignored_params=lora)
    model.to_empty(device=device)  # placement only: every value is set from rank 0's below
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():  # some are not in the state dict (e.g. rotary frequencies)
        if world.main:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, device=device, dtype=dtype, name=model_cfg.policy)


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's repeated blocks: the largest ModuleList of the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise UserError(f"model.fsdp: {type(model).__name__} has no list of decoder layers to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
