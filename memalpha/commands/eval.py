"""`memalpha eval`: compare the trained policy with the baselines locally and write a report."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from memalpha.config import EVAL_METHODS, load_config
from memalpha.errors import UserError

METRICS_FILE = "metrics.json"


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a policy against the baselines and write a report")
    parser.add_argument("--model", help="trained adapter: an adapter folder, a checkpoint, a run folder (its best/ "
                        "adapter, else its latest checkpoint), or a downloaded registered model (MLmodel folder); "
                        "needed for the `policy` method")
    parser.add_argument("--data", help="dataset folder (default: eval.data_path)")
    parser.add_argument("--methods", nargs="+", choices=EVAL_METHODS, metavar="METHOD",
                        help=f"methods to compare (default: eval.methods); any of {', '.join(EVAL_METHODS)}")
    parser.add_argument("--split", choices=["train", "validation", "test", "all"],
                        help="split to evaluate (default: eval.split, test); all = every instance of the dataset")
    parser.add_argument("--max-instances", type=int, metavar="N",
                        help="instances to evaluate, round-robin over competencies; 0 = all (default: "
                             "eval.max_instances, 8; 0 when --split all)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds for sampled decoding (default: eval.seeds)")
    parser.add_argument("--out", default="runs/eval", help="report folder (default: runs/eval)")
    parser.add_argument("--length", action="store_true",
                        help="also run length generalisation (synthetic instances at eval.length_multipliers)")
    parser.add_argument("--compare", metavar="DIR",
                        help="a previous report folder: fail (exit 1) if a watched metric regressed beyond "
                        "eval.regression_threshold")
    parser.add_argument("--ray-workers", type=int, metavar="N",
                        help="spread each method's instances over N Ray workers (default: eval.ray_workers, 0 = no Ray)")
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="a running Ray cluster (`auto`, `ray://host:10001`); default: a local Ray on 127.0.0.1")
    parser.add_argument("--config", help="YAML config file (default: embedded defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.set_defaults(handler=_run)


def _previous_metrics(folder: str) -> dict[str, float]:
    path = Path(folder) / METRICS_FILE
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"--compare: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--compare: {path} is not valid JSON ({exc})") from None


def _run(args) -> int:
    from memalpha.evaluation import (
        evaluate,
        evaluate_length,
        resolve_adapter,
        write_report,
    )
    from memalpha.evaluation.regression import check_regression

    overrides = list(args.set)
    if args.split:
        overrides.append(f"eval.split={args.split}")
    if args.max_instances is not None or args.split == "all":
        overrides.append(f"eval.max_instances={args.max_instances if args.max_instances is not None else 0}")
    if args.ray_workers is not None:
        overrides.append(f"eval.ray_workers={args.ray_workers}")
    if args.ray_address is not None:
        overrides.append(f"eval.ray_address={args.ray_address}")
    config = load_config(args.config, overrides)
    previous = _previous_metrics(args.compare) if args.compare else None
    model = resolve_adapter(args.model) if args.model else None
    result = evaluate(config, args.data, args.methods, model_uri=model, seeds=args.seeds)
    result.info["command"] = "memalpha " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "memalpha eval"
    metrics = result.metrics()
    extra = ""
    if args.length:
        length = evaluate_length(config, args.methods, model_uri=model, seeds=args.seeds)
        length.write(args.out)
        metrics.update(length.metrics())
        extra = length.markdown() + "\n\n![length generalisation](length_generalisation.png)"
    check = None
    if previous is not None:
        check = check_regression(metrics, previous, config.eval.regression_threshold, config.eval.regression_keys)
        extra += f"\n\n### Regression check\n\n{check.message}\n\n{check.to_markdown()}"
    paths = write_report(result, args.out, title=f"Evaluation ({result.info['covered']})", extra_markdown=extra.strip())
    (Path(args.out) / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True))
    print()
    print(paths["markdown"].read_text().split("![", 1)[0].rstrip())
    print(f"\nreport: {paths['markdown']}")
    if check is not None:
        print(check.message, file=sys.stderr if check.regressed else sys.stdout)
        return 1 if check.regressed else 0
    return 0
