"""The writer's three memory tools: definitions (OpenAI tool format), calls, results and execution.

Only `memory_insert`, `memory_update` and `memory_delete` are ever executed. An update or delete names its
list entry by `memory_id` or by `old_content`, as the memory schema's `entry_address` says; under `subject`
an update names none and replaces the entry its new content is about (`MemoryStore.find_by_subject`). An
update that finds no single entry by words or subject adds its new content instead (Mem0's ADD). Arguments are checked
strictly against the definitions (no aliases): a missing, unexpected or mistyped argument is a failed
call (BAD_ARGUMENTS) whose message names the argument. Every failure leaves the memory unchanged.
An update's new text is `new_content`, or `content` (as an insert's) when the schema's `call_order` is
`statement_first`; `call_line` spells a call in that order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from memalpha.memory.schema import MEMALPHA_SCHEMA, MemorySchema
from memalpha.memory.store import FailureReason, MemoryStore, OpResult
from memalpha.parsing import ParseResult, ToolCall, parse_tool_calls

__all__ = [
    "ADDRESS_ARGUMENT",
    "TOOL_NAMES",
    "TOOL_SCHEMAS",
    "FailureReason",
    "ToolCall",
    "ToolResult",
    "call_line",
    "execute_call",
    "execute_calls",
    "execute_text",
    "text_argument",
    "tool_schemas",
    "updates_by_subject",
]

TOOL_NAMES = ("memory_insert", "memory_update", "memory_delete")

ADDRESS_ARGUMENT = {"id": "memory_id", "text": "old_content", "subject": "old_content"}
"""The argument naming the list entry to delete, and to update unless `MemorySchema.entry_address` is `subject`."""


def updates_by_subject(schema: MemorySchema) -> bool:
    """Updates name no entry: each replaces the one its new content is about."""
    return schema.entry_address == "subject"


def text_argument(name: str, schema: MemorySchema) -> str:
    """The argument holding the text that call `name` writes under `schema`."""
    return "new_content" if name == "memory_update" and schema.call_order == "name_first" else "content"


def call_line(schema: MemorySchema, name: str, arguments: dict[str, Any]) -> str:
    """One call as a JSON line, spelt in the schema's `call_order` (the writer prompt's format)."""
    call = {"name": name, "arguments": arguments} if schema.call_order == "name_first" else {"arguments": arguments, "name": name}
    return json.dumps(call, ensure_ascii=False)


def _arguments(name: str, schema: MemorySchema) -> tuple[frozenset[str], tuple[str, ...]] | None:
    """(allowed arguments, arguments that must be present and non-null) of a tool, or None if unknown."""
    address = ADDRESS_ARGUMENT[schema.entry_address]
    if name == "memory_insert":
        return frozenset({"memory_type", "content"}), ("memory_type", "content")
    if name == "memory_update":
        text = text_argument(name, schema)
        allowed = {"memory_type", text} if updates_by_subject(schema) else {"memory_type", address, text}
        return frozenset(allowed), ("memory_type", text)
    if name == "memory_delete":
        return frozenset({"memory_type", address}), ("memory_type", address)
    return None


@dataclass
class ToolResult:
    """Outcome of one call: the call (None for an unparseable output), the store's outcome (`OpResult`:
    ok, reason, message, entry id, and what was written or replaced, so a judge can assess it) and the
    memory section it addressed."""

    call: ToolCall | None
    outcome: OpResult
    memory_type: str | None = None

    @property
    def name(self) -> str | None:
        return self.call.name if self.call else None

    @property
    def ok(self) -> bool:
        return self.outcome.ok

    @property
    def reason(self) -> FailureReason | None:
        return self.outcome.reason

    @property
    def message(self) -> str:
        return self.outcome.message

    @property
    def entry_id(self) -> str | None:
        return self.outcome.entry_id

    @property
    def truncated(self) -> bool:
        return self.outcome.truncated

    @property
    def content(self) -> str | None:
        return self.outcome.content

    @property
    def previous_content(self) -> str | None:
        return self.outcome.previous_content

    def to_dict(self) -> dict[str, Any]:
        """Plain data for logging."""
        return {
            "name": self.name,
            "arguments": self.call.arguments if self.call else None,
            "ok": self.ok,
            "reason": str(self.reason) if self.reason else None,
            "message": self.message,
            "entry_id": self.entry_id,
            "truncated": self.truncated,
            "memory_type": self.memory_type,
            "content": self.content,
            "previous_content": self.previous_content,
        }


def _describe_sections(schema: MemorySchema, lists_only: bool) -> str:
    specs = schema.list_sections if lists_only else schema.sections
    return "; ".join(f"{s.name}: {s.description}" for s in specs)


def tool_schemas(schema: MemorySchema = MEMALPHA_SCHEMA) -> list[dict[str, Any]]:
    """JSON-schema definitions of the three tools in OpenAI tool format, for `schema`'s sections."""
    list_names = [s.name for s in schema.list_sections]
    paragraph_names = [s.name for s in schema.paragraph_sections]
    example_id = f"{schema.list_sections[0].prefix}-3" if schema.list_sections else "id-3"
    no_address = "" if updates_by_subject(schema) else f"; no {ADDRESS_ARGUMENT[schema.entry_address]}"
    rewrite_note = f" ({', '.join(paragraph_names)} is rewritten as a whole{no_address})" if paragraph_names else ""

    def function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required, "additionalProperties": False},
            },
        }

    list_type = {"type": "string", "enum": list_names, "description": _describe_sections(schema, lists_only=True)}
    any_type = {"type": "string", "enum": list(schema.names), "description": _describe_sections(schema, lists_only=False)}
    address = ADDRESS_ARGUMENT[schema.entry_address]
    if schema.entry_address == "id":
        target = {"type": "string", "description": f"Id of an existing entry, as shown in the memory (e.g. '{example_id}')."}
    else:
        target = {"type": "string", "description": "Words of an existing entry that no other entry of the list contains (or its whole text)."}
    update_text = text_argument("memory_update", schema)
    new_content = {"type": "string", "description": "The complete new text."}
    if updates_by_subject(schema):
        update_description = ("Replace the list entry about the same person and subject as the new content (none: it is "
                              "added), or rewrite a paragraph memory" + rewrite_note + ".")
        update_properties = {"memory_type": any_type, update_text: new_content}
    else:
        update_description = f"Replace the content of an existing list entry, given its {address}, or rewrite a paragraph memory" + rewrite_note + "."
        update_properties = {"memory_type": any_type, address: target, update_text: new_content}
    return [
        function(
            "memory_insert",
            "Add a new entry to a list memory. One self-contained fact or event per entry; never repeat an existing entry.",
            {"memory_type": list_type, "content": {"type": "string", "description": "The text of the new entry."}},
            ["memory_type", "content"],
        ),
        function("memory_update", update_description, update_properties, ["memory_type", update_text]),
        function(
            "memory_delete",
            f"Delete an outdated or wrong entry from a list memory, given its {address}.",
            {"memory_type": list_type, address: target},
            ["memory_type", address],
        ),
    ]


TOOL_SCHEMAS = tool_schemas(MEMALPHA_SCHEMA)
"""Tool definitions for the Mem-alpha layout."""


def _failure(call: ToolCall | None, reason: FailureReason, message: str, memory_type: str | None = None) -> ToolResult:
    return ToolResult(call, OpResult(False, reason, message), memory_type)


_MISSED_UPDATE_REASONS = (FailureReason.UNKNOWN_ID, FailureReason.AMBIGUOUS)
"""Why a text-addressed update finds no single entry; its new content is then inserted."""


def _insert_missed_update(store: MemoryStore, memory_type: str, content: str, chunk: int, miss: OpResult) -> OpResult:
    """Mem0's ADD for an update whose words name no single entry: the writer meant to store the new
    value, so it is kept as a new entry (the result has no `previous_content`, as an insert)."""
    op = store.insert(memory_type, content, chunk)
    return replace(op, message=f"{miss.message}; {op.message}") if op.ok else op


def execute_call(store: MemoryStore, call: ToolCall, chunk: int) -> ToolResult:
    """Validate one call against the tool definitions and apply it to `store`."""
    address = ADDRESS_ARGUMENT[store.schema.entry_address]
    by_subject = updates_by_subject(store.schema)
    spec = _arguments(call.name, store.schema)
    if spec is None:
        return _failure(call, FailureReason.UNKNOWN_TOOL, f"unknown tool {call.name!r} (tools: {', '.join(TOOL_NAMES)})")
    args = call.arguments
    if not isinstance(args, dict):
        return _failure(call, FailureReason.BAD_ARGUMENTS, f"arguments of {call.name} must be a JSON object")
    allowed, required = spec
    for name in args:
        if name not in allowed:
            expected = ", ".join(sorted(allowed))
            return _failure(call, FailureReason.BAD_ARGUMENTS, f"unexpected argument {name!r} for {call.name} (expected: {expected})")
    for name in required:
        if args.get(name) is None:
            return _failure(call, FailureReason.BAD_ARGUMENTS, f"missing argument {name!r} for {call.name}")
    memory_type = args["memory_type"]
    if not isinstance(memory_type, str):
        return _failure(call, FailureReason.BAD_ARGUMENTS, f"argument 'memory_type' must be a string, not {type(memory_type).__name__}")
    memory_type = memory_type.strip()
    content_arg = text_argument(call.name, store.schema)
    if content_arg in args and not isinstance(args[content_arg], str):
        return _failure(call, FailureReason.BAD_ARGUMENTS, f"argument {content_arg!r} must be a string", memory_type)

    section = store.spec(memory_type)
    is_list = section is not None and section.is_list
    memory_id = args.get(address)
    if call.name == "memory_update" and is_list and by_subject:
        entry, error = store.find_by_subject(memory_type, args[content_arg])
        if error:
            return ToolResult(call, _insert_missed_update(store, memory_type, args[content_arg], chunk, error), memory_type)
        memory_id = entry.id
    elif call.name != "memory_insert" and is_list:
        if memory_id is None:
            return _failure(call, FailureReason.BAD_ARGUMENTS, f"missing argument {address!r} for {call.name} on {memory_type}", memory_type)
        if not isinstance(memory_id, str):
            return _failure(call, FailureReason.BAD_ARGUMENTS, f"argument {address!r} must be a string, not {memory_id!r}", memory_type)
        if address == "old_content":  # the store edits by id; the words only find the entry
            entry, error = store.find_by_text(memory_type, memory_id)
            if error and call.name == "memory_update" and error.reason in _MISSED_UPDATE_REASONS:
                return ToolResult(call, _insert_missed_update(store, memory_type, args[content_arg], chunk, error), memory_type)
            if error:
                return ToolResult(call, error, memory_type)
            memory_id = entry.id

    if call.name == "memory_insert":
        op = store.insert(memory_type, args["content"], chunk)
    elif call.name == "memory_update":
        op = store.update(memory_type, memory_id, args[content_arg], chunk)
    else:
        op = store.delete(memory_type, memory_id, chunk)
    return ToolResult(call, op, memory_type)


def execute_calls(store: MemoryStore, calls: list[ToolCall], chunk: int) -> list[ToolResult]:
    """Apply calls in order; each gets a result, failures leave the memory unchanged."""
    return [execute_call(store, call, chunk) for call in calls]


def execute_text(store: MemoryStore, text: str, chunk: int) -> tuple[ParseResult, list[ToolResult]]:
    """Parse a model output and apply its calls.

    Each parse error (a fragment that could not become a call, or an output with neither calls nor
    NOTHING_TO_STORE) is one failed result with reason UNPARSEABLE; an explicit nothing-to-store output
    gives no results.
    """
    parsed = parse_tool_calls(text)
    results = execute_calls(store, parsed.calls, chunk)
    results.extend(_failure(None, FailureReason.UNPARSEABLE, error) for error in parsed.errors)
    return parsed, results
