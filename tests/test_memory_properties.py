"""Property tests: arbitrary model output never crashes or corrupts the store; failures change nothing;
the store agrees with a simple reference model."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memalpha.env.tools import ToolCall, execute_calls, execute_text
from memalpha.memory import MEMALPHA_SCHEMA, PERSONA_SCHEMA, FailureReason, MemoryStore
from memalpha.memory.store import normalize_content

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SECTIONS = ["core", "semantic", "episodic", "procedural"]
CONTENTS = ["Alice likes tea", "alice likes tea", "  Alice  likes tea ", "", "   ", "Bob is 30", "Met Bob on Monday", "x"]
IDS = ["sem-1", "sem-2", "sem-3", "epi-1", "epi-2", "epi-4", "core", "", "7"]


def check_integrity(store: MemoryStore) -> None:
    text = store.to_json()
    restored = MemoryStore.from_json(text)  # validates ids, counter and duplicates
    assert restored.to_json() == text
    ids = [e.id for _, e in store.all_entries()]
    assert len(ids) == len(set(ids))
    assert all(int(i.rsplit("-", 1)[1]) < store.next_id for i in ids)
    recount = sum(store.count_tokens(t) for t in store.paragraphs.values())
    recount += sum(store.count_tokens(e.content) for _, e in store.all_entries())
    assert store.token_count() == recount == restored.token_count()


def seeded_store(schema=MEMALPHA_SCHEMA) -> MemoryStore:
    store = MemoryStore(schema)
    store.update("core", None, "Alice is a teacher.", 0)
    store.insert(schema.list_sections[0].name, "Alice likes tea", 0)
    store.insert(schema.list_sections[1].name, "Met Bob on Monday", 0)
    return store


arguments = st.dictionaries(
    st.sampled_from(["memory_type", "content", "new_content", "memory_id", "text"]),
    st.one_of(st.sampled_from(SECTIONS), st.sampled_from(CONTENTS), st.sampled_from(IDS), st.none(), st.integers(), st.lists(st.text(max_size=3), max_size=2)),
    max_size=4,
)
sections, contents, ids = st.sampled_from(SECTIONS), st.sampled_from(CONTENTS), st.sampled_from(IDS)
well_formed_calls = st.one_of(
    st.builds(lambda t, c: ToolCall("memory_insert", {"memory_type": t, "content": c}), sections, contents),
    st.builds(lambda t, i, c: ToolCall("memory_update", {"memory_type": t, "memory_id": i, "new_content": c}), sections, ids, contents),
    st.builds(lambda t, i: ToolCall("memory_delete", {"memory_type": t, "memory_id": i}), sections, ids),
)
tool_calls = st.one_of(
    well_formed_calls,
    st.builds(ToolCall, st.sampled_from(["memory_insert", "memory_update", "memory_delete", "memory_search", ""]), arguments),
)


def render(call: ToolCall, style: int) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments})
    return [body, f"<tool_call>{body}</tool_call>", f"```json\n{body}\n```", f"✿FUNCTION✿: {call.name}\n✿ARGS✿: {json.dumps(call.arguments)}"][style]


@st.composite
def model_outputs(draw) -> str:
    """Plausible model output: calls in mixed formats with prose, then possibly cut or corrupted."""
    calls = draw(st.lists(st.tuples(tool_calls, st.integers(0, 3)), max_size=4))
    parts = [render(c, style) for c, style in calls]
    parts += draw(st.lists(st.sampled_from(["Sure!", "NOTHING_TO_STORE", "{", "}", '{"', "[{", "```", "<tool_call>", "✿ARGS✿:"]), max_size=2))
    text = "\n".join(draw(st.permutations(parts)))
    if text and draw(st.booleans()):
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.sampled_from(["", ",", "'", '"', "}", "\\"])) + text[cut:]
    return text


@SETTINGS
@given(st.text(max_size=400))
def test_arbitrary_text_never_raises_or_corrupts(text):
    store = seeded_store()
    parsed, results = execute_text(store, text, chunk=1)
    assert parsed.nothing_to_store or results  # never a silent drop
    assert len(results) >= len(parsed.errors)
    check_integrity(store)


@SETTINGS
@given(model_outputs(), st.sampled_from([MEMALPHA_SCHEMA, PERSONA_SCHEMA]))
def test_structured_output_never_raises_or_corrupts(text, schema):
    store = seeded_store(schema)
    parsed, results = execute_text(store, text, chunk=2)
    assert len(results) == len(parsed.calls) + len(parsed.errors)
    assert all((r.reason is None) == r.ok for r in results)
    check_integrity(store)


@SETTINGS
@given(st.lists(tool_calls, min_size=1, max_size=8))
def test_a_failed_call_leaves_memory_unchanged(calls):
    store = seeded_store()
    for chunk, call in enumerate(calls, start=1):
        before = store.to_json()
        (result,) = execute_calls(store, [call], chunk)
        if not result.ok:
            assert result.reason in FailureReason
            assert store.to_json() == before
        elif call.name == "memory_insert":
            assert store.get(result.memory_type, result.entry_id).content == result.content
    check_integrity(store)


class StoreAgainstModel(RuleBasedStateMachine):
    """The store's outcomes match a plain reference model of lists, ids and duplicates."""

    def __init__(self):
        super().__init__()
        self.store = MemoryStore(MEMALPHA_SCHEMA)
        self.model = {"semantic": {}, "episodic": {}}  # section -> {id: content}
        self.counter = 1
        self.chunk = 0
        self.listened = {}
        self.store.add_listener(self.listen)

    def listen(self, event, section, entry):
        if event == "delete":
            del self.listened[entry.id]
        else:
            self.listened[entry.id] = entry.content

    def holder(self, section, content):
        norm = normalize_content(content)
        return next((i for i, c in self.model[section].items() if normalize_content(c) == norm), None)

    @rule(section=st.sampled_from(["semantic", "episodic"]), content=st.sampled_from(CONTENTS))
    def insert(self, section, content):
        self.chunk += 1
        result = self.store.insert(section, content, self.chunk)
        if not content.strip():
            assert result.reason is FailureReason.EMPTY_CONTENT
        elif self.holder(section, content.strip()):
            assert result.reason is FailureReason.DUPLICATE
        else:
            assert result.ok and result.entry_id == f"{section[:3]}-{self.counter}"
            self.model[section][result.entry_id] = content.strip()
            self.counter += 1

    def known_ids(self):
        return [i for entries in self.model.values() for i in entries]

    @precondition(lambda self: self.known_ids())
    @rule(data=st.data(), content=st.sampled_from(CONTENTS))
    def update(self, data, content):
        entry_id = data.draw(st.sampled_from(self.known_ids()))
        section = entry_id.startswith("sem") and "semantic" or "episodic"
        self.chunk += 1
        result = self.store.update(section, entry_id, content, self.chunk)
        holder = self.holder(section, content.strip()) if content.strip() else None
        if not content.strip():
            assert result.reason is FailureReason.EMPTY_CONTENT
        elif holder not in (None, entry_id):
            assert result.reason is FailureReason.DUPLICATE
        else:
            assert result.ok
            self.model[section][entry_id] = content.strip()

    @precondition(lambda self: self.known_ids())
    @rule(data=st.data())
    def delete(self, data):
        entry_id = data.draw(st.sampled_from(self.known_ids()))
        section = entry_id.startswith("sem") and "semantic" or "episodic"
        assert self.store.delete(section, entry_id, self.chunk).ok
        del self.model[section][entry_id]
        assert self.store.delete(section, entry_id, self.chunk).reason is FailureReason.UNKNOWN_ID

    @rule()
    def round_trip(self):
        listeners = [self.listen]
        self.store = MemoryStore.from_json(self.store.to_json())
        for fn in listeners:
            self.store.add_listener(fn)

    @invariant()
    def agrees(self):
        for section, entries in self.model.items():
            assert [(e.id, e.content) for e in self.store.entries(section)] == list(entries.items())
        assert self.listened == {i: c for entries in self.model.values() for i, c in entries.items()}
        assert self.store.next_id == self.counter


TestStoreAgainstModel = StoreAgainstModel.TestCase
TestStoreAgainstModel.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
