"""The learning benchmark's breakdown of conflict questions by what each finished memory holds."""

from bench import bench_learning as learning
from memalpha.data.schema import Instance, Question
from memalpha.memory import MemoryStore
from memalpha.memory.schema import MEMALPHA_SCHEMA


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


def test_the_report_shows_the_breakdown_for_memory_methods_only():
    method = {"qa": 0.5, "qa_by_competency": dict.fromkeys(learning.COMPETENCIES, 0.5), "memory_tokens": 10.0, "stale_answers": 0}
    results = {
        "settings": {"config": "c", "overrides": [], "B": 1, "G": 2, "learning_rate": 1e-4, "warm_start_seconds": 1,
                     "grpo_seconds": 1, "total_seconds": 60, "budget_seconds": 60, "test_instances": 1, "test_questions": 2,
                     "test_chunks": 2, "test_seed": 7, "reader": "evidence", "retrieval": "bm25", "qa_spread": "-"},
        "targets": {}, "sft_steps": 1, "sft_best_epoch": 1, "grpo_steps": 1, "selected_step": 1, "selected_validation_qa": 0.5, "sft_epochs": [], "curve": [],
        "methods": {"policy": {**method, "conflict_memory": {"current": 3, "both": 2, "superseded": 1, "neither": 0}}, "rag": method},
    }
    markdown = learning.to_markdown(results)
    assert "| policy | 3 | 2 | 1 | 0 |" in markdown
    assert "| rag | " not in markdown.split("## Conflict questions by what the final memory holds")[1]
