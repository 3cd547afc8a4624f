"""Raw model text -> tool calls, for every accepted format and for broken or empty output."""

import json

import pytest

from memalpha.env.parsing import NO_CALL_ERROR, NOTHING_TO_STORE, parse_tool_calls

INSERT = {"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "Alice likes tea"}}
DELETE = {"name": "memory_delete", "arguments": {"memory_type": "episodic", "memory_id": "epi-2"}}


def simple(result):
    return [(c.name, c.arguments) for c in result.calls]


def test_hermes_tool_call_blocks():
    text = f"<tool_call>\n{json.dumps(INSERT)}\n</tool_call>\n<tool_call>{json.dumps(DELETE)}</tool_call>"
    result = parse_tool_calls(text)
    assert simple(result) == [(INSERT["name"], INSERT["arguments"]), (DELETE["name"], DELETE["arguments"])]
    assert result.format == "hermes" and result.errors == [] and not result.nothing_to_store
    assert result.calls[0].raw.startswith("{")


def test_hermes_arguments_as_json_string_and_missing_closing_tag():
    call = {"name": "memory_insert", "arguments": json.dumps(INSERT["arguments"])}
    result = parse_tool_calls(f"<tool_call>{json.dumps(call)}")
    assert simple(result) == [("memory_insert", INSERT["arguments"])]


def test_hermes_block_holding_an_array():
    result = parse_tool_calls(f"<tool_call>[{json.dumps(INSERT)}, {json.dumps(DELETE)}]</tool_call>")
    assert [c.name for c in result.calls] == ["memory_insert", "memory_delete"]


def test_hermes_block_without_json_is_an_error():
    result = parse_tool_calls("<tool_call>memory_insert semantic tea</tool_call>")
    assert result.calls == [] and len(result.errors) == 1 and "<tool_call>" in result.errors[0]


def test_json_lines():
    text = "\n".join(json.dumps(c) for c in (INSERT, DELETE))
    result = parse_tool_calls(text)
    assert simple(result) == [(INSERT["name"], INSERT["arguments"]), (DELETE["name"], DELETE["arguments"])]
    assert result.format == "json"


def test_json_array_and_single_object():
    assert [c.name for c in parse_tool_calls(json.dumps([INSERT, DELETE])).calls] == ["memory_insert", "memory_delete"]
    assert simple(parse_tool_calls(json.dumps(INSERT))) == [(INSERT["name"], INSERT["arguments"])]


def test_code_fence_with_surrounding_prose():
    text = f"Here are my calls:\n```json\n{json.dumps(INSERT, indent=2)}\n```\nDone."
    result = parse_tool_calls(text)
    assert simple(result) == [(INSERT["name"], INSERT["arguments"])] and result.format == "code_fence"


def test_function_markers():
    text = (
        "✿FUNCTION✿: memory_insert\n✿ARGS✿: " + json.dumps(INSERT["arguments"]) + "\n"
        "✿RESULT✿: ok\n✿FUNCTION✿: memory_delete\n✿ARGS✿: " + json.dumps(DELETE["arguments"])
    )
    result = parse_tool_calls(text)
    assert simple(result) == [(INSERT["name"], INSERT["arguments"]), (DELETE["name"], DELETE["arguments"])]
    assert result.format == "function_marker" and result.errors == []


def test_function_marker_with_broken_args_is_an_error():
    result = parse_tool_calls("✿FUNCTION✿: memory_insert\n✿ARGS✿: memory_type semantic")
    assert result.calls == [] and "not JSON" in result.errors[0]


def test_openai_style_and_tool_calls_wrapper():
    openai = {"id": "call_1", "type": "function", "function": {"name": "memory_insert", "arguments": json.dumps(INSERT["arguments"])}}
    result = parse_tool_calls(json.dumps({"role": "assistant", "tool_calls": [openai]}))
    assert simple(result) == [("memory_insert", INSERT["arguments"])] and "openai" in result.format


def test_parameters_envelope_is_read():
    result = parse_tool_calls(json.dumps({"name": "memory_delete", "parameters": DELETE["arguments"]}))
    assert simple(result) == [("memory_delete", DELETE["arguments"])]


@pytest.mark.parametrize(
    "text",
    [
        # trailing comma, single quotes, missing closing brace
        '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "Alice likes tea",}}',
        "{'name': 'memory_insert', 'arguments': {'memory_type': 'semantic', 'content': 'Alice likes tea'}}",
        '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "Alice likes tea"}',
        '<tool_call>{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "Alice likes tea"</tool_call>',
    ],
)
def test_small_json_defects_are_repaired(text):
    result = parse_tool_calls(text)
    assert simple(result) == [("memory_insert", INSERT["arguments"])] and result.errors == []


def test_a_broken_line_does_not_swallow_the_next_one():
    broken = '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "one"}'
    text = broken + "\n" + json.dumps(DELETE)
    result = parse_tool_calls(text)
    assert [c.name for c in result.calls] == ["memory_insert", "memory_delete"]
    assert result.calls[0].arguments["content"] == "one"


@pytest.mark.parametrize("text", ["", "   \n", "I will remember that Alice likes tea.", "call memory_insert(semantic, tea)", "a {b} c"])
def test_prose_and_empty_output_yield_no_call_and_one_error(text):
    result = parse_tool_calls(text)
    assert result.calls == [] and result.errors == [NO_CALL_ERROR]
    assert not result.nothing_to_store and result.format == "none"


def test_json_that_is_not_a_call_is_an_error():
    result = parse_tool_calls('Memory: {"memory_type": "semantic", "content": "tea"}')
    assert result.calls == [] and len(result.errors) == 1 and "no 'name'" in result.errors[0]


def test_nothing_to_store_marker():
    for text in (NOTHING_TO_STORE, f"This chunk is small talk.\n{NOTHING_TO_STORE}", f"`{NOTHING_TO_STORE}`."):
        result = parse_tool_calls(text)
        assert result.nothing_to_store and result.calls == [] and result.errors == []
        assert result.format == "nothing_to_store"


def test_marker_must_be_the_exact_token():
    assert not parse_tool_calls("nothing_to_store").nothing_to_store
    assert not parse_tool_calls("NOTHING_TO_STORED").nothing_to_store


def test_marker_with_calls_is_ignored():
    result = parse_tool_calls(f"{json.dumps(INSERT)}\n{NOTHING_TO_STORE}")
    assert not result.nothing_to_store and len(result.calls) == 1


def test_mixed_good_and_bad_fragments_keep_order_and_errors():
    text = f'{json.dumps(INSERT)}\n{{"oops": 1}}\n<tool_call>{json.dumps(DELETE)}</tool_call>'
    result = parse_tool_calls(text)
    assert [c.name for c in result.calls] == ["memory_insert", "memory_delete"]
    assert len(result.errors) == 1 and set(result.format.split("+")) == {"hermes", "json"}


def test_non_object_arguments_are_an_error():
    result = parse_tool_calls('{"name": "memory_insert", "arguments": ["semantic", "tea"]}')
    assert result.calls == [] and "not a JSON object" in result.errors[0]


def test_deeply_nested_input_does_not_raise():
    result = parse_tool_calls("[{" + '"a":[' * 5000)
    assert result.calls == []


def test_a_lone_surrogate_in_a_call_is_escaped_and_the_call_still_parses():
    from memalpha.env.parsing import parse_tool_calls

    result = parse_tool_calls('{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "likes \\ud83d tea"}}')
    (call,) = result.calls
    assert call.arguments["content"] == "likes \\ud83d tea"
    call.arguments["content"].encode("utf-8")
