"""Adapters of record: the shipped warm start matches the recipe, is reused when a run's recipe hashes
the same, is trained when it does not, and survives its bf16 storage."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_rollout import make_dataset, random_adapter, tiny_config  # noqa: F401  (fixture re-export)

from memalpha.config import RunConfig
from memalpha.teacher import record
from memalpha.teacher.warm_start import prepare_warm_start
from memalpha.training.checkpoint import SFT_DIR


def test_the_shipped_warm_start_is_the_current_recipes():
    kept = record.read_record(record.WARM_START)
    assert kept is not None, f"{record.WARM_START} holds no warm start of record: run `make warm-start`"
    assert kept["hash"] == record.warm_start_hash(RunConfig()), (
        "the recipe changed since the shipped warm start was built (its recipe fields: "
        f"{record.WARM_START / record.RECORD_FILE}): run `make warm-start` and commit adapters/warm-start")
    assert kept["recipe"] == json.loads(json.dumps(record.warm_start_fields(RunConfig())))


def test_a_warm_start_survives_its_bf16_storage_to_bf16_rounding(random_adapter, tmp_path):  # noqa: F811
    stored = record.ship(random_adapter, tmp_path / "shipped", {"hash": "x"})
    assert {v.dtype for v in load_file(str(stored / record.WEIGHTS_FILE)).values()} == {torch.bfloat16}
    restored = load_file(str(record.restore(stored, tmp_path / "run" / "sft") / record.WEIGHTS_FILE))
    for key, value in load_file(str(random_adapter / record.WEIGHTS_FILE)).items():
        assert restored[key].dtype == torch.float32
        assert torch.equal(restored[key], value.to(torch.bfloat16).float())


def test_a_run_reuses_the_shipped_warm_start_of_its_recipe_and_trains_another(random_adapter, tmp_path, caplog):  # noqa: F811
    config = tiny_config(make_dataset(tmp_path / "data"), "sft.enabled=true", "sft.eval_chunks=0")
    shipped = record.ship(random_adapter, tmp_path / "shipped", {"hash": record.warm_start_hash(config)})
    with caplog.at_level("INFO"):
        reused = prepare_warm_start(config, tmp_path / "same", shipped=shipped)
    assert reused == tmp_path / "same" / SFT_DIR and "reused, not trained" in caplog.text
    assert not (reused / "sft_result.json").exists()
    other = config.model_copy(update={"sft": config.sft.model_copy(update={"learning_rate": 1e-3})})
    assert record.warm_start_hash(other) != record.warm_start_hash(config)
    trained = prepare_warm_start(other, tmp_path / "other", shipped=shipped)
    assert json.loads((trained / "sft_result.json").read_text())["steps"] >= 1
    assert json.loads((trained / "sft_result.json").read_text())["adapter_dir"] == str(trained)


def test_a_run_reads_the_held_out_check_its_shipped_warm_start_records_and_measures_another(random_adapter, tmp_path):  # noqa: F811
    from memalpha.config import load_config
    from memalpha.errors import UserError
    from memalpha.teacher.warm_start import record_held_out_check
    from memalpha.training.checkpoint import read_best
    from memalpha.training.trainer import Trainer

    data = make_dataset(tmp_path / "data")
    config = tiny_config(data, "sft.enabled=true", "sft.eval_chunks=0")
    shipped = record.ship(random_adapter, tmp_path / "shipped", {"hash": record.warm_start_hash(config)})
    check = record_held_out_check(config, shipped)
    assert record.read_record(shipped)[record.HELD_OUT_CHECKS] == [check] and check["metrics"]["eval/instances"] == 2

    def before_step_one(run_config, name):
        prepare_warm_start(run_config, tmp_path / name, shipped=shipped)
        trainer = Trainer(run_config, tmp_path / name)
        said = []
        trainer.say = said.append
        return trainer, trainer.validate(), said

    trainer, metrics, said = before_step_one(config, "same")
    assert said == [f"held-out check of the warm start: read from {tmp_path / 'same' / SFT_DIR / record.RECORD_FILE} "
                    "(measured on the same data, reader and config)"]
    assert {k: v for k, v in metrics.items() if not k.startswith("best/")} == check["metrics"]
    assert metrics["best/step"] == 0 and read_best(tmp_path / "same")["score"] == check["metrics"]["eval/qa_score"]
    measured = trainer.evaluate()  # what the run would have measured
    assert {k: v for k, v in measured.items() if k != "eval/seconds"} == {k: v for k, v in check["metrics"].items() if k != "eval/seconds"}

    # another number of held-out instances is another check: measured, and the line says why
    fewer = tiny_config(data, "sft.enabled=true", "sft.eval_chunks=0", "eval.max_instances=1")
    _, metrics, said = before_step_one(fewer, "fewer")
    assert said[0] == (f"held-out check of the warm start: measuring it, as {tmp_path / 'fewer' / SFT_DIR / record.RECORD_FILE} "
                       "was measured with other eval.max_instances, instances_sha256")
    assert metrics["eval/instances"] == 1
    # recorded beside the first: both are kept, and each run reads its own
    recorded = record_held_out_check(fewer, shipped)
    assert [c["fields"] for c in record.read_record(shipped)[record.HELD_OUT_CHECKS]] == [check["fields"], recorded["fields"]]
    for run_config, name in ((config, "same-again"), (fewer, "fewer-again")):
        assert before_step_one(run_config, name)[2][0].startswith("held-out check of the warm start: read from")
    record_held_out_check(fewer, shipped)  # measured again: it replaces the check of the same fields
    assert len(record.read_record(shipped)[record.HELD_OUT_CHECKS]) == 2
    with pytest.raises(UserError, match=r"record.json: field 'hash'"):
        record_held_out_check(load_config(None, [f"data.train_path={data}"]), shipped)


@pytest.mark.parametrize("change", ["sft.num_demonstrations=8", "rollout.max_completion_length=64", "model.lora_r=8",
                                    "memory.writer_view_tokens=512", "grpo.seed=1", "data.competencies=[accurate_retrieval]"])
def test_what_determines_the_warm_start_changes_its_hash_and_what_does_not_leaves_it(change):
    from memalpha.config import load_config

    base = record.warm_start_hash(RunConfig())
    assert record.warm_start_hash(load_config(None, [change])) != base
    for harmless in ("grpo.steps=3", "grpo.learning_rate=1e-3", "rollout.num_generations=4", "eval.max_instances=2",
                     "time_budget_minutes=5", "output_dir=elsewhere"):
        assert record.warm_start_hash(load_config(None, [harmless])) == base


def test_a_writer_writes_a_memory_for_a_users_own_conversation(random_adapter, tmp_path):  # noqa: F811
    from memalpha.evaluation.write import write_memory

    memory = write_memory(random_adapter, ["Maya: I moved to Lisbon last week.", "Maya: I work at a bakery now."],
                          tiny_config(tmp_path / "data"))
    assert set(memory) == {"core", "semantic", "episodic"}
    assert isinstance(memory["core"], str) and all(isinstance(e, str) for e in memory["semantic"] + memory["episodic"])
