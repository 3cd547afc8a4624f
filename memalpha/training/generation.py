"""Batched sampling with a KV cache that returns completion token ids and per-token log-probs.

One call generates a completion for every prompt of the batch (left-padded). Identical prompts (the G
candidates of a step-level group, the first chunk of a trajectory group) are prefilled once, and the
rows that ask for them decode against that one copy of its KV cache (memalpha.training.kv_cache); the prefix all
distinct prompts share (the writer's system prompt, about a third of a writer prompt) is prefilled once
before their different tails; a row that finished is dropped from the batch, so the decode steps only
compute the rows still generating. Sampling uses a caller-owned `torch.Generator` on the model's device,
so a rollout is reproducible from the generator's state (saved in checkpoints); a token is drawn by
inverting the cumulative distribution with one uniform number per row.
The log-prob of a sampled token is log softmax(logits / temperature), TRL's convention (top-p only
restricts which tokens can be drawn). These are the sampling policy's log-probs; the trainer
recomputes the importance-ratio denominator in its own micro-batch layout (see trainer.py).
Every tensor is created on the model's device, so the same code runs on a CPU or a GPU.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from memalpha.training.kv_cache import CascadeCache, cascade_attention, reserved_cache


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
    shared_prefix_tokens: int = 0
    """Length of the prefix common to the distinct prompts, prefilled once for all of them."""

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)


def model_device(model) -> torch.device:
    """The device of the model's weights (where every input and generator must live)."""
    return next(model.parameters()).device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so a wall-clock split (prefill / decode) is not launch time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


MIN_SHARED_PREFIX = 16
"""Shortest common prefix (tokens) worth a forward pass of its own."""


def keep_last(count: int, width: int, device: torch.device | str) -> torch.Tensor:
    """`logits_to_keep` for the last `count` of `width` positions, as an index tensor. An int makes
    transformers slice hidden[:, -count:], a strided view that the CPU lm_head multiplies about 100x
    slower (it expands the vocabulary matrix per row); indexing gives a contiguous copy."""
    return torch.arange(width - count, width, device=device)


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest prefix shared by every row."""
    shortest = min(len(row) for row in rows)
    for i in range(shortest):
        if any(row[i] != rows[0][i] for row in rows):
            return i
    return shortest


def shareable_prefix_length(rows: list[list[int]]) -> int:
    """Length of the prefix worth running once for all rows (two or more): their common prefix, less one
    token so every row keeps a tail to predict from, or 0 when that is shorter than MIN_SHARED_PREFIX."""
    if len(rows) < 2:
        return 0
    length = min(common_prefix_length(rows), min(len(row) for row in rows) - 1)
    return length if length >= MIN_SHARED_PREFIX else 0


def distinct_rows(rows: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct rows in first-seen order, and for every row the index of its distinct row."""
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(tuple(row), len(first)) for row in rows]
    return [list(key) for key in first], inverse


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` (rows need not sum to 1), drawn by inverting the cumulative
    distribution with one uniform number per row: torch.multinomial draws an exponential number per
    vocabulary entry, a sixth of a CPU decode step at 32 rows x 49k tokens. float64 keeps the tail exact."""
    cumulative = probs.double().cumsum(-1)
    uniform = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=probs.device)
    token = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    return token.clamp_(max=probs.shape[-1] - 1)


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
    `share_prefill=False` prefills every row whole, identical or not, sharing no prefix (the reference the
    shared paths are tested against)."""
    if not prompts:
        return Generation([], [], [])
    device = model_device(model)
    if generator is not None and not greedy and generator.device.type != device.type:
        raise ValueError(f"the sampling generator is on {generator.device}, the model on {device}: "
                         "create it with torch.Generator(device=<the policy's device>)")
    distinct, inverse = distinct_rows(prompts) if share_prefill else (prompts, list(range(len(prompts))))
    t0 = time.perf_counter()
    out, attn, positions, cache, prefix = _prefill(model, distinct, pad_token_id, max_new_tokens, device, share_prefill)
    synchronize(device)
    t1 = time.perf_counter()
    rows = torch.tensor(inverse, dtype=torch.long, device=device)
    cascade = len(distinct) < len(prompts)  # repeated prompts: their rows read one copy of the prompt cache
    if cascade:
        cache = CascadeCache(cache, attn, inverse, max_new_tokens)
    logits, attn, next_pos = out.logits[rows, -1, :], attn[rows], positions[rows, -1] + 1
    n = len(prompts)
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    alive = torch.arange(n, device=device)  # rows of the full batch still generating, in cache order
    with cascade_attention(model) if cascade else nullcontext():
        for step in range(max_new_tokens):
            scaled = logits.float() / (1.0 if greedy else temperature)
            log_probs = scaled.log_softmax(-1)
            if greedy:
                token = scaled.argmax(-1)
            else:
                candidates = _top_p_filter(scaled, top_p) if top_p < 1.0 else scaled
                token = sample_tokens(candidates.softmax(-1), generator)
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
            if cascade:
                attention = {"cascade": cache}
            else:
                attn = torch.cat([attn, attn.new_ones((len(alive), 1))], dim=1)
                attention = {"attention_mask": attn}
            out = model(input_ids=token.unsqueeze(1), position_ids=next_pos.unsqueeze(1), past_key_values=cache,
                        use_cache=True, **attention)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
    synchronize(device)
    t2 = time.perf_counter()
    lengths_list, tokens_list, logps_list = lengths.tolist(), tokens.tolist(), logps.tolist()
    return Generation(
        completion_ids=[tokens_list[i][: lengths_list[i]] for i in range(n)],
        logps=[logps_list[i][: lengths_list[i]] for i in range(n)],
        truncated=[not f for f in finished.tolist()],
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        prefilled_prompts=len(distinct),
        shared_prefix_tokens=prefix,
    )


def _prefill(model, prompts: list[list[int]], pad_token_id: int, max_new_tokens: int, device: torch.device,
             share_prefix: bool) -> tuple:
    """Run the prompts into a fresh cache: (output with the last position's logits, attention mask,
    position ids, cache, length of the shared prefix). With `share_prefix`, a prefix common to all
    prompts runs once and its cache is copied to every row before the tails run; the padding then sits
    between prefix and tail, masked."""
    prefix = shareable_prefix_length(prompts) if share_prefix else 0
    ids, attn = left_pad([p[prefix:] for p in prompts], pad_token_id, device)
    cache = reserved_cache(model, prefix + ids.shape[1] + max_new_tokens)
    if prefix:
        model(input_ids=torch.tensor([prompts[0][:prefix]], device=device), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        cache.batch_select_indices(torch.zeros(len(prompts), dtype=torch.long, device=device))
    positions = prefix + (attn.cumsum(-1) - 1).clamp(min=0)
    attn = torch.cat([attn.new_ones((len(prompts), prefix)), attn], 1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=keep_last(1, ids.shape[1], device))
    return out, attn, positions, cache, prefix
