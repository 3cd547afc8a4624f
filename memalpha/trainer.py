"""The GRPO training loop: data order, rollouts, the update, metrics, checkpoints and exact resume.

One step: take the next B training instances (seeded shuffle per epoch), run G rollouts of each
(memalpha.rollout), normalise rewards into advantages within groups, and update the LoRA adapter with
the clipped surrogate (memalpha.grpo) over micro-batches with gradient accumulation.

Importance-ratio denominator: the first inner epoch's forward pass of each micro-batch, detached. The
policy has not changed yet at that point (gradients accumulate, the optimizer steps after the last
micro-batch), so these are exactly the sampling policy's log-probs in the training layout, and no extra
forward pass is needed. The sampler's own log-probs (bf16, KV cache, other padding) are kept only to
report how far they are from the training computation (`sampling/logp_abs_diff`).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
import warnings
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import polars as pl
import torch
from torch.optim.swa_utils import get_swa_multi_avg_fn

from memalpha.checkpoint import (ADAPTER, BEST, CheckpointState, latest_checkpoint, load_checkpoint,
                                 read_best, read_state, save_best, save_checkpoint)
from memalpha.config import WARM_START_BUDGET_SHARE, RunConfig, step_would_overrun, training_fields
from memalpha.data.schema import Instance
from memalpha.episode import thin_distractors, truncate_for_training
from memalpha.errors import UserError
from memalpha.generation import left_pad, right_pad, shareable_prefix_length
from memalpha.grpo import (
    SharedPrefix, completion_logps, compute_advantages, group_ids, group_std, grpo_loss, shared_prompt_logps,
)
from memalpha.progress import SFTProgress
from memalpha.rewards import REWARD_COMPONENTS
from memalpha.rollout import RolloutBatch, Sample, collect_rollouts, collect_step_rollouts
from memalpha.tools import TOOL_NAMES

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SFT_DIR = "sft"


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
    """Span tree of one rollout (see memalpha.rollout.rollout_trace)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class TrainingData:
    """Instances by split, truncated for training, and how many each split lost to truncation."""

    splits: dict[str, list[Instance]]
    dropped: dict[str, int]
    """Per split: instances dropped because no question stayed answerable from the kept chunks."""


def load_training_data(config: RunConfig, tokenizer=None) -> TrainingData:
    """Instances of config.data.train_path by split, restricted to config.data.competencies and truncated
    to data.max_chunks_per_instance (questions whose evidence does not all survive are dropped, then
    instances without a question; memalpha.episode.truncate_for_training).

    A missing dataset folder is generated first with the seeded synthetic `train` preset (so training
    works on a fresh machine).
    """
    from memalpha.data.io import read_dataset

    path = Path(config.data.train_path)
    if not path.exists():
        from memalpha.data.prep import synthesize
        from memalpha.data.synth import PRESETS

        log.info("dataset %s not found: generating the synthetic training set", path)
        synth = replace(PRESETS["train"], competencies=tuple(config.data.competencies), seed=config.data.split_seed)
        synthesize(path, synth, tokenizer=tokenizer or _regex_tokenizer(), data_cfg=config.data,
                   tokenizer_name=getattr(tokenizer, "name_or_path", "regex"))
    wanted = set(config.data.competencies)
    splits: dict[str, list[Instance]] = {"train": [], "validation": [], "test": []}
    for instance in read_dataset(path):
        if instance.competency in wanted:
            splits.setdefault(instance.split, []).append(instance)
    dropped = {}
    for split, instances in splits.items():
        splits[split], dropped[split] = truncate_for_training(instances, config.data.max_chunks_per_instance)
        if dropped[split]:
            log.info("%s: %d %s instances dropped: no question answerable from their first %d chunks",
                     path, dropped[split], split, config.data.max_chunks_per_instance)
    if not splits["train"]:
        raise UserError(f"{path}: no training instances with competency in {sorted(wanted)}"
                        + (f" and a question answerable from the first {config.data.max_chunks_per_instance} chunks"
                           if dropped["train"] else ""))
    return TrainingData(splits, dropped)


def _regex_tokenizer():
    from memalpha.tokens import regex_token_count

    return regex_token_count


def warm_start(config: RunConfig, run_dir: Path, policy, instances: list[Instance],
               held_out: list[Instance] = (), on_log: Callable[[dict], None] | None = None,
               started: float | None = None) -> Path:
    """SFT warm start into run_dir/sft (rule-writer demonstrations + TRL SFTTrainer), measuring extraction
    on `sft.eval_chunks` chunks of the `held_out` instances after every epoch; the policy ends with the
    warm-start adapter. An existing adapter there is loaded instead of retraining. Under a time budget
    the run began at `started` (a `time.time()`, default now) and SFT gets `WARM_START_BUDGET_SHARE` of it."""
    from memalpha.sft import DemoStats, demonstration_max_length, extraction_probes, train_warm_start

    out = Path(run_dir) / SFT_DIR
    if (out / "adapter_model.safetensors").is_file():
        policy.load_adapter(out)
        return out
    tmp = out.with_name(f".{SFT_DIR}-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    probes = extraction_probes(list(held_out), config, policy.tokenizer, config.sft.eval_chunks)
    deadline = config.deadline(time.time() if started is None else started, WARM_START_BUDGET_SHARE)
    stats = DemoStats()
    result = train_warm_start(policy, instances, config, tmp, probes=probes, on_log=on_log or SFTProgress(log.info),
                              deadline=deadline, stats=stats)
    log.info("warm start: %d demonstrations from %d chunks (%d nothing-to-store, %d updating an entry, %d dropped "
             "as longer than %d tokens)", stats.kept, stats.chunks, stats.nothing_to_store, stats.updates,
             stats.too_long, demonstration_max_length(config))
    for member in result.members:
        recall = max((e["evidence_recall"] for e in member["epochs"]), default=None)
        log.info("warm start: seed %d of the average, %d SFT steps in %.0f s, held-out evidence recall %s",
                 member["seed"], member["steps"], member["seconds"], "not measured" if recall is None else f"{recall:.3f}")
    if config.sft.dagger_rounds:
        for info in result.rounds:
            log.info("warm start: DAgger round %d, %d demonstrations, %d of them on the policy's own memories "
                     "(labelled in %.0f s), %d nothing-to-store, %d updating an entry; %d SFT steps in %.0f s",
                     info["round"], info["demonstrations"], info["policy_states"], info["label_seconds"],
                     info["nothing_to_store"], info["updates"], info["steps"], info["seconds"])
    tmp.rename(out)
    log.info("warm start: %d SFT steps in %.0f s (best epoch %d of %d)", result.steps, result.seconds,
             result.best_epoch, len(result.epochs))
    return out


def prepare_warm_start(config: RunConfig, run_dir: str | Path, on_log: Callable[[dict], None] | None = None,
                       started: float | None = None) -> Path | None:
    """The warm-start adapter of a run folder, trained now if missing (None when sft.enabled is false).
    For pipelines that run the warm start as its own step; Trainer does the same on construction."""
    from memalpha.models.policy import load_policy

    if not config.sft.enabled or not _needs_warm_start(Path(run_dir)):
        return None
    policy = load_policy(config.trained_model(), seed=config.grpo.seed)
    data = load_training_data(config, policy.tokenizer)
    return warm_start(config, Path(run_dir), policy, data.splits["train"], data.splits["validation"], on_log, started)


def _needs_warm_start(run_dir: Path) -> bool:
    """An existing adapter is reused; past the first checkpoint the checkpoint holds the newer adapter."""
    return (run_dir / SFT_DIR / "adapter_model.safetensors").is_file() or latest_checkpoint(run_dir) is None


class Trainer:
    """GRPO over LoRA adapters with checkpoints and exact resume (see the module docstring)."""

    def __init__(self, config: RunConfig, run_dir: str | Path, force: bool = False,
                 on_warm_start_log: Callable[[dict], None] | None = None, started: float | None = None):
        """`on_warm_start_log` receives the warm start's records (default: progress lines to the log);
        `started` (a `time.time()`, default now) is when the run began, for `time_budget_minutes`."""
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
        self.stopped_early = False
        """Whether `train` stopped before `grpo.steps` because of the time budget."""
        cfg = config.grpo
        self.policy = load_policy(config.trained_model(), seed=cfg.seed)
        loaded = load_training_data(config, self.policy.tokenizer)
        self.data = loaded.splits
        self.dropped_instances = loaded.dropped
        self.warm_start_dir: Path | None = None
        if config.sft.enabled and _needs_warm_start(self.run_dir):
            self.warm_start_dir = warm_start(config, self.run_dir, self.policy, self.data["train"], self.data["validation"],
                                             on_warm_start_log, self.started)
        self.reader = make_reader(config.model, self.policy)
        self.judge = make_judge(config.model, self.policy) if config.reward.judge == "llm" else None
        seed_everything(cfg.seed)  # identical state whether the warm start ran now or was loaded
        self.generator = torch.Generator(device=self.policy.device).manual_seed(cfg.seed)
        self.reference = None
        if cfg.kl_beta and cfg.kl_reference == "warm_start":
            if config.sft.enabled and self.warm_start_dir is None:  # resumed, and run_dir/sft is gone
                raise UserError(f"{self.run_dir / SFT_DIR} holds no warm-start adapter, and the KL term's reference "
                                "(grpo.kl_reference=warm_start) is that adapter; restore it, or resume with "
                                "grpo.kl_reference=base")
            self.reference = self.policy.adapter_weights()
        """The KL term's reference weights (before any GRPO update; a resumed run loads the warm start first);
        None: the base model, when there is a KL term."""
        self.average: dict[str, torch.Tensor] | None = None
        """The mean of the adapter weights after steps grpo.average_from..step; None before, or when off."""
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

    def curriculum_distractors(self) -> float:
        """Share of distractor chunks kept at the coming step under data.distractor_curriculum."""
        return self._scheduled(self.config.data.distractor_curriculum, 1.0)

    def _next_instances(self) -> list[Instance]:
        """The next B training instances in the epoch's order, thinned and cut by the curricula; an instance
        left without an answerable question is passed over (the data position still moves on)."""
        picked = []
        chunks, distractors = self.curriculum_chunks(), self.curriculum_distractors()
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
            kept, dropped = truncate_for_training([thin_distractors(instance, distractors)], chunks)
            picked.extend(kept)
            passed_over += dropped
        return picked

    # ---- one step --------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One GRPO step: rollouts, advantages, update; appends the metrics to run_dir/metrics.jsonl. The
        held-out evaluation follows on the steps `GRPOConfig.is_eval_step` names and once the time budget
        has no room for another step (`out_of_time`)."""
        cfg = self.config.grpo
        started = time.perf_counter()
        # the policy before any update: the baseline the held-out curve starts from
        before = {f"warm_start/{k}": v for k, v in self.validate().items()} if self.step == 0 else {}
        instances = self._next_instances()
        distractors_kept = self.curriculum_distractors()
        collect = collect_step_rollouts if cfg.sampling == "step" else collect_rollouts
        batch = collect(
            self.policy, instances, self.config, num_generations=self.config.rollout.num_generations,
            generator=self.generator, reader=self.reader, judge=self.judge,
        )
        samples = batch.samples
        rewards = torch.tensor([s.reward.total for s in samples])
        grouping = "chunk" if cfg.sampling == "step" else cfg.advantage_grouping  # step groups: one state's G candidates
        groups = group_ids([s.instance_index for s in samples], [s.chunk for s in samples], grouping)
        advantages, zero_std = compute_advantages(rewards, groups, cfg.scale_rewards)
        for sample, adv in zip(samples, advantages.tolist()):
            sample.advantage = adv
        learning_rate = self.optimizer.param_groups[0]["lr"]
        update_start = time.perf_counter()
        update = self._update(samples, advantages)
        with warnings.catch_warnings():
            # The schedule counts GRPO steps, skipped updates (all advantages zero) included, so a first step
            # without an optimizer step is expected, not the ordering bug torch warns about.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()
        update_s = time.perf_counter() - update_start
        self.step += 1
        if cfg.average_from and self.step >= cfg.average_from:
            self._add_to_average()
        metrics = self._metrics(batch, rewards, groups, zero_std, update)
        metrics.update(before)
        metrics.update({
            "learning_rate": learning_rate,
            "timing/generate_s": batch.generate_s, "timing/reward_s": batch.reward_s, "timing/update_s": update_s,
            "timing/step_s": time.perf_counter() - started,
            "throughput/generated_tokens_per_s": batch.generated_tokens / max(batch.generate_s, 1e-9),
            "data/epoch": float(self.epoch),
            "curriculum/chunks_per_instance": float(max(len(i.chunks) for i in instances)),
            "curriculum/distractors_kept": distractors_kept,
            "data/dropped_instances": float(self.dropped_instances.get("train", 0)),
        })
        step_times = [h["timing/step_s"] for h in self.history if "timing/step_s" in h] + [metrics["timing/step_s"]]
        self.out_of_time = step_would_overrun(self.config.deadline(self.started), sum(step_times) / len(step_times))
        if self.out_of_time or cfg.is_eval_step(self.step):
            metrics.update(self.validate())
        self.history.append({"step": self.step, **metrics})
        with open(self.run_dir / METRICS_FILE, "a") as fh:
            fh.write(json.dumps({"step": self.step, **metrics}) + "\n")
        return StepResult(self.step, metrics, samples_frame(samples), rollout_memories(batch), batch.trace)

    def _add_to_average(self) -> None:
        """Fold the weights after this step into `average`, the uniform mean since grpo.average_from."""
        if self.average is None:
            self.average = self.policy.adapter_weights()
            return
        live = dict(self.policy.model.named_parameters())
        names = list(self.average)
        averaged_before = self.step - self.config.grpo.average_from
        get_swa_multi_avg_fn()([self.average[n] for n in names], [live[n].detach() for n in names], averaged_before)

    def _evaluated_weights(self) -> AbstractContextManager:
        """The weights the run stands for, to evaluate and keep as best: the average once there is one."""
        return nullcontext() if self.average is None else self.policy.using_adapter_weights(self.average)

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
        n_seq = len(samples)
        n_tok = sum(len(s.completion_ids) for s in samples)
        # Zero-advantage samples add nothing to these losses or their gradients when there is no KL term
        # (the normalisers below count them anyway), so their forward/backward passes are skipped.
        skippable = cfg.kl_beta == 0 and cfg.loss_type in ("grpo", "dr_grpo", "dapo")
        keep = [i for i in range(n_seq) if not (skippable and advantages[i] == 0)]
        micro = self._micro_batches(samples, keep)
        stats = {"loss": 0.0, "tokens": 0.0, "low": 0.0, "high": 0.0, "kl": 0.0, "entropy": 0.0,
                 "grad_norm": 0.0, "logp_diff": 0.0, "first_tokens": 0.0, "sampled_tokens": 0.0,
                 "shared_prefix_tokens": 0.0}
        if not micro:
            return {**stats, "skipped": float(n_seq - len(keep))}
        old: list[torch.Tensor] = []
        ref = self._reference_logps(samples, micro) if cfg.kl_beta else [None] * len(micro)
        model.train()
        try:
            for iteration in range(cfg.num_iterations):
                self.optimizer.zero_grad(set_to_none=True)
                prefix = self._shared_prefix(samples, micro)
                for k, (chosen, shared) in enumerate(micro):
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
                        batch_sequences=n_seq, batch_tokens=n_tok, num_micro_batches=len(micro),
                        ref_logps=ref[k], kl_beta=cfg.kl_beta,
                    )
                    loss.backward()
                    stats["loss"] += float(loss.detach()) / cfg.num_iterations
                    stats["tokens"] += ls.tokens
                    stats["low"] += ls.low_clipped
                    stats["high"] += ls.high_clipped
                    stats["kl"] += ls.kl_sum
                if prefix is not None:
                    prefix.backward()
                    stats["shared_prefix_tokens"] = float(prefix.length)
                stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
                self.optimizer.step()
        finally:
            model.eval()
            self.optimizer.zero_grad(set_to_none=True)
        stats["skipped"] = float(n_seq - len(keep))
        return stats

    def _micro_batches(self, samples: list[Sample], keep: list[int]) -> list[tuple[list[int], bool]]:
        """(sample indices, shares one prompt) per forward pass. With grpo.shared_prompt_update, the samples
        of one prompt form one pass that runs the prompt once; the rest are packed micro_batch_size at a
        time, sorted by length for less padding."""
        cfg = self.config.grpo
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        if cfg.shared_prompt_update and cfg.loss_type != "bnpo":
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

    @torch.no_grad()
    def _reference_logps(self, samples: list[Sample], micro: list[tuple[list[int], bool]]) -> list[torch.Tensor]:
        """Completion log-probs of the KL reference for each micro-batch, with the prefix the groups share run once."""
        policy = self.policy
        with policy.adapters_disabled() if self.reference is None else policy.using_adapter_weights(self.reference):
            prefix = self._shared_prefix(samples, micro)
            return [self._logps([samples[i] for i in chosen], shared, prefix=prefix if shared else None)[0]
                    for chosen, shared in micro]

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
            "kl": update["kl"] / tokens,
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
            **guidance_metrics(samples),
        }

    # ---- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, split: str = "validation") -> dict[str, float]:
        """Greedy rollouts (G=1) on up to eval.max_instances held-out instances (0 = all), read through
        retrieval as in evaluation: eval/* metrics, QA per competency included. `train_step` runs it
        after every step `GRPOConfig.is_eval_step` names, so its metrics line carries them."""
        instances = self.data.get(split, [])[: self.config.eval.max_instances or None]
        if not instances:
            raise UserError(f"{self.config.data.train_path}: no {split!r} instances to evaluate on")
        started = time.perf_counter()
        with self._evaluated_weights():
            batch = collect_rollouts(self.policy, instances, self.config, num_generations=1, generator=None,
                                     reader=self.reader, judge=self.judge, greedy=True, reader_view_mode="retrieve")
        return evaluation_metrics(batch, time.perf_counter() - started)

    def validate(self) -> dict[str, float]:
        """`evaluate` on the validation split, keeping the adapter in run_dir/best when its QA beats every
        earlier one (at step 0 the warm start is the first); adds `best/step` and `best/qa_score`."""
        metrics = self.evaluate("validation")
        best = read_best(self.run_dir)
        if self.step == 0 or best is None or metrics["eval/qa_score"] > best["score"]:
            with self._evaluated_weights():
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
            metrics=self.history, config=self.config.model_dump(mode="json"),
        )
        return save_checkpoint(self.run_dir, state, policy=self.policy, optimizer=self.optimizer,
                               scheduler=self.scheduler, generator=self.generator, average=self.average)

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
        # a run resumed (forced) with averaging off drops the checkpoint's mean
        self.average = load_checkpoint(path, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                                       generator=self.generator, with_average=bool(self.config.grpo.average_from))
        self.step = state.step
        self.epoch, self.position = state.data_position["epoch"], state.data_position["position"]
        self.history = list(state.metrics)
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


def _sampling_gap(rows: list[Sample], logps: torch.Tensor) -> float:
    """Token-summed |sampling log-prob - training log-prob| over sampled completions (a check of the
    sampler, not used in the loss; guided completions have no sampling log-probs and add nothing)."""
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
            "r1": r.r1, "r2": r.r2, "r3": r.r3, "r4": r.r4, "coverage": r.coverage, "retention": r.retention, "precision": r.precision,
            "holds_evidence": r.holds_evidence,
            "reward": r.total, "advantage": s.advantage, "guided": s.guided,
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


def guidance_metrics(samples: list[Sample]) -> dict[str, float]:
    """How the rule writer's guided candidates fared in their groups (`grpo.rule_guidance`): their mean
    reward and advantage, and the share of groups where one beat every sampled candidate."""
    guided = [s for s in samples if s.guided]
    if not guided:
        return {}
    best_sampled: dict[tuple[int, int], float] = {}
    for s in samples:
        if not s.guided:
            key = (s.instance_index, s.chunk)
            best_sampled[key] = max(best_sampled.get(key, float("-inf")), s.reward.total)
    return {
        "guidance/reward": sum(s.reward.total for s in guided) / len(guided),
        "guidance/advantage": sum(s.advantage for s in guided) / len(guided),
        "guidance/beats_sampled": sum(s.reward.total > best_sampled[(s.instance_index, s.chunk)] for s in guided) / len(guided),
    }


def rollout_metrics(batch: RolloutBatch) -> dict[str, float]:
    """What a batch of rollouts did, computed the same way for training steps and for held-out
    evaluation (there prefixed `eval/`): reward and its components, QA, completions, tool calls, memory.
    The policy's own samples only: guided candidates are the rule writer's (`guidance_metrics`)."""
    samples = [s for s in batch.samples if not s.guided]
    n = max(len(samples), 1)
    calls = sum(s.reward.calls for s in samples)
    tools = Counter(r.name or "unparseable" for s in samples for r in s.results)
    lengths = [len(s.completion_ids) for s in samples]
    return {
        "reward": sum(s.reward.total for s in samples) / n,
        "qa_score": sum(batch.qa_scores) / max(len(batch.qa_scores), 1),
        **{f"rewards/{c}/mean": sum(getattr(s.reward, c) for s in samples) / n for c in REWARD_COMPONENTS},
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
