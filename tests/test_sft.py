"""Warm start: demonstrations are built like rollout prompts; SFT on the tiny model learns them."""

from __future__ import annotations

import json
import time

import pytest
import torch

from memalpha.config import load_config
from memalpha.data.synth import SynthConfig, generate
from memalpha.env.episode import Episode
from memalpha.env.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.env.prompts import render_writer_prompt
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.memory.views import view_ids, writer_view
from memalpha.models.policy import load_policy
from memalpha.teacher.demonstrations import (
    Demonstration,
    DemoStats,
    build_demonstrations,
    demonstration_max_length,
)
from memalpha.teacher.probes import extraction_probes, score_probe
from memalpha.teacher.rule_writer import RuleWriter
from memalpha.teacher.sft import run_sft

OVERRIDES = ["model.policy=tiny", "model.dtype=float32", "model.device=cpu", "sft.max_length=768", "sft.batch_size=4"]


@pytest.fixture(scope="module")
def config():
    return load_config(None, OVERRIDES)


@pytest.fixture(scope="module")
def instances():
    return generate(SynthConfig(instances=8, chunks_per_instance=(4,), chunk_tokens=128, seed=3))


def test_demonstrations_match_rollout_prompts(config, instances):
    policy = load_policy(config.model)
    stats = DemoStats()
    demos = build_demonstrations(instances, config, policy.tokenizer, count=12, stats=stats)
    assert len(demos) == 12 == stats.kept and stats.chunks == sum(len(i.chunks) for i in instances) and stats.calls_ok == 1.0
    skipped = [d for d in demos if d.nothing_to_store]
    assert len(skipped) == 3  # the requested 25% share of small-talk chunks
    by_id = {i.instance_id: i for i in instances}
    for demo in demos:
        assert demo.prompt_tokens + demo.completion_tokens <= config.sft.max_length
        assert demo.completion_tokens <= config.rollout.max_completion_length + 1
        parsed = parse_tool_calls(demo.completion)
        assert parsed.nothing_to_store or (parsed.calls and not parsed.errors)
        # replaying the rule writer's own outputs up to this chunk reproduces the prompt exactly
        episode = Episode(by_id[demo.instance_id], MEMALPHA_SCHEMA, config.memory, config.retrieval,
                          policy.count_tokens, policy.tokenizer)
        writer = RuleWriter(MEMALPHA_SCHEMA, max_completion_tokens=config.rollout.max_completion_length, count_tokens=policy.count_tokens)
        for _ in range(demo.chunk_index):
            prompt = render_writer_prompt(policy.tokenizer, MEMALPHA_SCHEMA, writer_view(
                episode.store, episode.chunk_text, episode.index.search, config.memory.writer_view_tokens,
                config.memory.writer_newest_entries, config.memory.writer_relevant_entries), episode.chunk_text)
            assert episode.prompt() == prompt
            episode.step(writer.write(episode.chunk_text, episode.store, view_ids(prompt)))
        assert demo.prompt == episode.prompt()


def test_demonstrations_drop_pairs_that_would_be_truncated(instances):
    config = load_config(None, OVERRIDES + ["sft.max_length=300"])
    policy = load_policy(config.model)
    stats = DemoStats()
    demos = build_demonstrations(instances, config, policy.tokenizer, count=50, stats=stats)
    assert stats.too_long > 0
    assert all(d.prompt_tokens + d.completion_tokens <= 300 for d in demos)


def test_without_a_cap_demonstrations_keep_every_step_a_rollout_takes(instances):
    # a fixed cap below the rollout's budgets dropped the later chunks' writes (longer memory views) and
    # kept their skips: the warm start then skipped every chunk that had a memory
    config = load_config(None, [o for o in OVERRIDES if not o.startswith("sft.max_length")]
                         + ["rollout.max_prompt_tokens=600", "rollout.max_completion_length=40"])
    assert config.sft.max_length is None and demonstration_max_length(config) == 640
    policy = load_policy(config.model)
    stats = DemoStats()
    demos = build_demonstrations(instances, config, policy.tokenizer, count=50, stats=stats)
    assert stats.too_long == 0 and stats.kept == stats.chunks
    longest = max(d.prompt_tokens + d.completion_tokens for d in demos)
    capped = config.model_copy(update={"sft": config.sft.model_copy(update={"max_length": longest - 1})})
    stats = DemoStats()
    build_demonstrations(instances, capped, policy.tokenizer, count=50, stats=stats)
    assert stats.too_long >= 1 and stats.kept == stats.chunks - stats.too_long


def _short_demos(policy) -> list[Demonstration]:
    """Short prompt/completion pairs in the rollout format (the tiny model's 49K-token vocabulary makes
    long sequences slow on a shared CPU)."""
    facts = [("Maya", "Lisbon"), ("Omar", "Porto"), ("Ines", "Graz"), ("Luca", "Perth")]
    demos = []
    for i, (name, city) in enumerate(facts):
        prompt = policy.render_chat([{"role": "user", "content": f"New chunk:\n{name}: I live in {city}."}])
        completion = json.dumps({"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": f"{name} lives in {city}."}})
        demos.append(Demonstration(prompt, completion, "demo", i, policy.count_tokens(prompt), policy.count_tokens(completion) + 1))
    return demos


def test_sft_on_tiny_model_reduces_loss_and_saves_adapter(tmp_path, config):
    policy = load_policy(config.model)
    demos = _short_demos(policy)
    sft_cfg = config.sft.model_copy(update={"learning_rate": 5e-3, "batch_size": 4})
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    result = run_sft(policy, demos, tmp_path / "warm", sft_cfg, max_steps=8)
    assert result.steps == 8 and len(result.losses) == 8
    assert result.losses[-1] < result.losses[0] - 0.25  # same batch each step: a real decrease, not noise
    # only the adapter moved, and it was saved as safetensors
    changed = [n for n, p in policy.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert (tmp_path / "warm" / "adapter_model.safetensors").is_file()
    saved = json.loads((tmp_path / "warm" / "sft_result.json").read_text())
    assert saved["steps"] == 8
    # the saved adapter reproduces the trained policy; generation still works (left padding restored)
    reloaded = load_policy(config.model, adapter=tmp_path / "warm")
    batch = policy.encode([demos[0].prompt])
    with torch.no_grad():
        assert torch.allclose(policy.model(**batch).logits, reloaded.model(**batch).logits, atol=1e-5)
    assert policy.tokenizer.padding_side == "left"
    assert len(policy.generate_text([demos[0].prompt], max_new_tokens=3)) == 1


def test_completion_only_loss_ignores_the_prompt(tmp_path, config, instances):
    """The prepared training rows carry labels on the completion (and the end-of-turn token) only."""
    from trl import SFTTrainer

    policy = load_policy(config.model)
    demos = build_demonstrations(instances, config, policy.tokenizer, count=2)
    from datasets import Dataset

    from memalpha.teacher.sft import sft_arguments

    trainer = SFTTrainer(
        model=policy.model,
        args=sft_arguments(config.sft, policy, tmp_path, 1, 0),
        train_dataset=Dataset.from_list([{"prompt": d.prompt, "completion": d.completion} for d in demos]),
        processing_class=policy.tokenizer,
    )
    row = trainer.train_dataset[0]
    labelled = [t for t, m in zip(row["input_ids"], row["labels"]) if m != -100]
    completion = policy.tokenizer(demos[0].completion, add_special_tokens=False)["input_ids"]
    assert labelled[: len(completion)] == completion  # exactly the completion (then the end-of-turn token)
    assert len(labelled) == len(completion) + 1


def test_micro_batches_accumulate_to_the_batch(tmp_path, config):
    policy = load_policy(config.model)
    from memalpha.teacher.sft import sft_arguments

    args = sft_arguments(config.sft.model_copy(update={"batch_size": 8, "micro_batch_size": 2}), policy, tmp_path, None, 0)
    assert args.per_device_train_batch_size == 2 and args.gradient_accumulation_steps == 4
    assert args.use_cpu and not args.gradient_checkpointing and args.completion_only_loss
    with pytest.raises(ValueError, match="multiple of sft.micro_batch_size"):  # refused when the config is built
        type(config.sft).model_validate({**config.sft.model_dump(), "batch_size": 6, "micro_batch_size": 4})


def test_completion_loss_equals_the_full_logit_loss(config):
    """The SFT loss computes logits only from the first completion token on; on a right-padded batch with
    prompts of different lengths it matches the model's own loss over all positions."""
    from memalpha.teacher.sft import completion_loss

    policy = load_policy(config.model)
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 4:10] = ids[0, 4:10]  # prompt of 4, completion of 6, then padding
    labels[1, 7:12] = ids[1, 7:12]  # prompt of 7, completion of 5
    attention = torch.ones_like(ids)
    attention[0, 10:] = 0
    inputs = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    loss, count, correct = completion_loss(policy.model, inputs)
    reference = policy.model(**inputs).loss
    assert count == 11 and 0 <= correct <= count
    assert torch.allclose(loss, reference, atol=1e-5)
    summed, _, _ = completion_loss(policy.model, inputs, normalizer=22)  # half of it over twice the tokens
    assert torch.allclose(summed, reference / 2, atol=1e-5)


def test_sft_loss_weighs_every_completion_token_alike_whatever_the_batch_holds(tmp_path, config, instances):
    """The token sum goes over rows x the completion budget, not over the batch's own token count, so a
    batch of short skips does not weigh its tokens more than a batch of long writes."""
    from datasets import Dataset

    from memalpha.teacher.sft import (
        _completion_only_trainer,
        completion_loss,
        sft_arguments,
    )

    policy = load_policy(config.model)
    demos = build_demonstrations(instances, config, policy.tokenizer, count=2)
    trainer = _completion_only_trainer(41)(
        model=policy.model, args=sft_arguments(config.sft, policy, tmp_path, 1, 0),
        train_dataset=Dataset.from_list([{"prompt": d.prompt, "completion": d.completion} for d in demos]),
        processing_class=policy.tokenizer,
    )
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (2, 12))
    short, long = torch.full_like(ids, -100), torch.full_like(ids, -100)
    short[:, 10:] = ids[:, 10:]  # 2 completion tokens a row, like NOTHING_TO_STORE
    long[:, 4:] = ids[:, 4:]  # 8 a row
    rows = config.sft.batch_size  # micro-batches of 2 accumulate to it
    for labels in (short, long):
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        summed, count, _ = completion_loss(policy.model, inputs, normalizer=1)
        assert torch.allclose(trainer.compute_loss(policy.model, inputs, num_items_in_batch=count), summed / (rows * 41))
        # without num_items_in_batch the Trainer averages the micro-batches itself
        assert torch.allclose(trainer.compute_loss(policy.model, inputs), summed / (2 * 41))


def test_a_shared_prefix_runs_once_with_the_same_loss_and_gradients(config):
    """Rows that open with the same system prompt: the prefix runs forward once and its cache is reused,
    and the loss and LoRA gradients equal those of the model's own loss over whole rows."""
    from memalpha.teacher.sft import completion_loss, shared_prefix_length
    from memalpha.training.generation import MIN_SHARED_PREFIX

    policy = load_policy(config.model)
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (3, 40))
    ids[:, :20] = ids[0, :20]  # the shared system prompt
    labels = torch.full_like(ids, -100)
    labels[0, 26:36] = ids[0, 26:36]
    labels[1, 30:40] = ids[1, 30:40]
    labels[2, 24:31] = ids[2, 24:31]
    attention = torch.ones_like(ids)
    attention[0, 36:] = 0
    attention[2, 31:] = 0
    inputs = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    assert shared_prefix_length(ids, attention) == 20 >= MIN_SHARED_PREFIX
    params = [p for p in policy.model.parameters() if p.requires_grad]

    def loss_and_grads(compute):
        for param in params:
            param.grad = None
        loss = compute()
        loss.backward()
        return loss.detach(), [param.grad.clone() for param in params]

    shared, shared_grads = loss_and_grads(lambda: completion_loss(policy.model, inputs)[0])
    plain, plain_grads = loss_and_grads(lambda: policy.model(**inputs).loss)
    assert torch.allclose(shared, plain, atol=1e-5)
    assert any(g.abs().sum() > 0 for g in plain_grads)
    for a, b in zip(shared_grads, plain_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    ids[1, 3] += 1  # rows that differ early share no prefix worth a pass
    assert shared_prefix_length(ids, attention) == 3


def test_held_out_extraction_is_measured_each_epoch_and_a_plateau_stops_training(tmp_path, config, instances):
    policy = load_policy(config.model)
    demos = _short_demos(policy)[:4]
    probes = extraction_probes(instances[-2:], config, policy.tokenizer, count=6)
    assert len(probes) == 6 and any(p.holds_evidence for p in probes)
    assert all(not p.episode.done for p in probes)  # each probe stops before its chunk
    sft_cfg = config.sft.model_copy(update={"batch_size": 4, "micro_batch_size": 2, "epochs": 4.0, "patience": 1})
    logged = []
    result = run_sft(policy, demos, tmp_path / "warm", sft_cfg, probes=probes, max_new_tokens=8, on_log=logged.append)
    # the random tiny model never gets better: epoch 2 shows the plateau and training stops there
    assert [e["epoch"] for e in result.epochs] == [1, 2] and result.best_epoch == 1 and result.steps == 2
    for epoch in result.epochs:
        assert {"valid_calls", "evidence_recall", "skip_accuracy", "updates", "update_aim"} <= epoch.keys()
        assert all(0.0 <= epoch[k] <= 1.0 for k in ("valid_calls", "evidence_recall", "skip_accuracy"))
    assert sum("sft_eval/evidence_recall" in record for record in logged) == 2
    assert json.loads((tmp_path / "warm" / "sft_result.json").read_text())["epochs"] == result.epochs


def test_a_deadline_stops_sft_after_the_step_that_reaches_it_and_still_checks_held_out(tmp_path, config, instances):
    policy = load_policy(config.model)
    probes = extraction_probes(instances[-2:], config, policy.tokenizer, count=2)
    sft_cfg = config.sft.model_copy(update={"batch_size": 2, "micro_batch_size": 2, "epochs": 2.0})
    result = run_sft(policy, _short_demos(policy)[:4], tmp_path / "warm", sft_cfg, probes=probes, max_new_tokens=4,
                     deadline=time.time())
    assert result.steps == 1 and [e["step"] for e in result.epochs] == [1]  # of 4 steps without the deadline


def test_a_held_out_update_counts_as_aimed_only_when_it_keeps_the_entry_subject(config, instances):
    policy = load_policy(config.model)
    probes = extraction_probes(instances, config, policy.tokenizer, count=64)
    probe = next(p for p in probes if any(True for _ in p.episode.store.all_entries()))
    section, entry = next(iter(probe.episode.store.all_entries()))
    kept = entry.content.rstrip(".") + ", as before."

    def update(content: str) -> str:
        return json.dumps({"name": "memory_update", "arguments": {"memory_type": section, "memory_id": entry.id, "new_content": content}})

    aimed = score_probe(probe, update(kept))
    assert (aimed.updates, aimed.aimed, aimed.valid) == (1, 1, True)
    misaimed = score_probe(probe, update("Quentin bought a zither yesterday."))
    assert (misaimed.updates, misaimed.aimed) == (1, 0)
    assert score_probe(probe, NOTHING_TO_STORE).updates == 0


def small_talk(day: int) -> str:
    return json.dumps({"name": "memory_insert", "arguments": {"memory_type": "episodic",
                                                             "content": f"They chatted about the weather on day {day}."}})


def _lora_pairs(weights: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    return [(a, a.replace("lora_A", "lora_B")) for a in weights if "lora_A" in a]


def _deltas(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {a: weights[b].double() @ weights[a].double() for a, b in _lora_pairs(weights)}


def _applied_deltas(policy) -> dict[str, torch.Tensor]:
    """What each LoRA layer adds to its base weight (lora_alpha / r included)."""
    from peft.tuners.lora import LoraLayer

    return {name: layer.get_delta_weight("default") for name, layer in policy.model.named_modules()
            if isinstance(layer, LoraLayer)}


