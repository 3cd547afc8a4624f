"""Cascade attention: rows of a repeated prompt attend to one copy of its cache, as if each had its own."""

from types import SimpleNamespace

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from memalpha.training.kv_cache import CascadeCache, cascade_attention_forward


def _prompt_cache(keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    layer = DynamicLayer()
    layer.update(keys, values)
    cache.layers = [layer]
    return cache


def test_merged_attention_equals_attention_over_each_rows_whole_cache():
    """Three prompts (one left-padded), five rows (two repeat prompt 0, one drops out), two generated
    tokens: each row's output equals softmax attention over [its prompt without padding | its tokens]."""
    g = torch.Generator().manual_seed(0)
    prompts, kv_heads, heads, width, dim = 3, 2, 4, 6, 8
    prompt_keys = torch.randn(prompts, kv_heads, width, dim, generator=g)
    prompt_values = torch.randn(prompts, kv_heads, width, dim, generator=g)
    mask = torch.ones(prompts, width, dtype=torch.long)
    mask[1, :2] = 0
    prompt_of_row = [0, 1, 0, 2, 0]
    cache = CascadeCache(_prompt_cache(prompt_keys, prompt_values), mask, prompt_of_row, capacity=4)
    module = SimpleNamespace(layer_idx=0)
    rows = torch.arange(5)
    for step in range(2):
        if step == 1:  # row 2 finished: it leaves the cache
            rows = torch.tensor([0, 1, 3, 4])
            cache.batch_select_indices(torch.tensor([0, 1, 3, 4]))
        new_k = torch.randn(len(rows), kv_heads, 1, dim, generator=g)
        new_v = torch.randn(len(rows), kv_heads, 1, dim, generator=g)
        tail_k, tail_v = cache.layers[0].update(new_k, new_v)
        query = torch.randn(len(rows), heads, 1, dim, generator=g)
        out, _ = cascade_attention_forward(module, query, tail_k, tail_v, None, scaling=dim ** -0.5, cascade=cache)
        assert out.shape == (len(rows), 1, heads, dim)
        for i, row in enumerate(rows.tolist()):
            p = prompt_of_row[row]
            valid = mask[p].bool()
            keys = torch.cat([prompt_keys[p][:, valid], tail_k[i]], 1).repeat_interleave(heads // kv_heads, 0)
            values = torch.cat([prompt_values[p][:, valid], tail_v[i]], 1).repeat_interleave(heads // kv_heads, 0)
            expected = torch.nn.functional.scaled_dot_product_attention(query[i], keys, values)  # [heads, 1, dim]
            assert torch.allclose(out[i, 0], expected[:, 0], atol=1e-5)


def test_a_sliding_window_layer_sees_only_the_last_window_cache_positions():
    """Gemma 3's local layers: the query at cache index width + generated - 1 attends to the cache indices
    above that minus the window, as transformers' sliding-window mask counts them: first part of the
    prompt, then none of it, then not the oldest generated tokens either."""
    g = torch.Generator().manual_seed(1)
    kv_heads, heads, width, dim, window = 1, 2, 4, 4, 3
    prompt_keys = torch.randn(1, kv_heads, width, dim, generator=g)
    prompt_values = torch.randn(1, kv_heads, width, dim, generator=g)
    cache = CascadeCache(_prompt_cache(prompt_keys, prompt_values), torch.ones(1, width, dtype=torch.long), [0],
                         capacity=6)
    module = SimpleNamespace(layer_idx=0, sliding_window=window)
    for generated in range(1, 6):
        tail_k, tail_v = cache.layers[0].update(torch.randn(1, kv_heads, 1, dim, generator=g),
                                                torch.randn(1, kv_heads, 1, dim, generator=g))
        query = torch.randn(1, heads, 1, dim, generator=g)
        out, _ = cascade_attention_forward(module, query, tail_k, tail_v, None, scaling=dim ** -0.5, cascade=cache)
        keys = torch.cat([prompt_keys[0], tail_k[0]], 1)[:, -window:].repeat_interleave(heads, 0)
        values = torch.cat([prompt_values[0], tail_v[0]], 1)[:, -window:].repeat_interleave(heads, 0)
        expected = torch.nn.functional.scaled_dot_product_attention(query[0], keys, values)
        assert torch.allclose(out[0, 0], expected[:, 0], atol=1e-5)
        assert torch.isfinite(out).all()


def test_cascade_attention_refuses_calls_it_cannot_serve():
    query, key = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 1, 4)
    with pytest.raises(ValueError, match="cascade="):
        cascade_attention_forward(SimpleNamespace(layer_idx=0), query, key, key, None)
    with pytest.raises(ValueError, match="one token per row"):
        cascade_attention_forward(SimpleNamespace(layer_idx=0), torch.zeros(1, 2, 3, 4), key, key, None, cascade=object())
