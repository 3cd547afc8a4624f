from pathlib import Path

import pytest

from memalpha.cli import main
from memalpha.config import ConfigError, RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_match_the_paper_weights():
    config = load_config()
    assert config.reward.beta == 0.05
    assert config.reward.gamma == 0.1
    assert config.memory.core_max_tokens == 512


def test_yaml_and_overrides_compose(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("reward:\n  beta: 0.2\nrollout:\n  num_generations: 8\n")
    config = load_config(path, ["reward.gamma=0.3", "memory.schema_name=persona"])
    assert (config.reward.beta, config.reward.gamma) == (0.2, 0.3)
    assert config.rollout.num_generations == 8
    assert config.memory.schema_name == "persona"


@pytest.mark.parametrize(
    "override, field",
    [
        ("reward.beta=-1", "reward.beta"),
        ("memory.schema_name=bogus", "memory.schema_name"),
        ("grpo.kl_beta=0.1", "grpo.kl_beta"),
        ("grpo.loss_type=ppo", "grpo.loss_type"),
        ("rollout.nonexistent=3", "rollout.nonexistent"),
    ],
)
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("reward: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_override_must_be_key_value():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["reward.beta"])


def test_flat_params_and_training_hash():
    config = RunConfig()
    flat = config.flat()
    assert flat["reward.beta"] == 0.05 and "grpo.epsilon" in flat
    renamed = config.model_copy(update={"name": "other", "output_dir": "elsewhere"})
    assert renamed.training_hash() == config.training_hash()
    changed = load_config(None, ["reward.beta=0.5"])
    assert changed.training_hash() != config.training_hash()


def test_cli_config_show_prints_overrides(capsys):
    assert main(["config", "--set", "reward.beta=0.25"]) == 0
    assert "beta: 0.25" in capsys.readouterr().out


def test_cli_reports_bad_override_without_traceback(capsys):
    assert main(["config", "--set", "reward.beta=oops"]) == 2
    assert "reward.beta" in capsys.readouterr().err


def test_a_combination_the_code_cannot_run_is_refused_at_load_naming_both_fields():
    with pytest.raises(ConfigError, match=r"reward\.qa_metric=llm_judge.*model\.judge"):
        load_config(None, ["reward.qa_metric=llm_judge"])
    with pytest.raises(ConfigError, match=r"sft\.batch_size=8 must be a multiple of sft\.micro_batch_size=3"):
        load_config(None, ["sft.batch_size=8", "sft.micro_batch_size=3"])


RECIPE = {
    # the measured recipe (docs/TRAINING.md, "The recipe"): step-level GRPO with Dr. GRPO's loss, one group
    # of 8 per step, 192-token completions, from a warm start of 1,024 demonstrations at lr 5e-4
    "grpo.sampling": "step", "grpo.loss_type": "dr_grpo", "grpo.advantage_grouping": "chunk", "grpo.learning_rate": 1e-4,
    "grpo.warmup_steps": 1, "grpo.steps": 20, "grpo.eval_every": 5, "rollout.instances_per_step": 1,
    "rollout.num_generations": 8, "rollout.max_completion_length": 192, "rollout.max_prompt_tokens": 1024,
    "memory.writer_view_tokens": 256, "memory.reader_view_tokens": 1024,
    "data.competencies": ["accurate_retrieval", "conflict_resolution"], "data.max_chunks_per_instance": 4,
    "data.chunk_curriculum": [[0, 2], [15, 4]], "sft.num_demonstrations": 1024, "sft.learning_rate": 5e-4,
    "sft.batch_size": 4, "sft.epochs": 1.0, "sft.nothing_to_store_share": 0.25, "sft.eval_chunks": 32,
    "reward.shadowed_conflict_credit": 0.5, "reward.coverage_weight": 1.0, "reward.content_gate": True,
    "reward.retention": True, "reward.beta": 0.05, "reward.gamma": 0.1, "time_budget_minutes": None,
}


def test_the_code_defaults_are_the_recipe():
    flat = RunConfig().flat()
    assert {key: flat[key] for key in RECIPE} == RECIPE
    assert len(flat) <= 110  # one field a concept; levers that did not help are not fields


def test_the_default_yaml_only_sizes_the_run():
    """configs/default.yaml changes how long the run is, never what a step computes or the warm start it uses."""
    defaults, sized = RunConfig().flat(), load_config(ROOT / "configs" / "default.yaml").flat()
    changed = {key for key in defaults if defaults[key] != sized[key]}
    assert changed <= {"name", "output_dir", "time_budget_minutes", "grpo.steps", "grpo.eval_every",
                       "grpo.checkpoint_every", "eval.max_instances"}


def test_the_fsdp_recipe_changes_the_policy_and_where_it_runs_not_the_grpo_recipe():
    """infra/fsdp.yaml is a valid run config (fsdp needs vLLM rollouts and a reader other than the local one)
    that keeps every GRPO and reward field of the recipe."""
    defaults, recipe = RunConfig().flat(), load_config(ROOT / "infra" / "fsdp.yaml").flat()
    changed = {key for key in defaults if defaults[key] != recipe[key]}
    assert changed == {"name", "output_dir", "model.policy", "model.dtype", "model.device", "model.fsdp",
                       "rollout.engine", "rollout.instances_per_step", "sft.enabled"}
    assert recipe["rollout.instances_per_step"] % 4 == 0  # the recipe's --nproc_per_node 4
