"""Expectation suite, semantic checks, closed-book filter and the report."""

import pytest

from memalpha.data.schema import Instance, Question
from memalpha.data.validation import Limits, validate
from memalpha.tokens import regex_token_count


def _good(iid="a", **kw):
    base = dict(instance_id=iid, data_source="test", competency="accurate_retrieval",
                chunks=["Ann adopted a dog named Rex.", "Bob moved to Lyon in 2021."],
                questions=[Question("q0", "Dog's name?", ["Rex"], "single_hop", [0]),
                           Question("q1", "Where did Bob move?", ["Lyon"], "single_hop", [1])], metadata={}, split="")
    base.update(kw)
    return Instance(**base)


@pytest.fixture(scope="module")
def mixed():
    instances = [
        _good("ok"),
        _good("absent", questions=[Question("q0", "Cat's name?", ["Tom"], "single_hop"),
                                    Question("q1", "Where did Bob move?", ["Lyon"], "single_hop")]),
        _good("empty_chunk", chunks=["Ann adopted a dog named Rex.", "  "]),
        _good("ok"),  # duplicate id
        _good("dupq", questions=[Question("q0", "Dog's name?", ["Rex"], "single_hop"),
                                  Question("q1", "dog's NAME", ["Rex"], "single_hop"),
                                  Question("q1", "Where did Bob move?", ["Lyon"], "single_hop")]),
        _good("badev", questions=[Question("q0", "Dog's name?", ["Rex"], "single_hop", [5])]),
        _good("longans", questions=[Question("q0", "Dog?", ["Rex " * 80], "single_hop")]),
        _good("num", questions=[Question("q0", "Year?", ["2021"], "temporal")]),
        _good("weird", competency="telepathy", questions=[Question("q0", "Dog?", ["Rex"], "mind_reading")]),
        _good("summary", competency="long_range_understanding",
              questions=[Question("q0", "Summarize.", ["Rex", "Lyon", "Paris"], "summary"),
                         Question("q1", "Summarize again.", ["Rex", "Paris", "Rome"], "summary")]),
    ]
    return instances, validate(instances, regex_token_count, Limits.from_config())


def _reasons(result, iid):
    return [(r["check"], r["field"], r["question_id"], r["chunk_index"]) for r in result.rejected if r["instance_id"] == iid]


def test_valid_instances_kept(mixed):
    _, result = mixed
    assert [i.instance_id for i in result.valid] == ["ok", "absent", "dupq", "num", "summary"]
    assert result.counts["instances_in"] == 10 and result.counts["instances_valid"] == 5


def test_answer_absent_from_context_drops_the_question(mixed):
    _, result = mixed
    assert ("answer_in_context", "answers", "q0", None) in _reasons(result, "absent")
    absent = next(i for i in result.valid if i.instance_id == "absent")
    assert [q.question_id for q in absent.questions] == ["q1"]


def test_empty_chunk_drops_the_instance(mixed):
    _, result = mixed
    assert _reasons(result, "empty_chunk") == [("expect_column_values_to_be_between(tokens)", "chunks", None, 1)]


def test_a_whitespace_only_chunk_is_rejected_even_when_the_tokenizer_counts_its_spaces():
    spaces_count = lambda text: len(text)  # noqa: E731  (a subword tokenizer gives whitespace tokens)
    result = validate([_good("blank", chunks=["Ann adopted a dog named Rex.", " \n\t "])], spaces_count)
    assert result.valid == []
    assert [(r["chunk_index"], r["reason"]) for r in result.rejected if r["table"] == "chunks"] == [
        (1, "empty or whitespace-only chunk")]


def test_duplicate_instance_id_keeps_the_first(mixed):
    _, result = mixed
    dup = [r for r in result.rejected if r["instance_id"] == "ok"]
    assert len(dup) == 1 and "first at row 0" in dup[0]["reason"]


def test_duplicate_question_id_and_text(mixed):
    _, result = mixed
    reasons = _reasons(result, "dupq")
    assert ("expect_column_values_to_be_unique(question_key)", "question_id", "q1", None) in reasons
    assert ("duplicate_question", "question", "q1", None) in reasons
    dupq = next(i for i in result.valid if i.instance_id == "dupq")
    assert [q.question for q in dupq.questions] == ["Dog's name?"]
    # a duplicate question is a removal, not an input error
    assert all(r["check"] != "duplicate_question" for r in result.errors)


def test_evidence_answer_length_and_types(mixed):
    _, result = mixed
    assert ("expect_column_values_to_be_in_set(evidence_in_range)", "evidence_chunks", "q0", None) in _reasons(result, "badev")
    assert ("expect_column_values_to_be_between(answer_tokens)", "answers", "q0", None) in _reasons(result, "longans")
    weird = {r[1] for r in _reasons(result, "weird")}
    assert {"competency", "question_type"} <= weird


def test_summary_keywords(mixed):
    _, result = mixed
    summary = next(i for i in result.valid if i.instance_id == "summary")
    assert [q.question_id for q in summary.questions] == ["q0"]  # 2/3 keywords present
    assert any("1/3 keywords" in r["reason"] for r in result.rejected if r["instance_id"] == "summary")


def test_errors_are_described_with_origins(mixed):
    _, result = mixed
    text = result.describe_errors({"empty_chunk": "in.parquet: row 2"}, limit=50)
    assert "instance 'empty_chunk' (in.parquet: row 2): chunk 1: field 'chunks': empty or whitespace-only chunk [expect_column_values_to_be_between(tokens)]" in text
    assert "instance 'absent': question 'q0': field 'answers': no gold answer occurs in the context" in text


def test_report(mixed):
    _, result = mixed
    md = result.report_markdown()
    assert "| instances valid | 5 |" in md and "answer_in_context" in md
    assert "closed-book filter skipped: no reader configured" in md
    html = result.report_html()
    assert html.startswith("<!doctype html>") and "answer_in_context" in html


def test_closed_book_filter_uses_the_reader():
    known = {"Where did Bob move?": "He moved to Lyon."}

    def reader(question: str) -> str:
        return known.get(question, "I don't know")

    result = validate([_good("x")], regex_token_count, reader=reader)
    assert [q.question_id for q in result.valid[0].questions] == ["q0"]
    assert result.counts["closed_book_removed"] == 1 and not result.errors
    assert not any("skipped" in n for n in result.notes)


def test_instance_without_valid_questions_is_rejected():
    inst = _good("none", questions=[Question("q0", "Cat?", ["Tom"], "single_hop")])
    result = validate([inst], regex_token_count)
    assert result.valid == [] and {r["check"] for r in result.rejected} == {"answer_in_context", "has_questions"}


def test_limits_come_from_data_config():
    from memalpha.config import DataConfig

    limits = Limits.from_config(DataConfig(max_chunk_tokens=16, max_answer_tokens=1))
    inst = _good("x", chunks=["Ann adopted a dog named Rex. " * 3, "Bob moved to Lyon in 2021."], questions=[Question("q0", "Dog?", ["Rex"], "single_hop"), Question("q1", "Move?", ["to Lyon"], "single_hop")])
    result = validate([inst], regex_token_count, limits)
    assert result.valid == []
    assert {(r["check"], r["chunk_index"], r["question_id"]) for r in result.errors} == {
        ("expect_column_values_to_be_between(tokens)", 0, None), ("expect_column_values_to_be_between(answer_tokens)", None, "q1")}
