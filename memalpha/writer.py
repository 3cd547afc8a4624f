"""Using a trained writer: conversations in, memories out.

`MemoryWriter` loads the policy with a writer adapter once and writes many conversations together: each
chunk position of every conversation in one batched generation call (`training.rollout.write_unasked`,
the loop evaluation uses), on the rollout engine of the config (`hf`, or `vllm` where one serves).
Conversations come as turns (speaker, text, optional date), ready chunks, or plain text; they are chunked
at the writer's chunk size (its record's `chunk_tokens`). With questions, the frozen base model answers
them from the memory through retrieval, as in evaluation (the local reader).

The same class serves `memalpha write`, `write_memory` and the MLflow pyfunc model (`serving/`); its progress
lines come from `memalpha.progress.WriteProgress`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memalpha.config import RunConfig
from memalpha.data.chunking import TokenCounts, Turn, chunk_turns, fit_chunks, text_turns
from memalpha.data.schema import Instance, Question
from memalpha.errors import UserError

MAX_TURNS = 20_000
"""Most turns one request may carry: a bound on the work one call can ask for."""


class WriteInputError(UserError):
    """A conversation that cannot be written; the message names the field."""


@dataclass
class Conversation:
    """One conversation to write: turns, or ready chunks, and optional questions."""

    id: str
    turns: list[Turn] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WriteInputError(f"{where}: expected a list of strings")
    return value


def parse_conversation(obj: Any, where: str = "conversation") -> Conversation:
    """A conversation from JSON data: `{"turns": [{"speaker", "text", "date"?}, ...]}`, `{"chunks": [...]}`
    or `{"text": "..."}`, each with optional `id` and `questions`. Errors name the field."""
    if not isinstance(obj, dict):
        raise WriteInputError(f"{where}: expected an object with 'turns', 'chunks' or 'text', got {type(obj).__name__}")
    conv = Conversation(str(obj.get("id", where)))
    if "questions" in obj and obj["questions"] is not None:
        conv.questions = _strings(obj["questions"], f"{where}.questions")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list):
            raise WriteInputError(f"{where}.turns: expected a list of turns")
        if len(turns) > MAX_TURNS:
            raise WriteInputError(f"{where}.turns: {len(turns)} turns, more than the {MAX_TURNS} one request may carry")
        for i, turn in enumerate(turns):
            tw = f"{where}.turns[{i}]"
            if not isinstance(turn, dict):
                raise WriteInputError(f"{tw}: expected an object with 'speaker' and 'text'")
            for name in ("speaker", "text"):
                if name not in turn:
                    raise WriteInputError(f"{tw}: missing field '{name}'")
                if not isinstance(turn[name], str):
                    raise WriteInputError(f"{tw}.{name}: expected a string, got {type(turn[name]).__name__}")
            if turn.get("date") is not None and not isinstance(turn["date"], str):
                raise WriteInputError(f"{tw}.date: expected a string, got {type(turn['date']).__name__}")
            conv.turns.append(Turn(turn["text"], turn["speaker"], turn.get("date"), f"t{i}"))
    elif "chunks" in obj:
        conv.chunks = _strings(obj["chunks"], f"{where}.chunks")
    elif "text" in obj:
        if not isinstance(obj["text"], str):
            raise WriteInputError(f"{where}.text: expected a string, got {type(obj['text']).__name__}")
        conv.turns = text_turns(obj["text"])
    else:
        raise WriteInputError(f"{where}: needs one of 'turns', 'chunks' or 'text'")
    if not any(t.text.strip() for t in conv.turns) and not any(c.strip() for c in conv.chunks):
        raise WriteInputError(f"{where}: the conversation is empty")
    return conv


def read_conversations(path: str | Path) -> list[Conversation]:
    """A file of conversations: JSONL of turns (one conversation; a line `{"speaker", "text", "date"?}`),
    a LoCoMo-format JSON (a list of conversations with `conversation.session_N`), a JSON object or list of
    objects in `parse_conversation`'s shape, or plain text (one conversation)."""
    from memalpha.data.loaders import load_locomo

    path = Path(path)
    if not path.is_file():
        raise WriteInputError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        turns = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    turns.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise WriteInputError(f"{path}: line {n}: not valid JSON ({exc.msg})") from None
        return [parse_conversation({"id": path.stem, "turns": turns}, f"{path}")]
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WriteInputError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        items = data if isinstance(data, list) else [data]
        if items and isinstance(items[0], dict) and "conversation" in items[0]:
            return [Conversation(raw.instance_id, turns=raw.turns) for raw in load_locomo(path).items]
        return [parse_conversation(item, f"{path}: item {i}") for i, item in enumerate(items)]
    conv = parse_conversation({"id": path.stem, "text": text}, str(path))
    return [conv]


class MemoryWriter:
    """A writer adapter loaded once, writing batches of conversations."""

    def __init__(self, adapter: str | Path, config: RunConfig | None = None, base_model: str | Path | None = None):
        from memalpha.models.policy import load_policy
        from memalpha.teacher.record import writer_chunk_tokens
        from memalpha.training.engines import check_engine

        config = config or RunConfig()
        if base_model is not None:
            config = config.model_copy(update={"model": config.model.model_copy(update={"policy": str(base_model)})})
        self.config = config
        self.adapter = Path(adapter)
        self.chunk_tokens = writer_chunk_tokens(adapter)
        if config.rollout.engine == "llamacpp":  # the writer's export on its llama.cpp server
            from memalpha.models.llamacpp import served_policy

            self.policy = served_policy(config.model, config.memory.schema(), self.adapter)
        else:
            check_engine(config.rollout, config.model.policy)  # rollout.engine=vllm writes on its server
            self.policy = load_policy(config.model, adapter=self.adapter, trainable=False, seed=config.grpo.seed)
        self.counter = TokenCounts(self.policy.tokenizer)
        self._reader = None

    def chunks(self, conv: Conversation) -> list[str]:
        """The conversation's chunks at the writer's chunk size."""
        if conv.turns:
            return chunk_turns(conv.turns, self.counter, self.chunk_tokens).chunks
        return fit_chunks([c for c in conv.chunks if c.strip()], self.counter, self.chunk_tokens)[0]

    def write(self, conversations: list[Conversation], progress: Callable[[int], None] | None = None,
              batch_size: int | None = None) -> list[dict[str, Any]]:
        """One memory per conversation ({id, core, semantic, episodic, chunks[, answers]}), in order.
        `progress` gets the number of chunks written after every batched writer call."""
        from memalpha.training.rollout import write_unasked

        instances = [Instance(c.id, "user", "accurate_retrieval", self.chunks(c), []) for c in conversations]
        out: list[dict[str, Any]] = []
        stores = []
        size = batch_size or max(1, self.config.eval.batch_size)
        for written, _ in write_unasked(self.policy, instances, self.config, batch_size=size, on_chunks=progress):
            for w in written:
                stores.append(w.memory)
                out.append({"id": w.instance.instance_id, "core": w.memory.paragraph("core"),
                            **{s.name: [e.content for e in w.memory.entries(s.name)] for s in w.memory.schema.list_sections},
                            "chunks": len(w.instance.chunks)})
        for conv, memory, store in zip(conversations, out, stores):
            if conv.questions:
                memory["answers"] = self.answer(memory["id"], store, conv.questions)
        return out

    def answer(self, conv_id: str, store, questions: list[str]) -> list[str]:
        """The reader's answers to `questions` from the memory, read through retrieval: a packaged LLM reader
        when model.reader names one, else the writer's frozen base model (the local reader)."""
        from memalpha.memory.views import reader_view
        from memalpha.models.loading import LLM_MODELS
        from memalpha.models.readers import LocalModelReader, ReaderItem, make_reader
        from memalpha.retrieval import MemoryIndex

        if self._reader is None:
            if self.config.model.reader in LLM_MODELS:
                self._reader = make_reader(self.config.model)
            elif self.config.rollout.engine == "llamacpp":
                raise UserError("questions to a writer on llama.cpp are answered by an LLM reader: set model.reader="
                                "qwen2.5-coder-1.5b (or -0.5b) and start its server")
            else:
                self._reader = LocalModelReader(self.policy, self.config.model.reader_max_new_tokens)
        index = MemoryIndex(store, self.config.retrieval)
        items = [ReaderItem(reader_view(store, q, search=index.search, budget_tokens=self.config.memory.reader_view_tokens,
                                        top_k=self.config.retrieval.top_k), Question(f"{conv_id}-q{i}", q, [], "single_hop"))
                 for i, q in enumerate(questions)]
        return self._reader.answer(items)

