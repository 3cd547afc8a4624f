"""Prefect flows: `prep`, `grpo` (deployment `train`), `writer` (deployment `register`), `evaluate`
(deployment `nightly`) and `sweep`. Flows call tasks (tasks/), tasks call the domain library (memalpha/); deployments live in
flows/deployments.py."""

from __future__ import annotations

from pathlib import Path

from memalpha.config import RunConfig, load_config

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG_FILE = REPO_ROOT / "configs" / "default.yaml"


def repo_path(path: str | Path) -> Path:
    """`path` itself when absolute, else under the repository: runners may start in another folder."""
    return Path(path) if Path(path).is_absolute() else REPO_ROOT / path


def default_config() -> RunConfig:
    """The default run config the deployments show in their forms: configs/default.yaml, else the code defaults."""
    return load_config(DEFAULT_CONFIG_FILE) if DEFAULT_CONFIG_FILE.is_file() else RunConfig()
