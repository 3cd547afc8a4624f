import pytest

from memalpha.cli import main
from memalpha.config import ConfigError, RunConfig, load_config


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
