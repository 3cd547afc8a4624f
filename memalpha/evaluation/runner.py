"""Run the compared methods on a dataset split: build contexts, have the one configured reader answer
every question, score each answer with memalpha.rewards.qa.score_answer, and record sizes and timings
(memalpha.evaluation.answering), in this process or on Ray workers (memalpha.evaluation.cluster)."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Sequence

import polars as pl

from memalpha.config import EVAL_METHODS, RunConfig
from memalpha.data.chunking import TokenCounts
from memalpha.data.io import read_dataset
from memalpha.data.schema import Instance
from memalpha.errors import UserError
from memalpha.evaluation.answering import LazyReader, policy_tokenizer, run_method, token_counter
from memalpha.evaluation.cluster import ray_session, run_method_on_ray
from memalpha.evaluation.methods import EvalEnv, make_method
from memalpha.evaluation.results import INSTANCE_COLUMNS, QUESTION_COLUMNS, EvalResult

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


def load_instances(config: RunConfig, data_dir: str | Path | None = None) -> tuple[list[Instance], str]:
    """The configured split of the dataset (`all`: every instance) and a sentence saying what was
    covered; with `eval.max_instances` (0 = all), that many instances taken round-robin over
    competencies (in dataset order within each), so every competency is shown."""
    path = Path(data_dir or config.eval.data_path)
    instances = read_dataset(path)
    split = config.eval.split
    chosen = instances if split == "all" else [inst for inst in instances if inst.split == split]
    if not chosen:
        found = sorted({inst.split or "(none)" for inst in instances})
        raise UserError(f"{path}: no instance in split {split!r} (splits present: {', '.join(found)}); set eval.split")
    limit = config.eval.max_instances
    picked = stratified(chosen, limit) if limit else chosen
    where = "the whole dataset (every split)" if split == "all" else f"the {split} split"
    covered = f"{len(picked)} of {len(chosen)} instances of {where}"
    if len(picked) < len(chosen):
        covered += (f", {limit} taken round-robin over competencies (eval.max_instances; "
                    "--split all --max-instances 0 evaluates every instance)")
    return picked, covered


def stratified(instances: list[Instance], limit: int) -> list[Instance]:
    """`limit` instances, alternating over competencies (in order of first appearance), each in dataset order."""
    groups: dict[str, list[Instance]] = {}
    for inst in instances:
        groups.setdefault(inst.competency, []).append(inst)
    picked: list[Instance] = []
    for rank in range(max(len(group) for group in groups.values())):
        picked.extend(group[rank] for group in groups.values() if rank < len(group))
    return picked[:limit]


def _check_methods(methods: Sequence[str]) -> list[str]:
    unknown = [m for m in methods if m not in EVAL_METHODS]
    if unknown:
        raise UserError(f"unknown evaluation method(s) {unknown}; choose from {', '.join(EVAL_METHODS)}")
    if not methods:
        raise UserError("no evaluation method selected")
    return list(dict.fromkeys(methods))


def _run_one(name: str, env: EvalEnv, model_uri, instances: list[Instance], seeds: list[int], reader: LazyReader,
             config: RunConfig, input_tokens: list[int], out: tuple[list, list, list], say: Progress) -> float:
    """Run one method for each of its seeds (on Ray workers when `eval.ray_workers`), appending its rows to
    `out`; returns its seconds."""
    started = time.perf_counter()
    method = make_method(name, env, model_uri)
    question_rows, instance_rows, memories = out
    try:
        for seed in seeds if method.stochastic else seeds[:1]:
            if config.eval.ray_workers:
                q_rows, i_rows, built_memories = run_method_on_ray(config, name, model_uri, instances, seed, input_tokens)
            else:
                q_rows, i_rows, built_memories = run_method(method, instances, seed, reader.get(), config, input_tokens, say)
            question_rows.extend(q_rows)
            instance_rows.extend(i_rows)
            memories.extend(built_memories)
            score = sum(r["score"] for r in q_rows) / len(q_rows) if q_rows else float("nan")
            memory = sum(r["memory_tokens"] for r in i_rows) / len(i_rows) if i_rows else 0.0
            say(f"  {name:<12} seed {seed}: mean question score {score:.3f}, memory {memory:,.0f} tokens, "
                f"{time.perf_counter() - started:.1f} s")
    finally:
        method.close()
    return time.perf_counter() - started


def evaluate(
    config: RunConfig,
    data_dir: str | Path | None = None,
    methods: Sequence[str] | None = None,
    model_uri: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    *,
    instances: list[Instance] | None = None,
    progress: Progress | None = print,
) -> EvalResult:
    """Evaluate `methods` (default `eval.methods`) on the configured split of `data_dir` (default
    `eval.data_path`), or on `instances` when given.

    `model_uri` is the trained policy for the `policy` method: an adapter folder (a checkpoint, or the
    adapter inside a downloaded registered model; MLflow URIs are resolved by the tasks layer). Without
    it the `policy` method is skipped and the skip is recorded in `info["skipped"]`. Stochastic methods
    (policy methods with `eval.temperature > 0`) run once per seed; the others run once.
    """
    method_names = _check_methods(methods if methods is not None else config.eval.methods)
    seeds = list(seeds if seeds is not None else config.eval.seeds)
    if not seeds:
        raise UserError("at least one seed is needed")
    say = progress or (lambda _message: None)
    skipped: dict[str, str] = {}
    if "policy" in method_names and model_uri is None:
        skipped["policy"] = "no model given (--model)"
        method_names.remove("policy")
    if "sft" in method_names and not config.eval.sft_adapter:
        skipped["sft"] = "no SFT adapter configured (eval.sft_adapter)"
        method_names.remove("sft")
    for name, why in skipped.items():
        say(f"skipping {name}: {why}")
    data_source, covered = "instances given by the caller", f"{len(instances or [])} instances given by the caller"
    if instances is None:
        data_source = str(data_dir or config.eval.data_path)
        instances, covered = load_instances(config, data_dir)
    say(f"evaluating {covered}")
    tokenizer, counter_name = policy_tokenizer(config)
    batch_counts = TokenCounts(tokenizer)
    input_tokens = [sum(batch_counts.counts(inst.chunks)) if inst.chunks else 0 for inst in instances]
    env = EvalEnv(config, token_counter(tokenizer), progress=progress)
    reader = LazyReader(config)
    question_rows: list[dict[str, Any]] = []
    instance_rows: list[dict[str, Any]] = []
    memories: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    say(f"evaluating {len(instances)} instances ({sum(len(i.questions) for i in instances)} questions, "
        f"{sum(input_tokens):,} input tokens) with methods {', '.join(method_names) or '(none)'}")
    with ray_session(config.eval.ray_address, config.eval.ray_workers) if config.eval.ray_workers else nullcontext():
        for name in method_names:
            timings[name] = _run_one(name, env, model_uri, instances, seeds, reader, config, input_tokens,
                                     (question_rows, instance_rows, memories), say)
    info = {
        "data": data_source,
        "split": config.eval.split,
        "instances": len(instances),
        "covered": covered,
        "methods": method_names,
        "skipped": skipped,
        "seeds": seeds,
        "decoding": "greedy" if config.eval.temperature == 0 else f"sampling (temperature {config.eval.temperature}, top_p {config.eval.top_p})",
        "reader": config.model.reader,
        "model": str(model_uri) if model_uri is not None else None,
        "policy": config.model.policy,
        "retrieval": f"{config.retrieval.method}, top_k {config.retrieval.top_k}, reader budget {config.memory.reader_view_tokens} tokens",
        "token_counter": counter_name,
        "qa_metric": config.reward.qa_metric,
        "method_seconds": timings,
        "workers": (f"{config.eval.ray_workers} Ray workers ({config.eval.ray_address or 'local, 127.0.0.1'})"
                    if config.eval.ray_workers else "this process"),
    }
    return EvalResult(
        questions=pl.DataFrame(question_rows, schema=QUESTION_COLUMNS),
        instances=pl.DataFrame(instance_rows, schema=INSTANCE_COLUMNS),
        memories=memories,
        info=info,
    )
