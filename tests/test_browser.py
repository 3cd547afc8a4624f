"""The MLflow UI, in headless Chromium, shows a sweep's child runs side by side: on its compare page, and in the
chart view `make sweep` links to, one series per child in every chart."""

from __future__ import annotations

import contextlib
import json
import os
import re
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

from flows.sweep import COMPARED
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


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """`mlflow server` (one worker, 127.0.0.1, a free port) on the SQLite store `folder`/mlflow.db; yields its URL."""
    port = free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(
        [str(REPO / ".venv/bin/mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root", str(folder / "artifacts")],
        stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture()
def mlflow_ui(sweep_store):
    with mlflow_server(sweep_store[0]) as url:
        yield url


def chromium(url: str, output: str, budget_ms: int = 30000) -> str:
    """Headless Chromium on `url` with `output` (`--dump-dom` or `--screenshot=PATH`) once the page's scripts ran
    for `budget_ms` of virtual time (the SPA fetches and renders meanwhile); returns stdout."""
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1600,1400",
                              f"--virtual-time-budget={budget_ms}", output, url], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def dump_dom(url: str, budget_ms: int = 30000) -> str:
    """The page's DOM after its scripts ran."""
    return chromium(url, "--dump-dom", budget_ms)


def screenshot(url: str, path: str | Path, budget_ms: int = 90000) -> Path:
    """A PNG of the page (1600 x 1400) once its charts rendered; for the README, with the MLflow UI up:
    `.venv/bin/python -c 'import sys; sys.path.insert(0, "tests"); import test_browser as b; b.screenshot(*sys.argv[1:])' URL OUT.png`."""
    chromium(url, f"--screenshot={Path(path).resolve()}", budget_ms)
    return Path(path)


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


@pytest.mark.slow  # the tiny sweep (tests/conftest.py), then Chromium drawing its charts (~1 min)
@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (make browser)")
def test_the_chart_view_make_sweep_prints_has_one_series_per_child(tiny_sweep, tmp_path):
    url = next(line.split(maxsplit=1)[1] for line in tiny_sweep["printed"].splitlines() if line.startswith("compare:"))
    children = tiny_sweep["result"]["children"]
    with mlflow_server(tiny_sweep["folder"]) as ui:
        local = urllib.parse.urlsplit(url)._replace(netloc=urllib.parse.urlsplit(ui).netloc).geturl()  # on this test's server
        dom = dump_dom(local, budget_ms=60000)
        assert screenshot(local, tmp_path / "sweep.png", budget_ms=60000).stat().st_size > 50_000
    assert "Model training" in dom and "Group: reward.beta: 1.0, reward.gamma: 1.0" in dom
    assert "Reward weightings" in dom  # the section of COMPARED, first
    charts = dom.split("js-plotly-plot")[1:]
    assert len(charts) >= len(COMPARED), "the chart view drew too few charts"
    for chart in charts:
        # each series a line in its run's colour (a faint copy behind it is the unsmoothed curve)
        series = set(re.findall(r'class="js-line"[^>]*stroke: (rgb\([^)]*\)); stroke-opacity: 1;', chart))
        assert len(series) == len(children)
    assert len(set(re.findall(r"tiny-beta[0-9.]+-gamma[0-9.]+", dom))) == len(children)
