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


def _rows(scores: dict[str, float]) -> dict:
    return {"rows": [{"instance_id": "conv", "question_id": q, "score": s, "f1": s, "question_type": "single_hop"}
                     for q, s in scores.items()],
            "instances": [{"memory_tokens": 10}], "build_seconds": 6.0, "answer_seconds": 6.0}


def test_a_machine_without_the_caches_reuses_the_report_of_records_rows(tmp_path, monkeypatch):
    import json

    import bench.llama_server
    import memalpha.models.llamacpp

    def no_server(*args, **kwargs):
        raise AssertionError("no method needed a server")

    monkeypatch.setattr(bench.llama_server, "local_llama_server", no_server)
    monkeypatch.setattr(real_llm, "answered", lambda *args: pytest.fail("a recorded or cached method was redone"))
    adapter = tmp_path / "writer"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    (tmp_path / "tag").mkdir()
    (tmp_path / "tag" / "rag.json").write_text(json.dumps(_rows({"q1": 1.0, "q2": 0.0})))  # this machine's cache
    spec = {"reader": "r", "per_cell": 4, "seed": 0, "data": "d"}
    record = tmp_path / "real_llm.json"
    shipped = real_llm.method_key("policy", adapter)
    results = {"spec": spec, "methods": {"no_memory": _method(0.0, 0.0, 0), "shipped_writer": _method(0.5, 0.5, 10)},
               "keys": {"no_memory": "no_memory", "shipped_writer": shipped},
               "scores": {"shipped_writer": {"conv": {"q1": 1.0, "q2": 1.0}}},
               "minus_rag": {"no_memory": {"diff": -0.5, "ci95": [-1.0, 0.0]}}}
    record.write_text(json.dumps({"results": results}))
    assert real_llm.recorded_methods(record, {**spec, "data": "other"}) == {}, "another sample or data: nothing reused"
    report, scores = real_llm.answer_methods(
        load_config(None), [], set(), tmp_path, ("rag", "no_memory", "shipped_writer"), {"shipped_writer": adapter},
        "tag", tmp_path / "state", recorded=real_llm.recorded_methods(record, spec))
    assert report["from_record"] == ["no_memory", "shipped_writer"]
    assert report["methods"]["shipped_writer"]["qa"] == 0.5 and scores["shipped_writer"][("conv", "q2")] == 1.0
    assert report["minus_rag"]["shipped_writer"]["diff"] == 0.5, "paired with this machine's rag by question"
    assert report["minus_rag"]["no_memory"]["diff"] == -0.5, "no scores recorded: the record's own interval"
    assert report["scores"]["rag"] == {"conv": {"q1": 1.0, "q2": 0.0}}
    assert real_llm._decoded(report["scores"]["rag"]) == {("conv", "q1"): 1.0, ("conv", "q2"): 0.0}
    alone, _ = real_llm.answer_methods(load_config(None), [], set(), tmp_path, ("rag",), {}, "tag", tmp_path / "state",
                                       recorded=real_llm.recorded_methods(record, spec))
    assert list(alone["methods"]) == ["rag", "no_memory", "shipped_writer"], "a run of fewer methods keeps the record's"

    (adapter / "adapter_model.safetensors").write_bytes(b"retrained")  # other weights: the row is stale
    called = []
    monkeypatch.setattr(real_llm, "answered", lambda config, instances, name, *rest: called.append(name) or
                        tmp_path / "tag" / "rag.json")
    monkeypatch.setattr(memalpha.models.llamacpp, "check_server", lambda name: None)  # "up": nothing to start
    real_llm.answer_methods(load_config(None), [], set(), tmp_path, ("shipped_writer",), {"shipped_writer": adapter},
                            "tag", tmp_path / "state", recorded=real_llm.recorded_methods(record, spec))
    assert called == ["shipped_writer"]


def test_rag_without_recorded_scores_is_made_again_for_a_new_row_to_pair_with(tmp_path, monkeypatch):
    import json

    import memalpha.models.llamacpp

    monkeypatch.setattr(memalpha.models.llamacpp, "check_server", lambda name: None)  # "up": nothing to start
    made = []

    def answered(config, instances, name, keep, folder, adapters, tag, policies):
        made.append(name)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(_rows({"q1": 1.0 if name == "rag" else 0.0})))
        return path

    monkeypatch.setattr(real_llm, "answered", answered)
    recorded = {"rag": {"key": "rag", "summary": _method(1.0, 1.0, 10), "scores": None, "minus_rag": None},
                "no_memory": {"key": "no_memory", "summary": _method(0.0, 0.0, 0), "scores": None,
                              "minus_rag": {"diff": -1.0, "ci95": [-1.0, -1.0]}}}
    args = (load_config(None), [], set(), tmp_path, ("rag", "no_memory"), {}, "tag", tmp_path / "state")
    real_llm.answer_methods(*args, recorded=recorded)
    assert made == [], "nothing new: the record's rows as they are"
    report, _ = real_llm.answer_methods(*args[:4], ("rag", "no_memory", "llm_writer_1.5b"), *args[5:], recorded=recorded)
    assert made == ["rag", "llm_writer_1.5b"] and report["from_record"] == ["no_memory"]
    assert report["minus_rag"]["llm_writer_1.5b"]["diff"] == -1.0


def test_a_new_trained_seed_makes_again_every_row_it_cannot_pair_with():
    def row(scores):
        return {"key": "k", "summary": {}, "scores": scores, "minus_rag": {"diff": 0.0}}

    recorded = {"rag": row(None), "no_memory": row(None), "shipped_writer": row({("c", "q"): 1.0})}
    names = ["rag", "no_memory", "shipped_writer", "trained_0.5b_seed0"]
    assert real_llm.reusable(names, {"trained_0.5b_seed0"}, recorded) == {"shipped_writer"}
    assert real_llm.reusable(names[:3], set(), recorded) == set(names[:3]), "nothing new: the record's rows as they are"
    recorded["shipped_writer"]["minus_rag"] = None
    assert real_llm.reusable(names[:3], set(), recorded) == {"no_memory", "shipped_writer"}, \
        "a row without its interval: RAG's scores are made to pair it"
