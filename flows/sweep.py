"""Flow `sweep`: a grid of reward weightings (beta, gamma), each a GRPO run logged as a child of one
MLflow parent run, so the MLflow UI compares them side by side."""

from __future__ import annotations

import itertools

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from flows import default_config
from flows.grpo import grpo
from memalpha.config import RunConfig
from tasks import tracking


@task(name="open-sweep-run", cache_policy=NO_CACHE)
def open_parent(config: RunConfig, grid: list[tuple[float, float]], flow_run_id: str) -> str:
    """The parent MLflow run: the base config as params, the grid as a tag."""
    params = {k: v for k, v in config.flat().items() if k not in ("reward.beta", "reward.gamma")}
    tags = {"prefect.flow_run_id": flow_run_id, "memalpha.sweep_grid": str(grid), "memalpha.kind": "sweep"}
    return tracking.create_run(config.tracking.experiment, f"sweep-{config.name}", params, tags)


@task(name="close-sweep-run", cache_policy=NO_CACHE)
def close_parent(run_id: str, children: list[dict], status: str = "FINISHED") -> None:
    """Record the children on the parent and end it."""
    tracking.set_tags(run_id, {"memalpha.children": ",".join(c["run_id"] for c in children)})
    tracking.configure().set_terminated(run_id, status=status)


@flow(name="sweep")
def sweep(config: RunConfig = default_config(), betas: list[float] = [0.0, 0.05, 0.2],
          gammas: list[float] = [0.0, 0.1]) -> dict:
    """Run `grpo` for every (beta, gamma) in betas x gammas as MLflow child runs of one parent run."""
    logger = get_run_logger()
    grid = list(itertools.product(betas, gammas))
    parent = open_parent(config, grid, str(runtime.flow_run.id))
    children = []
    try:
        for beta, gamma in grid:
            child_config = config.model_copy(deep=True)
            child_config.reward.beta = beta
            child_config.reward.gamma = gamma
            child_config.name = f"{config.name}-beta{beta:g}-gamma{gamma:g}"
            children.append(grpo(child_config, parent_run_id=parent, register_adapter=False))
            logger.info("beta=%g gamma=%g done: %s", beta, gamma, children[-1]["run_id"])
    except BaseException:
        close_parent(parent, children, "FAILED")
        raise
    close_parent(parent, children)
    return {"parent_run_id": parent, "children": [c["run_id"] for c in children]}
