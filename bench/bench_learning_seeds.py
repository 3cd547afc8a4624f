"""Learning over training seeds: the learning benchmark's recipe with several GRPO seeds and more steps.

The learning benchmark trains one GRPO run inside an hour and tests it on 96 questions, where one run
differs from another by as much as the gains measured (docs/TRAINING.md, "Next levers" 2). This one
trains `SEEDS` GRPO runs from one warm start, each to every step in `STEPS`, and evaluates each seed's
adapter at each of those steps greedily on the first `TEST_INSTANCES` test instances of the learning
benchmark (48: 288 questions), beside the warm start, the rule writer, BM25 RAG top-2 and long context.
`qa_spread` is the std over training seeds (ddof 1); the targets are those of the learning benchmark at
the last step. Writes learning_seeds.json, learning_seeds.md and learning_seeds.png (test QA over steps
per seed against the baselines, and each seed's training reward).

The warm start is `MEMALPHA_BENCH_SEEDS_WARM_START` (an adapter folder, e.g. runs/bench-learning/sft)
or, without it, trained by the first seed's run as the learning benchmark trains it. Runs live in
`RUN_ROOT/seed<N>` and resume from their checkpoints; each test evaluation is kept beside its run, so an
interrupted job continues where it stopped (delete RUN_ROOT to start afresh, e.g. from another warm start). About 5 hours on a 2-core bf16 CPU (3 seeds x 60 steps of
~90 s, 10 evaluations of ~5 min), so on a CPU it is skipped unless `MEMALPHA_BENCH_SEEDS_ON_CPU=1`.

    MEMALPHA_BENCH_SEEDS_ON_CPU=1 python -m bench.run_all learning_seeds
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import BenchmarkSkipped
from bench import bench_learning as learning
from bench.run_all import write_atomically

SEEDS = tuple(int(s) for s in os.environ.get("MEMALPHA_BENCH_SEEDS", "0 1 2").split())
STEPS = tuple(sorted(int(s) for s in os.environ.get("MEMALPHA_BENCH_SEEDS_STEPS", "20 40 60").split()))
"""The GRPO steps at which every seed's adapter is tested."""
TEST_INSTANCES = int(os.environ.get("MEMALPHA_BENCH_SEEDS_TEST_INSTANCES", "48"))
WARM_START = os.environ.get("MEMALPHA_BENCH_SEEDS_WARM_START")
ON_CPU = os.environ.get("MEMALPHA_BENCH_SEEDS_ON_CPU") == "1"
RUN_ROOT = learning.ROOT / "runs" / "bench-learning-seeds"
PLOT = learning.ROOT / "bench" / "results" / "learning_seeds.png"
CHECKPOINT_EVERY = 10
CONFIG: Path | None = None
"""A config file under the overrides (None: the recipe, `RunConfig()`)."""
BASELINES = ("rule_writer", "rag", "long_context")


def seed_overrides(seed: int) -> list[str]:
    """The learning benchmark's overrides for one GRPO seed, run to the last of STEPS (validation only after it)."""
    shared = [o for o in learning.OVERRIDES if not o.startswith("output_dir=")]
    return [*shared, *learning.EXTRA_OVERRIDES, f"output_dir={RUN_ROOT / f'seed{seed}'}", f"grpo.seed={seed}",
            f"grpo.steps={STEPS[-1]}", f"grpo.eval_every={STEPS[-1]}", f"grpo.checkpoint_every={CHECKPOINT_EVERY}"]


def seed_config(seed: int):
    from memalpha.config import load_config

    return load_config(CONFIG, seed_overrides(seed))


def tested(cache: Path, evaluate) -> dict[str, Any]:
    """The test result kept at `cache`, or `evaluate()`'s, kept there."""
    if cache.is_file():
        return json.loads(cache.read_text())
    result = evaluate()
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(cache, json.dumps(result, indent=1))
    return result


def train_seed(seed: int, warm_start: Path | None, instances: list) -> dict[str, Any]:
    """One GRPO seed from the warm start: trained to each of STEPS (resumed where it stopped) and tested there."""
    from memalpha.teacher.warm_start import prepare_warm_start
    from memalpha.training.checkpoint import SFT_DIR, checkpoint_dir, policy_adapter
    from memalpha.training.trainer import Trainer

    config = seed_config(seed)
    run_dir = Path(config.output_dir)
    if warm_start is not None and not (run_dir / SFT_DIR).exists():
        shutil.copytree(warm_start, run_dir / SFT_DIR)
    prepare_warm_start(config, run_dir)
    trainer = Trainer(config, run_dir)
    trainer.maybe_resume()
    started, first = time.perf_counter(), trainer.step
    tests: dict[int, dict[str, Any]] = {}

    def progress(result) -> None:
        rate = (time.perf_counter() - started) / (result.step - first)
        print(f"seed {seed} step {result.step}/{STEPS[-1]} reward {result.metrics['reward']:.3f} "
              f"({rate:.0f} s/step, ETA {rate * (STEPS[-1] - result.step) / 60:.1f} min for this seed)", flush=True)

    def test(step: int) -> dict[str, Any]:
        checkpoint = checkpoint_dir(run_dir, step)
        if not checkpoint.is_dir():  # resumed past a step whose checkpoint was never kept
            raise FileNotFoundError(f"{checkpoint}: no checkpoint at step {step} to test; delete {run_dir} to train it again")
        return learning.compare(config, instances, "policy", policy_adapter(checkpoint))

    for step in STEPS:
        trainer.train(on_step=progress, until=step)
        tests[step] = tested(run_dir / f"test-{len(instances)}" / f"step-{step}.json", partial(test, step))
        print(f"seed {seed} step {step}: test QA {tests[step]['qa']:.3f}", flush=True)
    curve = [{"step": m["step"], "reward": m["reward"], "coverage": m["rewards/coverage/mean"]} for m in trainer.history]
    return {"tests": tests, "curve": curve, "warm_start": run_dir / SFT_DIR}


def summarize(tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of their test results at one step, with `qa_spread` = std over the seeds."""
    qa = [t["qa"] for t in tests]
    competencies = tests[0]["qa_by_competency"]
    return {
        "qa": statistics.mean(qa), "qa_spread": statistics.stdev(qa), "qa_seeds": qa,
        "qa_by_competency": {c: statistics.mean(t["qa_by_competency"][c] for t in tests) for c in competencies},
        "memory_tokens": statistics.mean(t["memory_tokens"] for t in tests),
        "stale_answers": statistics.mean(t["stale_answers"] for t in tests),
        "stale_answers_seeds": [t["stale_answers"] for t in tests],
    }


def targets(trained: dict[str, Any], warm: dict[str, Any], rag: dict[str, Any]) -> dict[str, bool]:
    """The learning benchmark's targets for the seeds' mean at one step: the spread is over seeds, and a stale
    answer of any seed counts."""
    return learning.targets(trained, warm["qa"], trained["qa_spread"], rag, sum(trained["stale_answers_seeds"]))


def run() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available() and not ON_CPU:
        raise BenchmarkSkipped("hours on a CPU (3 seeds x 60 GRPO steps); set MEMALPHA_BENCH_SEEDS_ON_CPU=1 to run it anyway")
    if len(SEEDS) < 2:
        raise ValueError(f"MEMALPHA_BENCH_SEEDS={' '.join(map(str, SEEDS))}: a spread over seeds needs at least 2")
    started = time.perf_counter()
    learning.training_data()
    instances = learning.test_instances(TEST_INSTANCES)
    warm_start = Path(WARM_START) if WARM_START else None
    config = seed_config(SEEDS[0])
    if warm_start is None and not config.sft.enabled:
        raise ValueError("sft.enabled=false leaves no warm start to train from and compare with; "
                         "set MEMALPHA_BENCH_SEEDS_WARM_START to an adapter folder")
    seeds: dict[int, dict[str, Any]] = {}
    for seed in SEEDS:
        seeds[seed] = train_seed(seed, warm_start, instances)
        warm_start = warm_start or seeds[seed]["warm_start"]  # the first seed trained it: the others share it
    methods = {"warm_start": tested(RUN_ROOT / f"test-{len(instances)}" / "warm-start.json",
                                    lambda: learning.compare(config, instances, "policy", warm_start))}
    methods.update({name: learning.compare(config, instances, name) for name in BASELINES})
    by_step = {step: summarize([seeds[s]["tests"][step] for s in SEEDS]) for step in STEPS}
    results = {
        "methods": methods, "by_step": by_step,
        "seeds": {seed: {"tests": s["tests"], "curve": s["curve"]} for seed, s in seeds.items()},
        "targets": targets(by_step[STEPS[-1]], methods["warm_start"], methods["rag"]),
        "settings": {
            "config": str(CONFIG or "RunConfig() (the recipe)"), "overrides": seed_overrides(SEEDS[0]), "seeds": list(SEEDS),
            "steps": list(STEPS), "warm_start": WARM_START or f"trained by seed {SEEDS[0]}'s run",
            "test_instances": len(instances), "test_questions": sum(len(i.questions) for i in instances),
            "test_seed": learning.TEST_SEED, "reader": config.model.reader,
            "qa_spread": f"std over {len(SEEDS)} training seeds (ddof 1)",
            "total_seconds_this_run": round(time.perf_counter() - started, 1),
        },
    }
    plot(results)
    return results


def plot(results: dict[str, Any]) -> None:
    """learning_seeds.png: test QA over GRPO steps per seed and their mean against the baselines; training reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (qa_ax, reward_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    warm = results["methods"]["warm_start"]["qa"]
    steps = [0, *results["settings"]["steps"]]
    for seed, s in results["seeds"].items():
        qa_ax.plot(steps, [warm, *(s["tests"][step]["qa"] for step in steps[1:])], alpha=0.5, marker=".", label=f"seed {seed}")
        reward_ax.plot([p["step"] for p in s["curve"]], [p["reward"] for p in s["curve"]], alpha=0.7, label=f"seed {seed}")
    mean = [results["by_step"][step] for step in steps[1:]]
    qa_ax.errorbar(steps, [warm, *(m["qa"] for m in mean)], yerr=[0, *(m["qa_spread"] for m in mean)],
                   color="black", marker="s", capsize=3, label="mean over seeds (std)")
    for name, style in zip(BASELINES, (":", "--", "-.")):
        qa_ax.axhline(results["methods"][name]["qa"], color="gray", linestyle=style, label=name)
    qa_ax.set(xlabel="GRPO step (0: warm start)", ylabel="test QA (greedy)", ylim=(0, 1),
              title=f"Held-out QA, {results['settings']['test_questions']} questions")
    qa_ax.legend(fontsize=8)
    reward_ax.set(xlabel="GRPO step", ylabel="training reward", title="Training reward per seed")
    reward_ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def to_markdown(results: dict[str, Any]) -> str:
    s, competencies = results["settings"], learning.COMPETENCIES
    last = s["steps"][-1]
    lines = [
        "# Benchmark: learning over training seeds", "",
        f"{s['config']} with {' '.join(s['overrides'])}; GRPO seeds {', '.join(map(str, s['seeds']))} from one warm start "
        f"({s['warm_start']}), each tested at steps {', '.join(map(str, s['steps']))}. Held-out test: the learning "
        f"benchmark's first {s['test_instances']} instances ({s['test_questions']} questions, generator seed {s['test_seed']}); "
        f"greedy; {s['reader']} reader. qa_spread: {s['qa_spread']}. "
        f"{s['total_seconds_this_run'] / 60:.1f} min this run (evaluations kept from earlier runs are not repeated).", "",
        "| method | qa | qa_spread | " + " | ".join(competencies) + " | memory tokens | stale conflict answers |",
        "|---|---|---|" + "---|" * len(competencies) + "---|---|",
    ]
    rows = {name: m for name, m in results["methods"].items() if name == "warm_start"}
    rows.update({f"trained, step {step} (mean over seeds)": m for step, m in results["by_step"].items()})
    rows.update({name: m for name, m in results["methods"].items() if name != "warm_start"})
    for name, m in rows.items():
        spread = f"{m['qa_spread']:.3f}" if "qa_spread" in m else ""
        stale = f"{m['stale_answers']:.1f}" if "qa_seeds" in m else str(m["stale_answers"])  # a mean over seeds
        lines.append(f"| {name} | {m['qa']:.3f} | {spread} | " + " | ".join(f"{m['qa_by_competency'][c]:.3f}" for c in competencies)
                     + f" | {m['memory_tokens']:.0f} | {stale} |")
    warm = results["methods"]["warm_start"]["qa"]
    lines += ["", f"Targets at step {last}: " + ", ".join(f"{k}: {v}" for k, v in results["targets"].items())
              + f" (gain {results['by_step'][last]['qa'] - warm:+.3f}, 3 spreads {3 * results['by_step'][last]['qa_spread']:.3f}).",
              "", "![test QA over steps per seed, training reward](learning_seeds.png)", "", "## Each seed's test QA", "",
              "| seed | " + " | ".join(f"step {step}" for step in s["steps"]) + " | memory tokens, stale (last step) |",
              "|---|" + "---|" * len(s["steps"]) + "---|"]
    for seed, run in results["seeds"].items():
        final = run["tests"][last]
        lines.append(f"| {seed} | " + " | ".join(f"{run['tests'][step]['qa']:.3f}" for step in s["steps"])
                     + f" | {final['memory_tokens']:.0f}, {final['stale_answers']} |")
    return "\n".join(lines) + "\n"
