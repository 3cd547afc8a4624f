"""Token-based chunking of long conversations and texts.

Turns (or sentences of plain text) are tokenized once, in one batch call of a fast tokenizer, and packed
greedily by their counts up to `chunk_tokens`, the template's tokens included. A unit is split (at
sentences, then at token windows) only when it alone exceeds the limit. Each chunk is wrapped in a dated
"please remember" template. The finished chunks are counted again in one batch and any chunk over the
limit gives its last turn to the next one, so the limit holds for any tokenizer."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable

DIALOGUE_HEADER = "The following is a conversation from {date}. Please remember it.\n\n"
UNDATED_DIALOGUE_HEADER = "The following is a conversation. Please remember it.\n\n"
TEXT_HEADER = "The following is part of a document. Please remember it.\n\n"
SESSION_MARKER = "Later, on {date}:\n"

_SENTENCE_BREAK = re.compile(r"((?<=[.!?])\s+|\n\s*)")
_WORD = re.compile(r"\S+\s*")


@dataclass
class Turn:
    """A unit of a raw conversation: one dialogue turn (speaker set) or one piece of plain text."""

    text: str
    speaker: str | None = None
    date: str | None = None
    turn_id: str | None = None
    new_chunk: bool = False
    """Force a chunk boundary before this turn (the synthetic generator uses this to place facts)."""


@dataclass
class Chunked:
    """Chunks, their exact token counts, and where each identified turn ended up."""

    chunks: list[str]
    token_counts: list[int]
    turn_chunks: dict[str, list[int]] = field(default_factory=dict)


class TokenCounts:
    """Batch token counting and token-window splitting over a HF tokenizer, a `tokenizers.Tokenizer`,
    or a plain `TokenCounter` callable (e.g. `regex_token_count`)."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and hasattr(tokenizer, "encode_batch"):
            backend = tokenizer
        if backend is None and not callable(tokenizer):
            raise TypeError(f"expected a tokenizer or a token counter, got {type(tokenizer).__name__}")
        self._backend = backend
        self._counter: Callable[[str], int] | None = None if backend is not None else tokenizer

    def count(self, text: str) -> int:
        return self.counts([text])[0]

    def counts(self, texts: list[str]) -> list[int]:
        """Token counts of many texts: one batch call for a fast tokenizer."""
        if self._backend is not None:
            return [len(enc.ids) for enc in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [self._counter(text) for text in texts]

    def split(self, text: str, max_tokens: int) -> list[str]:
        """Cut text into consecutive pieces of at most about max_tokens tokens each."""
        if self._backend is not None:
            offsets = self._backend.encode(text, add_special_tokens=False).offsets
            starts = [offsets[i][0] for i in range(0, len(offsets), max_tokens)]
            return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)]) if text[a:b].strip()]
        pieces, current, used = [], [], 0
        words = [m.group() for m in _WORD.finditer(text)]
        for word, n in zip(words, self.counts(words)):
            if current and used + n > max_tokens:
                pieces.append("".join(current))
                current, used = [], 0
            current.append(word)
            used += n
        if current:
            pieces.append("".join(current))
        return pieces


def text_turns(text: str, id_prefix: str | None = None) -> list[Turn]:
    """Plain text -> sentence units whose concatenation is the text (whitespace kept with each sentence)."""
    parts = _SENTENCE_BREAK.split(text)
    units = []
    for i in range(0, len(parts), 2):
        piece = parts[i] + (parts[i + 1] if i + 1 < len(parts) else "")
        if piece.strip():
            units.append(Turn(text=piece, turn_id=f"{id_prefix}{len(units)}" if id_prefix else None))
    return units


def _line(turn: Turn, text: str) -> str:
    if turn.speaker is not None:
        return f"{turn.speaker}: {text.strip()}\n"
    return text


def _header(date: str | None, dialogue: bool) -> str:
    if not dialogue:
        return TEXT_HEADER
    return DIALOGUE_HEADER.format(date=date) if date else UNDATED_DIALOGUE_HEADER


@dataclass
class _Unit:
    line: str
    date: str | None
    turn_id: str | None
    new_chunk: bool
    tokens: int = 0


def _expand(turns: list[Turn], counter: TokenCounts, budget: int) -> list[_Unit]:
    """Render turns as lines, count them in one batch, and split the ones over budget."""
    units = [_Unit(_line(t, t.text), t.date, t.turn_id, t.new_chunk) for t in turns]
    for unit, n in zip(units, counter.counts([u.line for u in units])):
        unit.tokens = n
    out: list[_Unit] = []
    for turn, unit in zip(turns, units):
        if unit.tokens <= budget:
            out.append(unit)
            continue
        prefix = counter.count(_line(turn, "")) if turn.speaker is not None else 0
        pieces = []
        for sentence in text_turns(turn.text):
            pieces.extend(counter.split(sentence.text, max(1, budget - prefix - 1)))
        lines = [_line(turn, p) for p in _merge_small(pieces, counter, budget - prefix)]
        for i, (line, n) in enumerate(zip(lines, counter.counts(lines))):
            out.append(_Unit(line, turn.date, turn.turn_id, turn.new_chunk and i == 0, n))
    return out


def _merge_small(pieces: list[str], counter: TokenCounts, budget: int) -> list[str]:
    """Re-join consecutive sentence pieces of a split turn while they fit."""
    merged: list[str] = []
    used = 0
    for piece, n in zip(pieces, counter.counts(pieces)):
        if merged and used + n <= budget:
            merged[-1] += piece
            used += n
        else:
            merged.append(piece)
            used = n
    return merged


def chunk_turns(turns: list[Turn], tokenizer: Any, chunk_tokens: int = 2048) -> Chunked:
    """Pack turns into chunks of at most chunk_tokens tokens (template included)."""
    counter = tokenizer if isinstance(tokenizer, TokenCounts) else TokenCounts(tokenizer)
    if not turns:
        return Chunked([], [], {})
    dialogue = any(t.speaker is not None for t in turns)
    dates = [None, *dict.fromkeys(t.date for t in turns if t.date)]
    headers = {d: _header(d, dialogue) for d in dates}
    markers = {d: SESSION_MARKER.format(date=d) for d in dates if d}
    texts = list(headers.values()) + list(markers.values())
    costs = dict(zip(texts, counter.counts(texts)))
    budget = chunk_tokens - max(costs[h] for h in headers.values()) - max((costs[m] for m in markers.values()), default=0)
    if budget < 8:
        raise ValueError(f"chunk_tokens={chunk_tokens} leaves no room after the template")
    units = _expand(turns, counter, budget)

    groups: list[list[int]] = []
    used = 0
    current_date: str | None = None
    for i, unit in enumerate(units):
        marker = costs[markers[unit.date]] if groups and unit.date and unit.date != current_date else 0
        if not groups or unit.new_chunk or used + marker + unit.tokens > chunk_tokens:
            groups.append([i])
            used = costs[headers[unit.date]] + unit.tokens
        else:
            groups[-1].append(i)
            used += marker + unit.tokens
        current_date = unit.date or current_date

    def render(group: list[int]) -> str:
        first = units[group[0]]
        parts = [headers[first.date]]
        date = first.date
        for i in group:
            unit = units[i]
            if unit.date and unit.date != date and dialogue:
                parts.append(markers[unit.date])
            date = unit.date or date
            parts.append(unit.line)
        return "".join(parts).rstrip()

    chunks = [render(g) for g in groups]
    counts = counter.counts(chunks)
    i = 0
    while i < len(groups):
        # The sum of unit counts can differ from the count of the joined text; repair the rare overflow.
        while counts[i] > chunk_tokens and len(groups[i]) > 1:
            moved = groups[i].pop()
            if i + 1 < len(groups) and not units[groups[i + 1][0]].new_chunk:
                groups[i + 1].insert(0, moved)
            else:
                groups.insert(i + 1, [moved])
                chunks.insert(i + 1, "")
                counts.insert(i + 1, 0)
            chunks[i], chunks[i + 1] = render(groups[i]), render(groups[i + 1])
            counts[i], counts[i + 1] = counter.counts([chunks[i], chunks[i + 1]])
        i += 1

    turn_chunks: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        for u in group:
            tid = units[u].turn_id
            if tid is not None and index not in turn_chunks.setdefault(tid, []):
                turn_chunks[tid].append(index)
    return Chunked(chunks, counts, turn_chunks)


def fit_chunks(chunks: list[str], counter: TokenCounts, max_tokens: int) -> tuple[list[str], list[list[int]]]:
    """Chunks cut to at most `max_tokens` tokens each (a writer's chunk size), at line breaks where a line
    fits, else inside the line; returns the new chunks and, for each old chunk, the indices of its pieces.
    Chunks that fit are kept as they are."""
    out: list[str] = []
    pieces_of: list[list[int]] = []
    for chunk, tokens in zip(chunks, counter.counts(chunks)):
        start = len(out)
        if tokens <= max_tokens:
            out.append(chunk)
        else:
            lines = [piece for line in chunk.splitlines(keepends=True)
                     for piece in ([line] if counter.count(line) <= max_tokens else counter.split(line, max_tokens))]
            current, used = "", 0
            for line, n in zip(lines, counter.counts(lines)):
                if current and used + n > max_tokens:
                    out.append(current.rstrip())
                    current, used = "", 0
                current += line
                used += n
            if current.strip():
                out.append(current.rstrip())
        pieces_of.append(list(range(start, len(out))))
    return out, pieces_of


def fit_instance(instance, counter: TokenCounts, max_tokens: int):
    """`instance` with its chunks cut to a writer's chunk size (`fit_chunks`) and its questions' evidence
    chunk indices moved with them; returns (instance, whether anything was cut)."""
    chunks, pieces_of = fit_chunks(instance.chunks, counter, max_tokens)
    if len(chunks) == len(instance.chunks):
        return instance, False
    questions = [replace(q, evidence_chunks=sorted({p for c in q.evidence_chunks for p in pieces_of[c]}))
                 if q.evidence_chunks is not None else q for q in instance.questions]
    return replace(instance, chunks=chunks, questions=questions,
                   metadata={**instance.metadata, "rechunked_from": instance.metadata.get("chunk_tokens"),
                             "chunk_tokens": max_tokens}), True
