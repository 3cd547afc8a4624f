"""Run by tests/test_distributed.py under torchrun: one GRPO update of the tiny policy on rollouts sampled
beforehand (a pickle of samples and advantages), each rank taking the samples of its share of the
instances; rank 0 saves the updated adapter. Prints each rank's number of micro-batches and of parameter
values held.

    torchrun --nproc_per_node N tests/distributed_update.py CONFIG_JSON SAMPLES_PICKLE RUN_DIR OUT_DIR
"""

import pickle
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import memalpha.training.trainer as trainer_module
from memalpha.config import RunConfig
from memalpha.training.trainer import Trainer

# the rollouts are given, so a config with rollout.engine=vllm (model.fsdp needs it) asks no server
trainer_module.check_engine = lambda *args: None

config_json, samples_file, run_dir, out_dir = sys.argv[1:]
trainer = Trainer(RunConfig.model_validate_json(Path(config_json).read_text()), run_dir)
samples, advantages, instances = pickle.loads(Path(samples_file).read_bytes())
mine = set(trainer.world.shard(range(instances)))
chosen = [i for i, s in enumerate(samples) if s.instance_index in mine]
rows, adv = [samples[i] for i in chosen], torch.tensor([advantages[i] for i in chosen])
micro = trainer._micro_batches(rows, [i for i in range(len(rows)) if adv[i] != 0])
held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trainer.policy.model.parameters())
print(f"rank {trainer.world.rank}: {len(micro)} micro-batches, {held} parameter values held", flush=True)
trainer._update(rows, adv)
if trainer.world.main:
    trainer.policy.save_adapter(Path(out_dir))
