"""End to end on real servers: a Prefect server (SQLite, temp PREFECT_HOME, free port), a real MLflow
SQLite store in tmp, and `python -m flows.deployments serve` in a subprocess.

- `grpo/train` is triggered with the CLI on the tiny config while a failure is injected after step 3;
  the block task's retry must resume from the step-2 checkpoint and MLflow must hold every step once.
- the `evaluate/nightly` deployment's cron schedule must create scheduled runs on the server.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from memalpha.config import load_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python")
PREFECT = str(REPO / ".venv" / "bin" / "prefect")
FAIL_AT = 3
STEPS = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited ({proc.returncode}): {log.read_text()[-3000:] if log else ''}")
        try:
            value = check()
            if value:
                return value
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{what} not ready after {timeout}s: {log.read_text()[-3000:] if log else ''}")


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def serve_stack(tmp: Path, extra_env: dict[str, str] | None = None):
    """Prefect server + runner serving every deployment, against a temp MLflow store (`extra_env` may point
    both at other databases). Yields env and paths."""
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlruns' / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MEMALPHA_FAIL_AT_STEP": str(FAIL_AT),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(extra_env or {}),
    }
    (tmp / "mlruns").mkdir(exist_ok=True)
    server = start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, tmp / "server.log")
    procs = [server]
    try:
        wait_until(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2).status == 200,
                   180, "prefect server", server, tmp / "server.log")
        since = time.time()
        runner = start([PY, "-m", "flows.deployments", "serve"], env, tmp / "runner.log")
        procs.append(runner)
        ready = subprocess.run([PY, "-m", "flows.deployments", "ready", "--since", str(since), "--wait", "180"],
                               cwd=REPO, env=env, capture_output=True, text=True)
        assert ready.returncode == 0, (tmp / "runner.log").read_text()[-3000:]
        yield {"env": env, "tmp": tmp, "runner_log": tmp / "runner.log"}
    finally:
        for proc in reversed(procs):
            stop(proc)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The stack on SQLite (Prefect's default database, MLflow's SQLite store)."""
    yield from serve_stack(tmp_path_factory.mktemp("stack"))


def prefect_json(stack, path: str, body: dict) -> list | dict:
    """POST to the Prefect REST API of the test server."""
    request = urllib.request.Request(stack["env"]["PREFECT_API_URL"] + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_nightly_schedule_creates_scheduled_runs(stack):
    deployment = json.loads(urllib.request.urlopen(
        stack["env"]["PREFECT_API_URL"] + "/deployments/name/evaluate/nightly", timeout=30).read())
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 2 * * *"]

    def scheduled():
        runs = prefect_json(stack, "/flow_runs/filter", {
            "deployments": {"id": {"any_": [deployment["id"]]}},
            "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}})
        return runs if len(runs) >= 3 else None

    runs = wait_until(scheduled, 90, "scheduled nightly runs")
    times = sorted(run["expected_start_time"] for run in runs)
    assert all(re.search(r"T02:00:00", t) for t in times), times
    assert len(set(t[:10] for t in times)) == len(times)  # one a day


def tiny_config(tmp: Path) -> dict:
    config = load_config(REPO / "configs" / "tiny.yaml", [
        f"output_dir={tmp / 'runs'}", f"data.train_path={tmp / 'data'}", f"grpo.steps={STEPS}",
        "grpo.checkpoint_every=2", "grpo.eval_every=2",
        "tracking.experiment=integration", "tracking.registered_model=integration-policy",
        # a budget that never binds: the warm start's 2 SFT steps and every GRPO step must run
        "sft.batch_size=2", "sft.micro_batch_size=2", "time_budget_minutes=60",
    ])
    return config.model_dump(mode="json")


def run_deployment(stack, name: str, params: dict, timeout: int = 600) -> str:
    """`prefect deployment run NAME --watch` as a user would; returns the flow run id once it completed."""
    args = [PREFECT, "deployment", "run", name, "--watch", "--watch-interval", "3", "--watch-timeout", str(timeout)]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    out = subprocess.run(args, cwd=REPO, env=stack["env"], capture_output=True, text=True, timeout=timeout + 60)
    match = re.search(r"UUID: *([0-9a-f-]{36})", out.stdout)
    assert match and out.returncode == 0, out.stdout[-2000:] + stack["runner_log"].read_text()[-4000:]
    return match.group(1)


@pytest.fixture(scope="module")
def dataset(stack):
    """A small synthetic dataset written by the `prep/prep` deployment."""
    tmp = stack["tmp"]
    config = tiny_config(tmp)
    synth = {"instances": 16, "chunks_per_instance": [2], "chunk_tokens": 256, "facts_per_instance": 2,
             "competencies": config["data"]["competencies"], "seed": 1}
    run_deployment(stack, "prep/prep", {"source": "synthetic", "out_dir": str(tmp / "data"), "synth": synth,
                                        "config": config})
    from memalpha.data.io import read_dataset

    splits = [instance.split for instance in read_dataset(tmp / "data")]
    assert splits.count("validation") >= 1 and splits.count("train") >= 4, splits
    return tmp / "data"


@pytest.fixture(scope="module")
def trained(stack, dataset) -> str:
    """Flow run id of a `grpo/train` run on the tiny config (a failure is injected after step 3)."""
    started = time.time()
    flow_run_id = run_deployment(stack, "grpo/train", {"config": tiny_config(stack["tmp"])})
    print(f"grpo/train took {time.time() - started:.0f} s")
    return flow_run_id


def test_train_deployment_resumes_after_injected_failure(stack, trained):
    import mlflow
    from mlflow.tracking import MlflowClient

    env, flow_run_id = stack["env"], trained

    # Prefect: the block holding step 3 failed once, and both attempts resumed from the step-2 checkpoint
    messages: list[str] = []
    while True:  # the API pages logs by 200
        page = prefect_json(stack, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                   "sort": "TIMESTAMP_ASC", "limit": 200, "offset": len(messages)})
        messages += [entry["message"] for entry in page]
        if len(page) < 200:
            break
    assert sum(f"injected failure after training step {FAIL_AT}" in m for m in messages) >= 1, messages
    assert sum("block 3-4: resumed from checkpoint at step 2" in m for m in messages) == 2, messages
    # progress lines, one per step with rate and ETA, in the flow run's logs (the warm start's too)
    for step in range(1, STEPS + 1):
        assert any(re.match(rf"grpo step {step}/{STEPS} \| reward -?[0-9.]+ \(r1 .*\| [0-9.]+ s/step \| ETA ", m)
                   for m in messages), (step, messages)
    for step in (1, 2):
        assert any(re.match(rf"warm start step {step}/2 \| loss [0-9.]+ \| ", m) for m in messages), messages
    assert any(m.startswith("warm start epoch 1 held-out extraction: valid_calls") for m in messages), messages
    task_runs = prefect_json(stack, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    blocks = {run["name"]: run for run in task_runs if run["name"].startswith("train-block")}
    assert sorted(run["run_count"] for run in blocks.values()) == [1, 2]
    assert all(run["state"]["type"] == "COMPLETED" for run in blocks.values())

    # MLflow: one run tagged with the flow run, every metric at every step exactly once
    client = MlflowClient(env["MLFLOW_TRACKING_URI"], registry_uri=env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("integration")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.deployment"] == "train"
    description = run.data.tags["mlflow.note.content"]
    assert description.startswith("Config `") and "Data: `" in description and "Result: held-out QA" in description
    assert run.data.params["grpo.steps"] == str(STEPS) and "reward.beta" in run.data.params
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/seconds")] == [0]  # the warm start ran
    per_step = [k for k in run.data.metrics if not k.startswith(("eval/", "best/", "sft/", "sft_eval/", "warm_start/"))]
    assert "pipeline/step_seconds" in per_step and len(per_step) > 3
    for key in per_step:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == list(range(1, STEPS + 1)), (key, steps)
    eval_keys = [k for k in run.data.metrics if k.startswith(("eval/", "best/"))]
    assert {"eval/qa_score", "best/step", "best/qa_score"} <= set(eval_keys)
    for key in eval_keys:  # step 0: the warm start's held-out check
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 2, 4], key
    # the warm start's held-out extraction per SFT epoch, and its held-out QA before the first update
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sft_eval/evidence_recall")] == [1]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "warm_start/eval/qa_score")] == [1]

    def listed(path):
        return {a.path for a in client.list_artifacts(run.info.run_id, path)}

    assert listed("rollouts") == {f"rollouts/rollouts-step-{s:06d}.parquet" for s in range(1, STEPS + 1)}
    assert listed("reward_breakdown") == {f"reward_breakdown/step-{s:06d}.json" for s in range(1, STEPS + 1)}
    assert {"checkpoints/step-000002", "checkpoints/step-000004"} <= listed("checkpoints")
    assert "plots/reward.png" in listed("plots")
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    traces = mlflow.search_traces(run_id=run.info.run_id, locations=[experiment.experiment_id], return_type="list")
    assert sorted(int(t.info.tags["memalpha.step"]) for t in traces) == list(range(1, STEPS + 1))

    # the adapter selected on validation QA is registered (so it is `models:/integration-policy/latest`)
    # and, the first time, champion
    (version,) = client.search_model_versions("name = 'integration-policy'")
    champion = client.get_model_version_by_alias("integration-policy", "champion")
    assert version.run_id == run.info.run_id and champion.version == version.version
    assert float(champion.tags["validation_score"]) == run.data.metrics["best/qa_score"]
    assert champion.tags["step"] == str(int(run.data.metrics["best/step"]))
    assert champion.tags["adapter"].endswith("best/adapter")


def test_sweep_runs_its_children_on_ray_under_one_parent(stack, dataset):
    from mlflow.tracking import MlflowClient

    config = tiny_config(stack["tmp"])
    config["name"] = "sweep"
    config["grpo"].update({"steps": 1, "checkpoint_every": 1, "eval_every": 1})
    config["sft"]["enabled"] = False
    config["tracking"]["experiment"] = "integration-sweep"
    # the two children at once on a local Ray with 2 workers
    flow_run_id = run_deployment(stack, "sweep/sweep", {"config": config, "betas": [0.0, 0.2], "gammas": [0.1],
                                                        "ray_workers": 2})

    client = MlflowClient(stack["env"]["MLFLOW_TRACKING_URI"], registry_uri=stack["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("integration-sweep")
    (parent,) = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    grid = sorted((float(c.data.params["reward.beta"]), float(c.data.params["reward.gamma"])) for c in children)
    assert grid == [(0.0, 0.1), (0.2, 0.1)]
    assert all(c.info.status == "FINISHED" and "reward" in c.data.metrics for c in children)
    assert parent.data.tags["memalpha.children"].count(",") == 1 and parent.info.status == "FINISHED"
    started, ended = zip(*sorted((c.info.start_time, c.info.end_time) for c in children))
    assert started[1] < ended[0]  # concurrent: the second child started before the first ended
    for child in children:  # sweep runs are compared, not registered
        assert not client.search_model_versions(f"run_id = '{child.info.run_id}'")


def test_nightly_evaluates_the_champion(stack, trained):
    from mlflow.tracking import MlflowClient

    config = tiny_config(stack["tmp"])
    config["eval"].update({"data_path": config["data"]["train_path"], "split": "validation",
                           "methods": ["policy", "no_memory"], "max_instances": 2})
    flow_run_id = run_deployment(stack, "evaluate/nightly", {"config": config})

    client = MlflowClient(stack["env"]["MLFLOW_TRACKING_URI"], registry_uri=stack["env"]["MLFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("integration-policy", "champion")
    experiment = client.get_experiment_by_name("integration-nightly")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert run.data.tags["memalpha.model"] == f"integration-policy v{champion.version}"
    assert run.data.tags["prefect.deployment"] == "nightly" and run.data.tags["memalpha.regressed"] == "False"
    assert {"policy/score", "no_memory/score"} <= set(run.data.metrics)
    assert {"report/results.md", "report/regression.md"} <= {a.path for a in client.list_artifacts(run.info.run_id, "report")}


def test_the_shipped_writer_is_registered_through_the_training_registration_path(stack):
    from mlflow.tracking import MlflowClient

    from memalpha.teacher import record

    kept = record.read_record(record.WRITER)
    config = load_config(None, [f"output_dir={stack['tmp'] / 'writer-runs'}", "tracking.experiment=integration-writer",
                                "tracking.registered_model=integration-writer"]).model_dump(mode="json")
    flow_run_id = run_deployment(stack, "writer/register", {"config": config})

    client = MlflowClient(stack["env"]["MLFLOW_TRACKING_URI"], registry_uri=stack["env"]["MLFLOW_TRACKING_URI"])
    champion = client.get_model_version_by_alias("integration-writer", "champion")  # the first version is the champion
    assert champion.tags["step"] == str(kept["step"]) and float(champion.tags["validation_score"]) == kept["validation_qa"]
    run = client.get_run(champion.run_id)
    assert run.data.tags["prefect.flow_run_id"] == flow_run_id and run.info.status == "FINISHED"
    assert run.data.tags["memalpha.shipped_adapter"] == "adapters/writer"
    assert run.data.metrics["test/evidence/qa"] == kept["test"]["evidence"]["qa"]
    logged = client.download_artifacts(run.info.run_id, "shipped/record.json", str(stack["tmp"]))
    assert json.loads(Path(logged).read_text()) == kept


def test_train_deployment_runs_its_blocks_on_two_processes(stack, dataset):
    from mlflow.tracking import MlflowClient

    config = tiny_config(stack["tmp"])
    config["name"] = "two-processes"
    config["grpo"].update({"steps": 2, "checkpoint_every": 1, "eval_every": 2})
    config["sft"]["enabled"] = False
    config["tracking"]["experiment"] = "integration-processes"
    flow_run_id = run_deployment(stack, "grpo/train", {"config": config, "processes": 2, "register_adapter": False})

    client = MlflowClient(stack["env"]["MLFLOW_TRACKING_URI"], registry_uri=stack["env"]["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("integration-processes")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward")] == [1, 2]  # each step once, from rank 0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/qa_score")] == [0, 2]  # 0: before step 1
    run_dir = Path(run.data.tags["memalpha.run_dir"])
    state = json.loads((run_dir / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["processes"] == 2 and (run_dir / "checkpoints" / "step-000002" / "rng-rank-1.pt").is_file()
    assert "(2 processes)" in stack["runner_log"].read_text()  # the ranks' progress lines reach the flow-run logs
