"""Evaluation on a local Ray with 2 workers gives the serial run's report: same scores, memories and rows."""

from __future__ import annotations

import polars as pl
import pytest
from test_rollout import CONFIG as TINY_CONFIG
from test_rollout import make_instances, random_adapter  # noqa: F401  (fixture re-export)

from memalpha.config import load_config
from memalpha.evaluation.cluster import shards
from memalpha.evaluation.runner import evaluate

TIMINGS = ("build_seconds", "answer_seconds")


def test_shards_are_contiguous_whole_batches_at_most_one_a_worker():
    assert shards(10, 2, 2) == [range(0, 6), range(6, 10)]  # 5 batches: 3 + 2
    assert shards(10, 2, 16) == [range(0, 10)]  # one batch cannot be split
    assert shards(4, 8, 1) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert shards(0, 2, 4) == []
    covered = [i for part in shards(37, 3, 4) for i in part]
    assert covered == list(range(37))


@pytest.mark.slow
def test_two_ray_workers_give_the_serial_report(random_adapter, tmp_path):
    import ray

    instances = make_instances()
    methods = ["policy", "rule_writer", "rag", "long_context", "no_memory"]
    config = load_config(TINY_CONFIG, ["eval.batch_size=2", "eval.max_instances=0", "sft.enabled=false"])
    serial = evaluate(config, methods=methods, model_uri=random_adapter, instances=instances, progress=None)
    spread = evaluate(config.model_copy(update={"eval": config.eval.model_copy(update={"ray_workers": 2})}),
                      methods=methods, model_uri=random_adapter, instances=instances, progress=None)

    assert not ray.is_initialized()  # the local Ray started for the call was stopped
    assert spread.info["workers"] == "2 Ray workers (local, 127.0.0.1)"
    assert spread.questions.equals(serial.questions)
    assert spread.instances.drop(TIMINGS).equals(serial.instances.drop(TIMINGS))
    assert spread.memories == serial.memories
    assert spread.instances.filter(pl.col("method") == "rag")["memory_tokens"].min() > 0  # real memories
    assert spread.instances.filter(pl.col("method") == "policy").height == len(instances)
