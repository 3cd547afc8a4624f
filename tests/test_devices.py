"""Device correctness: generation, the GRPO update and the local reader create every tensor on the
policy's device.

Without a GPU this is checked by making the *default* device `meta` while the model stays on the CPU:
a tensor created without an explicit device lands on `meta` and the first operation that mixes it with
the model's tensors fails, which is what would happen on a CUDA machine. The `gpu` tests run the same
paths on CUDA and are skipped without one.
"""

from contextlib import contextmanager

import pytest
import torch
from test_rollout import _policy, make_dataset, random_adapter, tiny_config  # noqa: F401  (fixture re-export)
from test_trainer import _run_dir

from memalpha.data.schema import Question
from memalpha.models.loading import build_tiny
from memalpha.models.readers import LocalModelReader, ReaderItem
from memalpha.training.generation import generate
from memalpha.training.rollout import collect_step_rollouts
from memalpha.training.trainer import Trainer


@contextmanager
def stray_tensors_on_meta():
    """Tensors created without a device go to `meta` (no data), so using one with the model fails."""
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_the_check_catches_a_tensor_created_on_the_default_device():
    on_model_device = torch.ones(3)
    with stray_tensors_on_meta():
        with pytest.raises(RuntimeError, match="meta"):
            on_model_device + torch.zeros(3)
        with pytest.raises(NotImplementedError):
            torch.tensor([1, 2]).to(on_model_device.device)  # built on the default device, then moved


def test_generation_creates_its_tensors_on_the_model_device():
    model, tokenizer = build_tiny(seed=1)
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9]]
    expected = generate(model, prompts, max_new_tokens=6, eos_token_ids=[7], pad_token_id=tokenizer.pad_token_id,
                        generator=torch.Generator().manual_seed(0))
    with stray_tensors_on_meta():
        out = generate(model, prompts, max_new_tokens=6, eos_token_ids=[7], pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0))
    assert out.completion_ids == expected.completion_ids


def _step_trainer(tmp_path, adapter, *overrides):
    config = tiny_config(make_dataset(tmp_path / "data"), "sft.enabled=true", "grpo.sampling=step",
                         "rollout.num_generations=3", *overrides)
    return Trainer(config, _run_dir(tmp_path, adapter))


@pytest.mark.parametrize("shared", [True, False])
def test_the_update_creates_its_tensors_on_the_policy_device(tmp_path, random_adapter, shared):  # noqa: F811
    trainer = _step_trainer(tmp_path, random_adapter, f"grpo.shared_prompt_update={shared}")
    batch = collect_step_rollouts(trainer.policy, trainer._next_instances(), trainer.config, num_generations=3,
                                  generator=trainer.generator, reader=trainer.reader)
    advantages = torch.randn(len(batch.samples), generator=torch.Generator().manual_seed(1))
    trainer.optimizer.step = lambda: None  # both updates start from the same weights
    expected = trainer._update(batch.samples, advantages)
    with stray_tensors_on_meta():
        stats = trainer._update(batch.samples, advantages)
    assert stats["grad_norm"] > 0
    for key in ("loss", "entropy", "grad_norm"):
        assert stats[key] == pytest.approx(expected[key], rel=1e-5), key


def test_the_local_reader_creates_its_tensors_on_the_policy_device(tmp_path, random_adapter):  # noqa: F811
    policy = _policy(tiny_config(tmp_path), random_adapter)
    reader = LocalModelReader(policy, max_new_tokens=4)
    items = [ReaderItem("Ana is allergic to peanuts.", Question("q", "What is Ana allergic to?", ["peanuts"], "single_hop"))]
    expected = reader.answer(items)
    with stray_tensors_on_meta():
        assert reader.answer(items) == expected


@pytest.mark.gpu
def test_generation_runs_on_cuda_and_refuses_a_cpu_generator():
    model, tokenizer = build_tiny(seed=1, device=torch.device("cuda"))
    args = dict(max_new_tokens=6, eos_token_ids=[7], pad_token_id=tokenizer.pad_token_id)
    out = generate(model, [[5, 6, 7], [5, 6, 7]], generator=torch.Generator(device="cuda").manual_seed(0), **args)
    assert len(out.completion_ids) == 2
    with pytest.raises(ValueError, match="generator is on cpu"):
        generate(model, [[5, 6, 7]], generator=torch.Generator().manual_seed(0), **args)


@pytest.mark.gpu
def test_a_step_level_grpo_step_runs_on_cuda(tmp_path, random_adapter):  # noqa: F811
    trainer = _step_trainer(tmp_path, random_adapter, "model.device=cuda")
    assert trainer.policy.device.type == "cuda" and trainer.generator.device.type == "cuda"
    result = trainer.train_step()
    assert result.metrics["timing/step_s"] > 0 and "loss" in result.metrics
