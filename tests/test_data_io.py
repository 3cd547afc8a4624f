"""Canonical dataset on disk: Memalpha-compatible parquet, atomic folders, clear errors."""

import json

import polars as pl
import pytest

from memalpha.data.io import (
    DATA_FILE,
    frame_to_instances,
    instances_to_frame,
    read_dataset,
    write_dataset,
)
from memalpha.data.schema import DataError, Instance, Question
from memalpha.errors import UserError


def _instances():
    return [
        Instance("a", "synthetic", "accurate_retrieval", ["chunk one: Ann owns a dog named Rex.", "chunk two"],
                 [Question("q0", "What is the dog's name?", ["Rex"], "single_hop", [0]),
                  Question("q1", "Where?", ["Lyon", "Lyon, France"], "multi_hop", None)],
                 {"seed": 3, "speakers": ["Ann", "Bo"]}, "train"),
        Instance("b", "synthetic", "conflict_resolution", ["Bo lives in Oslo.", "Bo moved to Graz."],
                 [Question("q0", "Where does Bo live now?", ["Graz"], "conflict", [1], ["Oslo"])], {}, "test"),
    ]


def test_round_trip_identical(tmp_path):
    write_dataset(tmp_path / "ds", _instances(), manifest={"source": "test"})
    assert read_dataset(tmp_path / "ds") == _instances()
    assert read_dataset(tmp_path / "ds" / DATA_FILE) == _instances()


def test_memalpha_columns_and_question_objects(tmp_path):
    frame = instances_to_frame(_instances())
    for column in ("instance_id", "chunks", "questions_and_answers", "data_source", "metadata", "num_chunks", "num_questions"):
        assert column in frame.columns
    qa = json.loads(frame["questions_and_answers"][0])
    # the paper's code reads question/answer; answer is the first gold answer
    assert qa[1]["question"] == "Where?" and qa[1]["answer"] == "Lyon"
    assert json.loads(frame["chunks"][1]) == ["Bo lives in Oslo.", "Bo moved to Graz."]
    assert frame["num_chunks"].to_list() == [2, 2]


def test_paper_format_file_loads_with_inferred_fields(tmp_path):
    path = tmp_path / "memalpha.parquet"
    pl.DataFrame({
        "instance_id": ["x1", "x2"],
        "chunks": [json.dumps(["The label of 'hello' is 3."]), json.dumps(["Ann moved to Porto."])],
        "questions_and_answers": [json.dumps([{"question": "Label of 'hi'?", "answer": 3}]),
                                  json.dumps([{"question": "Where did Ann move?", "answer": "Porto"}])],
        "data_source": ["trec_coarse", "squad"],
        "metadata": ["{}", json.dumps({"k": 1})],
        "num_chunks": [1, 1],
        "num_questions": [1, 1],
    }).write_parquet(path)
    first, second = read_dataset(path)
    assert first.competency == "test_time_learning" and second.competency == "accurate_retrieval"
    assert first.questions[0].answers == ["3"]  # numeric answers are accepted and kept as strings
    assert first.questions[0].question_type == "test_time_learning" and first.questions[0].question_id == "q0"
    assert second.metadata == {"k": 1} and second.split == ""


def _write(tmp_path, **columns):
    base = {"instance_id": ["a"], "chunks": [json.dumps(["text"])],
            "questions_and_answers": [json.dumps([{"question": "q?", "answer": "text"}])]}
    base.update(columns)
    path = tmp_path / "in.parquet"
    pl.DataFrame({k: v for k, v in base.items() if v is not None}).write_parquet(path)
    return path


@pytest.mark.parametrize("columns, message", [
    ({"chunks": None}, "missing column(s) chunks"),
    ({"chunks": ["[\"unterminated"]}, "row 0 (instance_id='a'): field 'chunks': malformed JSON"),
    ({"questions_and_answers": ["not json"]}, "field 'questions_and_answers': malformed JSON"),
    ({"chunks": [json.dumps(["ok", 5])]}, "field 'chunks'[1]: expected a string, got int"),
    ({"questions_and_answers": [json.dumps([{"question": "q?", "answer": {"x": 1}}])]}, "answer must be a string or a number"),
    ({"questions_and_answers": [json.dumps([{"question": "q?"}])]}, "missing 'answer'"),
    ({"questions_and_answers": [json.dumps({"question": "q?"})]}, "expected a list, got dict"),
    ({"metadata": ["[1, 2]"]}, "field 'metadata': expected a JSON object"),
    ({"num_chunks": [4]}, "field 'num_chunks': says 4 but the row has 1"),
    ({"competency": ["telepathy"]}, "'telepathy' is not one of"),
])
def test_bad_rows_name_file_row_field(tmp_path, columns, message):
    path = _write(tmp_path, **columns)
    with pytest.raises(DataError) as err:
        read_dataset(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert isinstance(err.value, UserError)  # the CLI prints it without a traceback


def test_unreadable_and_missing_files(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_text("this is not parquet")
    with pytest.raises(DataError, match="cannot read as parquet"):
        read_dataset(bad)
    with pytest.raises(DataError, match="no such file"):
        read_dataset(tmp_path / "absent")


def test_write_is_atomic_and_refuses_to_clobber(tmp_path):
    out = tmp_path / "ds"
    broken = _instances()
    broken[1].metadata = {"not json": object()}
    with pytest.raises(TypeError):
        write_dataset(out, broken)
    assert list(tmp_path.iterdir()) == []  # no half-written folder, no temp leftovers
    write_dataset(out, _instances()[:1])
    with pytest.raises(DataError, match="already exists"):
        write_dataset(out, _instances())
    write_dataset(out, _instances(), overwrite=True)
    assert [i.instance_id for i in read_dataset(out)] == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_frame_to_instances_rejects_bool_ids(tmp_path):
    frame = pl.DataFrame({"instance_id": [True], "chunks": ["[]"], "questions_and_answers": ["[]"]})
    with pytest.raises(DataError, match="row 0: field 'instance_id'"):
        frame_to_instances(frame, "f.parquet")
