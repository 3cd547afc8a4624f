"""GRPO advantages and loss against hand-computed values, clipping, and the gradient direction."""


import pytest
import torch

from memalpha.models.loading import build_tiny
from memalpha.training.grpo import (
    STD_EPS,
    completion_logps,
    compute_advantages,
    group_ids,
    grpo_loss,
)


def _loss(logps, old, adv, mask, loss_type, **kw):
    args = dict(
        loss_type=loss_type, epsilon=0.2, epsilon_high=None, max_completion_length=4,
        batch_sequences=adv.numel(), batch_tokens=int(mask.sum()), num_micro_batches=1,
    )
    args.update(kw)
    return grpo_loss(logps, old, adv, mask, **args)


def test_advantages_group_scaling_and_zero_std_group():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv, zero = compute_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), "group")
    # group 0: mean 2, Bessel std 1; group 1: all equal -> advantage 0
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / torch.tensor([1 + STD_EPS] * 3 + [STD_EPS] * 3)
    assert torch.allclose(adv, expected, atol=1e-6)
    assert zero.tolist() == [False, False, False, True, True, True]


def test_advantages_batch_and_none_scaling():
    rewards = torch.tensor([0.0, 2.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv_none, _ = compute_advantages(rewards, groups, "none")
    assert torch.allclose(adv_none, torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    adv_batch, _ = compute_advantages(rewards, groups, "batch")
    batch_std = float(rewards.std())  # Bessel over the whole batch, as TRL
    assert torch.allclose(adv_batch, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (batch_std + STD_EPS), atol=1e-6)
    with pytest.raises(ValueError):
        compute_advantages(rewards, groups, "bogus")


def test_group_ids_instance_vs_chunk():
    inst = [0, 0, 0, 0, 1, 1]
    chunk = [0, 1, 0, 1, 0, 0]
    assert group_ids(inst, chunk, "instance").tolist() == [0, 0, 0, 0, 1, 1]
    assert group_ids(inst, chunk, "chunk").tolist() == [0, 1, 0, 1, 2, 2]
    # per chunk position: rewards of chunk 0 are compared only with chunk 0 of the other rollouts
    rewards = torch.tensor([1.0, 10.0, 3.0, 10.0, 4.0, 4.0])
    adv, zero = compute_advantages(rewards, group_ids(inst, chunk, "chunk"), "none")
    assert adv.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert zero.tolist() == [False, True, False, True, True, True]


@pytest.fixture
def batch():
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logps = torch.full((2, 3), -1.0)
    return logps, logps.clone(), adv, mask  # ratio 1: per-token loss is -A


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", (-1.0 + 2.0) / 2),  # per-sequence means -1 and 2, averaged
        ("dr_grpo", (-3.0 + 2.0) / (2 * 4)),  # sum / (N * max_completion_length=4)
        ("dapo", (-3.0 + 2.0) / 4),  # sum / all 4 tokens
        ("bnpo", (-3.0 + 2.0) / 4),  # token mean of the single micro-batch
    ],
)
def test_loss_values_per_type(batch, loss_type, expected):
    loss, stats = _loss(*batch, loss_type)
    assert loss.item() == pytest.approx(expected)
    assert stats.tokens == 4 and stats.low_clipped == 0 and stats.high_clipped == 0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_global_loss(batch, loss_type):
    logps, old, adv, mask = batch
    logps = logps + torch.tensor([[0.1, -0.05, 0.0], [0.02, 0.0, 0.0]])
    whole, _ = _loss(logps, old, adv, mask, loss_type)
    split = sum(
        _loss(logps[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], loss_type,
              batch_sequences=2, batch_tokens=4, num_micro_batches=2)[0]
        for i in range(2)
    )
    assert split.item() == pytest.approx(whole.item())


def test_bnpo_averages_micro_batch_token_means(batch):
    logps, old, adv, mask = batch
    parts = [
        _loss(logps[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], "bnpo", num_micro_batches=2)[0]
        for i in range(2)
    ]
    assert sum(parts).item() == pytest.approx((-1.0 + 2.0) / 2)


def test_clipping_zeroes_gradient_outside_trust_region():
    old = torch.zeros(4, 1)
    # ratios 1.5 (A>0, clipped), 0.5 (A>0, not clipped), 0.5 (A<0, clipped), 1.5 (A<0, not clipped)
    logps = torch.log(torch.tensor([[1.5], [0.5], [0.5], [1.5]])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, 1)
    loss, stats = _loss(logps, old, adv, mask, "dapo")
    loss.backward()
    grad = logps.grad.squeeze(1)
    assert grad[0] == 0 and grad[2] == 0
    assert grad[1] < 0 and grad[3] > 0  # descent raises logp when A>0, lowers it when A<0
    # -min(rA, clip(r)A): 1.2, 0.5, -0.8, -1.5, token mean
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 0.8 - 1.5) / 4)
    assert stats.high_clipped == 1 and stats.low_clipped == 1


def test_epsilon_high_widens_upper_clip():
    old = torch.zeros(1, 1)
    logps = torch.log(torch.tensor([[1.25]])).requires_grad_()
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    loss, stats = _loss(logps, old, adv, mask, "dapo", epsilon_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25) and logps.grad.item() != 0 and stats.high_clipped == 0


def test_positive_advantage_completion_becomes_more_likely():
    model, _ = build_tiny(seed=0)
    model.train()
    torch.manual_seed(0)
    prompt = torch.randint(10, 200, (1, 6))
    good, bad = torch.randint(10, 200, (1, 5)), torch.randint(10, 200, (1, 5))
    input_ids = torch.cat([torch.cat([prompt, good], 1), torch.cat([prompt, bad], 1)])
    attn = torch.ones_like(input_ids)
    mask = torch.ones(2, 5)
    adv, _ = compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))
    with torch.no_grad():
        before, _ = completion_logps(model, input_ids, attn, 5, 1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logps, _ = completion_logps(model, input_ids, attn, 5, 1.0)
    loss, _ = _loss(logps, logps.detach(), adv, mask, "grpo", max_completion_length=5)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after, _ = completion_logps(model, input_ids, attn, 5, 1.0)
    assert after[0].sum() > before[0].sum()
    assert after[1].sum() < before[1].sum()
