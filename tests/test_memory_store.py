"""The memory store: schemas, list and paragraph operations, ids, listeners, copies and JSON."""

import json

import pytest

from memalpha.config import MemoryConfig
from memalpha.memory import (
    MEMALPHA_SCHEMA,
    PERSONA_SCHEMA,
    FailureReason,
    MemorySchema,
    MemoryStore,
    SectionSpec,
    get_schema,
    truncate_to_tokens,
)
from memalpha.tokens import regex_token_count

PERSONA_LISTS = [
    "sensory_lifestyle",
    "culture_entertainment",
    "cognition_work",
    "values",
    "physiology_health",
    "resource_economic",
    "social_interpersonal",
    "spatiotemporal_context",
    "psychological_defense",
]


def recount(store: MemoryStore) -> int:
    paragraphs = sum(store.count_tokens(t) for t in store.paragraphs.values())
    return paragraphs + sum(store.count_tokens(e.content) for _, e in store.all_entries())


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore(MEMALPHA_SCHEMA)


# ---- schemas -------------------------------------------------------------------------------------


def test_memalpha_schema_layout():
    schema = get_schema("memalpha")
    assert schema.names == ("core", "semantic", "episodic")
    assert schema.section("core").kind == "paragraph" and schema.section("core").max_tokens == 512
    assert [s.name for s in schema.list_sections] == ["semantic", "episodic"]
    assert [s.name for s in schema.paragraph_sections] == ["core"]


def test_persona_schema_layout_and_config_caps():
    cfg = MemoryConfig(schema_name="persona", core_max_tokens=64)
    schema = get_schema(cfg.schema_name, cfg.core_max_tokens)
    assert schema.names == ("core", *PERSONA_LISTS)
    assert schema.section("core").max_tokens == 64
    assert all(s.kind == "list" and s.description for s in schema.list_sections)
    assert PERSONA_SCHEMA.section("core").max_tokens == 512  # the shared constant is untouched


def test_unknown_schema_and_section_are_named():
    with pytest.raises(ValueError, match="unknown memory schema 'nope'.*memalpha"):
        get_schema("nope")
    with pytest.raises(KeyError, match="no section 'x'"):
        MEMALPHA_SCHEMA.section("x")


def test_schema_rejects_repeated_prefixes():
    with pytest.raises(ValueError, match="prefixes repeat"):
        MemorySchema("bad", (SectionSpec("a", "list", "", id_prefix="x"), SectionSpec("b", "list", "", id_prefix="x")))
    with pytest.raises(ValueError, match="kind"):
        SectionSpec("a", "table", "")  # type: ignore[arg-type]


# ---- list operations -----------------------------------------------------------------------------


def test_insert_assigns_prefixed_increasing_ids(store):
    first = store.insert("semantic", "  Alice likes green tea. ", chunk=0)
    second = store.insert("episodic", "Alice met Bob on Monday.", chunk=1)
    assert first.ok and first.entry_id == "sem-1" and first.content == "Alice likes green tea."
    assert second.ok and second.entry_id == "epi-2"
    entry = store.get("semantic", "sem-1")
    assert (entry.content, entry.created_chunk, entry.updated_chunk) == ("Alice likes green tea.", 0, 0)
    assert store.entry_count() == 2 and store.section_of("epi-2") == "episodic"


def test_ids_are_never_reused_after_delete_or_round_trip(store):
    store.insert("semantic", "a", 0)
    store.insert("semantic", "b", 0)
    assert store.delete("semantic", "sem-2", 1).ok
    assert store.insert("semantic", "c", 1).entry_id == "sem-3"
    restored = MemoryStore.from_json(store.to_json())
    assert restored.insert("semantic", "b", 2).entry_id == "sem-4"


def test_duplicate_insert_fails_after_whitespace_normalisation(store):
    store.insert("semantic", "Alice likes tea", 0)
    before = store.to_json()
    result = store.insert("semantic", "  Alice   likes\ntea ", 1)
    assert not result.ok and result.reason is FailureReason.DUPLICATE and result.entry_id == "sem-1"
    assert "sem-1" in result.message
    assert store.to_json() == before
    assert store.insert("episodic", "Alice likes tea", 1).ok  # duplicates are per section
    assert store.insert("semantic", "alice likes tea", 1).ok  # case is content


@pytest.mark.parametrize("content", ["", "   ", "\n\t"])
def test_empty_content_fails(store, content):
    result = store.insert("semantic", content, 0)
    assert result.reason is FailureReason.EMPTY_CONTENT and store.entry_count() == 0
    store.insert("semantic", "x", 0)
    assert store.update("semantic", "sem-1", content, 1).reason is FailureReason.EMPTY_CONTENT
    assert store.update("core", None, content, 1).reason is FailureReason.EMPTY_CONTENT


def test_unknown_id_fails_and_names_the_right_section(store):
    store.insert("episodic", "event", 0)
    result = store.update("semantic", "epi-1", "new", 1)
    assert result.reason is FailureReason.UNKNOWN_ID and "episodic" in result.message
    assert store.delete("semantic", "sem-99", 1).reason is FailureReason.UNKNOWN_ID
    assert store.get("episodic", "epi-1").content == "event"


def test_wrong_memory_type(store):
    assert store.insert("core", "x", 0).reason is FailureReason.WRONG_MEMORY_TYPE
    assert store.delete("core", "core", 0).reason is FailureReason.WRONG_MEMORY_TYPE
    for op in (lambda: store.insert("procedural", "x", 0), lambda: store.update("procedural", "p-1", "x", 0)):
        result = op()
        assert result.reason is FailureReason.WRONG_MEMORY_TYPE and "semantic" in result.message
    assert store.entry_count() == 0 and store.paragraph("core") == ""


def test_update_keeps_position_and_created_chunk(store):
    for text in ("a", "b", "c"):
        store.insert("semantic", text, 0)
    result = store.update("semantic", "sem-2", "B", 5)
    assert result.ok and result.previous_content == "b" and result.content == "B"
    assert [e.content for e in store.entries("semantic")] == ["a", "B", "c"]
    entry = store.get("semantic", "sem-2")
    assert (entry.created_chunk, entry.updated_chunk) == (0, 5)
    # the old text is free again, the new one is taken
    assert store.insert("semantic", "b", 6).ok
    assert store.insert("semantic", "B", 6).reason is FailureReason.DUPLICATE


def test_update_to_another_entrys_content_is_a_duplicate(store):
    store.insert("semantic", "a", 0)
    store.insert("semantic", "b", 0)
    result = store.update("semantic", "sem-2", " a ", 1)
    assert result.reason is FailureReason.DUPLICATE and store.get("semantic", "sem-2").content == "b"


def test_update_with_same_content_is_a_no_op(store):
    store.insert("semantic", "a", 0)
    calls = []
    store.add_listener(lambda *args: calls.append(args))
    result = store.update("semantic", "sem-1", "a", 3)
    assert result.ok and "unchanged" in result.message and calls == []
    assert store.get("semantic", "sem-1").updated_chunk == 0


def test_update_list_entry_requires_an_id(store):
    assert store.update("semantic", None, "x", 0).reason is FailureReason.BAD_ARGUMENTS


def test_delete_returns_previous_content(store):
    store.insert("semantic", "old fact", 0)
    result = store.delete("semantic", "sem-1", 2)
    assert result.ok and result.previous_content == "old fact" and store.entries("semantic") == []


def test_newest_entries(store):
    for i in range(5):
        store.insert("semantic", f"fact {i}", i)
    assert [e.id for e in store.newest("semantic", 2)] == ["sem-5", "sem-4"]
    assert store.newest("semantic", 0) == []


# ---- core paragraph ------------------------------------------------------------------------------


def test_core_rewrite_replaces_paragraph(store):
    assert store.update("core", None, "Alice is a teacher.", 0).ok
    result = store.update("core", "ignored", "Alice is a retired teacher.", 1)
    assert result.ok and result.previous_content == "Alice is a teacher."
    assert store.paragraph("core") == "Alice is a retired teacher."


def test_core_is_cut_at_a_word_boundary():
    store = MemoryStore(get_schema("memalpha", core_max_tokens=16))
    words = [f"word{i}" for i in range(40)]
    result = store.update("core", None, " ".join(words), 0)
    assert result.ok and result.truncated and "16-token cap" in result.message
    assert store.paragraph("core") == " ".join(words[:16])
    assert result.content == store.paragraph("core")


def test_core_cap_uses_the_stores_counter():
    def chars(text: str) -> int:  # a counter unlike the regex one: one token per 4 characters
        return (len(text) + 3) // 4

    store = MemoryStore(get_schema("memalpha", core_max_tokens=16), count_tokens=chars)
    result = store.update("core", None, "abcdefgh " * 20, 0)
    assert result.truncated and chars(store.paragraph("core")) <= 16
    assert store.paragraph("core").endswith("abcdefgh")  # whole words only


def test_truncate_to_tokens_edge_cases():
    assert truncate_to_tokens("short text", 5, regex_token_count) == ("short text", False)
    cut, truncated = truncate_to_tokens("x" * 100, 3, lambda t: len(t))
    assert truncated and cut == "xxx"


# ---- counts, listeners, copies ---------------------------------------------------------------------


def test_token_count_is_kept_incrementally(store):
    store.update("core", None, "Alice, a teacher.", 0)
    store.insert("semantic", "Alice likes tea.", 0)
    store.insert("episodic", "Alice met Bob.", 1)
    store.update("semantic", "sem-1", "Alice likes green tea very much.", 2)
    store.delete("episodic", "epi-2", 3)
    assert store.token_count() == recount(store) == 5 + 7


def test_listeners_hear_successful_list_edits_only(store):
    events = []
    store.add_listener(lambda event, section, entry: events.append((event, section, entry.id, entry.content)))
    store.insert("semantic", "a", 0)
    store.insert("semantic", "a", 0)  # duplicate: no event
    store.update("semantic", "sem-1", "b", 1)
    store.update("core", None, "core text", 1)  # paragraphs are not announced
    store.delete("semantic", "sem-1", 2)
    store.delete("semantic", "sem-1", 2)  # unknown: no event
    assert events == [("insert", "semantic", "sem-1", "a"), ("update", "semantic", "sem-1", "b"), ("delete", "semantic", "sem-1", "b")]


def test_copy_is_independent_and_has_no_listeners(store):
    events = []
    store.add_listener(lambda *args: events.append(args))
    store.insert("semantic", "a", 0)
    clone = store.copy()
    clone.insert("semantic", "b", 1)
    clone.update("core", None, "c", 1)
    assert len(events) == 1
    assert store.entry_count() == 1 and store.paragraph("core") == ""
    assert clone.entry_count() == 2 and clone.token_count() == recount(clone)
    assert store.insert("semantic", "b", 1).entry_id == clone.get("semantic", "sem-2").id  # same counter state


def test_snapshots_are_read_only(store):
    store.insert("semantic", "a", 0)
    store.lists["semantic"].clear()
    assert store.entry_count() == 1
    with pytest.raises(TypeError):
        store.paragraphs["core"] = "x"  # type: ignore[index]


# ---- JSON ----------------------------------------------------------------------------------------


def test_json_round_trip_is_lossless(store):
    store.update("core", None, "Alice — «unicode» ok", 0)
    store.insert("semantic", "a", 0)
    store.insert("episodic", "b", 1)
    store.update("semantic", "sem-1", "A", 2)
    store.delete("episodic", "epi-2", 3)
    text = store.to_json()
    restored = MemoryStore.from_json(text)
    assert restored.to_json() == text
    assert restored.next_id == 3 and restored.token_count() == store.token_count()
    assert restored.get("semantic", "sem-1").updated_chunk == 2


def test_json_keeps_schema_name_and_caps():
    store = MemoryStore(get_schema("persona", core_max_tokens=32))
    store.insert("values", "Honesty matters most.", 0)
    restored = MemoryStore.from_json(store.to_json())
    assert restored.schema == store.schema and restored.schema.section("core").max_tokens == 32
    assert restored.get("values", "val-1").content == "Honesty matters most."


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(next_id=1), "id"),
        (lambda d: d["lists"]["semantic"].append(dict(d["lists"]["semantic"][0])), "sem-1"),
        (lambda d: d["lists"]["semantic"][0].pop("content"), "memory.lists.semantic[0]"),
        (lambda d: d["lists"].pop("episodic"), "memory.lists"),
        (lambda d: d.update(version=9), "memory.version"),
        (lambda d: d["schema"]["sections"][0].pop("kind"), "schema.sections[0]"),
    ],
)
def test_bad_json_is_rejected_naming_the_field(store, mutate, field):
    store.insert("semantic", "a", 0)
    data = json.loads(store.to_json())
    mutate(data)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        MemoryStore.from_json(json.dumps(data))


def test_invalid_json_text_is_a_value_error():
    with pytest.raises(ValueError, match="memory JSON is invalid"):
        MemoryStore.from_json("{not json")


# ---- persona layout through the same store ---------------------------------------------------------


def test_persona_store_uses_section_prefixes():
    store = MemoryStore(PERSONA_SCHEMA)
    ids = [store.insert(name, f"fact about {name}", 0).entry_id for name in PERSONA_LISTS]
    assert [i.split("-")[0] for i in ids] == ["sen", "cul", "cog", "val", "phy", "res", "soc", "spa", "psy"]
    assert len(set(ids)) == 9 and store.entry_count() == 9
    assert store.insert("semantic", "x", 0).reason is FailureReason.WRONG_MEMORY_TYPE
    assert store.delete("values", "val-4", 1).ok and store.update("core", None, "Persona core", 1).ok




