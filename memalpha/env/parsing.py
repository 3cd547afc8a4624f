"""Raw model text -> tool calls.

Accepted formats (mixed freely, calls kept in text order):
- Hermes/Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (arguments may be a JSON
  string; the closing tag may be missing when generation stopped);
- bare JSON: one object, one object per line (JSON lines, our writer prompt's format) or an array;
- JSON inside ``` code fences;
- Qwen-Agent markers: `✿FUNCTION✿: name` / `✿ARGS✿: {...}`;
- OpenAI style `{"function": {"name", "arguments"}}`, also inside `{"tool_calls": [...]}`.
Small JSON defects are repaired with json-repair, but only text that looks like JSON (`{"`, `[{`) is
ever read, so prose never turns into a call. Every JSON-looking fragment that does not yield a call is
reported in `errors` (each counts as one failed call); so is output with neither calls nor the
NOTHING_TO_STORE marker.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import json_repair

from memalpha.text import encodable

NOTHING_TO_STORE = "NOTHING_TO_STORE"
"""Marker for an explicit "this chunk has nothing worth storing"."""

NO_CALL_ERROR = "no tool call and no NOTHING_TO_STORE marker found"

_NOTHING = re.compile(rf"(?<!\w){NOTHING_TO_STORE}(?!\w)")
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|(?=<tool_call>)|\Z)", re.S)
_FENCE = re.compile(r"```[ \t]*[\w-]*[ \t]*\n?(.*?)(?:```|\Z)", re.S)
_MARKER = re.compile(r"✿(FUNCTION|ARGS|RESULT|RETURN)✿[ \t]*[:：]?")
_JSON_START = re.compile(r"""\{\s*["']|\[\s*\{""")
_NEXT_LINE_START = re.compile(r"""\n[ \t]*(?:\{[ \t]*["']|\[[ \t]*\{)""")
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One requested tool call; `raw` is the text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ParseResult:
    """Calls found in a model output, one error per fragment that could not become a call.

    `nothing_to_store` is True only for an output with the marker and neither calls nor errors.
    `format` names the syntaxes seen, joined by '+' (e.g. `hermes`, `json`, `json+openai`), or `none`.
    """

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    nothing_to_store: bool = False
    format: str = "none"


def _snippet(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _fragment_end(text: str, start: int) -> int:
    """End of a broken JSON fragment: its balancing bracket, else the next line that starts JSON."""
    bound_match = _NEXT_LINE_START.search(text, start + 1)
    bound = bound_match.start() if bound_match else len(text)
    depth = 0
    in_string = escaped = False
    for i in range(start, bound):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return bound


def _repair(fragment: str) -> Any:
    try:
        return json_repair.loads(fragment)
    except Exception:  # a third-party repair of arbitrary model text: any failure means "unparseable"
        return None


def _load_json(text: str) -> Any:
    """Strict JSON, else repaired JSON; None when nothing usable comes out."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        repaired = _repair(text)
        return repaired if isinstance(repaired, (dict, list)) and repaired else None


def _encodable_strings(value: Any) -> Any:
    """Lone surrogates in the strings of a parsed call escaped (`text.encodable`), so whatever is stored
    can be written as UTF-8."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, list):
        return [_encodable_strings(v) for v in value]
    if isinstance(value, dict):
        return {encodable(str(k)): _encodable_strings(v) for k, v in value.items()}
    return value


class _Collector:
    """Accumulates calls and errors with their text positions, and the formats seen."""

    def __init__(self) -> None:
        self.items: list[tuple[int, ToolCall | str]] = []
        self.formats: list[str] = []

    def format(self, name: str) -> None:
        if name not in self.formats:
            self.formats.append(name)

    def error(self, pos: int, message: str) -> None:
        self.items.append((pos, message))

    def add_object(self, pos: int, obj: Any, raw: str) -> None:
        """Turn one decoded JSON value into calls (lists and `tool_calls` wrappers are flattened)."""
        if isinstance(obj, list):
            if not obj:
                self.error(pos, f"empty JSON array: {_snippet(raw)}")
            for item in obj:
                self.add_object(pos, item, raw)
            return
        if not isinstance(obj, dict):
            self.error(pos, f"expected a JSON object for a tool call: {_snippet(raw)}")
            return
        if isinstance(obj.get("tool_calls"), list):
            self.add_object(pos, obj["tool_calls"], raw)
            return
        function = obj.get("function")
        if isinstance(function, dict):
            self.format("openai")
            name, arguments = function.get("name"), function.get("arguments")
        elif "name" in obj:
            name = obj["name"]
            arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters")
        else:
            self.error(pos, f"JSON object is not a tool call (no 'name'): {_snippet(raw)}")
            return
        self.add_call(pos, name, arguments, raw)

    def add_call(self, pos: int, name: Any, arguments: Any, raw: str) -> None:
        if not isinstance(name, str) or not name.strip():
            self.error(pos, f"tool call without a name: {_snippet(raw)}")
            return
        if isinstance(arguments, str):
            arguments = _load_json(arguments) if arguments.strip() else {}
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            self.error(pos, f"arguments of {name.strip()} are not a JSON object: {_snippet(raw)}")
            return
        self.items.append((pos, ToolCall(encodable(name.strip()), _encodable_strings(arguments), raw)))

    def scan_json(self, text: str, offset: int) -> int:
        """Read every JSON-looking fragment of `text`; returns how many were found."""
        found = 0
        pos = 0
        while (match := _JSON_START.search(text, pos)) is not None:
            start = match.start()
            try:
                obj, end = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                end = _fragment_end(text, start)
                obj = _repair(text[start:end])
            raw = text[start:end]
            if not isinstance(obj, (dict, list)):
                self.error(offset + start, f"unparseable JSON: {_snippet(raw)}")
            else:
                self.add_object(offset + start, obj, raw)
            found += 1
            pos = max(end, start + 1)
        return found


def _take(pieces: list[tuple[int, str]], pattern: re.Pattern[str], handle) -> list[tuple[int, str]]:
    """Run `handle(offset, match)` on every match in the pieces; return the uncovered pieces."""
    rest: list[tuple[int, str]] = []
    for offset, text in pieces:
        last = 0
        for match in pattern.finditer(text):
            rest.append((offset + last, text[last : match.start()]))
            handle(offset, match)
            last = match.end()
        rest.append((offset + last, text[last:]))
    return [(o, t) for o, t in rest if t.strip()]


def _markers(out: _Collector, offset: int, text: str) -> str:
    """Qwen-Agent `✿FUNCTION✿: name` / `✿ARGS✿: {...}` pairs; returns the text outside them."""
    marks = list(_MARKER.finditer(text))
    if not marks:
        return text
    out.format("function_marker")
    values = [
        (m.group(1), m.start(), text[m.end() : marks[i + 1].start() if i + 1 < len(marks) else len(text)])
        for i, m in enumerate(marks)
    ]
    for i, (kind, start, value) in enumerate(values):
        if kind == "FUNCTION":
            name = value.strip().split("\n", 1)[0].strip()
            has_args = i + 1 < len(values) and values[i + 1][0] == "ARGS"
            args_text = values[i + 1][2].strip() if has_args else ""
            after = i + 2 if has_args else i + 1
            raw = text[start : values[after][1] if after < len(values) else len(text)]
            if args_text and _load_json(args_text) is None:
                out.error(offset + start, f"arguments of {name or '?'} are not JSON: {_snippet(args_text)}")
            else:
                out.add_call(offset + start, name, args_text, raw)
        elif kind == "ARGS" and (i == 0 or values[i - 1][0] != "FUNCTION"):
            out.error(offset + start, f"✿ARGS✿ without ✿FUNCTION✿: {_snippet(value)}")
    return text[: marks[0].start()]


def parse_tool_calls(text: str) -> ParseResult:
    """Parse one model output into tool calls; never raises."""
    out = _Collector()

    def hermes(offset: int, match: re.Match[str]) -> None:
        out.format("hermes")
        if out.scan_json(match.group(1), offset + match.start(1)) == 0:
            out.error(offset + match.start(), f"<tool_call> block without JSON: {_snippet(match.group(0))}")

    def fence(offset: int, match: re.Match[str]) -> None:
        if out.scan_json(match.group(1), offset + match.start(1)):
            out.format("code_fence")

    pieces = _take([(0, text)], _HERMES, hermes)
    pieces = [(o, _markers(out, o, t)) for o, t in pieces]
    pieces = _take(pieces, _FENCE, fence)
    for offset, piece in pieces:
        if out.scan_json(piece, offset):
            out.format("json")

    out.items.sort(key=lambda item: item[0])
    calls = [item for _, item in out.items if isinstance(item, ToolCall)]
    errors = [item for _, item in out.items if isinstance(item, str)]
    nothing = not calls and not errors and _NOTHING.search(text) is not None
    if not calls and not errors and not nothing:
        errors.append(NO_CALL_ERROR)
    fmt = "nothing_to_store" if nothing else "+".join(out.formats) or "none"
    return ParseResult(calls, errors, nothing, fmt)
