"""Adapters of record shipped in the repository: the recipe's warm start and the trained writer.

Each lives in `adapters/<name>/` as a LoRA adapter stored in bf16 (`adapter_model.safetensors`,
`adapter_config.json`) beside `record.json`: the hash of what determines it, the recipe fields, the data
it came from and the scores measured on it. A run whose warm start hashes the same copies the shipped
adapter instead of training it (`memalpha.teacher.warm_start.prepare_warm_start`).

The warm-start hash covers the SFT settings, the policy and its LoRA layout, the memory, retrieval and
rollout budgets the demonstrations are rendered with, the data selection and seed, the demonstration
data (its generator settings, or the data file's digest), the writer's prompt and tool definitions, and an
LLM teacher when one wrote the demonstrations (`teacher.llm_teacher`).
It does not cover the rule writer's code: a change there that alters demonstrations needs
`make warm-start` by hand (tests/test_episode.py's golden memories catch such changes).

The warm start's record also holds the held-out checks `make train` and `make sweep`'s children make of it
before their first GRPO step (`HELD_OUT_CHECKS`), each with what it depends on (`held_out_fields`), so such a
run reads its check instead of spending minutes measuring it again. It does not cover the code either: a change to rollouts, retrieval or
scoring needs `memalpha sft --held-out-check` by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.data.synth import SynthConfig, config_dict
from memalpha.env.prompts import writer_system_prompt
from memalpha.env.tools import tool_schemas
from memalpha.models.loading import repo_root

ADAPTERS = repo_root() / "adapters"
WARM_START = ADAPTERS / "warm-start"
WRITER = ADAPTERS / "writer"
RECORD_FILE = "record.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
HELD_OUT_CHECKS = "held_out_checks"
"""The record's list of {"fields": `held_out_fields`, "metrics": eval/* of `Trainer.evaluate`}: held-out checks
of the adapter as GRPO runs make them before their first step, one per set of fields."""
MAKE_TRAIN_CONFIG = repo_root() / "configs" / "default.yaml"
"""The config `make train` runs (flows.DEFAULT_CONFIG_FILE): the shipped warm start's held-out check is recorded for it."""

WARM_START_DATA = SynthConfig(instances=1024, chunks_per_instance=(4,), chunk_tokens=512,
                              competencies=("accurate_retrieval", "conflict_resolution"), seed=0)
"""The demonstration data of the recipe (`sft.data_path`, generated when missing):
`memalpha data synth --instances 1024 --chunks-per-instance 4 --chunk-tokens 512
--competencies accurate_retrieval,conflict_resolution --seed 0`."""


def demonstration_data(config: RunConfig) -> dict[str, Any]:
    """What the warm start's data is: the generator settings of a synthetic folder, else the digest of
    its data file; for a missing folder, the settings `prepare_warm_start` generates it with. Under
    `sft.mix`: each folder's weight and data, and the digest of the adapter SFT starts from."""
    if config.sft.mix:
        init = Path(config.sft.init_adapter) / WEIGHTS_FILE if config.sft.init_adapter else None
        # by content, in mix order (the order seeds each folder's draw), so the hash does not depend on where the folders are
        return {"mix": [[weight, _folder_data(Path(folder))] for folder, weight in config.sft.mix.items()],
                "init_adapter_sha256": hashlib.sha256(init.read_bytes()).hexdigest() if init and init.is_file() else None}
    return _folder_data(Path(config.sft.data_path or config.data.train_path))


def _folder_data(path: Path) -> dict[str, Any]:
    manifest = path / "manifest.json"
    if manifest.is_file():
        synth = json.loads(manifest.read_text()).get("synth")
        if synth:
            return {"synth": synth}
        digest = hashlib.sha256((path / "data.parquet").read_bytes()).hexdigest()
        return {"data_sha256": digest}
    return {"synth": config_dict(WARM_START_DATA)}


def warm_start_fields(config: RunConfig, teacher: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the warm-start adapter depends on, as plain data (see the module docstring). `teacher`: an
    LLM teacher's description (`LLMTeacher.describe`); without one (the rule and evidence writers) the fields
    have no teacher entry, so the recipe's hash is the one its shipped warm start was recorded with."""
    schema = config.memory.schema()
    sft = config.sft.model_dump(mode="json")
    for name in ("data_path", "mix", "init_adapter"):  # the data is described by its content below, not its folder
        sft.pop(name)
    model = config.model.model_dump(mode="json")
    fields = {
        "sft": sft,
        "model": {k: model[k] for k in ("policy", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")},
        "memory": config.memory.model_dump(mode="json"),
        "retrieval": config.retrieval.model_dump(mode="json"),
        "rollout": {k: getattr(config.rollout, k) for k in ("max_prompt_tokens", "max_completion_length")},
        "data": {k: getattr(config.data, k) for k in ("competencies", "max_chunks_per_instance", "split_seed", "split_ratios")},
        "seed": config.grpo.seed,
        "demonstrations": demonstration_data(config),
        "prompt": writer_system_prompt(schema),
        "tools": tool_schemas(schema),
    }
    if teacher is not None:
        fields["teacher"] = teacher
    return fields


def warm_start_hash(config: RunConfig, teacher: dict[str, Any] | None = None) -> str:
    return hashlib.sha256(json.dumps(warm_start_fields(config, teacher), sort_keys=True).encode()).hexdigest()[:16]


HELD_OUT_CONFIG = ("memory.", "retrieval.", "reward.", "rollout.max_prompt_tokens", "rollout.max_completion_length",
                   "rollout.engine", "model.policy", "model.reader", "model.judge", "model.openai_base_url",
                   "model.openai_model", "eval.max_instances")
"""The config fields (dotted prefixes) a held-out check depends on besides its adapter and instances: how memories are
written, read, retrieved and scored, who reads them, and how many instances are evaluated."""


def held_out_fields(config: RunConfig, instances: list[Instance], dtype: str, device: str) -> dict[str, Any]:
    """What a held-out check of an adapter depends on besides the adapter: `HELD_OUT_CONFIG`, the instances
    evaluated (by content) and the precision and device the policy runs in (greedy outputs can differ)."""
    fields = {k: v for k, v in config.flat().items() if k.startswith(HELD_OUT_CONFIG)}
    data = json.dumps([dataclasses.asdict(i) for i in instances], sort_keys=True, default=str)
    return {**fields, "instances_sha256": hashlib.sha256(data.encode()).hexdigest(), "dtype": dtype, "device": device}


WRITER_CHUNK_TOKENS = 512
"""The chunk size every adapter of record was trained on, and the one assumed for an adapter without a
record (`writer_chunk_tokens`)."""


def writer_chunk_tokens(adapter: str | Path | None) -> int:
    """The chunk size a writer adapter was trained with: its record's `chunk_tokens`, else WRITER_CHUNK_TOKENS.
    Evaluation and `write_memory` cut longer chunks to it (`data.chunking.fit_instance`), since a longer
    chunk would overflow the writer's prompt budget and lose its beginning."""
    kept = read_record(Path(adapter)) if adapter else None
    return int((kept or {}).get("chunk_tokens", WRITER_CHUNK_TOKENS))


def training_chunk_tokens(config: RunConfig) -> int:
    """The chunk size of a run's training data (its manifest's `chunk_tokens`; under `data.mix`, the first
    folder's), else WRITER_CHUNK_TOKENS."""
    folder = Path(next(iter(config.data.mix), config.data.train_path))
    manifest = folder / "manifest.json"
    if manifest.is_file():
        return int(json.loads(manifest.read_text()).get("chunk_tokens") or WRITER_CHUNK_TOKENS)
    return WRITER_CHUNK_TOKENS


def with_writer_record(adapter: Path, out: Path, config: RunConfig) -> Path:
    """`adapter` copied to `out` with a record naming what a user of the writer needs: the chunk size and
    prompt budget it was trained with (a shipped adapter keeps its own record)."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(adapter, out)
    if read_record(out) is None:
        entry = {"chunk_tokens": training_chunk_tokens(config), "max_prompt_tokens": config.rollout.max_prompt_tokens,
                 "policy": config.model.policy}
        (out / RECORD_FILE).write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
    return out


def read_record(folder: Path) -> dict[str, Any] | None:
    """The record of a shipped adapter folder, or None when it holds none."""
    path = Path(folder) / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() and (Path(folder) / WEIGHTS_FILE).is_file() else None


def ship(adapter: Path, folder: Path, record: dict[str, Any]) -> Path:
    """Copy `adapter` into `folder` with its weights in bf16 and `record` beside them (written last, so a
    folder with a record is complete)."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = load_file(str(Path(adapter) / WEIGHTS_FILE))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE))
    adapter_config = json.loads((Path(adapter) / CONFIG_FILE).read_text())
    base = adapter_config.get("base_model_name_or_path")
    if base:  # a local cache path means nothing on another machine: keep the policy's name
        adapter_config["base_model_name_or_path"] = Path(base).name
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def restore(folder: Path, out: Path) -> Path:
    """A shipped adapter copied into a run's adapter folder, weights back in fp32 (how the trainer keeps LoRA)."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = load_file(str(Path(folder) / WEIGHTS_FILE))
    save_file({k: v.float().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE))
    shutil.copy(Path(folder) / CONFIG_FILE, tmp / CONFIG_FILE)
    shutil.copy(Path(folder) / RECORD_FILE, tmp / RECORD_FILE)
    tmp.rename(out)
    return out
