"""A deterministic, rule-based memory writer: the SFT teacher and an evaluation baseline.

It reads a chunk (the dated "please remember" dialogue template of memalpha.data.chunking, or plain
text) sentence by sentence and keeps
- labelled examples (test-time learning: a quoted input with "label N" / "category N");
- facts: sentences with a life-fact cue (job, home, pets and names, purchases, allergies, clubs,
  relatives, dates and codes) or specific tokens (names, numbers, quotes);
- events: such sentences with a time word or a past action, stored with the session date;
rewritten as third-person statements ("I work as a nurse" -> "Maya works as a nurse"). Greetings,
questions and chatter without a cue or a specific token are skipped; a chunk with nothing left gives
NOTHING_TO_STORE. A sentence announcing a change ("moved from X to Y", "no longer", "sold the X")
updates the visible entry it shares words with (conflict resolution) instead of adding a second copy.
A short core paragraph names the speakers and their current home and job.

Output: JSON lines in the exact format the writer prompt teaches, most
valuable calls first, cut to a completion budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memalpha.env.episode import Episode, Step
from memalpha.env.parsing import NOTHING_TO_STORE, ToolCall
from memalpha.env.tools import call_line, execute_call
from memalpha.memory.schema import MemorySchema
from memalpha.memory.store import MemoryStore, normalize_content
from memalpha.text import MONTHS, WEEKDAYS
from memalpha.tokens import TokenCounter, regex_token_count

if TYPE_CHECKING:
    from memalpha.config import RunConfig

_HEADER = re.compile(r"^The following is (?:a conversation(?: from (?P<date>.+?))?|part of a document)\. Please remember it\.\s*$")
_LATER = re.compile(r"^Later, on (?P<date>.+?):\s*$")
_SPEAKER = re.compile(r"^(?:\[(?P<stamp>[^\]]{1,40})\]\s*)?(?P<speaker>[A-Z][\w.'-]*(?: [A-Z][\w.'-]*){0,2}):\s+(?P<text>\S.*)$")
_CLOCK = re.compile(r"^\s*\d{1,2}:\d{2}\s*(?:am|pm)?\s+on\s+", re.I)
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\d])")

_QUOTE = re.compile(r"[\"“](?P<text>[^\"”]{3,})[\"”]")
_LABEL = re.compile(r"\b(?:label|category|class)\s*(?:is\s*|[:=#]\s*)?(?P<label>[\w-]+)", re.I)

_MONTHS = "|".join(MONTHS)
_DAYS = "|".join(WEEKDAYS)
_TIME_WORD = re.compile(
    rf"\b(?:yesterday|today|tonight|tomorrow|this (?:morning|afternoon|evening|week|weekend|month|year)"
    rf"|last (?:night|week|weekend|month|year|{_DAYS})|next (?:week|weekend|month|year|{_DAYS})|on (?:{_DAYS})s?"
    rf"|\d+ (?:days|weeks|months|years) ago|(?:{_MONTHS}) \d{{1,2}}|\d{{1,2}} (?:{_MONTHS})|\d{{4}}-\d{{2}}-\d{{2}}|in (?:19|20)\d{{2}})\b",
    re.I,
)
_PAST_ACTION = re.compile(
    r"\b(?:adopted|bought|started|finished|signed|joined|hired|moved|accepted|sold|traded|replaced|quit|left|"
    r"switched|changed|gave up|booked|planted|painted|installed|built|fixed|hurt|injured|passed|won|lost|"
    r"graduated|married|launched|completed|arrived|visited|met|picked up|ran|retrained|relocated|named|got)\b",
    re.I,
)
# life-fact vocabulary: identity, home, work, pets and names, possessions, health, hobbies, relatives, plans
_FACT_CUE = re.compile(
    r"\b(?:work(?:s|ing|ed)? (?:as|at|for)|hired|job|employer|employee|contract|offer|career|retrained|"
    r"I'?m an? |I am an? |being an? |no longer an? |"
    r"live[sd]?|living|moved?|moving|relocat\w*|flat in|apartment|address|"
    r"named|called|adopted|bought|picked up|received|drive[sn]?|sold|traded|replaced|own(?:s|ed)?|"
    r"allerg\w*|diagnos\w*|doctor|physio|"
    r"lessons|joined|signed up|club|band|playing|novel|book club|reading|marathon|garden|trip|flight|renovat\w*|"
    r"wedding|birthday|married|anniversary|appointment|code|password)\b",
    re.I,
)
_CHANGE_CUE = re.compile(
    r"\b(?:from \S+(?: \S+){0,3} to|no longer|no more|anymore|quit|left|switched|replaced|changed|sold|gave up|goodbye|"
    r"instead|moved)\b",
    re.I,
)
_WEAK_CHANGE_CUE = re.compile(r"\b(?:new|now)\b", re.I)
"""Weaker signs of a change ("my new X", "X now"): need more shared words with the entry they update."""
_SMALL_TALK = re.compile(
    r"^(?:hi|hey|hello|morning|evening|thanks|thank you|good (?:morning|night|evening)|ok(?:ay)?|sure|great|"
    r"nice|cool|wow|haha|ha|lol|bye|see you|sounds|that'?s|me too|no problem|of course|how are you|i see|oh|"
    r"yeah|yep|yes|no way|fair enough|totally|honestly|congrats|noted|ugh|right|got it|makes sense|not much)\b",
    re.I,
)
_QUESTION_START = re.compile(r"^(?:what|who|where|when|why|how|do|does|did|are|is|can|could|would|will|have|has|should|remember)\b", re.I)
_CALENDAR = frozenset((_MONTHS + "|" + _DAYS).split("|"))
_FIRST_PERSON = re.compile(r"\b(?:I|I'm|I've|I'd|I'll)\b|\b(?:my|me|mine|myself)\b", re.I)
_SECOND_PERSON = re.compile(r"\b(?:you|your|yours)\b", re.I)
_STOPWORDS = frozenset(
    "a an the of to in on at for and or but is are was were be been it this that with as by from what which who "
    "my your his her our their me him us them i you he she we they so now new old just no not any anymore "
    "longer from into than then there here has have had do does did will would can could very really".split()
)


@dataclass
class Extraction:
    """One thing worth storing from a chunk."""

    kind: str
    """`example`, `fact` or `event`."""
    content: str
    speaker: str = ""
    change: int = 0
    """How strongly the sentence announces a change of something said before: 0 none, 1 weak, 2 strong."""
    score: int = 0
    date: str | None = None


@dataclass
class _Utterance:
    speaker: str | None
    text: str
    date: str | None


class RuleWriter:
    """Deterministic writer: `write(chunk_text, store)` returns the completion text (JSON lines).

    `max_calls` and `max_completion_tokens` (counted with `count_tokens`) cap the output, keeping the
    most valuable calls (updates, labelled examples, facts, events, then the core rewrite), most
    valuable first. A speaker's sentence is stored as a third-person statement ("Maya loves Maya's
    job"). Updates only address entries in `visible_ids` when given (the ids the writer view shows), since a policy can only
    update what it sees.
    """

    def __init__(
        self,
        schema: MemorySchema,
        max_calls: int = 8,
        max_completion_tokens: int | None = None,
        count_tokens: TokenCounter = regex_token_count,
        core_max_words: int = 48,
    ):
        lists = [s.name for s in schema.list_sections]
        if not lists:
            raise ValueError(f"memory schema {schema.name!r} has no list section to write to")
        self.schema = schema
        self.max_calls = max_calls
        self.max_completion_tokens = max_completion_tokens
        self.count_tokens = count_tokens
        self.core_max_words = core_max_words
        self._fact_section = "semantic" if "semantic" in lists else lists[0]
        self._event_section = "episodic" if "episodic" in lists else self._fact_section
        self._has_core = "core" in schema.names and not schema.section("core").is_list

    # ---- reading the chunk ---------------------------------------------------------------------

    @staticmethod
    def utterances(chunk_text: str) -> list[_Utterance]:
        """Speaker turns (or plain lines) with the session date in force."""
        date: str | None = None
        out: list[_Utterance] = []
        for raw in chunk_text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if match := _HEADER.match(line):
                date = _day(match.group("date")) if match.group("date") else date
            elif match := _LATER.match(line):
                date = _day(match.group("date"))
            elif match := _SPEAKER.match(line):
                stamp = match.group("stamp")
                out.append(_Utterance(match.group("speaker"), match.group("text"), _day(stamp) if stamp else date))
            else:
                out.append(_Utterance(None, line, date))
        return out

    def extract(self, chunk_text: str) -> list[Extraction]:
        """Everything worth storing in a chunk, in text order, without repeats."""
        found: list[Extraction] = []
        seen: set[str] = set()
        utterances = self.utterances(chunk_text)
        speakers = frozenset(u.speaker for u in utterances if u.speaker)
        for utt in utterances:
            example = _example(utt.text)
            items = [example] if example else [x for s in _sentences(utt.text) if (x := _statement(s, utt, speakers))]
            for item in items:
                key = normalize_content(item.content).lower()
                if key not in seen:
                    seen.add(key)
                    found.append(item)
        return found

    # ---- writing -------------------------------------------------------------------------------

    def _section(self, item: Extraction) -> str:
        if self._fact_section == "semantic":
            return self._event_section if item.kind == "event" else self._fact_section
        # other layouts (persona categories): the first section whose topic words the content mentions
        words = set(re.findall(r"[a-z]+", item.content.lower()))
        for section, topic in _TOPICS.items():
            if section in self.schema.names and words & topic:
                return section
        return self._fact_section

    def plan(self, chunk_text: str, store: MemoryStore, visible_ids: set[str] | None = None) -> list[ToolCall]:
        """The tool calls for one chunk, most valuable first, before any budget cut: updates, inserts, the core."""
        known = {normalize_content(e.content).lower() for _, e in store.all_entries()}
        # what a change can apply to: visible entries and this chunk's planned inserts, as they will read
        targets = {e.id: (s, e.content) for s, e in store.all_entries() if visible_ids is None or e.id in visible_ids}
        updated: dict[str, str] = {}
        inserts: dict[str, tuple[int, int, str]] = {}  # key -> (score, order, section)
        for order, item in enumerate(self.extract(chunk_text)):
            if normalize_content(item.content).lower() in known:
                continue
            if item.change:
                key = _same_subject(item, targets)
                if key is not None:
                    # the latest statement of a subject wins: one write per entry and chunk
                    section = targets[key][0]
                    content = item.content
                    if section == self._event_section != self._fact_section and item.kind != "event" and item.date:
                        content = f"On {item.date}, {_lower_first(content)}"  # an episodic entry keeps its date
                    targets[key] = (section, content)
                    if key in inserts:
                        inserts[key] = (max(inserts[key][0], item.score), inserts[key][1], section)
                    else:
                        updated[key] = content
                    continue
            if item.score > 0:
                key = f"new-{order}"
                targets[key] = (self._section(item), item.content)
                inserts[key] = (item.score, order, self._section(item))
        after = store.copy()  # the memory as this chunk's calls leave it
        calls = self._updates(after, updated, {key: targets[key][0] for key in updated})
        ranked = sorted(inserts.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
        for key, (_, _, section) in ranked:
            calls.append(ToolCall("memory_insert", {"memory_type": section, "content": targets[key][1]}))
            execute_call(after, calls[-1], 0)
        core = self._core(store, after, chunk_text)
        if core is not None:
            calls.append(ToolCall("memory_update", {"memory_type": "core", "new_content": core}))
        return calls

    @staticmethod
    def _updates(after: MemoryStore, updated: dict[str, str], sections: dict[str, str]) -> list[ToolCall]:
        """memory_update calls writing `updated[id]` over each entry, each applied to `after`."""
        calls = []
        for key, content in updated.items():
            calls.append(ToolCall("memory_update", {"memory_type": sections[key], "memory_id": key, "new_content": content}))
            execute_call(after, calls[-1], 0)
        return calls

    def _core(self, store: MemoryStore, after: MemoryStore, chunk_text: str) -> str | None:
        """Rewritten core when it changes: who is talking, then their current home and job facts in
        `after`, the memory as this chunk's other calls leave `store`."""
        if not self._has_core:
            return None
        previous = store.paragraph("core")
        speakers = list(dict.fromkeys(u.speaker for u in self.utterances(chunk_text) if u.speaker))
        names = _core_names(previous)
        for name in speakers:
            if name not in names:
                names.append(name)
        if not names:
            return None
        sentences = [f"Conversation between {' and '.join(names)}." if len(names) > 1 else f"Notes about {names[0]}."]
        profile = [e.content for _, e in after.all_entries() if _PROFILE.search(e.content) and any(n in e.content for n in names)]
        for content in reversed(profile):  # newest first; older ones give way to the word cap
            if len(" ".join(sentences + [content]).split()) <= self.core_max_words:
                sentences.append(content)
        core = " ".join(sentences)
        return core if core != previous else None

    def write(self, chunk_text: str, store: MemoryStore, visible_ids: set[str] | None = None) -> str:
        """The completion text for one chunk: JSON lines, or NOTHING_TO_STORE."""
        kept: list[str] = []
        used = 0
        planned = self.plan(chunk_text, store, visible_ids)
        if all(c.arguments.get("memory_type") == "core" for c in planned):
            return NOTHING_TO_STORE  # a new core alone (speaker names) is not worth a call
        for call in planned:
            if len(kept) >= self.max_calls:
                break
            line = call_line(call.name, call.arguments)
            cost = self.count_tokens(line + "\n")
            if self.max_completion_tokens is not None and used + cost > self.max_completion_tokens:
                continue  # a shorter, lower-priority call may still fit
            kept.append(line)
            used += cost
        return "\n".join(kept) if kept else NOTHING_TO_STORE


_TOPICS: dict[str, frozenset[str]] = {
    name: frozenset(words.split())
    for name, words in {
        "cognition_work": "work works job hired employee employer contract career engineer nurse chef analyst study degree project office company",
        "spatiotemporal_context": "live lives moved moving city flat apartment address trip flight visit travel",
        "social_interpersonal": "sister brother mother father cousin neighbour neighbor colleague roommate aunt uncle friend wife husband partner wedding",
        "physiology_health": "allergic allergy doctor physio health sleep gym marathon knee ankle run ran",
        "resource_economic": "bought sold paid money rent salary car drive drives hatchback truck van scooter motorbike code",
        "culture_entertainment": "book novel music band lessons club cello banjo guitar piano film movie game hobby",
        "sensory_lifestyle": "food coffee tea cook cooked dinner dog cat parrot pet named called",
        "values": "believe value values principle vote",
        "psychological_defense": "afraid fear stress anxious worried nervous cope",
    }.items()
}
"""Topic words of the persona categories, for layouts without semantic/episodic lists."""

_PROFILE = re.compile(r"\b(?:lives in|is in|moved (?:from \S+(?: \S+){0,3} )?to|works (?:as|at|for)|is an? |joined)\b")
_CORE_NAMES = re.compile(r"^(?:Conversation between (?P<many>.+?)|Notes about (?P<one>.+?))\.")


def rule_writer_for(config: RunConfig, count_tokens: TokenCounter, reserve_tokens: int = 0) -> RuleWriter:
    """The rule writer of a run: its memory schema, and the rollout's completion budget less
    `reserve_tokens`."""
    schema = config.memory.schema()
    return RuleWriter(schema, max_completion_tokens=config.rollout.max_completion_length - reserve_tokens,
                      count_tokens=count_tokens)


def _core_names(core: str) -> list[str]:
    match = _CORE_NAMES.match(core)
    if not match:
        return []
    return [n.strip() for n in (match.group("many") or match.group("one")).split(" and ") if n.strip()]


def _day(stamp: str) -> str:
    """The session date without its clock time ("9:45 pm on 23 March, 2023" -> "23 March 2023")."""
    return _CLOCK.sub("", stamp).replace(",", "").strip()


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text) if s.strip()]


def _example(text: str) -> Extraction | None:
    """A labelled example: a quoted input and its label in one utterance."""
    quote, label = _QUOTE.search(text), _LABEL.search(text)
    if not quote or not label or label.start() < quote.start():
        return None
    body = quote.group("text").strip().rstrip(".")
    # neither a leading quote nor a "Name:" prefix: both read as a dialogue line to the rule judge
    return Extraction("example", f'Label {label.group("label")} covers inputs like "{body}"', score=10)


_WE = re.compile(r"\b(?:we|our|ours)\b", re.I)
_ELIDED_SUBJECT = re.compile(r"^(?:[A-Z][a-z]+ed|Sold|Bought|Got|Made|Took|Ran|Met|Left|Began|Found|Picked|Finished|Started|Moved)\b")


def _specific(text: str, speakers: frozenset[str] = frozenset()) -> int:
    """Specific tokens: names (capitalised, not sentence-initial, not a calendar word, not one of the
    people talking: addressing the listener is not a fact), numbers, quotes."""
    words = re.findall(r"[A-Za-z][\w'-]*|\d[\d:.,/-]*", text)
    names = [w for w in words[1:] if w[0].isupper() and w != "I" and w.lower() not in _CALENDAR and w not in speakers]
    numbers = [w for w in words if w[0].isdigit()]
    return len(names) + len(numbers) + len(_QUOTE.findall(text))


def _statement(sentence: str, utt: _Utterance, speakers: frozenset[str] = frozenset()) -> Extraction | None:
    text = sentence.strip()
    if len(text.split()) < 3:
        return None
    cue = _FACT_CUE.search(text) is not None
    specific = _specific(text, speakers)
    if _SMALL_TALK.match(text) and not (cue or specific):
        return None
    if text.endswith("?") or _QUESTION_START.match(text):
        if not (cue and specific):
            return None  # a real question, not a rhetorical announcement
        text = text.rstrip("?") + "."
    change = 2 if _CHANGE_CUE.search(text) else 1 if _WEAK_CHANGE_CUE.search(text) else 0
    if not cue and not specific and not change:
        return None  # a change-only sentence is kept only if it matches a stored entry (see plan)
    speaker = utt.speaker or ""
    event = _TIME_WORD.search(text) is not None or (_PAST_ACTION.search(text) is not None and not cue)
    date = utt.date if event else None
    content = _restated(text, speaker, date)
    return Extraction("event" if event else "fact", content, speaker, change, 3 * cue + min(specific, 3), utt.date)


def _restated(text: str, speaker: str, date: str | None) -> str:
    """`text`, said by `speaker`, as a third-person statement, dated when `date` is given."""
    body = text.rstrip(".!").strip()
    if speaker and (_FIRST_PERSON.search(body) or _WE.search(body)):
        body = third_person(body, speaker)
    elif speaker and _ELIDED_SUBJECT.match(body):
        body = f"{speaker} {body[:1].lower()}{body[1:]}"
    elif speaker and speaker not in body:
        # names keep their capital: a lowercased "zoe" is a token the chunk never shows, and a writer
        # trained on it looped on "said that zoe said that ..." where it should copy
        body = f"{speaker} said that {_lower_first(body)}"
    if speaker and _SECOND_PERSON.search(body):
        body = _SECOND_PERSON.sub("the listener", body)
    body = body[:1].upper() + body[1:]
    if date:
        body = f"On {date}, {_lower_first(body)}"
    return body + "."


_FUNCTION_WORDS = frozenset("The A An Our We It They This That There Their His Her".split())


def _lower_first(text: str) -> str:
    """Lowercase a capitalised function word that no longer starts the sentence (names keep theirs)."""
    first = text.split(" ", 1)[0]
    return text[:1].lower() + text[1:] if first in _FUNCTION_WORDS else text


def _content_words(text: str, skip: set[str]) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9][a-z0-9'-]*", text.lower()) if w not in _STOPWORDS and w not in skip and len(w) > 1}


def _same_subject(item: Extraction, targets: dict[str, tuple[str, str]]) -> str | None:
    """The entry a change announcement is about: the one (of the same speaker, if named) sharing the
    most content words with it, newest first on ties; None when none shares any."""
    skip = {"said", "listener"} | {f"{w}{end}" for w in item.speaker.lower().split() for end in ("", "'s")}
    mine = _content_words(item.content, skip)
    best, best_overlap = None, 1 if item.change == 1 else 0
    for entry_id, (_, content) in reversed(list(targets.items())):
        if item.speaker and item.speaker not in content:
            continue
        overlap = len(mine & _content_words(content, skip))
        if overlap > best_overlap:
            best, best_overlap = entry_id, overlap
    return best


_PRONOUNS = [
    (re.compile(r"\bI'm\b"), "{s} is"),
    (re.compile(r"\bI've\b"), "{s} has"),
    (re.compile(r"\bI'd\b"), "{s} would"),
    (re.compile(r"\bI'll\b"), "{s} will"),
    (re.compile(r"\bI am\b"), "{s} is"),
    (re.compile(r"\bI was\b"), "{s} was"),
    (re.compile(r"\bI don't\b"), "{s} doesn't"),
    (re.compile(r"\bI do not\b"), "{s} does not"),
    (re.compile(r"\bmyself\b", re.I), "{s}"),
    (re.compile(r"\bmine\b", re.I), "{s}'s"),
    (re.compile(r"\bmy\b", re.I), "{s}'s"),
    (re.compile(r"\bme\b", re.I), "{s}"),
    (re.compile(r"\bour\b", re.I), "{s}'s"),
    (re.compile(r"\bours\b", re.I), "{s}'s"),
    (re.compile(r"\bwe're\b", re.I), "{s} is"),
    (re.compile(r"\bwe've\b", re.I), "{s} has"),
]
_KEEP_VERB = frozenset(
    "can could will would shall should may might must did was went had got made took saw met said told came "
    "bought ran left found gave won lost flew drove wrote read sold began kept felt thought heard knew became "
    "quit put set hurt cut let hit".split()
)
_IRREGULAR_3RD = {"have": "has", "do": "does", "go": "goes", "am": "is"}


def _third_person_verb(word: str) -> str:
    lower = word.lower()
    if lower in _KEEP_VERB or lower.endswith("ed") or not lower.isalpha():
        return word
    if lower in _IRREGULAR_3RD:
        return _IRREGULAR_3RD[lower]
    if lower.endswith(("s", "sh", "ch", "x", "z", "o")):
        return word + "es"
    if len(lower) > 2 and lower.endswith("y") and lower[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def third_person(text: str, speaker: str) -> str:
    """Rewrite a first-person sentence about `speaker` in the third person ("I love my job" ->
    "Maya loves Maya's job"), so the entry is a statement, not a dialogue line."""
    for pattern, replacement in _PRONOUNS:
        text = pattern.sub(replacement.format(s=speaker), text)

    def subject_verb(match: re.Match[str]) -> str:
        adverbs, verb = match.group("adv") or "", match.group("verb")
        return f"{speaker} {adverbs}{_third_person_verb(verb)}"

    return re.sub(r"\b(?:I|[Ww]e) (?P<adv>(?:\w+ly |also |just |still |now |often |never |always |finally )*)(?P<verb>[A-Za-z']+)", subject_verb, text)


def run_rule_writer(episode: Episode, writer: RuleWriter) -> list[Step]:
    """Drive `episode` to its last chunk with the rule writer, which, like a policy, may only update
    the entries the writer view shows. Returns the episode's steps."""
    while not episode.done:
        episode.step(writer.write(episode.chunk_text, episode.store, episode.visible_ids()))
    return episode.steps
