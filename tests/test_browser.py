"""The MLflow UI, in headless Chromium, shows a sweep's child runs side by side on its compare page."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tasks import tracking

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# flags for a closed network, as root (see the machine notes): no sandbox, no background traffic
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
GRID = [(0.0, 0.0), (0.05, 0.1), (0.2, 0.1)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout}s")


@pytest.fixture()
def sweep_store(tmp_path, monkeypatch):
    """A temp SQLite store holding a sweep: one parent run and a child per (beta, gamma)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = tracking.create_run("sweep-ui", "sweep-test", {"grpo.steps": 3}, {"memalpha.kind": "sweep"})
    children = {}
    for beta, gamma in GRID:
        name = f"test-beta{beta:g}-gamma{gamma:g}"
        run_id = tracking.create_run("sweep-ui", name, {"reward.beta": beta, "reward.gamma": gamma}, {}, parent_run_id=parent)
        for step in (1, 2, 3):
            tracking.log_step_metrics(run_id, step, {"reward/total": 1.0 + step * (beta - gamma)}, tracking.now_ms())
        tracking.configure().set_terminated(run_id)
        children[run_id] = name
    experiment_id = tracking.configure().get_experiment_by_name("sweep-ui").experiment_id
    return tmp_path, parent, children, experiment_id


@pytest.fixture()
def mlflow_ui(sweep_store):
    """`mlflow server` (one worker, 127.0.0.1, a free port) on the sweep's store."""
    tmp_path = sweep_store[0]
    port = free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        [str(REPO / ".venv/bin/mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root", str(tmp_path / "artifacts")],
        stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def dump_dom(url: str) -> str:
    """The page's DOM after its scripts ran (virtual time lets the SPA fetch and render)."""
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=30000",
                              "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (make browser)")
def test_compare_page_shows_every_run_of_the_sweep(sweep_store, mlflow_ui):
    _, parent, children, experiment_id = sweep_store
    # the children as the UI's users find them: runs whose parent is the sweep's run
    found = tracking.configure().search_runs([experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert {run.info.run_id for run in found} == set(children)
    query = urllib.parse.quote(json.dumps(sorted(children)), safe="")
    dom = dump_dom(f"{mlflow_ui}/#/compare-runs?runs={query}&experiments={urllib.parse.quote(json.dumps([experiment_id]))}")
    assert f"Comparing {len(children)} Runs from 1 Experiment" in dom
    for run_id, name in children.items():
        assert name in dom, f"run {name} missing from the compare page"
        assert run_id[:12] in dom
    for column in ("reward.beta", "reward.gamma", "reward/total"):
        assert column in dom
