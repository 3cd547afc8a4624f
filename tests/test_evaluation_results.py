"""Aggregation of evaluation records against hand-computed values."""

from __future__ import annotations

import math

import polars as pl
import pytest

from memalpha.evaluation.results import (
    INSTANCE_COLUMNS,
    QUESTION_COLUMNS,
    EvalResult,
    flat_metrics,
    metric_name,
)


def _question(method, seed, instance, source, competency, qid, score):
    return {
        "method": method, "seed": seed, "instance_id": instance, "data_source": source, "competency": competency,
        "input_tokens": 100, "question_id": qid, "question_type": "qa", "question": "q?", "prediction": "p",
        "score": score,
    }


def _instance(method, seed, instance, source, competency, memory, calls, ok, seconds, lost=None):
    return {
        "method": method, "seed": seed, "instance_id": instance, "data_source": source, "competency": competency,
        "num_chunks": 2, "num_questions": 2, "input_tokens": 100, "memory_tokens": memory,
        "compression": 1 - memory / 100, "tool_calls": calls, "tool_calls_ok": ok, "answers_lost": lost,
        "prompts_cut": 1 if lost is not None else 0, "rechunked": False, "build_seconds": seconds, "answer_seconds": 1.0,
    }


@pytest.fixture
def result() -> EvalResult:
    questions = [
        # seed 0: s1 = mean(1, 0) = 0.5, s2 = 1.0 -> plain mean over sources 0.75 (micro would be 2/3)
        _question("writer", 0, "i1", "s1", "accurate_retrieval", "q1", 1.0),
        _question("writer", 0, "i1", "s1", "accurate_retrieval", "q2", 0.0),
        _question("writer", 0, "i2", "s2", "conflict_resolution", "q3", 1.0),
        # seed 1: s1 = 1.0, s2 = 0.0 -> 0.5
        _question("writer", 1, "i1", "s1", "accurate_retrieval", "q1", 1.0),
        _question("writer", 1, "i1", "s1", "accurate_retrieval", "q2", 1.0),
        _question("writer", 1, "i2", "s2", "conflict_resolution", "q3", 0.0),
        _question("closed", 0, "i1", "s1", "accurate_retrieval", "q1", 0.0),
        _question("closed", 0, "i1", "s1", "accurate_retrieval", "q2", 0.0),
        _question("closed", 0, "i2", "s2", "conflict_resolution", "q3", 1.0),
    ]
    instances = [
        _instance("writer", 0, "i1", "s1", "accurate_retrieval", 10, 4, 3, 2.0, lost=1),
        _instance("writer", 0, "i2", "s2", "conflict_resolution", 30, 0, 0, 3.0, lost=0),
        _instance("writer", 1, "i1", "s1", "accurate_retrieval", 20, 2, 2, 4.0, lost=2),
        _instance("writer", 1, "i2", "s2", "conflict_resolution", 40, 2, 2, 5.0, lost=1),
        _instance("closed", 0, "i1", "s1", "accurate_retrieval", 0, 0, 0, 0.0),
        _instance("closed", 0, "i2", "s2", "conflict_resolution", 0, 0, 0, 0.0),
    ]
    return EvalResult(
        questions=pl.DataFrame(questions, schema=QUESTION_COLUMNS),
        instances=pl.DataFrame(instances, schema=INSTANCE_COLUMNS),
    )


def test_overall_score_is_plain_mean_over_sources_then_mean_and_std_over_seeds(result):
    row = result.summary().filter(pl.col("method") == "writer").row(0, named=True)
    assert row["score"] == pytest.approx((0.75 + 0.5) / 2)
    assert row["score_std"] == pytest.approx(math.sqrt(2 * 0.125**2 / 1))
    # per competency: seed 0 (0.5 + 1.0) / 2, seed 1 (1.0 + 0.0) / 2
    assert row["competency_mean"] == pytest.approx((0.75 + 0.5) / 2)
    assert row["seeds"] == 2
    assert row["memory_tokens"] == pytest.approx((20 + 30) / 2)
    assert row["memory_tokens_std"] == pytest.approx(math.sqrt(2 * 5**2))
    # tool success is successful / all calls per seed: 3/4 and 4/4
    assert row["tool_success"] == pytest.approx((0.75 + 1.0) / 2)
    # answers lost per instance: 0.5 in seed 0, 1.5 in seed 1
    assert row["answers_lost"] == pytest.approx(1.0)
    # seconds: total build + answer time of a seed (7 and 11)
    assert row["seconds"] == pytest.approx(9.0)


def test_single_seed_has_zero_spread_and_no_tool_success(result):
    row = result.summary().filter(pl.col("method") == "closed").row(0, named=True)
    assert row["score"] == pytest.approx((0.0 + 1.0) / 2)
    assert row["score_std"] == 0.0
    assert row["seeds"] == 1
    assert row["tool_success"] is None


def test_group_tables(result):
    by_competency = result.by("competency").filter(pl.col("method") == "writer")
    scores = dict(zip(by_competency["competency"], by_competency["score"]))
    assert scores == pytest.approx({"accurate_retrieval": 0.75, "conflict_resolution": 0.5})
    by_source = result.by("data_source")
    assert by_source["method"].to_list() == ["writer", "writer", "closed", "closed"]
    with pytest.raises(ValueError, match="cannot group by"):
        result.by("question_type")


def test_flat_metric_keys_name_the_method(result):
    metrics = flat_metrics(result)
    assert metrics["writer/score"] == pytest.approx(0.625)
    assert metrics["closed/score"] == pytest.approx(0.5)
    assert metrics["writer/accurate_retrieval/score"] == pytest.approx(0.75)
    assert metrics["writer/source/s2/score"] == pytest.approx(0.5)
    assert metrics["writer/tool_success"] == pytest.approx(0.875)
    assert "closed/tool_success" not in metrics
    assert all(isinstance(value, float) for value in metrics.values())


def test_metric_name_sanitises():
    assert metric_name("locomo:conv=1") == "locomo_conv_1"


def test_missing_columns_rejected():
    with pytest.raises(ValueError, match="questions lacks columns"):
        EvalResult(questions=pl.DataFrame({"method": ["a"]}))


def test_report_writes_tables_and_plots(result, tmp_path):
    from memalpha.evaluation.report import write_report

    result.info = {"data": "fixture", "seeds": [0, 1]}
    paths = write_report(result, tmp_path, title="Fixture")
    markdown = paths["markdown"].read_text()
    assert "| writer | 0.625 ± 0.177 | 0.625 ± 0.177 | 25 ± 7 | 0.750 ± 0.071 | 0.875 ± 0.177 | 1.000 | 2.000 | 9.0 | 2 | 2 | 3 | 100 | 2 |" in markdown
    assert "| closed | 0.500 | 0.500 | 0 | 1.000 | - | - |" in markdown
    summary = pl.read_csv(paths["summary_csv"])
    assert summary["score"].to_list() == pytest.approx([0.625, 0.5])
    assert pl.read_csv(paths["by_competency_csv"]).height == 4
    for name in ("score_vs_memory", "score_vs_length"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"


def test_a_memory_with_a_lone_surrogate_is_written_escaped(result, tmp_path):
    """A model can emit "\\ud83d" inside JSON; the report writer escapes it instead of raising."""
    from memalpha.evaluation.report import write_report

    result.memories = [{"method": "writer", "instance_id": "i1", "memory": {"semantic": ["likes \ud83d tea"]}}]
    result.info = {"data": "fixture \ud83d"}
    paths = write_report(result, tmp_path, title="Fixture \ud83d")
    assert "likes \\ud83d tea" in paths["memories"].read_text(encoding="utf-8")
    assert "Fixture \\ud83d" in paths["markdown"].read_text(encoding="utf-8")
