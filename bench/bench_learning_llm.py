"""The LLM-reader section of the learning benchmark of record (bench/results/learning_llm.md): the held-out
synthetic conversations of `bench_learning` (48 instances, 288 questions) read by a packaged LLM on llama.cpp
(`bench_real_llm.READER`) instead of the 135M policy.

A full LLM-reader pass costs too much here (every method x 288 questions at ~4 s a short memory, ~11 s a
1,024-token retrieval context for the 1.5B), so `PER_INSTANCE` questions of every instance are answered,
drawn with seed `SAMPLE_SEED`: 96 of 288, half from accurate-retrieval conversations, half from conflict
resolution. Every method builds from the whole instances.

Methods: the trained writer of record (`shipped_writer`, adapters/writer: the best seed of the learning
bench), its warm start (adapters/warm-start), the rule writer, the prompted LLM writers, BM25 RAG top-2, long
context, no memory and the reader's ceiling `oracle_evidence` (each question's evidence chunks); qa
(substring match, a conflict answer naming the superseded value is wrong) and token F1 by competency, memory
tokens, minutes, and each method minus RAG paired by question with a 95% bootstrap interval. Resumable like
`bench_real_llm`: builds and answers are cached under `RUN_ROOT`, methods run in `METHODS` order, and rows of
the report of record are reused where this machine has no cache of them.

    MEMALPHA_BENCH_LEARNING_ON_CPU=1 python -m bench.run_all learning_llm
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from bench import BenchmarkSkipped
from bench.bench_learning import COMPETENCIES, ON_CPU, ROOT, WARM_START, seed_config, test_instances
from bench.bench_real import WRITER, data_key
from bench.bench_real_llm import (
    READER,
    STUDENT,
    answer_methods,
    method_table,
    recorded_methods,
    student_adapters,
    with_student_mean,
)

PER_INSTANCE = int(os.environ.get("MEMALPHA_BENCH_LEARNING_LLM_PER_INSTANCE", "2"))
SAMPLE_SEED = 0
RUN_ROOT = ROOT / "runs" / "bench-learning-llm"
RESULTS = ROOT / "bench" / "results" / "learning_llm.json"
"""The report of record, whose rows a machine without the caches reuses (`bench_real_llm.recorded_methods`)."""
ADAPTERS = {"shipped_writer": WRITER, "warm_start": WARM_START}
ALL_METHODS = ("oracle_evidence", "no_memory", "rag", "shipped_writer", "warm_start", "rule_writer", "llm_writer_0.5b",
               "long_context", "llm_writer_1.5b")
"""In order of what a stopped run should have first: the ceiling and the bar, the writers of record, the rest."""
METHODS = tuple(os.environ.get("MEMALPHA_BENCH_LEARNING_LLM_METHODS", " ".join(ALL_METHODS)).split())


def sample(instances, per_instance: int = PER_INSTANCE, seed: int = SAMPLE_SEED) -> set[tuple[str, str]]:
    """(instance id, question id) of `per_instance` questions drawn from each instance."""
    rng = random.Random(seed)
    chosen = set()
    for inst in instances:
        ids = sorted(q.question_id for q in inst.questions)
        chosen.update((inst.instance_id, qid) for qid in rng.sample(ids, min(per_instance, len(ids))))
    return chosen


def run() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available() and not ON_CPU:
        raise BenchmarkSkipped("about 2 hours on a CPU (two LLM writers, every method read by an LLM); "
                               "set MEMALPHA_BENCH_LEARNING_ON_CPU=1 to run it anyway")
    started = time.perf_counter()
    config = seed_config(0)
    instances = test_instances()
    keep = sample(instances)
    students = student_adapters()
    spec = {"reader": READER, "per_instance": PER_INSTANCE, "seed": SAMPLE_SEED, "data": data_key(instances)}
    report, _ = answer_methods(config, instances, keep, RUN_ROOT / "memories" / f"synthetic-{data_key(instances)}",
                               METHODS + tuple(students), {**ADAPTERS, **students},
                               f"{READER}-sample{PER_INSTANCE}s{SAMPLE_SEED}", RUN_ROOT / "llama-state",
                               group="competency", policies={name: STUDENT for name in students},
                               recorded=recorded_methods(RESULTS, spec))
    if with_student_mean(report) and "shipped_writer" in report["methods"]:
        m = report["methods"]
        report["targets"] = {"trained 0.5B >= the 135M writer of record": m["trained_0.5b"]["qa"] >= m["shipped_writer"]["qa"]}
    return {"reader": READER, "spec": spec, "sample": {"per_instance": PER_INSTANCE, "seed": SAMPLE_SEED, "questions": len(keep),
                                         "of": sum(len(i.questions) for i in instances)},
            "instances": len(instances), "chunks": sum(len(i.chunks) for i in instances),
            **report, "not_run": [m for m in ALL_METHODS if m not in report["methods"]],
            "minutes_this_run": round((time.perf_counter() - started) / 60, 1)}


def to_markdown(results: dict[str, Any]) -> str:
    s = results["sample"]
    lines = ["# Benchmark: learning, LLM reader", "",
             f"Reader: `{results['reader']}` on llama.cpp, greedy. The learning bench's {results['instances']} held-out "
             f"synthetic conversations ({results['chunks']} chunks of 512 tokens), written whole; {s['questions']} of their "
             f"{s['of']} questions answered, {s['per_instance']} drawn from each conversation with seed {s['seed']}. "
             "BM25 top-20 retrieval, 1,024-token reader budget. qa: substring match (a conflict answer naming the "
             "superseded value is wrong); f1: token F1. `shipped_writer` is the trained writer of record. "
             f"{results['minutes_this_run']} min this run (cached builds and answers are read, not redone).", ""]
    lines += method_table(results, COMPETENCIES)
    if "trained_0.5b" in results["methods"]:
        lines += ["", "`trained_0.5b` is the mean of its seeds."]
    if results.get("targets"):
        lines += ["", "| target | met |", "|---|---|"]
        lines += [f"| {name} | {'met' if met else 'missed'} |" for name, met in results["targets"].items()]
    return "\n".join(lines) + "\n"
