"""Data-prep throughput at 1M tokens: chunking (policy tokenizer and regex counter), validation (expectation
suite + semantic checks) and synthetic generation. `run()` returns the numbers; bench/run_all.py saves them."""

from __future__ import annotations

import re
import time
from typing import Any

TARGET_TOKENS = 1_000_000
CHUNK_TOKENS = 2048
_LINE = re.compile(r"^([^:\n]+): (.*)$")


def _policy_tokenizer() -> tuple[Any, str]:
    """The default policy's tokenizer (SmolLM2); the regex counter when the model is not prepared."""
    from memalpha.config import DEFAULT_POLICY
    from memalpha.models.loading import (
        ModelNotPreparedError,
        load_tokenizer,
        resolve_model_path,
    )
    from memalpha.tokens import regex_token_count

    try:
        return load_tokenizer(resolve_model_path(DEFAULT_POLICY)), DEFAULT_POLICY
    except ModelNotPreparedError:
        return regex_token_count, "regex (default policy not prepared)"


def _turns_from(instances) -> list:
    """Recover dialogue turns from synthetic chunks: a realistic raw conversation to chunk again."""
    from memalpha.data.chunking import Turn

    turns = []
    for inst in instances:
        for chunk in inst.chunks:
            date = chunk.split(" from ", 1)[1].split(". Please", 1)[0]
            for line in chunk.split("\n\n", 1)[1].splitlines():
                if line.startswith("Later, on "):
                    date = line[len("Later, on "):-1]
                elif m := _LINE.match(line):
                    turns.append(Turn(m.group(2), m.group(1), date, f"t{len(turns)}"))
    return turns


class _Timer:
    """Wall and CPU time of a block (CPU time is less sensitive to other people's jobs on a shared machine)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def rate(self, tokens: int) -> dict[str, float]:
        return {"tokens": tokens, "seconds": round(self.wall, 3), "cpu_seconds": round(self.cpu, 3),
                "tokens_per_s": round(tokens / self.wall), "tokens_per_cpu_s": round(tokens / self.cpu)}


def run() -> dict[str, Any]:
    """Measure; every number is one timed run on the current machine."""
    from memalpha.data.chunking import TokenCounts, chunk_turns
    from memalpha.data.synth import SynthConfig, generate
    from memalpha.data.validation import Limits, validate
    from memalpha.tokens import regex_token_count

    tokenizer, name = _policy_tokenizer()
    counter = TokenCounts(tokenizer)
    results: dict[str, Any] = {"tokenizer": name, "chunk_tokens": CHUNK_TOKENS, "target_tokens": TARGET_TOKENS}

    # Synthetic generation with the policy tokenizer: 4 instances of ~250K tokens.
    per_instance = TARGET_TOKENS // 4 // CHUNK_TOKENS
    cfg = SynthConfig(instances=4, chunks_per_instance=(per_instance,), chunk_tokens=CHUNK_TOKENS, facts_per_instance=12)
    with _Timer() as timer:
        instances = generate(cfg, counter)
    results["synth_generation"] = timer.rate(sum(inst.metadata["num_tokens"] for inst in instances))

    turns = _turns_from(instances)
    results["turns"] = len(turns)
    for label, tok in (("chunking", counter), ("chunking_regex", TokenCounts(regex_token_count))):
        with _Timer() as timer:
            chunked = chunk_turns(turns, tok, CHUNK_TOKENS)
        results[label] = {**timer.rate(sum(chunked.token_counts)), "chunks": len(chunked.chunks),
                          "max_chunk_tokens": max(chunked.token_counts)}

    with _Timer() as timer:
        import great_expectations  # noqa: F401  (one-time import cost, reported on its own)
    results["gx_import_seconds"] = round(timer.wall, 3)
    with _Timer() as timer:
        result = validate(instances, counter, Limits.from_config())
    results["validation"] = {**timer.rate(result.counts["tokens_valid"]), "questions": result.counts["questions_in"],
                             "rejected": len(result.rejected)}
    return results


def to_markdown(results: dict[str, Any]) -> str:
    """Throughput table for bench/results/data.md."""
    rows = [f"| {label} | {results[key]['tokens']:,} | {results[key]['seconds']} | {results[key]['tokens_per_s']:,} | "
            f"{results[key]['cpu_seconds']} | {results[key]['tokens_per_cpu_s']:,} |"
            for key, label in (("synth_generation", "synthetic generation"), ("chunking", "chunking (policy tokenizer)"),
                               ("chunking_regex", "chunking (regex counter)"), ("validation", "validation (GX + semantic)"))]
    return (f"# Benchmark: data\n\nTokenizer: {results['tokenizer']}; chunks of {results['chunk_tokens']} tokens; "
            f"{results['turns']:,} turns. great-expectations import: {results['gx_import_seconds']} s (once, not in "
            "the validation time).\n\n| step | tokens | wall s | tokens/s | CPU s | tokens/CPU s |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
