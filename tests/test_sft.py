"""Warm start: demonstrations are built like rollout prompts; SFT on the tiny model learns them."""

from __future__ import annotations

import json
import time

import pytest
import torch

from memalpha.config import load_config
from memalpha.data.synth import SynthConfig, generate
from memalpha.episode import Episode
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.memory.views import view_ids, writer_view
from memalpha.models.policy import AdapterError, average_adapters, load_policy
from memalpha.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.prompts import render_writer_prompt
from memalpha.rule_writer import RuleWriter
from memalpha.data.schema import Instance, Question
from memalpha.rewards import mentions
from memalpha.sft import (
    Demonstration,
    DemoStats,
    answer_writes_only,
    build_demonstrations,
    demonstration_max_length,
    extraction_probes,
    label_policy_states,
    policy_state_demonstrations,
    run_dagger,
    run_sft,
    score_probe,
    train_warm_start,
)

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
            episode.step(writer.write(episode.chunk_text, episode.store, view_ids(prompt, episode.store)))
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


def test_update_share_draws_conflicting_chunks_first():
    config = load_config(None, OVERRIDES)
    policy = load_policy(config.model)
    conflicts = generate(SynthConfig(instances=6, chunks_per_instance=(4,), chunk_tokens=128,
                                     competencies=("conflict_resolution",), seed=5))
    proportional, weighted = DemoStats(), DemoStats()
    build_demonstrations(conflicts, config, policy.tokenizer, count=8, nothing_share=0.0, update_share=0.0, stats=proportional)
    demos = build_demonstrations(conflicts, config, policy.tokenizer, count=8, nothing_share=0.0, update_share=1.0, stats=weighted)
    updating = [d for d in demos if d.updates_entry]
    assert weighted.updates == len(updating) == 8 > proportional.updates
    for demo in updating:
        assert any(c.name == "memory_update" and c.arguments["memory_id"] for c in parse_tool_calls(demo.completion).calls)


def test_answer_writes_only_keeps_the_calls_that_hold_an_answer_or_a_superseded_one():
    instance = Instance("i", "synth", "conflict_resolution", ["chunk"], [
        Question("q", "Where does Maya live?", ["Porto"], "conflict_resolution", superseded_answers=["Lisbon"]),
    ])
    lines = [json.dumps({"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": text}})
             for text in ("Maya lives in Lisbon.", "The bus was late again.", "Maya moved to porto.")]
    kept = answer_writes_only("\n".join(lines), instance, MEMALPHA_SCHEMA)
    assert kept.splitlines() == [lines[0], lines[2]]
    assert answer_writes_only(lines[1], instance, MEMALPHA_SCHEMA) == NOTHING_TO_STORE
    assert answer_writes_only(NOTHING_TO_STORE, instance, MEMALPHA_SCHEMA) == NOTHING_TO_STORE


def test_answer_demonstrations_leave_out_the_writes_no_question_asks_about(instances):
    config = load_config(None, OVERRIDES + ["sft.demonstration_writes=answers"])
    policy = load_policy(config.model)
    everything, answers = DemoStats(), DemoStats()
    full = build_demonstrations(instances, load_config(None, OVERRIDES), policy.tokenizer, count=100, nothing_share=0.0, stats=everything)
    kept = build_demonstrations(instances, config, policy.tokenizer, count=100, nothing_share=0.0, stats=answers)
    by_id = {i.instance_id: i for i in instances}
    texts = [c.arguments["content"] for d in kept for c in parse_tool_calls(d.completion).calls if c.name == "memory_insert"]
    assert texts
    for demo in kept:
        gold = [a for q in by_id[demo.instance_id].questions for a in (*q.answers, *q.superseded_answers)]
        for call in parse_tool_calls(demo.completion).calls:
            text = call.arguments.get("content") or call.arguments.get("new_content") or ""
            assert call.name == "memory_delete" or any(mentions(text, a) for a in gold), text
    calls = lambda demos: sum(len(parse_tool_calls(d.completion).calls) for d in demos)
    assert calls(kept) < calls(full)


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

    from memalpha.sft import sft_arguments

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
    from memalpha.sft import sft_arguments

    args = sft_arguments(config.sft.model_copy(update={"batch_size": 8, "micro_batch_size": 2}), policy, tmp_path, None, 0)
    assert args.per_device_train_batch_size == 2 and args.gradient_accumulation_steps == 4
    assert args.use_cpu and not args.gradient_checkpointing and args.completion_only_loss
    with pytest.raises(ValueError, match="multiple of sft.micro_batch_size"):  # refused when the config is built
        type(config.sft).model_validate({**config.sft.model_dump(), "batch_size": 6, "micro_batch_size": 4})


def test_completion_loss_equals_the_full_logit_loss(config):
    """The SFT loss computes logits only from the first completion token on; on a right-padded batch with
    prompts of different lengths it matches the model's own loss over all positions."""
    from memalpha.sft import completion_loss

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

    from memalpha.sft import _completion_only_trainer, completion_loss, sft_arguments

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
    from memalpha.sft import MIN_SHARED_PREFIX, completion_loss, shared_prefix_length

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


def test_dagger_labels_the_memory_the_policy_built_with_what_the_rule_writer_would_write(config, instances):
    policy = load_policy(config.model)
    instance = instances[0]
    n = len(instance.chunks)
    teacher = sorted(build_demonstrations([instance], config, policy.tokenizer, count=n), key=lambda d: d.chunk_index)
    chatty = sorted(label_policy_states([instance], [[small_talk(t) for t in range(n)]], config, policy.tokenizer, count=n),
                    key=lambda d: d.chunk_index)
    skipping = sorted(label_policy_states([instance], [[NOTHING_TO_STORE] * n], config, policy.tokenizer, count=n),
                      key=lambda d: d.chunk_index)
    assert [d.chunk_index for d in chatty] == [d.chunk_index for d in skipping] == list(range(n))
    # the first chunk meets an empty memory whoever wrote before: the same demonstration
    assert chatty[0].prompt == skipping[0].prompt == teacher[0].prompt
    assert chatty[0].completion == skipping[0].completion == teacher[0].completion
    writer = RuleWriter(MEMALPHA_SCHEMA, max_completion_tokens=config.rollout.max_completion_length,
                        count_tokens=policy.count_tokens)
    chatty_episode = Episode(instance, MEMALPHA_SCHEMA, config.memory, config.retrieval, policy.count_tokens, policy.tokenizer)
    for t in range(n):
        # the prompt shows the policy's memory (t small-talk entries), not the rule writer's
        assert chatty[t].prompt.count("They chatted about the weather") == t
        assert chatty[t].prompt == chatty_episode.prompt()
        # and the label is the rule writer's completion on that memory
        label = writer.write(chatty_episode.chunk_text, chatty_episode.store, chatty_episode.visible_ids())
        assert chatty[t].completion == label
        assert chatty_episode.step(small_talk(t)).results[0].ok
        assert "Memory:\n[core]\n(empty)\n\nNew chunk:" in skipping[t].prompt  # nothing stored, ever
        assert not skipping[t].updates_entry  # nothing to update on an empty memory
    assert any(t.prompt != s.prompt for t, s in zip(teacher[1:], skipping[1:]))  # the teacher stored before these
    with pytest.raises(ValueError, match=instance.instance_id):  # a policy that wrote fewer chunks than exist
        label_policy_states([instance], [[NOTHING_TO_STORE]], config, policy.tokenizer, count=n)


def test_a_dagger_round_trains_on_the_policys_own_states_and_continues_the_sft_record(tmp_path, config, instances):
    policy = load_policy(config.model)
    cfg = config.model_copy(update={
        "sft": config.sft.model_copy(update={"batch_size": 2, "micro_batch_size": 2, "dagger_rounds": 1,
                                             "dagger_demonstrations": 4, "dagger_learning_rate": 2e-4}),
        "rollout": config.rollout.model_copy(update={"max_completion_length": 8}),
    })
    # the round's states: what the (random) tiny policy wrote, replayed
    demos = policy_state_demonstrations(policy, instances[:4], cfg, count=4, seed=cfg.grpo.seed + 1)
    assert len(demos) == 4 and len({d.instance_id for d in demos}) == 1  # drawn until their chunks make the count
    probes = extraction_probes(instances[-2:], cfg, policy.tokenizer, count=2)
    first = run_sft(policy, _short_demos(policy)[:2], tmp_path / "warm", cfg.sft, probes=probes, max_new_tokens=4)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    logged = []
    result = run_dagger(policy, instances[:4], cfg, tmp_path / "warm", first, probes=probes, on_log=logged.append)
    assert result.steps == first.steps + 2  # 4 demonstrations in batches of 2
    assert [e["epoch"] for e in result.epochs] == [1, 2] and result.epochs[1]["round"] == 1
    assert result.epochs[1]["step"] == result.steps and result.best_epoch == 2
    # sft.dagger_mix (0.25) of the 4 come from the rule writer's own memories
    assert result.rounds[0]["round"] == 1 and result.rounds[0]["steps"] == 2
    assert result.rounds[0]["demonstrations"] == 4 and result.rounds[0]["policy_states"] == 3
    # progress: the round's rollouts, then its steps numbered after the first stage's
    assert [(r["instances_written"], r["instances"]) for r in logged if "dagger_round" in r] == [(0, 1), (1, 1)]
    assert [r["step"] for r in logged if "token_loss" in r] == [first.steps + 1, first.steps + 2]
    assert {r["learning_rate"] for r in logged if "token_loss" in r} == {2e-4}  # the rounds' own rate
    assert any(not torch.equal(p, before[n]) for n, p in policy.model.named_parameters() if p.requires_grad)
    assert json.loads((tmp_path / "warm" / "sft_result.json").read_text())["rounds"] == result.rounds


def test_dagger_rounds_start_only_before_the_deadline(tmp_path, config, instances):
    policy = load_policy(config.model)
    cfg = config.model_copy(update={"sft": config.sft.model_copy(update={"dagger_rounds": 2})})
    first = run_sft(policy, _short_demos(policy)[:4], tmp_path / "warm", cfg.sft.model_copy(update={"batch_size": 4}))
    result = run_dagger(policy, instances, cfg, tmp_path / "warm", first, deadline=time.time() - 1)
    assert result.rounds == [] and result.steps == first.steps


def _lora_pairs(weights: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    return [(a, a.replace("lora_A", "lora_B")) for a in weights if "lora_A" in a]


def _deltas(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {a: weights[b].double() @ weights[a].double() for a, b in _lora_pairs(weights)}


def _applied_deltas(policy) -> dict[str, torch.Tensor]:
    """What each LoRA layer adds to its base weight (lora_alpha / r included)."""
    from peft.tuners.lora import LoraLayer

    return {name: layer.get_delta_weight("default") for name, layer in policy.model.named_modules()
            if isinstance(layer, LoraLayer)}


def test_an_average_of_adapters_holds_exactly_their_mean_delta(tmp_path, config):
    from safetensors.torch import load_file

    policy = load_policy(config.model)
    params = dict(policy.model.named_parameters())
    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():  # a trained-looking adapter: B is zero after init
            for a, b in _lora_pairs(params):
                params[a].normal_()
                params[b].normal_()
        dirs.append(policy.save_adapter(tmp_path / f"seed-{seed}"))
    saved = json.loads((dirs[1] / "adapter_config.json").read_text())  # peft lists target modules in any order
    (dirs[1] / "adapter_config.json").write_text(json.dumps({**saved, "target_modules": saved["target_modules"][::-1]}))
    out = average_adapters(dirs, tmp_path / "soup")
    first = json.loads((dirs[0] / "adapter_config.json").read_text())
    soup_config = json.loads((out / "adapter_config.json").read_text())
    assert (soup_config["r"], soup_config["lora_alpha"]) == (2 * first["r"], 2 * first["lora_alpha"])
    members = [_deltas(load_file(str(d / "adapter_model.safetensors"))) for d in dirs]
    for key, delta in _deltas(load_file(str(out / "adapter_model.safetensors"))).items():
        assert torch.allclose(delta, (members[0][key] + members[1][key]) / 2, atol=1e-9)
    # a policy of the doubled layout applies, layer by layer, the mean of the members' scaled deltas
    wide = load_policy(config.model.model_copy(update={"lora_r": 2 * first["r"], "lora_alpha": 2 * first["lora_alpha"]}))
    wide.load_adapter(out)
    applied = []
    for d in dirs:
        policy.load_adapter(d)
        applied.append(_applied_deltas(policy))
    for name, delta in _applied_deltas(wide).items():
        assert torch.allclose(delta, (applied[0][name] + applied[1][name]) / 2, atol=1e-5)
    other = load_config(None, OVERRIDES + ["model.lora_r=8"])
    load_policy(other.model).save_adapter(tmp_path / "rank8")
    with pytest.raises(AdapterError, match="rank8"):
        average_adapters([dirs[0], tmp_path / "rank8"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_a_warm_start_of_several_seeds_is_the_average_of_the_warm_start_of_each_seed(tmp_path, config, instances):
    from safetensors.torch import load_file

    cfg = config.model_copy(update={
        "sft": config.sft.model_copy(update={"soup_seeds": 2, "num_demonstrations": 2, "batch_size": 2,
                                             "micro_batch_size": 2, "learning_rate": 5e-3}),
        "rollout": config.rollout.model_copy(update={"max_completion_length": 4}),
    })
    policy = load_policy(cfg.trained_model())
    probes = extraction_probes(instances[-2:], cfg, policy.tokenizer, count=2)
    logged, stats = [], DemoStats()
    result = train_warm_start(policy, instances[:4], cfg, tmp_path / "warm", probes=probes, on_log=logged.append,
                              stats=stats)
    members = [tmp_path / "warm" / "members" / f"seed-{seed}" for seed in (0, 1)]
    assert [m["seed"] for m in result.members] == [0, 1] and stats.kept == 4
    # the second member is the warm start seed 1 trains alone
    alone = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"seed": 1}),
                                   "sft": cfg.sft.model_copy(update={"soup_seeds": 1})})
    train_warm_start(load_policy(alone.trained_model(), seed=1), instances[:4], alone, tmp_path / "alone")
    second, single = (load_file(str(d / "adapter_model.safetensors")) for d in (members[1], tmp_path / "alone"))
    assert all(torch.equal(second[k], single[k]) for k in single)
    first = load_file(str(members[0] / "adapter_model.safetensors"))
    assert any(not torch.equal(first[k], second[k]) for k in first)
    # the warm start is their average, and the policy holds it
    soup = load_file(str(tmp_path / "warm" / "adapter_model.safetensors"))
    expected = load_file(str(average_adapters(members, tmp_path / "expected") / "adapter_model.safetensors"))
    assert soup.keys() == expected.keys() and all(torch.equal(v, expected[k]) for k, v in soup.items())
    held = policy.adapter_weights()
    assert all(torch.equal(held[k.replace(".weight", ".default.weight")], v) for k, v in soup.items())
    # one record: both members' steps and held-out epochs in turn, then the average's, which is kept
    assert result.steps == sum(m["steps"] for m in result.members) == 2
    assert [(e["epoch"], e.get("member"), e.get("soup")) for e in result.epochs] == [(1, 0, None), (2, 1, None), (3, None, 2)]
    assert result.best_epoch == 3 and result.epochs[-1]["step"] == 2
    assert [r["step"] for r in logged if "token_loss" in r] == [1, 2]  # the second member numbered after the first
    assert [r["epoch"] for r in logged if "sft_eval/evidence_recall" in r] == [1, 2, 3]
    assert json.loads((tmp_path / "warm" / "sft_result.json").read_text())["epochs"] == result.epochs


def test_each_seed_of_an_average_gets_a_share_of_the_time_left(tmp_path, config, instances):
    cfg = config.model_copy(update={
        "sft": config.sft.model_copy(update={"soup_seeds": 2, "num_demonstrations": 4, "batch_size": 2, "micro_batch_size": 2}),
        "rollout": config.rollout.model_copy(update={"max_completion_length": 4}),
    })
    result = train_warm_start(load_policy(cfg.trained_model()), instances[:4], cfg, tmp_path / "warm", deadline=time.time())
    # out of time from the start: each seed still takes its first step (of 2), and both are averaged
    assert [(m["seed"], m["steps"]) for m in result.members] == [(0, 1), (1, 1)]
    assert (tmp_path / "warm" / "adapter_model.safetensors").is_file()
