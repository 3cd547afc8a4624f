"""GRPO: group-normalised advantages and the clipped surrogate loss (TRL 1.16 semantics).

Notation: sample i is one (rollout, chunk) pair with reward R_i, completion tokens t = 1..|o_i|,
current log-prob logp_it, old log-prob (the policy that sampled it) old_it.

    A_i     = (R_i - mean_{g(i)} R) / (std + 1e-4)           scale_rewards = group: std over g(i)
                                                              scale_rewards = batch: std over the batch
                                                              scale_rewards = none:  no division
    rho_it  = exp(logp_it - old_it)
    L_it    = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)     (no KL term, TRL's beta = 0)

Aggregation over the global batch of N samples (T tokens in all) split into M micro-batches:
    grpo    : (1/N) sum_i mean_t L_it                      per-sequence mean, then mean over sequences
    dr_grpo : (1/(N * max_completion_length)) sum_it L_it
    dapo    : (1/T) sum_it L_it                            token mean over the global batch
    bnpo    : (1/M) sum_mb (token mean over the micro-batch)
Each micro-batch's loss below is its share of that sum, so accumulating gradients over micro-batches
gives the gradient of the global loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from memalpha.training.generation import keep_last

STD_EPS = 1e-4  # TRL's constant in A = (R - mean) / (std + eps)


def group_std(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Bessel-corrected std of each group (0 for single-member groups), one value per group."""
    counts = torch.bincount(group_ids, minlength=num_groups).to(values.dtype)
    means = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group_ids, values) / counts.clamp(min=1)
    sq = torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group_ids, (values - means[group_ids]) ** 2)
    return torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))


def compute_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages A_i and a per-sample flag "my group's rewards all equal" (for frac_reward_zero_std).

    rewards: (N,) float; group_ids: (N,) long in [0, num_groups) -- an instance (paper) or an
    (instance, chunk position) pair; scale_rewards: "group", "batch" or "none" as in TRL.
    """
    rewards = rewards.to(torch.float64)
    group_ids = group_ids.long()
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    counts = torch.bincount(group_ids, minlength=num_groups).to(rewards.dtype)
    means = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_ids, rewards) / counts.clamp(min=1)
    stds = group_std(rewards, group_ids, num_groups)[group_ids]
    zero_std = torch.isclose(stds, torch.zeros_like(stds))
    advantages = rewards - means[group_ids]
    if scale_rewards == "group":
        advantages = advantages / (stds + STD_EPS)
    elif scale_rewards == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
        advantages = advantages / (batch_std + STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    return advantages.float(), zero_std


@dataclass
class LossStats:
    """Token-summed statistics of one micro-batch (the trainer divides by token counts)."""

    tokens: float
    low_clipped: float
    high_clipped: float


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    max_completion_length: int,
    batch_sequences: int,
    batch_tokens: int,
    num_micro_batches: int,
) -> tuple[torch.Tensor, LossStats]:
    """Loss of one micro-batch, already scaled so that summing over micro-batches gives the global loss.

    logps, old_logps, mask: (b, L) over completion tokens; advantages: (b,).
    batch_sequences / batch_tokens / num_micro_batches describe the whole (global) batch.
    """
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / batch_sequences
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (batch_sequences * max_completion_length)
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / max(batch_tokens, 1)
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches
    else:
        raise ValueError(f"loss_type must be grpo, dr_grpo, dapo or bnpo, not {loss_type!r}")
    with torch.no_grad():
        stats = LossStats(
            tokens=float(mask.sum()),
            low_clipped=float((((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype) * mask).sum()),
            high_clipped=float((((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype) * mask).sum()),
        )
    return loss, stats


def completion_logps(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int, temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the last `completion_len` tokens of input_ids.

    Logits are computed only at completion positions (`logits_to_keep`), divided by the sampling
    temperature as in TRL, and reduced in float32.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        logits_to_keep=keep_last(completion_len + 1, input_ids.shape[1], input_ids.device), use_cache=False,
    )
    # position p predicts token p + 1
    return _token_logps(out.logits[:, :-1, :], input_ids[:, -completion_len:], temperature, with_entropy)


class SharedPrefix:
    """A prompt prefix common to several groups of an update (the writer's system prompt), run forward
    once with gradient.

    Each group reads detached copies of the prefix's keys and values (`cache()`), so its backward pass
    stops there and leaves the gradient on those copies, summed over groups; `backward()` then carries
    that sum through the prefix once. The gradients equal running the prefix in every group, while
    only one group's graph is alive at a time.
    """

    def __init__(self, model, prefix_ids: torch.Tensor):
        cache = model(input_ids=prefix_ids, use_cache=True, logits_to_keep=1).past_key_values
        self.length = prefix_ids.shape[1]
        self._outputs = [(layer.keys, layer.values) for layer in cache.layers]
        self._leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in self._outputs]

    def cache(self) -> DynamicCache:
        """A fresh cache holding the prefix, for one group's forward pass."""
        cache = DynamicCache()
        for layer, (keys, values) in enumerate(self._leaves):
            cache.update(keys, values, layer)
        return cache

    def backward(self) -> None:
        """Backpropagate the gradients the groups left on the prefix's keys and values."""
        pairs = [(out, leaf.grad) for outs, leaves in zip(self._outputs, self._leaves)
                 for out, leaf in zip(outs, leaves) if leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def shared_prompt_logps(
    model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor, temperature: float,
    with_entropy: bool = False, prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """completion_logps for k completions of one prompt, running the prompt forward once.

    prompt_ids: (1, P) unpadded; completion_ids, completion_mask: (k, L) right-padded. The prompt's KV
    cache (computed with gradient: LoRA touches its keys and values) is repeated for the k rows, and its
    last logit predicts every completion's first token. With `prefix` (shorter than the prompt, and the
    prompt's start), only the rest of the prompt runs here.
    """
    k, width = completion_ids.shape
    prompt_len = prompt_ids.shape[1]
    device = completion_ids.device
    start = prefix.length if prefix is not None else 0
    cache = prefix.cache() if prefix is not None else DynamicCache()
    prompt = model(input_ids=prompt_ids[:, start:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(k)
    attention_mask = torch.cat([completion_mask.new_ones((k, prompt_len)), completion_mask], 1)
    positions = torch.arange(prompt_len, prompt_len + width, device=device).expand(k, width)
    out = model(input_ids=completion_ids, attention_mask=attention_mask, position_ids=positions,
                past_key_values=cache, use_cache=True)
    first = prompt.logits[:, -1:, :].expand(k, 1, -1)
    return _token_logps(torch.cat([first, out.logits[:, :-1, :]], 1), completion_ids, temperature, with_entropy)


def _token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at the target tokens, in float32, and the entropies if asked."""
    log_probs = (logits.float() / temperature).log_softmax(-1)
    logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


def group_ids(instance_index: list[int], chunk_index: list[int], grouping: str) -> torch.Tensor:
    """Dense group id per sample: by instance (all chunk-samples of its G rollouts) or by (instance, chunk)."""
    if grouping == "instance":
        keys = list(instance_index)
    elif grouping == "chunk":
        keys = list(zip(instance_index, chunk_index))
    else:
        raise ValueError(f"advantage_grouping must be instance or chunk, not {grouping!r}")
    dense: dict = {}
    return torch.tensor([dense.setdefault(key, len(dense)) for key in keys], dtype=torch.long)
