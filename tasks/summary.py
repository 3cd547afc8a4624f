"""A training run's summary for people: `python -m tasks.summary summary --flow-run-id ID` (infra/train.sh
prints it at the end of `make train`)."""

from __future__ import annotations

import argparse
import sys

from tasks.tracking import (
    TIME_BUDGET_TAG,
    VALIDATION_KEY,
    configure,
    find_run,
    logged_steps,
    metric_series,
    run_url,
)

REWARD_KEY = "reward"
"""The trainer's mean total reward per step (TRL's name)."""


def summarize(run_id: str) -> str:
    """Human summary of a training run: steps, reward at start and end, checkpoint, registered model."""
    client = configure()
    run = client.get_run(run_id)
    tags = run.data.tags
    steps = sorted(logged_steps(run_id))
    lines = [f"MLflow run:  {run_url(run_id)}", f"status:      {run.info.status}",
             f"steps:       {len(steps)} logged" + (f" ({steps[0]}..{steps[-1]})" if steps else "")]
    if REWARD_KEY in run.data.metrics:
        key, series = REWARD_KEY, metric_series(run_id, REWARD_KEY)
        lines.append(f"{key}: start {series[0][1]:.4f} (step {series[0][0]}) -> end {series[-1][1]:.4f} (step {series[-1][0]})")
    if VALIDATION_KEY in run.data.metrics:
        step, value = metric_series(run_id, VALIDATION_KEY)[-1]
        lines.append(f"validation:  {VALIDATION_KEY} {value:.4f} at step {step}")
        warm = f"warm_start/{VALIDATION_KEY}"
        if warm in run.data.metrics:
            lines.append(f"held-out QA: warm start {run.data.metrics[warm]:.4f} -> step {step} {value:.4f} "
                         f"(greedy, validation split, retrieval as in evaluation)")
        if "best/step" in run.data.metrics:
            best = int(run.data.metrics["best/step"])
            which = "the warm start (no GRPO step scored higher)" if best == 0 else f"step {best}"
            lines.append(f"selected:    {which}, validation QA {run.data.metrics['best/qa_score']:.4f}: "
                         "the adapter that is checkpointed as best and registered")
    for label, tag in (("time budget:", TIME_BUDGET_TAG), ("run folder:", "memalpha.run_dir"),
                       ("checkpoint:", "memalpha.last_checkpoint"),
                       ("best:", "memalpha.best_checkpoint"), ("model:", "memalpha.registered_model")):
        if tag in tags:
            lines.append(f"{label:<12} {tags[tag]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.summary summary --flow-run-id ID [--experiment NAME]` (used by infra/train.sh)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.summary")
    sub = parser.add_subparsers(dest="command", required=True)
    summary = sub.add_parser("summary", help="summarize the training run of a Prefect flow run")
    summary.add_argument("--flow-run-id", required=True)
    summary.add_argument("--experiment", help="MLflow experiment (default: search all)")
    args = parser.parse_args(argv)
    run_id = find_run(args.experiment, "prefect.flow_run_id", args.flow_run_id)
    if run_id is None:
        print(f"no MLflow run is tagged with flow run {args.flow_run_id}", file=sys.stderr)
        return 1
    print(summarize(run_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
