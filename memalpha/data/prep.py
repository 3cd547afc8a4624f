"""The prep pipeline as plain functions, one per step, so an orchestrator can call them one by one:
load -> chunk -> validate -> split -> write. `prepare` and `synthesize` chain them."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memalpha.data.chunking import TokenCounts
from memalpha.data.conversations import split_conversations
from memalpha.data.io import (
    REJECTED_FILE,
    REPORT_MD,
    refused_dir,
    write_dataset,
    write_rejected,
)
from memalpha.data.loaders import Loaded, load_source, to_instance
from memalpha.data.schema import DataError, Instance
from memalpha.data.splits import assign_splits
from memalpha.data.synth import GENERATOR, SynthConfig, config_dict, generate
from memalpha.data.validation import Limits, Reader, ValidationResult, validate


@dataclass
class PrepSummary:
    """What a pipeline run produced."""

    out_dir: Path
    counts: dict[str, int]
    split_counts: dict[str, int]
    rejected_by_check: dict[str, int]
    notes: list[str] = field(default_factory=list)


def load_step(source: str, path: str | Path, competency: str | None = None) -> Loaded:
    """Read the input in its own format (`competency` overrides the data's or the guessed one)."""
    return load_source(source, path, competency)


def chunk_step(loaded: Loaded, tokenizer: Any, chunk_tokens: int, progress: bool = False, data_cfg=None) -> list[Instance]:
    """Chunk raw instances with the policy's tokenizer; pre-chunked instances pass through. With `data_cfg`,
    real conversations (LoCoMo, PerLTQA) are first split by conversation and cut into training windows
    (`data.conversations.split_conversations`)."""
    from tqdm.auto import tqdm

    counter = tokenizer if isinstance(tokenizer, TokenCounts) else TokenCounts(tokenizer)
    items = loaded.items
    if data_cfg is not None:
        items = split_conversations(items, counter, data_cfg.split_ratios, data_cfg.split_seed, data_cfg.train_window_tokens)
    items = tqdm(items, desc="chunking", unit="inst", disable=not progress)
    return [to_instance(item, counter, chunk_tokens) for item in items]


def validate_step(instances: list[Instance], tokenizer: Any, limits: Limits, reader: Reader | None = None,
                  progress: bool = False, loader_rejected: list[dict[str, Any]] = ()) -> ValidationResult:
    """Expectation suite + semantic checks (+ the closed-book filter when a reader is given); the questions a
    loader dropped (`Loaded.rejected`) join the rejected rows and their counts."""
    result = validate(instances, tokenizer, limits, reader, progress)
    result.rejected.extend(loader_rejected)
    for row in loader_rejected:
        result.check_counts[row["check"]] = result.check_counts.get(row["check"], 0) + 1
    return result


def split_step(instances: list[Instance], ratios: list[float], seed: int) -> list[Instance]:
    """Assign train/validation/test by instance (existing valid splits are kept)."""
    return assign_splits(instances, ratios, seed)


def write_step(out_dir: str | Path, instances: list[Instance], result: ValidationResult, manifest: dict[str, Any],
               drop_invalid: bool = False, overwrite: bool = False, origins: dict[str, str] | None = None) -> Path:
    """Write the folder, or fail listing the problems unless drop_invalid: the dataset folder is then not
    touched, and the rejected table and report go to `io.refused_dir(out_dir)`."""
    if result.errors and not drop_invalid:
        refused = write_rejected(refused_dir(out_dir), result.rejected, result.report_markdown(), result.report_html())
        raise DataError(f"{len(result.errors)} problem(s) in the input; nothing was written to {out_dir} "
                        f"(use --drop-invalid to drop the bad rows). Every rejected row is in "
                        f"{refused / REJECTED_FILE}, the report in {refused / REPORT_MD}:\n"
                        f"{result.describe_errors(origins)}")
    if not instances:
        raise DataError("no valid instances left; nothing was written:\n" + result.describe_errors(origins))
    return write_dataset(out_dir, instances, rejected=result.rejected, report_md=result.report_markdown(),
                         report_html=result.report_html(), manifest=manifest, overwrite=overwrite)


def dataset_manifest(source_manifest: dict[str, Any], instances: list[Instance], result: ValidationResult,
                     data_cfg) -> dict[str, Any]:
    """The manifest written with a dataset: where it came from, plus counts, splits, rejections and limits."""
    return {**source_manifest, "counts": result.counts,
            "split_counts": dict(sorted(Counter(i.split for i in instances).items())),
            "split_seed": data_cfg.split_seed, "split_ratios": list(data_cfg.split_ratios),
            "rejected_by_check": result.check_counts, "notes": result.notes,
            "limits": asdict(Limits.from_config(data_cfg))}


def _finish(out_dir, instances, result, manifest, data_cfg, drop_invalid, overwrite, origins, notes) -> PrepSummary:
    instances = split_step(instances, data_cfg.split_ratios, data_cfg.split_seed)
    result.notes.extend(notes)
    manifest = dataset_manifest(manifest, instances, result, data_cfg)
    path = write_step(out_dir, instances, result, manifest, drop_invalid, overwrite, origins)
    return PrepSummary(path, result.counts, manifest["split_counts"], result.check_counts, result.notes)


def prepare(source: str, path: str | Path, out_dir: str | Path, *, tokenizer: Any, tokenizer_name: str, data_cfg,
            chunk_tokens: int | None = None, drop_invalid: bool = False, overwrite: bool = False,
            reader: Reader | None = None, progress: bool = False, competency: str | None = None) -> PrepSummary:
    """`memalpha data prep`: load -> (real conversations: split by conversation, training windows) -> chunk ->
    validate -> split -> write."""
    counter = TokenCounts(tokenizer)
    chunk_tokens = chunk_tokens or data_cfg.chunk_tokens
    loaded = load_step(source, path, competency)
    instances = chunk_step(loaded, counter, chunk_tokens, progress, data_cfg)
    result = validate_step(instances, counter, Limits.from_config(data_cfg), reader, progress, loaded.rejected)
    manifest = {"source": source, "input": str(path), "tokenizer": tokenizer_name, "chunk_tokens": chunk_tokens}
    return _finish(out_dir, result.valid, result, manifest, data_cfg, drop_invalid, overwrite, loaded.origins, loaded.notes)


def synthesize(out_dir: str | Path, synth_cfg: SynthConfig, *, tokenizer: Any, tokenizer_name: str, data_cfg,
               overwrite: bool = False, progress: bool = False) -> PrepSummary:
    """`memalpha data synth`: generate -> validate -> split -> write."""
    counter = TokenCounts(tokenizer)
    instances = generate(synth_cfg, counter, progress)
    result = validate_step(instances, counter, Limits.from_config(data_cfg), None, progress)
    manifest = {"source": "synthetic", "generator": GENERATOR, "synth": config_dict(synth_cfg),
                "tokenizer": tokenizer_name, "chunk_tokens": synth_cfg.chunk_tokens}
    return _finish(out_dir, result.valid, result, manifest, data_cfg, False, overwrite, None, [])
