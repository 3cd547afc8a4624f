"""What pays on this machine for the two hot loops of a GRPO step: threads, micro-batch size, torch.compile.

1. Decoding: one new token for each of 32 rows over the KV cache of a 770-token writer prompt (a
   step-level group of 8 prompts x 4 as the rollout benchmark has it, here one prompt repeated), the
   adapter merged as in rollouts; `DECODE_STEPS` consecutive steps, so the cache grows as in generation.
   Timed with 1 and with all threads, eager and compiled.
2. The update: forward + backward of writer prompts with 48-token completions through the LoRA adapter,
   loss on the completion logits only (as `grpo.completion_logps`); micro-batches of 1, 2, 4 and 8 rows
   (seconds per row), and 2 rows eager against compiled.

Compiling uses `torch.compile(dynamic=True)` (growing caches and varying widths must not recompile every
call); its first calls are reported as compile time and excluded from the steady-state time. A compile
that fails is reported with its error, not hidden.

    python -m bench.run_all machinery      # writes bench/results/machinery.json and machinery.md
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

ROWS = 32
DECODE_STEPS = 12
UPDATE_ROWS = 2
COMPLETION = 48
REPEATS = 3
MICRO_BATCHES = (1, 2, 4, 8)


def _decode(model, cache, prompt_len: int, token: int) -> list[float]:
    """Seconds of each of DECODE_STEPS single-token steps for ROWS rows, from a copy of `cache`."""
    cache = copy.deepcopy(cache)
    ids = torch.full((ROWS, 1), token, dtype=torch.long)
    times = []
    with torch.no_grad():
        for i in range(DECODE_STEPS):
            positions = torch.full((ROWS, 1), prompt_len + i, dtype=torch.long)
            start = time.perf_counter()
            model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return times


def _update(model, rows: torch.Tensor) -> float:
    """Seconds of one forward + backward over `rows` with the loss on the completion logits."""
    start = time.perf_counter()
    logits = model(input_ids=rows, logits_to_keep=COMPLETION + 1).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _measure(run, repeats: int) -> dict[str, Any]:
    """First call (compile, for a compiled model) and the median of `repeats` further calls."""
    try:
        first = run()
        rest = [run() for _ in range(repeats)]
    except Exception as exc:  # a compile failure is a result on this machine
        return {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    flat = lambda value: sum(value) if isinstance(value, list) else value  # noqa: E731
    return {"first_call_s": round(flat(first), 3), "steady_s": round(statistics.median(flat(r) for r in rest), 3)}


def run() -> dict[str, Any]:
    from bench.bench_rollout import _prompts
    from memalpha.config import load_config
    from memalpha.models.policy import load_policy

    torch._dynamo.config.cache_size_limit = 64
    config = load_config(None, [])
    policy = load_policy(config.model, seed=0)
    prompt = _prompts(policy, config, 1)[0]
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                               "dtype": str(policy.dtype), "prompt_tokens": len(prompt)}

    with policy.merged_adapter():
        model = policy.model
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([prompt]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(ROWS)
        token = policy.tokenizer.eos_token_id
        decode = {"eager": _measure(lambda: _decode(model, cache, len(prompt), token), REPEATS)}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        decode["one_thread"] = _measure(lambda: _decode(model, cache, len(prompt), token), REPEATS)
        torch.set_num_threads(threads)
        compiled = torch.compile(model, dynamic=True)
        decode["compiled"] = _measure(lambda: _decode(compiled, cache, len(prompt), token), REPEATS)
        torch._dynamo.reset()
    results["decode"] = {**decode, "rows": ROWS, "steps": DECODE_STEPS}

    generator = torch.Generator().manual_seed(0)
    rows = torch.tensor([prompt + torch.randint(100, 40000, (COMPLETION,), generator=generator).tolist()
                         for _ in range(UPDATE_ROWS)])
    policy.model.train()
    update = {"eager": _measure(lambda: _update(policy.model, rows), REPEATS)}
    compiled = torch.compile(policy.model, dynamic=True)
    update["compiled"] = _measure(lambda: _update(compiled, rows), REPEATS)
    torch._dynamo.reset()
    results["update"] = {**update, "rows": UPDATE_ROWS, "tokens_per_row": rows.shape[1]}
    per_row = {}
    for size in MICRO_BATCHES:
        batch = rows[:1].expand(size, -1).contiguous()
        timing = _measure(lambda: _update(policy.model, batch), 1)
        per_row[str(size)] = round(timing["steady_s"] / size, 3)
    results["update_seconds_per_row"] = per_row
    for part in ("decode", "update"):
        eager, comp = results[part]["eager"], results[part]["compiled"]
        if "steady_s" in eager and "steady_s" in comp:
            results[part]["speedup"] = round(eager["steady_s"] / comp["steady_s"], 2)
            extra = comp["first_call_s"] - eager["steady_s"]
            saved = eager["steady_s"] - comp["steady_s"]
            results[part]["calls_to_repay_compile"] = round(extra / saved) if saved > 0 else None
    return results


def to_markdown(results: dict[str, Any]) -> str:
    decode = results["decode"]
    lines = [
        "# Benchmark: threads, micro-batches, torch.compile", "",
        f"torch {results['torch']}, {results['threads']} threads, {results['dtype']}, writer prompt of "
        f"{results['prompt_tokens']} tokens. Decode: {results['decode']['steps']} single-token steps for "
        f"{results['decode']['rows']} rows over the prompt's cache (adapter merged). Update: forward + backward "
        f"of {results['update']['rows']} rows of {results['update']['tokens_per_row']} tokens through the LoRA adapter. "
        "Steady = median of 3 calls after the first; first call = compile time for the compiled model.", "",
        "| loop | eager steady s | compiled first call s | compiled steady s | speedup | calls to repay the compile |",
        "|---|---|---|---|---|---|",
    ]
    for part in ("decode", "update"):
        r = results[part]
        comp = r["compiled"]
        if "failed" in comp:
            lines.append(f"| {part} | {r['eager'].get('steady_s')} | failed: {comp['failed']} | | | |")
            continue
        lines.append(f"| {part} | {r['eager']['steady_s']} | {comp['first_call_s']} | {comp['steady_s']} | "
                     f"{r.get('speedup')} | {r.get('calls_to_repay_compile')} |")
    lines += [
        "", f"Decode with 1 thread: {decode['one_thread'].get('steady_s')} s against {decode['eager'].get('steady_s')} s "
        f"with {results['threads']}.", "",
        "| update micro-batch (rows) | " + " | ".join(results["update_seconds_per_row"]) + " |",
        "|---|" + "---|" * len(results["update_seconds_per_row"]),
        "| seconds per row | " + " | ".join(str(v) for v in results["update_seconds_per_row"].values()) + " |",
    ]
    return "\n".join(lines) + "\n"
