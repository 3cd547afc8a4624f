"""MLflow store and run lifecycle shared by the tasks: where the store is, experiments, runs, params,
tags and idempotent step logging. Plots live in tasks/plots.py, the run summary in tasks/summary.py.

The store is `MLFLOW_TRACKING_URI` when set (e.g. a remote server), else SQLite at
`<repo>/mlruns/mlflow.db` with artifacts under `<repo>/mlruns/artifacts`, both by absolute path since
Prefect runners may start flows in another directory. MLflow's active run is thread-local and Prefect
runs tasks on worker threads, so everything here takes an explicit run id and uses `MlflowClient`.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

REPO_ROOT = Path(__file__).resolve().parents[1]
MLRUNS = REPO_ROOT / "mlruns"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on one param value
BATCH_LIMIT = 100  # MLflow's limit on params (and tags) per log_batch call
STEP_SENTINEL = "pipeline/step_seconds"
"""Logged in the same batch as every training step's metrics: its history is the set of logged steps."""


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI`, or the project's SQLite store by absolute path."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{MLRUNS / 'mlflow.db'}"


def artifact_root() -> Path | None:
    """Where experiments created against a SQLite store keep artifacts: `artifacts/` beside the database.

    None for a server URI, where the server's own artifact root applies.
    """
    uri = tracking_uri()
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).parent / "artifacts"


def ui_url() -> str:
    """Base URL of the MLflow UI that shows this store (`MEMALPHA_MLFLOW_UI` or the local server)."""
    uri = tracking_uri()
    if uri.startswith("http"):
        return uri.rstrip("/")
    return os.environ.get("MEMALPHA_MLFLOW_UI", f"http://127.0.0.1:{os.environ.get('MEMALPHA_MLFLOW_PORT', '5000')}")


def configure() -> MlflowClient:
    """Point the mlflow module (tracking and registry) at the store and return a client for it."""
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def ensure_experiment(name: str) -> str:
    """Id of the named experiment, created (with its artifacts under mlruns/) if missing."""
    client = configure()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    root = artifact_root()
    location = (root / name).as_uri() if root else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except mlflow.exceptions.MlflowException:
        # another process created it between our lookup and create
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:MAX_PARAM_LENGTH]


def create_run(experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
               parent_run_id: str | None = None) -> str:
    """Create a run with params and tags (a child of `parent_run_id` when given); return its id."""
    client = configure()
    experiment_id = ensure_experiment(experiment)
    all_tags = dict(tags)
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    log_params(run.info.run_id, params)
    return run.info.run_id


def log_params(run_id: str, params: dict[str, Any]) -> None:
    """Log params in batches; values that are not strings are JSON-encoded (lists stay readable)."""
    client = configure()
    items = [Param(key, _param_value(value)) for key, value in params.items()]
    for start in range(0, len(items), BATCH_LIMIT):
        client.log_batch(run_id, params=items[start:start + BATCH_LIMIT])


def set_tags(run_id: str, tags: dict[str, Any]) -> None:
    """Set several tags at once."""
    configure().log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def finite_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Numeric, finite entries only: NaN or inf from an empty batch would break charts and comparisons."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(float(value)):
            out[key] = float(value)
    return out


def now_ms() -> int:
    """Wall-clock time in milliseconds, MLflow's metric timestamp unit."""
    return int(time.time() * 1000)


def log_step_metrics(run_id: str, step: int, metrics: dict[str, float], timestamp_ms: int) -> None:
    """All metrics of one step in one batch (one SQL transaction on the SQLite store)."""
    client = configure()
    items = [Metric(key, value, timestamp_ms, step) for key, value in finite_metrics(metrics).items()]
    for start in range(0, len(items), 1000):
        client.log_batch(run_id, metrics=items[start:start + 1000])


def logged_steps(run_id: str, key: str = STEP_SENTINEL) -> set[int]:
    """Steps at which `key` was logged: with the sentinel, the training steps already in MLflow."""
    return {m.step for m in configure().get_metric_history(run_id, key)}


def artifact_exists(run_id: str, path: str) -> bool:
    """Whether the run already has an artifact at `path` (a file or a folder)."""
    parent = str(Path(path).parent) if "/" in path else None
    names = {item.path for item in configure().list_artifacts(run_id, parent)}
    return path in names


def find_run(experiment: str | None, tag: str, value: str) -> str | None:
    """Id of the newest run with tag == value in the experiment (or in any experiment), or None."""
    client = configure()
    if experiment is None:
        ids = [e.experiment_id for e in client.search_experiments()]
    else:
        found = client.get_experiment_by_name(experiment)
        ids = [found.experiment_id] if found else []
    if not ids:
        return None
    runs = client.search_runs(ids, filter_string=f"tags.`{tag}` = '{value}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


UI_VIEW = "workflowType=machine_learning"
"""The MLflow UI's training view: MLflow 3.17 opens its GenAI view unless the link names this one (it no longer
reads an experiment's `mlflow.experimentKind` tag)."""
SHARED_VIEW_TAG = "mlflow.sharedViewState."
"""Experiment tag prefix under which the MLflow UI's Share button stores a runs view (key: `viewStateShareKey`)."""
COMPARE_TAG = "memalpha.compare_url"
"""A parent run's tag holding `share_children_view`'s link (a sweep's)."""


def run_url(run_id: str) -> str:
    """Link to the run in the MLflow UI."""
    run = configure().get_run(run_id)
    return f"{ui_url()}/#/experiments/{run.info.experiment_id}/runs/{run_id}?{UI_VIEW}"


LINE_CHART = {"type": "LINE", "runsCountToCompare": 100, "deleted": False, "isGenerated": True, "lineSmoothness": 0,
              "xAxisKey": "step", "xAxisScaleType": "linear", "scaleType": "linear", "selectedXAxisMetricKey": "",
              "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False, "useGlobalXaxisKey": True,
              "useGlobalLineSmoothing": True}
"""A metric's line chart over steps as the MLflow 3.17 UI stores one (its `RunsChartsLineCardConfig`)."""


def share_children_view(parent_run_id: str, group_by: list[str], section: str, metrics: list[str]) -> str:
    """Link to the MLflow UI's chart view of a parent run's children (a sweep's runs): one series per child in
    every chart, first a section `section` of `metrics`, then the UI's own chart of every other metric. The view
    is stored on the experiment as the UI's Share button stores one: the runs filtered on the parent and grouped
    by the params in `group_by`, which the children differ in and the parent lacks (filtered alone, the
    children stay folded under their parent and the charts are empty)."""
    client = configure()
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    view = {"searchFilter": f"tags.mlflow.parentRunId = '{parent_run_id}'", "runsHiddenMode": "SHOW_ALL",
            "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "param", "groupByData": key} for key in group_by]},
            "useGroupedValuesInCharts": False,  # each run its own series, not its group's mean
            "isAccordionReordered": True,  # `section` first, not sorted among the generated ones
            "compareRunSections": [{"uuid": "first", "name": section, "display": True, "isReordered": False, "deleted": False}],
            "compareRunCharts": [{**LINE_CHART, "uuid": f"first-{i}", "metricSectionId": "first", "metricKey": key}
                                 for i, key in enumerate(metrics)]}
    client.set_experiment_tag(experiment_id, SHARED_VIEW_TAG + parent_run_id, json.dumps(view))
    return f"{ui_url()}/#/experiments/{experiment_id}/runs?viewStateShareKey={parent_run_id}&compareRunsMode=CHART&{UI_VIEW}"


def metric_series(run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of a metric, sorted by step."""
    return sorted((m.step, m.value) for m in configure().get_metric_history(run_id, key))


DESCRIPTION_TAG = "mlflow.note.content"
"""The tag the MLflow UI shows as a run's description."""
VALIDATION_KEY = "eval/qa_score"
"""The validation score the best adapter and the champion are chosen by (the QA score, r1's metric)."""
TIME_BUDGET_TAG = "memalpha.time_budget"
"""Set when `time_budget_minutes` ended GRPO before `grpo.steps`: what was spent and where it stopped."""
