"""Scale benchmark: a GRPO step with 1 and 2 training processes, evaluation serially and on a local Ray
with 2 workers, and what starting Ray costs.

Training: the recipe (`RunConfig()`, from the shipped warm start) with `rollout.instances_per_step=2` (so 2
processes take one instance each), on the learning benchmark's training data, under `torchrun`, 2 steps;
`step_seconds` and `allreduce_seconds` are step 2's (step 1 also times the warm start's validation), keyed
by processes. On 2 cores no speed-up is expected: the point is the overhead, measured.

The learning benchmark's first `INSTANCES` held-out instances (4 chunks of 512 tokens each), greedy, the
evidence reader, methods `METHODS` (the shipped writer as `policy`). `eval_seconds` is keyed by workers
(1 = the serial runner in this process); each Ray run starts its own local Ray instance and the time of
that start (a Ray instance up and one empty task back) is reported separately as `ray_start_seconds`
and included in the Ray run's `eval_seconds`. The reports are compared too: a Ray run must give the serial
run's scores and memory sizes. On a 2-core machine no speed-up is expected: the point is the overhead.

    python -m bench.run_all scale
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from typing import Any

from bench import bench_learning as learning

INSTANCES = 16
WORKERS = (1, 2)
METHODS = ("policy", "rule_writer", "rag", "long_context")
PROCESSES = (1, 2)
RUN_ROOT = learning.ROOT / "runs" / "bench-scale"


def train_step_seconds(processes: int) -> dict[str, float]:
    """Step 2 of the recipe at B=2 under torchrun with `processes` ranks: step and all-reduce seconds."""
    run_dir = RUN_ROOT / f"processes-{processes}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m", "memalpha",
           "train", "--set", f"output_dir={run_dir}", "--set", f"data.train_path={learning.training_data()}",
           "--set", "rollout.instances_per_step=2", "--set", "grpo.steps=2", "--set", "grpo.eval_every=2",
           "--set", "time_budget_minutes=null", "--set", "eval.max_instances=2"]
    done = subprocess.run(cmd, cwd=learning.ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    step = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1]
    print(f"{processes} process(es): step 2 took {step['timing/step_s']:.1f} s", flush=True)
    return {"step_seconds": round(step["timing/step_s"], 1), "allreduce_seconds": round(step["timing/allreduce_s"], 3)}


def ray_start_seconds() -> float:
    """A local Ray instance up and one empty task back, then stopped."""
    import ray

    from memalpha.evaluation.cluster import ray_session

    started = time.perf_counter()
    with ray_session("", 2):
        ray.get(ray.remote(lambda: None).remote())
        return time.perf_counter() - started


def run() -> dict[str, Any]:
    from memalpha.config import load_config
    from memalpha.evaluation.runner import evaluate
    from memalpha.teacher import record

    training = {p: train_step_seconds(p) for p in PROCESSES}
    instances = learning.test_instances(INSTANCES)
    seconds, scores = {}, {}
    for workers in WORKERS:
        config = load_config(None, [f"eval.ray_workers={workers if workers > 1 else 0}"])
        started = time.perf_counter()
        result = evaluate(config, methods=list(METHODS), model_uri=record.WRITER, instances=instances, progress=None)
        seconds[workers] = round(time.perf_counter() - started, 1)
        scores[workers] = {m: {"qa": float(result.questions.filter(result.questions["method"] == m)["score"].mean()),
                               "memory_tokens": float(result.instances.filter(result.instances["method"] == m)["memory_tokens"].mean())}
                           for m in METHODS}
        print(f"{workers} worker(s): {seconds[workers]} s", flush=True)
    return {
        "step_seconds": {p: t["step_seconds"] for p, t in training.items()},
        "allreduce_seconds": {p: t["allreduce_seconds"] for p, t in training.items()},
        "eval_seconds": seconds, "ray_start_seconds": round(ray_start_seconds(), 1),
        "same_report": all(scores[w] == scores[1] for w in WORKERS), "scores": scores,
        "settings": {"instances": len(instances), "questions": sum(len(i.questions) for i in instances),
                     "methods": list(METHODS), "policy": str(record.WRITER.relative_to(learning.ROOT)), "reader": "evidence"},
    }


GPU_RESULTS = learning.ROOT / "bench" / "results" / "rollout_gpu.json"
# Assumptions of the projection (not measured here; docs/TRAINING.md): a ring all-reduce moves 2(N-1)/N of
# the gradient through each GPU; NVLink inside an 8-GPU node and InfiniBand between nodes; a 4B policy's
# decode step is launch-bound like the 135M's on the hf engine (scaled by its 36 layers against 30), and
# takes ~8 ms with vLLM's CUDA graphs; its update runs at 40% of an H100's 990 bf16 TFLOP/s.
NVLINK_GBPS, INFINIBAND_GBPS = 300.0, 25.0
LORA_PARAMS = {"SmolLM2-135M (default)": 4.88e6, "Qwen3-4B (paper)": 33.0e6}
HF_DECODE_S_135M, VLLM_DECODE_S_4B, UPDATE_FLOPS = 0.040, 0.008, 0.4 * 990e12
PAPER = {"chunks": 32, "completion": 192, "prompt": 4096, "G": 8}


def allreduce_seconds(params: float, gpus: int) -> float:
    if gpus == 1:
        return 0.0
    bandwidth = (NVLINK_GBPS if gpus <= 8 else INFINIBAND_GBPS) * 1e9
    return 2 * (gpus - 1) / gpus * params * 4 / bandwidth


def projection(gpu_step_seconds: float) -> list[str]:
    """A step at 1, 8 and 32 GPUs, one instance a GPU (so a step takes N instances): the single-GPU step
    plus the all-reduce of the LoRA gradients (fp32)."""
    p = PAPER
    decode_steps = p["chunks"] * p["completion"]
    update_tokens = p["chunks"] * (p["prompt"] + p["G"] * p["completion"])  # shared-prompt update
    update_4b = 6 * 4e9 * update_tokens / UPDATE_FLOPS
    step_4b = {"hf": decode_steps * HF_DECODE_S_135M * 36 / 30 + update_4b, "vllm": decode_steps * VLLM_DECODE_S_4B + update_4b}
    rows = [("SmolLM2-135M (default)", "hf", gpu_step_seconds),
            ("Qwen3-4B (paper)", "hf", step_4b["hf"]), ("Qwen3-4B (paper)", "vllm", step_4b["vllm"])]
    lines = ["", "## Projection: a step on 1, 8 and 32 GPUs (not measured)", "",
             "Data-parallel with one instance a GPU, so N GPUs take N instances a step in the single-GPU step's time "
             "plus the all-reduce of the LoRA gradients (fp32; ring; NVLink 300 GB/s within 8 GPUs, InfiniBand "
             "25 GB/s across nodes). The default policy's step is the one measured on an H200 "
             f"({gpu_step_seconds} s, [rollout_gpu.md](rollout_gpu.md)). The 4B step is the paper's shape "
             f"({p['chunks']} chunks, G={p['G']}, {p['completion']}-token completions, ~{p['prompt']}-token prompts): "
             f"{decode_steps:,} sequential decode steps at ~{HF_DECODE_S_135M * 36 / 30 * 1000:.0f} ms each on the hf "
             f"engine (launch-bound like the 135M's 40 ms, 36 layers against 30) or an assumed ~{VLLM_DECODE_S_4B * 1000:.0f} ms "
             f"on vLLM, plus the shared-prompt update ({update_tokens:,} tokens, 6 x 4e9 FLOP a token at 40% of an "
             f"H100's bf16 peak: {update_4b:.0f} s).", "",
             "| policy | engine | 1 GPU (s) | 8 GPUs (s) | 32 GPUs (s) | all-reduce at 32 (ms) |", "|---|---|---|---|---|---|"]
    for name, engine, step in rows:
        cells = [f"{step + allreduce_seconds(LORA_PARAMS[name], n):.1f}" for n in (1, 8, 32)]
        lines.append(f"| {name} | {engine} | " + " | ".join(cells) + f" | {allreduce_seconds(LORA_PARAMS[name], 32) * 1000:.1f} |")
    lines += ["", "The all-reduce stays at about 10 ms or less: N GPUs give N times the instances a step at the same "
              "step time, and the paper's 4B recipe is bound by sequential decoding, which vLLM shortens."]
    return lines


def to_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = ["# Benchmark: scale", "",
             f"Evaluation of {s['instances']} held-out instances ({s['questions']} questions; methods {', '.join(s['methods'])}; "
             f"policy {s['policy']}; {s['reader']} reader), serially and on a local Ray. Starting a local Ray and running one "
             f"empty task: {results['ray_start_seconds']} s (inside the Ray rows). Same report on Ray as serially: "
             f"{results['same_report']}" + ("" if results["same_report"] else
             " (a Ray task runs torch on one thread, so the bf16 policy's greedy decoding flips on near-ties; "
             "a serial run on one thread gives the Ray run's scores: docs/EVALUATION.md)") + ".",
             "", "| workers | eval seconds |", "|---|---|"]
    lines += [f"| {w} | {sec} |" for w, sec in results["eval_seconds"].items()]
    lines += ["", "GRPO step of the recipe at B=2 (G=8) under torchrun, step 2:", "",
              "| processes | step seconds | all-reduce seconds |", "|---|---|---|"]
    lines += [f"| {p} | {sec} | {results['allreduce_seconds'][p]} |" for p, sec in results["step_seconds"].items()]
    if GPU_RESULTS.is_file():
        lines += projection(json.loads(GPU_RESULTS.read_text())["results"]["step_seconds"])
    return "\n".join(lines) + "\n"
