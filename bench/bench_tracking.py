"""Tracking under concurrent load, SQLite against PostgreSQL, side by side: are records lost?

For each backend an MLflow server (`mlflow server --workers 1`, as `make up` starts it) and a Prefect server
run on fresh stores: SQLite files, or the PostgreSQL cluster `infra/servers.sh start-postgres` starts (what
`make up DB=postgres` uses).
- MLflow: `PROCESSES` processes log at once, each one run with 10 params, `BATCHES` metric batches (5
  metrics each), a table and an artifact; every call that returned (acknowledged) is recorded client-side.
  Counted back from the server's API: runs, metric points, tables and artifacts present. `errors` = calls
  that failed after the client's retries; `lost` = acknowledged records absent.
- Prefect: `PROCESSES` flow runs (3 tasks each) start at once; counted back: flow runs COMPLETED.
- Kill: the same MLflow load again, the server killed with SIGKILL mid-load and restarted on the same port;
  what was acknowledged before the kill must all be there (the loggers keep going through the client's
  retries, so the restart is also a resumption test).

    python -m bench.run_all tracking
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(sys.executable).parent
PROCESSES = 8
BATCHES = int(os.environ.get("MEMALPHA_BENCH_TRACKING_BATCHES", "200"))
METRICS_PER_BATCH = 5
BACKENDS = tuple(os.environ.get("MEMALPHA_BENCH_TRACKING_BACKENDS", "sqlite postgres").split())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: server exited: {log.read_text()[-2000:]}")
            time.sleep(0.5)
    raise RuntimeError(f"{url}: not up after {timeout} s: {log.read_text()[-2000:]}")


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)


class Backend:
    """Store URIs of one backend in `tmp` (PostgreSQL: a cluster started there)."""

    def __init__(self, name: str, tmp: Path):
        self.name, self.tmp, self.env = name, tmp, dict(os.environ)
        if name == "sqlite":
            self.mlflow_uri = f"sqlite:///{tmp}/mlflow.db"
            self.prefect_uri = f"sqlite+aiosqlite:///{tmp}/prefect.db"
            return
        port = _free_port()
        tmp.chmod(0o755)  # the cluster's owner (the `postgres` user under root) must reach its folder
        self.env.update({"MEMALPHA_STATE": str(tmp / "state"), "MEMALPHA_PG_PORT": str(port)})
        subprocess.run(["bash", str(ROOT / "infra" / "servers.sh"), "start-postgres"], env=self.env, check=True,
                       capture_output=True, text=True)
        self.env["PGPASSFILE"] = str(tmp / "state" / "postgres" / "pgpass")
        self.mlflow_uri = f"postgresql+psycopg2://memalpha@127.0.0.1:{port}/mlflow"
        self.prefect_uri = f"postgresql+asyncpg://memalpha@127.0.0.1:{port}/prefect"

    def close(self) -> None:
        if self.name == "postgres":
            subprocess.run(["bash", str(ROOT / "infra" / "servers.sh"), "stop-postgres"], env=self.env, capture_output=True)


def start_mlflow(backend: Backend, port: int) -> subprocess.Popen:
    env = {**backend.env, "MLFLOW_BACKEND_STORE_URI": backend.mlflow_uri, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    proc = _start([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                   "--default-artifact-root", str(backend.tmp / "artifacts")], env, backend.tmp / "mlflow.log")
    _wait(f"http://127.0.0.1:{port}/health", proc, backend.tmp / "mlflow.log")
    return proc


def logger_main(url: str, experiment: str, index: int, out: str) -> None:
    """One logging process: a run, params, BATCHES metric batches, a table and an artifact; what was
    acknowledged goes to `out` (JSON) as it happens, so a killed server cannot erase the client's record."""
    import mlflow
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    mlflow.set_tracking_uri(url)
    client = MlflowClient()
    record: dict[str, Any] = {"run_id": None, "batches": [], "errors": [], "table": False, "artifact": False}

    def save() -> None:
        Path(out).write_text(json.dumps(record))

    def attempt(what: str, call) -> bool:
        try:
            call()
            return True
        except Exception as exc:  # noqa: BLE001 - every failure is counted, the load goes on
            record["errors"].append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
            return False

    exp = None
    for _ in range(20):
        try:
            exp = client.get_experiment_by_name(experiment) or client.get_experiment(client.create_experiment(experiment))
            break
        except Exception:  # noqa: BLE001 - another process created it first
            time.sleep(0.2)
    run = client.create_run(exp.experiment_id, run_name=f"load-{index}")
    record["run_id"] = run.info.run_id
    save()
    attempt("params", lambda: client.log_batch(run.info.run_id, params=[Param(f"p{k}", str(k * index)) for k in range(10)]))
    for b in range(BATCHES):
        now = int(time.time() * 1000)
        metrics = [Metric(f"m{k}", float(b * k), now, b) for k in range(METRICS_PER_BATCH)]
        if attempt(f"batch {b}", lambda: client.log_batch(run.info.run_id, metrics=metrics)):
            record["batches"].append(b)
        save()
    import pandas as pd

    record["table"] = attempt("table", lambda: client.log_table(run.info.run_id, pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}), "table.json"))
    record["artifact"] = attempt("artifact", lambda: client.log_text(run.info.run_id, f"process {index}", "note.txt"))
    attempt("terminate", lambda: client.set_terminated(run.info.run_id))
    save()


def mlflow_load(url: str, tmp: Path, experiment: str, during=None) -> dict[str, Any]:
    """PROCESSES logging processes at once (with `during()` run while they log); their records counted back."""
    from mlflow.tracking import MlflowClient

    outs = [tmp / f"{experiment}-{i}.json" for i in range(PROCESSES)]
    started = time.perf_counter()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [subprocess.Popen([PY, "-c", f"from bench.bench_tracking import logger_main; logger_main({url!r}, {experiment!r}, {i}, {str(o)!r})"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{experiment}-{i}.log", "w"))
             for i, o in enumerate(outs)]
    if during is not None:
        during()
    for p in procs:
        p.wait(timeout=1800)
    seconds = time.perf_counter() - started
    records = [json.loads(o.read_text()) if o.is_file() else {"run_id": None, "batches": [], "errors": ["no record"]} for o in outs]
    client = MlflowClient(url)
    lost = {"runs": 0, "metric_points": 0, "tables": 0, "artifacts": 0}
    found_points = 0
    for r in records:
        if r["run_id"] is None:
            continue
        try:
            client.get_run(r["run_id"])
        except Exception:  # noqa: BLE001
            lost["runs"] += 1
            continue
        for k in range(METRICS_PER_BATCH):
            steps = {m.step for m in client.get_metric_history(r["run_id"], f"m{k}")}
            found_points += len(steps)
            lost["metric_points"] += len(set(r["batches"]) - steps)
        names = {a.path for a in client.list_artifacts(r["run_id"])}
        lost["tables"] += int(r.get("table", False) and "table.json" not in names)
        lost["artifacts"] += int(r.get("artifact", False) and "note.txt" not in names)
    errors = [e for r in records for e in r["errors"]]
    return {"seconds": round(seconds, 1), "runs": sum(r["run_id"] is not None for r in records),
            "acknowledged_metric_points": sum(len(r["batches"]) for r in records) * METRICS_PER_BATCH,
            "metric_points_found": found_points, "expected_metric_points": PROCESSES * BATCHES * METRICS_PER_BATCH,
            "errors": len(errors), "error_examples": errors[:3], "lost": lost, "lost_total": sum(lost.values())}


FLOW_SCRIPT = """
from prefect import flow, task

@task
def add(x):
    return x + 1

@flow(name="tracking-load")
def load(n: int):
    return sum(add(i) for i in range(3)) + n

load({n})
"""


def prefect_load(backend: Backend) -> dict[str, Any]:
    port = _free_port()
    env = {**backend.env, "PREFECT_HOME": str(backend.tmp / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_API_DATABASE_CONNECTION_URL": backend.prefect_uri, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false"}
    server = _start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env,
                    backend.tmp / "prefect.log")
    try:
        _wait(f"http://127.0.0.1:{port}/api/health", server, backend.tmp / "prefect.log")
        started = time.perf_counter()
        procs = [subprocess.Popen([PY, "-c", FLOW_SCRIPT.format(n=i)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(backend.tmp / f"flow-{i}.log", "w")) for i in range(PROCESSES)]
        codes = [p.wait(timeout=900) for p in procs]
        seconds = time.perf_counter() - started
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/flow_runs/filter", method="POST",
                                         data=json.dumps({"flows": {"name": {"any_": ["tracking-load"]}}}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            runs = json.loads(response.read())
        completed = sum(r["state"]["type"] == "COMPLETED" for r in runs)
        return {"seconds": round(seconds, 1), "flow_runs": PROCESSES, "errors": sum(c != 0 for c in codes),
                "completed": completed, "lost": PROCESSES - completed}
    finally:
        _stop(server)


def one_backend(name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        backend = Backend(name, tmp)
        try:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            server = start_mlflow(backend, port)
            out: dict[str, Any] = {}
            try:
                out["mlflow"] = mlflow_load(url, tmp, "load")
                print(f"{name}: mlflow load {out['mlflow']}", flush=True)
                holder = {"server": server}

                def kill_and_restart() -> None:
                    time.sleep(8)
                    _stop(holder["server"], signal.SIGKILL)
                    time.sleep(2)
                    holder["server"] = start_mlflow(backend, port)

                out["mlflow_kill"] = mlflow_load(url, tmp, "kill", during=kill_and_restart)
                print(f"{name}: mlflow kill -9 and restart {out['mlflow_kill']}", flush=True)
                server = holder["server"]
            finally:
                _stop(server)
            out["prefect"] = prefect_load(backend)
            print(f"{name}: prefect {out['prefect']}", flush=True)
            return out
        finally:
            backend.close()


def run() -> dict[str, Any]:
    results = {"processes": PROCESSES, "batches_per_run": BATCHES, "metrics_per_batch": METRICS_PER_BATCH,
               "backends": {name: one_backend(name) for name in BACKENDS}}
    pg = results["backends"].get("postgres")
    if pg:
        results["targets"] = {"postgres: 0 errors under the 8-process load": pg["mlflow"]["errors"] == 0 and pg["prefect"]["errors"] == 0,
                              "postgres: 0 lost records": pg["mlflow"]["lost_total"] == 0 and pg["prefect"]["lost"] == 0,
                              "postgres: everything acknowledged before kill -9 is there": pg["mlflow_kill"]["lost_total"] == 0}
    return results


def to_markdown(r: dict[str, Any]) -> str:
    lines = ["# Benchmark: tracking under concurrent load (SQLite vs PostgreSQL)", "",
             f"{r['processes']} processes log to one MLflow server at once (`--workers 1`, as `make up` starts it), each "
             f"one run: 10 params, {r['batches_per_run']} batches of {r['metrics_per_batch']} metrics, a table, an artifact; "
             f"{r['processes']} Prefect flow runs (3 tasks each) start at once. `errors`: calls that failed after the "
             "MLflow client's retries; `lost`: acknowledged records the server's API does not return. Kill: the same "
             "MLflow load with the server killed (SIGKILL) after 8 s and restarted on the same port.", "",
             "| backend | MLflow s | metric points found / expected | errors | lost | kill -9: errors | kill -9: lost | Prefect s | flow runs completed | Prefect errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, b in r["backends"].items():
        m, k, p = b["mlflow"], b["mlflow_kill"], b["prefect"]
        lines.append(f"| {name} | {m['seconds']} | {m['metric_points_found']} / {m['expected_metric_points']} | {m['errors']} | "
                     f"{m['lost_total']} | {k['errors']} | {k['lost_total']} | {p['seconds']} | {p['completed']}/{p['flow_runs']} | {p['errors']} |")
    for name, b in r["backends"].items():
        examples = b["mlflow"]["error_examples"] + b["mlflow_kill"]["error_examples"]
        if examples:
            lines += ["", f"Errors seen on {name}, for example:", ""] + [f"- `{e}`" for e in examples[:4]]
    if "targets" in r:
        lines += ["", "## Targets", "", "| target | met |", "|---|---|"]
        lines += [f"| {n} | {'met' if v else 'missed'} |" for n, v in r["targets"].items()]
    return "\n".join(lines) + "\n"
