"""KV caches for decoding: buffers reserved for the whole generation, and cascade attention.

Reserved buffers: a decode step writes its position in place, where transformers' default layer copies
the whole cache (torch.cat) every step (decode 15% faster at B*G = 32, bench/results/rollout.md).

Cascade attention: rows that continue the same prompt read one copy of its KV cache.

The G candidates of a step-level group (and of a trajectory group's first chunk) share their whole
~800-token prompt. Copying its KV cache to every row makes each decode step read G copies of it, and that
read is about half of a 32-row decode step on a CPU. Here the prompt's keys and values are kept once per
distinct prompt: a decode step attends the queries of all rows of a prompt to it together, attends each
row to its own generated tokens, and merges the two softmaxes by their maxima and sums (the split that
FlashInfer calls cascade attention). The result equals attention over the concatenated cache up to float
rounding; it runs in fp32 on whatever device the model is on.

Sliding-window layers (Gemma 3: 5 of every 6) see only the last `module.sliding_window` cache positions,
counted by cache index as transformers' masks count them; older prompt columns and generated tokens are
masked.

`generate` installs it for its decode loop only (`cascade_attention`): the model's attention implementation
is switched to ATTENTION and back, and every forward inside passes the cache as `cascade=`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer

ATTENTION = "memalpha_cascade"


class ReservedLayer(DynamicLayer):
    """A KV-cache layer whose keys and values live in a buffer of `capacity` positions, written in place;
    in `dtype` (default: that of the first keys written)."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity, self.buffer_dtype = capacity, dtype
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            batch, heads, _, dim = key_states.shape
            self.dtype = self.buffer_dtype or key_states.dtype
            self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim), dtype=self.dtype)
            self.value_buffer = value_states.new_empty((batch, heads, self.capacity, dim), dtype=self.dtype)
            self.device, self.is_initialized = key_states.device, True
        new = key_states.shape[-2]
        self.key_buffer[:, :, self.length : self.length + new] = key_states
        self.value_buffer[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._expose()
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._expose()

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]


def reserved_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache whose layers hold `capacity` positions without reallocating."""
    cache = DynamicCache()
    cache.layers = [ReservedLayer(capacity) for _ in range(model.config.num_hidden_layers)]
    return cache


class CascadeLayer(ReservedLayer):
    """One layer's cache: the distinct prompts' keys and values (fixed, fp32) and each row's generated
    tokens (a reserved fp32 buffer)."""

    def __init__(self, prompt_keys: torch.Tensor, prompt_values: torch.Tensor, capacity: int):
        super().__init__(capacity, torch.float32)
        self.prompt_keys, self.prompt_values = prompt_keys.float(), prompt_values.float()

    def get_seq_length(self) -> int:
        return self.prompt_keys.shape[-2] + self.length


class CascadeCache(DynamicCache):
    """A decode cache over distinct prompts: row r continues prompt `prompt_of_row[r]`.

    The rows of one prompt sit in a grid of `slots_per_prompt` slots so that their queries meet the
    prompt's keys in one matrix product; `slots` maps each row still generating to its slot."""

    def __init__(self, prompt_cache: DynamicCache, prompt_mask: torch.Tensor, prompt_of_row: list[int], capacity: int):
        super().__init__()
        self.layers = [CascadeLayer(layer.keys, layer.values, capacity) for layer in prompt_cache.layers]
        self.prompts = prompt_mask.shape[0]
        # additive: 0 on prompt tokens, -inf on padding; [prompts, 1, 1, width] broadcasts over heads and queries
        self.prompt_bias = torch.zeros(prompt_mask.shape, dtype=torch.float32, device=prompt_mask.device)
        self.prompt_bias = self.prompt_bias.masked_fill(prompt_mask == 0, float("-inf"))[:, None, None, :]
        rank, seen = [], [0] * self.prompts
        for prompt in prompt_of_row:
            rank.append(seen[prompt])
            seen[prompt] += 1
        self.slots_per_prompt = max(seen)
        self.slots = torch.tensor([p * self.slots_per_prompt + r for p, r in zip(prompt_of_row, rank)],
                                  dtype=torch.long, device=prompt_mask.device)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.slots = self.slots[indices]

    def attend_prompts(self, queries: torch.Tensor, layer: CascadeLayer,
                       first_visible: int = 0) -> tuple[torch.Tensor, ...]:
        """Attention of the rows' scaled queries [rows, kv_heads, queries_per_kv_head, dim] to their prompts'
        columns from `first_visible` on: (unnormalised output, row max of the scores, sum of
        exp(score - max)), each per row."""
        kv_heads, per_head, dim = queries.shape[1:]
        slots = self.slots_per_prompt
        grid = queries.new_zeros((self.prompts * slots, kv_heads, per_head, dim))
        grid[self.slots] = queries
        grid = grid.view(self.prompts, slots, kv_heads, per_head, dim).transpose(1, 2)
        grid = grid.reshape(self.prompts, kv_heads, slots * per_head, dim)
        scores = grid @ layer.prompt_keys.transpose(-1, -2) + self.prompt_bias
        if first_visible > 0:
            scores[..., :first_visible] = float("-inf")
        top = scores.amax(-1, keepdim=True)
        weights = (scores - top).exp()

        def per_row(x: torch.Tensor) -> torch.Tensor:
            x = x.view(self.prompts, kv_heads, slots, per_head, x.shape[-1]).transpose(1, 2)
            return x.reshape(self.prompts * slots, kv_heads, per_head, x.shape[-1])[self.slots]

        return per_row(weights @ layer.prompt_values), per_row(top), per_row(weights.sum(-1, keepdim=True))


def cascade_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                              cascade: CascadeCache | None = None, **kwargs):
    """The attention function registered as ATTENTION: `query` [rows, heads, 1, dim], `key`/`value` the
    rows' generated tokens [rows, kv_heads, generated, dim] (the current one included). Returns the
    output as [rows, 1, heads, dim], as transformers' attention functions do."""
    if cascade is None:
        raise ValueError(f"the {ATTENTION!r} attention needs the decode cache passed as `cascade=`")
    rows, heads, length, dim = query.shape
    if length != 1:
        raise ValueError(f"{ATTENTION!r} attention decodes one token per row, got {length}")
    kv_heads = key.shape[1]
    scale = dim ** -0.5 if scaling is None else scaling
    queries = query.float().view(rows, kv_heads, heads // kv_heads, dim) * scale
    layer = cascade.layers[module.layer_idx]
    width, generated = layer.prompt_keys.shape[-2], key.shape[2]
    window = getattr(module, "sliding_window", None)
    # the query sits at cache index width + generated - 1 and sees the indices above that minus the window
    first_visible = width + generated - window if window else 0
    scores = queries @ key.transpose(-1, -2)
    if first_visible > width:  # generated tokens have left the window too
        scores[..., : first_visible - width] = float("-inf")
    tail_top = scores.amax(-1, keepdim=True)
    weights = (scores - tail_top).exp()
    tail_out, tail_sum = weights @ value, weights.sum(-1, keepdim=True)
    if first_visible >= width:  # the whole prompt is outside the window
        out = tail_out / tail_sum
    else:
        prompt_out, prompt_top, prompt_sum = cascade.attend_prompts(queries, layer, first_visible)
        top = torch.maximum(prompt_top, tail_top)
        prompt_share, tail_share = (prompt_top - top).exp(), (tail_top - top).exp()
        out = (prompt_out * prompt_share + tail_out * tail_share) / (prompt_sum * prompt_share + tail_sum * tail_share)
    return out.view(rows, 1, heads, dim).to(query.dtype), None


AttentionInterface.register(ATTENTION, cascade_attention_forward)


@contextmanager
def cascade_attention(model):
    """Run the model's attention as ATTENTION inside the block (its forwards must pass `cascade=`)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
