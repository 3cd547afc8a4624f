"""Tool definitions and execution: every outcome of every tool, and text-to-results."""

import json

import pytest

from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.env.tools import (
    TOOL_NAMES,
    TOOL_SCHEMAS,
    FailureReason,
    ToolCall,
    execute_calls,
    execute_text,
    tool_schemas,
)
from memalpha.memory import MEMALPHA_SCHEMA, PERSONA_SCHEMA, MemoryStore, get_schema


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
        "unparseable", "unknown_tool", "bad_arguments", "unknown_id", "duplicate", "empty_content", "wrong_memory_type",
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


