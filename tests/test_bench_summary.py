"""bench/run_all.py: SUMMARY.md has one row per report and none for input files, with the status each benchmark's latest
run recorded in statuses.json; a benchmark that cannot run here is skipped."""

import json

import pytest

from bench.run_all import write_summary


def test_summary_lists_reports_and_leaves_out_inputs_without_a_report(tmp_path):
    (tmp_path / "rollout.json").write_text(json.dumps({"finished_at": "2026-11-25T01:32:22+00:00",
                                                      "machine": {"load_average_1m_at_end": 2.0}}))
    (tmp_path / "rollout.md").write_text("# Benchmark: rollout\n")
    (tmp_path / "rollout_before.json").write_text(json.dumps({"step_seconds": 50.4}))

    summary = write_summary({"rollout": "ok (359.7 s)"}, tmp_path).read_text()

    assert "| rollout | ok (359.7 s) | 2026-11-25T01:32:22+00:00 | 2.0 |  | [rollout.md](rollout.md) |" in summary
    assert "rollout_before" not in summary


def test_a_partial_run_keeps_the_status_earlier_runs_reported_for_the_others(tmp_path):
    for name in ("learning", "memory"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"finished_at": "2026-11-26T14:08:03+00:00"}))
        (tmp_path / f"{name}.md").write_text(f"# Benchmark: {name}\n")
    write_summary({"learning": "ok (3381.2 s, this run)", "memory": "FAILED (2.0 s, this run)"}, tmp_path)

    summary = write_summary({"memory": "ok (41.0 s, this run)"}, tmp_path).read_text()

    assert "| learning | ok (3381.2 s, an earlier run) |" in summary
    assert "| memory | ok (41.0 s, this run) |" in summary
    assert summary.count("| learning |") == 1
    assert json.loads((tmp_path / "statuses.json").read_text()) == {"learning": "ok (3381.2 s, an earlier run)",
                                                                     "memory": "ok (41.0 s, this run)"}
    assert "statuses" not in summary


def test_statuses_survive_a_deleted_summary_and_a_broken_status_file_is_named_not_overwritten(tmp_path):
    (tmp_path / "rollout.json").write_text(json.dumps({"finished_at": "2026-11-25T01:32:22+00:00"}))
    (tmp_path / "rollout.md").write_text("# Benchmark: rollout\n")
    write_summary({"rollout": "skipped: needs a CUDA GPU (0.1 s, this run)"}, tmp_path)
    (tmp_path / "SUMMARY.md").unlink()

    assert "| rollout | skipped: needs a CUDA GPU (0.1 s, an earlier run) |" in write_summary({}, tmp_path).read_text()

    (tmp_path / "statuses.json").write_text("{not json")
    before = (tmp_path / "SUMMARY.md").read_text()
    with pytest.raises(ValueError, match="statuses.json: not valid JSON"):
        write_summary({"rollout": "ok (1.0 s, this run)"}, tmp_path)
    assert (tmp_path / "statuses.json").read_text() == "{not json"
    assert (tmp_path / "SUMMARY.md").read_text() == before


def test_results_name_the_cpu_and_whether_it_has_native_bf16(tmp_path, monkeypatch):
    from bench import run_all

    monkeypatch.setattr(run_all, "cpu_supports_bf16", lambda: False)
    json_path, _ = run_all.write_results("memory", {"x": 1}, "# memory\n", tmp_path)
    machine = json.loads(json_path.read_text())["machine"]
    assert machine["cpu"] and machine["cpu_native_bf16"] is False

    summary = write_summary({"memory": "ok"}, tmp_path).read_text()
    assert f"| {machine['cpu']}, no native bf16 | [memory.md](memory.md) |" in summary


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
