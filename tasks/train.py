"""Training tasks: open the MLflow run, warm start, GRPO blocks, final model registration.

Tasks pass paths and ids, never models: each block task builds its own `Trainer` from the run folder
and resumes from the latest checkpoint. That makes a retried block exact: a block's results are staged
on disk and published to MLflow only after the block's checkpoint is written, and publishing skips
steps MLflow already has, so no step is logged twice or lost whatever fails where.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import mlflow
import polars as pl
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from memalpha.config import GRPOConfig, RewardConfig, RunConfig
from memalpha.errors import NoTrainingStep
from memalpha.training.checkpoint import (
    ADAPTER,
    BEST,
    adopt_best,
    checkpoint_dir,
    policy_adapter,
    read_best,
    step_name,
)
from tasks import plots, tracking

FAIL_AT_STEP_ENV = "MEMALPHA_FAIL_AT_STEP"
"""Failure injection for tests: raise once, after this training step and before its checkpoint."""
RUN_ID_FILE = "mlflow_run_id"
NO_TRAINING_STEP = "no_training_step"
"""Key of a data-parallel block's outcome file when the time budget left no GRPO step (its message)."""
STAGING = "staging"
TEXT_COLUMNS = ("prompt", "completion", "parsed_calls", "results", "memory")


class InjectedFailure(RuntimeError):
    """Raised by the failure-injection hook; the block task's retry must recover from it."""


def block_bounds(steps: int, checkpoint_every: int, eval_every: int) -> list[tuple[int, int]]:
    """(first, last) step of each block: blocks end at every checkpoint, every evaluation and the last step."""
    schedule = GRPOConfig(steps=steps, eval_every=eval_every)
    ends = sorted({s for s in range(1, steps + 1) if s % checkpoint_every == 0 or schedule.is_eval_step(s)})
    bounds, first = [], 1
    for end in ends:
        if end >= first:
            bounds.append((first, end))
            first = end + 1
    return bounds


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / STAGING / step_name(step)


def _maybe_fail(run_dir: Path, step: int) -> None:
    wanted = os.environ.get(FAIL_AT_STEP_ENV)
    if not wanted or int(wanted) != step:
        return
    marker = run_dir / f".failure-injected-at-step-{step}"
    if marker.exists():
        return
    marker.write_text("injected once\n")
    raise InjectedFailure(f"injected failure after training step {step} ({FAIL_AT_STEP_ENV}={wanted})")


@task(name="open-mlflow-run", cache_policy=NO_CACHE)
def open_run(config: RunConfig, run_dir: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
    """The MLflow run of this training folder: created once (params = flattened config), reused on re-runs."""
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    id_file = path / RUN_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
        tracking.configure().update_run(run_id, status="RUNNING")
        tracking.set_tags(run_id, tags)
        return run_id
    all_tags = {**tags, "memalpha.run_dir": str(path), "memalpha.training_hash": config.training_hash(),
                tracking.DESCRIPTION_TAG: run_description(config)}
    run_id = tracking.create_run(config.tracking.experiment, config.name, config.flat(), all_tags, parent_run_id)
    id_file.write_text(run_id + "\n")
    tracking.configure().log_text(run_id, config.model_dump_json(indent=2), "config/run_config.json")
    return run_id


def run_description(config: RunConfig, metrics: dict[str, float] | None = None) -> str:
    """The MLflow run's description: the config, the data and, once finished, the result."""
    text = (f"Config `{config.name}` (training hash {config.training_hash()}): {config.grpo.steps} GRPO steps, "
            f"{config.grpo.sampling}-level sampling, B={config.rollout.instances_per_step} G={config.rollout.num_generations}, "
            f"warm start {'on' if config.sft.enabled else 'off'}, policy `{config.model.policy}`. "
            f"Data: `{config.data.train_path}` ({', '.join(config.data.competencies)}).")
    if metrics is None:
        return text + " Result: running."
    qa, warm = metrics.get(tracking.VALIDATION_KEY), metrics.get(f"warm_start/{tracking.VALIDATION_KEY}")
    result = [f"held-out QA {qa:.3f}" + (f" (warm start {warm:.3f})" if warm is not None else "")] if qa is not None else []
    if "reward" in metrics:
        result.append(f"last training reward {metrics['reward']:.3f}")
    return text + " Result: " + ("; ".join(result) or "no step finished") + "."


@task(name="close-mlflow-run", cache_policy=NO_CACHE)
def close_run(run_id: str, status: str = "FINISHED", config: RunConfig | None = None) -> None:
    """Plot what the run logged, whatever its steps and status, and mark it finished (or failed); with `config`,
    its description gets the result."""
    client = tracking.configure()
    plots.log_training_plots(run_id)
    if config is not None:
        tracking.set_tags(run_id, {tracking.DESCRIPTION_TAG: run_description(config, client.get_run(run_id).data.metrics)})
    client.set_terminated(run_id, status=status)


def _stage_step(run_dir: Path, result, seconds: float) -> None:
    """Write one step's results to disk; `publish_block` logs them once the checkpoint exists."""
    folder = _step_dir(run_dir, result.step)
    folder.mkdir(parents=True, exist_ok=True)
    metrics = {**result.metrics, tracking.STEP_SENTINEL: seconds}
    (folder / "metrics.json").write_text(json.dumps({"step": result.step, "time_ms": tracking.now_ms(),
                                                     "metrics": tracking.finite_metrics(metrics)}))
    result.samples.write_parquet(folder / "samples.parquet")
    (folder / "memories.json").write_text(json.dumps(result.memories, default=str))
    (folder / "trace.json").write_text(json.dumps(result.trace, default=str))


def weighted_terms(reward: RewardConfig, metrics: dict[str, float]) -> dict[str, float]:
    """beta r3 and gamma g r4 as the total reward counts them, in training, held-out and warm-start metrics: the
    terms a reward weighting scales, so a sweep's charts show what each weighting adds to the reward."""
    out = {}
    for prefix in ("", "eval/", "warm_start/eval/"):
        if f"{prefix}rewards/r3/mean" in metrics:
            out[f"{prefix}rewards/beta_r3/mean"] = reward.beta * metrics[f"{prefix}rewards/r3/mean"]
        if f"{prefix}rewards/r4_gated/mean" in metrics:
            out[f"{prefix}rewards/gamma_r4_gated/mean"] = reward.gamma * metrics[f"{prefix}rewards/r4_gated/mean"]
    return out


def _rollout_key(samples: pl.DataFrame) -> list[str]:
    return [c for c in ("instance", "rollout") if c in samples.columns]


def _bounded_samples(samples: pl.DataFrame, keep: int) -> pl.DataFrame:
    """All rows (numbers are totals), text columns only for the first `keep` rollouts."""
    key = _rollout_key(samples)
    text = [c for c in samples.columns if c in TEXT_COLUMNS]
    if not key or not text:
        return samples
    kept = samples.select(key).unique(maintain_order=True).head(keep).with_columns(pl.lit(True).alias("_full"))
    joined = samples.join(kept, on=key, how="left")
    full = pl.col("_full").fill_null(False)
    return joined.with_columns([pl.when(full).then(pl.col(c)).otherwise(None).alias(c) for c in text]).drop("_full")


def _reward_table(samples: pl.DataFrame) -> pl.DataFrame:
    """The per-(instance, rollout, chunk) reward breakdown: identifiers and every numeric column."""
    ids = [c for c in ("instance", "instance_id", "rollout", "chunk") if c in samples.columns]
    numeric = [c for c, dtype in samples.schema.items() if dtype.is_numeric() and c not in ids]
    return samples.select(ids + numeric)


def _log_trace(run_id: str, trace: Any, step: int) -> None:
    """One rollout as an MLflow trace linked to the run: nested spans from StepResult.trace.

    `trace` is a span tree: {"name", "span_type", "inputs", "outputs", "attributes", "children": [...]}.
    """
    if not trace:
        return
    from mlflow.entities.trace_location import MlflowExperimentLocation

    mlflow.set_tracking_uri(tracking.tracking_uri())
    experiment_id = tracking.configure().get_run(run_id).info.experiment_id

    def emit(node: dict, root: bool) -> None:
        options = {"trace_destination": MlflowExperimentLocation(experiment_id), "run_id": run_id} if root else {}
        with mlflow.start_span(name=str(node.get("name", "span")), span_type=str(node.get("span_type", "UNKNOWN")),
                               attributes=node.get("attributes") or {}, **options) as span:
            if root:
                mlflow.update_current_trace(tags={"memalpha.step": str(step)})
            span.set_inputs(node.get("inputs"))
            for child in node.get("children") or []:
                emit(child, False)
            span.set_outputs(node.get("outputs"))

    # MLflow draws trace ids from the global `random`, which the trainer seeds and restores on resume:
    # without fresh entropy a resumed block reuses (and overwrites) earlier traces' ids. The training
    # RNG state is put back afterwards so tracing never changes what training samples.
    training_state = random.getstate()
    random.seed()
    try:
        emit(trace, True)
        mlflow.flush_trace_async_logging()
    finally:
        random.setstate(training_state)


def _tag_best(run_dir: Path, run_id: str, metrics: dict[str, float]) -> None:
    """Mirror the trainer's choice (Trainer.validate keeps the best adapter by validation QA) as run tags."""
    if "best/step" not in metrics:
        return
    step = int(metrics["best/step"])
    tracking.set_tags(run_id, {
        "memalpha.best_checkpoint": f"{run_dir / BEST / ADAPTER} ({tracking.VALIDATION_KEY}={metrics['best/qa_score']:.4f} at step {step})",
        "memalpha.best_step": step,
    })


def _log_warm_start_check(run_id: str, record: dict) -> None:
    """The held-out check of the warm start (`warm_start/*` of the first step, or of a run the time budget
    ended before it) also as step 0 of the eval/* and best/* curves, which then start where GRPO started; once."""
    before = {k.removeprefix("warm_start/"): v for k, v in record["metrics"].items() if k.startswith("warm_start/")}
    if before and 0 not in tracking.logged_steps(run_id, tracking.VALIDATION_KEY):
        tracking.log_step_metrics(run_id, 0, before, record["time_ms"])


def publish_block(config: RunConfig, run_dir: Path, run_id: str, first: int, last: int, checkpoint: Path) -> int:
    """Log staged steps first..last that MLflow lacks (artifacts, then the metric batch), then the checkpoint."""
    client = tracking.configure()
    done = tracking.logged_steps(run_id)
    keep = config.tracking.rollouts_logged_per_step
    published = 0
    for step in range(first, last + 1):
        if step in done:
            continue
        folder = _step_dir(run_dir, step)
        record = json.loads((folder / "metrics.json").read_text())
        samples = pl.read_parquet(folder / "samples.parquet")
        name = step_name(step)
        bounded = folder / f"rollouts-{name}.parquet"
        _bounded_samples(samples, keep).write_parquet(bounded)
        client.log_artifact(run_id, str(bounded), "rollouts")
        table_path = f"reward_breakdown/{name}.json"
        if not tracking.artifact_exists(run_id, table_path):  # log_table appends, so never twice
            client.log_table(run_id, _reward_table(samples).to_pandas(), table_path)
        memories = json.loads((folder / "memories.json").read_text())
        client.log_dict(run_id, memories[:keep], f"memories/{name}.json")
        _log_trace(run_id, json.loads((folder / "trace.json").read_text()), step)
        _log_warm_start_check(run_id, record)
        # metrics last: once the sentinel is in, the step counts as published
        tracking.log_step_metrics(run_id, step, record["metrics"], record["time_ms"])
        _tag_best(run_dir, run_id, record["metrics"])
        published += 1
    client.log_artifacts(run_id, str(checkpoint), f"checkpoints/{checkpoint.name}")
    tracking.set_tags(run_id, {"memalpha.last_checkpoint": str(checkpoint)})
    return published


@task(name="warm-start", cache_policy=NO_CACHE, retries=1)
def warm_start(config: RunConfig, run_dir: str, run_id: str, started: float | None = None) -> str | None:
    """SFT warm start (rule-writer demonstrations + LoRA) when configured; returns the adapter folder.

    The adapter lands in <run_dir>/sft, where the first GRPO block's Trainer loads it. `started` (a
    `time.time()`) is when the flow began, for `time_budget_minutes`.
    """
    from memalpha.progress import SFTProgress
    from memalpha.teacher.warm_start import prepare_warm_start

    began = time.perf_counter()
    progress, client = SFTProgress(get_run_logger().info), tracking.configure()

    def on_log(record: dict) -> None:
        progress(record)
        if "token_loss" in record:  # the loss curve of the warm start, beside GRPO's in the same run
            client.log_metric(run_id, "sft/loss", float(record["token_loss"]), step=int(record["step"]))

    adapter = prepare_warm_start(config, run_dir, on_log=on_log, started=started)
    if adapter is None:  # disabled, or a re-run past the first checkpoint (it holds newer weights)
        return None
    if not tracking.artifact_exists(run_id, "sft"):
        client.log_artifacts(run_id, str(adapter), "sft")
        client.log_metric(run_id, "sft/seconds", time.perf_counter() - began, step=0)
        result = Path(adapter) / "sft_result.json"
        for epoch in json.loads(result.read_text()).get("epochs", []) if result.is_file() else []:
            metrics = {f"sft_eval/{k}": v for k, v in epoch.items() if k not in ("epoch", "step")}
            tracking.log_step_metrics(run_id, epoch["epoch"], metrics, tracking.now_ms())
    tracking.set_tags(run_id, {"memalpha.sft_adapter": str(adapter)})
    return str(adapter)


def _train_steps(config: RunConfig, path: Path, first: int, last: int, started: float | None, say) -> dict[str, Any]:
    """Steps first..last in this process (one rank of a data-parallel block under torchrun): resume, train,
    stage each step on rank 0 for `publish_block`."""
    from memalpha.progress import GRPOProgress
    from memalpha.training.trainer import Trainer

    trainer = Trainer(config, path, started=started)
    trainer.maybe_resume()
    resumed = trainer.step
    say = say if trainer.world.main else (lambda _line: None)
    say(f"block {first}-{last}: resumed from checkpoint at step {resumed}"
        + (f" ({trainer.world.size} processes)" if trainer.world.size > 1 else ""))
    if resumed < first - 1:
        raise RuntimeError(f"block {first}-{last} needs the checkpoint of step {first - 1}; latest is step {resumed}")
    progress = GRPOProgress(config.grpo.steps, trainer.step, say, deadline=config.deadline(trainer.started),
                            sampling=config.grpo.sampling)
    trainer.say = say
    previous = time.perf_counter()

    def on_step(result) -> None:
        nonlocal previous
        now = time.perf_counter()
        if trainer.world.main:
            result.metrics.update(weighted_terms(config.reward, result.metrics))
            _stage_step(path, result, now - previous)
            progress(result)
            _maybe_fail(path, result.step)
        previous = now

    checkpoint = trainer.train(on_step, until=last) or checkpoint_dir(path, last)
    return {"resumed_from": resumed, "checkpoint": str(checkpoint), "step": trainer.step,
            "budget_stop": trainer.budget_stop, "stopped_early": trainer.stopped_early}


def _launch(processes: int, config: RunConfig, path: Path, first: int, last: int, started: float | None, say) -> dict[str, Any]:
    """The block under torchrun with `processes` ranks, its output streamed to `say`; a failed rank is a
    RuntimeError, so the task's retry resumes from the last checkpoint."""
    import subprocess
    import sys

    folder = path / "launch"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config.model_dump_json())
    out = folder / f"block-{first}-{last}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m", "tasks.train",
           str(folder / "config.json"), str(path), str(first), str(last), str(started or time.time()), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-20:]
        if line and not line.startswith(" "):
            say(line)
    if proc.wait() != 0 or not out.is_file():
        raise RuntimeError(f"block {first}-{last}: {processes} training processes exited with {proc.returncode}:\n"
                           + "\n".join(tail))
    outcome = json.loads(out.read_text())
    if NO_TRAINING_STEP in outcome:
        raise NoTrainingStep(outcome[NO_TRAINING_STEP], outcome["held_out"])
    return outcome


def _retry_unless_no_step(task, task_run, state) -> bool:
    """A retry cannot give a spent time budget time back (it counts from the flow run's start)."""
    return not isinstance(state.data, NoTrainingStep)


@task(name="train-block", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1, retry_condition_fn=_retry_unless_no_step)
def train_block(config: RunConfig, run_dir: str, run_id: str, first: int, last: int,
                started: float | None = None, processes: int = 1) -> dict[str, Any]:
    """GRPO steps first..last: resume from the latest checkpoint, train, evaluate, checkpoint, publish; with
    `processes` > 1 data-parallel under torchrun. Under `time_budget_minutes` (counted from `started`) the
    block may end early: `stopped_early`; a budget spent before step 1 fails it with `NoTrainingStep`."""
    logger = get_run_logger()
    path = Path(run_dir)
    try:
        if processes > 1:
            outcome = _launch(processes, config, path, first, last, started, logger.info)
        else:
            outcome = _train_steps(config, path, first, last, started, logger.info)
    except NoTrainingStep as error:
        logger.error("%s", error)
        tracking.set_tags(run_id, {tracking.TIME_BUDGET_TAG: str(error)})
        _log_warm_start_check(run_id, {"metrics": error.held_out, "time_ms": tracking.now_ms()})
        raise
    checkpoint = Path(outcome["checkpoint"])
    if outcome["budget_stop"]:
        logger.info("time budget of %s", outcome["budget_stop"])
        tracking.set_tags(run_id, {tracking.TIME_BUDGET_TAG: outcome["budget_stop"]})
        last = outcome["step"]
    published = publish_block(config, path, run_id, first, last, checkpoint)
    logger.info("block %d-%d: checkpoint %s, %d steps published to MLflow", first, last, checkpoint, published)
    return {"first": first, "last": last, "resumed_from": outcome["resumed_from"], "checkpoint": str(checkpoint),
            "published": published, "stopped_early": outcome["stopped_early"]}


def main(argv: list[str] | None = None) -> int:
    """One rank of a data-parallel block (`_launch`): CONFIG_JSON RUN_DIR FIRST LAST STARTED OUT_JSON."""
    import sys

    from memalpha.training.distributed import init_world

    config_file, run_dir, first, last, started, out = (argv or sys.argv[1:])
    try:
        outcome = _train_steps(RunConfig.model_validate_json(Path(config_file).read_text()), Path(run_dir), int(first),
                               int(last), float(started), lambda line: print(line, flush=True))
    except NoTrainingStep as error:  # every rank raises it; `_launch` raises it again, for the task not to retry
        outcome = {NO_TRAINING_STEP: str(error), "held_out": error.held_out}
    if init_world().main:
        Path(out).write_text(json.dumps(outcome))
    return 0


def _base_model_path(config: RunConfig, policy, run_dir: Path) -> str | None:
    """A local folder holding the base weights, so the logged model references it instead of a hub id."""
    from memalpha.models.loading import TINY_POLICY, resolve_model_path

    if config.model.policy == TINY_POLICY:
        # the tiny model is built in memory from a seed: save it once so the model can be reloaded
        folder = run_dir / "base-model"
        if not (folder / "config.json").is_file():
            policy.model.get_base_model().save_pretrained(folder)
            policy.tokenizer.save_pretrained(folder)
        return str(folder)
    resolved = Path(resolve_model_path(config.model.policy))
    return str(resolved) if resolved.is_dir() else None


def _champion_score(client, name: str) -> float | None:
    try:
        version = client.get_model_version_by_alias(name, "champion")
    except mlflow.exceptions.MlflowException:
        return None
    score = version.tags.get("validation_score")
    return float(score) if score is not None else None


@task(name="adopt-shipped-writer", cache_policy=NO_CACHE)
def adopt_shipped_writer(run_dir: str, run_id: str, adapter: str) -> dict[str, Any]:
    """A shipped writer (`adapters/writer`) as the selected adapter of `run_dir` (fp32, with the validation
    score of its record), its record's test scores logged to the run; returns the record."""
    from memalpha.errors import UserError
    from memalpha.teacher import record

    kept = record.read_record(Path(adapter))
    if kept is None:
        raise UserError(f"{adapter}: not a shipped adapter (needs {record.WEIGHTS_FILE} and {record.RECORD_FILE})")
    for field in ("step", "validation_qa"):
        if not isinstance(kept.get(field), (int, float)):
            raise UserError(f"{Path(adapter) / record.RECORD_FILE}: field {field!r} must be a number, got {kept.get(field)!r}")
    path = Path(run_dir)
    if read_best(path) is None:
        adopt_best(path, record.restore(Path(adapter), path / "shipped"), kept["step"], kept["validation_qa"])
    metrics = {f"test/{reader}/{key}": float(value) for reader, result in kept.get("test", {}).items()
               for key, value in result.items() if isinstance(value, (int, float))}
    tracking.log_step_metrics(run_id, kept["step"], {**metrics, tracking.VALIDATION_KEY: kept["validation_qa"]}, tracking.now_ms())
    tracking.configure().log_text(run_id, json.dumps(kept, indent=1), "shipped/record.json")
    return kept


@task(name="register-model", cache_policy=NO_CACHE, retries=1)
def register_model(config: RunConfig, run_dir: str, run_id: str, checkpoint: str) -> dict[str, Any]:
    """Log the adapter the trainer selected on validation QA (run_dir/best; the final `checkpoint`'s when
    the run never evaluated) as the memory-writer pyfunc model (`serving/`: base model, adapter with its
    record, config) and register a new version; alias it `champion` when its validation score beats the
    current champion's. (`latest` is an alias MLflow reserves and resolves by itself:
    `models:/<name>/latest` is always the newest version.)"""
    from memalpha.models.policy import load_policy
    from memalpha.teacher import record
    from serving.registry import log_writer_model

    logger = get_run_logger()
    client = tracking.configure()
    path = Path(run_dir)
    best = read_best(path)
    adapter = path / BEST / ADAPTER if best else policy_adapter(checkpoint)
    policy = load_policy(config.model, adapter=adapter, trainable=False, seed=config.grpo.seed)
    base = _base_model_path(config, policy, path)
    name = config.tracking.registered_model
    with_record = record.with_writer_record(adapter, path / "registered-adapter", config)
    info = log_writer_model(run_id, with_record, base, config.model_dump(mode="json"), name)
    outcome: dict[str, Any] = {"model_uri": info.model_uri, "base_model_path": base}
    version = str(info.registered_model_version)
    key = tracking.VALIDATION_KEY
    score = best["score"] if best else client.get_run(run_id).data.metrics.get(key)
    client.set_model_version_tag(name, version, "run_id", run_id)
    client.set_model_version_tag(name, version, "adapter", str(adapter))
    if best:
        client.set_model_version_tag(name, version, "step", str(best["step"]))
    if score is not None:
        client.set_model_version_tag(name, version, "validation_metric", key)
        client.set_model_version_tag(name, version, "validation_score", str(score))
    champion = _champion_score(client, name)
    promoted = score is not None and (champion is None or score > champion)
    if promoted:
        client.set_registered_model_alias(name, "champion", version)
    logger.info("registered %s version %s (%s=%s); champion %s (previous champion score %s)",
                name, version, key, score, "moved" if promoted else "kept", champion)
    tracking.set_tags(run_id, {"memalpha.registered_model": f"{name} v{version}" + (" (champion)" if promoted else "")})
    return {**outcome, "name": name, "version": version, "champion": promoted, "validation_score": score}


if __name__ == "__main__":
    raise SystemExit(main())
