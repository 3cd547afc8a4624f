"""Shared test setup: everything offline, quiet, and reproducible; the tiny sweep tests/test_sweep.py and
tests/test_browser.py share."""

import os

import pytest

for name, value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "GX_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(name, value)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped, with the reason, on machines without one."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SWEEP_GRID = [(0.0, 0.0), (1.0, 1.0)]
"""The tiny sweep's reward weightings (beta, gamma): both weights differ between its two children."""
SCRIPTED_STORE = '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "Allergic to hazelnuts or peanuts."}}'


def scripted_writer(policy, prompts, rcfg, *, copies, greedy, generator, eos_token_ids=None):
    """`engines.sample` for the tiny policy, whose random writes score 0 in r1..r4 (so every weighting would
    score alike): every other row stores the answer to tests/test_rollout.py's questions where its chunk names
    an allergy, the others skip, so r1..r4 are all nonzero and beta and gamma change the reward."""
    from memalpha.training.generation import Generation

    tokenizer = policy.tokenizer
    rows = [ids for ids in prompts for _ in range(copies)]
    texts = [SCRIPTED_STORE if i % 2 == 0 and "allergic to" in tokenizer.decode(ids[-40:]) else "NOTHING_TO_STORE"
             for i, ids in enumerate(rows)]
    completions = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
    return Generation(completions, [[0.0] * len(ids) for ids in completions], [False] * len(completions))


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory):
    """One real `sweep` flow run (Prefect's test server, a SQLite MLflow store in tmp) of configs/tiny.yaml: a
    child of 2 GRPO steps, held-out QA after each, for every weighting of SWEEP_GRID, written by
    `scripted_writer`. Returns the store's URI and folder, the grid, the flow's result and what `make sweep` prints of it."""
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect.testing.utilities import prefect_test_harness
    from test_rollout import make_dataset, tiny_config

    from flows.sweep import sweep
    from memalpha.training import engines
    from tasks.summary import summarize_sweep

    tmp = tmp_path_factory.mktemp("sweep")
    store = f"sqlite:///{tmp / 'mlflow.db'}"
    config = tiny_config(make_dataset(tmp / "data"), f"output_dir={tmp / 'runs'}", "grpo.steps=2", "grpo.eval_every=1",
                         "grpo.checkpoint_every=2", "tracking.experiment=sweep")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", store)
        patch.setattr(engines, "sample", scripted_writer)
        with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: str(tmp / "results")}):
            with prefect_test_harness(server_startup_timeout=90):
                result = sweep(config=config, points=SWEEP_GRID)
        printed = summarize_sweep(result["parent_run_id"])
    return {"store": store, "folder": tmp, "grid": SWEEP_GRID, "result": result, "printed": printed}
