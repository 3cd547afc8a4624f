"""Evaluation spread over Ray workers: each worker builds and answers a shard of the instances with the
same code as a serial run (`runner.run_method`), and the driver concatenates the rows in instance order.

Shards are contiguous runs of whole writer batches (`eval.batch_size` instances), so a policy writes each
memory in the same batch as it would serially. `eval.ray_address` empty starts a local Ray instance on
127.0.0.1 (no dashboard) for the call and stops it after; an address (`ray://host:10001` or `auto`)
uses a running cluster, whose workers must have memalpha installed (the repository and its `.venv`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.evaluation.answering import LazyReader, policy_tokenizer, run_method, token_counter
from memalpha.evaluation.methods import EvalEnv, make_method

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_ray_kwargs(workers: int) -> dict:
    """`ray.init` arguments of a local Ray bound to 127.0.0.1. Ray takes the machine's address for a node even
    when told 127.0.0.1, unless multi-node clusters are off (`LOOPBACK_ENV`=0, read when ray is imported and by
    the processes it starts): then every Ray port listens on 127.0.0.1 only."""
    os.environ[LOOPBACK_ENV] = "0"
    if "ray" in sys.modules:  # imported before: its constant was read already
        sys.modules["ray"]._private.ray_constants.ENABLE_RAY_CLUSTER = False
    return {"num_cpus": workers, "include_dashboard": False, "log_to_driver": False}


def shards(count: int, workers: int, batch_size: int) -> list[range]:
    """Contiguous index ranges of whole batches, as even as whole batches allow, at most `workers` of them."""
    batches = -(-count // batch_size)
    per_shard, extra = divmod(batches, min(workers, batches) or 1)
    out, first = [], 0
    for shard in range(min(workers, batches)):
        size = (per_shard + (shard < extra)) * batch_size
        out.append(range(first, min(first + size, count)))
        first += size
    return out


@contextmanager
def ray_session(address: str, workers: int) -> Iterator[None]:
    """Ray for the duration of the block: the cluster at `address`, or a local instance of `workers` CPUs
    bound to 127.0.0.1 and stopped afterwards. A session already open in this process is reused."""
    kwargs = {"address": address, "log_to_driver": False} if address else local_ray_kwargs(workers)
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(**kwargs)
    try:
        yield
    finally:
        ray.shutdown()


def _run_shard(config_json: str, method: str, model_uri: str | None, instances: list[Instance], seed: int,
               input_tokens: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """One worker's share: the serial code path on a shard of the instances."""

    config = RunConfig.model_validate_json(config_json)
    tokenizer, _ = policy_tokenizer(config)
    built = make_method(method, EvalEnv(config, token_counter(tokenizer), progress=None), model_uri)
    try:
        return run_method(built, instances, seed, LazyReader(config).get(), config, input_tokens)
    finally:
        built.close()


def run_method_on_ray(
    config: RunConfig, method: str, model_uri: str | Path | None, instances: list[Instance], seed: int, input_tokens: list[int],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """`run_method` over `eval.ray_workers` Ray tasks (inside `ray_session`); rows in instance order."""
    import ray

    remote = ray.remote(num_cpus=1)(_run_shard)
    parts = shards(len(instances), config.eval.ray_workers, config.eval.batch_size)
    futures = [remote.remote(config.model_dump_json(), method, None if model_uri is None else str(model_uri),
                             instances[part.start:part.stop], seed, input_tokens[part.start:part.stop]) for part in parts]
    questions, per_instance, memories = [], [], []
    for q_rows, i_rows, built in ray.get(futures):
        questions.extend(q_rows)
        per_instance.extend(i_rows)
        memories.extend(built)
    return questions, per_instance, memories
