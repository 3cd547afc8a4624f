"""Benchmarks: every `bench/bench_<name>.py` exposes `run() -> dict` (and optionally `to_markdown`);
`python -m bench.run_all` runs them and writes bench/results/<name>.json and .md."""


class BenchmarkSkipped(Exception):
    """Raised by a benchmark's `run()` when this machine cannot run it (e.g. no GPU): reported, not failed."""
