"""Each baseline on a tiny hand-written fixture, through the real runner, reader, retrieval and scoring."""

from __future__ import annotations

import json

import polars as pl
import pytest

from memalpha.config import load_config
from memalpha.data.io import write_dataset
from memalpha.data.schema import Instance, Question
from memalpha.errors import UserError
from memalpha.evaluation.methods import tail_tokens
from memalpha.evaluation.runner import evaluate, load_instances
from memalpha.tokens import regex_token_count

HEADER = "The following is a conversation from 9:30 am on {day} May, 2023. Please remember it.\n\n"
FILLER = [
    "Bob: Did you see the game last night? What a finish.",
    "Alice: Haha, classic, the bus was late again this morning.",
    "Bob: The coffee at the office is great today, honestly.",
    "Alice: That sounds chaotic, I would have walked instead.",
]


def _chunk(day: int, first: str | None = None, last: str | None = None) -> str:
    lines = ([first] if first else []) + FILLER + ([last] if last else [])
    return HEADER.format(day=day) + "\n".join(lines)


def _instances() -> list[Instance]:
    retrieval = Instance(
        "fixture-ar", "fixture_people", "accurate_retrieval",
        [_chunk(1, first="Alice: I'm allergic to hazelnuts, the test came back positive."), _chunk(5),
         _chunk(9, last="Bob: My favourite city is Lisbon.")],
        [Question("q0", "What is Alice allergic to?", ["hazelnuts"], "single_hop", [0]),
         Question("q1", "What is Bob's favourite city?", ["Lisbon"], "single_hop", [2])],
        split="test",
    )
    conflict = Instance(
        "fixture-cr", "fixture_codes", "conflict_resolution",
        [_chunk(2, first="Carol: My gate code is 4471."), _chunk(6),
         _chunk(12, last="Carol: My gate code is now 9052.")],
        [Question("q0", "What is Carol's gate code now?", ["9052"], "conflict", [2], superseded_answers=["4471"])],
        split="test",
    )
    return [retrieval, conflict]


@pytest.fixture(scope="module")
def config():
    # a reader budget smaller than one instance, larger than one chunk
    return load_config(overrides=["model.policy=tiny", "memory.reader_view_tokens=200", "eval.max_instances=0"])


@pytest.fixture(scope="module")
def result(config):
    return evaluate(config, methods=["no_memory", "long_context", "rag", "rule_writer"], instances=_instances(), progress=None)


def _scores(result, method):
    rows = result.questions.filter(pl.col("method") == method)
    return {f"{i}/{q}": s for i, q, s in zip(rows["instance_id"], rows["question_id"], rows["score"])}


def test_no_memory_is_closed_book(result):
    assert set(_scores(result, "no_memory").values()) == {0.0}
    row = result.instances.filter(pl.col("method") == "no_memory").row(0, named=True)
    assert row["memory_tokens"] == 0 and row["compression"] == 1.0


def test_long_context_sees_only_the_tail(result, config):
    # the last chunk's facts are within the budget, the first chunk's are not
    assert _scores(result, "long_context") == {"fixture-ar/q0": 0.0, "fixture-ar/q1": 1.0, "fixture-cr/q0": 1.0}
    memory = result.instances.filter(pl.col("method") == "long_context")["memory_tokens"].to_list()
    assert all(0 < m <= config.memory.reader_view_tokens for m in memory)


def test_rag_retrieves_chunks_but_cannot_resolve_conflicts(result):
    # both gate-code chunks are retrieved: the stale value in the context makes the answer ambiguous
    assert _scores(result, "rag") == {"fixture-ar/q0": 1.0, "fixture-ar/q1": 1.0, "fixture-cr/q0": 0.0}
    rows = result.instances.filter(pl.col("method") == "rag")
    # RAG keeps every raw chunk: no compression
    assert rows["memory_tokens"].to_list() == rows["input_tokens"].to_list()
    assert rows["compression"].to_list() == [0.0, 0.0]


def test_rule_writer_builds_a_small_memory_and_updates_conflicts(result):
    assert _scores(result, "rule_writer") == {"fixture-ar/q0": 1.0, "fixture-ar/q1": 1.0, "fixture-cr/q0": 1.0}
    rows = result.instances.filter(pl.col("method") == "rule_writer")
    assert all(c > 0.5 for c in rows["compression"])
    assert rows["tool_calls"].sum() > 0 and rows["tool_calls_ok"].sum() == rows["tool_calls"].sum()
    assert rows["answers_lost"].to_list() == [0] * len(rows)  # it updates stale values, never an answer
    assert result.instances.filter(pl.col("method") == "rag")["answers_lost"].null_count() == len(rows)


def test_metrics_and_info(result):
    metrics = result.metrics()
    assert metrics["rule_writer/score"] == 1.0
    # plain mean over the two sources: (1.0 + 0.0) / 2
    assert metrics["rag/score"] == pytest.approx(0.5)
    assert metrics["rule_writer/tool_success"] == 1.0
    assert "rag/tool_success" not in metrics
    assert metrics["rule_writer/answers_lost"] == 0.0 and "rag/answers_lost" not in metrics
    assert metrics["long_context/conflict_resolution/score"] == 1.0
    assert result.info["methods"] == ["no_memory", "long_context", "rag", "rule_writer"]
    assert all(metrics[f"{m}/seconds"] >= 0 for m in result.info["methods"])


def test_policy_without_model_is_skipped(config):
    result = evaluate(config, methods=["policy", "no_memory"], instances=_instances()[:1], progress=None)
    assert result.methods == ["no_memory"]
    assert "policy" in result.info["skipped"]


def test_bad_method_and_missing_split(config, tmp_path):
    with pytest.raises(UserError, match="unknown evaluation method"):
        evaluate(config, methods=["oracle"], instances=_instances(), progress=None)
    data = write_dataset(tmp_path / "data", [Instance(**{**_instances()[0].__dict__, "split": "train"})])
    with pytest.raises(UserError, match="no instance in split 'test'"):
        load_instances(config, data)


def test_tail_tokens():
    text = "one two three four five"
    assert tail_tokens(text, 2, regex_token_count) == "four five"
    assert tail_tokens(text, 10, regex_token_count) == text
    assert tail_tokens(text, 0, regex_token_count) == ""


def test_cli_writes_report_and_fails_on_a_planted_regression(tmp_path, capsys):
    from memalpha.cli import main

    data = write_dataset(tmp_path / "data", _instances())
    common = ["--data", str(data), "--methods", "no_memory", "rag", "--set", "model.policy=tiny",
              "--set", "memory.reader_view_tokens=200", "--set", "eval.regression_keys=[rag/score]"]
    first = tmp_path / "first"
    assert main(["eval", *common, "--out", str(first)]) == 0
    metrics = json.loads((first / "metrics.json").read_text())
    assert metrics["rag/score"] == pytest.approx(0.5)
    for name in ("results.md", "summary.csv", "by_competency.csv", "by_source.csv", "questions.csv",
                 "score_vs_memory.png", "score_vs_length.png", "memories.jsonl"):
        assert (first / name).is_file(), name
    assert "| rag | 0.500 |" in capsys.readouterr().out
    # the same run again is within the threshold; a previous run scoring 0.2 higher is a regression
    assert main(["eval", *common, "--out", str(tmp_path / "same"), "--compare", str(first)]) == 0
    (first / "metrics.json").write_text(json.dumps({**metrics, "rag/score": 0.7}))
    assert main(["eval", *common, "--out", str(tmp_path / "worse"), "--compare", str(first)]) == 1
    assert "REGRESSION" in capsys.readouterr().err
    assert "rag/score fell from 0.7000 to 0.5000" in (tmp_path / "worse" / "results.md").read_text()


def test_cli_rejects_remote_model_uri(capsys):
    from memalpha.cli import main

    assert main(["eval", "--model", "models:/memalpha-policy@champion", "--methods", "no_memory"]) == 2
    assert "resolved by the pipeline" in capsys.readouterr().err


def test_length_generalisation_grows_inputs(config):
    from memalpha.evaluation.length import evaluate_length

    small = config.model_copy(update={"eval": config.eval.model_copy(update={"length_instances": 2, "length_base_chunks": 2})})
    result = evaluate_length(small, methods=["no_memory", "long_context"], multipliers=[1, 3], progress=None)
    table = result.table()
    assert table.height == 4
    tokens = dict(zip(zip(table["method"], table["length_x"]), table["input_tokens"]))
    assert tokens[("long_context", 3)] > 2.5 * tokens[("long_context", 1)]
    metrics = result.metrics()
    assert metrics["no_memory/length_3x/score"] == 0.0
    assert {"long_context/length_1x/score", "long_context/length_3x/memory_tokens"} <= set(metrics)


def test_every_context_respects_the_same_budget(config):
    from memalpha.evaluation.methods import EvalEnv, make_method
    from memalpha.evaluation.answering import policy_tokenizer, token_counter

    tight = config.model_copy(update={"memory": config.memory.model_copy(update={"reader_view_tokens": 64})})
    count = token_counter(policy_tokenizer(tight)[0])
    env = EvalEnv(tight, count)
    for name in ("no_memory", "long_context", "rag", "rule_writer"):
        for built in make_method(name, env).build(_instances(), seed=0):
            assert all(count(context) <= 64 for context in built.contexts), name


def test_instance_cap_alternates_competencies():
    from memalpha.evaluation.runner import stratified

    def inst(i, competency):
        return Instance(f"i{i}", "s", competency, ["c"], [], split="test")

    pool = [inst(0, "a"), inst(1, "a"), inst(2, "a"), inst(3, "b"), inst(4, "c"), inst(5, "b")]
    assert [i.instance_id for i in stratified(pool, 4)] == ["i0", "i3", "i4", "i1"]
    assert len(stratified(pool, 10)) == 6


def test_split_all_evaluates_every_instance_and_the_default_says_what_it_covered(tmp_path, capsys):
    from dataclasses import replace

    from memalpha.cli import main

    base = _instances()
    instances = [replace(base[i % 2], instance_id=f"{base[i % 2].instance_id}-{i}", split=split)
                 for i, split in enumerate(["train"] * 6 + ["validation", "test", "test", "test"])]
    data = write_dataset(tmp_path / "data", instances)
    common = ["--data", str(data), "--methods", "no_memory", "--set", "model.policy=tiny", "--set", "eval.max_instances=2"]
    assert main(["eval", *common, "--out", str(tmp_path / "default")]) == 0
    covered = "2 of 3 instances of the test split, 2 taken round-robin over competencies"
    assert covered in capsys.readouterr().out
    assert covered in (tmp_path / "default" / "results.md").read_text()

    assert main(["eval", *common, "--split", "all", "--out", str(tmp_path / "all")]) == 0
    assert "10 of 10 instances of the whole dataset (every split)" in capsys.readouterr().out
    evaluated = pl.read_csv(tmp_path / "all" / "instances.csv")["instance_id"].to_list()
    assert sorted(evaluated) == sorted(i.instance_id for i in instances)


def test_oracle_evidence_hands_the_reader_the_gold_turns():
    from memalpha.config import load_config
    from memalpha.data.schema import Instance, Question
    from memalpha.evaluation.methods import EvalEnv, make_method
    from memalpha.tokens import regex_token_count

    chunks = ["Maya: I adopted a cat. Her name is Pepper.", "Tom: my sister Lena is moving to Lisbon."]
    questions = [Question("q0", "What is the name of Maya's cat?", ["Pepper"], "single_hop", [0]),
                 Question("q1", "Where is Lena moving?", ["Lisbon"], "single_hop", [1])]
    instance = Instance("oracle", "locomo", "accurate_retrieval", chunks, questions, metadata={"evidence_turns": {
        "q0": [{"chunk": 0, "speaker": "Maya", "date": "2024-03-02", "text": "Her name is Pepper."}]}})
    built = make_method("oracle_evidence", EvalEnv(load_config(None), regex_token_count)).build([instance], 0)[0]
    assert built.contexts == ["2024-03-02, Maya: Her name is Pepper.", chunks[1]], "turns where known, else the chunk"
    assert built.memory_tokens == regex_token_count("\n".join(built.contexts)), "the evidence it shows"
