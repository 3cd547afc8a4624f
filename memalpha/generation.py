"""Batched sampling with a KV cache that returns completion token ids and per-token log-probs.

One call generates a completion for every prompt of the batch (left-padded). Sampling uses a
caller-owned `torch.Generator`, so a rollout is reproducible from the generator's state (saved in
checkpoints). The log-prob of a sampled token is log softmax(logits / temperature), TRL's convention
(top-p only restricts which tokens can be drawn). These are the sampling policy's log-probs; the
trainer recomputes the importance-ratio denominator in its own micro-batch layout (see trainer.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Generation:
    """Completions of one batched call, row-aligned with the prompts."""

    completion_ids: list[list[int]]
    logps: list[list[float]]
    """Per-token log-probs under the sampling policy (temperature-scaled logits)."""
    truncated: list[bool]
    """True when the completion hit max_new_tokens without an end-of-sequence token."""
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) with every row right-aligned."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the smallest set whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative - sorted_logits.softmax(-1) >= top_p  # keeps the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Generation:
    """Sample one completion per prompt (token ids, no special-token insertion) in one batched loop."""
    if not prompts:
        return Generation([], [], [])
    ids, attn = left_pad(prompts, pad_token_id)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    n = len(prompts)
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
    finished = torch.zeros(n, dtype=torch.bool)
    tokens_out: list[torch.Tensor] = []
    logps_out: list[torch.Tensor] = []
    alive_out: list[torch.Tensor] = []
    t0 = time.perf_counter()
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    next_pos = positions[:, -1] + 1
    for step in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()
        scaled = logits / (1.0 if greedy else temperature)
        log_probs = scaled.log_softmax(-1)
        if greedy:
            token = scaled.argmax(-1)
        else:
            candidates = _top_p_filter(scaled, top_p) if top_p < 1.0 else scaled
            token = torch.multinomial(candidates.softmax(-1), 1, generator=generator).squeeze(1)
        token = torch.where(finished, torch.full_like(token, pad_token_id), token)
        tokens_out.append(token)
        logps_out.append(log_probs.gather(-1, token.unsqueeze(1)).squeeze(1))
        alive_out.append(~finished)
        finished = finished | torch.isin(token, eos)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype)], dim=1)
        out = model(
            input_ids=token.unsqueeze(1), attention_mask=attn, position_ids=next_pos.unsqueeze(1),
            past_key_values=out.past_key_values, use_cache=True,
        )
        next_pos = next_pos + 1
    t2 = time.perf_counter()
    tokens = torch.stack(tokens_out, 1)
    logps = torch.stack(logps_out, 1)
    alive = torch.stack(alive_out, 1)
    lengths = alive.sum(1).tolist()
    return Generation(
        completion_ids=[tokens[i, : lengths[i]].tolist() for i in range(n)],
        logps=[logps[i, : lengths[i]].tolist() for i in range(n)],
        truncated=[not bool(finished[i]) for i in range(n)],
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
    )
