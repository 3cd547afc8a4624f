"""Tool definitions and execution: every outcome of every tool, and text-to-results."""

import json

import pytest

from memalpha.memory import MEMALPHA_SCHEMA, PERSONA_SCHEMA, MemoryStore, get_schema
from memalpha.parsing import NOTHING_TO_STORE
from memalpha.rewards import is_entry_update, rule_judge
from memalpha.tools import (TOOL_NAMES, TOOL_SCHEMAS, FailureReason, ToolCall, call_line, execute_calls, execute_text,
                            tool_schemas)


def call(name, **arguments):
    return ToolCall(name, arguments)


@pytest.fixture
def store():
    return MemoryStore(MEMALPHA_SCHEMA)


def run(store, *calls, chunk=0):
    return execute_calls(store, list(calls), chunk)


# ---- definitions ---------------------------------------------------------------------------------


def test_tool_schemas_are_openai_functions_with_schema_enums():
    by_name = {t["function"]["name"]: t["function"] for t in TOOL_SCHEMAS}
    assert tuple(by_name) == TOOL_NAMES and all(t["type"] == "function" for t in TOOL_SCHEMAS)
    insert = by_name["memory_insert"]["parameters"]
    assert insert["required"] == ["memory_type", "content"] and insert["additionalProperties"] is False
    assert insert["properties"]["memory_type"]["enum"] == ["semantic", "episodic"]
    update = by_name["memory_update"]["parameters"]
    assert update["properties"]["memory_type"]["enum"] == ["core", "semantic", "episodic"]
    assert "memory_id" not in update["required"]
    assert by_name["memory_delete"]["parameters"]["required"] == ["memory_type", "memory_id"]
    json.dumps(TOOL_SCHEMAS)  # serialisable for chat templates


def test_persona_tool_schemas():
    insert = tool_schemas(PERSONA_SCHEMA)[0]["function"]["parameters"]["properties"]["memory_type"]
    assert len(insert["enum"]) == 9 and "values" in insert["enum"] and "core" not in insert["enum"]
    assert "sen-3" in tool_schemas(PERSONA_SCHEMA)[2]["function"]["parameters"]["properties"]["memory_id"]["description"]


# ---- successes -----------------------------------------------------------------------------------


def test_insert_update_delete_success_report_what_was_written(store):
    inserted, updated, deleted = run(
        store,
        call("memory_insert", memory_type="semantic", content="Alice likes tea"),
        call("memory_update", memory_type="semantic", memory_id="sem-1", new_content="Alice likes green tea"),
        call("memory_delete", memory_type="semantic", memory_id="sem-1"),
    )
    assert inserted.ok and inserted.reason is None and inserted.entry_id == "sem-1"
    assert (inserted.memory_type, inserted.content, inserted.previous_content) == ("semantic", "Alice likes tea", None)
    assert updated.ok and (updated.content, updated.previous_content) == ("Alice likes green tea", "Alice likes tea")
    assert deleted.ok and deleted.previous_content == "Alice likes green tea" and store.entry_count() == 0
    assert inserted.name == "memory_insert" and inserted.to_dict()["reason"] is None


def test_core_update_replaces_paragraph_without_id(store):
    first, second = run(
        store,
        call("memory_update", memory_type="core", new_content="Alice is a teacher."),
        call("memory_update", memory_type="core", memory_id=None, new_content="Alice is a retired teacher."),
    )
    assert first.ok and second.ok and second.previous_content == "Alice is a teacher."
    assert store.paragraph("core") == "Alice is a retired teacher."


def test_core_truncation_is_reported():
    store = MemoryStore(get_schema("memalpha", core_max_tokens=16))
    (result,) = run(store, call("memory_update", memory_type="core", new_content=" ".join(["word"] * 50)))
    assert result.ok and result.truncated and "cut" in result.message
    assert result.content == " ".join(["word"] * 16) == store.paragraph("core")


# ---- every failure reason ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("the_call", "reason", "named"),
    [
        (call("memory_search", query="tea"), FailureReason.UNKNOWN_TOOL, "memory_search"),
        (call("memory_insert", memory_type="semantic"), FailureReason.BAD_ARGUMENTS, "content"),
        (call("memory_insert", content="x"), FailureReason.BAD_ARGUMENTS, "memory_type"),
        (call("memory_insert", memory_type="semantic", text="x"), FailureReason.BAD_ARGUMENTS, "text"),
        (call("memory_insert", memory_type="semantic", content="x", memory_id="sem-1"), FailureReason.BAD_ARGUMENTS, "memory_id"),
        (call("memory_insert", memory_type=["semantic"], content="x"), FailureReason.BAD_ARGUMENTS, "memory_type"),
        (call("memory_insert", memory_type="semantic", content=42), FailureReason.BAD_ARGUMENTS, "content"),
        (call("memory_update", memory_type="semantic", new_content="x"), FailureReason.BAD_ARGUMENTS, "memory_id"),
        (call("memory_update", memory_type="semantic", memory_id=1, new_content="x"), FailureReason.BAD_ARGUMENTS, "memory_id"),
        (call("memory_update", memory_type="semantic", memory_id="sem-1", content="x"), FailureReason.BAD_ARGUMENTS, "content"),
        (call("memory_delete", memory_type="semantic"), FailureReason.BAD_ARGUMENTS, "memory_id"),
        (call("memory_update", memory_type="semantic", memory_id="sem-9", new_content="x"), FailureReason.UNKNOWN_ID, "sem-9"),
        (call("memory_delete", memory_type="episodic", memory_id="sem-1"), FailureReason.UNKNOWN_ID, "semantic"),
        (call("memory_insert", memory_type="semantic", content="Alice likes tea"), FailureReason.DUPLICATE, "sem-1"),
        (call("memory_insert", memory_type="semantic", content="  "), FailureReason.EMPTY_CONTENT, "empty"),
        (call("memory_update", memory_type="core", new_content=""), FailureReason.EMPTY_CONTENT, "empty"),
        (call("memory_insert", memory_type="core", content="x"), FailureReason.WRONG_MEMORY_TYPE, "memory_update"),
        (call("memory_delete", memory_type="core", memory_id="core"), FailureReason.WRONG_MEMORY_TYPE, "core"),
        (call("memory_insert", memory_type="procedural", content="x"), FailureReason.WRONG_MEMORY_TYPE, "procedural"),
    ],
)
def test_failures_leave_memory_unchanged(store, the_call, reason, named):
    run(store, call("memory_insert", memory_type="semantic", content="Alice likes tea"))
    before = store.to_json()
    (result,) = run(store, the_call, chunk=1)
    assert not result.ok and result.reason is reason and named in result.message
    assert store.to_json() == before


def test_non_dict_arguments_are_bad_arguments(store):
    (result,) = run(store, ToolCall("memory_insert", ["semantic", "x"]))  # type: ignore[arg-type]
    assert result.reason is FailureReason.BAD_ARGUMENTS


def test_failure_reason_values():
    assert {r.value for r in FailureReason} == {
        "unparseable", "unknown_tool", "bad_arguments", "unknown_id", "ambiguous", "duplicate", "empty_content", "wrong_memory_type",
    }


# ---- execute_text --------------------------------------------------------------------------------


def test_execute_text_runs_parsed_calls_with_chunk(store):
    text = "\n".join(
        json.dumps(c)
        for c in (
            {"name": "memory_insert", "arguments": {"memory_type": "episodic", "content": "Met Bob on Monday"}},
            {"name": "memory_update", "arguments": {"memory_type": "core", "new_content": "Alice, teacher"}},
        )
    )
    parsed, results = execute_text(store, text, chunk=4)
    assert len(parsed.calls) == 2 and [r.ok for r in results] == [True, True]
    assert store.get("episodic", "epi-1").created_chunk == 4


def test_unparseable_output_is_one_failed_call(store):
    parsed, results = execute_text(store, "I'll remember Alice likes tea.", chunk=0)
    assert parsed.calls == [] and len(results) == 1
    assert results[0].reason is FailureReason.UNPARSEABLE and results[0].call is None and not results[0].ok
    assert store.entry_count() == 0


def test_empty_output_is_one_failed_call(store):
    _, results = execute_text(store, "", chunk=0)
    assert [r.reason for r in results] == [FailureReason.UNPARSEABLE]


def test_nothing_to_store_yields_no_results(store):
    parsed, results = execute_text(store, NOTHING_TO_STORE, chunk=0)
    assert parsed.nothing_to_store and results == []


def test_broken_fragment_counts_as_a_failure_beside_good_calls(store):
    text = '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "a"}}\n{"content": "b"}'
    _, results = execute_text(store, text, chunk=0)
    assert [(r.ok, r.reason) for r in results] == [(True, None), (False, FailureReason.UNPARSEABLE)]


def test_repaired_json_executes(store):
    _, results = execute_text(store, "{'name': 'memory_insert', 'arguments': {'memory_type': 'semantic', 'content': 'tea',}}", 0)
    assert [r.ok for r in results] == [True] and store.get("semantic", "sem-1").content == "tea"


# ---- entries named by their text (entry_address "text") ------------------------------------------


def test_text_addressed_update_and_delete_name_the_entry_by_its_words():
    store = MemoryStore(get_schema("memalpha", entry_address="text"))
    inserted, _, updated, deleted = run(
        store,
        call("memory_insert", memory_type="semantic", content="Ulla works as a pastry chef."),
        call("memory_insert", memory_type="semantic", content="Ulla lives in Turku."),
        call("memory_update", memory_type="semantic", old_content="pastry chef", new_content="Ulla works as a florist."),
        call("memory_delete", memory_type="semantic", old_content="Turku"),
    )
    assert updated.ok and updated.entry_id == inserted.entry_id and updated.previous_content == "Ulla works as a pastry chef."
    assert deleted.ok and deleted.previous_content == "Ulla lives in Turku."
    assert [e.content for e in store.entries("semantic")] == ["Ulla works as a florist."]


def test_text_addressing_rejects_ids_and_unmatched_words_and_leaves_the_memory_unchanged():
    store = MemoryStore(get_schema("memalpha", entry_address="text"))
    run(store, call("memory_insert", memory_type="semantic", content="Ulla lives in Turku."),
        call("memory_insert", memory_type="semantic", content="Gwen lives in Porto."))
    before = store.to_json()
    by_id, unmatched, ambiguous, missing = run(
        store,
        call("memory_update", memory_type="semantic", memory_id="sem-1", new_content="Ulla lives in Oslo."),
        call("memory_delete", memory_type="semantic", old_content="Oslo"),
        call("memory_delete", memory_type="semantic", old_content="lives in"),
        call("memory_delete", memory_type="semantic"),
    )
    assert by_id.reason == FailureReason.BAD_ARGUMENTS and "'memory_id'" in by_id.message and "old_content" in by_id.message
    assert unmatched.reason == FailureReason.UNKNOWN_ID and ambiguous.reason == FailureReason.AMBIGUOUS
    assert missing.reason == FailureReason.BAD_ARGUMENTS and "'old_content'" in missing.message
    assert store.to_json() == before
    core = run(store, call("memory_update", memory_type="core", new_content="Ulla and Gwen talk."))[0]
    assert core.ok  # a paragraph is rewritten whole, without old_content


def test_a_text_addressed_update_that_names_no_single_entry_inserts_its_new_content():
    store = MemoryStore(get_schema("memalpha", entry_address="text"))
    run(store, call("memory_insert", memory_type="semantic", content="Ulla lives in Turku."),
        call("memory_insert", memory_type="semantic", content="Gwen lives in Porto."))
    unmatched, ambiguous, repeated = run(
        store,
        call("memory_update", memory_type="semantic", old_content="Oslo", new_content="Ulla moved to Oslo."),
        call("memory_update", memory_type="semantic", old_content="lives in", new_content="Gwen lives in Braga."),
        call("memory_update", memory_type="semantic", old_content="Bergen", new_content="Ulla moved to Oslo."),
    )
    assert unmatched.ok and "no entry of semantic contains 'Oslo'" in unmatched.message and "inserted sem-3" in unmatched.message
    assert ambiguous.ok and ambiguous.entry_id == "sem-4" and ambiguous.previous_content is None
    assert repeated.reason == FailureReason.DUPLICATE  # the insert's own checks still apply
    assert [e.content for e in store.entries("semantic")] == [
        "Ulla lives in Turku.", "Gwen lives in Porto.", "Ulla moved to Oslo.", "Gwen lives in Braga."]
    assert not is_entry_update(unmatched) and rule_judge(unmatched)  # judged as the insert it was, not a misaimed update


def test_text_addressed_tool_schemas_ask_for_old_content():
    by_name = {t["function"]["name"]: t["function"] for t in tool_schemas(get_schema("memalpha", entry_address="text"))}
    update = by_name["memory_update"]["parameters"]
    assert "old_content" in update["properties"] and "memory_id" not in update["properties"]
    assert by_name["memory_delete"]["parameters"]["required"] == ["memory_type", "old_content"]


# ---- updates that name no entry (entry_address "subject") ----------------------------------------


def subject_store():
    store = MemoryStore(get_schema("memalpha", entry_address="subject"))
    run(store,
        call("memory_insert", memory_type="semantic", content="Gwen lives in Porto these days."),
        call("memory_insert", memory_type="semantic", content="Umar lives in Porto too."),
        call("memory_insert", memory_type="semantic", content="The gate code at Umar's building is 1450."),
        call("memory_insert", memory_type="semantic", content="Nico said that New gate code: 9901 (the old 9595 stopped working)."))
    return store


def test_a_subject_update_replaces_the_entry_about_the_same_person_and_subject():
    store = subject_store()
    moved, code = run(
        store,
        call("memory_update", memory_type="semantic", new_content="Gwen doesn't live in Porto anymore, Gwen lives in Braga now."),
        # Nico's entry shares more words ("new", "gate", "code", "old"...) but is not about Umar
        call("memory_update", memory_type="semantic", new_content="Umar said that they changed the gate code from 1450 to 5384."),
    )
    assert moved.ok and moved.entry_id == "sem-1" and moved.previous_content == "Gwen lives in Porto these days."
    assert code.ok and code.entry_id == "sem-3" and code.previous_content == "The gate code at Umar's building is 1450."
    assert [e.content for e in store.entries("semantic")][1] == "Umar lives in Porto too."
    assert is_entry_update(moved) and rule_judge(moved)


def test_a_subject_update_about_nothing_stored_is_inserted_and_names_are_rejected():
    store = subject_store()
    before = store.to_json()
    by_id, by_words = run(
        store,
        call("memory_update", memory_type="semantic", memory_id="sem-1", new_content="Gwen lives in Braga."),
        call("memory_update", memory_type="semantic", old_content="Porto", new_content="Gwen lives in Braga."),
    )
    assert by_id.reason == by_words.reason == FailureReason.BAD_ARGUMENTS and "unexpected argument" in by_id.message
    assert store.to_json() == before
    new_person, same_person_other_subject = run(
        store,
        call("memory_update", memory_type="semantic", new_content="Ulla works as a florist."),
        call("memory_update", memory_type="semantic", new_content="Gwen plays the oboe."),  # shares only "Gwen"
    )
    assert new_person.ok and new_person.previous_content is None and "no entry of semantic names" in new_person.message
    assert same_person_other_subject.ok and same_person_other_subject.entry_id == "sem-6"
    assert len(store.entries("semantic")) == 6 and not is_entry_update(new_person)
    deleted, core = run(store, call("memory_delete", memory_type="semantic", old_content="Braga"),
                        call("memory_update", memory_type="core", new_content="Gwen and Umar talk."))
    assert deleted.reason == FailureReason.UNKNOWN_ID and core.ok  # deletes name entries by their words


def test_subject_addressed_tool_schemas_update_without_naming_an_entry():
    by_name = {t["function"]["name"]: t["function"] for t in tool_schemas(get_schema("memalpha", entry_address="subject"))}
    update = by_name["memory_update"]["parameters"]
    assert set(update["properties"]) == {"memory_type", "new_content"} and update["required"] == ["memory_type", "new_content"]
    assert by_name["memory_delete"]["parameters"]["required"] == ["memory_type", "old_content"]


def test_statement_first_updates_write_content_and_lines_put_the_name_last():
    schema = get_schema("memalpha", entry_address="subject", call_order="statement_first")
    update = {t["function"]["name"]: t["function"] for t in tool_schemas(schema)}["memory_update"]["parameters"]
    assert set(update["properties"]) == {"memory_type", "content"} and update["required"] == ["memory_type", "content"]
    line = call_line(schema, "memory_update", {"memory_type": "semantic", "content": "Gwen lives in Braga."})
    assert line == '{"arguments": {"memory_type": "semantic", "content": "Gwen lives in Braga."}, "name": "memory_update"}'
    store = MemoryStore(schema)
    text = "\n".join([
        call_line(schema, "memory_insert", {"memory_type": "semantic", "content": "Gwen lives in Porto these days."}),
        line,
        call_line(schema, "memory_update", {"memory_type": "core", "content": "Gwen talks to Umar."}),
    ])
    _, (inserted, moved, core) = execute_text(store, text, 0)
    assert inserted.ok and moved.ok and core.ok
    assert moved.entry_id == inserted.entry_id and moved.previous_content == "Gwen lives in Porto these days."
    before = store.to_json()
    (old_spelling,) = run(store, call("memory_update", memory_type="semantic", new_content="Gwen lives in Faro."))
    assert old_spelling.reason == FailureReason.BAD_ARGUMENTS and "new_content" in old_spelling.message
    assert store.to_json() == before
