"""`memalpha data synth|prep|show` end to end, in-process."""

import json

import polars as pl
import pytest

from memalpha.cli import main
from memalpha.data.io import read_dataset, read_manifest

SYNTH = ["data", "synth", "--instances", "6", "--chunks-per-instance", "3,4", "--chunk-tokens", "512",
         "--facts", "4", "--seed", "3", "--tokenizer", "regex"]


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "ds"
    assert main([*SYNTH, "--out", str(out)]) == 0
    return out


def test_synth_prep_load_round_trip(synth_dir, tmp_path, capsys):
    out = tmp_path / "prepped"
    assert main(["data", "prep", "--source", "synthetic", "--path", str(synth_dir), "--out", str(out),
                 "--tokenizer", "regex"]) == 0
    original, prepped = read_dataset(synth_dir), read_dataset(out)
    assert prepped == original and len(original) == 6
    assert all(i.split in ("train", "validation", "test") for i in prepped)
    manifest = read_manifest(synth_dir)
    assert manifest["synth"]["seed"] == 3 and manifest["split_seed"] == 0 and manifest["counts"]["instances_valid"] == 6
    assert (out / "validation_report.md").read_text().startswith("# Validation report")
    assert "wrote" in capsys.readouterr().out


def test_show(synth_dir, capsys):
    assert main(["data", "show", str(synth_dir)]) == 0
    out = capsys.readouterr().out
    assert "6 instances (source: synthetic)" in out
    for name in ("accurate_retrieval", "test_time_learning", "long_range_understanding", "conflict_resolution"):
        assert name in out
    total = [line for line in out.splitlines() if line.startswith("all") and line.split()[1] == "all"][0].split()
    assert total[2] == "6" and int(total[3]) == sum(len(i.chunks) for i in read_dataset(synth_dir))


def _bad_input(path):
    good_q = json.dumps([{"question": "Dog?", "answer": "Rex"}])
    pl.DataFrame({
        "instance_id": ["fine", "absent", "empty", "fine"],
        "chunks": [json.dumps(["Ann has a dog named Rex."])] * 2 + [json.dumps(["Rex", ""]), json.dumps(["Rex!"])],
        "questions_and_answers": [good_q, json.dumps([{"question": "Cat?", "answer": "Tom"}]), good_q, good_q],
        "data_source": ["squad"] * 4,
    }).write_parquet(path)


def test_prep_fails_listing_problems_and_writes_nothing(tmp_path, capsys):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    _bad_input(src)
    assert main(["data", "prep", "--source", "memalpha", "--path", str(src), "--out", str(out), "--tokenizer", "regex"]) == 2
    err = capsys.readouterr().err
    refused = tmp_path / "out.rejected"
    assert f"error: 4 problem(s) in the input; nothing was written to {out}" in err
    assert f"Every rejected row is in {refused / 'rejected.parquet'}" in err
    assert f"instance 'absent' ({src}: row 1): question 'q0': field 'answers': no gold answer" in err
    assert f"instance 'empty' ({src}: row 2): chunk 1: field 'chunks'" in err
    assert "duplicate instance_id (first at row 0)" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "out.rejected"]  # no dataset folder
    table = pl.read_parquet(refused / "rejected.parquet")
    assert {"absent", "empty", "fine"} <= set(table["instance_id"]) and table.height >= 4
    assert "no gold answer occurs" in (refused / "validation_report.md").read_text()


def test_prep_drop_invalid_reports_counts(tmp_path, capsys):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    _bad_input(src)
    assert main(["data", "prep", "--source", "memalpha", "--path", str(src), "--out", str(out),
                 "--tokenizer", "regex", "--drop-invalid"]) == 0
    printed = capsys.readouterr().out
    assert "instances valid: 1" in printed and "rejected by answer_in_context: 1" in printed
    assert [i.instance_id for i in read_dataset(out)] == ["fine"]
    rejected = pl.read_parquet(out / "rejected.parquet")
    assert set(rejected["instance_id"]) == {"absent", "empty", "fine"}
    assert "answer_in_context" in (out / "validation_report.md").read_text()
    assert read_manifest(out)["counts"]["instances_rejected"] == 3


def test_clean_errors_for_bad_files_and_existing_output(synth_dir, tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"garbage")
    assert main(["data", "prep", "--source", "memalpha", "--path", str(bad), "--out", str(tmp_path / "o"),
                 "--tokenizer", "regex"]) == 2
    assert "cannot read as parquet" in capsys.readouterr().err
    assert main([*SYNTH, "--out", str(synth_dir)]) == 2
    assert "already exists (use --overwrite" in capsys.readouterr().err
    assert main(["data", "synth", "--out", str(tmp_path / "x"), "--distractor-share", "2", "--tokenizer", "regex"]) == 2
    assert "distractor_share must be in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "o").exists()


def test_prep_locomo_with_chunk_tokens(tmp_path):
    src = tmp_path / "locomo.json"
    turns = [{"speaker": "A" if i % 2 else "B", "dia_id": f"D1:{i}", "text": f"Line {i} of small talk, nothing much."}
             for i in range(1, 120)]
    turns.append({"speaker": "A", "dia_id": "D1:120", "text": "My cat is called Miso."})
    src.write_text(json.dumps([{"sample_id": "c1", "conversation": {
        "speaker_a": "A", "speaker_b": "B", "session_1": turns, "session_1_date_time": "1 May 2023"},
        "qa": [{"question": "Cat's name?", "answer": "Miso", "evidence": ["D1:120"], "category": 4}]}]))
    out = tmp_path / "out"
    assert main(["data", "prep", "--source", "locomo", "--path", str(src), "--out", str(out), "--chunk-tokens", "512",
                 "--tokenizer", "regex"]) == 0
    (inst,) = read_dataset(out)
    assert len(inst.chunks) >= 3 and inst.questions[0].evidence_chunks == [len(inst.chunks) - 1]
    assert read_manifest(out)["chunk_tokens"] == 512


def test_split_config_is_applied(tmp_path):
    out = tmp_path / "ds"
    assert main([*SYNTH, "--out", str(out), "--set", "data.split_ratios=[0, 0, 1]", "--set", "data.split_seed=5"]) == 0
    assert {i.split for i in read_dataset(out)} == {"test"}
    assert read_manifest(out)["split_seed"] == 5


def _locomo_worked_out(path):
    """A conversation in LoCoMo's format whose answers are worked out the way LoCoMo's are."""
    session_1 = [
        {"speaker": "Caroline", "dia_id": "D1:1", "text": "I went to the LGBTQ support group yesterday."},
        {"speaker": "Melanie", "dia_id": "D1:2", "text": "I painted a sunrise last year, and I do pottery now."},
        {"speaker": "Caroline", "dia_id": "D1:3", "text": "It was hard, I am not sure it is for me."},
    ]
    session_2 = [
        {"speaker": "Melanie", "dia_id": "D2:1", "text": "We went camping at the lake again, our third trip."},
        {"speaker": "Melanie", "dia_id": "D2:2", "text": "Painting keeps me calm."},
    ]
    qa = [
        {"question": "When did Caroline go to the support group?", "answer": "7 May 2023", "evidence": ["D1:1"], "category": 2},
        {"question": "When did Melanie paint a sunrise?", "answer": 2022, "evidence": ["D1:2"], "category": 2},
        {"question": "What does Melanie do?", "answer": "pottery, camping, painting, swimming",
         "evidence": ["D1:2", "D2:1", "D2:2"], "category": 1},
        {"question": "Would Caroline go back to the group?", "answer": "Likely no", "evidence": ["D1:3"], "category": 3},
        {"question": "How many camping trips has Melanie made?", "answer": "3 trips", "evidence": ["D2:1"], "category": 1},
        {"question": "Where did Melanie camp?", "answer": "the lake", "evidence": ["D2:1"], "category": 4},
        {"question": "What is Caroline's job?", "answer": "counselor", "evidence": ["D1:1"], "category": 4},
        {"question": "What did Caroline paint?", "adversarial_answer": "a sunrise", "evidence": ["D1:2"], "category": 5},
    ]
    path.write_text(json.dumps([{"sample_id": "conv-1", "qa": qa, "conversation": {
        "speaker_a": "Caroline", "speaker_b": "Melanie",
        "session_1_date_time": "1:56 pm on 8 May, 2023", "session_1": session_1,
        "session_2_date_time": "1:14 pm on 25 May, 2023", "session_2": session_2}}]))


def test_locomo_worked_out_answers_survive_with_the_check_that_fits(tmp_path, capsys):
    src, out = tmp_path / "locomo10.json", tmp_path / "out"
    _locomo_worked_out(src)
    assert main(["data", "prep", "--source", "locomo", "--path", str(src), "--out", str(out), "--tokenizer", "regex",
                 "--drop-invalid", "--set", "data.split_ratios=[0, 0, 1]"]) == 0
    (inst,) = read_dataset(out)
    kept = {q.question: q.question_type for q in inst.questions}
    assert len(kept) == 6 and "What is Caroline's job?" not in kept  # never stated: rejected
    checks = {q.question: inst.metadata["answer_checks"].get(q.question_id) for q in inst.questions}
    assert checks == {
        "When did Caroline go to the support group?": "date_parts",  # "yesterday" in a session dated 8 May 2023
        "When did Melanie paint a sunrise?": "date_parts",  # "last year", said in 2023
        "What does Melanie do?": "list_items",  # gathered across turns
        "Would Caroline go back to the group?": "yes_no",
        "How many camping trips has Melanie made?": "number",
        "Where did Melanie camp?": None,  # quoted: the plain answer-in-context check
    }
    counts = read_manifest(out)["counts"]
    assert counts["worked_out_answers_date_parts"] == 2 and counts["questions_valid"] == 6
    assert read_manifest(out)["rejected_by_check"]["answer_in_context"] == 1


def test_memalpha_conflict_metadata_gives_superseded_answers_and_the_conflict_competency(tmp_path, capsys):
    src, out = tmp_path / "facts.parquet", tmp_path / "out"
    chunks = json.dumps(["Ann lives in Paris.", "Ann moved to Rome last month."])
    pl.DataFrame({
        "instance_id": ["fc-0", "plain-0"],
        "chunks": [chunks, chunks],
        "questions_and_answers": [json.dumps([{"question": "Where does Ann live?", "answer": "Rome"},
                                              {"question": "Where did Ann live first?", "answer": "Paris"}]),
                                  json.dumps([{"question": "Where does Ann live?", "answer": "Rome"}])],
        "data_source": ["user_facts_v2", "user_facts_v2"],  # named like neither "conflict" nor "factconsolidation"
        "metadata": [json.dumps({"superseded_answers": [["Paris"], []]}), json.dumps({})],
    }).write_parquet(src)
    assert main(["data", "prep", "--source", "memalpha", "--path", str(src), "--out", str(out), "--tokenizer", "regex",
                 "--set", "data.split_ratios=[0, 0, 1]"]) == 0
    printed = capsys.readouterr().out
    conflict, plain = read_dataset(out)
    assert conflict.competency == "conflict_resolution"
    assert [q.superseded_answers for q in conflict.questions] == [["Paris"], []]
    assert {q.question_type for q in conflict.questions} == {"conflict_resolution"}
    assert plain.competency == "accurate_retrieval"  # guessed, and said so
    assert ("note: competency of 1 instance(s) with data_source 'user_facts_v2' guessed as accurate_retrieval "
            "from the name") in printed and "override with --competency" in printed

    assert main(["data", "prep", "--source", "memalpha", "--path", str(src), "--out", str(out), "--tokenizer", "regex",
                 "--competency", "conflict_resolution", "--overwrite"]) == 0
    assert "guessed" not in capsys.readouterr().out
    assert {i.competency for i in read_dataset(out)} == {"conflict_resolution"}


def test_superseded_values_in_a_question_object_are_read_under_their_common_names(tmp_path):
    from memalpha.data.io import parse_question

    for key in ("superseded_answers", "old_answer", "previous_answers"):
        q = parse_question({"question": "Where?", "answer": "Rome", key: ["Paris"]}, 0, "", "row 0")
        assert q.superseded_answers == ["Paris"], key
