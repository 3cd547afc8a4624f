"""Learning benchmark: does GRPO improve on the warm start?

configs/default.yaml (warm start, then GRPO on synthetic accurate-retrieval data) with `STEPS` GRPO
steps. The held-out evaluation runs on the validation instances before the first GRPO step (the warm
start) and after the last one: K sampled rollouts per instance at the training temperature, scored as
in training. The spread is the standard deviation over the K rollout sets (run-to-run noise of the
sampled policy); the greedy score is reported too. Target: final - warm start > spread, all within
60 minutes. Writes learning.json, learning.md and learning.png (reward curve, held-out comparison).

    MEMALPHA_BENCH_LEARNING_STEPS=40 python -m bench.run_all learning
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("MEMALPHA_BENCH_LEARNING_STEPS", "40"))
EVAL_ROLLOUTS = 4
EVAL_INSTANCES = 8
RUN_DIR = ROOT / "runs" / "bench-learning"
PLOT = ROOT / "bench" / "results" / "learning.png"
COMPONENTS = ("r1", "coverage", "r2", "r3", "r4")


def held_out(trainer, seed: int) -> dict[str, Any]:
    """K sampled rollouts of each validation instance: per-rollout-set means, their mean and spread."""
    from memalpha.rollout import collect_rollouts
    from memalpha.trainer import evaluation_metrics

    instances = trainer.data["validation"][:EVAL_INSTANCES]
    batch = collect_rollouts(trainer.policy, instances, trainer.config, num_generations=EVAL_ROLLOUTS,
                             generator=torch.Generator().manual_seed(seed), reader=trainer.reader)
    K = EVAL_ROLLOUTS
    reward = [statistics.mean(s.reward.total for s in batch.samples if s.rollout == g) for g in range(K)]
    qa = [statistics.mean(batch.qa_scores[b * K + g] for b in range(len(instances))) for g in range(K)]
    greedy = trainer.evaluate("validation")
    return {
        "reward_mean": statistics.mean(reward), "reward_spread": statistics.stdev(reward), "reward_per_set": reward,
        **{f"{c}_mean": statistics.mean(getattr(s.reward, c) for s in batch.samples) for c in COMPONENTS},
        "qa_mean": statistics.mean(qa), "qa_spread": statistics.stdev(qa),
        "tool_success": evaluation_metrics(batch)["eval/tool_success"],
        "greedy_reward": greedy["eval/reward"], "greedy_qa": greedy["eval/qa_score"],
        "instances": len(instances), "rollouts_per_instance": K,
    }


def run() -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.trainer import Trainer

    started = time.perf_counter()
    if RUN_DIR.exists():
        shutil.rmtree(RUN_DIR)  # a fresh run: the curve must start at the warm start
    config = load_config(ROOT / "configs" / "default.yaml",
                         [f"output_dir={RUN_DIR}", f"grpo.steps={STEPS}", f"grpo.checkpoint_every={max(STEPS, 1)}",
                          f"eval.max_instances={EVAL_INSTANCES}"])
    trainer = Trainer(config, RUN_DIR)
    warm_s = time.perf_counter() - started
    warm = held_out(trainer, seed=1234)
    curve = []
    grpo_started = time.perf_counter()

    def record(result) -> None:
        curve.append({"step": result.step, **{k: result.metrics[k] for k in (
            "reward", "rewards/r1/mean", "rewards/coverage/mean", "rewards/r2/mean", "rewards/r3/mean", "rewards/r4/mean",
            "tool_calls/success_rate", "frac_reward_zero_std", "kl", "entropy", "timing/step_s")}})
        elapsed = time.perf_counter() - grpo_started
        eta = elapsed / result.step * (STEPS - result.step)
        print(f"step {result.step}/{STEPS} reward {result.metrics['reward']:.3f} "
              f"({elapsed / result.step:.0f} s/step, ETA {eta / 60:.1f} min)", flush=True)

    trainer.train(record)
    final = held_out(trainer, seed=1234)
    spread = max(warm["reward_spread"], final["reward_spread"])
    gain = final["reward_mean"] - warm["reward_mean"]
    plot(curve, warm, final)
    return {
        "steps": STEPS, "B": config.rollout.instances_per_step, "G": config.rollout.num_generations,
        "warm_start_seconds": round(warm_s, 1), "total_seconds": round(time.perf_counter() - started, 1),
        "warm_start": warm, "final": final, "reward_gain": gain, "spread": spread,
        "beats_warm_start_by_more_than_spread": gain > spread, "curve": curve,
        "learning_rate": config.grpo.learning_rate, "sft_demonstrations": config.sft.num_demonstrations,
    }


def plot(curve: list[dict], warm: dict, final: dict) -> None:
    """learning.png: the per-step training reward with its components, and the held-out comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    steps = [p["step"] for p in curve]
    rewards = [p["reward"] for p in curve]
    left.plot(steps, rewards, label="reward", color="black", alpha=0.4)
    smooth = [statistics.mean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
    left.plot(steps, smooth, label="reward, 5-step mean", color="black", linewidth=2)
    for c in COMPONENTS:
        left.plot(steps, [p[f"rewards/{c}/mean"] for p in curve], label=c, alpha=0.7)
    left.set(xlabel="GRPO step", ylabel="mean over the step's samples", title="Training reward")
    left.legend()
    names = ["reward", *COMPONENTS]
    x = range(len(names))
    warm_values = [warm["reward_mean"], *(warm[f"{c}_mean"] for c in COMPONENTS)]
    final_values = [final["reward_mean"], *(final[f"{c}_mean"] for c in COMPONENTS)]
    right.bar([i - 0.2 for i in x], warm_values, width=0.4, label="warm start",
              yerr=[warm["reward_spread"], 0, 0, 0, 0])
    right.bar([i + 0.2 for i in x], final_values, width=0.4, label="final",
              yerr=[final["reward_spread"], 0, 0, 0, 0])
    right.set_xticks(list(x), names)
    right.set(title="Held-out (sampled), error bar = spread")
    right.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def to_markdown(results: dict[str, Any]) -> str:
    w, f = results["warm_start"], results["final"]
    lines = [
        "# Benchmark: learning", "",
        f"configs/default.yaml, {results['steps']} GRPO steps (B={results['B']}, G={results['G']}) after the warm start; "
        f"SFT warm start on {results['sft_demonstrations']} demonstrations, GRPO learning rate {results['learning_rate']}; "
        f"total {results['total_seconds']} s = {results['total_seconds'] / 60:.1f} min "
        f"(warm start + setup {results['warm_start_seconds']} s; target: within 60 min).", "",
        f"Held-out: {w['instances']} validation instances x {w['rollouts_per_instance']} sampled rollouts; spread = std "
        "over the rollout sets.", "",
        "| policy | reward | spread | r1 (QA) | r2 | r3 | r4 | tool success | greedy reward | greedy QA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in (("warm start", w), ("final", f)):
        lines.append(f"| {name} | {r['reward_mean']:.4f} | {r['reward_spread']:.4f} | {r['r1_mean']:.4f} | "
                     f"{r['r2_mean']:.4f} | {r['r3_mean']:.4f} | {r['r4_mean']:.4f} | {r['tool_success']:.3f} | "
                     f"{r['greedy_reward']:.4f} | {r['greedy_qa']:.4f} |")
    lines += ["", f"Gain {results['reward_gain']:+.4f} vs spread {results['spread']:.4f}: "
              f"{'beats' if results['beats_warm_start_by_more_than_spread'] else 'does not beat'} the warm start "
              "by more than the spread.", "", "![reward curve and held-out comparison](learning.png)", "", "## Reward curve", "", "| step | reward | r1 | r2 | r4 | calls ok | step s |",
              "|---|---|---|---|---|---|---|"]
    for p in results["curve"]:
        lines.append(f"| {p['step']} | {p['reward']:.4f} | {p['rewards/r1/mean']:.3f} | {p['rewards/r2/mean']:.3f} | "
                     f"{p['rewards/r4/mean']:.3f} | {p['tool_calls/success_rate']:.3f} | {p['timing/step_s']:.0f} |")
    return "\n".join(lines) + "\n"
