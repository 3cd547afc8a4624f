"""`memalpha sft`: build rule-writer demonstrations (or an LLM teacher's, `--teacher llm:MODEL`) from the
training data and warm-start the policy's LoRA adapter with TRL's SFTTrainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from memalpha.config import load_config
from memalpha.errors import UserError

OUT = "runs/warm-start"
LLM_OUT = "runs/llm-warm-start/sft"
"""An LLM teacher's adapter: never the rule writer's folder (an adapter there would be reused), and the `sft/` of
a run folder, so `memalpha train --set output_dir=runs/llm-warm-start` starts from it."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("sft", help="warm-start the policy on rule-writer demonstrations (LoRA SFT)")
    parser.add_argument("--config", help="YAML config file (default: embedded defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument("--out", help=f"folder for the adapter (safetensors) and sft_result.json (default {OUT}; "
                                       f"with an LLM teacher {LLM_OUT})")
    parser.add_argument("--ship", nargs="?", const=True, metavar="FOLDER",
                        help="store the result as a shipped warm start (bf16, with its record): the recipe's, "
                             "adapters/warm-start, by default")
    parser.add_argument("--held-out-check", action="store_true",
                        help="train nothing: measure the held-out check `make train` (configs/default.yaml, or --config) "
                             "makes of the shipped warm start before its first GRPO step, and store it in its record")
    parser.add_argument("--data", help="dataset folder (default: data.train_path of the config)")
    parser.add_argument("--adapter", help="continue from an existing adapter folder")
    parser.add_argument("--teacher", default="rule", metavar="rule|llm:MODEL",
                        help="who writes the demonstrations: the rule writer (and the evidence writer on real dialogue), "
                             "or a packaged LLM on its llama.cpp server, best of --samples episodes a window "
                             "(e.g. llm:qwen2.5-coder-1.5b; `bash infra/servers.sh start-llama MODEL` first)")
    parser.add_argument("--samples", type=int, default=None,
                        help="LLM teacher: episodes sampled a window (default 4)")
    parser.add_argument("--min-evidence", type=float, default=None,
                        help="LLM teacher: keep a window when its best episode's memory holds at least this share "
                             "of the answers the window states (default 0.5)")
    parser.add_argument("--teach", choices=("all", "dialogue"), default=None,
                        help="LLM teacher: label every dataset of the mix (all, the default), or only real dialogue "
                             "(dialogue), the rule writer labelling the synthetic data")
    parser.add_argument("--windows", type=int, default=None,
                        help="LLM teacher: write at most this many training windows of each dataset, a seeded draw "
                             "(default: all)")
    parser.set_defaults(handler=_run)


def _run(args) -> int:
    from memalpha.config import SFTConfig
    from memalpha.models.loading import ModelNotPreparedError
    from memalpha.models.policy import AdapterError, load_policy
    from memalpha.progress import SFTProgress
    from memalpha.teacher import llm_teacher
    from memalpha.teacher.record import MAKE_TRAIN_CONFIG, WARM_START, warm_start_hash
    from memalpha.teacher.warm_start import ship_warm_start, warm_start, warm_start_data

    if args.held_out_check:
        _held_out_check(load_config(args.config or MAKE_TRAIN_CONFIG, args.set))
        return 0
    config = load_config(args.config, args.set)
    teacher = _teacher(args, llm_teacher)
    ship = WARM_START if args.ship is True else Path(args.ship) if args.ship else None
    if ship is not None and (args.data or args.adapter):
        raise UserError("--ship records the warm start under its recipe's hash, which --data and --adapter are not "
                        "part of: run it without them")
    if ship is not None and teacher is not None and ship.resolve() == WARM_START.resolve():
        raise UserError(f"--ship {ship} stores the recipe's warm start, which the rule writer teaches: ship an LLM "
                        "teacher's into another folder (--ship adapters/warm-start-llm)")
    if args.data and config.sft.mix:
        raise UserError("--data names one dataset and sft.mix several: give one of them")
    data_path = Path(args.data or config.sft.data_path or config.data.train_path)
    generated = not args.data and config.sft.data_path == SFTConfig().data_path
    if not config.sft.mix and not data_path.exists() and not generated:
        raise UserError(f"training data {data_path} not found (create it with `memalpha data synth --out {data_path}`)")
    try:
        policy = load_policy(config.model, adapter=args.adapter, seed=config.grpo.seed)
    except (ModelNotPreparedError, AdapterError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    train, held_out = warm_start_data(config, policy.tokenizer, args.data)
    out = warm_start(config, args.out or (LLM_OUT if teacher else OUT), policy, train, held_out,
                     on_log=SFTProgress(lambda line: print(line, flush=True)), teacher=teacher)
    result = json.loads((out / "sft_result.json").read_text())
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}), file=sys.stdout)
    print(f"adapter saved to {out}")
    if ship is not None:
        entry = ship_warm_start(config, out, policy, held_out, ship,
                                teacher.describe() if teacher else None)
        where = "as the warm start of record" if ship.resolve() == WARM_START.resolve() else f"to {ship}"
        print(f"shipped {where} (hash {entry['hash']}); held-out checks as stored: "
              + ", ".join(f"{k} {v:.3f}" for k, v in entry["held_out_stored_bf16"].items()))
        make_train = load_config(MAKE_TRAIN_CONFIG)
        if warm_start_hash(make_train) == entry["hash"]:  # `make train` starts from it: record its first check
            _held_out_check(make_train)
    return 0


def _teacher(args, llm_teacher):
    """The LLM teacher `--teacher` names (None: the rule writer); its options only go with one."""
    options = {name: value for name, value in (("samples", args.samples), ("min_evidence", args.min_evidence),
                                                 ("windows", args.windows), ("scope", args.teach)) if value is not None}
    teacher = llm_teacher.LLMTeacher.from_spec(args.teacher, **options,
                                               say=lambda line: print(line, flush=True))
    if teacher is None and options:
        flag = {"scope": "teach"}.get(next(iter(options)), next(iter(options)))
        raise UserError(f"--{flag.replace('_', '-')} sets the LLM teacher: add --teacher llm:MODEL")
    return teacher


def _held_out_check(config) -> None:
    from memalpha.teacher import record
    from memalpha.teacher.warm_start import record_held_out_check

    check = record_held_out_check(config, say=lambda line: print(line, flush=True))
    print(f"{record.WARM_START / record.RECORD_FILE}: held-out check recorded, "
          f"QA {check['metrics']['eval/qa_score']:.3f} on {check['metrics']['eval/instances']:.0f} validation instances")
