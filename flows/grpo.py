"""Flow `grpo` (deployment `train`): warm start, then GRPO in checkpointed blocks, then register the adapter.
Flow `writer` (deployment `register`): register a shipped writer through the same registration path."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger, runtime

from flows import default_config, repo_path
from memalpha.config import RunConfig
from tasks import tracking
from tasks.train import (
    adopt_shipped_writer,
    block_bounds,
    close_run,
    open_run,
    register_model,
    train_block,
    warm_start,
)


SHIPPED_WRITER = "adapters/writer"


def run_dir_for(config: RunConfig, flow_run_id: str) -> Path:
    """`<output_dir>/<flow run id>`: a new flow run trains from scratch, a retried flow run resumes."""
    return repo_path(config.output_dir) / flow_run_id


def mark_mlflow_run_crashed(flow, flow_run, state) -> None:
    """on_crashed / on_cancellation hook, run by the runner when the flow's process died (e.g. OOM-killed)
    or was cancelled: the MLflow run would otherwise stay RUNNING forever."""
    config = flow_run.parameters.get("config") or default_config()
    if isinstance(config, dict):
        config = RunConfig.model_validate(config)
    experiment = config.tracking.experiment
    run_id = tracking.find_run(experiment, "prefect.flow_run_id", str(flow_run.id))
    if run_id is not None:
        tracking.set_tags(run_id, {"memalpha.crash": state.message or state.name})
        tracking.configure().set_terminated(run_id, status="KILLED")


@flow(name="grpo", on_crashed=[mark_mlflow_run_crashed], on_cancellation=[mark_mlflow_run_crashed])
def grpo(config: RunConfig = default_config(), parent_run_id: str | None = None, register_adapter: bool = True,
         processes: int = 1) -> dict:
    """Train the memory writer with GRPO on `config`, data-parallel over `processes` (torchrun: gloo on a
    CPU, NCCL on GPUs); returns the MLflow run id, checkpoint and model. Without `register_adapter` (a sweep's
    children: compared, not served) no model is logged; the run keeps its checkpoints."""
    logger = get_run_logger()
    flow_run_id = str(runtime.flow_run.id)
    run_dir = run_dir_for(config, flow_run_id)
    tags = {"prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": str(runtime.flow_run.name),
            "prefect.deployment": str(runtime.deployment.name or "")}
    run_id = open_run(config, str(run_dir), tags, parent_run_id)
    logger.info("MLflow run %s, run folder %s", tracking.run_url(run_id), run_dir)
    started = time.time()
    try:
        warm_start(config, str(run_dir), run_id, started)
        block = None
        for first, last in block_bounds(config.grpo.steps, config.grpo.checkpoint_every, config.grpo.eval_every):
            if block is not None and block["stopped_early"]:
                break  # the time budget is spent; the block evaluated and checkpointed its last step
            block = train_block(config, str(run_dir), run_id, first, last, started, processes)
        model = register_model(config, str(run_dir), run_id, block["checkpoint"]) if block and register_adapter else None
    except BaseException:
        close_run(run_id, "FAILED")
        raise
    close_run(run_id, config=config)
    return {"run_id": run_id, "run_dir": str(run_dir), "checkpoint": block and block["checkpoint"], "model": model}


@flow(name="writer")
def register_writer(config: RunConfig = default_config(), adapter: str = SHIPPED_WRITER) -> dict:
    """Register a shipped writer (default: the trained writer of record) as `grpo/train` registers a
    trained run's: an MLflow run holding its record and test scores, the model logged and registered as a
    new version, `champion` when its validation score beats the current champion's."""
    logger = get_run_logger()
    flow_run_id = str(runtime.flow_run.id)
    run_dir = run_dir_for(config, flow_run_id)
    tags = {"prefect.flow_run_id": flow_run_id, "prefect.flow_run_name": str(runtime.flow_run.name),
            "prefect.deployment": str(runtime.deployment.name or ""), "memalpha.shipped_adapter": adapter}
    run_id = open_run(config, str(run_dir), tags)
    logger.info("MLflow run %s for the shipped writer %s", tracking.run_url(run_id), adapter)
    try:
        kept = adopt_shipped_writer(str(run_dir), run_id, str(repo_path(adapter)))
        model = register_model(config, str(run_dir), run_id, str(run_dir))
    except BaseException:
        close_run(run_id, "FAILED")
        raise
    close_run(run_id, config=config)
    return {"run_id": run_id, "run_dir": str(run_dir), "step": kept["step"], "model": model}
