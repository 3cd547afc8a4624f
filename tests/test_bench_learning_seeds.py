"""The learning-over-seeds benchmark: its summary over seeds, its targets, its report, and a real run of
the tiny model (two seeds, two test steps) that resumes an interrupted seed without redoing finished work."""

import json
import shutil

import pytest
import torch
from test_rollout import CONFIG as TINY_CONFIG
from test_rollout import make_dataset

from bench import BenchmarkSkipped
from bench import bench_learning as learning
from bench import bench_learning_seeds as seeds
from memalpha.training.checkpoint import checkpoint_dir
from memalpha.training.trainer import Trainer


def _test(qa, tokens=100.0, stale=0, ar=None):
    return {"qa": qa, "qa_by_competency": {"accurate_retrieval": qa if ar is None else ar, "conflict_resolution": qa},
            "memory_tokens": tokens, "stale_answers": stale}


def test_the_mean_over_seeds_and_its_spread_decide_the_targets():
    step = seeds.summarize([_test(0.40, 200, 1, ar=0.6), _test(0.30, 100, 0, ar=0.4), _test(0.35, 150, 0, ar=0.5)])
    assert step["qa"] == pytest.approx(0.35) and step["qa_spread"] == pytest.approx(0.05)  # ddof 1
    assert step["qa_by_competency"]["accurate_retrieval"] == pytest.approx(0.5)
    assert step["memory_tokens"] == pytest.approx(150) and step["stale_answers_seeds"] == [1, 0, 0]

    rag = _test(0.35, 400)
    assert seeds.targets(step, _test(0.19), rag) == {
        "trained_beats_warm_start_by_3_spread": True, "trained_at_least_rag": True,
        "trained_half_rag_memory": True, "no_stale_conflict_answers": False}
    # a gain of 0.15 against 3 spreads of 0.15 is not above them; one stale answer of any seed counts
    assert not seeds.targets(step, _test(0.20), rag)["trained_beats_warm_start_by_3_spread"]
    assert seeds.targets(step, _test(0.20), _test(0.36, 299)) == {
        "trained_beats_warm_start_by_3_spread": False, "trained_at_least_rag": False,
        "trained_half_rag_memory": False, "no_stale_conflict_answers": False}


def test_report_shows_each_seed_at_each_step_beside_the_baselines():
    tests = {0: {20: _test(0.30), 40: _test(0.40, stale=2)}, 1: {20: _test(0.20), 40: _test(0.30, stale=1)}}
    by_step = {step: seeds.summarize([tests[s][step] for s in tests]) for step in (20, 40)}
    methods = {"warm_start": _test(0.25), "rule_writer": _test(0.8), "rag": _test(0.45, 1900), "long_context": _test(0.5, 1000)}
    results = {"methods": methods, "by_step": by_step, "seeds": {s: {"tests": t, "curve": []} for s, t in tests.items()},
               "targets": seeds.targets(by_step[40], methods["warm_start"], methods["rag"]),
               "settings": {"config": "configs/default.yaml", "overrides": ["grpo.seed=0"], "seeds": [0, 1], "steps": [20, 40],
                            "warm_start": "runs/bench-learning/sft", "test_instances": 48, "test_questions": 288,
                            "test_seed": 7, "reader": "evidence", "qa_spread": "std over 2 training seeds (ddof 1)",
                            "total_seconds_this_run": 600.0}}
    report = seeds.to_markdown(results)
    assert "| warm_start | 0.250 |  | 0.250 | 0.250 | 100 | 0 |" in report
    assert "| trained, step 40 (mean over seeds) | 0.350 | 0.071 | 0.350 | 0.350 | 100 | 1.5 |" in report
    assert "| rag | 0.450 |  | 0.450 | 0.450 | 1900 | 0 |" in report
    assert "| 0 | 0.300 | 0.400 | 100, 2 |" in report and "| 1 | 0.200 | 0.300 | 100, 1 |" in report
    assert "Targets at step 40: trained_beats_warm_start_by_3_spread: False" in report
    assert "(gain +0.100, 3 spreads 0.212)" in report


def test_on_a_cpu_it_is_skipped_unless_asked_and_one_seed_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(seeds, "ON_CPU", False)
    with pytest.raises(BenchmarkSkipped, match="MEMALPHA_BENCH_SEEDS_ON_CPU=1"):
        seeds.run()
    monkeypatch.setattr(seeds, "ON_CPU", True)
    monkeypatch.setattr(seeds, "SEEDS", (0,))
    with pytest.raises(ValueError, match="MEMALPHA_BENCH_SEEDS=0: a spread over seeds needs at least 2"):
        seeds.run()


def test_two_tiny_seeds_train_test_and_resume_without_redoing_finished_work(tmp_path, monkeypatch):
    data = make_dataset(tmp_path / "data")
    monkeypatch.setattr(seeds, "ON_CPU", True)
    monkeypatch.setattr(seeds, "SEEDS", (0, 1))
    monkeypatch.setattr(seeds, "STEPS", (1, 2))
    monkeypatch.setattr(seeds, "TEST_INSTANCES", 2)  # one of each competency
    monkeypatch.setattr(seeds, "RUN_ROOT", tmp_path / "runs")
    monkeypatch.setattr(seeds, "PLOT", tmp_path / "learning_seeds.png")
    monkeypatch.setattr(seeds, "CONFIG", TINY_CONFIG)
    monkeypatch.setattr(learning, "training_data", lambda: data)
    # the tiny model on the test dataset, with a short warm start trained by seed 0's run and 2 rollouts a group
    monkeypatch.setattr(learning, "EXTRA_OVERRIDES", [f"data.train_path={data}", "data.competencies=[accurate_retrieval]",
                                                      "sft.enabled=true", "sft.num_demonstrations=4", "sft.eval_chunks=2",
                                                      "rollout.num_generations=2", "rollout.max_completion_length=16"])
    results = seeds.run()

    assert list(results["by_step"]) == [1, 2] and set(results["seeds"]) == {0, 1}
    for step, summary in results["by_step"].items():
        qa = [results["seeds"][s]["tests"][step]["qa"] for s in (0, 1)]
        assert summary["qa_seeds"] == qa and summary["qa"] == pytest.approx(sum(qa) / 2)
    assert [p["step"] for p in results["seeds"][1]["curve"]] == [1, 2]
    assert set(results["methods"]) == {"warm_start", "rule_writer", "rag", "long_context"}
    assert (tmp_path / "learning_seeds.png").stat().st_size > 0
    seed0, seed1 = tmp_path / "runs" / "seed0", tmp_path / "runs" / "seed1"
    weights = "sft/adapter_model.safetensors"
    assert (seed1 / weights).read_bytes() == (seed0 / weights).read_bytes()  # one warm start, trained by seed 0's run
    assert json.loads((seed1 / "test-2" / "step-2.json").read_text()) == results["seeds"][1]["tests"][2]

    # seed 1 stopped after step 1: only its last step is trained and tested again, from its step-1 checkpoint
    shutil.rmtree(checkpoint_dir(seed1, 2))
    (seed1 / "test-2" / "step-2.json").unlink()
    trained, tested = [], []
    train_step, compare = Trainer.train_step, learning.compare
    monkeypatch.setattr(Trainer, "train_step", lambda self: trained.append(self.config.grpo.seed) or train_step(self))
    monkeypatch.setattr(learning, "compare", lambda config, instances, method, model=None:
                        tested.append((method, model)) or compare(config, instances, method, model))
    again = seeds.run()
    assert trained == [1]
    assert [m for m, _ in tested] == ["policy", "rule_writer", "rag", "long_context"]
    assert str(tested[0][1]).startswith(str(checkpoint_dir(seed1, 2)))
    def timeless(test):
        return {k: v for k, v in test.items() if k != "seconds"}

    # the resumed step's memories equal the uninterrupted one's
    assert timeless(again["seeds"][1]["tests"][2]) == timeless(results["seeds"][1]["tests"][2])
