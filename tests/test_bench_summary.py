"""bench/run_all.py's SUMMARY.md: one row per report, none for input files."""

import json

from bench.run_all import write_summary


def test_summary_lists_reports_and_leaves_out_inputs_without_a_report(tmp_path):
    (tmp_path / "rollout.json").write_text(json.dumps({"finished_at": "2026-11-25T01:32:22+00:00",
                                                      "machine": {"load_average_1m_at_end": 2.0}}))
    (tmp_path / "rollout.md").write_text("# Benchmark: rollout\n")
    (tmp_path / "rollout_before.json").write_text(json.dumps({"step_seconds": 50.4}))

    summary = write_summary({"rollout": "ok (359.7 s)"}, tmp_path).read_text()

    assert "| rollout | ok (359.7 s) | 2026-11-25T01:32:22+00:00 | 2.0 | [rollout.md](rollout.md) |" in summary
    assert "rollout_before" not in summary
