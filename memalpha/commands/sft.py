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
    parser.add_argument("--out", required=True, help="folder for the adapter (safetensors) and sft_result.json")
    parser.add_argument("--data", help="dataset folder (default: data.train_path of the config)")
    parser.add_argument("--adapter", help="continue from an existing adapter folder")
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from memalpha.data.io import read_dataset
    from memalpha.models.loading import ModelNotPreparedError
    from memalpha.models.policy import AdapterError, load_policy
    from memalpha.progress import SFTProgress
    from memalpha.sft import DemoStats, train_warm_start

    config = load_config(args.config, args.set)
    data_path = Path(args.data or config.data.train_path)
    if not data_path.exists():
        raise UserError(f"training data {data_path} not found (create it with `memalpha data synth --out {data_path}`)")
    instances = [i for i in read_dataset(data_path) if i.split in ("train", "")]
    instances = [i for i in instances if i.competency in config.data.competencies] or instances
    if not instances:
        raise UserError(f"{data_path} has no training instances")
    if args.adapter and config.sft.soup_seeds > 1:
        raise UserError(f"--adapter continues one adapter, sft.soup_seeds={config.sft.soup_seeds} averages fresh ones; "
                        "drop one of them")
    try:
        policy = load_policy(config.trained_model(), adapter=args.adapter, seed=config.grpo.seed)
    except (ModelNotPreparedError, AdapterError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None

    stats = DemoStats()
    result = train_warm_start(policy, instances, config, args.out, on_log=SFTProgress(lambda line: print(line, flush=True)),
                              stats=stats)
    print(
        f"demonstrations: {stats.kept} from {stats.chunks} chunks of {len(instances)} instances "
        f"({stats.nothing_to_store} nothing-to-store, {stats.updates} updating an entry, {stats.too_long} longer than sft.max_length dropped)",
        flush=True,
    )
    print(json.dumps({k: v for k, v in result.to_dict().items() if k != "losses"}), file=sys.stdout)
    print(f"adapter saved to {result.adapter_dir}")
    return 0
