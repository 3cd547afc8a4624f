"""The warm start, a stage of its own before GRPO: rule-writer demonstrations, SFT of the policy's LoRA
adapter, and held-out extraction checks after every epoch, into `run_dir/sft`."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

from memalpha.config import WARM_START_BUDGET_SHARE, RunConfig
from memalpha.data.schema import Instance
from memalpha.errors import UserError
from memalpha.progress import SFTProgress
from memalpha.teacher.demonstrations import (
    DemoStats,
    build_demonstrations,
    demonstration_max_length,
)
from memalpha.teacher.probes import extraction_probes
from memalpha.teacher.sft import run_sft
from memalpha.training.checkpoint import SFT_DIR, latest_checkpoint
from memalpha.training.data import load_training_data

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"


def warm_start(config: RunConfig, out: str | Path, policy, instances: list[Instance],
               held_out: list[Instance] = (), on_log: Callable[[dict], None] | None = None,
               started: float | None = None) -> Path:
    """SFT warm start into the adapter folder `out` (a run's is run_dir/sft): `sft.num_demonstrations` rule-writer demonstrations of `instances`
    (drawn with `grpo.seed`), extraction measured on `sft.eval_chunks` chunks of `held_out` after every
    epoch; the policy ends with the warm-start adapter. An existing adapter there is loaded instead of
    retraining. Under a time budget the run began at `started` (a `time.time()`, default now) and SFT
    gets `WARM_START_BUDGET_SHARE` of it."""
    out = Path(out)
    if (out / ADAPTER_FILE).is_file():
        policy.load_adapter(out)
        return out
    tmp = out.with_name(f".{out.name}-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    probes = extraction_probes(list(held_out), config, policy.tokenizer, config.sft.eval_chunks)
    deadline = config.deadline(time.time() if started is None else started, WARM_START_BUDGET_SHARE)
    stats = DemoStats()
    demos = build_demonstrations(instances, config, policy.tokenizer, seed=config.grpo.seed, stats=stats)
    if not demos:
        raise UserError(f"no demonstration fits sft.max_length={demonstration_max_length(config)} tokens; "
                        "raise it or use shorter chunks")
    log.info("warm start: %d demonstrations from %d chunks (%d nothing-to-store, %d updating an entry, %d dropped "
             "as longer than %d tokens)", stats.kept, stats.chunks, stats.nothing_to_store, stats.updates,
             stats.too_long, demonstration_max_length(config))
    result = run_sft(policy, demos, tmp, config.sft, seed=config.grpo.seed, on_log=on_log or SFTProgress(log.info),
                     probes=probes, max_new_tokens=config.rollout.max_completion_length, deadline=deadline)
    shutil.rmtree(tmp / "trainer", ignore_errors=True)  # TRL's output folder: nothing is saved there
    result.adapter_dir = str(out)
    (tmp / "sft_result.json").write_text(json.dumps(result.to_dict(), indent=2))
    tmp.rename(out)
    planned = result.planned_steps
    cut = f", stopped by the time budget after {result.steps} of {planned}" if result.steps < planned else ""
    log.info("warm start: %d SFT steps in %.0f s%s (best epoch %d of %d)", result.steps, result.seconds, cut,
             result.best_epoch, len(result.epochs))
    return out


def needs_warm_start(run_dir: Path) -> bool:
    """An existing adapter is reused; past the first checkpoint the checkpoint holds the newer adapter."""
    return (run_dir / SFT_DIR / ADAPTER_FILE).is_file() or latest_checkpoint(run_dir) is None


def prepare_warm_start(config: RunConfig, run_dir: str | Path, on_log: Callable[[dict], None] | None = None,
                       started: float | None = None) -> Path | None:
    """The warm-start adapter of a run folder, trained now if missing (None when sft.enabled is false or
    the run is past its first checkpoint). Demonstrations come from `sft.data_path` (default
    `data.train_path`), held-out checks from its validation split."""
    from memalpha.models.policy import load_policy

    run_dir = Path(run_dir)
    if not config.sft.enabled or not needs_warm_start(run_dir):
        return None
    policy = load_policy(config.model, seed=config.grpo.seed)
    data = load_training_data(config, policy.tokenizer, config.sft.data_path or None)
    return warm_start(config, run_dir / SFT_DIR, policy, data.splits["train"], data.splits["validation"], on_log, started)
