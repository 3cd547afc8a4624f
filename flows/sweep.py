"""Flow `sweep`: a grid of reward weightings (beta, gamma), each a GRPO run logged as a child of one
MLflow parent run, so the MLflow UI compares them side by side. The children run one after another, or
concurrently as tasks on Ray workers (prefect-ray's task runner): a local Ray on 127.0.0.1 with
`ray_workers` CPUs, or the cluster at `ray_address`."""

from __future__ import annotations

import itertools

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from flows import default_config
from flows.grpo import grpo
from memalpha.config import RunConfig
from memalpha.evaluation.cluster import local_ray_kwargs
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


@task(name="sweep-child", cache_policy=NO_CACHE)
def train_child(config: RunConfig, parent_run_id: str) -> dict:
    """One grid point on a Ray worker: the `grpo` flow as a nested flow run."""
    from flows.grpo import grpo as grpo_flow  # imported on the worker: a pickled flow cannot resolve its parameter types

    return grpo_flow(config, parent_run_id=parent_run_id, register_adapter=False)


@flow(name="sweep-on-ray")
def children_on_ray(configs: list[RunConfig], parent_run_id: str) -> list[dict]:
    """Every grid point at once on the flow's Ray task runner; Ray queues what exceeds its CPUs."""
    futures = [train_child.submit(config, parent_run_id) for config in configs]
    return [future.result() for future in futures]


def ray_runner(workers: int, address: str):
    """prefect-ray's task runner: the cluster at `address`, else a local Ray of `workers` CPUs on 127.0.0.1."""
    if address:
        from prefect_ray import RayTaskRunner

        return RayTaskRunner(address=address, init_kwargs={"log_to_driver": False})
    kwargs = local_ray_kwargs(workers)  # before prefect_ray imports ray
    from prefect_ray import RayTaskRunner

    return RayTaskRunner(init_kwargs=kwargs)


@flow(name="sweep")
def sweep(config: RunConfig = default_config(), betas: list[float] = [0.0, 0.05, 0.2],
          gammas: list[float] = [0.0, 0.1], ray_workers: int = 0, ray_address: str = "") -> dict:
    """Run `grpo` for every (beta, gamma) in betas x gammas as MLflow child runs of one parent run; on Ray
    when `ray_workers` > 0 or `ray_address` is set."""
    logger = get_run_logger()
    grid = list(itertools.product(betas, gammas))
    parent = open_parent(config, grid, str(runtime.flow_run.id))
    configs = []
    for beta, gamma in grid:
        child_config = config.model_copy(deep=True)
        child_config.reward.beta = beta
        child_config.reward.gamma = gamma
        child_config.name = f"{config.name}-beta{beta:g}-gamma{gamma:g}"
        configs.append(child_config)
    children = []
    try:
        if ray_workers or ray_address:
            children = children_on_ray.with_options(task_runner=ray_runner(ray_workers, ray_address))(configs, parent)
        else:
            for child_config in configs:
                children.append(grpo(child_config, parent_run_id=parent, register_adapter=False))
                logger.info("%s done: %s", child_config.name, children[-1]["run_id"])
    except BaseException:
        close_parent(parent, children, "FAILED")
        raise
    close_parent(parent, children)
    return {"parent_run_id": parent, "children": [c["run_id"] for c in children]}
