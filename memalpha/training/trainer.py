"""The GRPO training loop: data order, rollouts, the update, metrics, checkpoints and exact resume.

One step: take the next B training instances (seeded shuffle per epoch), run G rollouts of each
(memalpha.training.rollout), normalise rewards into advantages within groups, and update the LoRA adapter with
the clipped surrogate (memalpha.training.grpo) over micro-batches with gradient accumulation.

Importance-ratio denominator: the first inner epoch's forward pass of each micro-batch, detached. The
policy has not changed yet at that point (gradients accumulate, the optimizer steps after the last
micro-batch), so these are exactly the sampling policy's log-probs in the training layout, and no extra
forward pass is needed. The sampler's own log-probs (bf16, KV cache, other padding) are kept only to
report how far they are from the training computation (`sampling/logp_abs_diff`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from memalpha.config import RunConfig, step_would_overrun, training_fields
from memalpha.data.schema import Instance
from memalpha.env.tools import TOOL_NAMES
from memalpha.errors import NoTrainingStep, UserError
from memalpha.progress import StepProgress, duration
from memalpha.rewards.rubric import REWARD_COMPONENTS
from memalpha.teacher import record
from memalpha.training.checkpoint import (
    ADAPTER,
    BEST,
    SFT_DIR,
    CheckpointState,
    capture_rng,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    read_best,
    read_state,
    save_best,
    save_checkpoint,
)
from memalpha.training.data import (
    load_training_data,
    truncate_for_training,
)
from memalpha.training.distributed import init_world, load_sharded_policy
from memalpha.training.engines import check_engine
from memalpha.training.generation import left_pad, right_pad, shareable_prefix_length
from memalpha.training.grpo import (
    SharedPrefix,
    completion_logps,
    compute_advantages,
    group_ids,
    group_std,
    grpo_loss,
    shared_prompt_logps,
)
from memalpha.training.rollout import (
    RolloutBatch,
    Sample,
    collect_rollouts,
    collect_step_rollouts,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


@dataclass
class StepResult:
    """What one GRPO step produced (see docs/ARCHITECTURE.md, "Trainer API")."""

    step: int
    metrics: dict[str, float]
    samples: pl.DataFrame
    """One row per (instance, rollout, chunk)."""
    memories: list[dict] = field(default_factory=list)
    """Final memory (and the reader's answers) of every rollout."""
    trace: dict = field(default_factory=dict)
    """Span tree of one rollout (see memalpha.training.rollout.rollout_trace)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """GRPO over LoRA adapters with checkpoints and exact resume (see the module docstring)."""

    def __init__(self, config: RunConfig, run_dir: str | Path, force: bool = False, started: float | None = None):
        """GRPO from the warm-start adapter in run_dir/sft when `sft.enabled` (the warm start is its own stage:
        `memalpha.teacher.warm_start.prepare_warm_start`); `started` (a `time.time()`, default now) is when
        the run began, for `time_budget_minutes`."""
        from memalpha.models.judges import make_judge
        from memalpha.models.policy import load_policy
        from memalpha.models.readers import make_reader

        self.config = config
        self.run_dir = Path(run_dir)
        self.force = force
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.time() if started is None else started
        self.out_of_time = False
        """Whether the time budget has no room for another step (set by each `train_step`)."""
        self.say: Callable[[str], None] | None = None
        """Where progress lines of the held-out checks go (None: nowhere)."""
        self.stopped_early = False
        """Whether `train` stopped before `grpo.steps` because of the time budget."""
        cfg = config.grpo
        self.world = init_world()
        """The training processes (memalpha.training.distributed); rank 0 logs, validates and checkpoints."""
        if config.rollout.instances_per_step % self.world.size:
            raise UserError(f"rollout.instances_per_step={config.rollout.instances_per_step} cannot be shared by "
                            f"{self.world.size} processes: set it to a multiple of {self.world.size}")
        check_engine(config.rollout, config.model.policy)
        self.sharded = config.model.fsdp
        """The base weights are sharded over the ranks: every rank runs the same forward passes."""
        self.policy = (load_sharded_policy(config.model, self.world, seed=cfg.seed) if self.sharded
                       else load_policy(config.model, seed=cfg.seed))
        loaded = load_training_data(config, self.policy.tokenizer)
        self.data = loaded.splits
        self.dropped_instances = loaded.dropped
        warm = self.run_dir / SFT_DIR
        if config.sft.enabled and latest_checkpoint(self.run_dir) is None:
            if not (warm / "adapter_model.safetensors").is_file():
                raise UserError(f"{warm} holds no warm-start adapter; run the warm start first (`memalpha sft`, "
                                "or `memalpha train`, which runs it), or set sft.enabled=false")
            self.policy.load_adapter(warm)
        self.reader = make_reader(config.model, self.policy)
        self.judge = make_judge(config.model, self.policy) if config.reward.judge == "llm" else None
        seed_everything(cfg.seed)  # identical state whether the warm start ran now or was loaded
        # each rank samples its own stream; rank 0's is a one-process run's
        self.generator = torch.Generator(device=self.policy.device).manual_seed(cfg.seed + 1_000_003 * self.world.rank)
        self.params = self.policy.trainable_parameters()
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps
        # lr factor (s+1)/(warmup+1) during warmup, so the first step already learns; then constant
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        self.step = 0
        self.epoch = 0
        self.position = 0
        self.history: list[dict[str, float]] = []

    # ---- data order ------------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.data["train"])))
        random.Random(self.config.grpo.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _scheduled(self, schedule: list[tuple[int, float]], default: float) -> float:
        """The value of a (first step, value) curriculum at the coming step."""
        value = default
        for start, scheduled in schedule:
            if self.step >= start:
                value = scheduled
        return value

    def curriculum_chunks(self) -> int:
        """Chunks per instance at the coming step under data.chunk_curriculum (0: no curriculum)."""
        return int(self._scheduled(self.config.data.chunk_curriculum, 0))

    def _next_instances(self) -> list[Instance]:
        """The next B training instances in the epoch's order, cut by the chunk curriculum; an instance
        left without an answerable question is passed over (the data position still moves on)."""
        picked = []
        chunks = self.curriculum_chunks()
        passed_over = 0
        while len(picked) < self.config.rollout.instances_per_step:
            order = self._epoch_order(self.epoch)
            if passed_over > len(order):
                raise UserError(f"{self.config.data.train_path}: no training instance has a question answerable "
                                f"from its first {chunks} chunks (data.chunk_curriculum)")
            instance = self.data["train"][order[self.position]]
            self.position += 1
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
            kept, dropped = truncate_for_training([instance], chunks)
            picked.extend(kept)
            passed_over += dropped
        return picked

    # ---- one step --------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One GRPO step: rollouts, advantages, update; appends the metrics to run_dir/metrics.jsonl. The
        held-out evaluation follows on the steps `GRPOConfig.is_eval_step` names and once the time budget
        has no room for another step (`out_of_time`). Before step 1 the warm start is checked, and a time
        budget already spent fails the run (`NoTrainingStep`); once started, a step always finishes."""
        cfg = self.config.grpo
        # the policy before any update: the baseline the held-out curve starts from
        before = {f"warm_start/{k}": v for k, v in self.validate().items()} if self.step == 0 and self.world.main else {}
        if before:
            self._tell(f"held-out QA of the warm start: {before['warm_start/eval/qa_score']:.3f}")
        if self.step == 0:
            self._check_first_step(before)
        started = time.perf_counter()  # after the warm start's check: step times predict the next step's (`out_of_time`)
        instances = self._next_instances()
        shard = self.world.shard(instances)
        G = self.config.rollout.num_generations
        progress = StepProgress(self.step + 1, cfg.steps, sum(len(i.chunks) for i in shard) * G, self.say or log.info)
        # a step-level call writes G candidates for each instance still writing, a trajectory call a chunk of each rollout
        written = G if cfg.sampling == "step" else 1
        collect = collect_step_rollouts if cfg.sampling == "step" else collect_rollouts
        with progress:
            batch = collect(self.policy, shard, self.config, num_generations=G, generator=self.generator,
                            reader=self.reader, judge=self.judge, on_chunks=lambda chunks: progress(chunks * written))
            samples = batch.samples
            rewards = torch.tensor([s.reward.total for s in samples])
            grouping = "chunk" if cfg.sampling == "step" else cfg.advantage_grouping  # step groups: one state's G candidates
            groups = group_ids([s.instance_index for s in samples], [s.chunk for s in samples], grouping)
            advantages, zero_std = compute_advantages(rewards, groups, cfg.scale_rewards)
            for sample, adv in zip(samples, advantages.tolist()):
                sample.advantage = adv
            learning_rate = self.optimizer.param_groups[0]["lr"]
            update_start = time.perf_counter()
            progress.updating()
            update = self._update(samples, advantages)
        with warnings.catch_warnings():
            # The schedule counts GRPO steps, skipped updates (all advantages zero) included, so a first step
            # without an optimizer step is expected, not the ordering bug torch warns about.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()
        update_s = time.perf_counter() - update_start
        self.step += 1
        metrics = self._metrics(batch, rewards, groups, zero_std, update)
        metrics.update(before)
        metrics.update({
            "learning_rate": learning_rate,
            "timing/generate_s": batch.generate_s, "timing/reward_s": batch.reward_s, "timing/update_s": update_s,
            "timing/allreduce_s": update["allreduce_s"],
            "timing/step_s": time.perf_counter() - started,
            "throughput/generated_tokens_per_s": batch.generated_tokens / max(batch.generate_s, 1e-9),
            "data/epoch": float(self.epoch),
            "curriculum/chunks_per_instance": float(max(len(i.chunks) for i in instances)),
            "data/dropped_instances": float(self.dropped_instances.get("train", 0)),
        })
        step_times = [h["timing/step_s"] for h in self.history if "timing/step_s" in h] + [metrics["timing/step_s"]]
        deadline, mean_step = self.config.deadline(self.started), sum(step_times) / len(step_times)
        self.out_of_time = self.world.any(step_would_overrun(deadline, mean_step))  # every rank stops after the same step
        if deadline is not None:  # what the progress line says is what decides
            metrics["time_budget/steps_that_fit"] = 0.0 if self.out_of_time else float((deadline - time.time()) // mean_step)
        frame, memories = samples_frame(samples), rollout_memories(batch)
        if self.world.size > 1:  # the step's metrics are the ranks' mean; rank 0 holds every rank's rollouts
            metrics = _mean_over_ranks(self.world.gather(metrics))
            gathered = self.world.gather((frame, memories))
            frame, memories = pl.concat([f for f, _ in gathered], how="diagonal_relaxed"), [m for _, ms in gathered for m in ms]
        if self.world.main and (self.out_of_time or cfg.is_eval_step(self.step)):
            metrics.update(self.validate())
        self.history.append({"step": self.step, **metrics})
        if self.world.main:
            with open(self.run_dir / METRICS_FILE, "a") as fh:
                fh.write(json.dumps({"step": self.step, **metrics}) + "\n")
        return StepResult(self.step, metrics, frame, memories, batch.trace)

    def _check_first_step(self, held_out: dict[str, float]) -> None:
        """Before step 1: a time budget the warm start and its held-out check (`held_out`, rank 0's) spent leaves
        no GRPO step, and the run fails saying so (every rank takes the same branch). Later, the budget stops
        between steps."""
        deadline = self.config.deadline(self.started)
        if not self.world.any(deadline is not None and time.time() > deadline):
            return
        budget, spent = self.config.time_budget_minutes, time.time() - self.started
        more = math.ceil(budget + spent / 60)  # what was spent before step 1 again, plus the budget for steps
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
        raise NoTrainingStep(
            f"no GRPO step fits the time budget: time_budget_minutes={budget:g} was spent before step 1 "
            f"({duration(spent)} since the run began, on the warm start and its held-out check; load average {load} "
            f"on {os.cpu_count()} CPUs), so nothing was trained. Give it more time: time_budget_minutes={more} "
            f"(`--set time_budget_minutes={more}`; `MEMALPHA_TRAIN_MINUTES={more} make train`), or null for no "
            "limit, or run it on a less loaded machine", held_out)

    def _tell(self, line: str) -> None:
        (self.say or log.info)(line)

    def _collate(self, chosen: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """[left-padded prompt | right-padded completion] rows, attention mask, completion mask, width."""
        pad, device = self.policy.tokenizer.pad_token_id, self.policy.device
        prompt_ids, prompt_mask = left_pad([s.prompt_ids for s in chosen], pad, device)
        comp, comp_mask = right_pad([s.completion_ids for s in chosen], pad, device)
        return torch.cat([prompt_ids, comp], 1), torch.cat([prompt_mask, comp_mask], 1), comp_mask, comp.shape[1]

    def _update(self, samples: list[Sample], advantages: torch.Tensor) -> dict[str, float]:
        """num_iterations passes of gradient accumulation over micro-batches, each ending in one
        AdamW step after gradient clipping. Returns token-weighted statistics."""
        cfg = self.config.grpo
        model = self.policy.model
        world = self.world
        # the normalisers count the whole step's samples, on every rank (the gradients are summed)
        n_seq, n_tok = (int(v) for v in world.sum([len(samples), sum(len(s.completion_ids) for s in samples)]))
        # Zero-advantage samples add nothing to these losses or their gradients (the normalisers below
        # count them anyway), so their forward/backward passes are skipped.
        skippable = cfg.loss_type in ("grpo", "dr_grpo", "dapo")
        keep = [i for i in range(len(samples)) if not (skippable and advantages[i] == 0)]
        micro = self._micro_batches(samples, keep)
        stats = {"loss": 0.0, "tokens": 0.0, "low": 0.0, "high": 0.0, "entropy": 0.0,
                 "grad_norm": 0.0, "logp_diff": 0.0, "first_tokens": 0.0, "sampled_tokens": 0.0,
                 "shared_prefix_tokens": 0.0, "allreduce_s": 0.0}
        n_micro = int(world.sum([len(micro)])[0])
        if not n_micro:
            return {**stats, "skipped": float(n_seq - world.sum([len(keep)])[0])}
        old: list[torch.Tensor] = []
        model.train()
        try:
            for iteration in range(cfg.num_iterations):
                self.optimizer.zero_grad(set_to_none=True)
                prefix = self._shared_prefix(samples, micro)
                # a sharded pass gathers weights from every rank: ranks with fewer micro-batches run idle passes
                for k in range(world.max(len(micro)) if self.sharded else len(micro)):
                    if k >= len(micro):
                        self._idle_pass(samples)
                        continue
                    chosen, shared = micro[k]
                    rows = [samples[i] for i in chosen]
                    first = iteration == 0
                    logps, entropy, mask = self._logps(rows, shared, with_entropy=first,
                                                       prefix=prefix if shared else None)
                    if first:
                        old.append(logps.detach())
                        stats["entropy"] += float((entropy * mask).sum())
                        stats["logp_diff"] += _sampling_gap(rows, logps.detach())
                        stats["first_tokens"] += float(mask.sum())
                        stats["sampled_tokens"] += sum(len(s.sampling_logps) for s in rows)
                    loss, ls = grpo_loss(
                        logps, old[k], advantages[chosen].to(logps.device), mask,
                        loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                        max_completion_length=self.config.rollout.max_completion_length,
                        batch_sequences=n_seq, batch_tokens=n_tok, num_micro_batches=n_micro,
                    )
                    loss.backward()
                    stats["loss"] += float(loss.detach()) / cfg.num_iterations
                    stats["tokens"] += ls.tokens
                    stats["low"] += ls.low_clipped
                    stats["high"] += ls.high_clipped
                if prefix is not None:
                    prefix.backward()
                    stats["shared_prefix_tokens"] = float(prefix.length)
                reduce_start = time.perf_counter()
                world.sum_gradients(self.params)
                stats["allreduce_s"] += time.perf_counter() - reduce_start
                stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
                self.optimizer.step()
        finally:
            model.eval()
            self.optimizer.zero_grad(set_to_none=True)
        stats["skipped"] = float(n_seq - world.sum([len(keep)])[0])
        additive = ("loss", "tokens", "low", "high", "entropy", "logp_diff", "first_tokens", "sampled_tokens")
        stats.update(zip(additive, world.sum([stats[k] for k in additive])))
        return stats

    def _idle_pass(self, samples: list[Sample]) -> None:
        """A forward and backward pass that changes no gradient (a rank's share of a sharded pass)."""
        logps, _, _ = self._logps(samples[:1], shared=False)
        (logps.sum() * 0).backward()

    def _micro_batches(self, samples: list[Sample], keep: list[int]) -> list[tuple[list[int], bool]]:
        """(sample indices, shares one prompt) per forward pass. With grpo.shared_prompt_update, the samples
        of one prompt form one pass that runs the prompt once; the rest are packed micro_batch_size at a
        time, sorted by length for less padding."""
        cfg = self.config.grpo
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        # sharded: one pass per micro-batch on every rank (a shared prompt runs two), so the ranks' passes line up
        if cfg.shared_prompt_update and cfg.loss_type != "bnpo" and not self.sharded:
            for i in keep:
                by_prompt.setdefault(tuple(samples[i].prompt_ids), []).append(i)
        shared = [rows for rows in by_prompt.values() if len(rows) > 1]
        in_shared = {i for rows in shared for i in rows}
        single = sorted((i for i in keep if i not in in_shared),
                        key=lambda i: (len(samples[i].prompt_ids) + len(samples[i].completion_ids), i))
        packed = [single[j : j + cfg.micro_batch_size] for j in range(0, len(single), cfg.micro_batch_size)]
        return [(rows, True) for rows in shared] + [(rows, False) for rows in packed]

    def _shared_prefix(self, samples: list[Sample], micro: list[tuple[list[int], bool]]) -> SharedPrefix | None:
        """The prompt prefix common to the shared-prompt micro-batches (two or more), run once, or None."""
        prompts = [samples[chosen[0]].prompt_ids for chosen, shared in micro if shared]
        length = shareable_prefix_length(prompts)
        if not length:
            return None
        prefix_ids = torch.tensor([prompts[0][:length]], dtype=torch.long, device=self.policy.device)
        return SharedPrefix(self.policy.model, prefix_ids)

    def _logps(self, rows: list[Sample], shared: bool, with_entropy: bool = False, prefix: SharedPrefix | None = None):
        """Completion log-probs, entropies and completion mask of one micro-batch."""
        temperature, device = self.config.rollout.temperature, self.policy.device
        if shared:
            comp, mask = right_pad([s.completion_ids for s in rows], self.policy.tokenizer.pad_token_id, device)
            prompt = torch.tensor([rows[0].prompt_ids], dtype=torch.long, device=device)
            logps, entropy = shared_prompt_logps(self.policy.model, prompt, comp, mask, temperature, with_entropy,
                                                 prefix=prefix)
            return logps, entropy, mask
        ids, attn, mask, width = self._collate(rows)
        logps, entropy = completion_logps(self.policy.model, ids, attn, width, temperature, with_entropy=with_entropy)
        return logps, entropy, mask

    def _metrics(self, batch: RolloutBatch, rewards, groups, zero_std, update: dict[str, float]) -> dict[str, float]:
        samples = batch.samples
        n = max(len(samples), 1)
        num_groups = int(groups.max()) + 1 if len(samples) else 0
        stds = group_std(rewards.double(), groups, num_groups)[groups] if len(samples) else torch.zeros(0)
        tokens = max(update["tokens"], 1.0)
        first_tokens = max(update["first_tokens"], 1.0)
        return {
            **rollout_metrics(batch),
            "reward_std": float(stds.mean()) if len(samples) else 0.0,
            "frac_reward_zero_std": float(zero_std.float().mean()) if len(samples) else 0.0,
            "loss": update["loss"],
            "clip_ratio": (update["low"] + update["high"]) / tokens,
            "clip_ratio/low_mean": update["low"] / tokens,
            "clip_ratio/high_mean": update["high"] / tokens,
            "entropy": update["entropy"] / first_tokens,
            "grad_norm": update["grad_norm"],
            "sampling/logp_abs_diff": update["logp_diff"] / max(update["sampled_tokens"], 1.0),
            "update/skipped_samples": update["skipped"],
            "update/shared_prefix_tokens": update["shared_prefix_tokens"],
            "prompts/mean_tokens": sum(len(s.prompt_ids) for s in samples) / n,
            "prompts/truncated_ratio": sum(s.prompt_truncated for s in samples) / n,
            "generate_calls": float(batch.generate_calls),
        }

    # ---- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str = "validation") -> dict[str, float]:
        """Greedy rollouts (G=1) on up to eval.max_instances held-out instances (0 = all), read through
        retrieval as in evaluation: eval/* metrics, QA per competency included. `train_step` runs it
        after every step `GRPOConfig.is_eval_step` names, so its metrics line carries them."""
        instances = self._held_out(split)
        if not instances:
            raise UserError(f"{self.config.data.train_path}: no {split!r} instances to evaluate on")
        started = time.perf_counter()
        progress = None
        if self.say is not None:
            from memalpha.progress import WriteProgress

            progress = WriteProgress(sum(len(i.chunks) for i in instances), self.say, label=f"held-out check at step {self.step}")
        with progress or nullcontext():
            batch = collect_rollouts(self.policy, instances, self.config, num_generations=1, generator=None,
                                     reader=self.reader, judge=self.judge, greedy=True, reader_view_mode="retrieve",
                                     on_chunks=progress)
        return evaluation_metrics(batch, time.perf_counter() - started)

    def _held_out(self, split: str) -> list[Instance]:
        return self.data.get(split, [])[: self.config.eval.max_instances or None]

    def held_out_fields(self) -> dict:
        """What this trainer's held-out check depends on besides the adapter (`record.held_out_fields`)."""
        return record.held_out_fields(self.config, self._held_out("validation"), str(self.policy.dtype),
                                      self.policy.device.type)

    def warm_start_check(self) -> dict[str, float]:
        """`evaluate` of the policy before any update, read from the warm start's record instead when it holds
        this very check (the shipped warm start, copied with its record into run_dir/sft, on `make train`'s
        data, reader and config); one line says which, and why it is measured."""
        path = self.run_dir / SFT_DIR / record.RECORD_FILE
        kept = record.read_record(path.parent) if self.config.sft.enabled else None
        stored = (kept or {}).get(record.HELD_OUT_CHECKS, [])
        fields = self.held_out_fields()
        changed = []
        for check in stored:
            differ = sorted(k for k in fields.keys() | check["fields"].keys() if fields.get(k) != check["fields"].get(k))
            if not differ:
                self._tell(f"held-out check of the warm start: read from {path} (measured on the same data, reader and config)")
                return dict(check["metrics"])
            changed = differ if not changed or len(differ) < len(changed) else changed  # the closest check says why
        why = ("sft.enabled=false: no warm start, the base policy is checked" if not self.config.sft.enabled
               else f"{path.parent} is not the shipped warm start (no {record.RECORD_FILE})" if kept is None
               else f"{path} holds none (`memalpha sft --held-out-check` records it)" if not stored
               else f"{path} was measured with other {', '.join(changed)}")
        self._tell(f"held-out check of the warm start: measuring it, as {why}")
        return self.evaluate("validation")

    def validate(self) -> dict[str, float]:
        """`evaluate` on the validation split (before the first update `warm_start_check`), keeping the adapter in
        run_dir/best when its QA beats every earlier one (at step 0 the warm start is the first); adds
        `best/step` and `best/qa_score`."""
        metrics = self.warm_start_check() if self.step == 0 else self.evaluate("validation")
        best = read_best(self.run_dir)
        if self.step == 0 or best is None or metrics["eval/qa_score"] > best["score"]:
            save_best(self.run_dir, self.policy, self.step, metrics["eval/qa_score"])
            best = {"step": self.step, "score": metrics["eval/qa_score"]}
        return {**metrics, "best/step": float(best["step"]), "best/qa_score": best["score"]}

    @property
    def best_adapter(self) -> Path | None:
        """The adapter with the best validation QA so far (None before the first evaluation)."""
        return self.run_dir / BEST / ADAPTER if read_best(self.run_dir) else None

    # ---- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write run_dir/checkpoints/step-XXXXXX (atomic) and return it."""
        state = CheckpointState(
            step=self.step, training_hash=self.config.training_hash(),
            data_position={"epoch": self.epoch, "position": self.position},
            metrics=self.history, config=self.config.model_dump(mode="json"), processes=self.world.size,
        )
        rng = self.world.gather(capture_rng(self.generator))
        path = checkpoint_dir(self.run_dir, self.step)
        if self.world.main:
            path = save_checkpoint(self.run_dir, state, policy=self.policy, optimizer=self.optimizer,
                                   scheduler=self.scheduler, generator=self.generator, other_ranks_rng=rng[1:])
        self.world.barrier()  # no rank moves on before the checkpoint exists
        return path

    def maybe_resume(self, checkpoint: str | Path | None = None) -> bool:
        """Continue from `checkpoint` (default: the latest in run_dir/checkpoints); False when there is none.

        Refuses (UserError) a checkpoint written under a different training configuration unless
        the trainer was created with force=True.
        """
        path = Path(checkpoint) if checkpoint else latest_checkpoint(self.run_dir)
        if path is None:
            return False
        state = read_state(path)
        current = self.config.training_hash()
        if state.training_hash != current and not self.force:
            changed = _changed_fields(state.config, self.config.model_dump(mode="json"))
            raise UserError(
                f"checkpoint {path} was written under training config hash {state.training_hash}, the current "
                f"config hashes to {current}" + (f" (changed: {', '.join(changed)})" if changed else "")
                + "; resume with the original config, use another output folder, or force it (--force)"
            )
        if state.processes != self.world.size:
            raise UserError(f"checkpoint {path} was written by {state.processes} training process(es), this run has "
                            f"{self.world.size}: resume with `torchrun --nproc_per_node {state.processes}` (each "
                            "process restores its own sampler state), or start a new output folder")
        load_checkpoint(path, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                        generator=self.generator, rank=self.world.rank)
        self.step = state.step
        self.epoch, self.position = state.data_position["epoch"], state.data_position["position"]
        self.history = list(state.metrics)
        if self.world.main:
            (self.run_dir / METRICS_FILE).write_text("".join(json.dumps(m) + "\n" for m in self.history))
        log.info("resumed from %s (step %d)", path, self.step)
        return True

    def train(self, on_step: Callable[[StepResult], None] | None = None, until: int | None = None) -> Path | None:
        """Run the remaining steps up to `until` (default and at most grpo.steps), checkpointing every
        grpo.checkpoint_every steps and at the end; returns the last checkpoint saved (None when no step
        ran). The Prefect flow runs it block by block (`until` = the block's last step).

        Under `time_budget_minutes` the step after which another would end past the deadline is the last
        (`out_of_time`): it is evaluated and checkpointed, and `stopped_early` is set when steps were left."""
        cfg = self.config.grpo
        end = min(until or cfg.steps, cfg.steps)
        last = None
        while self.step < end:
            result = self.train_step()
            if on_step is not None:
                on_step(result)
            if self.step % cfg.checkpoint_every == 0 or self.step == end or self.out_of_time:
                last = self.save_checkpoint()
            if self.out_of_time:
                self.stopped_early = self.step < cfg.steps
                break
        return last

    @property
    def budget_stop(self) -> str | None:
        """Where the time budget stopped the run (`stopped_early`), for logs and the run's tag; else None."""
        if not self.stopped_early:
            return None
        return f"{self.config.time_budget_minutes} min spent: stopped after step {self.step} of {self.config.grpo.steps}"


def _mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the ranks that report it (the ranks' shares of a step are equal in size)."""
    keys = dict.fromkeys(k for metrics in per_rank for k in metrics)
    return {k: sum(m[k] for m in per_rank if k in m) / sum(k in m for m in per_rank) for k in keys}


def _sampling_gap(rows: list[Sample], logps: torch.Tensor) -> float:
    """Token-summed |sampling log-prob - training log-prob| over sampled completions (a check of the
    sampler, not used in the loss)."""
    total = 0.0
    for i, s in enumerate(rows):
        n = len(s.sampling_logps)
        total += float((logps[i, :n].float() - torch.tensor(s.sampling_logps, device=logps.device)).abs().sum())
    return total


def _changed_fields(saved: dict | None, current: dict) -> list[str]:
    if not saved:
        return []
    a, b = training_fields(saved), training_fields(current)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def samples_frame(samples: list[Sample]) -> pl.DataFrame:
    """One row per (instance, rollout, chunk) with texts, parsed calls, results and the reward breakdown."""
    rows = []
    for s in samples:
        r = s.reward
        rows.append({
            "instance": s.instance_index, "instance_id": s.instance_id, "rollout": s.rollout, "chunk": s.chunk,
            "prompt": s.prompt, "completion": s.completion,
            "parsed_calls": json.dumps([c.to_dict() for c in s.parse.calls]),
            "results": json.dumps([x.to_dict() for x in s.results], default=str),
            "memory": s.memory_json,
            "r1": r.r1, "r2": r.r2, "r3": r.r3, "r4": r.r4, "coverage": r.coverage, "retention": r.retention,
            "holds_evidence": r.holds_evidence,
            "reward": r.total, "advantage": s.advantage,
            "calls": r.calls, "executed": r.executed, "valid": r.valid, "nothing_to_store": r.nothing_to_store,
            "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.completion_ids), "truncated": s.truncated,
            "memory_tokens": s.memory_tokens, "memory_entries": s.memory_entries,
        })
    return pl.DataFrame(rows)


def rollout_memories(batch: RolloutBatch) -> list[dict]:
    """Final memory, QA score and answers of every rollout."""
    G = batch.num_generations
    return [
        {"instance_id": batch.instances[r // G].instance_id, "rollout": r % G, "qa_score": batch.qa_scores[r],
         "memory": json.loads(store.to_json()), "answers": batch.answers[r]}
        for r, store in enumerate(batch.memories)
    ]


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """What a batch of rollouts did, computed the same way for training steps and for held-out
    evaluation (there prefixed `eval/`): reward and its components, QA, completions, tool calls, memory.
    """
    samples = batch.samples
    n = max(len(samples), 1)
    calls = sum(s.reward.calls for s in samples)
    tools = Counter(r.name or "unparseable" for s in samples for r in s.results)
    lengths = [len(s.completion_ids) for s in samples]
    return {
        "reward": sum(s.reward.total for s in samples) / n,
        "qa_score": sum(batch.qa_scores) / max(len(batch.qa_scores), 1),
        **{f"rewards/{c}/mean": sum(getattr(s.reward, c) for s in samples) / n for c in REWARD_COMPONENTS},
        # r2 and r4 as the total counts them: step-level sampling optimises these, not the raw shares
        **{f"rewards/{c}_gated/mean": sum(s.reward.gate * getattr(s.reward, c) for s in samples) / n for c in ("r2", "r4")},
        "completions/mean_length": sum(lengths) / n,
        "completions/min_length": float(min(lengths, default=0)),
        "completions/max_length": float(max(lengths, default=0)),
        "completions/clipped_ratio": sum(s.truncated for s in samples) / n,
        "tool_calls/per_chunk": calls / n,
        "tool_calls/success_rate": sum(s.reward.executed for s in samples) / calls if calls else 0.0,
        "tool_calls/nothing_to_store": sum(s.parse.nothing_to_store for s in samples) / n,
        **{f"tool_calls/{name}": tools.get(name, 0) / n for name in (*TOOL_NAMES, "unparseable")},
        "memory/tokens": sum(m.token_count() for m in batch.memories) / max(len(batch.memories), 1),
        "memory/entries": sum(m.entry_count() for m in batch.memories) / max(len(batch.memories), 1),
    }


def evaluation_metrics(batch: RolloutBatch, seconds: float = 0.0) -> dict[str, float]:
    """eval/* metrics of a batch of greedy rollouts: `rollout_metrics`, plus QA per competency."""
    by_competency: dict[str, list[float]] = {}
    for r, answers in enumerate(batch.answers):
        competency = batch.instances[r // batch.num_generations].competency
        by_competency.setdefault(competency, []).extend(a["score"] for a in answers)
    return {
        **{f"eval/{key}": value for key, value in rollout_metrics(batch).items()},
        **{f"eval/qa/{c}": sum(v) / len(v) for c, v in sorted(by_competency.items()) if v},
        "eval/instances": float(len(batch.instances)),
        "eval/seconds": seconds,
    }
