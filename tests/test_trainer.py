"""The GRPO trainer with the tiny model: a step's outputs, checkpoints, exact resume, config-hash refusal."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_rollout import make_dataset, random_adapter, tiny_config  # noqa: F401  (fixture re-export)

from memalpha.errors import NoTrainingStep, UserError
from memalpha.training.checkpoint import SFT_DIR, read_best
from memalpha.training.trainer import METRICS_FILE, Trainer

VOLATILE = ("timing/", "throughput/", "eval/seconds", "warm_start/eval/seconds")


def _config(data_dir, *overrides):
    return tiny_config(data_dir, "sft.enabled=true", "grpo.learning_rate=0.05", "grpo.checkpoint_every=2", "grpo.steps=3",
                       *overrides)


@pytest.fixture(scope="module", autouse=True)
def varied_rewards():
    """Rewards that differ with the completion's length. The random tiny model never writes a valid call,
    so its real rewards all tie and no update would happen; these give every step a real gradient, so the
    resume tests cover optimizer and adapter state. The reward itself is tested in test_rewards.py."""
    from dataclasses import replace

    import memalpha.training.rollout as rollout

    real = rollout.score_episodes

    def score_episodes(episodes, *args, **kwargs):
        scores = real(episodes, *args, **kwargs)
        for episode, score in zip(episodes, scores):
            score.rewards = [replace(r, total=r.total + len(step.completion) % 7 / 7)
                             for r, step in zip(score.rewards, episode.steps)]
        return scores

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rollout, "score_episodes", score_episodes)
        yield


def _run_dir(tmp_path, adapter, name="run"):
    run = tmp_path / name
    (run / SFT_DIR).mkdir(parents=True)
    for f in adapter.iterdir():
        shutil.copy(f, run / SFT_DIR / f.name)  # an existing warm-start adapter is loaded, not retrained
    return run


def _stable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, random_adapter):  # noqa: F811
    """An uninterrupted 3-step run with checkpoints at steps 2 and 3."""
    tmp = tmp_path_factory.mktemp("trainer")
    data = make_dataset(tmp / "data")
    run = _run_dir(tmp, random_adapter)
    trainer = Trainer(_config(data), run)
    results = []
    trainer.train(results.append)
    return data, run, trainer, results


def test_step_outputs_and_metric_names(finished):
    _, run, trainer, results = finished
    first = results[0]
    assert [r.step for r in results] == [1, 2, 3] and trainer.step == 3
    for key in ("reward", "reward_std", "rewards/r1/mean", "rewards/r4/mean", "frac_reward_zero_std", "loss",
                "clip_ratio", "entropy", "grad_norm", "learning_rate", "completions/mean_length",
                "completions/clipped_ratio", "tool_calls/per_chunk", "tool_calls/success_rate",
                "tool_calls/memory_insert", "memory/tokens", "memory/entries", "timing/generate_s",
                "timing/reward_s", "timing/update_s", "throughput/generated_tokens_per_s"):
        assert key in first.metrics, key
    # B=2 instances x G=2 rollouts x 2 chunks (max_chunks_per_instance=2)
    assert first.samples.height == 8 and first.metrics["generate_calls"] == 2
    assert {"instance", "instance_id", "rollout", "chunk", "prompt", "completion", "parsed_calls", "results",
            "r1", "r2", "r3", "r4", "reward", "advantage"} <= set(first.samples.columns)
    assert len(first.memories) == 4 and first.trace["name"] == "rollout"
    assert first.metrics["grad_norm"] > 0
    lines = [json.loads(x) for x in (run / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert results[0].metrics["learning_rate"] < results[1].metrics["learning_rate"]  # warmup_steps=1


def test_checkpoint_contents_and_updates_change_the_adapter(finished):
    _, run, _, _ = finished
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step-000002", "step-000003"]
    ckpt = run / "checkpoints" / "step-000002"
    for name in ("adapter/adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "state.json"):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 2 and len(state["metrics"]) == 2 and state["data_position"]["position"] == 4
    a = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    b = load_file(run / "checkpoints" / "step-000003" / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def resume_third_step(config, run, results, tmp_path):
    """Resume a copy of `run` from its step-2 checkpoint, run step 3, check it against the uninterrupted
    step 3 (metrics and completions) and return it with the copy's folder."""
    copy = tmp_path / "resumed"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-000003")
    trainer = Trainer(config, copy)
    assert trainer.maybe_resume() and trainer.step == 2
    result = trainer.train_step()
    expected, got = _stable(results[2].metrics), _stable(result.metrics)
    assert expected.keys() == got.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert result.samples["completion"].to_list() == results[2].samples["completion"].to_list()
    return result, copy


def test_resume_reproduces_the_uninterrupted_run(finished, tmp_path):
    data, run, _, results = finished
    _, copy = resume_third_step(_config(data), run, results, tmp_path)
    assert [json.loads(x)["step"] for x in (copy / METRICS_FILE).read_text().splitlines()] == [1, 2, 3]


def test_resume_refuses_a_changed_training_config(finished):
    data, run, _, _ = finished
    changed = Trainer(_config(data, "grpo.epsilon=0.3"), run)
    with pytest.raises(UserError, match=r"grpo\.epsilon"):
        changed.maybe_resume()
    assert Trainer(_config(data, "grpo.epsilon=0.3"), run, force=True).maybe_resume()
    # more steps is not a different training computation
    assert Trainer(_config(data, "grpo.steps=5"), run).maybe_resume()


def test_a_time_budget_ends_training_at_the_last_step_that_fits_and_evaluates_it(finished, tmp_path, monkeypatch):
    data, run, _, _ = finished
    clock = [1000.0]
    monkeypatch.setattr("memalpha.training.trainer.time.time", lambda: clock[0])
    # 300 s of budget; each step advances the clock 100 s and really takes far less, even on a loaded
    # machine: after step 3 (at 1300 s) another step would end past the deadline
    trainer = Trainer(_config(data, "grpo.steps=5", "grpo.eval_every=5", "time_budget_minutes=5"),
                      _run_dir(tmp_path, run / SFT_DIR))
    step = trainer.train_step

    def hundred_second_step():
        clock[0] += 100.0
        return step()

    trainer.train_step = hundred_second_step
    results = []
    last = trainer.train(results.append)
    assert [r.step for r in results] == [1, 2, 3] and trainer.stopped_early
    assert last.name == "step-000003" and last.is_dir()
    assert "eval/qa_score" in results[2].metrics and "eval/qa_score" not in results[1].metrics
    # started past the deadline: the warm start is checked (with progress lines), then the run fails before
    # step 1, saying so with the load average and how to give it more time (10 min spent + 5 of budget)
    late = Trainer(_config(data, "grpo.steps=5", "time_budget_minutes=5"), _run_dir(tmp_path, run / SFT_DIR, "late"),
                   started=clock[0] - 600)
    said, results = [], []
    late.say = said.append
    with pytest.raises(NoTrainingStep, match=r"no GRPO step fits the time budget: time_budget_minutes=5 was spent") as error:
        late.train(results.append)
    message = str(error.value)
    assert re.search(r"10m 00s since the run began, .* load average [0-9.]+, [0-9.]+, [0-9.]+ on \d+ CPUs", message), message
    assert "`--set time_budget_minutes=15`; `MEMALPHA_TRAIN_MINUTES=15 make train`" in message
    assert results == [] and late.step == 0 and not (late.run_dir / "checkpoints").exists()
    assert "warm_start/eval/qa_score" in error.value.held_out  # the check it made, for the run to show
    assert said[0].startswith("held-out check of the warm start: measuring it, as ") and "no record.json" in said[0]
    assert any(line.startswith("held-out check at step 0: ") and "ETA" in line for line in said)
    assert said[-1].startswith("held-out QA of the warm start: ")


def test_the_first_step_finishes_when_the_budget_runs_out_inside_it(finished, tmp_path, monkeypatch):
    import memalpha.training.trainer as trainer_module

    data, run, _, _ = finished
    clock = [1000.0]
    monkeypatch.setattr("memalpha.training.trainer.time.time", lambda: clock[0])
    collect = trainer_module.collect_rollouts

    def slow_rollouts(*args, **kwargs):
        if not kwargs.get("greedy"):  # the training rollouts, not the held-out checks
            clock[0] += 600  # the 5-minute budget runs out while step 1 writes
        return collect(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "collect_rollouts", slow_rollouts)
    trainer = Trainer(_config(data, "grpo.steps=5", "time_budget_minutes=5"), _run_dir(tmp_path, run / SFT_DIR))
    results = []
    last = trainer.train(results.append)
    # step 1 is finished, evaluated and checkpointed; the budget stops the run before step 2
    assert [r.step for r in results] == [1] and trainer.stopped_early and last.name == "step-000001"
    assert "eval/qa_score" in results[0].metrics and trainer.budget_stop == "5.0 min spent: stopped after step 1 of 5"


def test_a_long_step_says_where_it_is_at_least_every_heartbeat():
    import time

    from memalpha.progress import StepProgress

    lines = []
    with StepProgress(2, 8, 16, lines.append, heartbeat=0.2) as progress:
        progress(4)
        time.sleep(0.5)
        progress(12)  # written: scoring follows
        time.sleep(0.5)
        progress.updating()
        time.sleep(0.5)
    kinds = [re.sub(r"\d+s so far$", "", re.sub(r"done in \d+s", "done", line)) for line in lines]
    assert kinds[0] == "grpo step 2/8: rollouts 4/16 chunks, " and kinds[-1] == "grpo step 2/8: rollouts done, updating, ", lines
    assert "grpo step 2/8: rollouts 16/16 chunks, scoring them, " in kinds, lines
    count = len(lines)
    time.sleep(0.3)
    assert len(lines) == count  # nothing once the step is over
    with StepProgress(1, 8, 16, lines.append, heartbeat=5) as progress:  # a short step says nothing
        progress(16)
    assert len(lines) == count


def test_the_step_line_shows_what_the_sampling_optimises():
    from memalpha.progress import StepMeter, grpo_line

    metrics = {"reward": 1.5, "qa_score": 0.25, **{f"rewards/{k}/mean": v for k, v in {
        "r1": 0.0, "r2": 0.9, "r3": 0.0, "r4": 0.8, "coverage": 0.5, "retention": 0.95, "r2_gated": 0.45, "r4_gated": 0.4}.items()}}
    step = grpo_line(3, 8, metrics, StepMeter(8, 3), sampling="step")
    assert step.startswith("grpo step 3/8 | reward 1.500 (coverage 0.50 retention 0.95 gated r2 0.45 gated r4 0.40) "
                           "| trajectory QA 0.250 | starting")
    assert "r1" not in step and "r3" not in step
    trajectory = grpo_line(3, 8, {**metrics, "eval/qa_score": 0.5}, StepMeter(8, 3), warm_start_qa=0.4, sampling="trajectory")
    assert trajectory.startswith("grpo step 3/8 | reward 1.500 (r1 0.00 r2 0.90 r3 0.00 r4 0.80 coverage 0.50 retention 0.95) "
                                 "| held-out QA 0.500 (warm start 0.400)")


def test_evaluate_is_greedy_and_does_not_touch_training_randomness(finished):
    _, _, trainer, _ = finished
    state = trainer.generator.get_state()
    first, second = trainer.evaluate(), trainer.evaluate()
    assert torch.equal(state, trainer.generator.get_state())
    assert _stable(first) == _stable(second)
    assert first["eval/instances"] == 2 and "eval/qa_score" in first


def test_validation_keeps_the_adapter_with_the_best_qa(finished, monkeypatch):
    _, run, trainer, results = finished
    warm, final = results[0].metrics["warm_start/eval/qa_score"], results[-1].metrics["eval/qa_score"]
    kept = {"step": 3, "score": final} if final > warm else {"step": 0, "score": warm}  # ties keep the earlier
    assert read_best(run) == kept and results[-1].metrics["best/step"] == kept["step"]
    assert trainer.best_adapter == run / "best" / "adapter"

    weights = run / "best" / "adapter" / "adapter_model.safetensors"
    lora = trainer.policy.trainable_parameters()[0]
    original = lora.detach().clone()
    scores = iter([kept["score"] + 1.0, kept["score"] + 0.5])
    monkeypatch.setattr(trainer, "evaluate", lambda split="validation": {"eval/qa_score": next(scores)})
    try:
        previous = weights.read_bytes()
        with torch.no_grad():
            lora.add_(1.0)
        better = trainer.validate()
        assert better["best/step"] == 3 and read_best(run)["score"] == kept["score"] + 1.0
        assert weights.read_bytes() != previous
        previous = weights.read_bytes()
        with torch.no_grad():
            lora.add_(1.0)
        worse = trainer.validate()  # a lower score leaves the kept adapter as it was
        assert worse["best/qa_score"] == kept["score"] + 1.0 and weights.read_bytes() == previous
    finally:
        with torch.no_grad():
            lora.copy_(original)


@pytest.mark.slow
def test_one_real_step_with_the_default_model(tmp_path):
    from memalpha.config import load_config

    data = make_dataset(tmp_path / "data")
    config = load_config(None, [
        f"data.train_path={data}", "sft.enabled=false", "rollout.instances_per_step=1", "rollout.num_generations=2",
        "rollout.max_completion_length=24", "data.max_chunks_per_instance=1",
    ])
    trainer = Trainer(config, tmp_path / "run")
    result = trainer.train_step()
    assert result.samples.height == 2 and result.metrics["completions/mean_length"] > 0
    assert result.metrics["throughput/generated_tokens_per_s"] > 0
    assert trainer.save_checkpoint().is_dir()


def test_train_cli_writes_checkpoints_metrics_and_refuses_a_changed_config(tmp_path, capsys):
    from test_rollout import CONFIG

    from memalpha.cli import main

    data = make_dataset(tmp_path / "data")
    args = ["train", "--config", str(CONFIG), "--set", f"data.train_path={data}", "--set", "sft.eval_chunks=2",
            "--set", f"output_dir={tmp_path / 'run'}", "--set", "grpo.steps=2", "--set", "grpo.eval_every=2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    # a progress line per warm-start step, per held-out extraction check and per GRPO step, with rate and ETA
    assert re.search(r"^warm start step 1/1 \| loss [0-9.]+ \| [0-9.]+ s/step \| ETA 0s$", printed, re.M), printed
    assert re.search(r"^warm start epoch 1 held-out extraction: valid_calls [0-9.]+, evidence_recall", printed, re.M)
    assert re.search(r"^grpo step 1/2 \| reward -?[0-9.]+ \(r1 [0-9.]+ r2 .*\) \| [0-9.]+ s/step \| ETA \d", printed, re.M)
    assert re.search(r"^grpo step 2/2 \| .* \| held-out QA [0-9.]+ \(warm start [0-9.]+\) \| .* ETA 0s$", printed, re.M)
    lines = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    # one line per step; the held-out evaluation rides in the lines of evaluation steps (kept on resume)
    assert [x["step"] for x in lines] == [1, 2] and "eval/qa_score" in lines[-1] and "eval/qa_score" not in lines[0]
    assert "warm_start/eval/qa_score" in lines[0]
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "state.json").is_file()
    assert main(args + ["--set", "grpo.learning_rate=0.5"]) == 2
    assert "grpo.learning_rate" in capsys.readouterr().err


