"""Policy methods (`base`, `policy`, `sft`) through the rollout machinery, with the tiny random model."""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
from test_evaluation_methods import _instances  # the shared hand-written fixture

from memalpha.config import load_config
from memalpha.env.episode import Episode
from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.errors import UserError
from memalpha.evaluation import evaluate, resolve_adapter
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.models.policy import load_policy
from memalpha.tokens import regex_token_count
from memalpha.training import rollout
from memalpha.training.rollout import RolloutBatch, Sample


@pytest.fixture(scope="module")
def config():
    return load_config(overrides=[
        "model.policy=tiny", "memory.reader_view_tokens=200", "rollout.max_completion_length=8",
        "rollout.max_prompt_tokens=512", "eval.max_instances=0", "eval.batch_size=2",
    ])


@pytest.fixture(scope="module")
def adapter(config, tmp_path_factory):
    # a checkpoint folder as the trainer writes it: <ckpt>/adapter/
    checkpoint = tmp_path_factory.mktemp("run") / "checkpoints" / "step-000001"
    load_policy(config.model, trainable=False, seed=3).save_adapter(checkpoint / "adapter")
    (checkpoint / "state.json").write_text("{}")  # what marks a checkpoint complete
    return checkpoint


def test_base_and_policy_write_memories_through_rollouts(config, adapter):
    result = evaluate(config, methods=["base", "policy", "no_memory"], model_uri=resolve_adapter(adapter),
                      instances=_instances(), progress=None)
    assert result.methods == ["base", "policy", "no_memory"]
    rows = result.instances.filter(pl.col("method").is_in(["base", "policy"]))
    # a random model's output is data: every chunk yields scored tool results (mostly failures), no crash
    assert rows["tool_calls"].to_list() and all(calls >= 0 for calls in rows["tool_calls"])
    assert all(0.0 <= c <= 1.0 for c in rows["compression"])
    assert len(result.memories) == 4 and {m["method"] for m in result.memories} == {"base", "policy"}
    scores = result.questions.filter(pl.col("method") == "base")["score"]
    assert scores.len() == 3 and all(0.0 <= s <= 1.0 for s in scores)
    metrics = result.metrics()
    assert {"base/score", "policy/score", "policy/memory_tokens", "policy/seconds"} <= set(metrics)


def test_greedy_is_deterministic_and_sampling_runs_per_seed(config):
    greedy = [evaluate(config, methods=["base"], instances=_instances()[:1], progress=None) for _ in range(2)]
    assert greedy[0].memories == greedy[1].memories
    sampled_cfg = config.model_copy(update={"eval": config.eval.model_copy(update={"temperature": 1.0})})
    sampled = evaluate(sampled_cfg, methods=["base", "no_memory"], seeds=[0, 1], instances=_instances()[:1], progress=None)
    seeds = sampled.instances.group_by("method").agg(pl.col("seed").n_unique()).sort("method")
    assert dict(zip(seeds["method"], seeds["seed"])) == {"base": 2, "no_memory": 1}
    assert sampled.summary().filter(pl.col("method") == "base")["seeds"].item() == 2


def test_sft_needs_its_adapter(config, adapter):
    skipped = evaluate(config, methods=["sft"], instances=_instances()[:1], progress=None)
    assert skipped.methods == [] and "sft" in skipped.info["skipped"]
    with_sft = config.model_copy(update={"eval": config.eval.model_copy(update={"sft_adapter": str(adapter / "adapter")})})
    assert evaluate(with_sft, methods=["sft"], instances=_instances()[:1], progress=None).methods == ["sft"]


def test_resolve_adapter_layouts(adapter, tmp_path):
    assert resolve_adapter(adapter / "adapter") == adapter / "adapter"
    assert resolve_adapter(adapter) == adapter / "adapter"
    assert resolve_adapter(adapter.parent.parent) == adapter / "adapter"  # run folder: latest checkpoint
    run = tmp_path / "run"
    shutil.copytree(adapter.parent.parent, run)
    shutil.copytree(adapter / "adapter", run / "best" / "adapter")
    assert resolve_adapter(run) == run / "best" / "adapter"  # unless validation selected an adapter
    model = tmp_path / "downloaded"
    (model / "artifacts" / "adapter").mkdir(parents=True)
    (model / "MLmodel").write_text("flavors:\n  python_function:\n    artifacts:\n      adapter:\n        path: artifacts/adapter\n")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (model / "artifacts" / "adapter" / name).write_bytes((adapter / "adapter" / name).read_bytes())
    assert resolve_adapter(model) == model / "artifacts" / "adapter"
    with pytest.raises(UserError, match="not an adapter folder"):
        resolve_adapter(tmp_path)
    with pytest.raises(UserError, match="no such file"):
        resolve_adapter(tmp_path / "missing")


def _insert(content: str) -> str:
    return json.dumps({"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": content}})


def _update(memory_id: str, content: str) -> str:
    return json.dumps({"name": "memory_update",
                       "arguments": {"memory_type": "semantic", "memory_id": memory_id, "new_content": content}})


SCRIPT = {  # a writer that stores Alice's allergy, then overwrites it; and one that resolves the conflict
    "fixture-ar": [_insert("Alice is allergic to hazelnuts."), _update("sem-1", "Bob watched the game last night."),
                   _insert("Bob's favourite city is Lisbon.")],
    "fixture-cr": [_insert("Carol's gate code is 4471."), NOTHING_TO_STORE, _update("sem-1", "Carol's gate code is now 9052.")],
}


def test_policy_answers_lost_are_read_off_each_steps_memory(config, adapter, monkeypatch):
    def scripted_rollouts(policy, instances, rollout_config, **_):
        batch = RolloutBatch(instances, num_generations=1)
        for b, inst in enumerate(instances):
            assert inst.questions == []  # the policy writes without seeing the questions
            episode = Episode(inst, MEMALPHA_SCHEMA, rollout_config.memory, rollout_config.retrieval, regex_token_count)
            for completion in SCRIPT[inst.instance_id]:
                step = episode.step(completion)
                batch.samples.append(Sample(b, inst.instance_id, 0, step, [], [], [], False, False, episode.store.to_json()))
            batch.memories.append(episode.store)
        return batch

    monkeypatch.setattr(rollout, "collect_rollouts", scripted_rollouts)
    result = evaluate(config, methods=["policy"], model_uri=resolve_adapter(adapter), instances=_instances(), progress=None)
    lost = dict(zip(result.instances["instance_id"], result.instances["answers_lost"]))
    assert lost == {"fixture-ar": 1, "fixture-cr": 0}  # replacing a superseded value loses no answer
    assert result.metrics()["policy/answers_lost"] == 0.5
