"""r4's write judge: is a tool call's write valid for its memory type? Rule-based (`rule_judge`: no
placeholders, no meta talk, no raw dialogue lines, events in episodic, no near-duplicates, deletes only of
superseded entries) or an LLM (`llm_verdicts`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from memalpha.env.tools import ToolResult
from memalpha.text import MONTH_ABBREVIATIONS, MONTHS, WEEKDAYS, keeps_subject, tokenize

if TYPE_CHECKING:
    from memalpha.memory.store import Entry, MemoryStore
    from memalpha.models.judges import Judge

NEAR_DUPLICATE = 0.8
"""Jaccard similarity of content words above which two entries say the same thing."""
SAME_SUBJECT = 0.6
"""Share of an entry's content words found in another entry above which the other covers its subject."""


_PLACEHOLDERS = frozenset(
    {
        "invalid", "valid", "n a", "na", "none", "null", "nil", "nothing", "empty", "todo", "tbd", "tba",
        "content", "new content", "text", "placeholder", "example", "unknown", "fact", "event", "summary",
        "memory", "entry", "info", "information", "xxx", "x", "test", "string", "content here", "your content",
        "insert content", "lorem ipsum", "nothing to store", "no content",
    }
)
_ONLY_SYMBOLS = re.compile(r"^[\W_]*$")
_ANGLE_PLACEHOLDER = re.compile(r"^\s*[<\[{]\s*[\w\s|/-]{0,40}[>\]}]\s*$")
_META = re.compile(
    r"\b(i\s*(will|'ll|shall|am going to)\s+(remember|store|save|note|keep|record)"
    r"|(memory|memories)\s+(has been\s+|was\s+|is\s+)?(updated|saved|stored|cleared)"
    r"|(nothing|no new (information|facts?)|no (relevant|important) (information|facts?))\s+(to|worth|for)\s+(store|storing|save|saving|remember|remembering|record|recording)"
    r"|nothing[_ ]to[_ ]store|no new information|nothing new"
    r"|i have (stored|saved|noted|recorded|updated)|(storing|saving|updating) (this|the|it) (in|to|into)? ?(my |the )?memory"
    r"|as an ai\b|this chunk\b|tool call)",
    re.I,
)
_SPEAKER_LINE = re.compile(r"^\s*(\[[^\]]{0,40}\]\s*)?[A-Z][\w .'-]{0,30}:\s+(?P<utterance>\S.*)$", re.S)
_QUOTED = re.compile(r"^\s*[\"“]")
_FIRST_SECOND_PERSON = re.compile(r"\b(I|I'm|I've|I'll|my|me|we|our|you|your|you're)\b|[?!]\s*$")
_MONTHS = "|".join([m for m in MONTHS if m != "may"] + list(MONTH_ABBREVIATIONS))  # "may" only beside a day number
_DAYS = "|".join(WEEKDAYS)
_TIME_MARKER = re.compile(
    rf"\b(\d{{4}}-\d{{1,2}}-\d{{1,2}}|\d{{1,2}}/\d{{1,2}}(/\d{{2,4}})?|(19|20)\d{{2}}|\d{{1,2}}:\d{{2}}|\d{{1,2}}\s*(am|pm)"
    rf"|{_MONTHS}|may\s+\d{{1,2}}|\d{{1,2}}\s+may|{_DAYS}|yesterday|today|tonight|tomorrow|morning|afternoon|evening"
    rf"|night|weekend|last (week|month|year|time)|next (week|month|year)|ago|earlier|later|recently"
    rf"|session\s*\d+|day\s*\d+|chunk\s*\d+)\b",
    re.I,
)
_IRREGULAR_PAST = frozenset(
    "went met said told bought saw came took made gave got had was were did ate left found began wrote spoke ran "
    "sent felt thought brought kept held lost paid sold sat stood heard knew became flew drove rode won broke chose "
    "fell forgot grew hid led lent meant put read set shut spent taught threw understood woke wore".split()
)
_PAST_ED = re.compile(r"\b[a-z]{3,}ed\b", re.I)
_ACTOR = re.compile(r"\b([A-Z][a-z]+|I|he|she|they|we|user|assistant|speaker)\b")


def _words(text: str) -> set[str]:
    return set(tokenize(text))


def _jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b) if a and b else 0.0


def _containment(part: set[str], whole: set[str]) -> float:
    return len(part & whole) / len(part) if part else 0.0


def is_entry_update(result: ToolResult) -> bool:
    """An executed update of a list entry (a paragraph has no entry id: it is rewritten whole; a missed
    text-addressed update that was inserted replaced nothing)."""
    return (result.ok and result.name == "memory_update" and result.entry_id is not None
            and result.previous_content is not None)


def overwritten_unrelated(results: Sequence[ToolResult]) -> str:
    """What this step's misaimed updates overwrote (list-entry updates that do not `keeps_subject`), one line
    each: an unrelated overwrite that removes a superseded value has not resolved the conflict, so the
    conflict credit still reads those lines as stored."""
    misaimed = [r for r in results if is_entry_update(r) and not keeps_subject(r.previous_content, r.content or "")]
    return "\n".join(r.previous_content for r in misaimed)  # is_entry_update: previous_content is set


def _id_number(entry_id: str | None) -> int:
    try:
        return int(str(entry_id).rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def is_placeholder(content: str) -> bool:
    """Content that stands in for content: empty, symbols only, "N/A", "INVALID", "<content>", "TODO"..."""
    text = content.strip()
    if _ONLY_SYMBOLS.match(text) or _ANGLE_PLACEHOLDER.match(text):
        return True
    return " ".join(re.sub(r"[\W_]+", " ", text.lower()).split()) in _PLACEHOLDERS


def is_meta(content: str) -> bool:
    """Text about the memory or the writing itself ("I will remember", "memory updated", "nothing to store")."""
    return _META.search(content) is not None


def is_dialogue_line(content: str) -> bool:
    """A quoted utterance, or a speaker-prefixed one in the first/second person ("Alice: I love tea!"),
    rather than a statement about the world ("Alice's job: nurse" is a statement)."""
    if _QUOTED.match(content):
        return True
    line = _SPEAKER_LINE.match(content)
    return line is not None and _FIRST_SECOND_PERSON.search(line.group("utterance")) is not None


def is_event(content: str) -> bool:
    """An episodic event: a time/date/session marker, or a past-tense action with an actor."""
    if _TIME_MARKER.search(content):
        return True
    words = re.findall(r"[A-Za-z]+", content)
    past = any(w.lower() in _IRREGULAR_PAST for w in words) or _PAST_ED.search(content) is not None
    return past and _ACTOR.search(content) is not None


def fits_memory_type(memory_type: str | None, content: str) -> bool:
    """Whether content suits its memory type: episodic = event, semantic = fact, core = summary.

    Other list sections (e.g. the persona categories) need a statement, not a dialogue line.
    """
    words = len(content.split())
    if memory_type == "episodic":
        return words >= 3 and is_event(content)
    if memory_type == "core":
        return words >= 5 and not is_dialogue_line(content)
    # semantic and other list sections: a statement of fact
    return words >= 3 and not is_dialogue_line(content) and not content.rstrip().endswith("?")


@dataclass
class JudgeContext:
    """What the judge may compare a write with: the section's other entries and the chunk index."""

    others: Sequence[Entry] = ()
    chunk: int = 0


def _is_duplicate(result: ToolResult, context: JudgeContext) -> bool:
    """Near-duplicate of an entry that existed before this write (later entries are not held against it)."""
    mine = _words(result.content or "")
    own = _id_number(result.entry_id)
    new_entry = result.previous_content is None  # an insert, or a missed update inserted
    for other in context.others:
        if other.id == result.entry_id:
            continue
        earlier = _id_number(other.id) < own if new_entry else other.created_chunk <= context.chunk
        if earlier and _jaccard(mine, _words(other.content)) >= NEAR_DUPLICATE:
            return True
    return False


def _delete_is_justified(result: ToolResult, context: JudgeContext) -> bool:
    """The deleted entry repeats another one, or another (newer) entry covers its subject."""
    gone = _words(result.previous_content or "")
    own = _id_number(result.entry_id)
    for other in context.others:
        if other.id == result.entry_id:
            continue
        words = _words(other.content)
        if _jaccard(gone, words) >= NEAR_DUPLICATE:
            return True
        newer = _id_number(other.id) > own or other.updated_chunk >= context.chunk
        if newer and _containment(gone, words) >= SAME_SUBJECT:
            return True
    return False


def write_is_clean(result: ToolResult, context: JudgeContext) -> bool:
    """The type-independent rules: executed, real content, not about the memory, not a duplicate, a no-op or a
    misaimed update (`keeps_subject`)."""
    if not result.ok or result.call is None:
        return False
    if result.name == "memory_delete":
        return _delete_is_justified(result, context)
    content = result.content or ""
    if not content.strip() or is_placeholder(content) or is_meta(content):
        return False
    if result.previous_content is not None and content.strip() == result.previous_content.strip():
        return False  # an update that changes nothing
    if is_entry_update(result) and not keeps_subject(result.previous_content or "", content):
        return False  # a misaimed update
    return not _is_duplicate(result, context)


def rule_judge(result: ToolResult, context: JudgeContext | None = None) -> bool:
    """Rule-based validity of one call's write (r4); failed calls are invalid."""
    context = context or JudgeContext()
    if not write_is_clean(result, context):
        return False
    if result.name == "memory_delete":
        return True
    return fits_memory_type(result.memory_type, result.content or "")


WriteJudge = Callable[[ToolResult, JudgeContext], bool]
"""A per-call judge: (result, context) -> valid?"""


# ---- verdicts ------------------------------------------------------------------------------------


def _contexts(chunk_results: Sequence[Sequence[ToolResult]], memory: MemoryStore | None) -> list[list[JudgeContext]]:
    lists = memory.lists if memory is not None else {}
    return [
        [JudgeContext(lists.get(r.memory_type or "", ()), t) for r in results]
        for t, results in enumerate(chunk_results)
    ]


def rule_verdicts(
    chunk_results: Sequence[Sequence[ToolResult]],
    memory: MemoryStore | None = None,
    judge: WriteJudge = rule_judge,
) -> list[list[bool]]:
    """One verdict per call, chunk by chunk. `memory` is the rollout's final memory: duplicates and
    justified deletes are found against it (without it, no write counts as a duplicate and no delete
    is justified). Chunk positions are the chunk indexes the calls were executed with."""
    contexts = _contexts(chunk_results, memory)
    return [[judge(r, c) for r, c in zip(results, ctx)] for results, ctx in zip(chunk_results, contexts)]


def llm_verdicts(
    chunk_results: Sequence[Sequence[ToolResult]],
    chunk_texts: Sequence[str],
    llm: Judge,
    memory: MemoryStore | None = None,
    descriptions: dict[str, str] | None = None,
) -> list[list[bool]]:
    """Verdicts with an LLM judging whether each insert/update fits its memory type.

    The type-independent rules still apply first (so "INVALID" content or a duplicate never passes,
    whatever the LLM says); deletes are judged by the rules, as the LLM does not see the memory.
    """
    from memalpha.models.judges import JudgeItem

    contexts = _contexts(chunk_results, memory)
    verdicts = [[write_is_clean(r, c) for r, c in zip(results, ctx)] for results, ctx in zip(chunk_results, contexts)]
    asks: list[tuple[int, int]] = []
    items: list[JudgeItem] = []
    for t, results in enumerate(chunk_results):
        for i, r in enumerate(results):
            if verdicts[t][i] and r.name != "memory_delete":
                asks.append((t, i))
                memory_type = r.memory_type or ""
                items.append(JudgeItem(memory_type, r.content or "", chunk_texts[t], (descriptions or {}).get(memory_type, "")))
    for (t, i), verdict in zip(asks, llm.judge(items) if items else []):
        verdicts[t][i] = verdict is True  # only a real True: never a truthy string such as "INVALID"
    return verdicts
