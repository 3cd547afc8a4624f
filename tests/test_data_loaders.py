"""Each loader on a small fixture written in its real format."""

import json

import polars as pl
import pytest

from memalpha.data.loaders import (
    load_jsonl,
    load_locomo,
    load_memoryagentbench,
    load_source,
    to_instance,
)
from memalpha.data.schema import DataError, Instance
from memalpha.tokens import regex_token_count

LONG_CONTEXT = " ".join(f"Sentence {i} says that item {i} is stored in box {i * 7}." for i in range(400))


def test_memoryagentbench_parquet_rows(tmp_path):
    path = tmp_path / "Accurate_Retrieval.parquet"
    pl.DataFrame({
        "context": [LONG_CONTEXT, "The capital of Zorbia is Quon. Nothing else."],
        "questions": [["Where is item 3 stored?", "Where is item 399 stored?"], ["What is the capital of Zorbia?"]],
        "answers": [[["box 21"], ["box 2793", "2793"]], [["Quon"]]],
        "metadata": [{"source": "ruler_qa1_197K", "qa_pair_ids": ["a1", "a2"]}, {"source": "ruler_qa1_197K", "qa_pair_ids": ["b1"]}],
    }).write_parquet(path)
    loaded = load_memoryagentbench(path)
    first = to_instance(loaded.items[0], regex_token_count, 512)
    assert first.instance_id == "mab-ruler_qa1_197K-0" and first.competency == "accurate_retrieval"
    assert len(first.chunks) > 5 and all(c.startswith("The following is part of a document.") for c in first.chunks)
    assert [q.question_id for q in first.questions] == ["a1", "a2"]
    assert first.questions[1].answers == ["box 2793", "2793"] and first.questions[1].evidence_chunks is None
    assert "item 399 is stored in box 2793." in first.chunks[-1]


def test_memoryagentbench_jsonl_competency_and_numbers(tmp_path):
    path = tmp_path / "rows.jsonl"
    row = {"context": "Example: 'card stolen' has label 4.", "questions": ["Label of 'lost card'?"], "answers": [[4]],
           "metadata": {"source": "icl_banking77_5900shot_balance"}}
    path.write_text(json.dumps(row) + "\n")
    item = load_memoryagentbench(path).items[0]
    assert item.competency == "test_time_learning" and item.questions[0].answers == ["4"]


@pytest.mark.parametrize("row, message", [
    ({"questions": [], "answers": []}, "row 0: missing field 'context'"),
    ({"context": "x", "questions": ["a", "b"], "answers": [["1"]]}, "2 questions but 1 answer lists"),
    ({"context": 5, "questions": [], "answers": []}, "field 'context': expected str, got int"),
])
def test_memoryagentbench_errors(tmp_path, row, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_memoryagentbench(path)


def _locomo():
    return [{
        "sample_id": "conv-1",
        "conversation": {
            "speaker_a": "Caroline", "speaker_b": "Melanie",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Caroline", "dia_id": "D1:1", "text": "I went to a support group yesterday."},
                {"speaker": "Melanie", "dia_id": "D1:2", "text": "That's great! I painted a sunrise in 2022.",
                 "img_url": ["x"], "blip_caption": "a painting of a sunrise over a lake"},
            ],
            "session_2_date_time": "1:14 pm on 25 May, 2023",
            "session_2": [{"speaker": "Caroline", "dia_id": f"D2:{i}", "text": f"Filler line number {i} about nothing."}
                          for i in range(1, 60)] + [{"speaker": "Melanie", "dia_id": "D2:60", "text": "We have 3 kids."}],
            "session_10_date_time": "9:00 am on 1 June, 2023",
            "session_10": [{"speaker": "Melanie", "dia_id": "D10:1", "text": "Back from camping at the lake."}],
        },
        "qa": [
            {"question": "When did Melanie paint a sunrise?", "answer": 2022, "evidence": ["D1:2"], "category": 2},
            {"question": "How many kids does Melanie have?", "answer": 3, "evidence": ["D2:60; D1:1"], "category": 1},
            {"question": "Where did Melanie camp?", "answer": "the lake", "evidence": ["D10:1", "D99:9"], "category": 4},
            {"question": "What did Caroline paint?", "adversarial_answer": "a sunrise", "evidence": ["D1:2"], "category": 5},
        ],
    }]


def test_locomo_sessions_evidence_and_adversarial(tmp_path):
    path = tmp_path / "locomo10.json"
    path.write_text(json.dumps(_locomo()))
    loaded = load_locomo(path)
    inst = to_instance(loaded.items[0], regex_token_count, 512)
    assert inst.instance_id == "locomo-conv-1" and inst.data_source == "locomo"
    assert [q.question_type for q in inst.questions] == ["temporal", "multi_hop", "single_hop"]
    assert [q.answers for q in inst.questions] == [["2022"], ["3"], ["the lake"]]  # numbers became strings
    assert inst.metadata["dropped_adversarial"] == 1 and inst.metadata["unknown_evidence_ids"] == 1
    assert "dropped 1 adversarial" in loaded.notes[0]
    assert inst.chunks[0].startswith("The following is a conversation from 1:56 pm on 8 May, 2023.")
    assert "[shares a photo: a painting of a sunrise over a lake]" in inst.chunks[0]
    # evidence dia_ids map to the chunks that hold those turns; session 10 comes after session 2
    for q in inst.questions:
        assert q.evidence_chunks and all(0 <= c < len(inst.chunks) for c in q.evidence_chunks)
    assert "2022" in inst.chunks[inst.questions[0].evidence_chunks[0]]
    assert "We have 3 kids." in inst.chunks[max(inst.questions[1].evidence_chunks)]
    assert inst.questions[2].evidence_chunks == [len(inst.chunks) - 1] and "camping" in inst.chunks[-1]


def test_locomo_bad_turn_is_named(tmp_path):
    data = _locomo()
    data[0]["conversation"]["session_2"][3] = {"speaker": "Caroline", "dia_id": "D2:4"}
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"conversation 0: field 'conversation.session_2'\[3\]: missing field 'text'"):
        load_locomo(path)


def test_jsonl_sessions_text_and_chunks(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"instance_id": "s1", "competency": "conflict_resolution",
         "sessions": [{"date": "3 March 2024", "turns": [{"speaker": "Ann", "text": "I live in Oslo.", "id": "a"}]},
                      {"date": "9 March 2024", "turns": [{"speaker": "Ann", "text": "I moved to Graz.", "id": "b"}]}],
         "questions": [{"question": "Where does Ann live?", "answer": "Graz", "question_type": "conflict",
                        "evidence": ["b"], "superseded_answers": ["Oslo"]}]},
        {"instance_id": "t1", "text": "The sky over Quon is green.", "questions": [{"question": "Sky colour?", "answers": ["green"]}]},
        {"instance_id": "c1", "data_source": "booksum", "chunks": ["Part one.", "Part two."],
         "questions": [{"question": "Summary?", "answer": "part"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = load_source("jsonl", path)
    assert isinstance(loaded.items[2], Instance) and loaded.items[2].competency == "long_range_understanding"
    s1, t1, c1 = (to_instance(item, regex_token_count, 512) for item in loaded.items)
    assert s1.questions[0].evidence_chunks == [0] and s1.questions[0].superseded_answers == ["Oslo"]
    assert "Later, on 9 March 2024:\nAnn: I moved to Graz." in s1.chunks[0]
    assert t1.questions[0].answers == ["green"] and c1.chunks == ["Part one.", "Part two."]
    assert loaded.origins["t1"] == f"{path}: row 1"


def test_jsonl_malformed_line_is_named(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"text": "a", "questions": []}\n{"text": \n')
    with pytest.raises(DataError, match="x.jsonl: line 2: malformed JSON"):
        load_jsonl(path)
