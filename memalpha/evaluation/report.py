"""Evaluation reports: markdown and CSV tables, and plots (score vs memory size, score vs input length)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
from matplotlib.figure import Figure

from memalpha.evaluation.results import EvalResult

SUMMARY_COLUMNS = [
    ("method", "method"),
    ("score", "score"),
    ("competency_mean", "mean over competencies"),
    ("memory_tokens", "memory tokens"),
    ("compression", "compression"),
    ("tool_success", "tool-call success"),
    ("answers_lost", "answers lost"),
    ("prompts_cut", "writer prompts cut"),
    ("seconds", "time (s)"),
    ("sources", "sources"),
    ("instances", "instances"),
    ("questions", "questions"),
    ("input_tokens", "input tokens"),
    ("seeds", "seeds"),
]


_TEXT_COLUMNS = ("method", "data_source", "competency")


def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if value is None:
        return "-"
    std = row.get(f"{column}_std")
    if column in ("score", "competency_mean", "compression", "tool_success"):
        text = f"{value:.3f}"
        return f"{text} ± {std:.3f}" if std and row.get("seeds", 1) > 1 else text
    if column in ("memory_tokens", "input_tokens"):
        text = f"{value:,.0f}"
        return f"{text} ± {std:,.0f}" if std and row.get("seeds", 1) > 1 else text
    if column == "seconds":
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def markdown_table(table: pl.DataFrame, columns: list[tuple[str, str]]) -> str:
    """A markdown table of the given (column, header) pairs; `x ± std` where several seeds ran."""
    present = [(column, header) for column, header in columns if column in table.columns]
    lines = ["| " + " | ".join(header for _, header in present) + " |"]
    lines.append("|" + "|".join("---" if column in _TEXT_COLUMNS else "---:" for column, _ in present) + "|")
    for row in table.iter_rows(named=True):
        lines.append("| " + " | ".join(_cell(row, column) for column, _ in present) + " |")
    return "\n".join(lines)


def _group_columns(group: str) -> list[tuple[str, str]]:
    return [("method", "method"), (group, group.replace("_", " "))] + [
        c for c in SUMMARY_COLUMNS[1:] if c[0] not in ("sources", "competency_mean")
    ]


def summary_markdown(result: EvalResult) -> str:
    """The summary, per-competency and per-source tables as markdown."""
    parts = [
        "### Overall (plain mean over data sources)",
        markdown_table(result.summary(), SUMMARY_COLUMNS),
        "### Per competency",
        markdown_table(result.by("competency"), _group_columns("competency")),
        "### Per data source",
        markdown_table(result.by("data_source"), _group_columns("data_source")),
    ]
    return "\n\n".join(parts)


def _csv_ready(table: pl.DataFrame) -> pl.DataFrame:
    return table.select([pl.col(c) for c in table.columns if table.schema[c] != pl.Object])


def plot_score_vs_memory(result: EvalResult, path: Path) -> Path:
    """Each method's overall score against its mean memory size (error bars: std over seeds)."""
    summary = result.summary()
    figure = Figure(figsize=(6.4, 4.4))
    axes = figure.subplots()
    for row in summary.iter_rows(named=True):
        x = max(row["memory_tokens"] or 0.0, 0.0)
        axes.errorbar([x], [row["score"]], yerr=[row["score_std"]], fmt="o", capsize=3, label=row["method"])
        axes.annotate(row["method"], (x, row["score"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    axes.set_xscale("symlog", linthresh=10)
    axes.set_xlabel("memory tokens per instance (mean)")
    axes.set_ylabel("score (plain mean over sources)")
    axes.set_ylim(-0.05, 1.05)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    axes.set_title("Score vs memory size")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def length_points(result: EvalResult) -> pl.DataFrame:
    """Per (method, instance): input tokens and the instance's mean question score (mean over seeds)."""
    return (
        result.questions.group_by(["method", "instance_id", "seed"], maintain_order=True)
        .agg(pl.col("input_tokens").first(), pl.col("score").mean())
        .group_by(["method", "instance_id"], maintain_order=True)
        .agg(pl.col("input_tokens").first(), pl.col("score").mean(), pl.col("score").std(ddof=1).fill_null(0.0).alias("score_std"))
        .sort(["method", "input_tokens"])
    )


def plot_score_vs_length(points: pl.DataFrame, path: Path, title: str = "Score vs input length") -> Path:
    """Score against input tokens, one line per method; `points` has method, input_tokens, score, score_std."""
    figure = Figure(figsize=(6.4, 4.4))
    axes = figure.subplots()
    methods = list(dict.fromkeys(points["method"].to_list()))
    for method in methods:
        rows = points.filter(pl.col("method") == method).sort("input_tokens")
        axes.errorbar(
            rows["input_tokens"].to_list(), rows["score"].to_list(), yerr=rows["score_std"].to_list(),
            marker="o", capsize=3, label=method,
        )
    axes.set_xscale("log")
    axes.set_xlabel("input tokens per instance")
    axes.set_ylabel("score")
    axes.set_ylim(-0.05, 1.05)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def write_report(result: EvalResult, out_dir: str | Path, title: str = "Evaluation", extra_markdown: str = "") -> dict[str, Path]:
    """Write results.md, summary/by_competency/by_source CSVs, the raw records, the finished memories
    (memories.jsonl), info.json and the plots.

    Returns the written paths by name, so the pipeline can log them as artifacts.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    tables = {
        "summary": result.summary(),
        "by_competency": result.by("competency"),
        "by_source": result.by("data_source"),
    }
    for name, table in tables.items():
        paths[f"{name}_csv"] = out / f"{name}.csv"
        _csv_ready(table).write_csv(paths[f"{name}_csv"])
    paths["questions"] = out / "questions.csv"
    result.questions.write_csv(paths["questions"])
    paths["instances"] = out / "instances.csv"
    result.instances.write_csv(paths["instances"])
    paths["memories"] = out / "memories.jsonl"
    paths["memories"].write_text("".join(json.dumps(m, ensure_ascii=False) + "\n" for m in result.memories),
                                 encoding="utf-8", errors="backslashreplace")  # a lone surrogate from a model
    paths["info"] = out / "info.json"
    paths["info"].write_text(json.dumps(result.info, indent=2, sort_keys=True, default=str), encoding="utf-8")
    paths["score_vs_memory"] = plot_score_vs_memory(result, out / "score_vs_memory.png")
    paths["score_vs_length"] = plot_score_vs_length(length_points(result), out / "score_vs_length.png")
    lines = [f"# {title}", ""]
    for key in ("command", "data", "split", "covered", "seeds", "decoding", "reader", "model", "retrieval"):
        if key in result.info:
            lines.append(f"- {key}: `{result.info[key]}`")
    lines += ["", summary_markdown(result)]
    if extra_markdown:
        lines += ["", extra_markdown]
    lines += ["", "![score vs memory](score_vs_memory.png)", "", "![score vs input length](score_vs_length.png)", ""]
    paths["markdown"] = out / "results.md"
    paths["markdown"].write_text("\n".join(lines), encoding="utf-8", errors="backslashreplace")
    return paths
