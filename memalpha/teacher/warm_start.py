"""The warm start, a stage of its own before GRPO: rule-writer demonstrations (or an LLM teacher's,
`memalpha sft --teacher`), SFT of the policy's LoRA adapter, and held-out extraction checks after every
epoch, into `run_dir/sft`."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from memalpha.config import WARM_START_BUDGET_SHARE, RunConfig, SFTConfig
from memalpha.data.schema import Instance
from memalpha.errors import UserError
from memalpha.progress import SFTProgress
from memalpha.teacher import record
from memalpha.teacher.demonstrations import (
    DemoStats,
    build_demonstrations,
    build_mixed_demonstrations,
    demonstration_max_length,
)
from memalpha.teacher.probes import extraction_metrics, extraction_probes
from memalpha.teacher.sft import run_sft
from memalpha.training.checkpoint import SFT_DIR, latest_checkpoint
from memalpha.training.data import load_training_data, mix_splits

if TYPE_CHECKING:
    from memalpha.teacher.llm_teacher import LLMTeacher

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter_model.safetensors"


def warm_start(config: RunConfig, out: str | Path, policy, instances: list[Instance] | list[list[Instance]],
               held_out: list[Instance] = (), on_log: Callable[[dict], None] | None = None,
               started: float | None = None, teacher: LLMTeacher | None = None) -> Path:
    """SFT warm start into the adapter folder `out` (a run's is run_dir/sft): `sft.num_demonstrations` teacher
    demonstrations of `instances` (drawn with `grpo.seed`; under `sft.mix`, one list per folder of the mix),
    extraction measured on `sft.eval_chunks` chunks of `held_out` after every epoch; the policy ends with
    the warm-start adapter. SFT starts from `sft.init_adapter` when set. An existing adapter there is
    loaded instead of retraining. Under a time budget the run began at `started` (a `time.time()`,
    default now) and SFT gets `WARM_START_BUDGET_SHARE` of it. `teacher`: an LLM teacher writes the
    demonstrations instead of the rule and evidence writers; its description and stats go into sft_result.json.
    An existing adapter another teacher taught is refused: shipped, it would carry this teacher's hash."""
    out = Path(out)
    if (out / ADAPTER_FILE).is_file():
        wanted, made_by = teacher.describe() if teacher is not None else None, _teacher_of(out)
        if made_by != wanted:
            raise UserError(f"{out} holds a warm start taught by {_who(made_by)}, not by {_who(wanted)}, the teacher "
                            "asked for: give another --out, or remove that folder to train it again")
        policy.load_adapter(out)
        return out
    tmp = out.with_name(f".{out.name}-tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    probes = extraction_probes(list(held_out), config, policy.tokenizer, config.sft.eval_chunks)
    deadline = config.deadline(time.time() if started is None else started, WARM_START_BUDGET_SHARE)
    stats = DemoStats()
    if config.sft.mix:
        demos = build_mixed_demonstrations(instances, list(config.sft.mix.values()), config, policy.tokenizer,
                                           seed=config.grpo.seed, stats=stats, teacher=teacher)
    else:
        demos = build_demonstrations(instances, config, policy.tokenizer, seed=config.grpo.seed, stats=stats,
                                     teacher=teacher)
    if config.sft.init_adapter:
        policy.load_adapter(_adapter_folder(Path(config.sft.init_adapter)))
    if teacher is not None and teacher.scope != "all" and not teacher.stats.windows:
        raise UserError(f"the LLM teacher teaches none of this data (--teach {teacher.scope}: no dataset has real "
                        "dialogue's evidence turns): use --teach all, or the rule writer")
    if not demos and teacher is not None:
        why = (f"no window's best sample reached --min-evidence {teacher.min_evidence}" if not teacher.stats.kept else
               f"of the kept windows' {stats.chunks} chunks {stats.unlabelled} had no executed call and {stats.too_long} "
               f"were longer than {demonstration_max_length(config)} tokens")
        raise UserError(f"the LLM teacher gave no demonstration: {why} ({teacher.stats.line()}). Lower --min-evidence, "
                        f"raise --samples, or give it more than rollout.max_completion_length="
                        f"{config.rollout.max_completion_length} tokens")
    if not demos:
        raise UserError(f"no demonstration fits sft.max_length={demonstration_max_length(config)} tokens; "
                        "raise it or use shorter chunks")
    log.info("warm start: %d demonstrations from %d chunks (%d nothing-to-store, %d updating an entry, %d dropped "
             "as longer than %d tokens, %d unlabelled)", stats.kept, stats.chunks, stats.nothing_to_store, stats.updates,
             stats.too_long, demonstration_max_length(config), stats.unlabelled)
    result = run_sft(policy, demos, tmp, config.sft, seed=config.grpo.seed, on_log=on_log or SFTProgress(log.info),
                     probes=probes, max_new_tokens=config.rollout.max_completion_length, deadline=deadline)
    shutil.rmtree(tmp / "trainer", ignore_errors=True)  # TRL's output folder: nothing is saved there
    result.adapter_dir = str(out)
    entry = result.to_dict()
    if teacher is not None:
        entry["teacher"] = {**teacher.describe(), "stats": teacher.stats.to_dict()}
    (tmp / "sft_result.json").write_text(json.dumps(entry, indent=2))
    tmp.rename(out)
    planned = result.planned_steps
    cut = f", stopped by the time budget after {result.steps} of {planned}" if result.steps < planned else ""
    log.info("warm start: %d SFT steps in %.0f s%s (best epoch %d of %d)", result.steps, result.seconds, cut,
             result.best_epoch, len(result.epochs))
    return out


def _teacher_of(adapter: Path) -> dict | None:
    """The LLM teacher's description an adapter folder records (None: the rule writer's): its sft_result.json's,
    or, for one restored from a shipped warm start, its record's recipe."""
    result = adapter / "sft_result.json"
    if result.is_file():
        taught = json.loads(result.read_text()).get("teacher")
    else:
        kept = record.read_record(adapter)
        taught = kept["recipe"].get("teacher") if kept else None
    return {k: v for k, v in taught.items() if k != "stats"} if taught else None


def _who(teacher: dict | None) -> str:
    return "the rule writer" if teacher is None else f"the LLM teacher {json.dumps(teacher, sort_keys=True)}"


def warm_start_data(config: RunConfig, tokenizer, path: str | Path | None = None
                    ) -> tuple[list[Instance] | list[list[Instance]], list[Instance]]:
    """The warm start's training instances and held-out ones: under `sft.mix` one train split a folder and the
    folders' validation interleaved (`mix_splits`); otherwise the splits of `path`, else of `sft.data_path`
    (generated with the recipe's settings when it is the default folder and missing), else of `data.train_path`."""
    if config.sft.mix:
        parts = [load_training_data(config, tokenizer, folder) for folder in config.sft.mix]
        held_out = mix_splits(parts, list(config.sft.mix.values()), config.grpo.seed).splits["validation"]
        return [p.splits["train"] for p in parts], held_out
    synth = record.WARM_START_DATA if path is None and config.sft.data_path == SFTConfig().data_path else None
    data = load_training_data(config, tokenizer, path or config.sft.data_path or None, synth)
    return data.splits["train"], data.splits["validation"]


def needs_warm_start(run_dir: Path) -> bool:
    """An existing adapter is reused; past the first checkpoint the checkpoint holds the newer adapter."""
    return (run_dir / SFT_DIR / ADAPTER_FILE).is_file() or latest_checkpoint(run_dir) is None


def prepare_warm_start(config: RunConfig, run_dir: str | Path, on_log: Callable[[dict], None] | None = None,
                       started: float | None = None, shipped: Path = record.WARM_START) -> Path | None:
    """The warm-start adapter of a run folder (None when sft.enabled is false or the run is past its first
    checkpoint): the `shipped` one when its record's hash is this config's, else trained now from
    `sft.data_path` (generated when it is the default and missing), held-out checks from its validation split."""
    from memalpha.models.policy import load_policy

    run_dir = Path(run_dir)
    if not config.sft.enabled or not needs_warm_start(run_dir):
        return None
    out = run_dir / SFT_DIR
    if (out / ADAPTER_FILE).is_file():
        return out
    wanted, kept = record.warm_start_hash(config), record.read_record(shipped)
    if kept is not None and kept["hash"] == wanted:
        log.info("warm start: %s matches this recipe (hash %s): reused, not trained", shipped, wanted)
        return record.restore(shipped, out)
    if config.model.fsdp:
        raise UserError(f"model.fsdp=true: the warm start trains the whole policy in one process; put a warm-start "
                        f"adapter in {out} (`memalpha sft` where the policy fits), or set sft.enabled=false")
    log.info("warm start: this recipe hashes to %s, %s: training it (`make warm-start` rebuilds the shipped one)",
             wanted, "the shipped one to " + kept["hash"] if kept else "none is shipped")
    policy = load_policy(config.model, seed=config.grpo.seed)
    train, held_out = warm_start_data(config, policy.tokenizer)
    return warm_start(config, out, policy, train, held_out, on_log, started)


def _adapter_folder(path: Path) -> Path:
    """An adapter folder to load: a shipped one (bf16 weights with a record) restored to fp32 first."""
    import tempfile

    if record.read_record(path) is None:
        return path
    return record.restore(path, Path(tempfile.mkdtemp(prefix="memalpha-init-")) / "adapter")


def record_held_out_check(config: RunConfig, folder: Path = record.WARM_START,
                          say: Callable[[str], None] | None = None) -> dict:
    """Measure the held-out check a GRPO run of `config` makes of the shipped warm start in `folder` before its
    first step (`Trainer.warm_start_check`) and store it in the record (`record.HELD_OUT_CHECKS`, replacing one
    measured on the same fields), so that such a run reads it instead of measuring it again. Returns the check."""
    import tempfile

    from memalpha.training.trainer import Trainer

    kept = record.read_record(folder)
    if kept is None:
        raise UserError(f"{folder}: no shipped warm start (needs {record.WEIGHTS_FILE} and {record.RECORD_FILE})")
    wanted = record.warm_start_hash(config)
    if kept.get("hash") != wanted:
        raise UserError(f"{Path(folder) / record.RECORD_FILE}: field 'hash' is {kept.get('hash')!r}, this config's warm "
                        f"start hashes to {wanted!r}: its runs do not start from this adapter")
    with tempfile.TemporaryDirectory() as tmp:
        record.restore(folder, Path(tmp) / SFT_DIR)
        trainer = Trainer(config, tmp)
        trainer.say = say
        check = {"fields": trainer.held_out_fields(), "metrics": trainer.evaluate("validation")}
    others = [c for c in kept.get(record.HELD_OUT_CHECKS, []) if c["fields"] != check["fields"]]
    kept[record.HELD_OUT_CHECKS] = [*others, check]
    (Path(folder) / record.RECORD_FILE).write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    log.info("%s: held-out check recorded, QA %.3f", folder, check["metrics"]["eval/qa_score"])
    return check


def ship_warm_start(config: RunConfig, adapter: Path, policy, held_out: list[Instance],
                    folder: Path = record.WARM_START, teacher: dict | None = None) -> dict:
    """Store `adapter` (this config's warm start) as the shipped one in bf16, with its record: the hash, the
    recipe fields (with `teacher`, an LLM teacher's description, when one wrote its demonstrations), its SFT
    result and the held-out checks of the stored bf16 weights beside the trained fp32 ones. Returns the record."""
    import tempfile

    result = json.loads((Path(adapter) / "sft_result.json").read_text())
    entry = {"hash": record.warm_start_hash(config, teacher), "recipe": record.warm_start_fields(config, teacher),
             "sft": {k: v for k, v in result.items() if k not in ("losses", "adapter_dir")}}
    record.ship(adapter, folder, entry)
    probes = extraction_probes(list(held_out), config, policy.tokenizer, config.sft.eval_chunks)
    with tempfile.TemporaryDirectory() as tmp:
        policy.load_adapter(record.restore(folder, Path(tmp) / "stored"))
        entry["held_out_stored_bf16"] = extraction_metrics(policy, probes, config.rollout.max_completion_length)
    (folder / record.RECORD_FILE).write_text(json.dumps(entry, indent=1, sort_keys=True) + "\n")
    log.info("shipped %s (hash %s): held-out checks as stored %s", folder, entry["hash"], entry["held_out_stored_bf16"])
    return entry
