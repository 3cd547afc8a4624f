"""Parquet on disk, compatible with the Memalpha release: one row per instance with `instance_id`,
`chunks` (JSON list of strings), `questions_and_answers` (JSON list of {question, answer, ...}),
`data_source`, `metadata` (JSON), `num_chunks`, `num_questions`; plus our `competency` and `split`.
Our extra question fields ride inside each questions_and_answers object, so the paper's code still reads
`question` and `answer`. A dataset folder holds data.parquet, rejected.parquet, the validation report and
manifest.json, and is written atomically (temp folder, then rename)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl

from memalpha.data.schema import DataError, Instance, Question, answer_to_str, where
from memalpha.rewards.question_types import COMPETENCIES

DATA_FILE = "data.parquet"
REJECTED_FILE = "rejected.parquet"
MANIFEST_FILE = "manifest.json"
REPORT_MD = "validation_report.md"
REPORT_HTML = "validation_report.html"

REQUIRED_COLUMNS = ("instance_id", "chunks", "questions_and_answers")
COLUMNS = ("instance_id", "chunks", "questions_and_answers", "data_source", "metadata", "num_chunks",
           "num_questions", "competency", "split")
REJECTED_COLUMNS = ("table", "instance_id", "question_id", "chunk_index", "field", "check", "reason")

# Substrings of data_source names (Memalpha release, MemoryAgentBench) -> competency.
_SOURCE_HINTS = (
    (("icl", "trec", "nlu", "banking", "clinic", "pubmed", "recsys", "classification"), "test_time_learning"),
    (("booksum", "infbench_sum", "summar", "detective", "long_range"), "long_range_understanding"),
    (("factconsolidation", "fact_consolidation", "conflict"), "conflict_resolution"),
)


def infer_competency(data_source: str) -> str:
    """Competency implied by a data source name; accurate_retrieval when nothing matches."""
    lowered = data_source.lower()
    for hints, competency in _SOURCE_HINTS:
        if any(hint in lowered for hint in hints):
            return competency
    return "accurate_retrieval"


def question_to_json(question: Question) -> dict[str, Any]:
    """One questions_and_answers object: the paper's keys first, ours after."""
    return {
        "question": question.question,
        "answer": question.answer,
        "answers": question.answers,
        "question_type": question.question_type,
        "question_id": question.question_id,
        "evidence_chunks": question.evidence_chunks,
        "superseded_answers": question.superseded_answers,
    }


def instances_to_frame(instances: list[Instance]) -> pl.DataFrame:
    """Instances -> the on-disk frame."""
    rows = {name: [] for name in COLUMNS}
    for inst in instances:
        rows["instance_id"].append(inst.instance_id)
        rows["chunks"].append(json.dumps(inst.chunks, ensure_ascii=False))
        rows["questions_and_answers"].append(json.dumps([question_to_json(q) for q in inst.questions], ensure_ascii=False))
        rows["data_source"].append(inst.data_source)
        rows["metadata"].append(json.dumps(inst.metadata, ensure_ascii=False, sort_keys=True))
        rows["num_chunks"].append(len(inst.chunks))
        rows["num_questions"].append(len(inst.questions))
        rows["competency"].append(inst.competency)
        rows["split"].append(inst.split)
    schema = {name: pl.Int64 if name.startswith("num_") else pl.String for name in COLUMNS}
    return pl.DataFrame(rows, schema=schema)


def _json_field(value: Any, loc: str) -> Any:
    # A JSON column may also arrive as a native list/struct column (e.g. exported from a HF dataset).
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{loc}: malformed JSON ({exc.msg} at char {exc.pos})") from None
    if isinstance(value, pl.Series):
        return value.to_list()
    return value


def _string_list(value: Any, loc: str, allow_numbers: bool = False) -> list[str]:
    if not isinstance(value, list):
        raise DataError(f"{loc}: expected a list, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        if allow_numbers:
            out.append(answer_to_str(item, f"{loc}[{i}]"))
        elif isinstance(item, str):
            out.append(item)
        else:
            raise DataError(f"{loc}[{i}]: expected a string, got {type(item).__name__}")
    return out


SUPERSEDED_KEYS = ("superseded_answers", "superseded", "old_answers", "old_answer", "previous_answers",
                   "previous_answer", "outdated_answers")
"""Keys that list a conflict question's superseded values, in a question object or in the instance's
metadata (there a list aligned with the questions, or an object keyed by question id or position)."""


def _superseded(obj: dict[str, Any], loc: str) -> list[str]:
    for key in SUPERSEDED_KEYS:
        value = obj.get(key)
        if value is not None and value != []:
            return _string_list(value if isinstance(value, list) else [value], f"{loc}.{key}", True)
    return []


def _metadata_superseded(metadata: dict[str, Any], questions: list[Question], loc: str) -> list[Question]:
    """Questions with the superseded values the instance metadata lists for them added."""
    for key in SUPERSEDED_KEYS:
        listed = metadata.get(key)
        if listed is None:
            continue
        if isinstance(listed, list):
            if len(listed) != len(questions):
                raise DataError(f"{loc}.{key}: {len(listed)} entries for {len(questions)} questions")
            by_position = dict(enumerate(listed))
        elif isinstance(listed, dict):
            by_position = {i: listed.get(q.question_id, listed.get(str(i))) for i, q in enumerate(questions)}
        else:
            raise DataError(f"{loc}.{key}: expected a list or an object, got {type(listed).__name__}")
        out = []
        for i, q in enumerate(questions):
            value = by_position.get(i)
            values = [] if value is None else value if isinstance(value, list) else [value]
            extra = _string_list(values, f"{loc}.{key}[{i}]", True)
            out.append(replace(q, superseded_answers=list(dict.fromkeys(q.superseded_answers + extra))))
        return out
    return questions


def parse_question(obj: Any, index: int, competency: str, loc: str) -> Question:
    """One question object (Memalpha `{question, answer}` plus our optional keys) -> Question. Without a
    `question_type` the question gets `competency` (which may be "" while the competency is not known)."""
    loc = f"{loc}[{index}]"
    if not isinstance(obj, dict):
        raise DataError(f"{loc}: expected an object with 'question' and 'answer', got {type(obj).__name__}")
    text = obj.get("question")
    if not isinstance(text, str):
        raise DataError(f"{loc}.question: expected a string, got {type(text).__name__}")
    if obj.get("answers") is not None:
        answers = _string_list(obj["answers"], f"{loc}.answers", allow_numbers=True)
    elif "answer" in obj and obj["answer"] is not None:
        raw = obj["answer"]
        answers = _string_list(raw, f"{loc}.answer", True) if isinstance(raw, list) else [answer_to_str(raw, f"{loc}.answer")]
    else:
        raise DataError(f"{loc}: missing 'answer'")
    evidence = obj.get("evidence_chunks")
    if evidence is not None:
        if not isinstance(evidence, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in evidence):
            raise DataError(f"{loc}.evidence_chunks: expected a list of integers, got {evidence!r}")
    qtype = obj.get("question_type") or competency
    if not isinstance(qtype, str):
        raise DataError(f"{loc}.question_type: expected a string, got {type(qtype).__name__}")
    qid = obj.get("question_id", f"q{index}")
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise DataError(f"{loc}.question_id: expected a string, got {type(qid).__name__}")
    return Question(
        question_id=str(qid),
        question=text,
        answers=answers,
        question_type=qtype,
        evidence_chunks=evidence,
        superseded_answers=_superseded(obj, loc),
    )


def frame_to_instances(frame: pl.DataFrame, path: object, competency: str | None = None,
                       notes: list[str] | None = None) -> list[Instance]:
    """The on-disk frame -> instances. Structural problems raise DataError naming file, row and field.

    Competency: `competency` (the user's override), else the row's `competency` column, else
    conflict_resolution when a question lists superseded values, else a guess from `data_source`; each
    guess is described in `notes`."""
    missing = [name for name in REQUIRED_COLUMNS if name not in frame.columns]
    if missing:
        raise DataError(f"{path}: missing column(s) {', '.join(missing)} (found: {', '.join(frame.columns)})")
    instances = []
    guesses: dict[tuple[str, str], int] = {}
    for row, record in enumerate(frame.iter_rows(named=True)):
        raw_id = record["instance_id"]
        if raw_id is None or isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
            raise DataError(f"{where(path, row, 'instance_id')}: expected a string, got {raw_id!r}")
        iid = str(raw_id)
        loc = lambda name: where(path, row, name, iid)  # noqa: E731
        chunks = _string_list(_json_field(record["chunks"], loc("chunks")), loc("chunks"))
        data_source = record.get("data_source") or ""
        if not isinstance(data_source, str):
            raise DataError(f"{loc('data_source')}: expected a string, got {type(data_source).__name__}")
        qa = _json_field(record["questions_and_answers"], loc("questions_and_answers"))
        if not isinstance(qa, list):
            raise DataError(f"{loc('questions_and_answers')}: expected a list, got {type(qa).__name__}")
        questions = [parse_question(obj, i, "", loc("questions_and_answers")) for i, obj in enumerate(qa)]
        metadata = _json_field(record.get("metadata"), loc("metadata")) or {}
        if not isinstance(metadata, dict):
            raise DataError(f"{loc('metadata')}: expected a JSON object, got {type(metadata).__name__}")
        questions = _metadata_superseded(metadata, questions, loc("metadata"))
        comp = resolve_competency(competency or record.get("competency"), questions, data_source, guesses,
                                  loc("competency"))
        questions = with_default_type(questions, comp)
        for name, actual in (("num_chunks", len(chunks)), ("num_questions", len(questions))):
            stated = record.get(name)
            if stated is not None and stated != actual:
                raise DataError(f"{loc(name)}: says {stated} but the row has {actual}")
        split = record.get("split") or ""
        instances.append(Instance(iid, data_source, comp, chunks, questions, metadata, split))
    if notes is not None:
        notes.extend(guess_notes(guesses))
    return instances


def resolve_competency(stated: str | None, questions: list[Question], data_source: str,
                       guesses: dict[tuple[str, str], int], loc: str) -> str:
    """The stated competency (an override or the data's own field), else conflict_resolution when a
    question lists superseded values, else a guess from the data-source name, counted in `guesses`."""
    if not stated and any(q.superseded_answers for q in questions):
        stated = "conflict_resolution"
    elif not stated:
        stated = infer_competency(data_source)
        guesses[(data_source, stated)] = guesses.get((data_source, stated), 0) + 1
    if stated not in COMPETENCIES:
        raise DataError(f"{loc}: {stated!r} is not one of {', '.join(COMPETENCIES)}")
    return stated


def with_default_type(questions: list[Question], competency: str) -> list[Question]:
    """Questions without a question_type get their instance's competency as type."""
    return [q if q.question_type else replace(q, question_type=competency) for q in questions]


def guess_notes(guesses: dict[tuple[str, str], int]) -> list[str]:
    """One printed note per guessed (data source, competency)."""
    return [f"competency of {n} instance(s) with data_source {source!r} guessed as {competency} from the name "
            f"(no competency field, no superseded answers); override with --competency or a competency field"
            for (source, competency), n in guesses.items()]


def read_frame(path: str | Path) -> pl.DataFrame:
    """Read a parquet file (or a dataset folder's data.parquet); unreadable input raises DataError."""
    path = Path(path)
    if path.is_dir():
        path = path / DATA_FILE
    if not path.is_file():
        raise DataError(f"{path}: no such file (make a dataset folder with `memalpha data synth --out DIR`, "
                        "or `memalpha data prep --source ... --out DIR` from your own data)")
    try:
        return pl.read_parquet(path)
    except Exception as exc:  # polars raises several error types for corrupt/non-parquet files
        raise DataError(f"{path}: cannot read as parquet ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None


def read_dataset(path: str | Path) -> list[Instance]:
    """Instances of a dataset folder or a Memalpha-format parquet file."""
    path = Path(path)
    target = path / DATA_FILE if path.is_dir() else path
    return frame_to_instances(read_frame(path), target)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """manifest.json of a dataset folder ({} when absent, e.g. for a bare parquet file)."""
    manifest = Path(path) / MANIFEST_FILE
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def rejected_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """Rejected-rows table, one row per problem."""
    schema = {name: pl.Int64 if name == "chunk_index" else pl.String for name in REJECTED_COLUMNS}
    return pl.DataFrame([{name: r.get(name) for name in REJECTED_COLUMNS} for r in rows], schema=schema)


def refused_dir(out_dir: str | Path) -> Path:
    """Where a refused prep writes its rejected rows: beside the dataset folder, which stays untouched."""
    out = Path(out_dir)
    return out.with_name(f"{out.name}.rejected")


def write_rejected(folder: str | Path, rejected: list[dict[str, Any]], report_md: str, report_html: str) -> Path:
    """The rejected table and validation report of a refused prep (replacing an earlier refusal's)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rejected_frame(rejected).write_parquet(folder / REJECTED_FILE)
    (folder / REPORT_MD).write_text(report_md, encoding="utf-8")
    (folder / REPORT_HTML).write_text(report_html, encoding="utf-8")
    return folder


def write_dataset(
    out_dir: str | Path,
    instances: list[Instance],
    *,
    rejected: list[dict[str, Any]] | None = None,
    report_md: str | None = None,
    report_html: str | None = None,
    manifest: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a dataset folder atomically: everything goes to a temp folder that is renamed into place, so a
    failure never leaves a half-written dataset. An existing folder is replaced only with overwrite=True."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise DataError(f"{out}: already exists (use --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        instances_to_frame(instances).write_parquet(tmp / DATA_FILE)
        rejected_frame(rejected or []).write_parquet(tmp / REJECTED_FILE)
        if report_md is not None:
            (tmp / REPORT_MD).write_text(report_md)
        if report_html is not None:
            (tmp / REPORT_HTML).write_text(report_html)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest or {}, indent=2, sort_keys=True) + "\n")
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
