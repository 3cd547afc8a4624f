"""The deployment table and the flows' typed parameters, without a server."""

from __future__ import annotations

import pytest

from flows import DEFAULT_CONFIG_FILE, default_config
from flows.deployments import DEPLOYMENTS, runner_deployments, schema_fingerprint
from memalpha.config import RunConfig, load_config


def test_every_deployment_is_declared_once_with_the_nightly_cron(monkeypatch):
    monkeypatch.delenv("MEMALPHA_NIGHTLY_CRON", raising=False)
    built = {d.flow_name + "/" + d.name: d for d in runner_deployments()}
    assert set(built) == {spec.full_name for spec in DEPLOYMENTS} == {"grpo/train", "writer/register", "evaluate/nightly", "prep/prep", "sweep/sweep"}
    crons = {name: [s.schedule.cron for s in (d.schedules or [])] for name, d in built.items()}
    assert crons == {"grpo/train": [], "writer/register": [], "evaluate/nightly": ["0 2 * * *"], "prep/prep": [], "sweep/sweep": []}
    monkeypatch.setenv("MEMALPHA_NIGHTLY_CRON", "30 3 * * 1")
    nightly = next(d for d in runner_deployments() if d.name == "nightly")
    assert [s.schedule.cron for s in nightly.schedules] == ["30 3 * * 1"]


def test_train_parameter_is_the_typed_run_config_form():
    train = next(d for d in runner_deployments() if d.name == "train")
    schema = train._parameter_openapi_schema.model_dump()
    assert schema["properties"]["config"]["$ref"].endswith("/RunConfig")
    definitions = schema["definitions"]
    # nested sections become nested forms whose fields carry the config's own types and bounds
    assert definitions["RewardConfig"]["properties"]["beta"]["type"] == "number"
    assert definitions["RewardConfig"]["properties"]["beta"]["minimum"] == 0
    assert set(definitions["RunConfig"]["properties"]) == set(RunConfig.model_fields)


def test_default_config_is_the_committed_default_yaml():
    expected = load_config(DEFAULT_CONFIG_FILE) if DEFAULT_CONFIG_FILE.is_file() else RunConfig()
    assert default_config() == expected


def test_schema_fingerprint_tracks_the_parameters(monkeypatch):
    before = schema_fingerprint()
    assert before == schema_fingerprint()
    monkeypatch.setenv("MEMALPHA_NIGHTLY_CRON", "0 5 * * *")
    assert schema_fingerprint() != before


def test_a_partial_config_parameter_is_completed_with_defaults():
    from flows.grpo import grpo

    validated = grpo.validate_parameters({"config": {"grpo": {"steps": 3}}})
    assert isinstance(validated["config"], RunConfig)
    assert validated["config"].grpo.steps == 3 and validated["config"].reward.beta == RunConfig().reward.beta
    with pytest.raises(Exception, match="beta"):
        grpo.validate_parameters({"config": {"reward": {"beta": -1}}})
