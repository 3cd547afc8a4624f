"""Scale benchmark: evaluation serially and on a local Ray with 2 workers, and what starting Ray costs.

The learning benchmark's first `INSTANCES` held-out instances (4 chunks of 512 tokens each), greedy, the
evidence reader, methods `METHODS` (the shipped writer as `policy`). `eval_seconds` is keyed by workers
(1 = the serial runner in this process); each Ray run starts its own local Ray instance and the time of
that start (a Ray instance up and one empty task back) is reported separately as `ray_start_seconds`
and included in the Ray run's `eval_seconds`. The reports are compared too: a Ray run must give the serial
run's scores and memory sizes. On a 2-core machine no speed-up is expected: the point is the overhead.

    python -m bench.run_all scale
"""

from __future__ import annotations

import time
from typing import Any

from bench import bench_learning as learning

INSTANCES = 16
WORKERS = (1, 2)
METHODS = ("policy", "rule_writer", "rag", "long_context")


def ray_start_seconds() -> float:
    """A local Ray instance up and one empty task back, then stopped."""
    import ray

    from memalpha.evaluation.cluster import ray_session

    started = time.perf_counter()
    with ray_session("", 2):
        ray.get(ray.remote(lambda: None).remote())
        return time.perf_counter() - started


def run() -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.evaluation.runner import evaluate
    from memalpha.teacher import record

    instances = learning.test_instances(INSTANCES)
    seconds, scores = {}, {}
    for workers in WORKERS:
        config = load_config(None, [f"eval.ray_workers={workers if workers > 1 else 0}"])
        started = time.perf_counter()
        result = evaluate(config, methods=list(METHODS), model_uri=record.WRITER, instances=instances, progress=None)
        seconds[workers] = round(time.perf_counter() - started, 1)
        scores[workers] = {m: {"qa": float(result.questions.filter(result.questions["method"] == m)["score"].mean()),
                               "memory_tokens": float(result.instances.filter(result.instances["method"] == m)["memory_tokens"].mean())}
                           for m in METHODS}
        print(f"{workers} worker(s): {seconds[workers]} s", flush=True)
    return {
        "eval_seconds": seconds, "ray_start_seconds": round(ray_start_seconds(), 1),
        "same_report": all(scores[w] == scores[1] for w in WORKERS), "scores": scores,
        "settings": {"instances": len(instances), "questions": sum(len(i.questions) for i in instances),
                     "methods": list(METHODS), "policy": str(record.WRITER.relative_to(learning.ROOT)), "reader": "evidence"},
    }


def to_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = ["# Benchmark: scale", "",
             f"Evaluation of {s['instances']} held-out instances ({s['questions']} questions; methods {', '.join(s['methods'])}; "
             f"policy {s['policy']}; {s['reader']} reader), serially and on a local Ray. Starting a local Ray and running one "
             f"empty task: {results['ray_start_seconds']} s (inside the Ray rows). Same report on Ray as serially: "
             f"{results['same_report']}.", "", "| workers | eval seconds |", "|---|---|"]
    lines += [f"| {w} | {sec} |" for w, sec in results["eval_seconds"].items()]
    lines += ["", "Data-parallel training (`step_seconds` by processes) is not built yet: not measured."]
    return "\n".join(lines) + "\n"
