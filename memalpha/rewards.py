"""Rewards of a (rollout, chunk) sample: the only place r1..r4 are computed. See docs/REWARDS.md.

r_t = r1 + w * coverage_t + g_t * (r2_t + gamma * r4_t) + beta * r3
- r1: mean QA score of the instance's questions on the final memory (shared by the rollout's chunks);
- coverage_t: how far what chunk t wrote makes the questions it holds evidence for answerable
  (1 for a chunk that holds no evidence); g_t = coverage_t on chunks with evidence (format cannot
  outscore content), 1 elsewhere;
- r2_t: share of chunk t's calls that executed (each unparseable fragment is one failed call);
- r3: 1 - memory tokens / input tokens, clipped to [0, 1] (shared), only for a useful non-empty memory;
- r4_t: share of chunk t's calls whose write a judge deems valid (failed calls are invalid writes).
An explicit nothing-to-store on a chunk known to hold no evidence is a correct action (r2 = r4 = 1); on
a chunk with evidence it earns nothing (coverage 0 gates everything). Elsewhere a chunk with no calls
gets r2 = r4 = 0, or r2 = cfg.nothing_to_store_r2 for an explicit skip in a useful, non-empty memory.
With coverage_weight = 0 and content_gate off this is the paper's reward.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from memalpha.config import SHADOWED_CONFLICT_CREDIT, RewardConfig
from memalpha.data.schema import Question
from memalpha.metrics import normalize_answer, score_answer
from memalpha.text import MONTH_ABBREVIATIONS, MONTHS, WEEKDAYS, keeps_subject, tokenize
from memalpha.tools import ToolResult

if TYPE_CHECKING:
    from memalpha.memory.store import Entry, MemoryStore
    from memalpha.models.judges import Judge

NEAR_DUPLICATE = 0.8
"""Jaccard similarity of content words above which two entries say the same thing."""
SAME_SUBJECT = 0.6
"""Share of an entry's content words found in another entry above which the other covers its subject."""


@dataclass
class RewardBreakdown:
    """Reward of one (rollout, chunk) sample, component by component."""

    r1: float
    r2: float
    r3: float
    r4: float
    total: float
    coverage: float = 0.0
    """Content credit of the chunk (1 for a chunk that holds no evidence), times its retention."""
    holds_evidence: bool | None = None
    calls: int = 0
    executed: int = 0
    valid: int = 0
    nothing_to_store: bool = False
    retention: float = 1.0
    """Share of the answer support the memory had before the chunk that survived it (`retention`)."""
    precision: float = 1.0
    """Share of the chunk's content writes that hold an answer the chunk can give (`write_precision`)."""

    def to_dict(self) -> dict[str, float | int | bool]:
        return asdict(self)


# ---- the rule judge ------------------------------------------------------------------------------

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


# ---- coverage: per-chunk credit for the questions a chunk can make answerable -----------------------

_ANSWER_STOPWORDS = frozenset("a an the of to in on at for and or is are was were be by with from as it its".split())


def _answer_words(text: str) -> set[str]:
    return {w for w in normalize_answer(text).split() if w not in _ANSWER_STOPWORDS}


def mentions(text: str, answer: str) -> bool:
    """`answer` occurs in `text`, normalised, on word boundaries (the convention of memalpha.metrics)."""
    needle = normalize_answer(answer)
    return bool(needle) and f" {needle} " in f" {normalize_answer(text)} "


def coverage_chunks(question: Question, chunks: Sequence[str]) -> list[int] | None:
    """The chunks that can make `question` answerable: its evidence chunks that state a current answer
    (a keyword, for summaries), or all its evidence chunks when none does (a worked-out answer).
    None for a question without evidence indices (its credit is attributed, see `attribution_credit`).
    Stating a superseded value does not count: storing it cannot answer the question."""
    if question.evidence_chunks is None:
        return None
    evidence = [c for c in question.evidence_chunks if 0 <= c < len(chunks)]
    stating = [c for c in evidence if any(mentions(chunks[c], a) for a in question.answers)]
    return stating or evidence


def answer_support(question: Question, written: str, chunk_text: str, memory_text: Callable[[], str],
                   shadowed_credit: float = SHADOWED_CONFLICT_CREDIT) -> float:
    """How far `written` (what one step wrote, as it reads after the step) supports the answer, in [0, 1].

    - summary keywords: the share of the keywords the chunk states that the writes kept;
    - classification: 1 when the evidence reader finds the right label among the written examples;
    - conflict: 1 when the writes state the current value and not a superseded one, times
      `shadowed_credit` while the whole memory (`memory_text()`, with what misaimed updates overwrote:
      `overwritten_unrelated`) still asserts a superseded value;
    - otherwise: 1 when a gold answer occurs in the writes, else the best share of a gold answer's
      words they hold (partial credit for lists and multi-word answers).
    """
    from memalpha.models.readers import EvidenceReader, competency_of  # memalpha.models loads torch on import

    competency = competency_of(question)
    if competency == "long_range_understanding":
        offered = [k for k in question.answers if mentions(chunk_text, k)] or question.answers
        return sum(mentions(written, k) for k in offered) / len(offered) if offered else 0.0
    if competency == "test_time_learning" or (competency == "conflict_resolution" and question.superseded_answers):
        reader = EvidenceReader()
        score = score_answer(reader.answer_one(written, question), question.answers, question.question_type,
                             question.superseded_answers)
        if score and competency == "conflict_resolution":
            whole = reader.answer_one(memory_text(), question)
            score *= 1.0 if score_answer(whole, question.answers, question.question_type, question.superseded_answers) else shadowed_credit
        return score
    best = 0.0
    words = _answer_words(written)
    for gold in question.answers:
        if mentions(written, gold):
            return 1.0
        wanted = _answer_words(gold)
        if wanted:
            best = max(best, len(wanted & words) / len(wanted))
    return best


def attribution_credit(scores: Sequence[float], retrieved: Sequence[Sequence[int]], num_chunks: int) -> list[float]:
    """Fine-Mem's evidence-anchored attribution for questions without evidence indices: question j's
    final score s_j is shared equally by the entries M_j the reader was shown for it, and each entry's
    share goes to the chunk that created or last updated it: N_t = sum_j sum_{m in M_j, step(m)=t}
    s_j / (|M_j| n). `retrieved[j]` lists the writing chunk of each entry in M_j."""
    credit = [0.0] * num_chunks
    n = len(scores)
    for score, chunks in zip(scores, retrieved):
        for t in chunks:
            if 0 <= t < num_chunks:
                credit[t] += score / (len(chunks) * n)
    return credit


# ---- combination ---------------------------------------------------------------------------------


def compression(memory_tokens: int, input_tokens: int) -> float:
    """1 - memory tokens / input tokens, clipped to [0, 1] (0 when there was no input)."""
    if input_tokens <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - memory_tokens / input_tokens))


REWARD_COMPONENTS = ("r1", "r2", "r3", "r4", "coverage", "retention", "precision")
"""The `RewardBreakdown` fields logged as `rewards/<name>/mean`."""


def memory_support(questions: Sequence[Question], memory_text: str) -> dict[int, float]:
    """Question index -> `answer_support` of the whole memory, for the questions it supports at all."""
    support = {}
    for j, question in enumerate(questions):
        value = answer_support(question, memory_text, memory_text, lambda: memory_text)
        if value > 0:
            support[j] = value
    return support


def retention(before: dict[int, float], after: dict[int, float]) -> float:
    """Share of the memory's answer support before a step that the step left (`memory_support` before and
    after it): 1 when nothing was supported or nothing was lost. A write that overwrites a stored answer
    with small talk lowers it; supporting more answers than before cannot make up for one lost."""
    total = sum(before.values())
    if total <= 0:
        return 1.0
    return sum(min(after.get(j, 0.0), value) for j, value in before.items()) / total


@dataclass(frozen=True)
class ChunkCoverage:
    """The content credit of one chunk (see `chunk_coverage`)."""

    value: float
    holds_evidence: bool | None
    """True: some question's coverage chunks include it; False: all questions have evidence indices and
    none points here; None: unknown (questions without evidence indices; `value` is attributed credit)."""
    retention: float = 1.0
    """`retention` of the step: the content credit and the gate are scaled by it."""
    precision: float = 1.0
    """`write_precision` of the step."""


def write_precision(answer_writes: int, writes: int, holds_evidence: bool | None) -> float:
    """Share of a step's content writes (inserts, updates, paragraph writes) that hold an answer of a
    question the chunk can make answerable. Without writes: 1 on a chunk that holds no evidence (skipping
    was right), 0 on one that does. Unknown evidence: 1 for every candidate, so it moves no advantage."""
    if holds_evidence is None:
        return 1.0
    if not writes:
        return 0.0 if holds_evidence else 1.0
    return answer_writes / writes


def chunk_coverage(
    supports: Sequence[dict[int, float]],
    relevant: Sequence[Sequence[int]],
    attributed: Sequence[float] | None = None,
    retained: Sequence[float] | None = None,
    writes: Sequence[tuple[int, int]] | None = None,
) -> list[ChunkCoverage]:
    """Coverage of every chunk of one rollout.

    supports[t]: question index -> `answer_support` of what chunk t wrote, for the questions in
    relevant[t] (those whose `coverage_chunks` include t). attributed: `attribution_credit` for the
    instance's questions without evidence indices, or None when every question has them. retained[t]:
    the `retention` of step t (None: every step kept everything). writes[t]: (content writes of step t
    that hold an answer, content writes of step t), for `write_precision` (None: precision 1).
    """
    out = []
    for t, questions in enumerate(relevant):
        kept = 1.0 if retained is None else retained[t]
        if questions:
            value, evidence = sum(supports[t].get(j, 0.0) for j in questions) / len(questions), True
        elif attributed is not None:
            value, evidence = attributed[t], None
        else:
            value, evidence = 0.0, False
        precision = 1.0 if writes is None else write_precision(*writes[t], evidence)
        out.append(ChunkCoverage(value, evidence, kept, precision))
    return out


def chunk_rewards(
    qa_score: float,
    chunk_results: Sequence[Sequence[ToolResult]],
    nothing_flags: Sequence[bool],
    memory_tokens: int,
    input_tokens: int,
    cfg: RewardConfig,
    judge: WriteJudge = rule_judge,
    memory: MemoryStore | None = None,
    verdicts: Sequence[Sequence[bool]] | None = None,
    coverage: Sequence[ChunkCoverage] | None = None,
) -> list[RewardBreakdown]:
    """Rewards of every chunk of one rollout (docs/REWARDS.md).

    qa_score: r1, the mean QA score on the final memory. chunk_results[t]: the results of chunk t's
    calls (from `execute_text`, so parse errors are failed results). nothing_flags[t]: the output was an
    explicit NOTHING_TO_STORE. memory: the final memory, for the judge's duplicate and delete checks.
    verdicts: precomputed per-call validity (e.g. `llm_verdicts`); otherwise `judge` decides.
    coverage: `chunk_coverage` of the rollout; without it the content term is 0 and nothing is gated
    (the paper's reward).
    """
    if len(nothing_flags) != len(chunk_results):
        raise ValueError(f"nothing_flags has {len(nothing_flags)} items for {len(chunk_results)} chunks")
    if coverage is not None and len(coverage) != len(chunk_results):
        raise ValueError(f"coverage has {len(coverage)} items for {len(chunk_results)} chunks")
    if not 0.0 <= qa_score <= 1.0:
        raise ValueError(f"qa_score must be in [0, 1], got {qa_score}")
    if verdicts is None:
        verdicts = rule_verdicts(chunk_results, memory, judge)
    elif [len(v) for v in verdicts] != [len(r) for r in chunk_results]:
        raise ValueError("verdicts must hold one verdict per call of every chunk")
    useful = qa_score > 0 and memory_tokens > 0
    r3 = compression(memory_tokens, input_tokens) if useful else 0.0
    out = []
    for t, (results, nothing, valid) in enumerate(zip(chunk_results, nothing_flags, verdicts)):
        calls = len(results)
        executed = sum(1 for r in results if r.ok)
        n_valid = sum(1 for v in valid if v is True)
        credit = coverage[t] if coverage is not None else ChunkCoverage(0.0, None)
        evidence = credit.holds_evidence
        skip = bool(nothing) and not calls
        if calls:
            r2, r4 = executed / calls, n_valid / calls
        elif skip and cfg.content_gate and evidence is False:
            r2 = r4 = 1.0  # nothing here will be asked about: skipping is the correct action
        else:
            r2 = cfg.nothing_to_store_r2 if skip and useful else 0.0
            r4 = 0.0
        kept = credit.retention if cfg.retention else 1.0
        # a chunk without evidence has nothing to miss, but can still overwrite what earlier chunks stored
        content = (1.0 if evidence is False else credit.value) * kept
        gate = (content if evidence else kept) if cfg.content_gate else 1.0
        total = (qa_score + cfg.coverage_weight * content + gate * (r2 + cfg.gamma * r4) + cfg.beta * r3
                 + cfg.precision_weight * credit.precision)
        out.append(RewardBreakdown(qa_score, r2, r3, r4, total, content, evidence, calls, executed, n_valid, skip,
                                   retention=credit.retention, precision=credit.precision))
    return out
