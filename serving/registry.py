"""Logging and registering the memory writer as an MLflow pyfunc model (`serving/writer_model.py`)."""

from __future__ import annotations

import importlib.metadata
import json
import tempfile
from pathlib import Path
from typing import Any

import mlflow

MODEL_FILE = Path(__file__).with_name("writer_model.py")
MODEL_NAME = "writer"
"""The logged model's name inside its run (its artifacts live under it)."""
REQUIREMENTS = ("torch", "transformers", "peft", "mlflow", "pydantic", "pyyaml", "numpy", "polars", "bm25s", "PyStemmer",
                "json-repair", "faiss-cpu")
MEMALPHA = Path(__file__).resolve().parents[1] / "memalpha"
INPUT_EXAMPLE = [{"id": "example", "turns": [
    {"speaker": "Maya", "text": "I moved to Lisbon last week.", "date": "1:00 pm on 8 May, 2023"},
    {"speaker": "Ben", "text": "Nice! What are you doing there?", "date": "1:00 pm on 8 May, 2023"},
    {"speaker": "Maya", "text": "I work at a bakery now.", "date": "1:00 pm on 8 May, 2023"}],
    "questions": ["Where does Maya work?"]}]


def _requirements() -> list[str]:
    out = []
    for pkg in REQUIREMENTS:
        try:
            out.append(f"{pkg}=={importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def log_writer_model(run_id: str, adapter: str | Path, base_model: str | Path | None, config_json: dict[str, Any],
                     registered_model_name: str | None = None):
    """Log the writer (adapter + base model folder + config) as a pyfunc model in `run_id`, registered under
    `registered_model_name` when given; returns MLflow's ModelInfo. Without a local base folder (a hub id
    policy) the model loads `model.policy` of the config where it is served."""
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "config.json"
        config_path.write_text(json.dumps(config_json, indent=1))
        with mlflow.start_run(run_id=run_id):
            return mlflow.pyfunc.log_model(
                name=MODEL_NAME,
                python_model=str(MODEL_FILE),
                artifacts={"adapter": str(adapter), "config": str(config_path),
                           **({"base_model": str(base_model)} if base_model else {})},
                input_example=INPUT_EXAMPLE,
                registered_model_name=registered_model_name,
                pip_requirements=_requirements(),
                code_paths=[str(MEMALPHA)],  # the model carries the domain code it runs
            )
