"""Nightly regression check: compare this evaluation's metrics with a previous run's.

A watched metric regresses when it fell by more than the threshold (absolute, in score units). A
watched metric that the previous run had and this run lacks also counts, since a method that silently
stopped running must not pass. The flow turns `RegressionCheck.regressed` into a failed state and
shows `message`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MetricComparison:
    """One watched metric: previous and current values and the verdict."""

    key: str
    previous: float | None
    current: float | None
    status: str  # "ok", "regressed", "missing" (gone from this run), "new" (no previous value)

    @property
    def delta(self) -> float | None:
        """current - previous, when both exist."""
        if self.previous is None or self.current is None:
            return None
        return self.current - self.previous


@dataclass
class RegressionCheck:
    """The verdict over all watched metrics."""

    regressed: bool
    message: str
    threshold: float
    comparisons: list[MetricComparison] = field(default_factory=list)

    def to_markdown(self) -> str:
        """The comparison as a markdown table, for reports and the Prefect artifact."""
        lines = [
            "| metric | previous | current | delta | status |",
            "|---|---:|---:|---:|---|",
        ]
        for item in self.comparisons:
            lines.append(
                f"| {item.key} | {_fmt(item.previous)} | {_fmt(item.current)} | {_fmt(item.delta, sign=True)} | {item.status} |"
            )
        return "\n".join(lines)


def _fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.4f}" if sign else f"{value:.4f}"


def check_regression(
    current: dict[str, float],
    previous: dict[str, float] | None,
    threshold: float,
    keys: list[str] | tuple[str, ...] = ("policy/score",),
) -> RegressionCheck:
    """Compare watched metrics (`keys`, fnmatch patterns such as `policy/*/score`) with a previous run.

    Regressed when any watched metric fell by more than `threshold`, or is missing from `current`
    although `previous` had it. Without a previous run nothing can regress.
    """
    if threshold < 0:
        raise ValueError(f"regression threshold must be >= 0, got {threshold}")
    if not previous:
        return RegressionCheck(False, "no previous evaluation to compare with; regression check skipped", threshold)
    watched = sorted({key for pattern in keys for key in (*previous, *current) if fnmatch.fnmatchcase(key, pattern)})
    comparisons: list[MetricComparison] = []
    for key in watched:
        before, now = previous.get(key), current.get(key)
        if before is None:
            status = "new"
        elif now is None:
            status = "missing"
        elif now < before - threshold:
            status = "regressed"
        else:
            status = "ok"
        comparisons.append(MetricComparison(key, before, now, status))
    if not comparisons:
        return RegressionCheck(
            False, f"no metric matches {list(keys)} in either run; regression check skipped", threshold, comparisons
        )
    bad = [item for item in comparisons if item.status in ("regressed", "missing")]
    if not bad:
        worst = min((item.delta for item in comparisons if item.delta is not None), default=None)
        detail = f" (largest drop {-worst:.4f})" if worst is not None and worst < 0 else ""
        return RegressionCheck(
            False, f"no regression beyond {threshold:.4f} in {len(comparisons)} watched metric(s){detail}", threshold, comparisons
        )
    parts = []
    for item in bad:
        if item.status == "missing":
            parts.append(f"{item.key} is missing (previous {item.previous:.4f})")
        else:
            parts.append(f"{item.key} fell from {item.previous:.4f} to {item.current:.4f} ({item.delta:+.4f})")
    message = f"REGRESSION beyond threshold {threshold:.4f}: " + "; ".join(parts)
    return RegressionCheck(True, message, threshold, comparisons)
