"""Summaries for people: a training run's (`python -m tasks.summary summary --flow-run-id ID`, printed at the
end of `make train` by infra/train.sh) and a sweep's (`... sweep --flow-run-id ID`, `make sweep`)."""

from __future__ import annotations

import argparse
import sys

from tasks.tracking import (
    COMPARE_TAG,
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


SWEEP_COLUMNS = (("reward", REWARD_KEY), ("beta r3", "rewards/beta_r3/mean"), ("gamma r4", "rewards/gamma_r4_gated/mean"),
                 ("memory tokens", "memory/tokens"))
"""What `summarize_sweep` shows of each child at its last step: the reward, the terms the weights scale, memory size."""


def summarize_sweep(parent_run_id: str) -> str:
    """Human summary of a sweep: where to compare its children, then each child's weights, last-step reward
    terms and memory size, and held-out QA from the warm start (step 0) to its last evaluation."""
    client = configure()
    parent = client.get_run(parent_run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                  order_by=["attributes.start_time ASC"])
    lines = [f"sweep run:   {run_url(parent_run_id)}", f"status:      {parent.info.status}, {len(children)} children",
             f"compare:     {parent.data.tags.get(COMPARE_TAG, '(not recorded)')}", "",
             f"{'beta':>6} {'gamma':>6} {'steps':>5} " + " ".join(f"{name:>13}" for name, _ in SWEEP_COLUMNS) + "  held-out QA"]
    for child in children:
        steps = sorted(logged_steps(child.info.run_id))
        cells = [child.data.params.get(k, "?") for k in ("reward.beta", "reward.gamma")] + [str(len(steps))]
        cells += [f"{child.data.metrics[key]:.3f}" if key in child.data.metrics else "-" for _, key in SWEEP_COLUMNS]
        qa = metric_series(child.info.run_id, VALIDATION_KEY)
        held_out = f"{qa[0][1]:.3f} (step {qa[0][0]}) -> {qa[-1][1]:.3f} (step {qa[-1][0]})" if qa else "-"
        lines.append(f"{cells[0]:>6} {cells[1]:>6} {cells[2]:>5} " + " ".join(f"{c:>13}" for c in cells[3:]) + f"  {held_out}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.summary summary|sweep --flow-run-id ID [--experiment NAME]` (used by infra/train.sh and
    infra/sweep.sh)."""
    parser = argparse.ArgumentParser(prog="python -m tasks.summary")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (("summary", "the training run"), ("sweep", "the sweep")):
        command = sub.add_parser(name, help=f"summarize {what} of a Prefect flow run")
        command.add_argument("--flow-run-id", required=True)
        command.add_argument("--experiment", help="MLflow experiment (default: search all)")
    args = parser.parse_args(argv)
    run_id = find_run(args.experiment, "prefect.flow_run_id", args.flow_run_id)
    if run_id is None:
        print(f"no MLflow run is tagged with flow run {args.flow_run_id}", file=sys.stderr)
        return 1
    print(summarize_sweep(run_id) if args.command == "sweep" else summarize(run_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
