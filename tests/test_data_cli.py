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
    assert "error: 4 problem(s) in the input; nothing was written" in err
    assert f"instance 'absent' ({src}: row 1): question 'q0': field 'answers': no gold answer" in err
    assert f"instance 'empty' ({src}: row 2): chunk 1: field 'chunks'" in err
    assert "duplicate instance_id (first at row 0)" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]


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
