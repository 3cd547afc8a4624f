"""Learning benchmark of record: does the trained writer remember better than its warm start, RAG and long
context, for a reader that has to read?

The recipe (`RunConfig()`) on its own synthetic training data (`TRAIN_INSTANCES` instances of accurate
retrieval and conflict resolution, 4 chunks of 512 tokens, seed `TRAIN_SEED`): `SEEDS` step-level GRPO runs
of `STEPS` steps, all from one warm start: `WARM_START` (by default the shipped adapters/warm-start) when its
hash is the recipe's, else trained by the recipe.
Held-out test: the first `TEST_INSTANCES` instances generated with seed `TEST_SEED` (48: 288 questions),
greedy, the same retrieval budget for every method. Each method builds its contexts once and each of
`READERS` answers from them:
- `evidence`: answers whenever a gold answer occurs in the context, an upper bound that favours raw text;
- `local`: the frozen base policy (SmolLM2-135M-Instruct), greedy: a reader that has to read.
Methods: the warm start, each seed's adapter after the last step (and their mean, `qa` with `qa_seed_std`,
std over seeds, ddof 1), the rule writer, BM25 RAG top-2, long context and no memory.

Runs live in `RUN_ROOT/seed<N>` and resume from their checkpoints; a finished run is not loaded again.
Each test result is kept per reader beside its run (`test-<instances>/<reader>/<name>.json`), so an
interrupted job continues where it stopped and a new reader only adds its own answers. About 2 hours on a
2-core CPU (3 seeds x 20 steps of ~1 min, 8 builds of ~4 min, the local reader ~1 min a method), so on a
CPU it is skipped unless `MEMALPHA_BENCH_LEARNING_ON_CPU=1`. Writes learning.json, learning.md and
learning.png (the GRPO curve per seed, the final comparison under each reader). With
`MEMALPHA_BENCH_LEARNING_SHIP=1` the seed with the best validation QA (the lowest seed on a tie) is shipped
as adapters/writer, its record holding its test results under each reader.

    MEMALPHA_BENCH_LEARNING_ON_CPU=1 python -m bench.run_all learning
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench import BenchmarkSkipped
from memalpha.rewards.qa import CONFLICT_MEMORY_STATES

ROOT = Path(__file__).resolve().parents[1]
SEEDS = tuple(int(s) for s in os.environ.get("MEMALPHA_BENCH_LEARNING_SEEDS", "0 1 2").split())
STEPS = int(os.environ.get("MEMALPHA_BENCH_LEARNING_STEPS", "20"))
TEST_INSTANCES = int(os.environ.get("MEMALPHA_BENCH_LEARNING_TEST_INSTANCES", "48"))
WARM_START = Path(os.environ.get("MEMALPHA_BENCH_LEARNING_WARM_START", ROOT / "adapters" / "warm-start"))
ON_CPU = os.environ.get("MEMALPHA_BENCH_LEARNING_ON_CPU") == "1"
READERS = tuple(os.environ.get("MEMALPHA_BENCH_LEARNING_READERS", "evidence local").split())
SHIP = os.environ.get("MEMALPHA_BENCH_LEARNING_SHIP") == "1"
"""Ship the seed with the best validation QA as adapters/writer (the trained writer of record)."""
EXTRA_OVERRIDES = os.environ.get("MEMALPHA_BENCH_LEARNING_OVERRIDES", "").split()
"""Space-separated `key=value` overrides applied after the benchmark's own (a setting to compare)."""
CONFIG: Path | None = None
"""A config file under the overrides (None: the recipe, `RunConfig()`)."""
CHUNK_TOKENS = 512
TEST_CHUNKS = 4
TEST_SEED = 7
TRAIN_SEED = 0
TRAIN_INSTANCES = 256
COMPETENCIES = ("accurate_retrieval", "conflict_resolution")
TRAIN_DATA = ROOT / "data" / "bench-learning"
RUN_ROOT = ROOT / "runs" / "bench-learning"
PLOT = ROOT / "bench" / "results" / "learning.png"
CHECKPOINT_EVERY = 10
BASELINES = ("rule_writer", "rag", "long_context", "no_memory")
READER_NOTES = {
    "evidence": "evidence reader: answers whenever a gold answer occurs in the context (an upper bound that favours raw text)",
    "local": "local reader: the frozen base policy (SmolLM2-135M-Instruct) answers greedily from the context",
}


def synth_config(instances: int, seed: int):
    """The generator settings of the training and the test conversations, which differ only in count and seed."""
    from memalpha.data.synth import SynthConfig

    return SynthConfig(instances=instances, chunks_per_instance=(TEST_CHUNKS,), chunk_tokens=CHUNK_TOKENS,
                       competencies=COMPETENCIES, seed=seed)


def training_data() -> Path:
    """TRAIN_DATA, generated and prepared (validated, split) unless it already holds this generator config."""
    from memalpha.config import load_config
    from memalpha.data.prep import synthesize
    from memalpha.data.synth import config_dict
    from memalpha.models.loading import default_model_dir, load_tokenizer

    cfg = synth_config(TRAIN_INSTANCES, TRAIN_SEED)
    manifest = TRAIN_DATA / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("synth") == config_dict(cfg):
        return TRAIN_DATA
    tokenizer = str(default_model_dir())
    synthesize(TRAIN_DATA, cfg, tokenizer=load_tokenizer(tokenizer), tokenizer_name=tokenizer,
               data_cfg=load_config(None).data, overwrite=True)
    return TRAIN_DATA


def test_instances(count: int = TEST_INSTANCES) -> list:
    """The first `count` held-out instances, chunked with the default policy's tokenizer like the training
    data, so that the test set is the same text whichever policy is trained."""
    from memalpha.data.synth import generate
    from memalpha.models.loading import default_model_dir, load_tokenizer

    return generate(synth_config(count, TEST_SEED), load_tokenizer(str(default_model_dir())))


def seed_overrides(seed: int) -> list[str]:
    """One GRPO seed's run: the recipe on the benchmark's data, validated only after its last step."""
    return [f"data.train_path={TRAIN_DATA}", "eval.max_instances=8", "time_budget_minutes=null", *EXTRA_OVERRIDES,
            f"output_dir={RUN_ROOT / f'seed{seed}'}", f"grpo.seed={seed}", f"grpo.steps={STEPS}",
            f"grpo.eval_every={STEPS}", f"grpo.checkpoint_every={CHECKPOINT_EVERY}"]


def seed_config(seed: int):
    from memalpha.config import load_config

    return load_config(CONFIG, seed_overrides(seed))


def compare(config, instances, method: str, readers: tuple[str, ...], model: Path | None = None) -> dict[str, dict[str, Any]]:
    """Greedy test of one method: its contexts built once, answered by each reader; {reader: result}."""
    from memalpha.data.chunking import TokenCounts
    from memalpha.evaluation.methods import EvalEnv, make_method
    from memalpha.evaluation.answering import LazyReader, answer_built, policy_tokenizer, token_counter
    from memalpha.rewards.qa import states_superseded

    tokenizer, _ = policy_tokenizer(config)
    input_tokens = [sum(TokenCounts(tokenizer).counts(inst.chunks)) for inst in instances]
    built_method = make_method(method, EvalEnv(config, token_counter(tokenizer), progress=None), model)
    try:
        started = time.perf_counter()
        built = built_method.build(instances, 0)
        build_s = time.perf_counter() - started
    finally:
        built_method.close()
    superseded = {q.question_id: (q.answers, q.superseded_answers) for inst in instances for q in inst.questions}
    results = {}
    for name in readers:
        reader_config = config.model_copy(update={"model": config.model.model_copy(update={"reader": name})})
        started = time.perf_counter()
        rows, instance_rows, memories = answer_built(method, instances, 0, built, build_s, LazyReader(reader_config).get(),
                                                     reader_config, input_tokens)
        stale = sum(states_superseded(r["prediction"], *superseded[r["question_id"]])
                    for r in rows if superseded[r["question_id"]][1])
        result = {
            "qa": statistics.mean(r["score"] for r in rows),
            "qa_by_competency": {c: statistics.mean(r["score"] for r in rows if r["competency"] == c) for c in COMPETENCIES},
            "memory_tokens": statistics.mean(r["memory_tokens"] for r in instance_rows),
            "answers_lost": statistics.mean(r["answers_lost"] or 0 for r in instance_rows) if memories else None,
            "stale_answers": int(stale),
            "build_seconds": round(build_s, 1), "answer_seconds": round(time.perf_counter() - started, 1),
        }
        if memories:
            result["conflict_memory"] = conflict_memory_counts(instances, memories)
        results[name] = result
    return results


def conflict_memory_counts(instances, memories: list[dict[str, Any]]) -> dict[str, int]:
    """Conflict questions by what the finished memory holds for them (`metrics.conflict_memory_state`):
    where a memory method loses conflict resolution, to shadowed values or to changes it never stored."""
    from memalpha.env.episode import whole_memory_text
    from memalpha.memory import MemoryStore
    from memalpha.models.readers import EvidenceReader
    from memalpha.rewards.qa import conflict_memory_state

    texts = {m["instance_id"]: whole_memory_text(MemoryStore.from_dict(m["memory"])) for m in memories}
    reader, counts = EvidenceReader(), dict.fromkeys(CONFLICT_MEMORY_STATES, 0)
    for instance in instances:
        for q in instance.questions:
            if q.superseded_answers and instance.instance_id in texts:
                counts[conflict_memory_state(reader.answer_one(texts[instance.instance_id], q), q.answers, q.superseded_answers)] += 1
    return counts


def tested(folder: Path, name: str, evaluate) -> dict[str, dict[str, Any]]:
    """{reader: result} for every reader in READERS: kept results read from `folder/<reader>/<name>.json`,
    the missing readers' from `evaluate(missing)` (one build for all of them), kept there."""
    from bench.run_all import write_atomically

    paths = {reader: folder / reader / f"{name}.json" for reader in READERS}
    results = {reader: json.loads(p.read_text()) for reader, p in paths.items() if p.is_file()}
    missing = tuple(r for r in READERS if r not in results)
    if missing:
        started = time.perf_counter()
        print(f"testing {name} with the {' and '.join(missing)} reader(s)", flush=True)
        for reader, result in evaluate(missing).items():
            paths[reader].parent.mkdir(parents=True, exist_ok=True)
            write_atomically(paths[reader], json.dumps(result, indent=1))
            results[reader] = result
        print(f"tested {name} in {time.perf_counter() - started:.0f} s: "
              + ", ".join(f"{r} reader QA {results[r]['qa']:.3f}" for r in missing), flush=True)
    return {reader: results[reader] for reader in READERS}


def warm_start() -> Path:
    """The seeds' one warm start, `RUN_ROOT/warm-start/sft`: WARM_START when its record's hash is the
    recipe's (restored from bf16), else trained now by the recipe."""
    from memalpha.teacher.warm_start import prepare_warm_start
    from memalpha.training.checkpoint import SFT_DIR

    folder = RUN_ROOT / "warm-start"
    prepare_warm_start(seed_config(SEEDS[0]), folder, shipped=WARM_START)
    return folder / SFT_DIR


def train_run(config, warm: Path, steps: int, name: str) -> tuple[list[dict[str, Any]], float]:
    """One GRPO run in `config.output_dir` from the warm start to `steps` (resumed where it stopped), a
    progress line per step; its metrics per step and the seconds this call spent training."""
    from memalpha.training.checkpoint import SFT_DIR, checkpoint_dir
    from memalpha.training.trainer import METRICS_FILE, Trainer

    run_dir = Path(config.output_dir)
    started = time.perf_counter()
    if not checkpoint_dir(run_dir, steps).is_dir():
        if not (run_dir / SFT_DIR).exists():
            shutil.copytree(warm, run_dir / SFT_DIR)
        trainer = Trainer(config, run_dir)
        trainer.maybe_resume()
        first = trainer.step

        def progress(result) -> None:
            rate = (time.perf_counter() - started) / (result.step - first)
            print(f"{name} step {result.step}/{steps} reward {result.metrics['reward']:.3f} "
                  f"({rate:.0f} s/step, ETA {rate * (steps - result.step) / 60:.1f} min for this run)", flush=True)

        trainer.train(on_step=progress, until=steps)
    history = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return history, time.perf_counter() - started


def train_seed(seed: int, warm: Path) -> tuple[list[dict[str, Any]], float]:
    """One GRPO seed from the warm start, trained to STEPS; its curve and the seconds this call spent training."""
    history, seconds = train_run(seed_config(seed), warm, STEPS, f"seed {seed}")
    return curve(history, coverage="rewards/coverage/mean"), seconds


def curve(history: list[dict[str, Any]], **metrics: str) -> list[dict[str, Any]]:
    """Per step of a run's metrics history: step, reward, the named `metrics` ({name: metric key}) and
    `validation_qa` where the run evaluated."""
    return [{"step": m["step"], "reward": m["reward"], **{name: m[key] for name, key in metrics.items()},
             **({"validation_qa": m["eval/qa_score"]} if "eval/qa_score" in m else {})} for m in history]


def best_seed(curves: dict[int, list[dict[str, Any]]]) -> tuple[int, dict[int, float]]:
    """The seed with the best validation QA at the last step (the lowest seed on a tie) and every seed's."""
    validation = {seed: c[-1].get("validation_qa", float("-inf")) for seed, c in curves.items()}
    return max(validation, key=lambda seed: (validation[seed], -seed)), validation


def curve_table(curves: dict[int, list[dict[str, Any]]]) -> list[str]:
    """The markdown table of the GRPO curve per seed."""
    lines = ["| seed | reward at step 1 | reward at the last step | validation QA at the last step |", "|---|---|---|---|"]
    for seed, c in curves.items():
        validation = next((f"{p['validation_qa']:.3f}" for p in reversed(c) if "validation_qa" in p), "")
        lines.append(f"| {seed} | {c[0]['reward']:.3f} | {c[-1]['reward']:.3f} | {validation} |")
    return lines


def summarize(tests: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds' mean test result: `qa` with `qa_seed_std` (std over seeds, ddof 1) and each seed's value."""
    qa = [t["qa"] for t in tests]
    return {
        "qa": statistics.mean(qa), "qa_seed_std": statistics.stdev(qa), "qa_seeds": qa,
        "qa_by_competency": {c: statistics.mean(t["qa_by_competency"][c] for t in tests) for c in COMPETENCIES},
        "memory_tokens": statistics.mean(t["memory_tokens"] for t in tests),
        "stale_answers": statistics.mean(t["stale_answers"] for t in tests),
        "stale_answers_seeds": [t["stale_answers"] for t in tests],
    }


def targets(by_reader: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """The targets of the trained writer (the seeds' mean), for the readers measured."""
    out = {}
    for reader, m in by_reader.items():
        trained, warm = m["trained"], m["warm_start"]
        out[f"{reader}: trained above warm start by 3 seed stds"] = trained["qa"] - warm["qa"] > 3 * trained["qa_seed_std"]
    if "local" in by_reader:
        m = by_reader["local"]
        out["local: trained above RAG top-2"] = m["trained"]["qa"] > m["rag"]["qa"]
        out["local: trained above long context"] = m["trained"]["qa"] > m["long_context"]["qa"]
        out["trained memory at most 20% of RAG's"] = m["trained"]["memory_tokens"] <= 0.2 * m["rag"]["memory_tokens"]
        out["local: no more stale answers than the rule writer"] = m["trained"]["stale_answers"] <= m["rule_writer"]["stale_answers"]
    if "evidence" in by_reader:
        m = by_reader["evidence"]
        out["evidence: trained at least RAG top-2"] = m["trained"]["qa"] >= m["rag"]["qa"]
    return out


def run() -> dict[str, Any]:
    import torch

    from memalpha.training.checkpoint import checkpoint_dir, policy_adapter

    if not torch.cuda.is_available() and not ON_CPU:
        raise BenchmarkSkipped("about 2 hours on a CPU (3 seeds x 20 GRPO steps, 8 test builds); "
                               "set MEMALPHA_BENCH_LEARNING_ON_CPU=1 to run it anyway")
    if len(SEEDS) < 2:
        raise ValueError(f"MEMALPHA_BENCH_LEARNING_SEEDS={' '.join(map(str, SEEDS))}: a spread over seeds needs at least 2")
    unknown = set(READERS) - set(READER_NOTES)
    if unknown:
        raise ValueError(f"MEMALPHA_BENCH_LEARNING_READERS: unknown reader(s) {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(READER_NOTES)}")
    started = time.perf_counter()
    training_data()
    warm, curves, grpo_s = warm_start(), {}, 0.0
    for seed in SEEDS:  # every seed is trained before any test
        curves[seed], seconds = train_seed(seed, warm)
        grpo_s += seconds
    instances = test_instances(TEST_INSTANCES)
    config = seed_config(SEEDS[0])
    folder = RUN_ROOT / f"test-{len(instances)}"
    methods = {"warm_start": tested(folder, "warm-start", lambda readers: compare(config, instances, "policy", readers, warm))}
    seeds = {}
    for seed in SEEDS:
        adapter = policy_adapter(checkpoint_dir(RUN_ROOT / f"seed{seed}", STEPS))
        seeds[seed] = tested(RUN_ROOT / f"seed{seed}" / f"test-{len(instances)}", f"step-{STEPS}",
                             lambda readers, adapter=adapter: compare(config, instances, "policy", readers, adapter))
    for name in BASELINES:
        methods[name] = tested(folder, name, lambda readers, name=name: compare(config, instances, name, readers))
    by_reader = {}
    for reader in READERS:
        trained = summarize([seeds[s][reader] for s in SEEDS])
        by_reader[reader] = {"warm_start": methods["warm_start"][reader], "trained": trained,
                             **{f"trained_seed{s}": seeds[s][reader] for s in SEEDS},
                             **{name: methods[name][reader] for name in BASELINES}}
    warm_record = WARM_START / "record.json"
    results = {
        "readers": by_reader, "curves": curves, "targets": targets(by_reader),
        "settings": {
            "config": str(CONFIG or "RunConfig() (the recipe)"), "overrides": seed_overrides(SEEDS[0]), "seeds": list(SEEDS),
            "steps": STEPS, "warm_start": str(WARM_START.relative_to(ROOT) if WARM_START.is_relative_to(ROOT) else WARM_START),
            "test_instances": len(instances), "test_questions": sum(len(i.questions) for i in instances),
            "test_seed": TEST_SEED, "readers": {r: READER_NOTES[r] for r in READERS},
            "retrieval": f"{config.retrieval.method} top-{config.retrieval.top_k}, {config.memory.reader_view_tokens}-token reader budget",
            "qa_seed_std": f"std over {len(SEEDS)} training seeds (ddof 1)",
            "grpo_seconds_this_run": round(grpo_s, 1),
            "warm_start_seconds": json.loads(warm_record.read_text())["sft"]["seconds"] if warm_record.is_file() else None,
            "total_seconds_this_run": round(time.perf_counter() - started, 1),
        },
    }
    if SHIP:
        results["shipped"] = ship_writer(config, curves, seeds)
    plot(results)
    return results


def ship_writer(config, curves: dict[int, list[dict[str, Any]]], tests: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Ship the seed with the best validation QA at the last step as adapters/writer; returns its record."""
    from memalpha.teacher import record
    from memalpha.training.checkpoint import checkpoint_dir, policy_adapter

    best, validation = best_seed(curves)
    seed_config_ = seed_config(best)
    entry = {
        "seed": best, "step": STEPS, "validation_qa": validation[best], "validation_qa_seeds": validation,
        "warm_start_hash": record.warm_start_hash(seed_config(SEEDS[0])),
        "grpo": seed_config_.grpo.model_dump(mode="json"), "rollout": seed_config_.rollout.model_dump(mode="json"),
        "data": f"bench/bench_learning.py training data: {TRAIN_INSTANCES} synthetic instances, {TEST_CHUNKS} chunks of "
                f"{CHUNK_TOKENS} tokens, seed {TRAIN_SEED}",
        "test": {reader: {k: v for k, v in result.items() if not k.endswith("seconds")} for reader, result in tests[best].items()},
        "test_set": f"{TEST_INSTANCES} instances generated with seed {TEST_SEED}, greedy",
    }
    record.ship(policy_adapter(checkpoint_dir(RUN_ROOT / f"seed{best}", STEPS)), record.WRITER, entry)
    return {"seed": best, "validation_qa": validation[best]}


def plot(results: dict[str, Any]) -> None:
    """learning.png: the GRPO curve per seed (training reward, validation QA) and the comparison per reader."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    readers = list(results["readers"])
    fig, axes = plt.subplots(1, 1 + len(readers), figsize=(6 + 6 * len(readers), 4.5))
    curve_ax, bar_axes = axes[0], axes[1:]
    for seed, curve in results["curves"].items():
        curve_ax.plot([p["step"] for p in curve], [p["reward"] for p in curve], alpha=0.7, label=f"seed {seed} reward")
    curve_ax.set(xlabel="GRPO step", ylabel="training reward (r1 + r2 + r4 + content credit)", title="GRPO, per seed")
    curve_ax.legend(fontsize=8)
    for ax, reader in zip(bar_axes, readers):
        methods = {k: v for k, v in results["readers"][reader].items() if not k.startswith("trained_seed")}
        names = list(methods)
        qa = [methods[n]["qa"] for n in names]
        ax.bar(names, qa, yerr=[methods[n].get("qa_seed_std", 0.0) for n in names],
               color=["tab:blue" if n in ("trained", "warm_start") else "tab:gray" for n in names])
        for i, n in enumerate(names):
            ax.annotate(f"{methods[n]['memory_tokens']:.0f} tok", (i, qa[i]), ha="center", va="bottom", fontsize=8)
        ax.set(ylabel="QA", ylim=(0, 1), title=f"{results['settings']['test_questions']} held-out questions, {reader} reader")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def to_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        "# Benchmark: learning", "",
        f"{s['config']} with {' '.join(s['overrides'])}; GRPO seeds {', '.join(map(str, s['seeds']))}, {s['steps']} "
        f"step-level steps each, from the warm start {s['warm_start']}. Held-out test: {s['test_instances']} instances "
        f"({s['test_questions']} questions) of {', '.join(COMPETENCIES)}, generator seed {s['test_seed']}; greedy; "
        f"{s['retrieval']}. `trained` is the mean over seeds; qa_seed_std: {s['qa_seed_std']}. "
        f"GRPO {s['grpo_seconds_this_run'] / 60:.1f} min and {s['total_seconds_this_run'] / 60:.1f} min in all this run "
        "(runs and test results kept from earlier runs are not repeated)"
        + (f"; the warm start took {s['warm_start_seconds'] / 60:.0f} min to build." if s.get("warm_start_seconds") else "."), "",
    ]
    for reader, methods in results["readers"].items():
        lines += [f"## {s['readers'][reader][0].upper()}{s['readers'][reader][1:]}", "",
                  "| method | qa | qa_seed_std | " + " | ".join(COMPETENCIES) + " | memory tokens | stale conflict answers |",
                  "|---|---|---|" + "---|" * len(COMPETENCIES) + "---|---|"]
        for name, m in methods.items():
            std = f"{m['qa_seed_std']:.3f}" if "qa_seed_std" in m else ""
            stale = f"{m['stale_answers']:.1f}" if "qa_seeds" in m else str(m["stale_answers"])
            lines.append(f"| {name} | {m['qa']:.3f} | {std} | " + " | ".join(f"{m['qa_by_competency'][c]:.3f}" for c in COMPETENCIES)
                         + f" | {m['memory_tokens']:.0f} | {stale} |")
        lines.append("")
    lines += ["## Targets", "", "| target | met |", "|---|---|"]
    lines += [f"| {name} | {'met' if met else 'missed'} |" for name, met in results["targets"].items()]
    held = {name: m["conflict_memory"] for name, m in next(iter(results["readers"].values())).items() if "conflict_memory" in m}
    if held:
        lines += ["", "## Conflict questions by what the final memory holds", "",
                  "| method | current value only | both values | superseded only | neither |", "|---|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(str(c[state]) for state in CONFLICT_MEMORY_STATES) + " |" for name, c in held.items()]
    lines += ["", "![GRPO per seed, comparison per reader](learning.png)", "", "## GRPO curve per seed", ""]
    lines += curve_table(results["curves"])
    return "\n".join(lines) + "\n"
