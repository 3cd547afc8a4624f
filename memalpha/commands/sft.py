"""`memalpha sft`: build rule-writer demonstrations from the training data and warm-start the policy's
LoRA adapter with TRL's SFTTrainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memalpha.config import load_config
from memalpha.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("sft", help="warm-start the policy on rule-writer demonstrations (LoRA SFT)")
    parser.add_argument("--config", help="YAML config file (default: embedded defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument("--out", default="runs/warm-start", help="folder for the adapter (safetensors) and sft_result.json")
    parser.add_argument("--ship", action="store_true",
                        help="store the result as the shipped warm start (adapters/warm-start, bf16, with its record)")
    parser.add_argument("--held-out-check", action="store_true",
                        help="train nothing: measure the held-out check `make train` (configs/default.yaml, or --config) "
                             "makes of the shipped warm start before its first GRPO step, and store it in its record")
    parser.add_argument("--data", help="dataset folder (default: data.train_path of the config)")
    parser.add_argument("--adapter", help="continue from an existing adapter folder")
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from memalpha.config import SFTConfig
    from memalpha.models.loading import ModelNotPreparedError
    from memalpha.models.policy import AdapterError, load_policy
    from memalpha.progress import SFTProgress
    from memalpha.teacher.record import MAKE_TRAIN_CONFIG, WARM_START_DATA, warm_start_hash
    from memalpha.teacher.warm_start import ship_warm_start, warm_start
    from memalpha.training.data import load_training_data

    if args.held_out_check:
        _held_out_check(load_config(args.config or MAKE_TRAIN_CONFIG, args.set))
        return 0
    config = load_config(args.config, args.set)
    data_path = Path(args.data or config.sft.data_path or config.data.train_path)
    generated = not args.data and config.sft.data_path == SFTConfig().data_path
    if not data_path.exists() and not generated:
        raise UserError(f"training data {data_path} not found (create it with `memalpha data synth --out {data_path}`)")
    try:
        policy = load_policy(config.model, adapter=args.adapter, seed=config.grpo.seed)
    except (ModelNotPreparedError, AdapterError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    data = load_training_data(config, policy.tokenizer, data_path, WARM_START_DATA if generated else None)
    out = warm_start(config, args.out, policy, data.splits["train"], data.splits["validation"],
                     on_log=SFTProgress(lambda line: print(line, flush=True)))
    result = json.loads((out / "sft_result.json").read_text())
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}), file=sys.stdout)
    print(f"adapter saved to {out}")
    if args.ship:
        if args.data or args.adapter:
            raise UserError("--ship stores the recipe's warm start: run it without --data and --adapter")
        entry = ship_warm_start(config, out, policy, data.splits["validation"])
        print(f"shipped as the warm start of record (hash {entry['hash']}); held-out checks as stored: "
              + ", ".join(f"{k} {v:.3f}" for k, v in entry["held_out_stored_bf16"].items()))
        make_train = load_config(MAKE_TRAIN_CONFIG)
        if warm_start_hash(make_train) == entry["hash"]:  # `make train` starts from it: record its first check
            _held_out_check(make_train)
    return 0


def _held_out_check(config) -> None:
    from memalpha.teacher import record
    from memalpha.teacher.warm_start import record_held_out_check

    check = record_held_out_check(config, say=lambda line: print(line, flush=True))
    print(f"{record.WARM_START / record.RECORD_FILE}: held-out check recorded, "
          f"QA {check['metrics']['eval/qa_score']:.3f} on {check['metrics']['eval/instances']:.0f} validation instances")
