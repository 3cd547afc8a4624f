"""Deterministic train/validation/test split by instance: a hash of (seed, instance_id) picks the split,
so an instance keeps its split when others are added or removed, and the result does not depend on
row order."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from memalpha.config import ConfigError
from memalpha.data.schema import SPLITS, Instance


def split_of(instance_id: str, ratios: tuple[float, float, float] | list[float], seed: int = 0) -> str:
    """The split of one instance id."""
    if len(ratios) != 3 or any(r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ConfigError(f"data.split_ratios: need three non-negative shares with a positive sum, got {list(ratios)}")
    digest = hashlib.sha256(f"{seed}:{instance_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    total = sum(ratios)
    edge = 0.0
    for name, share in zip(SPLITS, ratios):
        edge += share / total
        if u < edge:
            return name
    return SPLITS[-1]


def assign_splits(instances: list[Instance], ratios: tuple[float, float, float] | list[float] = (0.8, 0.1, 0.1),
                  seed: int = 0, keep_existing: bool = True) -> list[Instance]:
    """Instances with `split` set; a valid existing split is kept unless keep_existing is False."""
    return [inst if keep_existing and inst.split in SPLITS else replace(inst, split=split_of(inst.instance_id, ratios, seed))
            for inst in instances]
