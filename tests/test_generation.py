"""Batched sampling: shapes, reproducibility, padding invariance and exact log-probs."""

import pytest
import torch

from memalpha.models.loading import build_tiny
from memalpha.training.generation import (
    MIN_SHARED_PREFIX,
    generate,
    left_pad,
    sample_tokens,
    shareable_prefix_length,
)
from memalpha.training.grpo import completion_logps


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny(seed=1)
    return model, tokenizer


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in (7, 3, 12, 5)]


def _gen(model, tokenizer, prompts, seed=0, **kw):
    args = dict(max_new_tokens=10, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                temperature=1.0, generator=torch.Generator().manual_seed(seed))
    args.update(kw)
    return generate(model, prompts, **args)


def test_shapes_and_reproducibility(tiny):
    model, tokenizer = tiny
    a = _gen(model, tokenizer, _prompts(), seed=0)
    b = _gen(model, tokenizer, _prompts(), seed=0)
    c = _gen(model, tokenizer, _prompts(), seed=1)
    assert len(a.completion_ids) == 4
    assert all(1 <= len(ids) <= 10 for ids in a.completion_ids)
    assert all(len(ids) == len(lp) for ids, lp in zip(a.completion_ids, a.logps))
    assert all(x <= 0 for lp in a.logps for x in lp)
    assert a.completion_ids == b.completion_ids and a.logps == b.logps
    assert a.completion_ids != c.completion_ids
    assert a.num_tokens == sum(len(ids) for ids in a.completion_ids)


def test_generation_logps_match_full_forward(tiny):
    """The sampling log-probs equal a fresh forward pass over [left-padded prompt | completion] (fp32)."""
    model, tokenizer = tiny
    prompts = _prompts()
    out = _gen(model, tokenizer, prompts, temperature=0.7)
    for prompt, ids, lps in zip(prompts, out.completion_ids, out.logps):
        full = torch.tensor([prompt + ids])
        recomputed, _ = completion_logps(model, full, torch.ones_like(full), len(ids), 0.7)
        assert torch.allclose(recomputed[0], torch.tensor(lps), atol=1e-4)
    # and in one padded batch laid out as the trainer does
    ids, attn = left_pad([p for p in prompts], tokenizer.pad_token_id, "cpu")
    width = max(len(c) for c in out.completion_ids)
    comp = torch.full((4, width), tokenizer.pad_token_id)
    cmask = torch.zeros((4, width), dtype=torch.long)
    for i, c in enumerate(out.completion_ids):
        comp[i, : len(c)] = torch.tensor(c)
        cmask[i, : len(c)] = 1
    batched, _ = completion_logps(model, torch.cat([ids, comp], 1), torch.cat([attn, cmask], 1), width, 0.7)
    for i, lps in enumerate(out.logps):
        assert torch.allclose(batched[i, : len(lps)], torch.tensor(lps), atol=1e-4)


def test_sliding_window_model_logps_match_the_trainers_padded_forward():
    """A tiny Gemma 3 (sliding-window layers, window 4: shorter than most prompts and than the 6 new
    tokens), repeated prompts decoding with cascade attention: sampling log-probs equal a forward over
    the same left-padded batch, so the window is applied while decoding as in training."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = Gemma3ForCausalLM(config).eval()
    distinct = _prompts()
    prompts = [distinct[0], distinct[0], distinct[2], distinct[2], distinct[1]]
    out = generate(model, prompts, max_new_tokens=6, eos_token_ids=[1], pad_token_id=0, temperature=1.0,
                   generator=torch.Generator().manual_seed(0))
    assert max(len(c) for c in out.completion_ids) > 4
    ids, attn = left_pad(prompts, 0, "cpu")
    width = max(len(c) for c in out.completion_ids)
    comp, cmask = torch.zeros((5, width), dtype=torch.long), torch.zeros((5, width), dtype=torch.long)
    for i, c in enumerate(out.completion_ids):
        comp[i, : len(c)], cmask[i, : len(c)] = torch.tensor(c), 1
    batched, _ = completion_logps(model, torch.cat([ids, comp], 1), torch.cat([attn, cmask], 1), width, 1.0)
    for i, lps in enumerate(out.logps):
        assert torch.allclose(batched[i, : len(lps)], torch.tensor(lps), atol=1e-4)


def test_batched_greedy_equals_one_at_a_time(tiny):
    model, tokenizer = tiny
    prompts = _prompts()
    batched = _gen(model, tokenizer, prompts, greedy=True)
    for i, prompt in enumerate(prompts):
        single = _gen(model, tokenizer, [prompt], greedy=True)
        assert single.completion_ids[0] == batched.completion_ids[i]


def test_eos_stops_a_row_and_truncation_flag(tiny):
    model, tokenizer = tiny
    prompts = _prompts()
    first = _gen(model, tokenizer, prompts, greedy=True, max_new_tokens=1).completion_ids[0][0]
    out = _gen(model, tokenizer, prompts, greedy=True, eos_token_ids=[first])
    assert out.completion_ids[0] == [first] and out.truncated[0] is False
    others = [i for i in range(1, 4) if first not in out.completion_ids[i]]
    assert all(len(out.completion_ids[i]) == 10 and out.truncated[i] for i in others)


def test_top_p_restricts_to_the_most_likely_token(tiny):
    model, tokenizer = tiny
    prompts = _prompts()
    greedy = _gen(model, tokenizer, prompts, greedy=True, max_new_tokens=1)
    nucleus = _gen(model, tokenizer, prompts, top_p=1e-6, max_new_tokens=1, seed=5)
    assert nucleus.completion_ids == greedy.completion_ids


def test_identical_prompts_share_one_prefill_and_sample_as_unshared(tiny):
    """Prompts repeated G times (a step-level group) are prefilled once; the tokens and log-probs equal
    those of prefilling every copy, under the same seed."""
    model, tokenizer = tiny
    prompts = [p for p in _prompts()[:2] for _ in range(3)] + [_prompts()[0]]
    shared = _gen(model, tokenizer, prompts, seed=4)
    unshared = _gen(model, tokenizer, prompts, seed=4, share_prefill=False)
    assert shared.prefilled_prompts == 2 and unshared.prefilled_prompts == 7
    assert shared.completion_ids == unshared.completion_ids
    for a, b in zip(shared.logps, unshared.logps):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert len(set(map(tuple, shared.completion_ids[:3]))) > 1  # the copies are sampled independently


def test_repeated_prompts_whose_rows_finish_early_decode_as_unshared(tiny):
    """Rows of a repeated prompt read one copy of its cache (cascade attention); rows that stop early leave
    it. Greedy and sampled tokens and log-probs equal those of giving every row its own prefill."""
    model, tokenizer = tiny
    prompts = [p for p in _prompts()[:3] for _ in range(3)]
    greedy = _gen(model, tokenizer, prompts, greedy=True, share_prefill=False)
    stop = next(t for t in greedy.completion_ids[3] if t not in greedy.completion_ids[0])  # prompt 1's rows stop
    for kw in ({"greedy": True}, {"seed": 6}):
        shared = _gen(model, tokenizer, prompts, eos_token_ids=[stop], **kw)
        unshared = _gen(model, tokenizer, prompts, eos_token_ids=[stop], share_prefill=False, **kw)
        assert shared.prefilled_prompts == 3
        assert shared.completion_ids == unshared.completion_ids
        if kw.get("greedy"):
            assert len(shared.completion_ids[3]) < 10 and len(shared.completion_ids[0]) == 10
        for a, b in zip(shared.logps, unshared.logps):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_rows_that_finish_leave_the_batch_without_changing_the_others(tiny):
    """Once a row emits end-of-sequence it is dropped from the decode batch; the rows still generating
    keep exact log-probs (checked against a full forward pass) and the finished row stops at its eos."""
    model, tokenizer = tiny
    prompts = _prompts()
    greedy = _gen(model, tokenizer, prompts, greedy=True)
    stop = greedy.completion_ids[1][2]  # row 1 finishes within three tokens
    out = _gen(model, tokenizer, prompts, greedy=True, eos_token_ids=[stop])
    assert len(out.completion_ids[1]) <= 3 and not out.truncated[1]
    assert any(len(ids) == 10 for ids in out.completion_ids)  # and some row generated after it left
    for prompt, ids, lps, full_ids in zip(prompts, out.completion_ids, out.logps, greedy.completion_ids):
        expected = full_ids[: full_ids.index(stop) + 1] if stop in full_ids else full_ids
        assert ids == expected
        full = torch.tensor([prompt + ids])
        recomputed, _ = completion_logps(model, full, torch.ones_like(full), len(ids), 1.0)
        assert torch.allclose(recomputed[0], torch.tensor(lps), atol=1e-4)



def test_a_prefix_common_to_all_prompts_is_prefilled_once_and_samples_as_unshared(tiny):
    """Distinct prompts behind one system prompt: the prefix runs once, the tails after it (padding
    between them); tokens and log-probs equal those of prefilling every prompt whole, under the same seed."""
    model, tokenizer = tiny
    system = torch.randint(5, 300, (MIN_SHARED_PREFIX + 4,), generator=torch.Generator().manual_seed(8)).tolist()
    prompts = [system + tail for tail in _prompts()] + [system + _prompts()[1]]
    shared = _gen(model, tokenizer, prompts, seed=2)
    unshared = _gen(model, tokenizer, prompts, seed=2, share_prefill=False)
    assert shared.prefilled_prompts == 4 and shared.shared_prefix_tokens == len(system)
    assert unshared.shared_prefix_tokens == 0
    assert shared.completion_ids == unshared.completion_ids
    for a, b in zip(shared.logps, unshared.logps):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    greedy = _gen(model, tokenizer, prompts[:2], greedy=True)
    assert greedy.completion_ids == [_gen(model, tokenizer, [p], greedy=True).completion_ids[0] for p in prompts[:2]]


def test_the_shareable_prefix_leaves_every_row_a_tail_and_skips_short_or_lone_prefixes():
    system = list(range(MIN_SHARED_PREFIX + 4))
    assert shareable_prefix_length([system + [7, 8], system + [9]]) == len(system)
    assert shareable_prefix_length([system, system + [9]]) == len(system) - 1  # the shorter row keeps a token
    assert shareable_prefix_length([system[:MIN_SHARED_PREFIX - 1] + [1], system[:MIN_SHARED_PREFIX - 1] + [2]]) == 0
    assert shareable_prefix_length([system + [7]]) == 0


def test_sample_tokens_follows_the_distribution_and_never_draws_a_masked_token():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 2.0]]).repeat(10_000, 1)
    tokens = sample_tokens(probs, torch.Generator().manual_seed(0)).view(10_000, 2)
    shares = torch.bincount(tokens[:, 0], minlength=4).float() / 10_000
    assert torch.allclose(shares, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.02)
    assert shares[3] == 0 and (tokens[:, 1] == 3).all()
    again = sample_tokens(probs, torch.Generator().manual_seed(0)).view(10_000, 2)
    assert torch.equal(tokens, again)
