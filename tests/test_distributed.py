"""Data-parallel training over gloo with 2 processes (torchrun), on the tiny policy: the update equals one
process's on the same rollouts, and a run killed with kill -9 resumes to the uninterrupted run's adapter."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_rollout import make_dataset, tiny_config

from memalpha.training.checkpoint import checkpoint_dir, read_state
from memalpha.training.grpo import compute_advantages, group_ids
from memalpha.training.rollout import collect_rollouts
from memalpha.training.trainer import Trainer

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(REPO / ".venv" / "bin" / "torchrun")
WEIGHTS = "adapter_model.safetensors"


def torchrun(processes: int, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([TORCHRUN, "--standalone", f"--nproc_per_node={processes}", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)


def rank_of(pid: str) -> int:
    """The RANK torchrun gave a worker process."""
    env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return int(env["RANK"])


def kill_a_rank(launcher: subprocess.Popen, rank: int) -> str:
    """kill -9 of one training process (torchrun starts each in its own session, so killing torchrun's group
    would leave them running); torchrun then stops the other and fails. Returns the launcher's output."""
    workers = {rank_of(pid): pid for pid in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()}
    assert sorted(workers) == [0, 1], workers
    os.kill(int(workers[rank]), signal.SIGKILL)
    out, _ = launcher.communicate(timeout=300)
    assert launcher.returncode != 0, out[-3000:]
    return out


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)


def finished(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def test_two_processes_sharded_or_not_take_the_update_one_process_takes_on_the_same_rollouts(tmp_path):
    """Data-parallel, and with the base weights sharded (model.fsdp), on rollouts where one rank has fewer
    micro-batches than the other (it runs idle passes under FSDP)."""
    config = tiny_config(make_dataset(tmp_path / "data"), "grpo.micro_batch_size=2")
    trainer = Trainer(config, tmp_path / "sampled")
    instances = trainer._next_instances()
    batch = collect_rollouts(trainer.policy, instances, config, num_generations=config.rollout.num_generations,
                             generator=trainer.generator, reader=trainer.reader)
    samples = batch.samples
    rewards = torch.tensor([s.reward.total for s in samples])
    advantages, _ = compute_advantages(rewards, group_ids([s.instance_index for s in samples], [s.chunk for s in samples],
                                                          config.grpo.advantage_grouping), config.grpo.scale_rewards)
    assert advantages.abs().sum() > 0  # a real update
    # the instance that learns keeps all its samples, the other one sample: the ranks' shares differ
    learning = max(range(len(instances)), key=lambda i: float(sum(abs(a) for s, a in zip(samples, advantages) if s.instance_index == i)))
    kept = [j for j, s in enumerate(samples) if s.instance_index == learning
            or j == min(k for k, t in enumerate(samples) if t.instance_index == s.instance_index)]
    (tmp_path / "samples.pkl").write_bytes(pickle.dumps(([samples[j] for j in kept], [float(advantages[j]) for j in kept],
                                                         len(instances))))
    (tmp_path / "plain.json").write_text(config.model_dump_json())
    sharded = tiny_config(tmp_path / "data", "grpo.micro_batch_size=2", "model.fsdp=true", "rollout.engine=vllm")
    (tmp_path / "fsdp.json").write_text(sharded.model_dump_json())
    script = str(REPO / "tests" / "distributed_update.py")
    outputs = {}
    for name, processes, config_file in (("one", 1, "plain.json"), ("two", 2, "plain.json"), ("fsdp", 2, "fsdp.json")):
        outputs[name] = finished(torchrun(processes, script, str(tmp_path / config_file), str(tmp_path / "samples.pkl"),
                                          str(tmp_path / f"run-{name}"), str(tmp_path / name)))
    counts = sorted(int(n) for n in re.findall(r"rank \d: (\d+) micro-batches", outputs["fsdp"]))
    assert len(counts) == 2 and counts[0] < counts[1], outputs["fsdp"][-2000:]
    whole = int(re.search(r"(\d+) parameter values held", outputs["one"]).group(1))
    held = [int(n) for n in re.findall(r"(\d+) parameter values held", outputs["fsdp"])]
    assert len(held) == 2 and all(n < 0.55 * whole for n in held), (whole, held)  # half the base, all of the LoRA

    adapters = {name: load_file(tmp_path / name / WEIGHTS) for name in ("one", "two", "fsdp")}
    start = load_file(trainer.policy.save_adapter(tmp_path / "start") / WEIGHTS)
    one = adapters["one"]
    moved = max(float((one[k] - start[k]).abs().max()) for k in one)
    differs = {name: max(float((one[k] - adapters[name][k]).abs().max()) for k in one) for name in ("two", "fsdp")}
    print(f"largest weight change of the update {moved:.2e}; largest difference from one process: {differs}")
    # the same sums in another order (partial gradients added by gloo; under FSDP each prompt also runs
    # once per completion instead of once per group): float32 rounding only
    assert moved > 1e-4 and max(differs.values()) <= 1e-6


def test_a_two_process_run_killed_mid_run_resumes_to_the_uninterrupted_runs_adapter(tmp_path):
    data = make_dataset(tmp_path / "data")

    def train(name: str) -> subprocess.Popen:
        return torchrun(2, "-m", "memalpha", "train", "--config", "configs/tiny.yaml", "--set", f"data.train_path={data}",
                        "--set", "sft.enabled=false", "--set", "grpo.steps=3", "--set", "grpo.checkpoint_every=1",
                        "--set", "grpo.eval_every=3", "--set", f"output_dir={tmp_path / name}")

    out = finished(train("whole"))
    assert out.count("grpo step 3/3 |") == 1  # rank 0 alone prints
    whole = tmp_path / "whole"
    last = checkpoint_dir(whole, 3)
    assert read_state(last).processes == 2 and (last / "rng-rank-1.pt").is_file()
    assert [json.loads(line)["step"] for line in (whole / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    killed = train("killed")
    wait_for(checkpoint_dir(tmp_path / "killed", 1), killed)  # step 2 starts right after this checkpoint
    kill_a_rank(killed, rank=1)
    assert not checkpoint_dir(tmp_path / "killed", 2).exists()
    out = finished(train("killed"))
    assert "resumed at step 1" in out
    for step in (1, 2, 3):
        a, b = load_file(checkpoint_dir(whole, step) / "adapter" / WEIGHTS), load_file(checkpoint_dir(tmp_path / "killed", step) / "adapter" / WEIGHTS)
        assert all(torch.equal(a[k], b[k]) for k in a), f"step {step} differs after the resume"
    rewards = [[json.loads(line)["reward"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("whole", "killed")]
    assert rewards[0] == rewards[1]

    one = subprocess.run([str(REPO / ".venv" / "bin" / "memalpha"), "train", "--resume", str(whole), "--config", "configs/tiny.yaml",
                          "--set", f"data.train_path={data}", "--set", "sft.enabled=false", "--set", "grpo.steps=4",
                          "--set", "grpo.checkpoint_every=1", "--set", "grpo.eval_every=3", "--set", f"output_dir={whole}"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert one.returncode != 0 and "written by 2 training process(es), this run has 1" in one.stdout + one.stderr
