"""The real-data report: its targets from the seeds' mean, its tables, and a report rebuilt from the cached
memories and answers without writing again (a lost reader's answers are made again from the kept memories)."""

import json

import pytest
from test_rollout import CONFIG as TINY_CONFIG
from test_rollout import make_instances

from bench import bench_real as real
from memalpha.config import load_config


def _method(qa: float, memory_tokens: float) -> dict:
    return {"qa": qa, "f1": qa / 2, "memory_tokens": memory_tokens, "minutes": 1.0, "questions": 4,
            "by_category": {c: {"qa": qa, "f1": qa / 2, "n": 1} for c in real.LOCOMO_CATEGORIES}}


def _report(seeds_qa: list[float], warm_qa: float, synthetic_qa: float) -> dict:
    seeds = {f"trained_seed{s}": _method(qa, 100) for s, qa in enumerate(seeds_qa)}
    locomo = {"trained": real.seeds_mean(list(seeds.values())), **seeds, "warm_start": _method(warm_qa, 90),
              "shipped_writer": _method(0.05, 80), "rule_writer": _method(0.02, 300), "rag": _method(0.10, 400),
              "long_context": _method(0.03, 1000), "no_memory": _method(0.01, 0)}
    synthetic = {"trained": {**_method(synthetic_qa, 50), "qa_seed_std": 0.01}}
    shape = {"conversations": 1, "questions": 4, "chunks": 2}
    report = {"locomo": {"readers": {r: {"methods": locomo} for r in real.READERS}, **shape},
              "synthetic": {"readers": {r: {"methods": synthetic} for r in real.READERS}, **shape}}
    report["targets"] = real.targets(report)
    report["curves"] = {0: [{"step": 1, "reward": 1.0}, {"step": 2, "reward": 1.2, "validation_qa": 0.3}]}
    report["settings"] = {"seeds": [0, 1, 2], "steps": 2, "chunk_tokens": 512, "demonstrations": 4, "mix": {"a": 1.0},
                          "minutes_this_run": 0.1}
    return report


def test_targets_judge_the_seeds_mean_against_each_method_and_the_synthetic_bar():
    met = _report([0.20, 0.22, 0.24], warm_qa=0.15, synthetic_qa=0.28)
    trained = met["locomo"]["readers"]["local"]["methods"]["trained"]
    assert trained["qa"] == pytest.approx(0.22) and trained["qa_seed_std"] == pytest.approx(0.02)
    assert trained["qa_seeds"] == [0.20, 0.22, 0.24]
    assert all(met["targets"].values())  # 0.07 above the warm start > 3 x 0.02; memory 100 <= 25% of 400
    missed = _report([0.20, 0.22, 0.24], warm_qa=0.17, synthetic_qa=0.27)["targets"]
    assert [name for name, ok in missed.items() if not ok] == [
        f"synthetic learning bench, local: trained >= {real.SYNTHETIC_BAR[0]} - {real.SYNTHETIC_BAR[1]}",
        "LoCoMo local: trained > warm start by 3 seed std"]


def test_the_report_has_a_table_per_source_and_reader_and_each_target():
    report = _report([0.20, 0.22, 0.24], warm_qa=0.17, synthetic_qa=0.28)
    report["locomo"]["readers"]["local"]["trained_minus"] = {"rag": {"diff": 0.12, "ci95": [0.05, 0.19]}}
    report["perltqa"] = {"absent": "no PerLTQA release at data/raw/perltqa"}
    text = real.to_markdown(report)
    assert "paired by question" in text and "rag +0.120 [+0.050, +0.190]" in text
    assert "## perltqa: not run: no PerLTQA release at data/raw/perltqa" in text
    assert text.count("### local reader") == 2 and text.count("### evidence reader") == 2
    assert "| trained | 0.220 | 0.110 | 0.020 | 0.220 | 0.220 | 0.220 | 0.220 | 100 | 3.0 |" in text
    assert "| LoCoMo local: trained > warm start by 3 seed std | missed |" in text
    assert "| 0 | 1.000 | 1.200 | 0.300 |" in text


def test_scores_are_rebuilt_from_the_caches_and_a_lost_reader_is_answered_again_without_writing(tmp_path, monkeypatch):
    config = load_config(TINY_CONFIG, [f"data.train_path={tmp_path}", "sft.enabled=false"])
    instances = make_instances()[:3]
    first = real.score(config, instances, "test long_context", "long_context", None, tmp_path)
    assert set(first) == set(real.READERS)
    assert first["local"]["memory_tokens"] == first["evidence"]["memory_tokens"] > 0
    assert first["local"]["questions"] == 3 and first["local"]["by_category"]["single_hop"]["n"] == 3

    def no_writing(*args, **kwargs):
        raise AssertionError("a cached build was written again")

    monkeypatch.setattr("memalpha.evaluation.methods.make_method", no_writing)
    assert real.score(config, instances, "test long_context", "long_context", None, tmp_path) == first
    local = tmp_path / "local" / "long_context.json"
    answers = json.loads(local.read_text())["rows"]
    local.unlink()  # the local reader's answers lost: answered again from the kept build
    again = real.score(config, instances, "test long_context", "long_context", None, tmp_path)
    assert json.loads(local.read_text())["rows"] == answers
    assert {k: v for k, v in again["local"].items() if k != "minutes"} == \
        {k: v for k, v in first["local"].items() if k != "minutes"}


def test_a_missing_locomo_file_says_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "LOCOMO", tmp_path / "locomo10.json")
    with pytest.raises(FileNotFoundError, match="locomo10.json.*MEMALPHA_LOCOMO"):
        real.prepare_data()


def test_the_paired_difference_averages_the_seeds_per_question_and_its_interval_says_when_it_is_noise(tmp_path):
    def rows(name: str, scores: list[float]):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"rows": [{"instance_id": f"c{i % 3}", "question_id": f"q{i}", "score": x}
                                             for i, x in enumerate(scores)]}))
        return real.question_scores(path)

    seeds = [rows("s0", [1, 1, 0, 0] * 25), rows("s1", [1, 0, 1, 0] * 25)]
    worse = real.paired_difference(seeds, rows("worse", [0.0] * 100))
    assert worse["diff"] == pytest.approx(0.5) and 0 < worse["ci95"][0] < 0.5 < worse["ci95"][1]
    level = real.paired_difference(seeds, rows("level", [1, 0, 0, 1] * 25))  # the same mean, other questions
    assert level["diff"] == pytest.approx(0.0) and level["ci95"][0] < 0 < level["ci95"][1]
