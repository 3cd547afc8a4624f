"""The writer's and the reader's prompts, rendered with the tokenizer's chat template.

Kept short on purpose: the default policy has 135M parameters and every prompt token costs CPU time.
Examples use abstract placeholders only (a probe found the small model copying concrete example values
from the system prompt into memory).
"""

from __future__ import annotations

import re

from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.env.tools import call_line
from memalpha.memory.schema import MemorySchema, SectionSpec

_PARENTHESES = re.compile(r"\s*\([^)]*\)")


def _short(spec: SectionSpec) -> str:
    """First sentence of the section description, without parenthetical remarks."""
    text = _PARENTHESES.sub("", spec.description)
    return text.split(". ", 1)[0].rstrip(".") + "."


def writer_system_prompt(schema: MemorySchema) -> str:
    """Instructions for the writer: sections, the JSON-lines tool-call format, nothing-to-store."""
    sections = "\n".join(f"- {s.name} ({s.kind}): {_short(s)}" for s in schema.sections)
    list_name = schema.list_sections[0].name if schema.list_sections else "<section>"
    examples = "\n".join([
        call_line("memory_insert", {"memory_type": list_name, "content": "<fact>"}),
        call_line("memory_update", {"memory_type": list_name, "memory_id": "<id>", "new_content": "<new fact>"}),
        call_line("memory_delete", {"memory_type": list_name, "memory_id": "<id>"}),
    ])
    return (
        "You maintain a memory of a conversation. For each new chunk, record the new facts and events "
        "that could be asked about later.\n"
        f"Memory sections:\n{sections}\n"
        "Reply with tool calls only, one JSON object per line:\n"
        f"{examples}\n"
        "When a stored fact changes, update its entry. Rewrite core with memory_update (no memory_id).\n"
        f"If the chunk has nothing worth storing, reply with the single line {NOTHING_TO_STORE}"
    )


def writer_user_message(memory_view: str, chunk_text: str) -> str:
    """The current memory (as the writer view renders it) followed by the new chunk."""
    return f"Memory:\n{memory_view}\n\nNew chunk:\n{chunk_text.strip()}"


def writer_messages(schema: MemorySchema, memory_view: str, chunk_text: str) -> list[dict[str, str]]:
    """System + user messages of one writer step."""
    return [
        {"role": "system", "content": writer_system_prompt(schema)},
        {"role": "user", "content": writer_user_message(memory_view, chunk_text)},
    ]


def render_chat(tokenizer, messages: list[dict[str, str]]) -> str:
    """Messages rendered with the chat template, ending with the assistant turn's opening."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_writer_prompt(tokenizer, schema: MemorySchema, memory_view: str, chunk_text: str) -> str:
    """The exact prompt text of one writer step (memalpha.env.episode renders every writer prompt with it)."""
    return render_chat(tokenizer, writer_messages(schema, memory_view, chunk_text))


READER_SYSTEM = "Answer the question using only the memory. Reply with the answer only, in a few words."
READER_BOXED = "Reply with the label only, written as \\boxed{<label>}."


def reader_messages(memory_context: str, question: str, boxed: bool = False) -> list[dict[str, str]]:
    """System + user messages asking for a short answer (a boxed label for classification questions)."""
    system = READER_SYSTEM + (" " + READER_BOXED if boxed else "")
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Memory:\n{memory_context}\n\nQuestion: {question.strip()}"},
    ]


def render_reader_prompt(tokenizer, memory_context: str, question: str, boxed: bool = False) -> str:
    """The reader's prompt text, rendered with the chat template."""
    return render_chat(tokenizer, reader_messages(memory_context, question, boxed))


JUDGE_SYSTEM = (
    "You check one memory write. Reply VALID if the content is a specific, correct piece of information "
    "from the chunk and fits the memory type; otherwise reply INVALID. Reply with one word."
)


def judge_messages(memory_type: str, type_description: str, content: str, chunk_text: str) -> list[dict[str, str]]:
    """Messages asking an LLM judge whether one write is valid for its memory type."""
    return [
        {"role": "system", "content": JUDGE_SYSTEM},
        {
            "role": "user",
            "content": (
                f"Chunk:\n{chunk_text.strip()}\n\nMemory type: {memory_type} ({type_description})\n"
                f"Content written: {content.strip()}\n\nVALID or INVALID?"
            ),
        },
    ]
