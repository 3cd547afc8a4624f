"""Run every benchmark module `bench/bench_<name>.py` (or the names given) and write its results.

Each module exposes `run() -> dict` and optionally `to_markdown(results) -> str`. Results go to
bench/results/<name>.json and <name>.md; bench/results/statuses.json keeps each benchmark's latest status and
bench/results/SUMMARY.md lists every report with it. A benchmark that fails is reported and the others
still run; the exit status is 1 if any failed. One that cannot run on this machine (bench_rollout_gpu
without CUDA) raises BenchmarkSkipped and is reported as skipped.

    python -m bench.run_all            # all benchmarks
    python -m bench.run_all memory     # only bench_memory
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import BenchmarkSkipped
from memalpha.models.loading import cpu_supports_bf16

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
STATUS_FILE = "statuses.json"  # benchmark name -> status of its latest run


def discover() -> list[str]:
    """Names of the benchmark modules (`bench_<name>.py` -> `<name>`), sorted."""
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def generic_markdown(name: str, results: dict[str, Any]) -> str:
    """A flat key/value table, for modules without their own `to_markdown`."""
    rows = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            rows.append(f"| {prefix} | {_cell(node)} |")

    walk(results, "")
    return f"# Benchmark: {name}\n\n| metric | value |\n|---|---|\n" + "\n".join(rows) + "\n"


def write_results(name: str, results: dict[str, Any], markdown: str, out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write <name>.json (with run metadata) and <name>.md; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": _cpus(),
            "cpu": _cpu_model(),
            # CPU training and evaluation ran 2-3x slower on a machine without it (docs/PERFORMANCE.md)
            "cpu_native_bf16": cpu_supports_bf16(),
            # the CPU is shared: a load average above the CPU count means the numbers are pessimistic
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "results": results,
    }
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_one(name: str) -> dict[str, Any]:
    """Import bench.bench_<name>, run it and write its results."""
    module = importlib.import_module(f"bench.bench_{name}")
    results = module.run()
    render = getattr(module, "to_markdown", None)
    markdown = render(results) if render else generic_markdown(name, results)
    write_results(name, results, markdown)
    return results


def run_and_report(name: str) -> str:
    """Run one benchmark and return its status line: ok, skipped (with the reason) or FAILED."""
    print(f"== bench {name}", flush=True)
    start = time.perf_counter()
    try:
        run_one(name)
        status = "ok"
    except BenchmarkSkipped as reason:
        status = f"skipped: {reason}"
    except Exception:  # one broken benchmark must not hide the others' numbers
        traceback.print_exc()
        status = "FAILED"
    status = f"{status} ({time.perf_counter() - start:.1f} s, this run)"
    print(f"== bench {name}: {status}", flush=True)
    return status


def recorded_statuses(out_dir: Path = RESULTS_DIR) -> dict[str, str]:
    """The status each benchmark's latest run reported, from STATUS_FILE. A separate file, not a field of
    <name>.json: a run that fails or is skipped writes no results, and its status must not overwrite the
    numbers an earlier run left there."""
    path = out_dir / STATUS_FILE
    if not path.is_file():
        return {}
    try:
        statuses = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); fix it or delete it to start the statuses afresh") from exc
    if not isinstance(statuses, dict) or not all(isinstance(v, str) for v in statuses.values()):
        raise ValueError(f"{path}: expected one JSON object of benchmark name -> status text")
    return statuses


def write_summary(statuses: dict[str, str], out_dir: Path = RESULTS_DIR) -> Path:
    """Record this run's statuses in STATUS_FILE beside those of earlier runs (their "this run" becomes
    "an earlier run") and write SUMMARY.md over every result file present."""
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = {name: status.replace("this run", "an earlier run") for name, status in recorded_statuses(out_dir).items()}
    merged = dict(sorted({**earlier, **statuses}.items()))
    write_atomically(out_dir / STATUS_FILE, json.dumps(merged, indent=2) + "\n")
    lines = ["# Benchmark summary", "", "| benchmark | status | finished (UTC) | load avg | CPU | results |", "|---|---|---|---|---|---|"]
    # a report is a <name>.json with its <name>.md; inputs such as rollout_before.json have none
    reports = {p.stem for p in out_dir.glob("*.json") if p.with_suffix(".md").exists() and p.name != STATUS_FILE}
    for name in sorted(set(statuses) | reports):
        path = out_dir / f"{name}.json"
        meta = json.loads(path.read_text()) if path.exists() else {}
        meta = meta if isinstance(meta, dict) else {}
        machine = meta.get("machine", {})
        cpu = machine.get("cpu", "")
        if cpu:
            cpu += ", bf16" if machine.get("cpu_native_bf16") else ", no native bf16"
        status = merged.get(name, "from an earlier run")
        lines.append(f"| {name} | {status} | {meta.get('finished_at', '')} | {machine.get('load_average_1m_at_end', '')} | {cpu} "
                     f"| [{name}.md]({name}.md) |")
    summary = out_dir / "SUMMARY.md"
    write_atomically(summary, "\n".join(lines) + "\n")
    return summary


def write_atomically(path: Path, text: str) -> None:
    """Write then rename, so that an interrupted run leaves the previous file whole."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(discover())})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("memalpha").setLevel(logging.INFO)  # progress lines of warm starts and evaluations
    available = discover()
    unknown = [n for n in args.names if n not in available]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)} (available: {', '.join(available)})")
    statuses = {name: run_and_report(name) for name in args.names or available}
    write_summary(statuses)
    failed = sum(1 for s in statuses.values() if s.startswith("FAILED"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
