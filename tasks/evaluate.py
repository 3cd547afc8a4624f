"""Evaluation tasks: fetch the registered champion, evaluate it with memalpha.evaluation, log to MLflow,
compare with the previous nightly run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from memalpha.config import RunConfig
from tasks import tracking

NIGHTLY_SUFFIX = "-nightly"


@task(name="fetch-model", cache_policy=NO_CACHE, retries=1)
def fetch_model(config: RunConfig, alias: str, dest: str) -> dict[str, Any]:
    """Download `<registered_model>@<alias>` into `dest`; returns its adapter folder, version and base policy."""
    from memalpha.evaluation import model_artifacts, resolve_adapter

    client = tracking.configure()
    name = config.tracking.registered_model
    try:
        if alias == "latest":  # reserved by MLflow: the newest version, never set by hand
            version = max(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
        else:
            version = client.get_model_version_by_alias(name, alias)
    except (mlflow.exceptions.MlflowException, ValueError) as exc:
        raise RuntimeError(f"no model version of {name!r} has the alias {alias!r}; train one first (make train)") from exc
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version.version}", dst_path=dest))
    adapter = resolve_adapter(local)
    trained_with = client.get_run(version.run_id).data.params if version.run_id else {}
    # the base model logged with the writer is exactly the weights the adapter was trained on
    base = model_artifacts(local).get("base_model")
    policy = str(base) if base and (base / "config.json").is_file() else trained_with.get("model.policy", config.model.policy)
    return {"name": name, "version": version.version, "run_id": version.run_id, "adapter": str(adapter), "policy": policy}


@task(name="run-evaluation", cache_policy=NO_CACHE)
def run_evaluation(config: RunConfig, adapter: str | None, out_dir: str) -> dict[str, Any]:
    """Evaluate with memalpha.evaluation and write its report; returns the flat metrics and report files."""
    from memalpha.evaluation import evaluate, write_report

    result = evaluate(config, model_uri=adapter, progress=get_run_logger().info)
    paths = write_report(result, out_dir, title=f"Nightly evaluation ({config.eval.split})")
    return {"metrics": result.metrics(), "report_dir": out_dir, "files": {k: str(v) for k, v in paths.items()}}


def _previous_metrics(experiment: str) -> dict[str, float] | None:
    client = tracking.configure()
    experiment_obj = client.get_experiment_by_name(experiment)
    if experiment_obj is None:
        return None
    runs = client.search_runs([experiment_obj.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return dict(runs[0].data.metrics) if runs else None


@task(name="log-evaluation", cache_policy=NO_CACHE)
def log_evaluation(config: RunConfig, model: dict[str, Any], evaluation: dict[str, Any], tags: dict[str, str]) -> dict[str, Any]:
    """One MLflow run in `<experiment>-nightly`: metrics, the report, the regression check against the last run."""
    from memalpha.evaluation.regression import check_regression

    logger = get_run_logger()
    experiment = config.tracking.experiment + NIGHTLY_SUFFIX
    previous = _previous_metrics(experiment)
    check = check_regression(evaluation["metrics"], previous, config.eval.regression_threshold)
    run_tags = {**tags, "memalpha.model": f"{model['name']} v{model['version']}", "memalpha.model_run_id": model["run_id"] or "",
                "memalpha.regressed": str(check.regressed)}
    params = {k: v for k, v in config.flat().items() if k.startswith(("eval.", "retrieval.", "memory.", "model.reader"))}
    run_id = tracking.create_run(experiment, f"nightly-v{model['version']}", params, run_tags)
    client = tracking.configure()
    tracking.log_step_metrics(run_id, 0, evaluation["metrics"], tracking.now_ms())
    client.log_artifacts(run_id, evaluation["report_dir"], "report")
    client.log_text(run_id, check.to_markdown(), "report/regression.md")
    client.set_terminated(run_id, status="FINISHED")
    logger.info(check.message)
    return {"run_id": run_id, "regressed": check.regressed, "message": check.message}
