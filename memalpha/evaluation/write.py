"""Write a memory for your own conversation with a trained writer (greedy, as evaluation writes)."""

from __future__ import annotations

from pathlib import Path

from memalpha.config import RunConfig
from memalpha.data.schema import Instance


def write_memory(adapter: str | Path, chunks: list[str], config: RunConfig | None = None) -> dict:
    """The memory (core, semantic, episodic) a writer with the LoRA `adapter` builds from `chunks`, one
    writer call per chunk (chunks longer than the writer's chunk size are cut to it first);
    `config` sets the policy and the budgets (default: the recipe's)."""
    from memalpha.data.chunking import TokenCounts, fit_instance
    from memalpha.models.policy import load_policy
    from memalpha.teacher.record import writer_chunk_tokens
    from memalpha.training.rollout import write_unasked

    config = config or RunConfig()
    policy = load_policy(config.model, adapter=Path(adapter), trainable=False, seed=config.grpo.seed)
    instance = Instance("yours", "user", "accurate_retrieval", list(chunks), [])
    instance, _ = fit_instance(instance, TokenCounts(policy.tokenizer), writer_chunk_tokens(adapter))
    [(written, _)] = list(write_unasked(policy, [instance], config, batch_size=1))
    store = written[0].memory
    return {"core": store.paragraph("core"), **{s: [e.content for e in store.entries(s)] for s in ("semantic", "episodic")}}
