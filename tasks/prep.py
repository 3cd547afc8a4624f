"""Prep tasks: one per step of memalpha.data.prep (load -> chunk -> validate -> split -> write), each
cached on its inputs and its source code with persisted results, so an unchanged re-run is instant.

Inputs that name files also carry a fingerprint of the files' contents, so an edited input (or a
deleted output folder) misses the cache instead of returning a stale result.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from memalpha.config import DataConfig
from tasks import tracking

PREP_CACHE = INPUTS + TASK_SOURCE


def fingerprint(path: str | Path | None) -> str:
    """sha256 over the file (or every file under the folder, with relative names); "" when absent."""
    if path is None:
        return ""
    root = Path(path)
    if not root.exists():
        return ""
    digest = hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(root) if file != root else file.name).encode())
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def token_counter(policy: str):
    """(TokenCounts, name): the policy's tokenizer, or the regex counter when it cannot be loaded offline."""
    from memalpha.data.chunking import TokenCounts
    from memalpha.models.loading import load_tokenizer, resolve_model_path
    from memalpha.tokens import regex_token_count

    try:
        return TokenCounts(load_tokenizer(resolve_model_path(policy))), policy
    except Exception as exc:  # the tiny model, an unprepared cache, a hub id offline
        get_run_logger().warning("policy tokenizer unavailable (%s); counting tokens with the regex counter", exc)
        return TokenCounts(regex_token_count), "regex"


@task(name="load", cache_policy=PREP_CACHE, persist_result=True)
def load(source: str, path: str | None, input_fingerprint: str, synth: dict[str, Any] | None, policy: str):
    """Read the input in its own format; `synthetic` generates instances (already chunked) instead."""
    from memalpha.data.loaders import Loaded
    from memalpha.data.prep import load_step

    if source == "synthetic":
        from memalpha.data.synth import PRESETS, SynthConfig, generate

        knobs = dict(synth or {})
        preset = knobs.pop("preset", None)
        for key in ("chunks_per_instance", "competencies"):
            if key in knobs:
                knobs[key] = tuple(knobs[key])
        base = PRESETS[preset] if preset else SynthConfig()
        cfg = SynthConfig(**{**asdict(base), **knobs})
        counter, _ = token_counter(policy)
        return Loaded(items=generate(cfg, counter), notes=[f"synthetic: {json.dumps(asdict(cfg))}"])
    if path is None:
        raise ValueError(f"source {source!r} needs an input path")
    return load_step(source, path)


@task(name="chunk", cache_policy=PREP_CACHE, persist_result=True)
def chunk(loaded, policy: str, data_cfg: DataConfig):
    """Chunk raw instances with the policy's tokenizer (real conversations split by conversation and cut into
    training windows first); returns (instances, tokenizer name)."""
    from memalpha.data.prep import chunk_step

    counter, name = token_counter(policy)
    return chunk_step(loaded, counter, data_cfg.chunk_tokens, data_cfg=data_cfg), name


@task(name="validate", cache_policy=PREP_CACHE, persist_result=True)
def validate(instances, policy: str, data_cfg: DataConfig, loader_rejected: list[dict[str, Any]] = ()):
    """Great Expectations suite + semantic checks, with the loader's dropped questions; returns the ValidationResult."""
    from memalpha.data.prep import validate_step
    from memalpha.data.validation import Limits

    counter, _ = token_counter(policy)
    result = validate_step(instances, counter, Limits.from_config(data_cfg), loader_rejected=list(loader_rejected))
    get_run_logger().info("validation: %s; rejected by check: %s", result.counts, result.check_counts)
    return result


@task(name="split", cache_policy=PREP_CACHE, persist_result=True)
def split(instances, data_cfg: DataConfig):
    """Assign train/validation/test by instance."""
    from memalpha.data.prep import split_step

    return split_step(instances, data_cfg.split_ratios, data_cfg.split_seed)


@task(name="write", cache_policy=PREP_CACHE, persist_result=True)
def write(out_dir: str, instances, result, manifest: dict[str, Any], data_cfg: DataConfig, drop_invalid: bool) -> dict[str, str]:
    """Write the dataset folder (replacing it); returns its path and the fingerprint of what was written,
    so the flow can tell a cached write whose folder was since changed or deleted."""
    from memalpha.data.prep import dataset_manifest, write_step

    full_manifest = dataset_manifest(manifest, instances, result, data_cfg)
    path = write_step(out_dir, instances, result, full_manifest, drop_invalid=drop_invalid, overwrite=True)
    return {"path": str(path), "fingerprint": fingerprint(path)}


@task(name="log-dataset", cache_policy=(INPUTS - "tags") + TASK_SOURCE, persist_result=True)
def log_dataset(out_dir: str, dataset_fingerprint: str, experiment: str, tags: dict[str, str]) -> str:
    """An MLflow run with the dataset as inputs (one per split) and the validation report as artifacts.
    Cached on the dataset's fingerprint: an unchanged dataset is logged once (tags name the first flow run)."""
    import mlflow
    import polars as pl
    from mlflow.data.polars_dataset import from_polars

    from memalpha.data.io import (
        DATA_FILE,
        MANIFEST_FILE,
        REJECTED_FILE,
        REPORT_HTML,
        REPORT_MD,
    )

    folder = Path(out_dir)
    frame = pl.read_parquet(folder / DATA_FILE)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    params = {"source": manifest.get("source"), "input": manifest.get("input", ""), "tokenizer": manifest.get("tokenizer"),
              "chunk_tokens": manifest.get("chunk_tokens"), "split_seed": manifest.get("split_seed"),
              "split_ratios": manifest.get("split_ratios")}
    run_id = tracking.create_run(experiment, f"prep-{folder.name}", params,
                                 {**tags, "memalpha.kind": "prep", "memalpha.dataset": str(folder)})
    client = tracking.configure()
    mlflow.set_tracking_uri(tracking.tracking_uri())
    with mlflow.start_run(run_id=run_id):  # this thread's own active run; ended (FINISHED) on exit
        for split_name in ("train", "validation", "test"):
            part = frame.filter(pl.col("split") == split_name)
            if part.height:
                dataset = from_polars(part, source=str(folder / DATA_FILE), name=f"{folder.name}-{split_name}")
                mlflow.log_input(dataset, context=split_name)
    counts = {f"data/{k}": v for k, v in (manifest.get("counts") or {}).items()}
    counts.update({f"data/split/{k}": v for k, v in (manifest.get("split_counts") or {}).items()})
    counts.update({f"data/rejected/{k}": v for k, v in (manifest.get("rejected_by_check") or {}).items()})
    tracking.log_step_metrics(run_id, 0, counts, tracking.now_ms())
    for name in (REPORT_MD, REPORT_HTML, MANIFEST_FILE, REJECTED_FILE):
        if (folder / name).is_file():
            client.log_artifact(run_id, str(folder / name), "validation")
    return run_id
