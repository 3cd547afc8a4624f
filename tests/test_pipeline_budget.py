"""The `grpo` flow when its time budget leaves no GRPO step: the flow run fails instead of finishing
"successfully" with nothing trained, says why (load average, how to give it more time), tags the MLflow run
with it and its held-out check of the starting policy, does not retry the block, and registers nothing."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness
from test_rollout import make_dataset, tiny_config

from memalpha.errors import NoTrainingStep
from tasks import tracking

pytestmark = pytest.mark.slow  # starts Prefect's ephemeral test server (~20 s)


def test_a_budget_spent_before_step_one_fails_the_flow_run_and_registers_nothing(tmp_path, monkeypatch):
    from flows.grpo import grpo

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    # 0.06 s: spent by the time the trainer has loaded and checked the starting policy
    config = tiny_config(make_dataset(tmp_path / "data"), f"output_dir={tmp_path / 'runs'}", "time_budget_minutes=0.001",
                         "tracking.experiment=budget", "tracking.registered_model=budget-policy")
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: str(tmp_path / "results")}):
        with prefect_test_harness(server_startup_timeout=90):
            state = grpo(config=config, return_state=True)
            with get_client(sync_client=True) as client:
                flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
                blocks = [run for run in client.read_task_runs(flow_run_filter=flow_run) if run.name.startswith("train-block")]
    assert state.is_failed(), state
    with pytest.raises(NoTrainingStep, match=r"load average [0-9.]+, .*`MEMALPHA_TRAIN_MINUTES=\d+ make train`"):
        state.result()
    assert [run.run_count for run in blocks] == [1]  # a retry cannot give the budget time back

    client = tracking.configure()
    (run,) = client.search_runs([client.get_experiment_by_name("budget").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags[tracking.TIME_BUDGET_TAG].startswith("no GRPO step fits the time budget: time_budget_minutes=0.001")
    assert tracking.logged_steps(run.info.run_id) == set()
    # the starting policy's held-out check, made before the budget ran out, is on the run all the same
    assert [m.step for m in client.get_metric_history(run.info.run_id, tracking.VALIDATION_KEY)] == [0]
    assert client.search_model_versions("name = 'budget-policy'") == []  # no model, so no champion
