"""Supervised fine-tuning of the policy's LoRA adapter on demonstrations, with TRL's SFTTrainer and a
completion-only loss that runs the shared system prompt once per batch."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memalpha.config import SFTConfig, step_would_overrun
from memalpha.teacher.demonstrations import Demonstration
from memalpha.teacher.probes import Probe, extraction_metrics
from memalpha.training.generation import MIN_SHARED_PREFIX, keep_last


@dataclass
class SFTResult:
    """Outcome of run_sft: where the adapter is, the per-step losses and timings."""

    adapter_dir: str
    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    seconds_per_step: float = 0.0
    train_tokens: int = 0
    epochs: list[dict] = field(default_factory=list)
    """Per epoch: held-out extraction metrics (`extraction_metrics`) after it, and the step."""
    best_epoch: int = 0
    planned_steps: int = 0
    """Optimizer steps the epochs asked for; more than `steps` when the time budget stopped SFT."""

    def to_dict(self) -> dict:
        return asdict(self)


def sft_arguments(sft_cfg: SFTConfig, policy, out_dir: Path, max_steps: int | None, seed: int):
    """TRL SFTConfig for our setup: CPU-safe (use_cpu, no gradient checkpointing), bf16 when the policy
    runs in bf16, completion-only loss, no checkpoints or reporting (the caller saves the adapter)."""
    from trl import SFTConfig as TRLSFTConfig

    on_cpu = policy.device.type == "cpu"
    micro = min(sft_cfg.micro_batch_size, sft_cfg.batch_size)  # SFTConfig checked that micro divides the batch
    return TRLSFTConfig(
        output_dir=str(out_dir / "trainer"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=sft_cfg.batch_size // micro,
        num_train_epochs=sft_cfg.epochs,
        max_steps=max_steps or sft_cfg.max_steps or -1,
        learning_rate=sft_cfg.learning_rate,
        lr_scheduler_type="constant",  # runs are a few dozen steps: no step is spent at a warmup lr of 0
        max_length=sft_cfg.max_length,  # None: no truncation (build_demonstrations already dropped longer pairs)
        completion_only_loss=True,  # prompt tokens carry no loss
        use_cpu=on_cpu,
        bf16=policy.dtype is torch.bfloat16,
        gradient_checkpointing=False,  # TRL's default is on; on CPU it only costs time
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        disable_tqdm=True,
    )


def shared_prefix_length(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """Leading columns identical and unpadded in every row: the system prompt that all writer
    demonstrations share."""
    if input_ids.shape[0] < 2:
        return 0
    same = (input_ids == input_ids[:1]).all(0)
    if attention_mask is not None:
        same &= attention_mask.bool().all(0)
    differing = (~same).nonzero()
    return int(differing[0]) if len(differing) else input_ids.shape[1]


def completion_loss(model, inputs: dict, normalizer: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Summed next-token cross-entropy over the labelled (completion) tokens divided by `normalizer`
    (else their count), with logits computed only from the earliest labelled position on. Returns
    (loss, labelled tokens, correctly predicted tokens).

    A prefix shared by every row (the writer's system prompt, about a third of a demonstration) runs
    forward once, with gradient, and its KV cache is repeated for the rows: the same loss and gradients
    as running each row whole, for less compute."""
    input_ids, labels, attention_mask = inputs["input_ids"], inputs["labels"], inputs.get("attention_mask")
    labelled = labels != -100
    first = int(labelled.any(0).nonzero()[0])  # TRL drops examples without completion tokens
    keep = labels.shape[1] - first + 1
    shared = min(shared_prefix_length(input_ids, attention_mask), first - 1)  # logits from first-1 on stay in the rest
    if shared >= MIN_SHARED_PREFIX:
        rows, width = input_ids.shape
        cache = model(input_ids=input_ids[:1, :shared], use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(rows)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        positions = torch.arange(shared, width, device=input_ids.device).expand(rows, -1)
        out = model(input_ids=input_ids[:, shared:], attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=keep_last(keep, width - shared, input_ids.device))
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    logits_to_keep=keep_last(keep, input_ids.shape[1], input_ids.device))
    logits = out.logits[:, :-1].float()  # positions first-1 .. L-2 predict labels first .. L-1
    targets = labels[:, first:]
    loss_sum = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="sum")
    count = int(labelled.sum())
    correct = int(((logits.argmax(-1) == targets) & (targets != -100)).sum())
    denominator = normalizer if normalizer is not None else count
    return loss_sum / torch.as_tensor(denominator).clamp(min=1), count, correct


def _completion_only_trainer(tokens_per_row: int):
    """TRL's SFTTrainer with a cheaper loss: its fused LM head scores every position in fp32 on CPU (no
    Triton), so a step of 850-token demonstrations spends most of its time on prompt positions whose loss
    is masked anyway. Data handling, the loop, logging and the optimizer stay TRL's.

    The loss is the completion tokens' summed cross-entropy over a fixed length, rows of the optimizer
    batch x `tokens_per_row` (the completion budget), not over the batch's own token count: with the
    latter a batch of short NOTHING_TO_STORE demonstrations gets a per-token weight many times that of a
    batch of writes, and at a 192-token budget the warm start learned to skip every chunk (like Dr.
    GRPO's fixed length in the GRPO loss, docs/TRAINING.md)."""
    from trl import SFTTrainer

    class CompletionOnlySFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # with num_items_in_batch the Trainer leaves the gradient-accumulation average to the loss
            rows = self.args.per_device_train_batch_size * (
                self.args.gradient_accumulation_steps if num_items_in_batch is not None else 1)
            summed, count, correct = completion_loss(model, inputs, normalizer=1)
            loss = summed / (rows * tokens_per_row)
            mode = "train" if model.training else "eval"
            self._metrics[mode]["mean_token_accuracy"].append(correct / count if count else 0.0)
            self._metrics[mode]["token_loss"].append(float(summed.detach()) / max(count, 1))
            if mode == "train" and "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum())
                self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
            return (loss, None) if return_outputs else loss

    return CompletionOnlySFTTrainer


def run_sft(
    policy,
    demos: list[Demonstration],
    out_dir: str | Path,
    sft_cfg: SFTConfig,
    *,
    max_steps: int | None = None,
    seed: int = 0,
    on_log: Callable[[dict], None] | None = None,
    probes: list[Probe] | None = None,
    max_new_tokens: int = 96,
    deadline: float | None = None,
) -> SFTResult:
    """Train the policy's LoRA adapter on the demonstrations with TRL's SFTTrainer and save it.

    `max_steps` (else `sft_cfg.max_steps`, else the full `sft_cfg.epochs`) bounds the optimizer steps.

    The policy is already wrapped with the LoRA config of `ModelConfig` (see load_policy), so the trainer
    gets the PeftModel itself and updates only the adapter; the adapter (safetensors) is saved to
    `out_dir` and the policy keeps the trained weights. Loss is on the completion tokens only.

    With `probes`, held-out extraction (`extraction_metrics`) is measured after every epoch and logged as
    `sft_eval/*`; training stops once evidence recall has not improved by `sft.min_delta` for
    `sft.patience` epochs, and the adapter of the best epoch is the one kept.

    With `deadline` (a `time.time()`), training stops after the step past which another would end later
    (the held-out check of the epoch still runs).
    """
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    if not demos:
        raise ValueError("no demonstrations to train on")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.from_list([{"prompt": d.prompt, "completion": d.completion} for d in demos])
    losses: list[float] = []
    epochs: list[dict] = []
    best: dict = {"recall": -1.0, "epoch": 0, "weights": None}

    class _Record(TrainerCallback):
        began = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = time.time()
            if on_log is not None:  # lets a progress line time the first step
                on_log({"step": state.global_step, "max_steps": state.max_steps})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "token_loss" in logs:
                losses.append(float(logs["token_loss"]))  # per completion token, comparable across budgets
            if logs and on_log is not None:
                on_log({"step": state.global_step, "max_steps": state.max_steps, "deadline": deadline, **logs})

        def on_step_end(self, args, state, control, **kwargs):
            if step_would_overrun(deadline, (time.time() - self.began) / max(state.global_step, 1)):
                control.should_training_stop = True

        def on_epoch_end(self, args, state, control, **kwargs):
            if not probes:
                return
            metrics = extraction_metrics(policy, probes, max_new_tokens)
            epoch = len(epochs) + 1
            epochs.append({"epoch": epoch, "step": state.global_step, **metrics})
            if on_log is not None:
                on_log({"step": state.global_step, "max_steps": state.max_steps, "epoch": epoch,
                        **{f"sft_eval/{k}": v for k, v in metrics.items()}})
            if metrics["evidence_recall"] > best["recall"] + sft_cfg.min_delta:
                best.update(recall=metrics["evidence_recall"], epoch=epoch,
                            weights={k: v.detach().clone() for k, v in policy.model.named_parameters() if v.requires_grad})
            elif epoch - best["epoch"] >= sft_cfg.patience:
                control.should_training_stop = True  # a plateau: more epochs only fit the teacher's wording

    trainer = _completion_only_trainer(max_new_tokens + 1)(  # + the end-of-turn token
        model=policy.model,
        args=sft_arguments(sft_cfg, policy, out_dir, max_steps, seed),
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        callbacks=[_Record()],
    )
    trainer.remove_callback(PrinterCallback)  # progress goes through on_log
    start = time.perf_counter()
    policy.model.train()
    try:
        output = trainer.train()
    finally:
        policy.model.eval()
        policy.tokenizer.padding_side = "left"  # generation needs left padding again
    seconds = time.perf_counter() - start
    if best["weights"] is not None and best["epoch"] != len(epochs):
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if name in best["weights"]:
                    param.copy_(best["weights"][name])
    policy.save_adapter(out_dir)
    steps = int(output.global_step)
    result = SFTResult(
        adapter_dir=str(out_dir),
        steps=steps,
        losses=losses,
        seconds=seconds,
        seconds_per_step=seconds / max(steps, 1),
        train_tokens=sum(d.prompt_tokens + d.completion_tokens for d in demos),
        epochs=epochs,
        best_epoch=best["epoch"],
        planned_steps=int(trainer.state.max_steps),
    )
    (out_dir / "sft_result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result
