"""Write a memory for your own conversation with a trained writer (greedy, as evaluation writes)."""

from __future__ import annotations

from pathlib import Path

from memalpha.config import RunConfig


def write_memory(adapter: str | Path, chunks: list[str], config: RunConfig | None = None) -> dict:
    """The memory (core, semantic, episodic) a writer with the LoRA `adapter` builds from `chunks`, one
    writer call per chunk (chunks longer than the writer's chunk size are cut to it first);
    `config` sets the policy and the budgets (default: the recipe's). For many conversations, load the
    writer once: `memalpha.writer.MemoryWriter`."""
    from memalpha.writer import Conversation, MemoryWriter

    [memory] = MemoryWriter(adapter, config).write([Conversation("yours", chunks=list(chunks))])
    return {key: memory[key] for key in ("core", "semantic", "episodic") if key in memory}
