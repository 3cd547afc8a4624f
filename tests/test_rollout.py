"""Batched rollouts with the tiny model: one generate call per chunk position, reward breakdowns."""

from pathlib import Path

import pytest
import torch

from memalpha.config import load_config
from memalpha.data.io import write_dataset
from memalpha.data.schema import Instance, Question
from memalpha.models.policy import load_policy
from memalpha.models.readers import make_reader
from memalpha.training.rollout import collect_rollouts, write_unasked

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
PEOPLE = ["Priya", "Javier", "Clara", "Hiro", "Ines", "Luca", "Maya", "Oscar"]


def tiny_config(data_dir, *overrides):
    """configs/tiny.yaml on a test dataset, without a warm start unless asked."""
    return load_config(CONFIG, [f"data.train_path={data_dir}", "sft.enabled=false", *overrides])


def make_instances() -> list[Instance]:
    """Short two-or-three-chunk dialogues with one question each; the last two are held out."""
    out = []
    for i, name in enumerate(PEOPLE):
        fact = "hazelnuts" if i % 2 == 0 else "peanuts"
        chunks = [f"{name}: I found out I am allergic to {fact}.", f"{name}: I moved to Lisbon last week."]
        if i % 3 == 0:
            chunks.append(f"{name}: The weather is nice today.")
        questions = [Question("q0", f"What is {name} allergic to?", [fact], "single_hop", [0])]
        split = "validation" if i >= 6 else "train"
        out.append(Instance(f"inst-{i}", "test", "accurate_retrieval", chunks, questions, {}, split))
    return out


def make_dataset(folder: Path) -> Path:
    write_dataset(folder, make_instances(), manifest={"source": "test"})
    return folder


@pytest.fixture(scope="session")
def random_adapter(tmp_path_factory) -> Path:
    """A tiny-model LoRA adapter with random (non-zero) B matrices, so the policy differs from the base
    model (adapters off) and the LoRA A matrices have a gradient."""
    folder = tmp_path_factory.mktemp("adapter")
    config = tiny_config(folder / "data")
    policy = load_policy(config.model, seed=config.grpo.seed)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return policy.save_adapter(folder / "adapter")


@pytest.fixture
def dataset(tmp_path) -> Path:
    return make_dataset(tmp_path / "data")


def _policy(config, adapter):
    return load_policy(config.model, adapter=adapter, seed=config.grpo.seed)


def test_one_generate_call_per_chunk_position(dataset, random_adapter):
    config = tiny_config(dataset, "data.max_chunks_per_instance=0")
    policy = _policy(config, random_adapter)
    instances = make_instances()[:3]  # 3, 2 and 2 chunks
    batch = collect_rollouts(policy, instances, config, num_generations=4, generator=torch.Generator().manual_seed(0),
                             reader=make_reader(config.model))
    assert batch.generate_calls == 3  # chunk positions, not B*G*chunks
    assert len(batch.memories) == 12
    assert len(batch.samples) == 4 * 3 + 4 * 2 + 4 * 2  # rollouts stop at their instance's last chunk
    per_rollout = {}
    for s in batch.samples:
        per_rollout.setdefault((s.instance_index, s.rollout), []).append(s.chunk)
        assert s.reward is not None and len(s.completion_ids) == len(s.sampling_logps) > 0
        assert s.prompt_ids and s.prompt.endswith("assistant\n")
    assert per_rollout[(0, 0)] == [0, 1, 2] and per_rollout[(1, 3)] == [0, 1]
    assert batch.generated_tokens == sum(len(s.completion_ids) for s in batch.samples)


def test_rewards_follow_the_memory_and_are_shared_within_a_rollout(dataset, random_adapter):
    config = tiny_config(dataset)
    policy = _policy(config, random_adapter)
    batch = collect_rollouts(policy, make_instances()[:2], config, num_generations=4,
                             generator=torch.Generator().manual_seed(1), reader=make_reader(config.model))
    G = 4
    for r, store in enumerate(batch.memories):
        samples = [s for s in batch.samples if s.instance_index == r // G and s.rollout == r % G]
        assert len({s.reward.r1 for s in samples}) == 1 and len({s.reward.r3 for s in samples}) == 1
        # r1: the evidence reader finds the gold answer in this rollout's memory or not
        gold = batch.instances[r // G].questions[0].answers[0]
        assert samples[0].reward.r1 == (1.0 if gold in store.to_json() else 0.0) == batch.qa_scores[r]
        for s in samples:
            ok = sum(x.ok for x in s.results)
            b = s.reward
            if s.results:
                assert b.r2 == ok / len(s.results)
            # chunk 0 holds the evidence (its format counts as far as it covers), chunk 1 none
            assert b.holds_evidence == (s.chunk == 0)
            gate = b.coverage if b.holds_evidence else 1.0
            assert b.total == pytest.approx(b.r1 + b.coverage + gate * (b.r2 + config.reward.gamma * b.r4)
                                            + config.reward.beta * b.r3)
    assert batch.trace["span_type"] == "AGENT" and batch.trace["children"][0]["children"][0]["name"] == "generate"


def test_rollouts_are_reproducible_from_the_generator(dataset, random_adapter):
    config = tiny_config(dataset)
    policy = _policy(config, random_adapter)
    reader = make_reader(config.model)
    runs = [
        collect_rollouts(policy, make_instances()[:2], config, num_generations=2,
                         generator=torch.Generator().manual_seed(seed), reader=reader)
        for seed in (5, 5, 6)
    ]
    texts = [[s.completion for s in run.samples] for run in runs]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_write_unasked_batches_instances_without_their_questions(dataset, random_adapter):
    config = tiny_config(dataset, "data.max_chunks_per_instance=0")
    policy = _policy(config, random_adapter)
    instances = make_instances()[:3]  # 3, 2 and 2 chunks
    batches = list(write_unasked(policy, instances, config, batch_size=2))
    assert [len(written) for written, _ in batches] == [2, 1]
    written = [w for ws, _ in batches for w in ws]
    assert [w.instance for w in written] == instances  # questions kept for the scorer
    for w in written:
        assert [s.chunk for s in w.samples] == list(range(len(w.instance.chunks)))
        assert w.samples[-1].memory_json == w.memory.to_json()
    for _, rollouts in batches:
        assert all(not i.questions for i in rollouts.instances) and not rollouts.answers[0]
    greedy = [s.completion for s in written[0].samples]
    assert greedy == [s.completion for s in next(write_unasked(policy, instances[:1], config, batch_size=1))[0][0].samples]
