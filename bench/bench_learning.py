"""Learning benchmark: does the trained writer remember better than its warm start and than RAG?

The recipe (`RunConfig()`: step-level GRPO on synthetic accurate-retrieval and
conflict-resolution data). The warm start measures held-out extraction after every SFT epoch and stops
on a plateau; GRPO then runs until `STEPS` steps or until the time left only fits the final evaluation
(the whole run stays within `BUDGET_S`). Training data: `TRAIN_INSTANCES` instances from the synthetic
generator with seed `TRAIN_SEED`, shaped like the test set (`TEST_CHUNKS` chunks each, the same
competencies), prepared once into `TRAIN_DATA`. Held-out comparison: `TEST_INSTANCES` instances generated
with seed `TEST_SEED`, all greedy, the evidence reader and the same retrieval
budget for every method: warm start, trained policy, rule writer, BM25 RAG top-2, long context. The
trained policy is the adapter with the best validation QA (greedy, evaluated every `grpo.eval_every`
steps and after the last; the warm start competes too), and the last step's adapter is reported beside
it as `trained_last` when they differ and time is left. A policy's `qa_spread` is the std over 3
evaluations sampled at temperature 1: the warm start's is measured before GRPO, and the time it takes
sizes the reserve kept for the trained policy's at the end. For memory methods, `conflict_memory` counts
the conflict questions by what the final memory asserts (current value only, both, superseded only,
neither). Writes learning.json, learning.md and learning.png (SFT curve, GRPO curve with held-out QA, the
comparison).

    python -m bench.run_all learning
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from memalpha.rewards.qa import CONFLICT_MEMORY_STATES

ROOT = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("MEMALPHA_BENCH_LEARNING_STEPS", "60"))
BUDGET_S = float(os.environ.get("MEMALPHA_BENCH_LEARNING_BUDGET_S", str(60 * 60)))
TEST_INSTANCES = int(os.environ.get("MEMALPHA_BENCH_LEARNING_TEST_INSTANCES", "16"))
REUSE_SFT = os.environ.get("MEMALPHA_BENCH_LEARNING_REUSE_SFT")
"""An earlier run's warm-start adapter folder (same SFT settings and seed, so the same adapter) to start
from instead of training it again; the report says so and what that warm start cost."""
EXTRA_OVERRIDES = os.environ.get("MEMALPHA_BENCH_LEARNING_OVERRIDES", "").split()
"""Space-separated `key=value` overrides applied after the benchmark's own (a setting to compare)."""
CHUNK_TOKENS = int(os.environ.get("MEMALPHA_BENCH_LEARNING_CHUNK_TOKENS", "512"))
"""Tokens per chunk of the training and test conversations; each conversation holds `CONVERSATION_TOKENS`
whatever the chunk size, so a smaller chunk means more, shorter writer calls over the same text."""
CONVERSATION_TOKENS = 2048
TEST_SEED = 7
TEST_CHUNKS = CONVERSATION_TOKENS // CHUNK_TOKENS
SPREAD_SEEDS = (0, 1, 2)
COMPETENCIES = ("accurate_retrieval", "conflict_resolution")
TRAIN_SEED = 0
TRAIN_INSTANCES = 256
TRAIN_DATA = ROOT / "data" / ("bench-learning" if CHUNK_TOKENS == 512 else f"bench-learning-{CHUNK_TOKENS}")
RUN_DIR = ROOT / "runs" / "bench-learning"
PLOT = ROOT / "bench" / "results" / "learning.png"
OVERRIDES = [
    f"output_dir={RUN_DIR}", f"data.train_path={TRAIN_DATA}", "eval.max_instances=8",
    # the benchmark spends its own hour (BUDGET_S), not make train's 11 minutes
    "time_budget_minutes=null",
]
"""The benchmark is the recipe (`RunConfig()`, so the shipped warm start is reused) on its own training data."""
READER_NOTE = {"evidence": " (it answers whenever a gold answer occurs in the context: an upper bound for methods that keep raw text)"}
RULE_WRITER_BUDGETS = (64, 96, 128, 160, 192, 256)
"""Completion budgets (tokens per chunk) at which the rule writer is also evaluated: what a budget allows."""
HELD_OUT_KEYS = ("eval/qa", "warm_start/eval/qa", "best/")
CURVE_KEYS = ("reward", "qa_score", "rewards/coverage/mean", "rewards/retention/mean", "rewards/r2/mean", "rewards/r4/mean",
              "tool_calls/success_rate", "tool_calls/nothing_to_store", "frac_reward_zero_std", "timing/step_s")


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


def compare(config, instances, method: str, model: Path | None = None) -> dict[str, Any]:
    """Greedy evaluation of one method on the test instances."""
    from memalpha.evaluation.runner import evaluate
    from memalpha.rewards.qa import states_superseded

    result = evaluate(config, methods=[method], model_uri=model, instances=instances, progress=None)
    questions = result.questions
    superseded = {q.question_id: (q.answers, q.superseded_answers) for inst in instances for q in inst.questions}
    stale = sum(states_superseded(row["prediction"], *superseded[row["question_id"]])
                for row in questions.iter_rows(named=True) if superseded[row["question_id"]][1])
    out = {
        "qa": float(questions["score"].mean()),
        "qa_by_competency": {c: float(questions.filter(questions["competency"] == c)["score"].mean()) for c in COMPETENCIES},
        "memory_tokens": float(result.instances["memory_tokens"].mean()),
        "answers_lost": result.instances["answers_lost"].mean(),
        "stale_answers": int(stale),
        "seconds": round(sum(result.info["method_seconds"].values()), 1),
    }
    if result.memories:
        out["conflict_memory"] = conflict_memory_counts(instances, result.memories)
    return out


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


def with_completion_budget(config, tokens: int):
    """The config with another completion budget (the rule writer's demonstrations are cut to it too)."""
    return config.model_copy(update={"rollout": config.rollout.model_copy(update={"max_completion_length": tokens})})


def spread(config, instances, model: Path) -> dict[str, Any]:
    """`qa_spread` of a policy: the std of its QA over 3 evaluations sampled at temperature 1."""
    from memalpha.evaluation.runner import evaluate

    sampled = config.model_copy(update={"eval": config.eval.model_copy(update={"temperature": 1.0})})
    runs = evaluate(sampled, methods=["policy"], model_uri=model, instances=instances, seeds=list(SPREAD_SEEDS),
                    progress=None).questions
    per_seed = [float(runs.filter(runs["seed"] == s)["score"].mean()) for s in SPREAD_SEEDS]
    return {"qa_sampled": per_seed, "qa_spread": statistics.stdev(per_seed)}


def run() -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.teacher.warm_start import prepare_warm_start
    from memalpha.training.checkpoint import SFT_DIR, policy_adapter, read_best
    from memalpha.training.trainer import Trainer

    started = time.perf_counter()
    training_data()
    if RUN_DIR.exists():
        shutil.rmtree(RUN_DIR)  # a fresh run: the curves must start at the warm start
    if REUSE_SFT:
        shutil.copytree(REUSE_SFT, RUN_DIR / SFT_DIR)
    config = load_config(None, [*OVERRIDES, *EXTRA_OVERRIDES, f"grpo.steps={STEPS}", f"grpo.checkpoint_every={STEPS}"])
    prepare_warm_start(config, RUN_DIR)
    trainer = Trainer(config, RUN_DIR)
    warm_s = time.perf_counter() - started
    sft = _sft_result(RUN_DIR / SFT_DIR)
    instances = test_instances()
    print(f"warm start ready in {warm_s:.0f} s; evaluating on {len(instances)} test instances", flush=True)
    methods: dict[str, Any] = {}
    evaluated = time.perf_counter()
    methods["warm_start"] = compare(config, instances, "policy", RUN_DIR / SFT_DIR)
    greedy_eval_s = time.perf_counter() - evaluated
    methods["warm_start"].update(spread(config, instances, RUN_DIR / SFT_DIR))
    sampled_eval_s = time.perf_counter() - evaluated - greedy_eval_s
    for name in ("rule_writer", "rag", "long_context"):
        methods[name] = compare(config, instances, name)
    rule_writer_by_budget = {budget: compare(with_completion_budget(config, budget), instances, "rule_writer")
                             for budget in RULE_WRITER_BUDGETS}
    print(f"warm start and baselines evaluated in {time.perf_counter() - evaluated:.0f} s", flush=True)

    curve: list[dict] = []
    grpo_started = time.perf_counter()
    # the final evaluations, timed on the warm start: a last validation (half the test instances), the
    # selected policy greedy and its 3 sampled runs; and a margin. The last step's adapter, when it is not
    # the selected one, is evaluated only if time is left.
    reserve = 1.5 * greedy_eval_s + sampled_eval_s + 180
    print(f"GRPO until {BUDGET_S - reserve:.0f} s into the run: {reserve:.0f} s are reserved for the final evaluations", flush=True)
    while trainer.step < STEPS:
        elapsed = time.perf_counter() - started
        per_step = (time.perf_counter() - grpo_started) / trainer.step if trainer.step else 0.0
        if elapsed + per_step + reserve > BUDGET_S:
            break
        result = trainer.train_step()
        curve.append({"step": result.step, **{k: result.metrics[k] for k in CURVE_KEYS},
                      **{k: v for k, v in result.metrics.items() if k.startswith(HELD_OUT_KEYS)}})
        rate = (time.perf_counter() - grpo_started) / result.step
        print(f"step {result.step}/{STEPS} reward {result.metrics['reward']:.3f} coverage "
              f"{result.metrics['rewards/coverage/mean']:.3f} ({rate:.0f} s/step, ETA "
              f"{rate * (STEPS - result.step) / 60:.1f} min)", flush=True)
    if not trainer.step:
        print(f"no GRPO step fits: the warm start and its evaluations took {time.perf_counter() - started:.0f} s "
              f"of the {BUDGET_S:.0f} s budget on this machine", flush=True)
    if curve and not config.grpo.is_eval_step(trainer.step):
        curve[-1].update({k: v for k, v in trainer.validate().items() if k.startswith(HELD_OUT_KEYS)})
    grpo_s = time.perf_counter() - grpo_started  # the steps and their validations, not the final evaluations
    checkpoint = trainer.save_checkpoint()
    best = read_best(RUN_DIR) or {"step": 0, "score": float("nan")}  # no GRPO step ran: the warm start
    selected = trainer.best_adapter or RUN_DIR / SFT_DIR
    if trainer.step:
        methods["trained"] = compare(config, instances, "policy", selected)
        methods["trained"].update(spread(config, instances, selected))
    else:  # no step fit: the trained policy is the warm start, already evaluated
        methods["trained"] = dict(methods["warm_start"])
    if best["step"] != trainer.step and time.perf_counter() - started + greedy_eval_s <= BUDGET_S:
        methods["trained_last"] = compare(config, instances, "policy", policy_adapter(checkpoint))
    trained, warm, rag = methods["trained"], methods["warm_start"], methods["rag"]
    results = {
        "methods": methods,
        "rule_writer_by_budget": rule_writer_by_budget,
        "sft_epochs": sft.get("epochs", []), "sft_best_epoch": sft.get("best_epoch"), "sft_steps": sft.get("steps"),
        "sft_losses": sft.get("losses", []),
        "grpo_steps": trainer.step, "selected_step": best["step"], "selected_validation_qa": best["score"], "curve": curve,
        "targets": targets(trained, warm["qa"], max(trained["qa_spread"], warm["qa_spread"]), rag, trained["stale_answers"]),
        "settings": {
            "config": "RunConfig() (the recipe)", "overrides": OVERRIDES + EXTRA_OVERRIDES, "B": config.rollout.instances_per_step,
            "G": config.rollout.num_generations, "learning_rate": config.grpo.learning_rate,
            "test_instances": len(instances), "test_seed": TEST_SEED, "test_chunks": TEST_CHUNKS, "chunk_tokens": CHUNK_TOKENS,
            "test_questions": sum(len(i.questions) for i in instances), "reader": config.model.reader,
            "completion_budget": config.rollout.max_completion_length,
            "retrieval": f"{config.retrieval.method} top-{config.retrieval.top_k}, {config.memory.reader_view_tokens}-token reader budget",
            "qa_spread": f"std over {len(SPREAD_SEEDS)} evaluations sampled at temperature 1",
            "warm_start_seconds": round(warm_s, 1),
            "warm_start_reused_from": REUSE_SFT or None, "grpo_seconds": round(grpo_s, 1),
            "final_evaluation_reserve_seconds": round(reserve, 1),
            "total_seconds": round(time.perf_counter() - started, 1), "budget_seconds": BUDGET_S,
        },
    }
    plot(results)
    return results


def targets(trained: dict[str, Any], warm_qa: float, spread: float, rag: dict[str, Any], stale_answers: int) -> dict[str, bool]:
    """The issue's targets for a trained policy's test result, given the spread its gain is measured against."""
    return {
        "trained_beats_warm_start_by_3_spread": trained["qa"] - warm_qa > 3 * spread,
        "trained_at_least_rag": trained["qa"] >= rag["qa"],
        "trained_half_rag_memory": trained["memory_tokens"] <= rag["memory_tokens"] / 2,
        "no_stale_conflict_answers": stale_answers == 0,
    }


def _sft_result(folder: Path) -> dict:
    path = folder / "sft_result.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def plot(results: dict[str, Any]) -> None:
    """learning.png: held-out extraction per SFT epoch, the GRPO curve with held-out QA, the comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (sft_ax, grpo_ax, bars) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1, 2, 1.4]})
    losses = results.get("sft_losses", [])
    sft_ax.plot(range(1, len(losses) + 1), losses, color="lightgray", label="training loss")
    epochs = results["sft_epochs"]
    for key in ("evidence_recall", "valid_calls", "skip_accuracy"):
        sft_ax.plot([e["step"] for e in epochs], [e[key] for e in epochs], marker="o", label=f"held-out {key} (per epoch)")
    sft_ax.set(xlabel="SFT step", ylim=(0, 1.05), title="Warm start: loss and held-out extraction")
    sft_ax.legend(fontsize=8)
    curve = results["curve"]
    steps = [p["step"] for p in curve]
    for key in ("reward", "rewards/coverage/mean", "rewards/retention/mean", "rewards/r2/mean", "qa_score"):
        grpo_ax.plot(steps, [p[key] for p in curve], label=key, alpha=0.8)
    held = [(0, p["warm_start/eval/qa_score"]) for p in curve[:1] if "warm_start/eval/qa_score" in p]
    held += [(p["step"], p["eval/qa_score"]) for p in curve if "eval/qa_score" in p]
    if held:
        grpo_ax.plot(*zip(*held), marker="s", color="black", label="held-out QA (validation, greedy)")
    grpo_ax.set(xlabel="GRPO step", title="GRPO (step-level)")
    grpo_ax.legend(fontsize=8)
    names = list(results["methods"])
    qa = [results["methods"][n]["qa"] for n in names]
    err = [results["methods"][n].get("qa_spread", 0.0) for n in names]
    bars.bar(names, qa, yerr=err, color=["tab:blue" if "qa_spread" in results["methods"][n] else "tab:gray" for n in names])
    for i, n in enumerate(names):
        bars.annotate(f"{results['methods'][n]['memory_tokens']:.0f} tok", (i, qa[i]), ha="center", va="bottom", fontsize=8)
    bars.set(ylabel="QA (plain mean over questions)", title="Held-out test comparison (greedy)")
    bars.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)


def _which_adapter(results: dict[str, Any]) -> str:
    """The report's sentence on which adapters `trained` and `trained_last` are."""
    if not results["grpo_steps"]:
        return "No GRPO step fit in the budget on this machine: `trained` is the warm start."
    selected = (f"`trained` is the adapter with the best validation QA: step {results['selected_step']} "
                f"(validation QA {results['selected_validation_qa']:.3f}; step 0 is the warm start)")
    if "trained_last" in results["methods"]:
        return selected + ", `trained_last` the last step's."
    if results["selected_step"] == results["grpo_steps"]:
        return selected + ", the last step's too."
    return selected + "; the last step's adapter was not evaluated: no time was left."


def to_markdown(results: dict[str, Any]) -> str:
    s, t = results["settings"], results["targets"]
    lines = [
        "# Benchmark: learning", "",
        f"{s['config']} with {' '.join(s['overrides'])}; B={s['B']}, G={s['G']}, lr {s['learning_rate']}. "
        f"Warm start: {results['sft_steps']} SFT steps, best epoch {results['sft_best_epoch']} "
        f"({s['warm_start_seconds']} s with setup"
        + (f"; the adapter was reused from {s['warm_start_reused_from']}, whose run trained it" if s.get("warm_start_reused_from") else "")
        + f"); {results['grpo_steps']} GRPO steps in {s['grpo_seconds']} s; "
        f"{s['total_seconds'] / 60:.1f} min in all (budget {s['budget_seconds'] / 60:.0f} min). " + _which_adapter(results), "",
        f"Held-out test: {s['test_instances']} instances ({s['test_questions']} questions) of "
        f"{', '.join(COMPETENCIES)}, {s['test_chunks']} chunks each, generator seed {s['test_seed']}; greedy; "
        f"{s['reader']} reader{READER_NOTE.get(s['reader'], '')}; {s['retrieval']}. qa_spread: {s['qa_spread']}.", "",
        "| method | qa | qa_spread | " + " | ".join(COMPETENCIES) + " | memory tokens | stale conflict answers | answers lost |",
        "|---|---|---|" + "---|" * len(COMPETENCIES) + "---|---|---|",
    ]
    for name, m in results["methods"].items():
        spread = f"{m['qa_spread']:.3f}" if "qa_spread" in m else ""
        lost = f"{m['answers_lost']:.2f}" if m.get("answers_lost") is not None else ""
        lines.append(f"| {name} | {m['qa']:.3f} | {spread} | "
                     + " | ".join(f"{m['qa_by_competency'][c]:.3f}" for c in COMPETENCIES)
                     + f" | {m['memory_tokens']:.0f} | {m['stale_answers']} | {lost} |")
    lines += ["", "Targets: " + ", ".join(f"{k}: {v}" for k, v in t.items()), "",
              "![SFT curve, GRPO curve, held-out comparison](learning.png)", "", "## Warm start (held-out extraction per epoch)", "",
              "| epoch | step | evidence recall | valid calls | skip accuracy |", "|---|---|---|---|---|"]
    for e in results["sft_epochs"]:
        lines.append(f"| {e['epoch']} | {e['step']} | {e['evidence_recall']:.3f} | {e['valid_calls']:.3f} | {e['skip_accuracy']:.3f} |")
    lines += ["", f"## Rule writer by completion budget (tokens a chunk; this run's: {s.get('completion_budget')})", "",
              "| budget | qa | " + " | ".join(COMPETENCIES) + " | memory tokens | stale conflict answers |",
              "|---|---|" + "---|" * len(COMPETENCIES) + "---|---|"]
    for budget, m in results.get("rule_writer_by_budget", {}).items():
        lines.append(f"| {budget} | {m['qa']:.3f} | " + " | ".join(f"{m['qa_by_competency'][c]:.3f}" for c in COMPETENCIES)
                     + f" | {m['memory_tokens']:.0f} | {m['stale_answers']} |")
    held = {name: m["conflict_memory"] for name, m in results["methods"].items() if "conflict_memory" in m}
    if held:
        lines += ["", "## Conflict questions by what the final memory holds", "",
                  "| method | current value only | both values | superseded only | neither |", "|---|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(str(c[state]) for state in CONFLICT_MEMORY_STATES) + " |" for name, c in held.items()]
    lines += ["", "`answers lost`: per instance, answers the memory held after some chunk and no longer held at the end.",
              "", "## GRPO curve", "",
              "| step | reward | coverage | retention | r2 | rollout QA | held-out QA | zero-std groups | step s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for p in results["curve"]:
        held = f"{p['eval/qa_score']:.3f}" if "eval/qa_score" in p else ""
        lines.append(f"| {p['step']} | {p['reward']:.3f} | {p['rewards/coverage/mean']:.3f} | {p['rewards/retention/mean']:.3f} | "
                     f"{p['rewards/r2/mean']:.3f} | "
                     f"{p['qa_score']:.3f} | {held} | {p['frac_reward_zero_std']:.2f} | {p['timing/step_s']:.0f} |")
    return "\n".join(lines) + "\n"
