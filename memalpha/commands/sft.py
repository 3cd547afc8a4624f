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
    from memalpha.sft import DemoStats, build_demonstrations, run_dagger, run_sft

    config = load_config(args.config, args.set)
    data_path = Path(args.data or config.data.train_path)
    if not data_path.exists():
        raise UserError(f"training data {data_path} not found (create it with `memalpha data synth --out {data_path}`)")
    instances = [i for i in read_dataset(data_path) if i.split in ("train", "")]
    instances = [i for i in instances if i.competency in config.data.competencies] or instances
    if not instances:
        raise UserError(f"{data_path} has no training instances")
    try:
        policy = load_policy(config.model, adapter=args.adapter, seed=config.grpo.seed)
    except (ModelNotPreparedError, AdapterError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None

    stats = DemoStats()
    demos = build_demonstrations(instances, config, policy.tokenizer, seed=config.grpo.seed, stats=stats)
    print(
        f"demonstrations: {stats.kept} from {stats.chunks} chunks of {len(instances)} instances "
        f"({stats.nothing_to_store} nothing-to-store, {stats.updates} updating an entry, {stats.too_long} longer than sft.max_length dropped)",
        flush=True,
    )
    if not demos:
        raise UserError("no demonstration fits sft.max_length; raise it or use shorter chunks")

    progress = SFTProgress(lambda line: print(line, flush=True))
    result = run_sft(policy, demos, args.out, config.sft, seed=config.grpo.seed, on_log=progress)
    if config.sft.dagger_rounds:
        result = run_dagger(policy, instances, config, args.out, result, on_log=progress)
    print(json.dumps({k: v for k, v in result.to_dict().items() if k != "losses"}), file=sys.stdout)
    print(f"adapter saved to {result.adapter_dir}")
    return 0
