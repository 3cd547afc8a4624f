"""The prep flow end to end on a small synthetic dataset: every step a task, an unchanged re-run served
from the cache, a deleted output rewritten, the dataset logged to MLflow as inputs plus the report."""

from __future__ import annotations

import shutil
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from memalpha.config import RunConfig
from memalpha.data.io import read_dataset
from tasks import tracking

pytestmark = pytest.mark.slow  # starts Prefect's ephemeral test server (~20 s)

SYNTH = {"instances": 6, "chunks_per_instance": [2], "chunk_tokens": 256, "facts_per_instance": 2, "seed": 3}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: str(tmp_path_factory.mktemp("results"))}):
        with prefect_test_harness(server_startup_timeout=90):
            yield


def _task_states(flow_run_id) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def test_prep_is_cached_logged_and_rewritten_when_deleted(harness, tmp_path, monkeypatch):
    from flows.prep import prep

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = RunConfig.model_validate({"model": {"policy": "tiny"}, "tracking": {"experiment": "prep-test"}})
    out = tmp_path / "data"

    first = prep(source="synthetic", out_dir=str(out), synth=SYNTH, config=config, return_state=True)
    result = first.result()
    instances = read_dataset(out)
    assert len(instances) == result["counts"].get("valid", len(instances)) and instances
    assert {i.split for i in instances} <= {"train", "validation", "test"}
    states = _task_states(first.state_details.flow_run_id)
    assert set(states) == {"load", "chunk", "validate", "split", "write", "log-dataset"}
    assert "Cached" not in states.values()

    started = time.perf_counter()
    second = prep(source="synthetic", out_dir=str(out), synth=SYNTH, config=config, return_state=True)
    again = second.result()
    assert set(_task_states(second.state_details.flow_run_id).values()) == {"Cached"}
    assert again["mlflow_run_id"] == result["mlflow_run_id"]  # the same logged dataset, not a second run
    assert time.perf_counter() - started < 15

    client = tracking.configure()
    run = client.get_run(result["mlflow_run_id"])
    contexts = {tag.value for inp in run.inputs.dataset_inputs for tag in inp.tags if tag.key == "mlflow.data.context"}
    assert contexts == {i.split for i in instances}
    assert all(inp.dataset.source_type and inp.dataset.digest for inp in run.inputs.dataset_inputs)
    assert {a.path for a in client.list_artifacts(run.info.run_id, "validation")} >= {
        "validation/validation_report.md", "validation/manifest.json"}

    shutil.rmtree(out)
    third = prep(source="synthetic", out_dir=str(out), synth=SYNTH, config=config)
    assert read_dataset(out) and third["out_dir"] == str(out)
