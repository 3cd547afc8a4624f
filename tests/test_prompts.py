"""Writer, reader and judge prompts: rendering, content and length."""

from __future__ import annotations

import pytest

from memalpha.config import RetrievalConfig
from memalpha.env.parsing import parse_tool_calls
from memalpha.env.prompts import (
    judge_messages,
    reader_messages,
    render_reader_prompt,
    render_writer_prompt,
    writer_messages,
    writer_system_prompt,
)
from memalpha.env.tools import execute_text
from memalpha.memory.schema import MEMALPHA_SCHEMA, PERSONA_SCHEMA, get_schema
from memalpha.memory.store import MemoryStore
from memalpha.memory.views import writer_view
from memalpha.models.loading import build_tiny
from memalpha.retrieval import MemoryIndex


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny()[1]


def test_system_prompt_examples_parse_and_use_only_placeholders():
    prompt = writer_system_prompt(get_schema("memalpha"))
    argument, update_text = "memory_id", "new_content"
    example_lines = [line for line in prompt.splitlines() if line.startswith("{")]
    assert len(example_lines) == 3 and all(line.startswith('{"name"') for line in example_lines)
    parsed = parse_tool_calls("\n".join(example_lines))
    assert [c.name for c in parsed.calls] == ["memory_insert", "memory_update", "memory_delete"]
    # the tool argument names are the executed ones
    assert set(parsed.calls[1].arguments) == {"memory_type", update_text, argument}
    assert set(parsed.calls[2].arguments) == {"memory_type", argument}
    # abstract placeholders only: copying them into memory fails the store's checks or the judge's
    contents = [v for c in parsed.calls for k, v in c.arguments.items() if k in ("content", "new_content", argument)]
    assert all(v.startswith("<") and v.endswith(">") for v in contents)
    assert "NOTHING_TO_STORE" in prompt
    for section in MEMALPHA_SCHEMA.names:
        assert f"- {section} (" in prompt


def test_writer_prompt_is_short(tokenizer):
    from memalpha.tokens import tokenizer_counter

    count = tokenizer_counter(tokenizer)
    assert count(writer_system_prompt(MEMALPHA_SCHEMA)) < 300
    assert count(writer_system_prompt(PERSONA_SCHEMA)) < 500


def test_render_writer_prompt_shows_memory_view_and_chunk(tokenizer):
    store = MemoryStore(MEMALPHA_SCHEMA)
    index = MemoryIndex(store, RetrievalConfig())
    execute_text(store, '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "Maya owns a cat named Mochi."}}', 0)
    chunk = "The following is a conversation. Please remember it.\n\nMaya: Mochi learned a new trick."
    view = writer_view(store, chunk, index.search)
    prompt = render_writer_prompt(tokenizer, MEMALPHA_SCHEMA, view, chunk)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "- sem-1: Maya owns a cat named Mochi." in prompt
    assert prompt.index("Memory:") < prompt.index("New chunk:") < prompt.index("Mochi learned")
    # the same rendering as the plain messages through the chat template
    messages = writer_messages(MEMALPHA_SCHEMA, "[core]\n(empty)\n\n[semantic]\n- sem-1: Maya owns a cat named Mochi.", chunk)
    assert prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_writer_view_budget_bounds_the_prompt(tokenizer):
    from memalpha.tokens import tokenizer_counter

    count = tokenizer_counter(tokenizer)
    store = MemoryStore(MEMALPHA_SCHEMA, count)
    for i in range(200):
        store.insert("semantic", f"Fact number {i} about the garden and the harbour.", 0)
    small = render_writer_prompt(tokenizer, MEMALPHA_SCHEMA, writer_view(store, "x", budget_tokens=128), "x")
    large = render_writer_prompt(tokenizer, MEMALPHA_SCHEMA, writer_view(store, "x", budget_tokens=1024, newest=50), "x")
    system = count(writer_system_prompt(MEMALPHA_SCHEMA))
    assert count(small) <= system + 128 + 40
    assert count(small) < count(large)


def test_reader_prompt_asks_for_box_only_for_labels(tokenizer):
    plain = reader_messages("[core]\nMaya is a nurse.", "What is Maya's job?")
    boxed = reader_messages("[core]\nMaya is a nurse.", "Which label?", boxed=True)
    assert "\\boxed" not in plain[0]["content"] and "\\boxed{<label>}" in boxed[0]["content"]
    assert "Maya is a nurse." in plain[1]["content"] and plain[1]["content"].endswith("Question: What is Maya's job?")
    rendered = render_reader_prompt(tokenizer, "ctx", "q?")
    assert rendered.endswith("<|im_start|>assistant\n")


def test_judge_prompt_names_type_and_content():
    (system, user) = judge_messages("episodic", "Events with their time.", "Maya ran a race.", "chunk text")
    assert "VALID" in system["content"] and "INVALID" in system["content"]
    text = user["content"]
    assert "episodic (Events with their time.)" in text and "Maya ran a race." in text and "chunk text" in text
