"""bench/run_all.py: SUMMARY.md has one row per report and none for input files; a benchmark that cannot run here is skipped."""

import json

import pytest

from bench.run_all import write_summary


def test_summary_lists_reports_and_leaves_out_inputs_without_a_report(tmp_path):
    (tmp_path / "rollout.json").write_text(json.dumps({"finished_at": "2026-11-25T01:32:22+00:00",
                                                      "machine": {"load_average_1m_at_end": 2.0}}))
    (tmp_path / "rollout.md").write_text("# Benchmark: rollout\n")
    (tmp_path / "rollout_before.json").write_text(json.dumps({"step_seconds": 50.4}))

    summary = write_summary({"rollout": "ok (359.7 s)"}, tmp_path).read_text()

    assert "| rollout | ok (359.7 s) | 2026-11-25T01:32:22+00:00 | 2.0 | [rollout.md](rollout.md) |" in summary
    assert "rollout_before" not in summary


def test_a_benchmark_that_cannot_run_here_is_skipped_not_failed(monkeypatch):
    import torch

    from bench import BenchmarkSkipped, bench_rollout_gpu, run_all

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BenchmarkSkipped, match="CUDA"):
        bench_rollout_gpu.run()

    def raise_(exc):
        def run_one(name):
            raise exc
        return run_one

    monkeypatch.setattr(run_all, "run_one", raise_(BenchmarkSkipped("needs a CUDA GPU")))
    assert run_all.run_and_report("rollout_gpu").startswith("skipped: needs a CUDA GPU (")
    monkeypatch.setattr(run_all, "run_one", raise_(RuntimeError("broken")))
    assert run_all.run_and_report("rollout_gpu").startswith("FAILED (")
