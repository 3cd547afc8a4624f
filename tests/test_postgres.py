"""The pipeline on PostgreSQL: the integration run (a tiny `grpo/train` deployment run with an injected
failure, a sweep with 2 children at once, the nightly evaluation of the champion) against a Prefect server
and an MLflow store that both live in a PostgreSQL cluster started by `infra/servers.sh start-postgres`
(what `make up DB=postgres` starts). Skipped, with the reason, where PostgreSQL cannot be installed."""

from __future__ import annotations

import os
import subprocess

import pytest
from test_pipeline_integration import (  # noqa: F401  (fixtures and tests re-run on this module's stack)
    REPO,
    dataset,
    free_port,
    serve_stack,
    trained,
)
from test_pipeline_integration import (  # noqa: F401  (collected here, on the PostgreSQL stack)
    test_nightly_evaluates_the_champion as test_postgres_nightly_evaluates_the_champion,
    test_sweep_runs_its_children_on_ray_under_one_parent as test_postgres_sweep_runs_its_children_at_once,
    test_train_deployment_resumes_after_injected_failure as test_postgres_train_deployment_resumes_after_injected_failure,
)

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("postgres-stack")
    for folder in (tmp, *tmp.parents[:2]):  # the cluster's owner (the `postgres` user under root) must reach it
        folder.chmod(folder.stat().st_mode | 0o011)
    pg_port = free_port()
    env = {**os.environ, "MEMALPHA_STATE": str(tmp / "state"), "MEMALPHA_PG_PORT": str(pg_port)}
    started = subprocess.run(["bash", str(REPO / "infra" / "servers.sh"), "start-postgres"], env=env,
                             capture_output=True, text=True, timeout=600)
    if started.returncode != 0:
        pytest.skip(f"PostgreSQL could not be installed or started here: {(started.stderr or started.stdout).strip()[-500:]}")
    passfile = tmp / "state" / "postgres" / "pgpass"
    previous = os.environ.get("PGPASSFILE")
    os.environ["PGPASSFILE"] = str(passfile)  # the tests' own MLflow clients read the store too
    try:
        yield from serve_stack(tmp, {
            "PGPASSFILE": str(passfile),
            "MLFLOW_TRACKING_URI": f"postgresql+psycopg2://memalpha@127.0.0.1:{pg_port}/mlflow",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://memalpha@127.0.0.1:{pg_port}/prefect",
        })
    finally:
        if previous is None:
            os.environ.pop("PGPASSFILE", None)
        else:
            os.environ["PGPASSFILE"] = previous
        subprocess.run(["bash", str(REPO / "infra" / "servers.sh"), "stop-postgres"], env=env, capture_output=True, timeout=120)


def test_postgres_holds_the_records(stack, trained):  # noqa: F811  (the imported fixture)
    """The stores really are PostgreSQL's: the MLflow runs and the Prefect flow runs are rows there."""
    env = {**os.environ, "PGPASSFILE": stack["env"]["PGPASSFILE"]}
    port = stack["env"]["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1].split("/")[0]

    def count(db: str, sql: str) -> int:
        out = subprocess.run(["psql", "-X", "-tA", "-h", "127.0.0.1", "-p", port, "-U", "memalpha", "-d", db, "-c", sql],
                             env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert count("mlflow", "SELECT count(*) FROM runs") >= 1
    assert count("prefect", f"SELECT count(*) FROM flow_run WHERE id = '{trained}'") == 1
