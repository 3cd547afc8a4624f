"""The LLM-reader report's wiring of a writer of another policy (the 0.5B): found when trained, written by its
own policy, its sizes counted like every other method's, and its targets read from the paired intervals."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.bench_real_llm as real_llm
from bench.bench_real import seeds_mean
from memalpha.config import DEFAULT_POLICY, load_config
from memalpha.training.checkpoint import SFT_DIR, checkpoint_dir, policy_adapter


def test_the_students_adapters_are_found_once_they_exist(tmp_path, monkeypatch):
    monkeypatch.setattr(real_llm, "run_root", lambda policy: tmp_path / policy)
    monkeypatch.setattr(real_llm, "SEEDS", (0, 1))
    assert real_llm.student_adapters() == {}
    root = tmp_path / real_llm.STUDENT
    for folder in (root / "warm-start" / SFT_DIR, policy_adapter(checkpoint_dir(root / "seed1", real_llm.STEPS))):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"weights")
    policy_adapter(checkpoint_dir(root / "seed0", 3)).mkdir(parents=True)  # a seed short of its last step
    assert set(real_llm.student_adapters()) == {"warm_start_0.5b", "trained_0.5b_seed1"}


def test_a_student_writes_with_its_policy_and_is_counted_with_the_recipes(tmp_path, monkeypatch):
    seen = []

    class Built(Exception):
        pass

    def build(config, instances, method, adapter, folder, counting=None):
        seen.append((method, adapter, config.model.policy, counting.model.policy))
        raise Built

    monkeypatch.setattr(real_llm, "build", build)
    config = load_config(None)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    for name in ("trained_0.5b_seed0", "rag"):
        with pytest.raises(Built):
            real_llm.answered(config, [], name, set(), tmp_path, {"trained_0.5b_seed0": adapter}, "tag",
                              {"trained_0.5b_seed0": real_llm.STUDENT})
    assert seen == [("policy", adapter, real_llm.STUDENT, DEFAULT_POLICY), ("rag", None, DEFAULT_POLICY, DEFAULT_POLICY)]


def _method(qa: float, f1: float, tokens: float) -> dict:
    return {"qa": qa, "f1": f1, "by_category": {"single_hop": {"qa": qa, "f1": f1}}, "memory_tokens": tokens, "minutes": 1.0}


def test_targets_follow_the_intervals_and_skip_what_did_not_run():
    seeds = [_method(0.30, 0.30, 1000), _method(0.32, 0.32, 1100)]
    report = {"methods": {"trained_0.5b": seeds_mean(seeds), "rag": _method(0.25, 0.37, 4000),
                          "llm_writer_0.5b": _method(0.10, 0.25, 900), "shipped_writer": _method(0.10, 0.15, 500)},
              "trained_minus": {"rag": {"diff": 0.06, "ci95": [-0.01, 0.10]},
                                "llm_writer_0.5b": {"diff": 0.20, "ci95": [0.10, 0.30]},
                                "shipped_writer": {"diff": 0.20, "ci95": [-0.02, 0.30]}}}
    met = real_llm.targets(report)
    assert met == {
        "trained 0.5B > BM25 RAG top-2 with <= 25% of its memory tokens": False,  # 1,050 tokens > 25% of 4,000
        "trained 0.5B > untrained 0.5B llm_writer (paired 95% interval above 0)": True,
        "trained 0.5B F1 >= 1.5x the untrained 0.5B's": False,  # 0.31 < 1.5 x 0.25
        "ships: trained 0.5B > the shipped 135M writer (paired 95% interval above 0)": False,
    }, "the warm start and the 1.5B writer did not run: no verdict on them"


def test_the_learning_sample_takes_the_same_questions_of_every_conversation_each_run():
    from bench.bench_learning_llm import sample
    from memalpha.data.schema import Instance, Question

    instances = [Instance(f"i{n}", "synthetic", "accurate_retrieval" if n % 2 else "conflict_resolution", ["chunk"],
                          [Question(f"q{k}", "?", ["a"], "single_hop") for k in range(6 if n else 1)]) for n in range(4)]
    chosen = sample(instances, per_instance=2, seed=0)
    assert len(chosen) == 1 + 3 * 2, "every question of a conversation with fewer, two of each other"
    assert {i for i, _ in chosen} == {"i0", "i1", "i2", "i3"}
    assert sample(instances, per_instance=2, seed=0) == chosen != sample(instances, per_instance=2, seed=1)
