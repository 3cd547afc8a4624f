"""Batched sampling with a KV cache that returns completion token ids and per-token log-probs.

One call generates a completion for every prompt of the batch (left-padded). Identical prompts (the G
candidates of a step-level group, the first chunk of a trajectory group) are prefilled once and their
KV cache copied to every row that asks for them; a row that finished is dropped from the batch, so the
decode steps only compute the rows still generating. Sampling uses a caller-owned `torch.Generator`
on the model's device, so a rollout is reproducible from the generator's state (saved in checkpoints).
The log-prob of a sampled token is log softmax(logits / temperature), TRL's convention (top-p only
restricts which tokens can be drawn). These are the sampling policy's log-probs; the trainer
recomputes the importance-ratio denominator in its own micro-batch layout (see trainer.py).
Every tensor is created on the model's device, so the same code runs on a CPU or a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


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
    prefilled_prompts: int = 0
    """Distinct prompts run through the prefill (identical prompts share one)."""

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)


def model_device(model) -> torch.device:
    """The device of the model's weights (where every input and generator must live)."""
    return next(model.parameters()).device


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) on `device` with every row right-aligned."""
    width = max(len(row) for row in rows)
    ids = [[pad_id] * (width - len(row)) + list(row) for row in rows]
    mask = [[0] * (width - len(row)) + [1] * len(row) for row in rows]
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device)


def right_pad(rows: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) on `device` with every row left-aligned."""
    width = max(len(row) for row in rows)
    ids = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    mask = [[1] * len(row) + [0] * (width - len(row)) for row in rows]
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device)


def distinct_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct rows in first-seen order, and for every row the index of its distinct row."""
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(tuple(row), len(first)) for row in rows]
    return [list(key) for key in first], inverse


class _ReservedLayer(DynamicLayer):
    """A KV-cache layer whose keys and values live in a buffer reserved for the whole generation: a decode
    step writes its position in place, where the default layer copies the whole cache (torch.cat) every
    step (decode 15% faster at B*G = 32 here, bench/results/rollout.md)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            batch, heads, _, dim = key_states.shape
            self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim))
            self.value_buffer = value_states.new_empty((batch, heads, self.capacity, dim))
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        new = key_states.shape[-2]
        self.key_buffer[:, :, self.length : self.length + new] = key_states
        self.value_buffer[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._expose()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._expose()

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]


def reserved_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache whose layers hold `capacity` positions without reallocating."""
    cache = DynamicCache()
    cache.layers = [_ReservedLayer(capacity) for _ in range(model.config.num_hidden_layers)]
    return cache


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
    share_prefill: bool = True,
) -> Generation:
    """Sample one completion per prompt (token ids, no special-token insertion) in one batched loop.
    `share_prefill=False` prefills every row, identical or not (the reference the shared path is tested
    against)."""
    if not prompts:
        return Generation([], [], [])
    device = model_device(model)
    if generator is not None and not greedy and generator.device.type != device.type:
        raise ValueError(f"the sampling generator is on {generator.device}, the model on {device}: "
                         "create it with torch.Generator(device=<the policy's device>)")
    distinct, inverse = distinct_rows(prompts) if share_prefill else (prompts, list(range(len(prompts))))
    ids, attn = left_pad(distinct, pad_token_id, device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    t0 = time.perf_counter()
    cache = reserved_cache(model, ids.shape[1] + max_new_tokens)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    t1 = time.perf_counter()
    rows = torch.tensor(inverse, dtype=torch.long, device=device)
    if len(distinct) < len(prompts):
        cache.batch_select_indices(rows)
    logits, attn, next_pos = out.logits[rows, -1, :], attn[rows], positions[rows, -1] + 1
    n = len(prompts)
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    alive = torch.arange(n, device=device)  # rows of the full batch still generating, in cache order
    for step in range(max_new_tokens):
        scaled = logits.float() / (1.0 if greedy else temperature)
        log_probs = scaled.log_softmax(-1)
        if greedy:
            token = scaled.argmax(-1)
        else:
            candidates = _top_p_filter(scaled, top_p) if top_p < 1.0 else scaled
            token = torch.multinomial(candidates.softmax(-1), 1, generator=generator).squeeze(1)
        tokens[alive, step] = token
        logps[alive, step] = log_probs.gather(-1, token.unsqueeze(1)).squeeze(1)
        lengths[alive] += 1
        done = torch.isin(token, eos)
        finished[alive[done]] = True
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if bool(done.any()):  # finished rows leave the batch and its cache
            keep = (~done).nonzero().squeeze(1)
            alive, token, attn, next_pos = alive[keep], token[keep], attn[keep], next_pos[keep]
            cache.batch_select_indices(keep)
        attn = torch.cat([attn, attn.new_ones((len(alive), 1))], dim=1)
        out = model(
            input_ids=token.unsqueeze(1), attention_mask=attn, position_ids=next_pos.unsqueeze(1),
            past_key_values=cache, use_cache=True,
        )
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    t2 = time.perf_counter()
    lengths_list, tokens_list, logps_list = lengths.tolist(), tokens.tolist(), logps.tolist()
    return Generation(
        completion_ids=[tokens_list[i][: lengths_list[i]] for i in range(n)],
        logps=[logps_list[i][: lengths_list[i]] for i in range(n)],
        truncated=[not f for f in finished.tolist()],
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        prefilled_prompts=len(distinct),
    )
