"""The memory store: paragraph sections (rewrite-only) and list sections (insert/update/delete by id).

Every operation returns an `OpResult` and never raises on bad model input: a failed operation leaves the
store unchanged. Ids are `{prefix}-{n}` from one per-store counter that only grows, so an id is never
reused, even after a delete or a JSON round trip. Token and entry counts are kept incrementally.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from itertools import islice
from types import MappingProxyType
from typing import Any, Literal

from memalpha.memory.schema import MemorySchema, SectionSpec
from memalpha.tokens import TokenCounter, regex_token_count

Event = Literal["insert", "update", "delete"]
Listener = Callable[[Event, str, "Entry"], None]

_WORD_END = re.compile(r"\S+")
_JSON_VERSION = 1


class FailureReason(StrEnum):
    """Why a tool call failed (re-exported by `memalpha.env.tools`)."""

    UNPARSEABLE = "unparseable"
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    UNKNOWN_ID = "unknown_id"
    DUPLICATE = "duplicate"
    EMPTY_CONTENT = "empty_content"
    WRONG_MEMORY_TYPE = "wrong_memory_type"


@dataclass(frozen=True, slots=True)
class Entry:
    """One list entry. Immutable: an update replaces it, so copies of a store can share entries."""

    id: str
    content: str
    created_chunk: int
    updated_chunk: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "content": self.content, "created_chunk": self.created_chunk, "updated_chunk": self.updated_chunk}


@dataclass(frozen=True, slots=True)
class OpResult:
    """Outcome of one store operation; `content` is what was written (after truncation)."""

    ok: bool
    reason: FailureReason | None
    message: str
    entry_id: str | None = None
    truncated: bool = False
    content: str | None = None
    previous_content: str | None = None


def _fail(reason: FailureReason, message: str, entry_id: str | None = None) -> OpResult:
    return OpResult(False, reason, message, entry_id)


def normalize_content(text: str) -> str:
    """Whitespace-normalised content, the key for duplicate detection."""
    return " ".join(text.split())


def truncate_to_tokens(text: str, max_tokens: int, count: TokenCounter) -> tuple[str, bool]:
    """Longest prefix of `text` ending at a word boundary with at most `max_tokens` tokens.

    Binary search over word ends (O(log n) counter calls). A single first word longer than the cap is
    cut by characters. Returns (text, was_truncated); the result is always verified to fit.
    """
    if count(text) <= max_tokens:
        return text, False
    ends = [m.end() for m in _WORD_END.finditer(text)]
    lo, hi = 0, len(ends)  # invariant: a prefix of `lo` words fits (0 words trivially)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[: ends[mid - 1]]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    if lo > 0:
        return text[: ends[lo - 1]].rstrip(), True
    start = len(text) - len(text.lstrip())
    lo, hi = start, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[start:mid]) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[start:lo], True


class MemoryStore:
    """A memory laid out by a `MemorySchema`.

    Paragraph sections are only rewritten (`update`); list sections hold ordered `Entry`s edited by id.
    `paragraphs` and `lists` are read-only snapshots; change the store through its methods. Listeners
    (`add_listener`) hear every successful list edit so a retrieval index can stay in sync; paragraph
    rewrites are not announced (readers always see paragraphs whole).
    """

    def __init__(self, schema: MemorySchema, count_tokens: TokenCounter = regex_token_count):
        self.schema = schema
        self.count_tokens = count_tokens
        self._specs: dict[str, SectionSpec] = {s.name: s for s in schema.sections}
        self._paragraphs: dict[str, str] = {s.name: "" for s in schema.paragraph_sections}
        self._entries: dict[str, dict[str, Entry]] = {s.name: {} for s in schema.list_sections}
        self._norms: dict[str, dict[str, str]] = {s.name: {} for s in schema.list_sections}  # content -> id
        self._section_of: dict[str, str] = {}  # entry id -> section
        self._tokens_of: dict[str, int] = {}  # entry id or paragraph name -> tokens
        self._total_tokens = 0
        self._next_id = 1
        self._listeners: list[Listener] = []

    # ---- reading -------------------------------------------------------------------------------

    @property
    def next_id(self) -> int:
        """The number the next inserted entry will get."""
        return self._next_id

    @property
    def paragraphs(self) -> Mapping[str, str]:
        return MappingProxyType(self._paragraphs)

    @property
    def lists(self) -> dict[str, list[Entry]]:
        return {name: list(entries.values()) for name, entries in self._entries.items()}

    def paragraph(self, section: str) -> str:
        """Text of a paragraph section ('' when never written)."""
        return self._paragraphs[section]

    def entries(self, section: str) -> list[Entry]:
        """Entries of a list section, oldest first."""
        return list(self._entries[section].values())

    def newest(self, section: str, n: int) -> list[Entry]:
        """The `n` most recently inserted entries of a list section, newest first (no full copy)."""
        return list(islice(reversed(self._entries[section].values()), max(n, 0)))

    def all_entries(self) -> list[tuple[str, Entry]]:
        """(section, entry) for every list entry, section by section in schema order."""
        return [(name, e) for name, entries in self._entries.items() for e in entries.values()]

    def get(self, section: str, entry_id: str) -> Entry | None:
        entries = self._entries.get(section)
        return entries.get(entry_id) if entries is not None else None

    def spec(self, section: str) -> SectionSpec | None:
        """The schema's spec of `section`, or None when there is no such section (O(1))."""
        return self._specs.get(section) if isinstance(section, str) else None

    def section_of(self, entry_id: str) -> str | None:
        """The list section holding `entry_id`, or None."""
        return self._section_of.get(entry_id)

    def token_count(self) -> int:
        """Tokens of everything a reader sees: paragraphs and entry contents (kept incrementally)."""
        return self._total_tokens

    def entry_count(self) -> int:
        return len(self._section_of)

    # ---- listeners -----------------------------------------------------------------------------

    def add_listener(self, fn: Listener) -> None:
        """Call `fn(event, section, entry)` after each successful list insert/update/delete.

        For a delete, `entry` is the removed entry; for an update, the new one.
        """
        self._listeners.append(fn)

    def _emit(self, event: Event, section: str, entry: Entry) -> None:
        for fn in self._listeners:
            fn(event, section, entry)

    # ---- editing -------------------------------------------------------------------------------

    def _unknown_section(self, section: Any) -> OpResult:
        return _fail(
            FailureReason.WRONG_MEMORY_TYPE,
            f"unknown memory_type {section!r} (known: {', '.join(self.schema.names)})",
        )

    def _prepare(self, spec: SectionSpec, content: Any) -> tuple[str, bool, OpResult | None]:
        if not isinstance(content, str):
            return "", False, _fail(FailureReason.BAD_ARGUMENTS, f"content must be text, not {type(content).__name__}")
        text = content.strip()
        if not text:
            return "", False, _fail(FailureReason.EMPTY_CONTENT, f"content for {spec.name} is empty")
        truncated = False
        if spec.max_tokens is not None:
            text, truncated = truncate_to_tokens(text, spec.max_tokens, self.count_tokens)
        return text, truncated, None

    def _set_tokens(self, key: str, tokens: int) -> None:
        self._total_tokens += tokens - self._tokens_of.get(key, 0)
        self._tokens_of[key] = tokens

    def _truncation_note(self, spec: SectionSpec, truncated: bool) -> str:
        return f"; content was cut to the {spec.max_tokens}-token cap of {spec.name}" if truncated else ""

    def insert(self, section: str, content: str, chunk: int) -> OpResult:
        """Append a new entry to a list section."""
        spec = self.spec(section)
        if spec is None:
            return self._unknown_section(section)
        if not spec.is_list:
            return _fail(FailureReason.WRONG_MEMORY_TYPE, f"{section} is a paragraph: rewrite it with memory_update")
        text, truncated, error = self._prepare(spec, content)
        if error:
            return error
        norm = normalize_content(text)
        existing = self._norms[section].get(norm)
        if existing is not None:
            return _fail(FailureReason.DUPLICATE, f"{section} already holds this content as {existing}", existing)
        entry_id = f"{spec.prefix}-{self._next_id}"
        self._next_id += 1
        entry = Entry(entry_id, text, chunk, chunk)
        self._entries[section][entry_id] = entry
        self._norms[section][norm] = entry_id
        self._section_of[entry_id] = section
        self._set_tokens(entry_id, self.count_tokens(text))
        self._emit("insert", section, entry)
        return OpResult(True, None, f"inserted {entry_id} into {section}" + self._truncation_note(spec, truncated), entry_id, truncated, text)

    def _find(self, section: str, entry_id: Any) -> tuple[Entry | None, OpResult | None]:
        if not isinstance(entry_id, str):
            return None, _fail(FailureReason.BAD_ARGUMENTS, f"memory_id must be a string id such as '{self._specs[section].prefix}-1', not {entry_id!r}")
        key = entry_id.strip()
        entry = self._entries[section].get(key)
        if entry is not None:
            return entry, None
        elsewhere = self._section_of.get(key)
        where = f" (it is in {elsewhere})" if elsewhere else ""
        return None, _fail(FailureReason.UNKNOWN_ID, f"no entry {key!r} in {section}{where}", key)

    def update(self, section: str, entry_id: str | None, content: str, chunk: int) -> OpResult:
        """Replace an entry's content (list) or rewrite a paragraph (entry_id is ignored there)."""
        spec = self.spec(section)
        if spec is None:
            return self._unknown_section(section)
        if not spec.is_list:
            text, truncated, error = self._prepare(spec, content)
            if error:
                return error
            previous = self._paragraphs[section]
            self._paragraphs[section] = text
            self._set_tokens(section, self.count_tokens(text))
            message = f"rewrote {section}" + self._truncation_note(spec, truncated)
            return OpResult(True, None, message, None, truncated, text, previous)
        if entry_id is None:
            return _fail(FailureReason.BAD_ARGUMENTS, f"memory_id is required to update an entry of {section}")
        entry, error = self._find(section, entry_id)
        if error:
            return error
        text, truncated, error = self._prepare(spec, content)
        if error:
            return error
        if text == entry.content:
            return OpResult(True, None, f"{entry.id} unchanged (same content)", entry.id, truncated, text, entry.content)
        norms = self._norms[section]
        norm = normalize_content(text)
        owner = norms.get(norm)
        if owner is not None and owner != entry.id:
            return _fail(FailureReason.DUPLICATE, f"{section} already holds this content as {owner}", owner)
        del norms[normalize_content(entry.content)]
        norms[norm] = entry.id
        new = Entry(entry.id, text, entry.created_chunk, chunk)
        self._entries[section][entry.id] = new  # same key: keeps the entry's position
        self._set_tokens(entry.id, self.count_tokens(text))
        self._emit("update", section, new)
        message = f"updated {entry.id} in {section}" + self._truncation_note(spec, truncated)
        return OpResult(True, None, message, entry.id, truncated, text, entry.content)

    def delete(self, section: str, entry_id: str, chunk: int) -> OpResult:
        """Remove an entry from a list section. Its id is never given out again."""
        spec = self.spec(section)
        if spec is None:
            return self._unknown_section(section)
        if not spec.is_list:
            return _fail(FailureReason.WRONG_MEMORY_TYPE, f"{section} is a paragraph and cannot be deleted: rewrite it with memory_update")
        entry, error = self._find(section, entry_id)
        if error:
            return error
        del self._entries[section][entry.id]
        del self._norms[section][normalize_content(entry.content)]
        del self._section_of[entry.id]
        self._total_tokens -= self._tokens_of.pop(entry.id)
        self._emit("delete", section, entry)
        return OpResult(True, None, f"deleted {entry.id} from {section} at chunk {chunk}", entry.id, False, None, entry.content)

    # ---- copying and serialisation ------------------------------------------------------------

    def copy(self) -> MemoryStore:
        """An independent store with the same content and counter; listeners are not copied."""
        new = MemoryStore.__new__(MemoryStore)
        new.schema = self.schema
        new.count_tokens = self.count_tokens
        new._specs = self._specs
        new._paragraphs = dict(self._paragraphs)
        new._entries = {k: dict(v) for k, v in self._entries.items()}
        new._norms = {k: dict(v) for k, v in self._norms.items()}
        new._section_of = dict(self._section_of)
        new._tokens_of = dict(self._tokens_of)
        new._total_tokens = self._total_tokens
        new._next_id = self._next_id
        new._listeners = []
        return new

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form: schema, id counter, paragraphs and entries."""
        return {
            "version": _JSON_VERSION,
            "schema": self.schema.to_dict(),
            "next_id": self._next_id,
            "paragraphs": dict(self._paragraphs),
            "lists": {name: [e.to_dict() for e in entries.values()] for name, entries in self._entries.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Any, count_tokens: TokenCounter = regex_token_count) -> MemoryStore:
        """Inverse of `to_dict`; ValueError naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError("memory: expected a JSON object")
        if data.get("version") != _JSON_VERSION:
            raise ValueError(f"memory.version: expected {_JSON_VERSION}, got {data.get('version')!r}")
        store = cls(MemorySchema.from_dict(data.get("schema")), count_tokens)
        next_id = data.get("next_id")
        if not isinstance(next_id, int) or isinstance(next_id, bool) or next_id < 1:
            raise ValueError(f"memory.next_id: expected a positive integer, got {next_id!r}")
        paragraphs = data.get("paragraphs")
        if not isinstance(paragraphs, dict) or set(paragraphs) != set(store._paragraphs):
            raise ValueError(f"memory.paragraphs: expected exactly the sections {sorted(store._paragraphs)}")
        for name, text in paragraphs.items():
            if not isinstance(text, str):
                raise ValueError(f"memory.paragraphs.{name}: expected a string")
            store._paragraphs[name] = text
            store._set_tokens(name, count_tokens(text))
        lists = data.get("lists")
        if not isinstance(lists, dict) or set(lists) != set(store._entries):
            raise ValueError(f"memory.lists: expected exactly the sections {sorted(store._entries)}")
        for name, raw_entries in lists.items():
            spec = store._specs[name]
            id_pattern = re.compile(rf"^{re.escape(spec.prefix)}-(\d+)$")
            if not isinstance(raw_entries, list):
                raise ValueError(f"memory.lists.{name}: expected a list")
            for i, raw in enumerate(raw_entries):
                where = f"memory.lists.{name}[{i}]"
                try:
                    entry = Entry(str(raw["id"]), raw["content"], int(raw["created_chunk"]), int(raw["updated_chunk"]))
                except (KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"{where}: missing or invalid field {exc}") from None
                match = id_pattern.match(entry.id)
                if not match or int(match.group(1)) >= next_id:
                    raise ValueError(f"{where}.id: {entry.id!r} is not {spec.prefix}-<n> with n < next_id={next_id}")
                if entry.id in store._section_of:
                    raise ValueError(f"{where}.id: {entry.id!r} appears twice")
                if not isinstance(entry.content, str) or not entry.content.strip():
                    raise ValueError(f"{where}.content: expected non-empty text")
                norm = normalize_content(entry.content)
                if norm in store._norms[name]:
                    raise ValueError(f"{where}.content: duplicates {store._norms[name][norm]}")
                store._entries[name][entry.id] = entry
                store._norms[name][norm] = entry.id
                store._section_of[entry.id] = name
                store._set_tokens(entry.id, count_tokens(entry.content))
        store._next_id = next_id
        return store

    @classmethod
    def from_json(cls, text: str, count_tokens: TokenCounter = regex_token_count) -> MemoryStore:
        """Rebuild a store from `to_json` output (token counts are recomputed with `count_tokens`)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"memory JSON is invalid: {exc}") from None
        return cls.from_dict(data, count_tokens)

    def __repr__(self) -> str:
        return f"MemoryStore(schema={self.schema.name!r}, entries={self.entry_count()}, tokens={self.token_count()})"
