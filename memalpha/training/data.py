"""Training data as the trainer sees it: the prepared dataset's splits, restricted to the run's
competencies and cut to the chunks a step trains on (`truncate_for_training`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.data.synth import PRESETS, SynthConfig
from memalpha.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class TrainingData:
    """Instances by split, truncated for training, and how many each split lost to truncation."""

    splits: dict[str, list[Instance]]
    dropped: dict[str, int]
    """Per split: instances dropped because no question stayed answerable from the kept chunks."""


def load_training_data(config: RunConfig, tokenizer=None, path: str | Path | None = None,
                       synth: SynthConfig | None = None) -> TrainingData:
    """Instances of `path` (default data.train_path) by split, restricted to config.data.competencies and truncated
    to data.max_chunks_per_instance (questions whose evidence does not all survive are dropped, then
    instances without a question; truncate_for_training).

    A missing dataset folder is generated first with `synth` (default: the seeded synthetic `train`
    preset), so training works on a fresh machine. With `data.mix` (and no `path`) the folders of the mix
    are read and mixed by weight (`mix_splits`).
    """
    if path is None and config.data.mix:
        return mix_splits([load_training_data(config, tokenizer, folder, synth) for folder in config.data.mix],
                          list(config.data.mix.values()), config.grpo.seed)
    from memalpha.data.io import read_dataset

    path = Path(path or config.data.train_path)
    if not path.exists():
        from memalpha.data.prep import synthesize

        log.info("dataset %s not found: generating it (synthetic)", path)
        synth = synth or replace(PRESETS["train"], competencies=tuple(config.data.competencies), seed=config.data.split_seed)
        synthesize(path, synth, tokenizer=tokenizer or _regex_tokenizer(), data_cfg=config.data,
                   tokenizer_name=getattr(tokenizer, "name_or_path", "regex"))
    wanted = set(config.data.competencies)
    splits: dict[str, list[Instance]] = {"train": [], "validation": [], "test": []}
    for instance in read_dataset(path):
        if instance.competency in wanted:
            splits.setdefault(instance.split, []).append(instance)
    dropped = {}
    for split, instances in splits.items():
        splits[split], dropped[split] = truncate_for_training(instances, config.data.max_chunks_per_instance)
        if dropped[split]:
            log.info("%s: %d %s instances dropped: no question answerable from their first %d chunks",
                     path, dropped[split], split, config.data.max_chunks_per_instance)
    if not splits["train"]:
        raise UserError(f"{path}: no training instances with competency in {sorted(wanted)}"
                        + (f" and a question answerable from the first {config.data.max_chunks_per_instance} chunks"
                           if dropped["train"] else ""))
    return TrainingData(splits, dropped)


def mix_splits(parts: list[TrainingData], weights: list[float], seed: int = 0) -> TrainingData:
    """Several datasets as one: each train split is shuffled (seeded) and repeated or cut so that its share of
    the mixed split is its weight's share, the total being the sum of the sizes; validation and test
    interleave the datasets (one of each in turn), so the first few held-out instances cover them all."""
    import random

    if len(parts) != len(weights) or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"data.mix: need a non-negative weight per folder with a positive sum, got {weights}")
    total = sum(len(p.splits["train"]) for p in parts)
    train = []
    for i, (part, weight) in enumerate(zip(parts, weights)):
        pool = list(part.splits["train"])
        random.Random(seed * 7919 + i).shuffle(pool)
        want = round(total * weight / sum(weights))
        train.extend(pool[k % len(pool)] for k in range(want))
    splits = {"train": train}
    for split in ("validation", "test"):
        lists = [p.splits.get(split, []) for p, w in zip(parts, weights) if w > 0]
        splits[split] = [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)]
    dropped = {split: sum(p.dropped.get(split, 0) for p in parts) for split in ("train", "validation", "test")}
    return TrainingData(splits, dropped)


def _regex_tokenizer():
    from memalpha.tokens import regex_token_count

    return regex_token_count


def truncate_for_training(instances: list[Instance], max_chunks: int) -> tuple[list[Instance], int]:
    """The first `max_chunks` chunks of each instance (0: all), keeping only the questions whose evidence
    all survives (questions without evidence indices are kept); instances left without a question are
    dropped. Returns the kept instances and how many were dropped."""
    if not max_chunks:
        return list(instances), 0
    kept = []
    for instance in instances:
        if len(instance.chunks) > max_chunks:
            questions = [q for q in instance.questions
                         if q.evidence_chunks is None or all(c < max_chunks for c in q.evidence_chunks)]
            instance = replace(instance, chunks=instance.chunks[:max_chunks], questions=questions)
        if instance.questions:
            kept.append(instance)
    return kept, len(instances) - len(kept)
