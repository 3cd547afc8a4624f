"""Flow `sweep`: a grid of reward weightings (beta, gamma), each a GRPO run logged as a child of one
MLflow parent run, so the MLflow UI compares them side by side (`tracking.share_children_view`). The children
run one after another, or concurrently as tasks on Ray workers (prefect-ray's task runner): a local Ray on
127.0.0.1 with `ray_workers` CPUs, or the cluster at `ray_address`. By default the grid is `POINTS` and each
child is `configs/sweep.yaml`, sized so the whole sweep takes ~15 minutes on a 2-core CPU (`make sweep`)."""

from __future__ import annotations

import itertools

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from flows import REPO_ROOT
from flows.grpo import grpo
from memalpha.config import RunConfig, load_config
from memalpha.evaluation.cluster import local_ray_kwargs
from tasks import tracking

SWEEP_CONFIG_FILE = REPO_ROOT / "configs" / "sweep.yaml"
POINTS = [(0.05, 0.1), (1.0, 0.1), (0.05, 1.0)]
"""The recipe's (beta, gamma), then each weight raised alone: what each weight does shows against the recipe."""
WEIGHTS = ("reward.beta", "reward.gamma")
COMPARED = ["eval/qa_score", "reward", "rewards/beta_r3/mean", "rewards/gamma_r4_gated/mean", "rewards/r3/mean",
            "rewards/r4/mean", "memory/tokens", "eval/reward"]
"""The charts the sweep's comparison opens on: held-out QA, the reward, the terms the weights scale, what they change."""


def sweep_config() -> RunConfig:
    """The config each child starts from (its weights set by the grid): configs/sweep.yaml."""
    return load_config(SWEEP_CONFIG_FILE)


@task(name="open-sweep-run", cache_policy=NO_CACHE)
def open_parent(config: RunConfig, grid: list[tuple[float, float]], flow_run_id: str) -> dict[str, str]:
    """The parent MLflow run (the base config as params, the grid as a tag) and the UI's chart view of its
    children, linked from its description and `tracking.COMPARE_TAG`."""
    params = {k: v for k, v in config.flat().items() if k not in WEIGHTS}
    tags = {"prefect.flow_run_id": flow_run_id, "memalpha.sweep_grid": str(grid), "memalpha.kind": "sweep"}
    run_id = tracking.create_run(config.tracking.experiment, f"sweep-{config.name}", params, tags)
    compare = tracking.share_children_view(run_id, list(WEIGHTS), "Reward weightings", COMPARED)
    tracking.set_tags(run_id, {tracking.COMPARE_TAG: compare, tracking.DESCRIPTION_TAG: (
        f"Reward weightings (beta, gamma) {grid}, each a child run of config `{config.name}` ({config.grpo.steps} "
        f"GRPO steps, {config.grpo.sampling}-level sampling). [Compare them]({compare}): one series per child.")})
    return {"run_id": run_id, "compare_url": compare}


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
def sweep(config: RunConfig = sweep_config(), points: list[tuple[float, float]] = POINTS, betas: list[float] = [],
          gammas: list[float] = [], ray_workers: int = 0, ray_address: str = "") -> dict:
    """Run `grpo` for every (beta, gamma) of `points`, or of betas x gammas when either is given (the other
    then defaults to the config's weight), as MLflow child runs of one parent run; on Ray when `ray_workers`
    > 0 or `ray_address` is set. Returns the parent, the children and the UI's chart view comparing them."""
    logger = get_run_logger()
    if betas or gammas:
        points = list(itertools.product(betas or [config.reward.beta], gammas or [config.reward.gamma]))
    grid = [(float(beta), float(gamma)) for beta, gamma in points]
    opened = open_parent(config, grid, str(runtime.flow_run.id))
    parent, compare = opened["run_id"], opened["compare_url"]
    logger.info("sweep of %d reward weightings (beta, gamma) %s: compare them at %s", len(grid), grid, compare)
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
            for i, child_config in enumerate(configs, 1):
                logger.info("weighting %d/%d: beta %g, gamma %g (run %s)", i, len(configs), child_config.reward.beta,
                            child_config.reward.gamma, child_config.name)
                children.append(grpo(child_config, parent_run_id=parent, register_adapter=False))
                logger.info("weighting %d/%d done: %s", i, len(configs), tracking.run_url(children[-1]["run_id"]))
    except BaseException:
        close_parent(parent, children, "FAILED")
        raise
    close_parent(parent, children)
    return {"parent_run_id": parent, "children": [c["run_id"] for c in children], "compare_url": compare}
