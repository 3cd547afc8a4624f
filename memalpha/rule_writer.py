"""A deterministic, rule-based memory writer: the SFT teacher and an evaluation baseline.

It reads a chunk (the dated "please remember" dialogue template of memalpha.data.chunking, or plain
text), extracts
- facts: first-person statements ("my X is Y", "I live in", "I work as", "I have a ... named", likes,
  allergies) rewritten in the third person with the speaker's name, keyed by subject;
- labelled examples (test-time learning: "... label: N") kept with their input text;
- events: dated actions (past tense or a time word), stored with the session date;
- other statements with numbers or names;
and emits JSON-lines tool calls in the exact format the writer prompt teaches. A fact whose subject is
already in memory with another value becomes an update of that entry (conflict resolution). A short
core paragraph lists the speakers' profile facts. A chunk with nothing to store gives NOTHING_TO_STORE.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from memalpha.memory.schema import MemorySchema
from memalpha.memory.store import MemoryStore, normalize_content
from memalpha.parsing import NOTHING_TO_STORE
from memalpha.tokens import TokenCounter, regex_token_count

_HEADER = re.compile(r"^The following is (?:a conversation(?: from (?P<date>.+?))?|part of a document)\. Please remember it\.\s*$")
_LATER = re.compile(r"^Later, on (?P<date>.+?):\s*$")
_SPEAKER = re.compile(r"^(?:\[(?P<stamp>[^\]]{1,40})\]\s*)?(?P<speaker>[A-Z][\w.'-]*(?: [A-Z][\w.'-]*){0,2}):\s+(?P<text>\S.*)$")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\d])")
_LABEL = re.compile(r"^(?P<input>.*?)[\s,;:.\-–—>]*\b(?:label|category|class)\b\s*(?:is\s*|[:=]\s*)\s*(?P<label>[\w-]+)[.!]?\s*$", re.I)
_INPUT_PREFIX = re.compile(r"^(?:example|input|text|sentence|query)\s*\d*\s*[:\-]\s*", re.I)

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_TIME_WORD = re.compile(
    rf"\b(?:yesterday|today|tonight|this (?:morning|afternoon|evening|week|weekend)|last (?:night|week|weekend|month|year|\w+day)"
    rf"|on (?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)|\d+ (?:days|weeks|months|years) ago"
    rf"|(?:{_MONTHS}) \d{{1,2}}|\d{{4}}-\d{{2}}-\d{{2}}|in (?:19|20)\d{{2}})\b",
    re.I,
)
_PAST_VERB = re.compile(
    r"\bI (?:just |finally |recently |also |really )?(?:went|visited|met|bought|saw|started|finished|adopted|moved|got|ran|"
    r"attended|won|lost|joined|left|took|made|gave|had|booked|celebrated|traveled|travelled|signed|graduated|"
    r"completed|launched|hiked|cooked|baked|painted|wrote|read|watched|played|flew|drove|sold|received|tried|"
    r"learned|learnt|passed|failed|married|quit|retired|hosted|organized|organised|volunteered|ordered|planted|"
    r"[a-z]{3,}ed)\b"
)
_QUESTION_START = re.compile(r"^(?:what|who|where|when|why|how|do|does|did|are|is|can|could|would|will|have|has|should)\b", re.I)
_SMALL_TALK = re.compile(
    r"^(?:hi|hey|hello|thanks|thank you|good (?:morning|night|evening)|ok(?:ay)?|sure|great|nice|cool|wow|haha|lol|"
    r"bye|see you|sounds (?:good|great|fun)|that'?s (?:great|nice|cool|awesome|interesting|wonderful|good)|"
    r"me too|no problem|of course|how are you|i see|oh|yeah|yes|no)\b",
    re.I,
)
_CAPITALISED = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-z]+")
_NUMBER = re.compile(r"\d")

# fact patterns on a first-person sentence: (regex, subject template, content template)
# subject templates name what the fact is about, so a later value of the same subject updates the entry.
_FACT_PATTERNS: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"\bmy name is (?P<v>[A-Z][\w' -]+)", re.I), "{s}'s name is", "{s}'s name is {v}"),
    (re.compile(r"\bmy (?:new |current )?(?P<a>(?:[\w'-]+ ){0,3}?[\w'-]+) (?:is|are) (?:now |actually )?(?P<v>.+)", re.I), "{s}'s {a} is", "{s}'s {a} is {v}"),
    (re.compile(r"\bI(?:'ve| have)? (?:now |just |recently )?(?:live|am living|'m living|moved|relocated|moved out) (?:in|to) (?P<v>.+)", re.I), "{s} lives in", "{s} lives in {v}"),
    (re.compile(r"\bI (?:now |currently )?(?:work|am working|'m working) (?P<p>as|at|for) (?P<v>.+)", re.I), "{s} works {p}", "{s} works {p} {v}"),
    (re.compile(r"\bI(?:'m| am) (?:now |currently )?(?:working )?(?:a|an) (?P<v>(?:[\w-]+ ){0,2}(?:engineer|teacher|nurse|doctor|developer|designer|student|manager|writer|artist|chef|lawyer|accountant|scientist|researcher|consultant|pilot|architect|programmer|analyst|musician|photographer|journalist|librarian|pharmacist|dentist|mechanic|electrician|plumber|carpenter|farmer|baker|barista|therapist|professor|editor|producer|translator|veterinarian|vet|paramedic|firefighter|officer|salesperson|entrepreneur)\b.*)", re.I), "{s}'s job is", "{s}'s job is {v}"),
    (re.compile(r"\bI (?:have|own|got) (?:a|an|two|three) (?P<k>[\w -]{1,30}?) (?:named|called) (?P<v>[A-Z][\w'-]+(?: [A-Z][\w'-]+)?)", re.I), "{s}'s {k} is named", "{s}'s {k} is named {v}"),
    (re.compile(r"\bI(?:'m| am) allergic to (?P<v>.+)", re.I), "{s} is allergic to", "{s} is allergic to {v}"),
    (re.compile(r"\bI(?:'m| am) (?P<v>\d{1,3}) years old", re.I), "{s}'s age is", "{s} is {v} years old"),
    (re.compile(r"\bI (?:really |absolutely )?(?:love|like|enjoy|prefer|adore|hate|dislike) (?P<v>.+)", re.I), "", ""),
]

_PROFILE_SUBJECTS = ("name is", "lives in", "works as", "works at", "works for", "job is", "age is")

_PERSONA_KEYWORDS: dict[str, tuple[str, ...]] = {
    "cognition_work": ("work", "job", "engineer", "teacher", "nurse", "study", "degree", "project", "office", "career", "company", "skill"),
    "spatiotemporal_context": ("live", "moved", "city", "address", "visit", "trip", "town", "apartment", "travel"),
    "social_interpersonal": ("sister", "brother", "mother", "father", "friend", "wife", "husband", "partner", "son", "daughter", "colleague", "family"),
    "physiology_health": ("allergic", "health", "sleep", "exercise", "run", "gym", "doctor", "diet", "sick", "marathon"),
    "resource_economic": ("money", "salary", "rent", "bought", "sold", "car", "house", "price", "paid", "budget", "$"),
    "culture_entertainment": ("book", "movie", "music", "song", "game", "hobby", "paint", "guitar", "piano", "film", "concert"),
    "sensory_lifestyle": ("food", "eat", "coffee", "tea", "favorite", "favourite", "color", "colour", "cook", "dog", "cat", "pet"),
    "values": ("believe", "value", "important", "principle", "vote"),
    "psychological_defense": ("afraid", "fear", "stress", "anxious", "worried", "cope", "nervous"),
}


@dataclass
class Extraction:
    """One thing worth storing: its section, its text and, for keyed facts, its subject."""

    kind: str  # fact, example, event, statement
    content: str
    subject: str = ""
    speaker: str = ""


@dataclass
class _Utterance:
    speaker: str | None
    text: str
    date: str | None


@dataclass
class RuleWriter:
    """Deterministic writer: `write(chunk_text, store)` returns the completion text (JSON lines).

    `max_calls` and `max_completion_tokens` cap the output (the rollout's completion budget), keeping
    the most valuable calls: updates, then facts, labelled examples, events, other statements, core.
    `visible_ids`, when given to `write`, restricts updates to entries the writer view shows, as a
    policy can only address ids it sees.
    """

    schema: MemorySchema
    max_calls: int = 8
    max_completion_tokens: int | None = None
    count_tokens: TokenCounter = regex_token_count
    core_max_words: int = 60
    _sections: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        names = {s.name for s in self.schema.list_sections}
        if not names:
            raise ValueError(f"memory schema {self.schema.name!r} has no list section to write to")
        first = self.schema.list_sections[0].name
        self._sections = {
            "fact": "semantic" if "semantic" in names else first,
            "example": "semantic" if "semantic" in names else first,
            "statement": "semantic" if "semantic" in names else first,
            "event": "episodic" if "episodic" in names else first,
        }
        self._persona = not ({"semantic", "episodic"} <= names)

    # ---- reading the chunk ---------------------------------------------------------------------

    @staticmethod
    def _utterances(chunk_text: str) -> list[_Utterance]:
        date: str | None = None
        out: list[_Utterance] = []
        for raw in chunk_text.splitlines():
            line = raw.strip()
            if not line:
                continue
            if match := _HEADER.match(line):
                date = match.group("date") or date
                continue
            if match := _LATER.match(line):
                date = match.group("date")
                continue
            if match := _SPEAKER.match(line):
                out.append(_Utterance(match.group("speaker"), match.group("text"), match.group("stamp") or date))
            else:
                out.append(_Utterance(None, line, date))
        return out

    def extract(self, chunk_text: str) -> list[Extraction]:
        """Everything worth storing in a chunk, in text order, without repeats."""
        found: list[Extraction] = []
        seen: set[str] = set()
        for utt in self._utterances(chunk_text):
            whole = self._example(utt)
            items = [whole] if whole else [x for s in _sentences(utt.text) if (x := self._sentence(s, utt))]
            for item in items:
                key = normalize_content(item.content).lower()
                if key not in seen:
                    seen.add(key)
                    found.append(item)
        return found

    @staticmethod
    def _example(utt: _Utterance) -> Extraction | None:
        match = _LABEL.match(utt.text)
        if not match:
            return None
        text = _INPUT_PREFIX.sub("", match.group("input").strip().strip("\"'")).strip().strip("\"'").rstrip(" ,;:-")
        if len(text.split()) < 2:
            return None
        return Extraction("example", f'"{text}" has label {match.group("label")}.')

    def _sentence(self, sentence: str, utt: _Utterance) -> Extraction | None:
        text = sentence.strip()
        if len(text.split()) < 3 or text.endswith("?") or _QUESTION_START.match(text) or _SMALL_TALK.match(text):
            return None
        speaker = utt.speaker or ""
        first_person = re.search(r"\b(I|I'm|I've|my|me)\b", text) is not None
        if first_person and speaker:
            for pattern, subject, template in _FACT_PATTERNS:
                match = pattern.search(text)
                if not match:
                    continue
                groups = {k: _clean_value(v) for k, v in match.groupdict().items() if v}
                if not groups.get("v"):
                    continue
                if not template:  # likes: no subject, stored as a statement
                    return Extraction("fact", _sentence_case(third_person(text, speaker)), "", speaker)
                values = {"s": speaker, **groups}
                return Extraction("fact", template.format(**values) + ".", subject.format(**values), speaker)
        if _TIME_WORD.search(text) or (first_person and _PAST_VERB.search(text)):
            body = third_person(text, speaker) if speaker and first_person else text
            body = _sentence_case(body.rstrip(".!"))
            prefix = f"On {utt.date}, " if utt.date else ""
            return Extraction("event", f"{prefix}{body}.", "", speaker)
        if _NUMBER.search(text) or _CAPITALISED.search(text):
            body = third_person(text, speaker) if speaker and first_person else text
            if speaker and not first_person and not text.lower().startswith(speaker.lower()):
                body = f"{speaker} said: {text}" if re.search(r"\b(you|your|we|our)\b", text, re.I) is None else ""
            if body and not re.search(r"\b(you|your)\b", body, re.I):
                return Extraction("statement", _sentence_case(body.rstrip(".!")) + ".", "", speaker)
        return None

    # ---- writing -------------------------------------------------------------------------------

    def _section(self, item: Extraction) -> str:
        if not self._persona:
            return self._sections[item.kind]
        lower = item.content.lower()
        for section, words in _PERSONA_KEYWORDS.items():
            if section in self.schema.names and any(w in lower for w in words):
                return section
        return self._sections[item.kind]

    @staticmethod
    def _find_subject(store: MemoryStore, section: str, subject: str, visible: set[str] | None) -> str | None:
        prefix = subject.lower()
        for entry in reversed(store.entries(section)):
            if entry.content.lower().startswith(prefix) and (visible is None or entry.id in visible):
                return entry.id
        return None

    def plan(self, chunk_text: str, store: MemoryStore, visible_ids: set[str] | None = None) -> list[dict]:
        """The tool calls (as dicts) for one chunk, most valuable first, before any budget cut."""
        updates: list[dict] = []
        inserts: dict[str, list[dict]] = {"fact": [], "example": [], "event": [], "statement": []}
        existing = {normalize_content(e.content).lower() for _, e in store.all_entries()}
        profile: dict[str, str] = {}
        for item in self.extract(chunk_text):
            if normalize_content(item.content).lower() in existing:
                continue
            section = self._section(item)
            if item.subject:
                if item.subject.split(" ", 1)[-1].startswith(_PROFILE_SUBJECTS):
                    profile[item.subject.lower()] = item.content
                entry_id = self._find_subject(store, section, item.subject, visible_ids)
                if entry_id is not None:
                    updates.append(_call("memory_update", memory_type=section, memory_id=entry_id, new_content=item.content))
                    continue
            inserts[item.kind].append(_call("memory_insert", memory_type=section, content=item.content))
        calls = updates + inserts["fact"] + inserts["example"] + inserts["event"] + inserts["statement"]
        core = self._core(store, profile)
        if core is not None:
            calls.append(_call("memory_update", memory_type="core", new_content=core))
        return calls

    def _core(self, store: MemoryStore, profile: dict[str, str]) -> str | None:
        """A rewritten core paragraph when this chunk brings new profile facts (name, home, job, age)."""
        if not profile or "core" not in store.schema.names or store.schema.section("core").is_list:
            return None
        facts: dict[str, str] = {}
        for _, entry in store.all_entries():
            for subject in _PROFILE_SUBJECTS:
                head = entry.content.split(subject, 1)[0]
                if subject in entry.content and head.count(" ") <= 2:
                    facts[(head + subject).lower()] = entry.content
        facts.update(profile)
        sentences = list(dict.fromkeys(facts.values()))
        while sentences and len(" ".join(sentences).split()) > self.core_max_words:
            sentences.pop(0)  # oldest profile facts give way to the newest
        core = " ".join(sentences)
        return core if core and core != store.paragraph("core") else None

    def write(self, chunk_text: str, store: MemoryStore, visible_ids: set[str] | None = None) -> str:
        """The completion text for one chunk: JSON lines, or NOTHING_TO_STORE."""
        lines: list[str] = []
        used = 0
        for call in self.plan(chunk_text, store, visible_ids)[: self.max_calls]:
            line = json.dumps(call, ensure_ascii=False)
            cost = self.count_tokens(line + "\n")
            if self.max_completion_tokens is not None and used + cost > self.max_completion_tokens:
                continue  # a shorter, lower-priority call may still fit
            lines.append(line)
            used += cost
        return "\n".join(lines) if lines else NOTHING_TO_STORE


def _call(name: str, **arguments: str) -> dict:
    return {"name": name, "arguments": arguments}


def _sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE.split(text) if s.strip()]


def _clean_value(value: str) -> str:
    value = re.split(r"(?<=\w)[.!?;](?:\s|$)|,\s*(?:and|but|so|which|because)\b|\s+(?:and I|but I|because|so I)\b", value.strip())[0]
    return value.strip().rstrip(".,!;:").strip()


def _sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:] if text else text


_PRONOUNS = [
    (re.compile(r"\bI'm\b"), "{s} is"),
    (re.compile(r"\bI've\b"), "{s} has"),
    (re.compile(r"\bI'd\b"), "{s} would"),
    (re.compile(r"\bI'll\b"), "{s} will"),
    (re.compile(r"\bI am\b"), "{s} is"),
    (re.compile(r"\bI was\b"), "{s} was"),
    (re.compile(r"\bmyself\b", re.I), "{s}"),
    (re.compile(r"\bmine\b", re.I), "{s}'s"),
    (re.compile(r"\bmy\b", re.I), "{s}'s"),
    (re.compile(r"\bme\b"), "{s}"),
]
_KEEP_VERB = frozenset(
    "can could will would shall should may might must did was went had got made took saw met said told came "
    "bought ran left found gave won lost flew drove wrote read sold began kept felt thought heard knew became".split()
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

    return re.sub(r"\bI (?P<adv>(?:\w+ly |also |just |still |now |often |never |always )*)(?P<verb>[A-Za-z']+)", subject_verb, text)
