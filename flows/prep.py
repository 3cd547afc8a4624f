"""Flow `prep`: load -> chunk -> validate -> split -> write a dataset folder, each step a cached task, then
log the dataset to MLflow (dataset inputs per split, validation report as artifacts)."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, runtime

from flows import default_config, repo_path
from memalpha.config import RunConfig
from tasks import prep as steps


@flow(name="prep")
def prep(source: str = "synthetic", path: str | None = None, out_dir: str | None = None,
         synth: dict[str, Any] | None = None, drop_invalid: bool = False,
         config: RunConfig = default_config()) -> dict:
    """Prepare `path` (format `source`; `synthetic` generates with the `synth` knobs) into `out_dir`
    (default: config.data.train_path). An unchanged re-run is served from the task cache."""
    logger = get_run_logger()
    path = str(repo_path(path)) if path is not None else None
    out = str(repo_path(out_dir or config.data.train_path))
    policy = config.model.policy
    loaded = steps.load(source, path, steps.fingerprint(path), synth, policy)
    instances, tokenizer_name = steps.chunk(loaded, policy, config.data)
    result = steps.validate(instances, policy, config.data, loaded.rejected)
    assigned = steps.split(result.valid, config.data)
    manifest = {"source": source, "input": path or "", "tokenizer": tokenizer_name, "chunk_tokens": config.data.chunk_tokens}
    written = steps.write(out, assigned, result, manifest, config.data, drop_invalid)
    if steps.fingerprint(out) != written["fingerprint"]:  # cached, but the folder was changed or deleted since
        logger.info("%s differs from the cached write; writing it again", out)
        written = steps.write.with_options(refresh_cache=True)(out, assigned, result, manifest, config.data, drop_invalid)
    tags = {"prefect.flow_run_id": str(runtime.flow_run.id)}
    run_id = steps.log_dataset(written["path"], written["fingerprint"], config.tracking.experiment, tags)
    logger.info("dataset %s: %s; MLflow run %s", written["path"], result.counts, run_id)
    return {"out_dir": written["path"], "counts": result.counts, "mlflow_run_id": run_id}
