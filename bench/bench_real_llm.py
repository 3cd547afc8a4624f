"""The LLM-reader section of the report of record on real conversations (bench/results/real_llm.md): the
7 LoCoMo test conversations of `bench_real`, read by a packaged LLM on llama.cpp instead of the 135M policy.

A full LLM-reader pass costs too much here (1,078 questions x every method at ~5 s a 1,024-token question
for the 0.5B, ~11 s for the 1.5B), so the questions are a fixed sample stratified by conversation and
LoCoMo category: `PER_CELL` questions of every (conversation, category) cell, drawn with seed `SAMPLE_SEED`
(a cell with fewer gives all). Every method builds from whole conversations as in `bench_real` (same build
cache, so neither report writes a memory twice); only the answering is restricted to the sample.

Methods: the writers that need no GRPO run of this report (the shipped 135M writer, its dialogue warm start,
the rule writer), the prompted LLM writers (`llm_writer_0.5b`, `llm_writer_1.5b`, grammar-constrained on
llama.cpp), BM25 RAG top-2, long context, no memory and the reader's ceiling `oracle_evidence`; and, once
`bench_real` has trained them (MEMALPHA_BENCH_REAL_POLICY=qwen2.5-coder-0.5b, with this run's
MEMALPHA_BENCH_REAL_SEEDS and _STEPS), the 0.5B writer's warm start and seeds, their mean and its targets; qa
(substring match) and LoCoMo's token F1 by category, memory tokens, minutes, and each method minus RAG
paired by question with a 95% bootstrap interval. Resumable: each method's build and answers are cached,
and the methods run in `METHODS` order, so a stopped run loses at most the method it was on. On a machine
without those caches a row is taken from the report of record (bench/results/real_llm.json, which keeps each
row's build key and, for rows made since it does, its questions' scores) when the reader, the sample, the
data and the writer's adapter weights are the same; a recorded row without scores is made again only when a
new row must be paired with it (`reusable`), and the record's rows this run does not name are carried.

Needs the reader's llama.cpp server and, for the LLM writers, theirs (`bash infra/servers.sh start-llama
NAME`; this benchmark starts and stops the ones it needs itself).

    MEMALPHA_BENCH_REAL_ON_CPU=1 python -m bench.run_all real_llm
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from bench import BenchmarkSkipped
from bench.bench_real import (
    DIALOGUE_WARM_START,
    LOCOMO_CATEGORIES,
    MEMORIES,
    ON_CPU,
    SEEDS,
    STEPS,
    WRITER,
    build,
    data_key,
    method_key,
    paired_difference,
    prepare_data,
    run_root,
    seed_config,
    seeds_mean,
    summarize_rows,
    test_sets,
)

STUDENT = "qwen2.5-coder-0.5b"
"""The policy trained by `bench_real` with MEMALPHA_BENCH_REAL_POLICY: its warm start and seeds join the report
when they exist (`warm_start_0.5b`, `trained_0.5b_seed<N>`, their mean `trained_0.5b`)."""
READER = os.environ.get("MEMALPHA_BENCH_LLM_READER", "qwen2.5-coder-1.5b")
PER_CELL = int(os.environ.get("MEMALPHA_BENCH_LLM_PER_CELL", "4"))
SAMPLE_SEED = 0
ADAPTERS = {"shipped_writer": WRITER, "warm_start_dialogue": DIALOGUE_WARM_START}
ALL_METHODS = ("oracle_evidence", "no_memory", "rag", "llm_writer_0.5b", "shipped_writer", "llm_writer_1.5b", "rule_writer",
               "long_context", "warm_start_dialogue")
"""In order of what a stopped run should have first: the ceiling and the bar, then the writers."""
METHODS = tuple(os.environ.get("MEMALPHA_BENCH_LLM_METHODS", " ".join(ALL_METHODS)).split())
"""This run's methods (the report of record's other rows are carried; methods in neither are listed as not run)."""
LLM_WRITER_SERVERS = {"llm_writer_0.5b": "qwen2.5-coder-0.5b", "llm_writer_1.5b": "qwen2.5-coder-1.5b"}
SEED_PREFIX = "trained_0.5b_seed"
RESULTS = Path(__file__).resolve().parent / "results" / "real_llm.json"
"""The report of record: its rows are reused where this machine has no cache of them (`recorded_methods`)."""


def sample(instances, per_cell: int = PER_CELL, seed: int = SAMPLE_SEED) -> set[tuple[str, str]]:
    """(instance id, question id) of `per_cell` questions drawn from each (conversation, category) cell."""
    rng = random.Random(seed)
    chosen = set()
    for inst in instances:
        for category in LOCOMO_CATEGORIES:
            cell = sorted(q.question_id for q in inst.questions if q.question_type == category)
            chosen.update((inst.instance_id, qid) for qid in rng.sample(cell, min(per_cell, len(cell))))
    return chosen


def restricted(instances, built, keep: set[tuple[str, str]]):
    """The instances and builds with only the kept questions (and their contexts)."""
    from dataclasses import replace

    out_instances, out_built = [], []
    for inst, b in zip(instances, built):
        pairs = [(q, c) for q, c in zip(inst.questions, b.contexts) if (inst.instance_id, q.question_id) in keep]
        out_instances.append(replace(inst, questions=[q for q, _ in pairs]))
        out_built.append(replace(b, contexts=[c for _, c in pairs]))
    return out_instances, out_built


def build_of(name: str, adapters: dict[str, Path]) -> tuple[str, Path | None]:
    """The evaluation method and adapter a report's method `name` builds with."""
    return ("policy", adapters[name]) if name in adapters else (name, None)


def cache_file(folder: Path, tag: str, key: str) -> Path:
    """Where a method's sampled answers are cached: `folder/tag/<build key>.json`."""
    return folder / tag / f"{key}.json"


def answered(config, instances, name: str, keep, folder: Path, adapters: dict[str, Path], tag: str,
             policies: dict[str, str]) -> Path:
    """The sampled questions of one method answered by READER; the rows' cache file (`folder/tag/<key>.json`).
    A method in `policies` writes with that policy (its adapter's base); sizes are counted as for the others."""
    from bench.run_all import write_atomically
    from memalpha.data.chunking import TokenCounts
    from memalpha.evaluation.answering import LazyReader, answer_built, policy_tokenizer
    from memalpha.rewards.qa import token_f1

    method, adapter = build_of(name, adapters)
    path = cache_file(folder, tag, method_key(method, adapter))
    if path.is_file():
        return path
    print(f"{name}: building", flush=True)
    writer = config if name not in policies else config.model_copy(
        update={"model": config.model.model_copy(update={"policy": policies[name]})})
    built, build_s = build(writer, instances, method, adapter, folder, counting=config)
    tokenizer, _ = policy_tokenizer(config)
    input_tokens = [sum(TokenCounts(tokenizer).counts(i.chunks)) for i in instances]
    some, some_built = restricted(instances, built, keep)
    reader_config = config.model_copy(update={"model": config.model.model_copy(update={"reader": READER})})
    started = time.perf_counter()
    print(f"{name}: answering {len(keep)} sampled questions with {READER}", flush=True)
    rows, instance_rows, _ = answer_built(method, some, 0, some_built, build_s, LazyReader(reader_config).get(),
                                          reader_config, input_tokens, say=partial(print, flush=True))
    golds = {(i.instance_id, q.question_id): q.answers for i in some for q in i.questions}
    for row in rows:
        row["f1"] = token_f1(row["prediction"], golds[(row["instance_id"], row["question_id"])])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"rows": rows, "instances": instance_rows, "build_seconds": build_s,
                                       "answer_seconds": time.perf_counter() - started}))
    return path


def recorded_methods(path: Path, spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The methods of the report of record at `path` (bench/results/<name>.json) made under `spec` (reader, sample,
    data digest): {name: {"key", "summary", "scores", "minus_rag"}}, "scores" None where the report holds none
    (rows reported before the reports kept them)."""
    if not path.is_file():
        return {}
    results = json.loads(path.read_text()).get("results", {})
    if results.get("spec") != spec:
        return {}
    return {name: {"key": key, "summary": results["methods"][name], "minus_rag": results.get("minus_rag", {}).get(name),
                   "scores": _decoded(results.get("scores", {}).get(name))}
            for name, key in results.get("keys", {}).items() if name in results["methods"]}


def _encoded(scores: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    nested: dict[str, dict[str, float]] = {}
    for (instance, question), score in sorted(scores.items()):
        nested.setdefault(instance, {})[question] = score
    return nested


def _decoded(scores: dict[str, dict[str, float]] | None) -> dict[tuple[str, str], float] | None:
    if scores is None:
        return None
    return {(instance, question): score for instance, by_question in scores.items() for question, score in by_question.items()}


def reusable(names: list[str], made: set[str], recorded: dict[str, dict[str, Any]]) -> set[str]:
    """The recorded rows of `names` to take as they are, given the rows `made` here (built, or cached on this
    machine): not those without scores that a made row is paired with by question, RAG for a row's minus-RAG
    interval and every row for a trained seed's intervals (`SEED_PREFIX`)."""
    usable = {n for n in names if n not in made}
    if any(n.startswith(SEED_PREFIX) for n in made):
        usable = {n for n in usable if recorded[n]["scores"] is not None}
    needs_rag = any(n != "rag" and (n not in usable or recorded[n]["minus_rag"] is None) for n in names)
    if needs_rag and "rag" in usable and recorded["rag"]["scores"] is None:
        usable.discard("rag")
    return usable


def answer_methods(config, instances, keep, folder: Path, methods: tuple[str, ...], adapters: dict[str, Path],
                   tag: str, state: Path, group: str = "question_type", policies: dict[str, str] | None = None,
                   recorded: dict[str, dict[str, Any]] | None = None) -> tuple[dict[str, Any], dict[str, dict]]:
    """Every method of `methods`, in order, built and its sampled questions answered by READER, the llama.cpp
    servers it needs started (and stopped) here unless already up. On a machine without a method's cache its row
    is taken from `recorded` (`recorded_methods`) when its build key is the same (`reusable` says which rows must
    be made again to pair with), and the record's other rows are carried as they are. Returns the report
    ({"methods": {name: summary by `group`}, "minus_rag": {name: paired difference}, "keys", "scores" by
    instance and question, "from_record"}) and each method's {(instance, question): score} (those known)."""
    from bench.llama_server import local_llama_server
    from memalpha.models.llamacpp import check_server

    recorded = recorded or {}
    keys = {name: method_key(*build_of(name, adapters)) for name in methods}
    carried = [name for name in recorded if name not in methods]  # rows of the record this run does not name
    keys.update({name: recorded[name]["key"] for name in carried})
    names = [*methods, *carried]
    cached = {name for name in methods if cache_file(folder, tag, keys[name]).is_file()}
    made = {name for name in names if name in cached or recorded.get(name, {}).get("key") != keys[name]}
    usable = reusable(names, made, recorded)
    paths, reused = {}, {}
    with ExitStack() as servers:
        def serve(name: str) -> None:  # a server already up (ours or the user's) is used as it is
            try:
                check_server(name)
            except Exception:
                servers.enter_context(local_llama_server(state / name, name, offset=0))

        for name in names:
            if name in cached:
                paths[name] = cache_file(folder, tag, keys[name])
            elif name in usable:
                reused[name] = recorded[name]
            else:
                serve(READER)
                if name in LLM_WRITER_SERVERS:
                    serve(LLM_WRITER_SERVERS[name])
                paths[name] = answered(config, instances, name, keep, folder, adapters, tag, policies or {})
    kept = {name: json.loads(path.read_text()) for name, path in paths.items()}
    summaries = {name: summarize_rows(kept[name], group) if name in kept else reused[name]["summary"] for name in names}
    scores = {name: {(r["instance_id"], r["question_id"]): r["score"] for r in k["rows"]} for name, k in kept.items()}
    scores.update({name: r["scores"] for name, r in reused.items() if r["scores"] is not None})
    minus_rag = {}
    for name in names:
        if name == "rag":
            continue
        if name in scores and "rag" in scores:
            minus_rag[name] = paired_difference([scores[name]], scores["rag"])
        elif name in reused and reused[name]["minus_rag"] is not None:  # `reusable` kept RAG as recorded
            minus_rag[name] = reused[name]["minus_rag"]
    return {"methods": summaries, "minus_rag": minus_rag, "keys": keys,
            "scores": {name: _encoded(s) for name, s in scores.items()}, "from_record": sorted(reused)}, scores


def run() -> dict[str, Any]:
    import torch

    from memalpha.config import DEFAULT_POLICY

    if not torch.cuda.is_available() and not ON_CPU:
        raise BenchmarkSkipped("hours on a CPU (two LLM writers over 7 whole LoCoMo conversations, every method read "
                               "by an LLM); set MEMALPHA_BENCH_REAL_ON_CPU=1 to run it anyway")
    started = time.perf_counter()
    data = prepare_data()
    config = seed_config(0, data)  # the recipe's, whatever MEMALPHA_BENCH_REAL_POLICY says: it counts every size
    config = config.model_copy(update={"model": config.model.model_copy(update={"policy": DEFAULT_POLICY})})
    instances = test_sets(data)["locomo"]
    keep = sample(instances)
    students = student_adapters()
    spec = {"reader": READER, "per_cell": PER_CELL, "seed": SAMPLE_SEED, "data": data_key(instances)}
    recorded = recorded_methods(RESULTS, spec)
    report, scores = answer_methods(
        config, instances, keep, MEMORIES / f"locomo-{data_key(instances)}", METHODS + tuple(students),
        {**ADAPTERS, **students}, f"{READER}-sample{PER_CELL}s{SAMPLE_SEED}", MEMORIES.parent / "llama-state",
        policies={name: STUDENT for name in students}, recorded=recorded)
    seeds = with_student_mean(report)
    if seeds and all(s in scores for s in seeds):
        report["trained_minus"] = {name: paired_difference([scores[s] for s in seeds], theirs)
                                   for name, theirs in scores.items() if name not in seeds}
        report["targets"] = targets(report)
    return {"reader": READER, "spec": spec, "sample": {"per_cell": PER_CELL, "seed": SAMPLE_SEED, "questions": len(keep),
                                                       "of": sum(len(i.questions) for i in instances)},
            "conversations": len(instances), "chunks": sum(len(i.chunks) for i in instances),
            **report, "not_run": [m for m in ALL_METHODS if m not in report["methods"]],
            "minutes_this_run": round((time.perf_counter() - started) / 60, 1)}


def with_student_mean(report: dict[str, Any]) -> list[str]:
    """The 0.5B's seeds among the report's methods; their mean put first as `trained_0.5b` when there are any."""
    seeds = [name for name in report["methods"] if name.startswith(SEED_PREFIX)]
    if seeds:
        report["methods"] = {"trained_0.5b": seeds_mean([report["methods"][s] for s in seeds]), **report["methods"]}
    return seeds


def student_adapters() -> dict[str, Path]:
    """The 0.5B writer's warm start and trained seeds (`bench_real` with MEMALPHA_BENCH_REAL_POLICY=STUDENT), those
    that exist: {method name: adapter folder}."""
    from memalpha.training.checkpoint import SFT_DIR, checkpoint_dir, policy_adapter

    root = run_root(STUDENT)
    found = {"warm_start_0.5b": root / "warm-start" / SFT_DIR,
             **{f"{SEED_PREFIX}{s}": policy_adapter(checkpoint_dir(root / f"seed{s}", STEPS)) for s in SEEDS}}
    return {name: path for name, path in found.items() if (path / "adapter_model.safetensors").is_file()}


def targets(report: dict[str, Any]) -> dict[str, bool]:
    """The 0.5B writer's targets under the LLM reader (those whose methods ran)."""
    m, minus = report["methods"], report["trained_minus"]
    t = m["trained_0.5b"]
    above = {name: minus[name]["ci95"][0] > 0 for name in minus}
    checks = {
        "trained 0.5B > BM25 RAG top-2 with <= 25% of its memory tokens": lambda: t["qa"] > m["rag"]["qa"]
        and t["memory_tokens"] <= 0.25 * m["rag"]["memory_tokens"],
        "trained 0.5B > its warm start (paired 95% interval above 0)": lambda: above["warm_start_0.5b"],
        "trained 0.5B > untrained 0.5B llm_writer (paired 95% interval above 0)": lambda: above["llm_writer_0.5b"],
        "trained 0.5B F1 >= 1.5x the untrained 0.5B's": lambda: t["f1"] >= 1.5 * m["llm_writer_0.5b"]["f1"],
        "trained 0.5B >= untrained 1.5B llm_writer": lambda: t["qa"] >= m["llm_writer_1.5b"]["qa"],
        "ships: trained 0.5B > the shipped 135M writer (paired 95% interval above 0)": lambda: above["shipped_writer"],
    }
    met = {}
    for name, check in checks.items():
        try:
            met[name] = bool(check())
        except KeyError:  # a method it needs is not run yet
            continue
    return met


def method_table(results: dict[str, Any], groups: tuple[str, ...]) -> list[str]:
    """The report's table: a row a method, qa by each of `groups` found, memory tokens, minutes, minus RAG."""
    cats = [c for c in groups if any(c in m["by_category"] for m in results["methods"].values())]
    lines = ["| method | qa | f1 | " + " | ".join(f"{c} qa" for c in cats) + " | memory tokens | minutes | minus RAG, 95% interval |",
             "|---|---|---|" + "---|" * len(cats) + "---|---|---|"]
    for name, m in results["methods"].items():
        d = results["minus_rag"].get(name)
        interval = f"{d['diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]" if d else ""
        lines.append(f"| {name} | {m['qa']:.3f} | {m['f1']:.3f} | "
                     + "".join(f"{m['by_category'][c]['qa']:.3f} | " if c in m["by_category"] else "- | " for c in cats)
                     + f"{m['memory_tokens']:.0f} | {m['minutes']} | {interval} |")
    if results.get("from_record"):
        lines += ["", f"From the report of record, not redone here (same reader, sample and data; same writer weights): "
                  f"{', '.join(results['from_record'])}."]
    if results.get("not_run"):
        lines += ["", f"Not run yet: {', '.join(results['not_run'])} (the report resumes: finished methods are cached)."]
    return lines


def to_markdown(results: dict[str, Any]) -> str:
    s = results["sample"]
    lines = ["# Benchmark: real conversations, LLM reader", "",
             f"Reader: `{results['reader']}` on llama.cpp, greedy. LoCoMo: the {results['conversations']} test conversations "
             f"({results['chunks']} chunks of 512 tokens), written whole; {s['questions']} of their {s['of']} questions "
             f"answered, {s['per_cell']} drawn from each (conversation, category) cell with seed {s['seed']}. BM25 top-20 "
             "retrieval, 1,024-token reader budget. qa: substring match; f1: LoCoMo's token F1. "
             f"{results['minutes_this_run']} min this run (cached builds and answers are read, not redone).", ""]
    lines += method_table(results, LOCOMO_CATEGORIES)
    if results.get("trained_minus"):
        lines += ["", "`trained_0.5b` is the mean of its seeds. Trained 0.5B minus each method, paired by question (mean "
                  "over seeds per question; 95% bootstrap interval): " + "; ".join(
                      f"{name} {d['diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"
                      for name, d in results["trained_minus"].items()),
                  "", "| target | met |", "|---|---|"]
        lines += [f"| {name} | {'met' if met else 'missed'} |" for name, met in results["targets"].items()]
    return "\n".join(lines) + "\n"
