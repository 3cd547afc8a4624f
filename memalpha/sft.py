"""Warm start: rule-writer demonstrations and a LoRA SFT stage with TRL's SFTTrainer.

The untrained 135M policy writes prose, never tool calls; a short SFT on the rule writer's outputs
teaches it the JSON-lines format before GRPO. Demonstrations are built exactly as rollouts see chunks:
the rule writer runs over each training instance with an evolving memory, and each prompt is
the prompt of a memalpha.episode over that instance. DAgger rounds (`run_dagger`) then label the memories
the policy builds itself, which rule-writer demonstrations never show it.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memalpha.config import RunConfig, SFTConfig, step_would_overrun
from memalpha.data.schema import Instance
from memalpha.episode import Episode
from memalpha.errors import UserError
from memalpha.generation import MIN_SHARED_PREFIX, generate, keep_last
from memalpha.memory.schema import MemorySchema
from memalpha.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.rewards import is_entry_update, mentions
from memalpha.rule_writer import rule_writer_for
from memalpha.text import keeps_subject
from memalpha.tokens import tokenizer_counter
from memalpha.tools import call_line, text_argument


SOUP_MEMBERS = "members"
"""Folder of a warm start's averaged adapters (`sft.soup_seeds`), one seed-N folder each."""


@dataclass
class Demonstration:
    """One prompt/completion pair (prompt: the rendered writer prompt; completion: JSON lines)."""

    prompt: str
    completion: str
    instance_id: str
    chunk_index: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def nothing_to_store(self) -> bool:
        return self.completion.strip() == NOTHING_TO_STORE

    updates_entry: bool = False
    """The completion rewrites a stored list entry (what a conflicting chunk needs)."""


@dataclass
class DemoStats:
    """What build_demonstrations saw and kept, added up over the calls that share it."""

    chunks: int = 0
    kept: int = 0
    nothing_to_store: int = 0
    updates: int = 0
    too_long: int = 0
    calls_ok: float = 0.0
    """Share of the calls that executed, of the writer that advanced the episodes (rule writer or policy)."""


def demonstration_max_length(config: RunConfig) -> int:
    """`sft.max_length`, else the longest writer step a rollout takes (prompt budget + completion budget)."""
    return config.sft.max_length or config.rollout.max_prompt_tokens + config.rollout.max_completion_length


def build_demonstrations(
    instances: list[Instance],
    config: RunConfig,
    tokenizer,
    *,
    count: int | None = None,
    nothing_share: float | None = None,
    update_share: float | None = None,
    seed: int = 0,
    stats: DemoStats | None = None,
) -> list[Demonstration]:
    """Rule-writer demonstrations for the chunks of `instances`, as prompt/completion pairs.

    Completions are cut to `rollout.max_completion_length` tokens (what a rollout may generate), pairs
    longer than `demonstration_max_length` are dropped (truncation would cut the completion), and a sample of
    `count` (default `sft.num_demonstrations`) is drawn with `nothing_share` (default
    `sft.nothing_to_store_share`) of NOTHING_TO_STORE chunks
    (when there are enough), so the model learns to skip small talk without learning to skip everything.
    With `update_share` (default `sft.update_share`) above 0, at least that share are chunks where the
    rule writer updates a stored entry (conflicts are rarer than new facts).
    """
    return _labelled_sample(
        instances, None, config, tokenizer, stats,
        count=config.sft.num_demonstrations if count is None else count,
        nothing_share=config.sft.nothing_to_store_share if nothing_share is None else nothing_share,
        update_share=config.sft.update_share if update_share is None else update_share,
        seed=seed,
    )


def label_policy_states(
    instances: list[Instance],
    policy_completions: list[list[str]],
    config: RunConfig,
    tokenizer,
    *,
    count: int,
    seed: int = 0,
    stats: DemoStats | None = None,
) -> list[Demonstration]:
    """DAgger labels (Ross et al., 2011): the memory states a policy reached, each with the rule writer's
    completion for that state.

    `policy_completions[i]` holds what the policy wrote for the chunks of `instances[i]`, in order; the
    episode is replayed with them, and before each chunk the rule writer says what it would write on the
    memory the policy had built (small talk it stored, facts it missed, values it overwrote). Sampled like
    `build_demonstrations` (`count`, `sft.nothing_to_store_share`, `sft.update_share`)."""
    return _labelled_sample(instances, policy_completions, config, tokenizer, stats, count=count,
                            nothing_share=config.sft.nothing_to_store_share, update_share=config.sft.update_share,
                            seed=seed)


def _labelled_sample(instances: list[Instance], policy_completions: list[list[str]] | None, config: RunConfig,
                     tokenizer, stats: DemoStats | None, *, count: int, nothing_share: float, update_share: float,
                     seed: int) -> list[Demonstration]:
    """Label the states (`_label_states`) and draw `count` demonstrations: `nothing_share` of them skips
    (topped up with writes when skips run short, and the other way round) and at least `update_share`
    entry updates among the writes, shuffled; `stats` records what was seen and kept."""
    stats = stats if stats is not None else DemoStats()
    store_demos, skip_demos = _label_states(instances, policy_completions, config, tokenizer, stats)
    rng = random.Random(seed)
    n_skip = min(len(skip_demos), round(count * nothing_share))
    n_store = min(len(store_demos), count - n_skip)
    n_skip = min(len(skip_demos), count - n_store)  # top up with skips when writes run short
    update_demos = [d for d in store_demos if d.updates_entry]
    n_update = min(len(update_demos), n_store, round(count * update_share))
    updates = rng.sample(update_demos, n_update)
    taken = {id(d) for d in updates}
    chosen = updates + rng.sample([d for d in store_demos if id(d) not in taken], n_store - n_update)
    chosen += rng.sample(skip_demos, n_skip)
    rng.shuffle(chosen)
    stats.kept += len(chosen)
    stats.nothing_to_store += sum(d.nothing_to_store for d in chosen)
    stats.updates += sum(d.updates_entry for d in chosen)
    return chosen


def _updates_entry(completion: str, schema: MemorySchema) -> bool:
    """`completion` calls memory_update on a list section."""
    lists = {spec.name for spec in schema.list_sections}
    return any(call.name == "memory_update" and call.arguments.get("memory_type") in lists
               for call in parse_tool_calls(completion).calls)


def answer_writes_only(completion: str, instance: Instance, schema: MemorySchema) -> str:
    """The calls of `completion` whose text holds a gold or superseded answer of one of `instance`'s
    questions (deletes are kept), in order; NOTHING_TO_STORE when none is left. Superseded answers count:
    a value that changes later has to be stored before it can be updated."""
    answers = [a for q in instance.questions for a in (*q.answers, *q.superseded_answers)]
    kept = [call_line(schema, call.name, call.arguments) for call in parse_tool_calls(completion).calls
            if call.name == "memory_delete"
            or any(mentions(str(call.arguments.get(text_argument(call.name, schema), "")), a) for a in answers)]
    return "\n".join(kept) if kept else NOTHING_TO_STORE


def _label_states(instances: list[Instance], policy_completions: list[list[str]] | None, config: RunConfig, tokenizer,
                  stats: DemoStats) -> tuple[list[Demonstration], list[Demonstration]]:
    """Walk each instance's episode, labelling the state before every chunk with the rule writer's
    completion; the episode advances by that label (None) or by `policy_completions[i]`. Returns the
    writes and the skips that fit `demonstration_max_length`; `stats` counts chunks, drops and the share of
    the advancing calls that executed."""
    counter = tokenizer_counter(tokenizer)
    schema = config.memory.schema()
    writer = rule_writer_for(config, counter)
    max_length = demonstration_max_length(config)
    store_demos: list[Demonstration] = []
    skip_demos: list[Demonstration] = []
    results_ok: list[bool] = []
    if policy_completions is not None and len(policy_completions) != len(instances):
        raise ValueError(f"completions for {len(policy_completions)} instances, {len(instances)} instances given")
    for i, instance in enumerate(instances):
        episode = Episode(instance, schema, config.memory, config.retrieval, counter, tokenizer)
        written = None if policy_completions is None else policy_completions[i]
        if written is not None and len(written) != len(instance.chunks):
            raise ValueError(f"{instance.instance_id}: {len(written)} completions for {len(instance.chunks)} chunks")
        while not episode.done:
            prompt = episode.prompt()
            label = writer.write(episode.chunk_text, episode.store, episode.visible_ids())
            if config.sft.demonstration_writes == "answers":
                label = answer_writes_only(label, instance, schema)
            demo = Demonstration(prompt, label, instance.instance_id, episode.position,
                                 counter(prompt), counter(label) + 1,  # + the end-of-turn token
                                 _updates_entry(label, schema))
            stats.chunks += 1
            if demo.prompt_tokens + demo.completion_tokens > max_length:
                stats.too_long += 1
            else:
                (skip_demos if demo.nothing_to_store else store_demos).append(demo)
            step = episode.step(label if written is None else written[episode.position])
            results_ok.extend(r.ok for r in step.results)
    stats.calls_ok = sum(results_ok) / len(results_ok) if results_ok else 0.0
    return store_demos, skip_demos


def policy_state_demonstrations(policy, instances: list[Instance], config: RunConfig, *, count: int, seed: int = 0,
                                stats: DemoStats | None = None,
                                on_batch: Callable[[int, int], None] | None = None) -> list[Demonstration]:
    """`count` DAgger demonstrations: the policy writes instances drawn from `instances` (seeded) greedily,
    as it is evaluated, in batches of `eval.batch_size`, until their chunks number `count`, and
    `label_policy_states` labels the states it visited. `on_batch(written, drawn)` follows the batches."""
    from memalpha.rollout import write_unasked

    drawn: list[Instance] = []
    for instance in random.Random(seed).sample(instances, len(instances)):
        if sum(len(i.chunks) for i in drawn) >= count:
            break
        drawn.append(instance)
    completions: list[list[str]] = []
    if on_batch is not None:
        on_batch(0, len(drawn))
    for written, _ in write_unasked(policy, drawn, config, batch_size=config.eval.batch_size):
        completions.extend([s.completion for s in w.samples] for w in written)
        if on_batch is not None:
            on_batch(len(completions), len(drawn))
    return label_policy_states(drawn, completions, config, policy.tokenizer, count=count, seed=seed, stats=stats)


@dataclass
class Probe:
    """A held-out writer step: the episode just before a chunk, as the rule writer left it."""

    episode: Episode
    holds_evidence: bool


def extraction_probes(instances: list[Instance], config: RunConfig, tokenizer, count: int) -> list[Probe]:
    """Up to `count` held-out chunks (evidence and no-evidence chunks in the data's proportion, spread over
    the instances), each with the memory the rule writer built before it."""
    counter = tokenizer_counter(tokenizer)
    schema = config.memory.schema()
    writer = rule_writer_for(config, counter)
    probes: list[Probe] = []
    for instance in instances:
        episode = Episode(instance, schema, config.memory, config.retrieval, counter, tokenizer)
        while not episode.done:
            probes.append(Probe(episode.copy(), bool(episode.relevant_questions[episode.position])))
            episode.step(writer.write(episode.chunk_text, episode.store, episode.visible_ids()))
    random.Random(0).shuffle(probes)
    return probes[:count]


@dataclass
class ProbeScore:
    """What one greedy output on a held-out chunk did (see `extraction_metrics`)."""

    valid: bool
    skip_correct: bool
    recall: float | None
    """Mean support of the chunk's gold facts; None for a chunk without evidence."""
    updates: int
    aimed: int


def score_probe(probe: Probe, completion: str) -> ProbeScore:
    """Step `completion` on a copy of the probe's memory and score it."""
    step = probe.episode.copy().step(completion)
    skipped = step.parse.nothing_to_store
    list_updates = [r for r in step.results if is_entry_update(r)]
    return ProbeScore(
        valid=not step.parse.errors and (skipped or bool(step.parse.calls)),
        skip_correct=skipped != probe.holds_evidence,
        recall=sum(step.support.values()) / len(step.support) if probe.holds_evidence else None,
        updates=len(list_updates),
        aimed=sum(keeps_subject(r.previous_content or "", r.content or "") for r in list_updates),
    )


def extraction_metrics(policy, probes: list[Probe], max_new_tokens: int) -> dict[str, float]:
    """Greedy outputs on held-out chunks: `valid_calls` (share of outputs that parse whole: calls or an
    explicit skip), `evidence_recall` (mean coverage support of the gold facts of evidence chunks),
    `skip_accuracy` (share of chunks where the writer skipped exactly when the chunk holds no evidence),
    `updates` (list-entry updates a chunk) and `update_aim` (share of them that keep the subject of the entry
    they replace, `text.keeps_subject`; 1 when there were none, as none missed)."""
    tokenizer = policy.tokenizer
    ids = [tokenizer(p.episode.prompt(), add_special_tokens=False)["input_ids"] for p in probes]
    eos = [tokenizer.eos_token_id] + ([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.no_grad():
            out = generate(policy.model, ids, max_new_tokens=max_new_tokens, eos_token_ids=eos,
                           pad_token_id=tokenizer.pad_token_id, greedy=True)
    finally:
        policy.model.train(was_training)
    scores = [score_probe(p, tokenizer.decode(c, skip_special_tokens=True)) for p, c in zip(probes, out.completion_ids)]
    recalls = [s.recall for s in scores if s.recall is not None]
    updates = sum(s.updates for s in scores)
    n = max(len(scores), 1)
    return {"valid_calls": sum(s.valid for s in scores) / n, "evidence_recall": sum(recalls) / max(len(recalls), 1),
            "skip_accuracy": sum(s.skip_correct for s in scores) / n, "updates": updates / n,
            "update_aim": sum(s.aimed for s in scores) / updates if updates else 1.0}


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
    rounds: list[dict] = field(default_factory=list)
    """Per DAgger round (`run_dagger`): its demonstrations, SFT steps and seconds."""
    members: list[dict] = field(default_factory=list)
    """Per averaged warm start (`sft.soup_seeds` > 1): its seed and result, losses left out (they are in `losses`)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def soup(cls, adapter_dir: str, members: list[tuple[int, SFTResult]], held_out: dict | None = None) -> SFTResult:
        """The result of averaged warm starts, (seed, result) each: steps, losses and held-out epochs one after
        another (each epoch tagged with its `member` seed); `held_out`, the average's extraction, closes
        `epochs` tagged `soup` and is the best epoch, as its adapter is the one kept."""
        epochs: list[dict] = []
        steps, seconds = 0, 0.0
        for seed, member in members:
            epochs += [{**e, "epoch": e["epoch"] + len(epochs), "step": e["step"] + steps, "member": seed}
                       for e in member.epochs]
            steps += member.steps
            seconds += member.seconds
        if held_out is not None:
            epochs.append({"epoch": len(epochs) + 1, "step": steps, "soup": len(members), **held_out})
        return cls(
            adapter_dir=adapter_dir, steps=steps, losses=[x for _, m in members for x in m.losses], seconds=seconds,
            seconds_per_step=seconds / max(steps, 1), train_tokens=sum(m.train_tokens for _, m in members),
            epochs=epochs, best_epoch=len(epochs) if held_out is not None else 0,
            members=[{"seed": seed, **{k: v for k, v in m.to_dict().items() if k != "losses"}} for seed, m in members],
        )

    def followed_by(self, later: SFTResult, round_info: dict) -> SFTResult:
        """This result with a later SFT stage on the same adapter appended (steps and epochs continue)."""
        epochs = [{**e, "epoch": e["epoch"] + len(self.epochs), "step": e["step"] + self.steps,
                   "round": round_info["round"]} for e in later.epochs]
        steps = self.steps + later.steps
        seconds = self.seconds + later.seconds
        return SFTResult(
            adapter_dir=later.adapter_dir, steps=steps, losses=self.losses + later.losses, seconds=seconds,
            seconds_per_step=seconds / max(steps, 1), train_tokens=self.train_tokens + later.train_tokens,
            epochs=self.epochs + epochs,
            best_epoch=later.best_epoch + len(self.epochs) if later.best_epoch else self.best_epoch,
            rounds=self.rounds + [{**round_info, "steps": later.steps, "seconds": round(later.seconds, 1)}],
        )


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
                on_log({"step": state.global_step, "max_steps": state.max_steps, **logs})

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
    )
    (out_dir / "sft_result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def run_dagger(policy, instances: list[Instance], config: RunConfig, out_dir: str | Path, first: SFTResult, *,
               on_log: Callable[[dict], None] | None = None, probes: list[Probe] | None = None,
               deadline: float | None = None, base_seed: int | None = None) -> SFTResult:
    """`sft.dagger_rounds` rounds after the first SFT stage (`first`). Each labels memory states the
    current policy reaches on `instances` (`policy_state_demonstrations`), adds `sft.dagger_mix` of fresh
    rule-writer demonstrations (DAgger's aggregated data, sampled: `sft.dagger_demonstrations` in all),
    and trains one epoch on them at `sft.dagger_learning_rate`, like `run_sft`, into `out_dir`.

    Rule-writer demonstrations show only the rule writer's own memories; greedy, the warm start then
    stores small talk and misses facts on its own (docs/TRAINING.md). A round starts only before
    `deadline`. Round k draws with `base_seed` + k (default `grpo.seed`). Returns `first` with the rounds appended
    (also written to `out_dir`/sft_result.json)."""
    cfg = config.sft
    round_cfg = cfg.model_copy(update={"epochs": 1.0, "max_steps": 0,
                                       "learning_rate": cfg.dagger_learning_rate or cfg.learning_rate})
    from_rule_writer = round(cfg.dagger_demonstrations * cfg.dagger_mix)
    result = first
    base_seed = config.grpo.seed if base_seed is None else base_seed
    for round_ in range(1, cfg.dagger_rounds + 1):
        if deadline is not None and time.time() >= deadline:
            break
        seed = base_seed + round_
        stats = DemoStats()
        began = time.perf_counter()
        demos = policy_state_demonstrations(
            policy, instances, config, count=cfg.dagger_demonstrations - from_rule_writer, seed=seed, stats=stats,
            on_batch=on_log and (lambda written, drawn, r=round_: on_log(
                {"dagger_round": r, "instances_written": written, "instances": drawn})))
        labelled_s = time.perf_counter() - began
        if from_rule_writer:  # the trainer's sampler shuffles them together
            demos += build_demonstrations(instances, config, policy.tokenizer, count=from_rule_writer, seed=seed)
        later = run_sft(policy, demos, out_dir, round_cfg, seed=seed, on_log=_continuing(on_log, result), probes=probes,
                        max_new_tokens=config.rollout.max_completion_length, deadline=deadline)
        result = result.followed_by(later, {
            "round": round_, "demonstrations": len(demos), "policy_states": stats.kept,
            "nothing_to_store": sum(d.nothing_to_store for d in demos), "updates": sum(d.updates_entry for d in demos),
            "policy_calls_ok": round(stats.calls_ok, 3), "label_seconds": round(labelled_s, 1)})
    (Path(out_dir) / "sft_result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def train_adapter(policy, instances: list[Instance], config: RunConfig, out_dir: str | Path, *, seed: int,
                  probes: list[Probe] | None = None, on_log: Callable[[dict], None] | None = None,
                  deadline: float | None = None, stats: DemoStats | None = None) -> SFTResult:
    """One warm start of the policy's current adapter into `out_dir`: `sft.num_demonstrations` rule-writer
    demonstrations drawn with `seed`, `run_sft`, then `sft.dagger_rounds` rounds (`run_dagger`)."""
    demos = build_demonstrations(instances, config, policy.tokenizer, seed=seed, stats=stats)
    if not demos:
        raise UserError(f"no demonstration fits sft.max_length={demonstration_max_length(config)} tokens; "
                        "raise it or use shorter chunks")
    result = run_sft(policy, demos, out_dir, config.sft, seed=seed, on_log=on_log, probes=probes,
                     max_new_tokens=config.rollout.max_completion_length, deadline=deadline)
    if config.sft.dagger_rounds:
        result = run_dagger(policy, instances, config, out_dir, result, on_log=on_log, probes=probes,
                            deadline=deadline, base_seed=seed)
    return result


def train_warm_start(policy, instances: list[Instance], config: RunConfig, out_dir: str | Path, *,
                     probes: list[Probe] | None = None, on_log: Callable[[dict], None] | None = None,
                     deadline: float | None = None, stats: DemoStats | None = None) -> SFTResult:
    """The warm start into `out_dir`: `train_adapter` on the policy with seed `grpo.seed`; or, with
    `sft.soup_seeds` > 1, once per seed from `grpo.seed` on, each on its own policy as `load_policy` gives it
    for that seed (so a member is the warm start that seed alone trains) into out_dir/members/seed-N with an
    equal share of the time left before `deadline`, then their average (`average_adapters`), measured on
    `probes`. The policy (of layout `config.trained_model()`) ends with the warm-start adapter; `stats`
    adds up every member's demonstrations."""
    from memalpha.models.policy import average_adapters, load_policy

    seeds = [config.grpo.seed + i for i in range(config.sft.soup_seeds)]
    if len(seeds) == 1:
        return train_adapter(policy, instances, config, out_dir, seed=seeds[0], probes=probes, on_log=on_log,
                             deadline=deadline, stats=stats)
    out_dir = Path(out_dir)
    members: list[tuple[int, SFTResult]] = []
    for i, seed in enumerate(seeds):
        share = None if deadline is None else time.time() + (deadline - time.time()) / (len(seeds) - i)
        so_far = SFTResult.soup(str(out_dir), members)
        member = train_adapter(load_policy(config.model, seed=seed), instances, config,
                               out_dir / SOUP_MEMBERS / f"seed-{seed}", seed=seed, probes=probes,
                               on_log=_continuing(on_log, so_far), deadline=share, stats=stats)
        members.append((seed, member))
    average_adapters([m.adapter_dir for _, m in members], out_dir)
    policy.load_adapter(out_dir)
    held_out = extraction_metrics(policy, probes, config.rollout.max_completion_length) if probes else None
    result = SFTResult.soup(str(out_dir), members, held_out)
    if held_out is not None and on_log is not None:
        on_log({"step": result.steps, "max_steps": result.steps, "epoch": len(result.epochs),
                **{f"sft_eval/{k}": v for k, v in held_out.items()}})
    (out_dir / "sft_result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def _continuing(on_log: Callable[[dict], None] | None, earlier: SFTResult) -> Callable[[dict], None] | None:
    """`on_log` for a later SFT stage: its steps and held-out epochs numbered after `earlier`'s."""
    if on_log is None:
        return None

    def log(record: dict) -> None:
        shifted = {**record, "step": record.get("step", 0) + earlier.steps,
                   "max_steps": record.get("max_steps", 0) + earlier.steps}
        if isinstance(record.get("epoch"), int):  # run_sft's held-out check (TRL's own epoch is a float)
            shifted["epoch"] = record["epoch"] + len(earlier.epochs)
        on_log(shifted)

    return log
