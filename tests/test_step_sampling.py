"""Step-level GRPO: G candidates from one shared memory state, advantages within them, the state
advance rule, groups without signal skipped, exact resume, the chunk curriculum."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
from test_rollout import _policy, make_instances, random_adapter, tiny_config  # noqa: F401  (fixture re-export)
from test_trainer import _run_dir, resume_third_step

from memalpha.models.readers import make_reader
from memalpha.training.grpo import compute_advantages, group_ids
from memalpha.training.rollout import _advance, collect_step_rollouts
from memalpha.training.trainer import Trainer

G = 3


def test_advantages_are_normalised_over_the_candidates_of_one_state():
    # 2 instances x 2 chunks x G candidates, hand-made rewards; samples arrive group by group
    rewards = torch.tensor([1.0, 0.0, 2.0, 5.0, 5.0, 5.0, 0.0, 3.0, 0.0, 1.0, 1.0, 4.0])
    instances = [0] * 6 + [1] * 6
    chunks = [0, 0, 0, 1, 1, 1] * 2
    groups = group_ids(instances, chunks, "chunk")
    assert groups.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    advantages, zero_std = compute_advantages(rewards, groups, "none")
    assert advantages.tolist() == pytest.approx([0, -1, 1, 0, 0, 0, -1, 2, -1, -1, -1, 2])
    assert zero_std.tolist() == [False] * 3 + [True] * 3 + [False] * 6
    scaled, _ = compute_advantages(rewards, groups, "group")
    assert scaled[:3].tolist() == pytest.approx([0, -1 / (1 + 1e-4), 1 / (1 + 1e-4)])


def test_the_state_advances_to_a_drawn_candidate():
    group = [SimpleNamespace(reward=SimpleNamespace(total=t)) for t in (0.5, 2.0, 2.0, 1.0)]
    assert _advance(group, None) == 0
    draws = [_advance(group, torch.Generator().manual_seed(s)) for s in range(40)]
    assert set(draws) == {0, 1, 2, 3}
    assert draws == [_advance(group, torch.Generator().manual_seed(s)) for s in range(40)]


def test_candidates_share_one_prompt_and_the_state_follows_the_chosen_one(tmp_path, random_adapter):  # noqa: F811
    config = tiny_config(tmp_path, "data.max_chunks_per_instance=0")
    policy = _policy(config, random_adapter)
    instances = make_instances()[:2]  # 3 and 2 chunks
    batch = collect_step_rollouts(policy, instances, config, num_generations=G,
                                  generator=torch.Generator().manual_seed(0), reader=make_reader(config.model))
    assert batch.generate_calls == 3 and len(batch.samples) == G * (3 + 2) and len(batch.memories) == 2
    by_group: dict = {}
    for s in batch.samples:
        by_group.setdefault((s.instance_index, s.chunk), []).append(s)
    for (b, t), group in by_group.items():
        assert [s.rollout for s in group] == list(range(G))
        assert len({tuple(s.prompt_ids) for s in group}) == 1  # identical prompts: one state
        assert all(s.reward is not None and s.reward.r1 == 0.0 for s in group)
    last = {b: by_group[(b, len(instances[b].chunks) - 1)] for b in range(2)}
    for b, group in last.items():
        followed = [s for s in group if s.memory_json == batch.memories[b].to_json()]
        assert followed  # the final memory is one candidate's
    assert len(batch.qa_scores) == 2 and batch.trace["name"] == "rollout"


def _step_config(data_dir, *overrides):
    return tiny_config(data_dir, "sft.enabled=true", "grpo.sampling=step", "grpo.learning_rate=0.05",
                       "grpo.checkpoint_every=2", "grpo.steps=3", "rollout.num_generations=3", *overrides)


@pytest.fixture(scope="module")
def step_run(tmp_path_factory, random_adapter):  # noqa: F811
    from test_rollout import make_dataset

    tmp = tmp_path_factory.mktemp("step")
    data = make_dataset(tmp / "data")
    run = _run_dir(tmp, random_adapter)
    trainer = Trainer(_step_config(data), run)
    results = []
    trainer.train(results.append)
    return data, run, results


def test_groups_without_signal_are_counted_and_not_trained_on(step_run):
    _, _, results = step_run
    for result in results:
        m = result.metrics
        frame = result.samples
        assert frame.height == 2 * 2 * 3  # B instances x 2 chunks x G candidates
        zero = 0
        for (_, _), group in frame.group_by(["instance", "chunk"]):
            if group["reward"].n_unique() == 1:
                zero += group.height
                assert group["advantage"].abs().max() == 0
        assert m["frac_reward_zero_std"] == pytest.approx(zero / frame.height)
        assert m["update/skipped_samples"] == zero  # no forward/backward for them


def test_step_level_resume_reproduces_the_uninterrupted_run(step_run, tmp_path):
    data, run, results = step_run
    result, _ = resume_third_step(_step_config(data), run, results, tmp_path)
    assert json.loads(results[2].samples["memory"][0]) == json.loads(result.samples["memory"][0])


def _three_curriculum_steps(tmp_path, adapter, schedule: str) -> list:
    from test_rollout import make_dataset

    config = tiny_config(make_dataset(tmp_path / "data"), "data.max_chunks_per_instance=0", schedule,
                         "grpo.steps=3", "grpo.eval_every=10")
    results = []
    Trainer(config, _run_dir(tmp_path, adapter)).train(results.append)
    return results


def test_the_chunk_curriculum_grows_instances_over_steps(tmp_path, random_adapter):  # noqa: F811
    results = _three_curriculum_steps(tmp_path, random_adapter, "data.chunk_curriculum=[[0, 1], [2, 3]]")
    assert [r.metrics["curriculum/chunks_per_instance"] for r in results] == [1, 1, 3]
    assert results[0].samples["chunk"].max() == 0 and results[2].samples["chunk"].max() == 2


@pytest.mark.parametrize("kind, schedule, message", [
    ("chunk", "[[1, 1]]", "start at 0"), ("chunk", "[[0, 2], [0, 3]]", "increase"),
    ("chunk", "[[0, 0]]", "at least 1"),
])
def test_a_curriculum_the_data_cannot_follow_is_refused(kind, schedule, message):
    from memalpha.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.max_chunks_per_instance=2", f"data.{kind}_curriculum={schedule}"])


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_shared_prompt_update_equals_the_plain_one(tmp_path, random_adapter, loss_type):  # noqa: F811
    """Running a group's prompt forward once and reusing its cache for the G completions, and the prefix
    all groups share once for the step, gives the loss, entropy and gradients of the plain update,
    which runs every [prompt | completion] row."""
    from test_rollout import make_dataset

    from memalpha.training.generation import MIN_SHARED_PREFIX

    config = _step_config(make_dataset(tmp_path / "data"), f"grpo.loss_type={loss_type}",
                          "grpo.micro_batch_size=2")
    trainer = Trainer(config, _run_dir(tmp_path, random_adapter))
    batch = collect_step_rollouts(trainer.policy, trainer._next_instances(), config, num_generations=G,
                                  generator=trainer.generator, reader=trainer.reader)
    advantages = torch.randn(len(batch.samples), generator=torch.Generator().manual_seed(1))
    assert all(shared for _, shared in trainer._micro_batches(batch.samples, list(range(len(batch.samples)))))

    def update(shared: bool):
        trainer.config = config.model_copy(update={"grpo": config.grpo.model_copy(update={"shared_prompt_update": shared})})
        grads = []
        trainer.optimizer.step = lambda: grads.extend(p.grad.clone() for p in trainer.params)
        return trainer._update(batch.samples, advantages), grads

    shared_stats, shared_grads = update(True)
    plain_stats, plain_grads = update(False)
    assert shared_stats["shared_prefix_tokens"] >= MIN_SHARED_PREFIX  # the system prompt ran once for all groups
    assert plain_stats["shared_prefix_tokens"] == 0
    for key in ("loss", "entropy", "tokens", "grad_norm"):
        assert shared_stats[key] == pytest.approx(plain_stats[key], rel=1e-4, abs=1e-6), key
    assert shared_stats["grad_norm"] > 0
    for a, b in zip(shared_grads, plain_grads):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)


def test_the_step_line_shows_what_step_sampling_optimises(step_run):
    from memalpha.progress import GRPOProgress

    _, _, results = step_run
    lines = []
    progress = GRPOProgress(3, 0, lines.append, sampling="step")
    for result in results:
        m = result.metrics
        assert m["rewards/r1/mean"] == m["rewards/r3/mean"] == 0  # they need the final memory: not step-level terms
        assert 0 <= m["rewards/r2_gated/mean"] <= m["rewards/r2/mean"] and 0 <= m["rewards/r4_gated/mean"] <= m["rewards/r4/mean"]
        progress(result)
    terms = r"\(coverage [0-9.]+ retention [0-9.]+ gated r2 [0-9.]+ gated r4 [0-9.]+\) \| trajectory QA [0-9.]+"
    assert re.match(rf"grpo step 1/3 \| reward -?[0-9.]+ {terms} \| [0-9.]+ s/step \| ETA ", lines[0]), lines
    assert re.match(rf"grpo step 3/3 \| reward -?[0-9.]+ {terms} \| held-out QA [0-9.]+ \(warm start [0-9.]+\) \|", lines[2]), lines
    assert not any(re.search(r"\br[13] ", line) for line in lines), lines
