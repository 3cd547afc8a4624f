"""Loaders for the formats users bring. Pre-chunked sources (Memalpha parquet, our own folders, JSONL with
`chunks`) give `Instance`s; raw sources (MemoryAgentBench contexts, LoCoMo sessions, JSONL texts or
turns) give `RawInstance`s that `to_instance` chunks with the policy's tokenizer. Structural problems
raise DataError naming the file, the row and the field."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import polars as pl

from memalpha.data.chunking import Turn, chunk_turns, text_turns
from memalpha.data.io import (
    frame_to_instances,
    guess_notes,
    parse_question,
    read_frame,
    resolve_competency,
    with_default_type,
)
from memalpha.data.perltqa import load_perltqa
from memalpha.data.raw import Loaded, RawInstance
from memalpha.data.schema import DataError, Instance, Question, answer_to_str

SOURCES = ("synthetic", "memalpha", "memoryagentbench", "locomo", "perltqa", "jsonl")

LOCOMO_CATEGORIES = {1: "multi_hop", 2: "temporal", 3: "open_domain", 4: "single_hop", 5: "adversarial"}
_DIA_ID = re.compile(r"D\d+:\d+")


def to_instance(item: Instance | RawInstance, tokenizer: Any, chunk_tokens: int) -> Instance:
    """Chunk a raw instance (evidence turn ids become chunk indices); instances pass through unchanged.
    The evidence turns themselves are kept in metadata (`evidence_turns`: question id -> [{chunk,
    speaker, date, text}]) for the teacher that stores them (`teacher.evidence_writer`)."""
    if isinstance(item, Instance):
        return item
    chunked = chunk_turns(item.turns, tokenizer, chunk_tokens)
    by_id = {t.turn_id: t for t in item.turns if t.turn_id is not None}
    questions, lines = [], {}
    for q in item.questions:
        turn_ids = item.evidence_turns.get(q.question_id)
        if turn_ids is not None:
            found = sorted({c for tid in turn_ids for c in chunked.turn_chunks.get(tid, [])})
            q = Question(q.question_id, q.question, q.answers, q.question_type, found or None, q.superseded_answers)
            lines[q.question_id] = [{"chunk": chunked.turn_chunks[tid][0], "speaker": by_id[tid].speaker,
                                     "date": by_id[tid].date, "text": by_id[tid].text}
                                    for tid in turn_ids if tid in by_id and chunked.turn_chunks.get(tid)]
        questions.append(q)
    metadata = {**item.metadata, "chunk_tokens": chunk_tokens}
    if any(lines.values()):
        metadata["evidence_turns"] = lines
    return Instance(item.instance_id, item.data_source, item.competency, chunked.chunks, questions, metadata, item.split)


def load_memalpha(path: str | Path, competency: str | None = None) -> Loaded:
    """A Memalpha-format parquet file or one of our dataset folders (`competency` overrides the data's)."""
    path = Path(path)
    target = path / "data.parquet" if path.is_dir() else path
    notes: list[str] = []
    instances = frame_to_instances(read_frame(path), target, competency, notes)
    return Loaded(list(instances), {inst.instance_id: f"{target}: row {i}" for i, inst in enumerate(instances)}, notes)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """Rows of a .parquet, .json (a list, or one object) or .jsonl file."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        return list(read_frame(path).iter_rows(named=True))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read ({exc})") from None
    if path.suffix == ".jsonl":
        rows = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {line_no}: malformed JSON ({exc.msg} at char {exc.pos})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
        rows = data if isinstance(data, list) else [data]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i}: expected an object, got {type(row).__name__}")
    return rows


def _require(row: dict[str, Any], name: str, kind: type | tuple[type, ...], loc: str) -> Any:
    if name not in row or row[name] is None:
        raise DataError(f"{loc}: missing field {name!r}")
    value = row[name]
    if isinstance(value, pl.Series):
        value = value.to_list()
    if not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise DataError(f"{loc}: field {name!r}: expected {expected}, got {type(value).__name__}")
    return value


def _metadata(value: Any, loc: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{loc}: field 'metadata': malformed JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise DataError(f"{loc}: field 'metadata': expected an object, got {type(value).__name__}")
    return value


def load_memoryagentbench(path: str | Path, competency: str | None = None) -> Loaded:
    """MemoryAgentBench rows: `context` (one long string), `questions` (list), `answers` (list of lists),
    `metadata` (with `source`). The context is split into sentences for packing; all questions come after
    the last chunk, so evidence is unknown."""
    path = Path(path)
    loaded = Loaded([])
    guesses: dict[tuple[str, str], int] = {}
    for row, record in enumerate(_read_records(path)):
        loc = f"{path}: row {row}"
        context = _require(record, "context", str, loc)
        questions = _require(record, "questions", list, loc)
        answers = _require(record, "answers", list, loc)
        if len(questions) != len(answers):
            raise DataError(f"{loc}: {len(questions)} questions but {len(answers)} answer lists")
        metadata = _metadata(record.get("metadata"), loc)
        source = str(metadata.get("source") or path.stem)
        comp = resolve_competency(competency, [], f"{source} {path.stem}", guesses, f"{loc}: field 'competency'")
        ids = metadata.get("qa_pair_ids") or metadata.get("question_ids")
        qs = []
        for i, (question, answer) in enumerate(zip(questions, answers)):
            qloc = f"{loc}: field 'answers'[{i}]"
            if not isinstance(question, str):
                raise DataError(f"{loc}: field 'questions'[{i}]: expected a string, got {type(question).__name__}")
            if isinstance(answer, pl.Series):
                answer = answer.to_list()
            gold = [answer_to_str(a, qloc) for a in answer] if isinstance(answer, list) else [answer_to_str(answer, qloc)]
            qid = str(ids[i]) if isinstance(ids, list) and i < len(ids) else f"q{i}"
            qs.append(Question(qid, question, gold, comp))
        iid = f"mab-{source}-{row}"
        loaded.items.append(RawInstance(iid, source, comp, text_turns(context), qs, {}, metadata))
        loaded.origins[iid] = loc
    loaded.notes.extend(guess_notes(guesses))
    return loaded


def _session_keys(conversation: dict[str, Any]) -> list[int]:
    return sorted(int(m.group(1)) for key in conversation if (m := re.fullmatch(r"session_(\d+)", key)))


def load_locomo(path: str | Path) -> Loaded:
    """LoCoMo JSON: a list of conversations (`conversation` with speaker_a/speaker_b, `session_N` turn lists
    and `session_N_date_time`; `qa` with question, answer, evidence dia_ids, category). Image turns keep
    their caption. Category 5 (adversarial: the answer is not in the conversation) is dropped, since
    extractive scoring cannot reward it; the count is kept in metadata."""
    path = Path(path)
    loaded = Loaded([])
    for row, record in enumerate(_read_records(path)):
        loc = f"{path}: conversation {row}"
        conv = _require(record, "conversation", dict, loc)
        qa = _require(record, "qa", list, loc)
        iid = f"locomo-{record.get('sample_id', row)}"
        turns: list[Turn] = []
        for n in _session_keys(conv):
            session = _require(conv, f"session_{n}", list, f"{loc}: field 'conversation'")
            date = conv.get(f"session_{n}_date_time")
            for t, turn in enumerate(session):
                tloc = f"{loc}: field 'conversation.session_{n}'[{t}]"
                if not isinstance(turn, dict):
                    raise DataError(f"{tloc}: expected an object, got {type(turn).__name__}")
                text = _require(turn, "text", str, tloc)
                if turn.get("blip_caption"):
                    text = f"{text} [shares a photo: {turn['blip_caption']}]"
                turns.append(Turn(text, str(turn.get("speaker", "")), date, str(turn.get("dia_id", f"D{n}:{t + 1}"))))
        if not turns:
            raise DataError(f"{loc}: field 'conversation': no session_N turn lists")
        known = {t.turn_id for t in turns}
        questions, evidence, dropped, unknown = [], {}, 0, 0
        for i, item in enumerate(qa):
            qloc = f"{loc}: field 'qa'[{i}]"
            if not isinstance(item, dict):
                raise DataError(f"{qloc}: expected an object, got {type(item).__name__}")
            category = item.get("category")
            if category == 5:
                dropped += 1
                continue
            question = _require(item, "question", str, qloc)
            answer = _require(item, "answer", (str, int, float), qloc)
            qid = f"q{i}"
            ids = _DIA_ID.findall(" ".join(map(str, item.get("evidence") or [])))
            unknown += sum(1 for d in ids if d not in known)
            evidence[qid] = [d for d in ids if d in known]
            qtype = LOCOMO_CATEGORIES.get(category, "accurate_retrieval")
            questions.append(Question(qid, question, [answer_to_str(answer, f"{qloc}: field 'answer'")], qtype))
        metadata = {"speaker_a": conv.get("speaker_a"), "speaker_b": conv.get("speaker_b"),
                    "dropped_adversarial": dropped, "unknown_evidence_ids": unknown}
        loaded.items.append(RawInstance(iid, "locomo", "accurate_retrieval", turns, questions, evidence, metadata))
        loaded.origins[iid] = loc
        if dropped:
            loaded.notes.append(f"{iid}: dropped {dropped} adversarial (category 5) question(s)")
    return loaded


def _jsonl_turns(record: dict[str, Any], loc: str, iid: str) -> list[Turn]:
    if "sessions" in record:
        sessions = _require(record, "sessions", list, loc)
        turns = []
        for s, session in enumerate(sessions):
            sloc = f"{loc}: field 'sessions'[{s}]"
            if not isinstance(session, dict):
                raise DataError(f"{sloc}: expected an object, got {type(session).__name__}")
            for turn in _jsonl_turn_list(_require(session, "turns", list, sloc), f"{sloc}.turns", session.get("date")):
                turns.append(turn)
        return turns
    if "turns" in record:
        return _jsonl_turn_list(_require(record, "turns", list, loc), f"{loc}: field 'turns'", None)
    if "text" in record:
        return text_turns(_require(record, "text", str, loc))
    raise DataError(f"{loc}: needs one of 'chunks', 'sessions', 'turns' or 'text'")


def _jsonl_turn_list(items: list[Any], loc: str, date: str | None) -> list[Turn]:
    turns = []
    for t, turn in enumerate(items):
        tloc = f"{loc}[{t}]"
        if not isinstance(turn, dict):
            raise DataError(f"{tloc}: expected an object, got {type(turn).__name__}")
        text = _require(turn, "text", str, tloc)
        speaker = turn.get("speaker")
        turn_id = turn.get("id")
        turns.append(Turn(text, None if speaker is None else str(speaker), turn.get("date", date),
                          None if turn_id is None else str(turn_id)))
    return turns


def load_jsonl(path: str | Path, competency: str | None = None) -> Loaded:
    """JSONL, one instance a line: optional instance_id, data_source, competency, metadata; the content as
    `chunks` (pre-chunked), `sessions` ([{date, turns}]), `turns` ([{speaker, text, date?, id?}]) or
    `text`; and `questions` ([{question, answer or answers, question_type?, evidence? (turn ids),
    evidence_chunks?, superseded_answers?, question_id?}])."""
    path = Path(path)
    loaded = Loaded([])
    guesses: dict[tuple[str, str], int] = {}
    for row, record in enumerate(_read_records(path)):
        loc = f"{path}: row {row}"
        iid = str(record.get("instance_id") or f"{path.stem}-{row}")
        source = str(record.get("data_source") or path.stem)
        raw_qs = _require(record, "questions", list, loc)
        questions = [parse_question(q, i, "", f"{loc}: field 'questions'") for i, q in enumerate(raw_qs)]
        comp = resolve_competency(competency or record.get("competency"), questions, source, guesses,
                                  f"{loc}: field 'competency'")
        questions = with_default_type(questions, comp)
        metadata = _metadata(record.get("metadata"), loc)
        if "chunks" in record:
            chunks = _require(record, "chunks", list, loc)
            if not all(isinstance(c, str) for c in chunks):
                raise DataError(f"{loc}: field 'chunks': expected a list of strings")
            loaded.items.append(Instance(iid, source, comp, chunks, questions, metadata))
        else:
            turns = _jsonl_turns(record, loc, iid)
            evidence = {}
            for q, raw in zip(questions, raw_qs):
                if raw.get("evidence") is not None:
                    evidence[q.question_id] = [str(e) for e in raw["evidence"]]
            loaded.items.append(RawInstance(iid, source, comp, turns, questions, evidence, metadata))
        loaded.origins[iid] = loc
    loaded.notes.extend(guess_notes(guesses))
    return loaded


def load_source(source: str, path: str | Path, competency: str | None = None) -> Loaded:
    """Dispatch on the `--source` name; `competency` (`--competency`) overrides what the data says or
    what would be guessed (LoCoMo is accurate retrieval unless overridden)."""
    if source in ("synthetic", "memalpha"):
        return load_memalpha(path, competency)
    if source == "memoryagentbench":
        return load_memoryagentbench(path, competency)
    if source == "locomo":
        loaded = load_locomo(path)
        if competency:
            loaded.items = [replace(item, competency=competency) for item in loaded.items]
        return loaded
    if source == "perltqa":
        loaded = load_perltqa(path)
        if competency:
            loaded.items = [replace(item, competency=competency) for item in loaded.items]
        return loaded
    if source == "jsonl":
        return load_jsonl(path, competency)
    raise DataError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
