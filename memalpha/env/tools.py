"""The writer's three memory tools: definitions (OpenAI tool format), calls, results and execution.

Only `memory_insert`, `memory_update` and `memory_delete` are ever executed. An update or delete names its
list entry by `memory_id` (the paper's tools). Arguments are checked strictly against the definitions (no
aliases): a missing, unexpected or mistyped argument is a failed call (BAD_ARGUMENTS) whose message names
the argument. Every failure leaves the memory unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memalpha.env.parsing import NOTHING_TO_STORE, ParseResult, ToolCall, parse_tool_calls
from memalpha.memory.schema import MEMALPHA_SCHEMA, MemorySchema
from memalpha.memory.store import FailureReason, MemoryStore, OpResult

__all__ = [
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
    "tool_call_grammar",
    "tool_schemas",
]

TOOL_NAMES = ("memory_insert", "memory_update", "memory_delete")

def text_argument(name: str) -> str:
    """The argument holding the text that call `name` writes."""
    return "new_content" if name == "memory_update" else "content"


def call_line(name: str, arguments: dict[str, Any]) -> str:
    """One call as a JSON line, in the writer prompt's format."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


_ARGUMENTS = {
    "memory_insert": (frozenset({"memory_type", "content"}), ("memory_type", "content")),
    "memory_update": (frozenset({"memory_type", "memory_id", "new_content"}), ("memory_type", "new_content")),
    "memory_delete": (frozenset({"memory_type", "memory_id"}), ("memory_type", "memory_id")),
}
"""(allowed arguments, arguments that must be present and non-null) of each tool."""


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
    rewrite_note = f" ({', '.join(paragraph_names)} is rewritten as a whole; no memory_id)" if paragraph_names else ""

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
    target = {"type": "string", "description": f"Id of an existing entry, as shown in the memory (e.g. '{example_id}')."}
    new_content = {"type": "string", "description": "The complete new text."}
    update_description = "Replace the content of an existing list entry, given its memory_id, or rewrite a paragraph memory" + rewrite_note + "."
    update_properties = {"memory_type": any_type, "memory_id": target, "new_content": new_content}
    return [
        function(
            "memory_insert",
            "Add a new entry to a list memory. One self-contained fact or event per entry; never repeat an existing entry.",
            {"memory_type": list_type, "content": {"type": "string", "description": "The text of the new entry."}},
            ["memory_type", "content"],
        ),
        function("memory_update", update_description, update_properties, ["memory_type", "new_content"]),
        function(
            "memory_delete",
            "Delete an outdated or wrong entry from a list memory, given its memory_id.",
            {"memory_type": list_type, "memory_id": target},
            ["memory_type", "memory_id"],
        ),
    ]


TOOL_SCHEMAS = tool_schemas(MEMALPHA_SCHEMA)
"""Tool definitions for the Mem-alpha layout."""

MAX_CALLS_PER_CHUNK = 8
"""Most calls a grammar-constrained writer may make for one chunk."""
MAX_CONTENT_CHARS = 400
"""Longest text one constrained call may write (a section's token cap still applies when it executes)."""


def tool_call_grammar(schema: MemorySchema = MEMALPHA_SCHEMA, max_calls: int = MAX_CALLS_PER_CHUNK,
                      max_chars: int = MAX_CONTENT_CHARS) -> str:
    """A GBNF grammar (llama.cpp) of the writer prompt's format: NOTHING_TO_STORE, or 1..max_calls JSON
    lines of valid calls on this schema's sections. A writer sampled under it cannot call an unknown tool or
    section or repeat calls past the cap, and its JSON is valid unless the token cap cuts it short."""
    if not schema.list_sections:
        raise ValueError(f"schema {schema.name!r} has no list section: the tool-call grammar needs one")
    def lit(text: str) -> str:  # a GBNF string literal
        return json.dumps(text)

    def one_of(names) -> str:
        return " | ".join(lit(json.dumps(n)) for n in names)

    def head(tool: str) -> str:
        return lit('{"name": "%s", "arguments": {"memory_type": ' % tool)

    end, comma_id, comma_content, comma_new = lit("}}"), lit(', "memory_id": '), lit(', "content": '), lit(', "new_content": ')
    update = f"list-type {comma_id} id {comma_new} text"
    rules = [
        f"root ::= {lit(NOTHING_TO_STORE)} | call ({lit(chr(10))} call){{0,{max_calls - 1}}}",
        "call ::= insert | update | delete",
        f"insert ::= {head('memory_insert')} list-type {comma_content} text {end}",
        f"delete ::= {head('memory_delete')} list-type {comma_id} id {end}",
        f"list-type ::= {one_of(s.name for s in schema.list_sections)}",
        f"id ::= {lit(chr(34))} ({' | '.join(lit(s.prefix + '-') for s in schema.list_sections)}) [0-9]{{1,6}} {lit(chr(34))}",
        f"text ::= {lit(chr(34))} char{{1,{max_chars}}} {lit(chr(34))}",
        r'char ::= [^"\\\x00-\x1f] | "\\" ["\\/bfnrt]',
    ]
    if schema.paragraph_sections:
        update += f" | paragraph-type {comma_new} text"
        rules.append(f"paragraph-type ::= {one_of(s.name for s in schema.paragraph_sections)}")
    rules.insert(3, f"update ::= {head('memory_update')} ({update}) {end}")
    return "\n".join(rules) + "\n"


def _failure(call: ToolCall | None, reason: FailureReason, message: str, memory_type: str | None = None) -> ToolResult:
    return ToolResult(call, OpResult(False, reason, message), memory_type)


def execute_call(store: MemoryStore, call: ToolCall, chunk: int) -> ToolResult:
    """Validate one call against the tool definitions and apply it to `store`."""
    spec = _ARGUMENTS.get(call.name)
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
    content_arg = text_argument(call.name)
    if content_arg in args and not isinstance(args[content_arg], str):
        return _failure(call, FailureReason.BAD_ARGUMENTS, f"argument {content_arg!r} must be a string", memory_type)

    section = store.spec(memory_type)
    is_list = section is not None and section.is_list
    memory_id = args.get("memory_id")
    if call.name != "memory_insert" and is_list:
        if memory_id is None:
            return _failure(call, FailureReason.BAD_ARGUMENTS, f"missing argument 'memory_id' for {call.name} on {memory_type}", memory_type)
        if not isinstance(memory_id, str):
            return _failure(call, FailureReason.BAD_ARGUMENTS, f"argument 'memory_id' must be a string, not {memory_id!r}", memory_type)

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
