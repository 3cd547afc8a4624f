"""`memalpha train`: GRPO training in this process (no Prefect server needed).

Writes into the run folder (config.output_dir, or --resume DIR): config.yaml, the warm-start adapter
(sft/), checkpoints/step-XXXXXX/ every grpo.checkpoint_every steps and at the end, and metrics.jsonl
(one line per step; evaluation lines carry eval/* keys). An existing run folder is continued from its
latest checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from memalpha.config import load_config
from memalpha.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("train", help="warm start + GRPO training, locally")
    parser.add_argument("--config", help="YAML config file (default: embedded defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument("--resume", metavar="DIR", help="run folder (latest checkpoint) or checkpoint folder to continue")
    parser.add_argument("--force", action="store_true", help="resume even if the training config changed")
    parser.set_defaults(handler=_train)


def _resolve(resume: str | None, output_dir: str) -> tuple[Path, Path | None]:
    """(run folder, explicit checkpoint or None)."""
    if resume is None:
        return Path(output_dir), None
    path = Path(resume)
    if not path.exists():
        raise UserError(f"--resume {resume}: no such folder")
    if (path / "state.json").is_file():  # a checkpoint folder: run_dir/checkpoints/step-N
        return path.parent.parent, path
    return path, None


def _say(line: str) -> None:
    print(line, flush=True)


def _train(args) -> int:
    from memalpha.progress import GRPOProgress, SFTProgress
    from memalpha.teacher.warm_start import prepare_warm_start
    from memalpha.training.distributed import init_world
    from memalpha.training.trainer import METRICS_FILE, Trainer

    config = load_config(args.config, args.set)
    run_dir, checkpoint = _resolve(args.resume, config.output_dir)
    world = init_world()  # under torchrun: rank 0 prepares the folder and prints, every rank trains
    say = _say if world.main else (lambda _line: None)
    began = time.time()  # the time budget counts the warm start too
    started = time.perf_counter()
    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        say(f"run folder: {run_dir} (training hash {config.training_hash()})"
            + (f"; {world.size} processes" if world.size > 1 else ""))
        prepare_warm_start(config, run_dir, on_log=SFTProgress(say), started=began)
    world.barrier()
    trainer = Trainer(config, run_dir, force=args.force, started=began)
    say(f"policy {config.model.policy} on {trainer.policy.device} ({trainer.policy.dtype}); "
        f"ready in {time.perf_counter() - started:.0f} s")
    if trainer.maybe_resume(checkpoint):
        say(f"resumed at step {trainer.step}")
    trainer.say = say if world.main else None
    last = trainer.train(GRPOProgress(config.grpo.steps, trainer.step, say, deadline=config.deadline(trainer.started),
                                      sampling=config.grpo.sampling))
    if trainer.budget_stop:
        say(f"time budget of {trainer.budget_stop}")
    say(f"done: {trainer.step} steps in {time.perf_counter() - started:.0f} s; "
        f"last checkpoint {last or 'unchanged'}; metrics in {run_dir / METRICS_FILE}")
    return 0
