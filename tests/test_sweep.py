"""`make sweep`'s flow on the tiny config (the `tiny_sweep` fixture, tests/conftest.py): one MLflow child run per
reward weighting under one parent, each with the curves a comparison needs at every step, the curves differing
where the weights differ, and the link `make sweep` prints to the UI's chart view of the children."""

from __future__ import annotations

import json

import pytest

from flows.sweep import COMPARED, POINTS, SWEEP_CONFIG_FILE, WEIGHTS
from memalpha.config import RunConfig, load_config
from memalpha.teacher.record import warm_start_hash
from tasks import tracking

def test_the_sweep_config_sizes_the_run_and_trains_from_the_shipped_warm_start():
    """configs/sweep.yaml changes the run's size and one thing a step computes, the sampling (beta acts only
    in trajectory sampling); the recipe's warm start is the shipped one."""
    defaults, sized = RunConfig().flat(), load_config(SWEEP_CONFIG_FILE)
    changed = {key for key, value in sized.flat().items() if defaults[key] != value}
    assert changed == {"name", "output_dir", "time_budget_minutes", "grpo.steps", "grpo.eval_every", "grpo.checkpoint_every",
                       "eval.max_instances", "grpo.sampling"}
    assert sized.grpo.sampling == "trajectory" and warm_start_hash(sized) == warm_start_hash(RunConfig())
    assert len(POINTS) == 3 and len({beta for beta, _ in POINTS}) == len({gamma for _, gamma in POINTS}) == 2  # both vary


@pytest.mark.slow  # Prefect's test server and a sweep of 2 children (~1-2 min on 2 busy cores)
def test_each_weighting_is_a_child_run_whose_curves_differ_where_its_weights_do(tiny_sweep, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tiny_sweep["store"])
    client, result = tracking.configure(), tiny_sweep["result"]
    parent = client.get_run(result["parent_run_id"])
    found = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    children = {tuple(float(run.data.params[key]) for key in WEIGHTS): run.info.run_id for run in found}
    assert set(children) == set(tiny_sweep["grid"]) and sorted(children.values()) == sorted(result["children"])
    assert parent.info.status == "FINISHED" and all(run.info.status == "FINISHED" for run in found)

    def series(run_id: str, key: str) -> list[tuple[int, float]]:
        return tracking.metric_series(run_id, key)

    for run_id in children.values():
        # every curve the comparison opens on, at every step; held-out ones from the starting policy (step 0) on
        for key in COMPARED:
            assert [step for step, _ in series(run_id, key)] == ([0, 1, 2] if key.startswith("eval/") else [1, 2]), key
        # the reward breakdown, rollouts and plots on every run
        artifacts = {a.path for folder in ("reward_breakdown", "rollouts", "plots") for a in client.list_artifacts(run_id, folder)}
        assert {"reward_breakdown/step-000002.json", "rollouts/rollouts-step-000002.parquet", "plots/reward.png",
                "plots/validation.png"} <= artifacts
        assert not client.list_artifacts(run_id, "writer")  # compared, not served: no model logged

    low, high = children[(0.0, 0.0)], children[(1.0, 1.0)]
    # the same scripted writes, scored under other weights: the raw terms agree, the weighted ones and the reward not
    assert series(low, "rewards/r3/mean") == series(high, "rewards/r3/mean")
    assert all(value > 0 for _, value in series(high, "rewards/r3/mean") + series(high, "rewards/r4_gated/mean"))
    assert [v for _, v in series(low, "rewards/beta_r3/mean") + series(low, "rewards/gamma_r4_gated/mean")] == [0.0] * 4
    assert series(high, "rewards/beta_r3/mean") == series(high, "rewards/r3/mean")
    assert all(h > l for (_, l), (_, h) in zip(series(low, "reward"), series(high, "reward")))
    assert all(h > l for (_, l), (_, h) in zip(series(low, "eval/reward"), series(high, "eval/reward")))


@pytest.mark.slow
def test_make_sweep_prints_the_chart_view_of_the_children_and_each_childs_result(tiny_sweep, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tiny_sweep["store"])
    parent_id, printed = tiny_sweep["result"]["parent_run_id"], tiny_sweep["printed"]
    parent = tracking.configure().get_run(parent_id)
    url = next(line.split(maxsplit=1)[1] for line in printed.splitlines() if line.startswith("compare:"))
    assert url == tiny_sweep["result"]["compare_url"] == parent.data.tags[tracking.COMPARE_TAG]
    assert url.endswith(f"/#/experiments/{parent.info.experiment_id}/runs?viewStateShareKey={parent_id}"
                        "&compareRunsMode=CHART&workflowType=machine_learning")
    assert f"({url})" in parent.data.tags[tracking.DESCRIPTION_TAG]  # linked from the parent's page
    experiment = tracking.configure().get_experiment(parent.info.experiment_id)
    view = json.loads(experiment.tags[tracking.SHARED_VIEW_TAG + parent_id])
    assert view["searchFilter"] == f"tags.mlflow.parentRunId = '{parent_id}'"
    assert [key["groupByData"] for key in view["groupBy"]["groupByKeys"]] == list(WEIGHTS)
    assert [chart["metricKey"] for chart in view["compareRunCharts"]] == COMPARED
    rows = [line.split() for line in printed.splitlines() if line.split()[:1] in (["0.0"], ["1.0"])]
    assert sorted((float(row[0]), float(row[1]), row[2]) for row in rows) == [(0.0, 0.0, "2"), (1.0, 1.0, "2")]
    assert all("(step 0) ->" in " ".join(row) and "(step 2)" in " ".join(row) for row in rows)
