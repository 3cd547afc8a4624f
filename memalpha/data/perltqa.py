"""PerLTQA (Du et al. 2024; github.com/Elvin-Yiming-Du/PerLTQA, CC BY-NC 4.0) as raw conversations.

The English v2 release has two files: `perltmem_en_v2.json` (per character: profile, social relationships,
events and the dialogues that narrate them, each dialogue dated) and `perltqa_en_v2.json` (per character:
questions on the profile, the relationships, the events and the dialogues, each with its `Reference
Memory` and `Memory Anchors`). One instance per character: the character's dialogues in time order (the
date is the chunk header, as for LoCoMo sessions). The event narratives themselves are not part of the
conversation: a memory writer reads what was said.

A question keeps as evidence the turns of its reference memory (the dialogue, or the dialogues narrating
the event) that state one of its anchors, else all turns of that memory; profile and relationship
questions keep the turns anywhere that state an anchor. Gold answers are the anchors that occur in the
answer sentence or the evidence (substring match); where none does, the answer sentence, scored by token
F1 (question type `sentence_answer`). A question whose memory no dialogue states is dropped and counted
(`rejected.parquet`, check `memory_not_in_conversation`).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from memalpha.data.chunking import Turn
from memalpha.data.raw import Loaded, RawInstance
from memalpha.data.schema import DataError, Question

MEM_FILE = "perltmem_en_v2.json"
QA_FILE = "perltqa_en_v2.json"
NOT_IN_CONVERSATION = "memory_not_in_conversation"
_ID = re.compile(r"\d+(?:_\d+)+(?:#\d+)?")
_SECTIONS = ("profile", "social_relationship", "events", "dialogues")


def perltqa_files(path: str | Path) -> tuple[Path, Path]:
    """The memory and QA files under `path` (the release folder, `Dataset/en_v2` of a clone, or the clone)."""
    path = Path(path)
    for folder in (path, path / "en_v2", path / "Dataset" / "en_v2"):
        if (folder / MEM_FILE).is_file() and (folder / QA_FILE).is_file():
            return folder / MEM_FILE, folder / QA_FILE
    raise DataError(f"{path}: PerLTQA needs {MEM_FILE} and {QA_FILE} there (or under Dataset/en_v2); "
                    "get them from github.com/Elvin-Yiming-Du/PerLTQA")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None


def _characters(data: Any, path: Path) -> dict[str, Any]:
    """{name: record}: the memory file is an object by name; the QA file a list of one-name objects."""
    if isinstance(data, dict):
        return data
    if isinstance(data, list):
        out: dict[str, Any] = {}
        for i, item in enumerate(data):
            if not isinstance(item, dict):
                raise DataError(f"{path}: item {i}: expected an object keyed by character name")
            out.update(item)
        return out
    raise DataError(f"{path}: expected an object or a list of objects keyed by character name")


def _sort_key(date: str) -> tuple[int, str]:
    for fmt in ("%Y-%m-%d %H:%M", "%Y-%m-%d"):
        try:
            return 0, datetime.strptime(date.strip(), fmt).isoformat()
        except ValueError:
            pass
    return 1, date  # undated or free-form dates after the dated ones, in file order by the stable sort


def dialogue_turns(name: str, memory: dict[str, Any], loc: str) -> tuple[list[Turn], dict[str, list[str]], dict[str, list[str]]]:
    """The character's turns in time order, turn ids by dialogue id, and dialogue ids by event id."""
    dialogues = memory.get("dialogues")
    if not isinstance(dialogues, dict):
        raise DataError(f"{loc}: field 'dialogues': expected an object of dialogues by id")
    sessions = []
    for did, dialogue in dialogues.items():
        dloc = f"{loc}: field 'dialogues.{did}'"
        if not isinstance(dialogue, dict) or not isinstance(dialogue.get("contents"), dict):
            raise DataError(f"{dloc}: expected an object with 'contents' ({{date: [\"Speaker: text\", ...]}})")
        for date, lines in dialogue["contents"].items():
            if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
                raise DataError(f"{dloc}.contents.{date}: expected a list of strings")
            sessions.append((_sort_key(date), did, str(dialogue.get("events", "")), date, lines))
    sessions.sort(key=lambda s: s[0])
    turns: list[Turn] = []
    by_dialogue: dict[str, list[str]] = {}
    by_event: dict[str, list[str]] = {}
    for _, did, event, date, lines in sessions:
        by_event.setdefault(event, []).append(did)
        for i, line in enumerate(lines):
            speaker, sep, text = line.partition(": ")
            if not sep or len(speaker) > 40:
                speaker, text = name, line
            tid = f"{did}:{len(by_dialogue.get(did, []))}"
            by_dialogue.setdefault(did, []).append(tid)
            turns.append(Turn(text.strip(), speaker.strip(), date, tid))
    return turns, by_dialogue, by_event


def _anchors(item: dict[str, Any]) -> list[str]:
    out = []
    for anchor in item.get("Memory Anchors") or []:
        if isinstance(anchor, dict):
            out.extend(str(k).replace("&#39;", "'").strip() for k in anchor)
    return [a for a in out if a]


def _questions(qa: dict[str, Any], loc: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(section, memory key, question record) for every question of a character, in file order."""
    out = []
    for section in _SECTIONS:
        items = qa.get(section) or []
        if section == "profile":
            out.extend((section, "", item) for item in items)
            continue
        for group in items:
            if not isinstance(group, dict):
                raise DataError(f"{loc}: field '{section}': expected objects of questions by memory id")
            for key, records in group.items():
                out.extend((section, str(key), item) for item in records or [])
    return out


def load_character(name: str, memory: dict[str, Any], qa: dict[str, Any], loc: str):
    """One character as (turns, questions, evidence turn ids by question id, rejected rows)."""
    turns, by_dialogue, by_event = dialogue_turns(name, memory, loc)
    text = {t.turn_id: t.text.lower() for t in turns}
    questions: list[Question] = []
    evidence: dict[str, list[str]] = {}
    rejected: list[dict[str, Any]] = []
    for i, (section, key, item) in enumerate(_questions(qa, loc)):
        qloc = f"{loc}: question {i} ({section})"
        if not isinstance(item, dict) or not isinstance(item.get("Question"), str) or not isinstance(item.get("Answer"), str):
            raise DataError(f"{qloc}: expected an object with string fields 'Question' and 'Answer'")
        qid = f"q{i}"
        refs = _ID.findall(str(item.get("Reference Memory", ""))) or ([key] if key else [])
        source: list[str] = []
        if section in ("events", "dialogues"):
            for ref in refs:
                for did in ([ref] if ref in by_dialogue else by_event.get(ref, [])):
                    source.extend(by_dialogue[did])
        anchors = _anchors(item)
        answer = item["Answer"].strip()
        scope = source if section in ("events", "dialogues") else list(text)
        stated = [tid for tid in scope if any(a.lower() in text[tid] for a in anchors)]
        turns_of_q = stated or source
        if not turns_of_q:
            rejected.append({"table": "questions", "question_id": qid, "field": "Reference Memory",
                             "check": NOT_IN_CONVERSATION,
                             "reason": f"{section} memory {', '.join(refs) or item.get('Reference Memory')!r}: "
                                       "no dialogue of the character states it"})
            continue
        evidence_text = " ".join(text[t] for t in turns_of_q)
        golds = [a for a in anchors if a.lower() in answer.lower() or a.lower() in evidence_text]
        qtype = "single_hop" if golds else "sentence_answer"
        questions.append(Question(qid, item["Question"].strip(), golds or [answer], qtype))
        evidence[qid] = turns_of_q
    return turns, questions, evidence, rejected


def load_perltqa(path: str | Path):
    """Both files of the release -> a `Loaded` of one raw instance per character that has dialogues."""
    mem_path, qa_path = perltqa_files(path)
    memories = _characters(_read(mem_path), mem_path)
    qas = _characters(_read(qa_path), qa_path)
    loaded = Loaded([])
    for name, qa in qas.items():
        loc = f"{mem_path}: character {name!r}"
        if name not in memories:
            loaded.notes.append(f"{qa_path}: character {name!r} has no memory in {mem_path.name}; skipped")
            continue
        if not isinstance(memories[name], dict) or not isinstance(qa, dict):
            raise DataError(f"{loc}: expected an object")
        turns, questions, evidence, rejected = load_character(name, memories[name], qa, loc)
        iid = "perltqa-" + re.sub(r"\W+", "-", name.strip().lower()).strip("-")
        for row in rejected:
            loaded.rejected.append({**row, "instance_id": iid})
        if not turns:
            loaded.notes.append(f"{iid}: no dialogues; skipped")
            continue
        loaded.items.append(RawInstance(iid, "perltqa", "accurate_retrieval", turns, questions, evidence,
                                        {"character": name, "dropped_not_in_conversation": len(rejected)}))
        loaded.origins[iid] = loc
    dropped = len(loaded.rejected)
    if dropped:
        loaded.notes.append(f"perltqa: dropped {dropped} question(s) whose memory no dialogue states ({NOT_IN_CONVERSATION})")
    return loaded
