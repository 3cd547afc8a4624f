"""Flow `evaluate` (deployment `nightly`, cron 02:00): evaluate the registered champion on the held-out set."""

from __future__ import annotations

import tempfile

from prefect import flow, runtime
from prefect.artifacts import create_markdown_artifact

from flows import default_config
from memalpha.config import RunConfig
from tasks.evaluate import fetch_model, log_evaluation, run_evaluation


@flow(name="evaluate")
def evaluate(config: RunConfig = default_config(), alias: str = "champion") -> dict:
    """Evaluate `<registered model>@<alias>`; the flow fails when a watched score regressed."""
    with tempfile.TemporaryDirectory(prefix="memalpha-eval-") as tmp:
        model = fetch_model(config, alias, f"{tmp}/model")
        run_config = config.model_copy(deep=True)
        run_config.model.policy = model["policy"]
        evaluation = run_evaluation(run_config, model["adapter"], f"{tmp}/report")
        tags = {"prefect.flow_run_id": str(runtime.flow_run.id), "prefect.deployment": str(runtime.deployment.name or "")}
        logged = log_evaluation(run_config, model, evaluation, tags)
    create_markdown_artifact(key="nightly-regression", markdown=logged["message"])
    if logged["regressed"]:
        raise RuntimeError(logged["message"])
    return logged
