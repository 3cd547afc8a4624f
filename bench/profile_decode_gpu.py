"""Where a decode step's time goes on a CUDA GPU: 32 rows (8 writer prompts x 4), 8 and 48 tokens, shared and
unshared prefill, then torch.profiler over a 16-token call. Needs CUDA and the default policy:

    python -m bench.profile_decode_gpu   # bench/results/rollout_gpu_profile.txt holds one run's output
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_rollout import _prompts
from memalpha.config import load_config
from memalpha.models.policy import load_policy
from memalpha.training.generation import generate

config = load_config("configs/default.yaml", ["model.device=cuda"])
policy = load_policy(config.model)
prompts = [p for p in _prompts(policy, config, 8) for _ in range(4)]
print("attention implementation:", policy.model.config._attn_implementation)


def run(share, tokens=48):
    with policy.merged_adapter():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(policy.model, prompts, max_new_tokens=tokens, eos_token_ids=[], temperature=1.0,
                       pad_token_id=policy.tokenizer.pad_token_id,
                       generator=torch.Generator(device="cuda").manual_seed(0), share_prefill=share)
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


run(True)
for share in (True, False):
    for tokens in (8, 48):
        seconds, out = run(share, tokens)
        print(f"share={share} tokens={tokens}: {seconds:.2f} s, prefill {out.prefill_s:.3f} s, decode {out.decode_s:.3f} s "
              f"= {1000 * out.decode_s / (tokens - 1):.1f} ms per decode step")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    run(True, 16)
table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
print(table)
events = prof.key_averages()
kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
cuda_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
print(f"CUDA kernels in 16-token run: {kernels}, ~{kernels / 16:.0f} per step; GPU busy {cuda_us / 1e3:.1f} ms in all")
