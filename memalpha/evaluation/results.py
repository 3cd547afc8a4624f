"""Evaluation records and their aggregation: plain means, mean and std over seeds, flat metric keys.

An evaluation produces two record tables. `questions`: one row per (method, seed, instance, question)
with the reader's prediction and its score. `instances`: one row per (method, seed, instance) with
input and memory size, tool-call counts and timings.

Aggregation rules (documented in docs/EVALUATION.md):
- a group's score (a data source or a competency) is the mean of its question scores;
- a method's overall score is the plain, unweighted mean of its per-source scores (and, beside it,
  `competency_mean`, the plain mean of its per-competency scores);
- memory tokens and compression are means over instances; tool success is successful / all calls
  (absent for methods that make no calls); seconds is the method's total wall time over all instances;
- every number is first computed per seed, then reported as the mean over seeds with the sample
  standard deviation (ddof=1; 0 when only one seed ran).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import polars as pl

QUESTION_COLUMNS: dict[str, pl.DataType] = {
    "method": pl.String,
    "seed": pl.Int64,
    "instance_id": pl.String,
    "data_source": pl.String,
    "competency": pl.String,
    "input_tokens": pl.Int64,
    "question_id": pl.String,
    "question_type": pl.String,
    "question": pl.String,
    "prediction": pl.String,
    "score": pl.Float64,
}

INSTANCE_COLUMNS: dict[str, pl.DataType] = {
    "method": pl.String,
    "seed": pl.Int64,
    "instance_id": pl.String,
    "data_source": pl.String,
    "competency": pl.String,
    "num_chunks": pl.Int64,
    "num_questions": pl.Int64,
    "input_tokens": pl.Int64,
    "memory_tokens": pl.Int64,
    "compression": pl.Float64,
    "tool_calls": pl.Int64,
    "tool_calls_ok": pl.Int64,
    "answers_lost": pl.Int64,
    "prompts_cut": pl.Int64,
    "rechunked": pl.Boolean,
    "build_seconds": pl.Float64,
    "answer_seconds": pl.Float64,
}

GROUPINGS = ("data_source", "competency")

_METRIC_UNSAFE = re.compile(r"[^\w.\- ]")


def metric_name(part: str) -> str:
    """A metric-key segment MLflow accepts (letters, digits, `_ - . space`); other characters become `_`."""
    return _METRIC_UNSAFE.sub("_", part)


def empty_questions() -> pl.DataFrame:
    """An empty `questions` table with the canonical schema."""
    return pl.DataFrame(schema=QUESTION_COLUMNS)


def empty_instances() -> pl.DataFrame:
    """An empty `instances` table with the canonical schema."""
    return pl.DataFrame(schema=INSTANCE_COLUMNS)


@dataclass
class EvalResult:
    """Everything an evaluation measured, plus how it was run.

    `questions` and `instances` are the raw records (schemas above); `memories` the finished memories of
    memory methods ({method, seed, instance_id, memory}); `info` the run description (data path, split,
    seeds, reader, model) written next to the tables.
    """

    questions: pl.DataFrame = field(default_factory=empty_questions)
    instances: pl.DataFrame = field(default_factory=empty_instances)
    memories: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_columns(self.questions, QUESTION_COLUMNS, "questions")
        _check_columns(self.instances, INSTANCE_COLUMNS, "instances")

    @property
    def methods(self) -> list[str]:
        """Methods in the order they were first recorded."""
        return list(dict.fromkeys(self.instances["method"].to_list()))

    def merge(self, other: EvalResult) -> EvalResult:
        """Both results' records in one result (info of `self` wins on conflicts)."""
        return EvalResult(
            questions=pl.concat([self.questions, other.questions], how="vertical"),
            instances=pl.concat([self.instances, other.instances], how="vertical"),
            memories=self.memories + other.memories,
            info={**other.info, **self.info},
        )

    def summary(self) -> pl.DataFrame:
        """One row per method: overall score (mean/std over seeds), memory, compression, tools, time."""
        return summary_table(self)

    def by(self, column: str) -> pl.DataFrame:
        """One row per (method, group) for `data_source` or `competency`."""
        return group_table(self, column)

    def metrics(self) -> dict[str, float]:
        """Flat metric dict with method-named keys (see `flat_metrics`)."""
        return flat_metrics(self)


def _check_columns(frame: pl.DataFrame, expected: dict[str, pl.DataType], name: str) -> None:
    missing = [column for column in expected if column not in frame.columns]
    if missing:
        raise ValueError(f"EvalResult.{name} lacks columns {missing}")


def _seed_stats(per_seed: pl.DataFrame, keys: list[str], values: list[str]) -> pl.DataFrame:
    """Mean over seeds and sample std (0 for a single seed) of each value column, per key."""
    aggregations: list[pl.Expr] = [pl.col("seed").n_unique().alias("seeds")]
    for value in values:
        aggregations.append(pl.col(value).mean().alias(value))
        aggregations.append(pl.col(value).std(ddof=1).fill_null(0.0).fill_nan(0.0).alias(f"{value}_std"))
    return per_seed.group_by(keys, maintain_order=True).agg(aggregations)


def _instance_stats(instances: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """Per (keys, seed): mean memory/compression, tool success, total seconds, instance count."""
    calls = pl.col("tool_calls").sum()
    return instances.group_by([*keys, "seed"], maintain_order=True).agg(
        pl.len().alias("instances"),
        pl.col("input_tokens").mean().alias("input_tokens_mean"),
        pl.col("memory_tokens").cast(pl.Float64).mean().alias("memory_tokens"),
        pl.col("compression").mean().alias("compression"),
        pl.when(calls > 0).then(pl.col("tool_calls_ok").sum() / calls).otherwise(None).alias("tool_success"),
        pl.col("answers_lost").cast(pl.Float64).mean().alias("answers_lost"),
        pl.col("prompts_cut").cast(pl.Float64).sum().alias("prompts_cut"),
        (pl.col("build_seconds") + pl.col("answer_seconds")).sum().alias("seconds"),
    )


def group_table(result: EvalResult, column: str) -> pl.DataFrame:
    """Per (method, group): question-level mean score per seed, then mean/std over seeds, with sizes."""
    if column not in GROUPINGS:
        raise ValueError(f"cannot group by {column!r}; choose one of {GROUPINGS}")
    keys = ["method", column]
    scores = result.questions.group_by([*keys, "seed"], maintain_order=True).agg(
        pl.col("score").mean().alias("score"), pl.len().alias("questions")
    )
    per_seed = _instance_stats(result.instances, keys).join(scores, on=[*keys, "seed"], how="left")
    table = _seed_stats(per_seed, keys, ["score", "memory_tokens", "compression", "tool_success", "seconds"])
    sizes = per_seed.group_by(keys, maintain_order=True).agg(
        pl.col("instances").first(), pl.col("questions").first(), pl.col("input_tokens_mean").mean().alias("input_tokens")
    )
    table = table.join(sizes, on=keys, how="left")
    return _order(table, keys, result.methods)


def summary_table(result: EvalResult) -> pl.DataFrame:
    """Per method: `score`, the plain mean over data sources of per-source scores, and `competency_mean`,
    the plain mean over competencies (each per seed, then mean/std over seeds)."""
    source_scores = result.questions.group_by(["method", "data_source", "seed"], maintain_order=True).agg(
        pl.col("score").mean().alias("score")
    )
    overall = source_scores.group_by(["method", "seed"], maintain_order=True).agg(
        pl.col("score").mean().alias("score"), pl.col("data_source").n_unique().alias("sources")
    )
    competency_mean = (
        result.questions.group_by(["method", "competency", "seed"], maintain_order=True)
        .agg(pl.col("score").mean())
        .group_by(["method", "seed"], maintain_order=True)
        .agg(pl.col("score").mean().alias("competency_mean"))
    )
    questions = result.questions.group_by(["method", "seed"], maintain_order=True).agg(pl.len().alias("questions"))
    per_seed = _instance_stats(result.instances, ["method"]).join(overall, on=["method", "seed"], how="left")
    per_seed = per_seed.join(competency_mean, on=["method", "seed"], how="left")
    per_seed = per_seed.join(questions, on=["method", "seed"], how="left")
    values = ["score", "competency_mean", "memory_tokens", "compression", "tool_success", "answers_lost", "prompts_cut", "seconds"]
    table = _seed_stats(per_seed, ["method"], values)
    sizes = per_seed.group_by("method", maintain_order=True).agg(
        pl.col("sources").first(),
        pl.col("instances").first(),
        pl.col("questions").first(),
        pl.col("input_tokens_mean").mean().alias("input_tokens"),
    )
    return _order(table.join(sizes, on="method", how="left"), ["method"], result.methods)


def _order(table: pl.DataFrame, keys: list[str], methods: list[str]) -> pl.DataFrame:
    rank = {name: i for i, name in enumerate(methods)}
    ordered = table.with_columns(pl.col("method").replace_strict(rank, default=len(rank)).alias("_rank"))
    return ordered.sort(["_rank", *keys[1:]]).drop("_rank")


def _put(metrics: dict[str, float], key: str, value: Any) -> None:
    # absent (None/NaN) values are left out: MLflow charts treat a missing key better than a NaN
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return
    metrics[key] = float(value)


def flat_metrics(result: EvalResult) -> dict[str, float]:
    """Flat `<method>/...` metrics for MLflow.

    `<m>/score`, `<m>/score_std`, `<m>/competency_mean`, `<m>/memory_tokens`, `<m>/compression`, `<m>/tool_success` (only when
    the method made tool calls), `<m>/answers_lost` (memory writers: answers held after some chunk and
    lost by the end, per instance), `<m>/prompts_cut` (writer prompts over the prompt budget, whose start
    was cut, per seed), `<m>/seconds`, `<m>/<competency>/score` (+ `_std`) and
    `<m>/source/<data_source>/score` (+ `_std`).
    """
    metrics: dict[str, float] = {}
    for row in summary_table(result).iter_rows(named=True):
        m = metric_name(row["method"])
        for name in ("score", "score_std", "competency_mean", "memory_tokens", "compression", "tool_success", "answers_lost",
                     "prompts_cut", "seconds"):
            _put(metrics, f"{m}/{name}", row[name])
    for row in group_table(result, "competency").iter_rows(named=True):
        prefix = f"{metric_name(row['method'])}/{metric_name(row['competency'])}"
        _put(metrics, f"{prefix}/score", row["score"])
        _put(metrics, f"{prefix}/score_std", row["score_std"])
    for row in group_table(result, "data_source").iter_rows(named=True):
        prefix = f"{metric_name(row['method'])}/source/{metric_name(row['data_source'])}"
        _put(metrics, f"{prefix}/score", row["score"])
        _put(metrics, f"{prefix}/score_std", row["score_std"])
    return metrics
