"""Benchmarks: every `bench/bench_<name>.py` exposes `run() -> dict` (and optionally `to_markdown`);
`python -m bench.run_all` runs them and writes bench/results/<name>.json and .md."""
