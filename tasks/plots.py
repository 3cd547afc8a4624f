"""Training plots logged to an MLflow run: the metric histories by group (reward, memory, tool calls,
held-out QA), one figure each."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: plots are written to files, never shown

from matplotlib.figure import Figure  # noqa: E402

from tasks.tracking import configure, metric_series  # noqa: E402


def _plot(series: dict[str, list[tuple[int, float]]], title: str, ylabel: str) -> Figure:
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for label, points in series.items():
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o", markersize=3, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if any(series.values()):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


PLOT_GROUPS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # file name: (title, y label, metric-key prefixes or exact keys)
    "reward.png": ("Reward and its components", "reward", ("reward", "rewards/")),
    "memory.png": ("Memory size", "tokens / entries", ("memory/",)),
    "tool_calls.png": ("Tool-call outcomes", "per chunk / share", ("tool_calls/",)),
    "validation.png": ("Validation", "score", ("eval/qa_score", "eval/reward", "eval/rewards/", "eval/tool_calls/success_rate")),
}


def log_training_plots(run_id: str) -> list[str]:
    """Plot the run's metric histories by group (reward, memory, tool calls, validation) as artifacts."""
    client = configure()
    keys = sorted(client.get_run(run_id).data.metrics)
    logged = []
    for filename, (title, ylabel, prefixes) in PLOT_GROUPS.items():
        chosen = [k for k in keys if k.startswith(prefixes)]
        if not chosen:
            continue
        series = {k: metric_series(run_id, k) for k in chosen}
        client.log_figure(run_id, _plot(series, title, ylabel), f"plots/{filename}")
        logged.append(f"plots/{filename}")
    return logged
