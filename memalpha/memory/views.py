"""What the writer and the reader see of a memory, rendered compactly within a token budget.

Format: one block per section, `[core]` followed by the paragraph, `[semantic]` followed by lines
`- sem-3: content`. Entries are chosen by priority (newest and most relevant), shown in memory order,
and the lowest-priority ones are dropped until the rendering fits the budget, measured with the store's
token counter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from memalpha.memory.store import Entry, MemoryStore, truncate_to_tokens

T = TypeVar("T")

SearchFn = Callable[[str, str, int], list[str]]
"""search(section, query, k) -> ids of the k entries of `section` most relevant to `query`, best first."""

EMPTY = "(empty)"

def _entry_id(entry: Entry) -> str:
    return entry.id


def _item_id(item: tuple[str, Entry]) -> str:
    return item[1].id


def _id_number(entry: Entry) -> int:
    return int(entry.id.rsplit("-", 1)[1])


def _flat(text: str) -> str:
    return " ".join(text.split())


def _round_robin(ranked: Iterable[list[T]], key: Callable[[T], str]) -> list[T]:
    """Merge ranked lists round-robin (first of each, then second of each, ...), dropping repeats."""
    lists = [r for r in ranked if r]
    seen: set[str] = set()
    merged: list[T] = []
    for rank in range(max((len(r) for r in lists), default=0)):
        for r in lists:
            if rank < len(r) and key(r[rank]) not in seen:
                seen.add(key(r[rank]))
                merged.append(r[rank])
    return merged


def _searched(store: MemoryStore, search: SearchFn | None, section: str, query: str, k: int) -> list[Entry]:
    if search is None or k <= 0 or not query.strip():
        return []
    found = (store.get(section, entry_id) for entry_id in search(section, query, k))
    return [e for e in found if e is not None]  # an index may briefly hold ids the store no longer has


def _entry_line(entry: Entry) -> str:
    return f"- {entry.id}: {_flat(entry.content)}"


def _render(paragraphs: list[tuple[str, str]], shown: dict[str, list[Entry]]) -> str:
    blocks = [f"[{name}]\n{text or EMPTY}" for name, text in paragraphs]
    for section, entries in shown.items():
        if entries:
            lines = "\n".join(_entry_line(e) for e in sorted(entries, key=_id_number))
            blocks.append(f"[{section}]\n{lines}")
    return "\n\n".join(blocks)


def _fit(store: MemoryStore, priority: list[tuple[str, Entry]], budget_tokens: int) -> str:
    """Paragraphs first (cut if needed), then entries in priority order while the budget allows; each
    list's shown entries are listed by id, oldest first."""
    count = store.count_tokens
    paragraphs: list[tuple[str, str]] = []
    used = 0
    for spec in store.schema.paragraph_sections:
        header = count(f"\n\n[{spec.name}]\n")
        room = budget_tokens - used - header
        if room <= 0:
            break
        text, _ = truncate_to_tokens(_flat(store.paragraph(spec.name)) or EMPTY, room, count)
        if not text:
            break
        paragraphs.append((spec.name, text))
        used += header + count(text)

    shown: dict[str, list[Entry]] = {spec.name: [] for spec in store.schema.list_sections}
    accepted: list[tuple[str, Entry]] = []
    for section, entry in priority:
        cost = count("\n" + _entry_line(entry))
        if not shown[section]:
            cost += count(f"\n\n[{section}]")
        if used + cost <= budget_tokens:
            shown[section].append(entry)
            accepted.append((section, entry))
            used += cost

    # The estimate above assumes counts add up; enforce the budget on the real rendering.
    text = _render(paragraphs, shown)
    while count(text) > budget_tokens:
        if accepted:
            section, entry = accepted.pop()
            shown[section].remove(entry)
        elif paragraphs:
            name, para = paragraphs[-1]
            overflow = count(text) - budget_tokens
            cut, _ = truncate_to_tokens(para, max(count(para) - overflow, 0), count)
            if cut:
                paragraphs[-1] = (name, cut)
            else:
                paragraphs.pop()
        else:
            return ""
        text = _render(paragraphs, shown)
    return text


def writer_view(
    store: MemoryStore,
    chunk_text: str,
    search: SearchFn | None = None,
    budget_tokens: int = 1024,
    newest: int = 5,
    relevant: int = 5,
) -> str:
    """The memory shown to the writer with an incoming chunk.

    Paragraphs, then for each list its `newest` latest entries and the `relevant` entries most related
    to `chunk_text` (via `search`; without it only the newest), each with its id so the writer can
    update or delete it. Newest and relevant entries alternate in priority, ranks alternate across
    lists; the lowest-priority ones are dropped to stay within `budget_tokens`.
    """
    per_section = []
    for spec in store.schema.list_sections:
        searched = _searched(store, search, spec.name, chunk_text, relevant)
        ranked = _round_robin([store.newest(spec.name, newest), searched], _entry_id)
        per_section.append([(spec.name, e) for e in ranked])
    return _fit(store, _round_robin(per_section, _item_id), budget_tokens)


def reader_view(
    store: MemoryStore,
    query: str,
    search: SearchFn | None = None,
    budget_tokens: int = 2048,
    top_k: int = 20,
) -> str:
    """The memory shown to the reader for one question: paragraphs plus the `top_k` entries of each
    list retrieved for `query` (without `search`: the newest `top_k`), within `budget_tokens`."""
    per_section = []
    for spec in store.schema.list_sections:
        if search is None:
            ranked = store.newest(spec.name, top_k)
        else:
            ranked = _searched(store, search, spec.name, query, top_k)
        per_section.append([(spec.name, e) for e in ranked])
    return _fit(store, _round_robin(per_section, _item_id), budget_tokens)



def whole_view(store: MemoryStore, budget_tokens: int) -> str | None:
    """Every paragraph and entry of the memory, or None when that does not fit in `budget_tokens`."""
    paragraphs = [(spec.name, _flat(store.paragraph(spec.name))) for spec in store.schema.paragraph_sections]
    shown = {spec.name: store.entries(spec.name) for spec in store.schema.list_sections}
    text = _render(paragraphs, shown)
    return text if store.count_tokens(text) <= budget_tokens else None


_VIEW_ID = re.compile(r"^- (?P<id>[a-z0-9_]+-\d+): ", re.M)


def view_ids(view: str) -> set[str]:
    """Ids of the entries a view shows, read from its lines `- sem-3: content`."""
    return {m.group("id") for m in _VIEW_ID.finditer(view)}
