"""MLflow tracking helpers and the block publishing protocol, against a real SQLite MLflow store in tmp."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlflow
import polars as pl
import pytest

from memalpha.config import RunConfig
from tasks import tracking
from tasks.plots import log_training_plots
from tasks.summary import summarize
from tasks.train import (
    InjectedFailure,
    _bounded_samples,
    _maybe_fail,
    _stage_step,
    block_bounds,
    publish_block,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A SQLite tracking store in tmp (created once: migrations take seconds), selected the way users
    select a remote one."""
    root = tmp_path_factory.mktemp("mlruns")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        yield root


def _samples(step: int) -> pl.DataFrame:
    rows = []
    for instance in ("i0", "i1"):
        for rollout in range(3):
            for chunk in range(2):
                rows.append({"instance": instance, "rollout": rollout, "chunk": chunk,
                             "prompt": f"prompt {instance}/{rollout}/{chunk}", "completion": "NOTHING_TO_STORE",
                             "parsed_calls": "[]", "results": "[]", "r1": 0.5, "r2": 1.0, "r3": 0.9, "r4": 0.0,
                             "reward": 1.5 + step, "advantage": rollout - 1.0})
    return pl.DataFrame(rows)


def _result(step: int, with_eval: bool = False) -> SimpleNamespace:
    metrics = {"reward": 1.0 + step / 10, "rewards/r1/mean": 0.5, "memory/tokens": 10.0 * step, "tool_calls/success_rate": 0.5,
               "bad": float("nan"), **({"eval/qa_score": 0.1 * step, "best/step": float(step), "best/qa_score": 0.1 * step} if with_eval else {})}
    trace = {"name": "rollout", "inputs": {"instance": "i0"}, "children": [
        {"name": "chunk-0", "children": [{"name": "generation", "span_type": "LLM", "outputs": {"text": "x"}},
                                         {"name": "memory_insert", "span_type": "TOOL", "outputs": {"ok": True}}]}]}
    return SimpleNamespace(step=step, metrics=metrics, samples=_samples(step), memories=[{"core": f"m{step}"}] * 6,
                           trace=trace)


def test_tracking_uri_defaults_to_repo_sqlite_by_absolute_path(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = tracking.tracking_uri()
    assert uri == f"sqlite:///{tracking.REPO_ROOT}/mlruns/mlflow.db"
    assert uri.startswith("sqlite:////")  # four slashes: absolute path
    assert tracking.artifact_root() == tracking.REPO_ROOT / "mlruns" / "artifacts"


def test_server_uri_leaves_artifacts_to_the_server(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking.artifact_root() is None
    assert tracking.ui_url() == "http://127.0.0.1:5999"


def test_block_bounds_end_at_checkpoints_evaluations_and_the_last_step():
    assert block_bounds(10, 5, 10) == [(1, 5), (6, 10)]
    assert block_bounds(7, 3, 2) == [(1, 2), (3, 3), (4, 4), (5, 6), (7, 7)]
    assert block_bounds(0, 5, 10) == []
    covered = [s for first, last in block_bounds(23, 4, 6) for s in range(first, last + 1)]
    assert covered == list(range(1, 24))


def test_bounded_samples_keep_text_for_the_first_rollouts_only():
    samples = _samples(1)
    bounded = _bounded_samples(samples, 2)
    assert bounded.height == samples.height  # totals: every row stays
    full = bounded.filter(pl.col("prompt").is_not_null()).select("instance", "rollout").unique()
    assert sorted(full.rows()) == [("i0", 0), ("i0", 1)]
    assert bounded["reward"].to_list() == samples["reward"].to_list()
    assert _bounded_samples(samples, 0)["prompt"].null_count() == samples.height


def test_params_are_the_flat_config(store):
    config = RunConfig()
    run_id = tracking.create_run("exp", "run", config.flat(), {"prefect.flow_run_id": "abc"})
    run = tracking.configure().get_run(run_id)
    assert run.data.params["reward.beta"] == str(config.reward.beta)
    assert run.data.params["model.lora_target_modules"] == json.dumps(config.model.lora_target_modules)
    assert len(run.data.params) == len(config.flat())
    experiment = tracking.configure().get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == (store / "artifacts" / "exp").as_uri()
    assert tracking.find_run("exp", "prefect.flow_run_id", "abc") == run_id


def test_publish_logs_each_step_once_even_when_repeated(store, tmp_path):
    config = RunConfig.model_validate({"tracking": {"rollouts_logged_per_step": 1}})
    run_dir = tmp_path / "run"
    run_id = tracking.create_run("exp", "run", {}, {})
    checkpoint = run_dir / "checkpoints" / "step-000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text("{}")
    for step in (1, 2):
        result = _result(step, with_eval=step == 2)
        if step == 1:  # the warm start's held-out check, made before step 1
            result.metrics.update({"warm_start/eval/qa_score": 0.05, "warm_start/best/step": 0.0})
        _stage_step(run_dir, result, seconds=0.5)
    assert publish_block(config, run_dir, run_id, 1, 2, checkpoint) == 2
    # a retry after the checkpoint (or a re-run of the block) publishes nothing again
    assert publish_block(config, run_dir, run_id, 1, 2, checkpoint) == 0

    client = tracking.configure()
    for key in ("reward", "memory/tokens", tracking.STEP_SENTINEL):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [1, 2]
    # the held-out curves start at step 0 with the warm start's check, logged once
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/qa_score")] == [(0, 0.05), (2, 0.2)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "best/step")] == [(0, 0.0), (2, 2.0)]
    assert [m.step for m in client.get_metric_history(run_id, "warm_start/eval/qa_score")] == [1]
    assert client.get_metric_history(run_id, "bad") == []  # NaN is not logged
    names = {a.path for a in client.list_artifacts(run_id, "rollouts")}
    assert names == {"rollouts/rollouts-step-000001.parquet", "rollouts/rollouts-step-000002.parquet"}
    table = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path="reward_breakdown/step-000001.json", dst_path=str(tmp_path / "dl"))).read_text())
    assert len(table["data"]) == 12 and "prompt" not in table["columns"] and "advantage" in table["columns"]
    memories = json.loads(Path(mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path="memories/step-000002.json", dst_path=str(tmp_path / "dl"))).read_text())
    assert memories == [{"core": "m2"}]
    assert {a.path for a in client.list_artifacts(run_id, "checkpoints/step-000002")} == {"checkpoints/step-000002/state.json"}
    traces = mlflow.search_traces(run_id=run_id, locations=[client.get_run(run_id).info.experiment_id], return_type="list")
    assert len(traces) == 2
    assert [s.name for s in traces[0].data.spans] == ["rollout", "chunk-0", "generation", "memory_insert"]
    tags = client.get_run(run_id).data.tags
    assert tags["memalpha.best_step"] == "2" and tags["memalpha.last_checkpoint"] == str(checkpoint)
    assert tags["memalpha.best_checkpoint"] == f"{run_dir / 'best' / 'adapter'} (eval/qa_score=0.2000 at step 2)"
    assert client.get_run(run_id).info.status == "RUNNING"  # tracing did not end the run


def test_plots_and_summary(store):
    run_id = tracking.create_run("exp", "run", {}, {})
    for step in (1, 2, 3):
        held_out = {"warm_start/eval/qa_score": 0.125} if step == 1 else {"eval/qa_score": 0.25} if step == 3 else {}
        tracking.log_step_metrics(run_id, step, {"reward": 0.1 * step, "rewards/r2/mean": 1.0, "memory/tokens": 5.0 * step,
                                                 "tool_calls/success_rate": 0.1, tracking.STEP_SENTINEL: 1.0, **held_out},
                                  tracking.now_ms())
    assert log_training_plots(run_id) == ["plots/reward.png", "plots/memory.png", "plots/tool_calls.png",
                                                   "plots/validation.png"]
    summary = summarize(run_id)
    assert "3 logged (1..3)" in summary
    assert "reward: start 0.1000 (step 1) -> end 0.3000 (step 3)" in summary
    assert "held-out QA: warm start 0.1250 -> step 3 0.2500" in summary
    assert "selected:" not in summary  # no best step logged yet
    tracking.log_step_metrics(run_id, 3, {"best/step": 0.0, "best/qa_score": 0.125}, tracking.now_ms())
    assert "selected:    the warm start (no GRPO step scored higher), validation QA 0.1250" in summarize(run_id)
    assert "time budget" not in summary
    tracking.set_tags(run_id, {tracking.TIME_BUDGET_TAG: "11 min spent: stopped after step 3 of 5"})
    assert "time budget: 11 min spent: stopped after step 3 of 5" in summarize(run_id)


def test_failure_injection_fires_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMALPHA_FAIL_AT_STEP", "3")
    _maybe_fail(tmp_path, 2)
    with pytest.raises(InjectedFailure):
        _maybe_fail(tmp_path, 3)
    _maybe_fail(tmp_path, 3)  # the retry passes


def test_prefect_yaml_is_generated_from_the_deployment_table():
    from flows.deployments import DEPLOYMENTS, PREFECT_YAML, render_prefect_yaml

    assert PREFECT_YAML.read_text() == render_prefect_yaml(), "run `python -m flows.deployments yaml`"
    assert {spec.full_name for spec in DEPLOYMENTS} == {"grpo/train", "evaluate/nightly", "prep/prep", "sweep/sweep",
                                                             "writer/register"}
