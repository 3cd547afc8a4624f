"""The learning benchmark: conflict questions by what each memory holds, the seeds' mean and its targets
under both readers, the report, and a real run of the tiny model (two seeds, two readers) that resumes an
interrupted seed and adds a missing reader without redoing finished work."""

import json
import shutil

import pytest
import torch
from test_rollout import CONFIG as TINY_CONFIG
from test_rollout import make_dataset

from bench import BenchmarkSkipped
from bench import bench_learning as learning
from memalpha.data.schema import Instance, Question
from memalpha.memory import MemoryStore
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.teacher import record
from memalpha.training.checkpoint import checkpoint_dir
from memalpha.training.trainer import Trainer


def _instance(instance_id: str) -> Instance:
    moved = Question(f"{instance_id}-q", "Where does Ana live now?", ["Paris"], "conflict", [1], ["Lyon"])
    plain = Question(f"{instance_id}-r", "What is Ana's job?", ["nurse"], "single_hop", [0])
    return Instance(instance_id, "synthetic", "conflict_resolution", ["Ana lives in Lyon.", "Ana moved to Paris."], [moved, plain])


def _memory(instance_id: str, *entries: str) -> dict:
    store = MemoryStore(MEMALPHA_SCHEMA)
    for chunk, content in enumerate(entries):
        store.insert("semantic", content, chunk)
    return {"method": "policy", "seed": 0, "instance_id": instance_id, "memory": store.to_dict()}


def test_conflict_questions_are_counted_by_the_values_their_memory_asserts():
    instances = [_instance(name) for name in ("updated", "shadowed", "missed", "empty", "cued", "unbuilt")]
    memories = [
        _memory("updated", "Ana lives in Paris."),
        _memory("shadowed", "Ana lives in Lyon.", "Ana lives in Paris."),
        _memory("missed", "Ana lives in Lyon.", "Ana is a nurse."),
        _memory("empty"),
        _memory("cued", "Ana moved from Lyon to Paris."),  # "from Lyon" marks the old value as obsolete
    ]
    counts = learning.conflict_memory_counts(instances, memories)
    assert counts == {"current": 2, "both": 1, "superseded": 1, "neither": 1}  # the unbuilt instance and plain questions are not counted


def _test(qa, tokens=100.0, stale=0, ar=None):
    return {"qa": qa, "qa_by_competency": {"accurate_retrieval": qa if ar is None else ar, "conflict_resolution": qa},
            "memory_tokens": tokens, "stale_answers": stale}


def _reader(trained, warm=0.2, rag=0.3, long_context=0.3, rule_stale=1, rag_tokens=1000.0):
    return {"warm_start": _test(warm), "trained": trained, "rule_writer": _test(0.8, stale=rule_stale),
            "rag": _test(rag, rag_tokens), "long_context": _test(long_context, 1000.0), "no_memory": _test(0.0, 0.0)}


def test_the_mean_over_seeds_and_its_std_decide_the_targets_under_each_reader():
    trained = learning.summarize([_test(0.40, 200, 1, ar=0.6), _test(0.30, 100, 0, ar=0.4), _test(0.35, 150, 2, ar=0.5)])
    assert trained["qa"] == pytest.approx(0.35) and trained["qa_seed_std"] == pytest.approx(0.05)  # ddof 1
    assert trained["qa_seeds"] == [0.40, 0.30, 0.35] and trained["qa_by_competency"]["accurate_retrieval"] == pytest.approx(0.5)
    assert trained["memory_tokens"] == pytest.approx(150) and trained["stale_answers"] == pytest.approx(1.0)

    met = learning.targets({"evidence": _reader(trained, rag=0.35), "local": _reader(trained)})
    assert met == {"evidence: trained above warm start by 3 seed stds": False,  # a gain of 0.15 is not above 3 x 0.05
                   "local: trained above warm start by 3 seed stds": False,
                   "local: trained above RAG top-2": True, "local: trained above long context": True,
                   "trained memory at most 20% of RAG's": True, "local: no more stale answers than the rule writer": True,
                   "evidence: trained at least RAG top-2": True}
    missed = learning.targets({"local": _reader(trained, warm=0.19, rag=0.36, long_context=0.35, rule_stale=0, rag_tokens=749.0)})
    assert missed == {"local: trained above warm start by 3 seed stds": True, "local: trained above RAG top-2": False,
                      "local: trained above long context": False, "trained memory at most 20% of RAG's": False,
                      "local: no more stale answers than the rule writer": False}


def test_the_report_has_a_table_per_reader_the_targets_and_each_seeds_curve():
    trained = learning.summarize([_test(0.30, stale=2), _test(0.20, stale=1)])
    readers = {"evidence": {**_reader(trained), "trained_seed0": _test(0.30, stale=2)}, "local": _reader(trained, rag=0.1)}
    readers["evidence"]["rag"]["conflict_memory"] = {"current": 3, "both": 2, "superseded": 1, "neither": 0}
    readers["evidence"]["trained_seed0"]["conflict_memory"] = {"current": 1, "both": 0, "superseded": 0, "neither": 5}
    results = {"readers": readers, "targets": learning.targets(readers),
               "curves": {0: [{"step": 1, "reward": 1.0, "coverage": 0.5}, {"step": 2, "reward": 1.5, "coverage": 0.6, "validation_qa": 0.25}]},
               "settings": {"config": "RunConfig() (the recipe)", "overrides": ["grpo.seed=0"], "seeds": [0, 1], "steps": 2,
                            "warm_start": "adapters/warm-start", "test_instances": 48, "test_questions": 288, "test_seed": 7,
                            "readers": {r: learning.READER_NOTES[r] for r in ("evidence", "local")}, "retrieval": "bm25",
                            "qa_seed_std": "std over 2 training seeds (ddof 1)", "grpo_seconds_this_run": 120.0,
                            "warm_start_seconds": 4249.0, "total_seconds_this_run": 600.0}}
    report = learning.to_markdown(results)
    evidence, local = report.split("## Evidence reader")[1].split("## Local reader")
    assert "| trained | 0.250 | 0.071 | 0.250 | 0.250 | 100 | 1.5 |" in evidence
    assert "| trained_seed0 | 0.300 |  | 0.300 | 0.300 | 100 | 2 |" in evidence
    assert "| rag | 0.100 |  |" in local and "| rag | 0.300 |  |" in evidence
    assert "| local: trained above RAG top-2 | met |" in report and "| evidence: trained at least RAG top-2 | missed |" in report
    conflicts = report.split("## Conflict questions by what the final memory holds")[1]
    assert "| rag | 3 | 2 | 1 | 0 |" in conflicts and "| trained_seed0 | 1 | 0 | 0 | 5 |" in conflicts
    assert "| 0 | 1.000 | 1.500 | 0.250 |" in report
    assert "the warm start took 71 min to build" in report


def test_on_a_cpu_it_is_skipped_unless_asked_and_bad_settings_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(learning, "ON_CPU", False)
    with pytest.raises(BenchmarkSkipped, match="MEMALPHA_BENCH_LEARNING_ON_CPU=1"):
        learning.run()
    monkeypatch.setattr(learning, "ON_CPU", True)
    monkeypatch.setattr(learning, "SEEDS", (0,))
    with pytest.raises(ValueError, match="MEMALPHA_BENCH_LEARNING_SEEDS=0: a spread over seeds needs at least 2"):
        learning.run()
    monkeypatch.setattr(learning, "SEEDS", (0, 1))
    monkeypatch.setattr(learning, "READERS", ("evidence", "oracle"))
    with pytest.raises(ValueError, match="unknown reader\\(s\\) oracle"):
        learning.run()


def test_two_tiny_seeds_are_read_by_both_readers_from_one_build_and_resume_without_redoing_work(tmp_path, monkeypatch):
    data = make_dataset(tmp_path / "data")
    monkeypatch.setattr(learning, "ON_CPU", True)
    monkeypatch.setattr(learning, "SEEDS", (0, 1))
    monkeypatch.setattr(learning, "STEPS", 2)
    monkeypatch.setattr(learning, "CHECKPOINT_EVERY", 1)
    monkeypatch.setattr(learning, "TEST_INSTANCES", 2)  # one of each competency
    monkeypatch.setattr(learning, "RUN_ROOT", tmp_path / "runs")
    monkeypatch.setattr(learning, "WARM_START", tmp_path / "none-shipped")  # the warm start is trained
    monkeypatch.setattr(learning, "PLOT", tmp_path / "learning.png")
    monkeypatch.setattr(learning, "CONFIG", TINY_CONFIG)
    monkeypatch.setattr(learning, "TRAIN_DATA", data)
    monkeypatch.setattr(learning, "training_data", lambda: data)
    monkeypatch.setattr(learning, "EXTRA_OVERRIDES", ["data.competencies=[accurate_retrieval]", "sft.eval_chunks=2"])
    monkeypatch.setattr(learning, "SHIP", True)
    monkeypatch.setattr(record, "WRITER", tmp_path / "shipped-writer")
    builds = []
    compare = learning.compare
    monkeypatch.setattr(learning, "compare", lambda config, instances, method, readers, model=None:
                        builds.append((method, readers, model)) or compare(config, instances, method, readers, model))
    results = learning.run()

    assert set(results["readers"]) == {"evidence", "local"}
    assert len(builds) == 7 and all(readers == ("evidence", "local") for _, readers, _ in builds)  # one build a method
    for reader, methods in results["readers"].items():
        assert set(methods) == {"warm_start", "trained", "trained_seed0", "trained_seed1", *learning.BASELINES}
        assert methods["trained"]["qa_seeds"] == [methods["trained_seed0"]["qa"], methods["trained_seed1"]["qa"]]
        assert methods["no_memory"]["memory_tokens"] == 0
    # the memories are the readers' common input: the same sizes under both
    assert {m: r["memory_tokens"] for m, r in results["readers"]["local"].items()} == \
        {m: r["memory_tokens"] for m, r in results["readers"]["evidence"].items()}
    assert [p["step"] for p in results["curves"][1]] == [1, 2] and "validation_qa" in results["curves"][1][-1]
    assert (tmp_path / "learning.png").stat().st_size > 0
    runs = tmp_path / "runs"
    weights = "sft/adapter_model.safetensors"
    assert (runs / "seed0" / weights).read_bytes() == (runs / "seed1" / weights).read_bytes() == \
        (runs / "warm-start" / weights).read_bytes()  # one warm start for every seed
    assert json.loads((runs / "seed1" / "test-2" / "local" / "step-2.json").read_text()) == results["readers"]["local"]["trained_seed1"]
    validation = {seed: results["curves"][seed][-1]["validation_qa"] for seed in (0, 1)}
    shipped = record.read_record(tmp_path / "shipped-writer")
    assert shipped["seed"] == results["shipped"]["seed"] == (1 if validation[1] > validation[0] else 0)
    assert shipped["validation_qa"] == validation[shipped["seed"]] and shipped["step"] == 2
    assert shipped["test"]["local"]["qa"] == results["readers"]["local"][f"trained_seed{shipped['seed']}"]["qa"]

    # seed 1 stopped after step 1 and the local reader's answers of RAG were lost: seed 1 trains its last step
    # again from its step-1 checkpoint, both readers read its new adapter, RAG is rebuilt for the local reader only
    shutil.rmtree(checkpoint_dir(runs / "seed1", 2))
    for reader in ("evidence", "local"):
        (runs / "seed1" / "test-2" / reader / "step-2.json").unlink()
    (runs / "test-2" / "local" / "rag.json").unlink()
    trained, builds[:] = [], []
    train_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: trained.append(self.config.grpo.seed) or train_step(self))
    again = learning.run()
    assert trained == [1]
    assert [(method, readers) for method, readers, _ in builds] == [("policy", ("evidence", "local")), ("rag", ("local",))]
    assert str(builds[0][2]).startswith(str(checkpoint_dir(runs / "seed1", 2)))

    def timeless(test):
        return {k: v for k, v in test.items() if not k.endswith("seconds")}

    for reader in ("evidence", "local"):  # the resumed step's memories and answers equal the uninterrupted ones
        assert timeless(again["readers"][reader]["trained_seed1"]) == timeless(results["readers"][reader]["trained_seed1"])
        assert timeless(again["readers"][reader]["rag"]) == timeless(results["readers"][reader]["rag"])
