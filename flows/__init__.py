"""Prefect flows: `prep`, `grpo` (deployment `train`), `evaluate` (deployment `nightly`) and `sweep`.
Flows call tasks (tasks/), tasks call the domain library (memalpha/); deployments live in
flows/deployments.py."""

from __future__ import annotations

from pathlib import Path

from memalpha.config import RunConfig, load_config

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def default_config() -> RunConfig:
    """The default run config the deployments show in their forms: configs/default.yaml, else the code defaults."""
    return load_config(DEFAULT_CONFIG_FILE) if DEFAULT_CONFIG_FILE.is_file() else RunConfig()
