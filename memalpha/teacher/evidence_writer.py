"""The teacher for real dialogue: it stores the turns that hold a training question's answer.

The rule writer (`teacher.rule_writer`) reads facts from the templates of memalpha's own generator and
finds almost nothing in dialogue written by people (LoCoMo: 0.057 QA against BM25 RAG's 0.313). Real
training data carries what a template cannot: which turns answer each question (LoCoMo's evidence
dia_ids, PerLTQA's reference memories; kept in `metadata["evidence_turns"]` by `data.loaders.to_instance`).
At each chunk this teacher inserts those turns into episodic memory as dated, speaker-named facts
("Caroline, 8 May 2023: I went to a LGBTQ support group yesterday."), skipping what is stored already and
what does not fit the completion budget; a chunk without evidence gets NOTHING_TO_STORE. It only ever
sees training-split questions: demonstrations are built from the training split alone.
"""

from __future__ import annotations

from memalpha.data.schema import Instance
from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.env.tools import call_line
from memalpha.memory import MemorySchema, MemoryStore
from memalpha.teacher.rule_writer import _day
from memalpha.tokens import TokenCounter

MAX_FACT_WORDS = 40
"""A longer turn is cut to its first words: a fact, not a transcript."""


def evidence_fact(line: dict) -> str:
    """One evidence turn as a dated, speaker-named fact."""
    words = str(line.get("text", "")).split()
    text = " ".join(words[:MAX_FACT_WORDS]) + (" ..." if len(words) > MAX_FACT_WORDS else "")
    who = line.get("speaker") or "Someone"
    return f"{who}, {_day(line['date'])}: {text}" if line.get("date") else f"{who}: {text}"


class EvidenceWriter:
    """Writes, for one instance, the facts of the evidence turns each chunk holds."""

    def __init__(self, schema: MemorySchema, max_completion_tokens: int, count_tokens: TokenCounter):
        names = [spec.name for spec in schema.list_sections]
        self.section = "episodic" if "episodic" in names else names[0]
        self.max_completion_tokens = max_completion_tokens
        self.count_tokens = count_tokens

    @staticmethod
    def applies(instance: Instance) -> bool:
        return bool(instance.metadata.get("evidence_turns"))

    def facts(self, instance: Instance, chunk: int) -> list[str]:
        """The facts of the chunk's evidence turns, in question order, without repeats."""
        seen: dict[str, None] = {}
        for lines in instance.metadata.get("evidence_turns", {}).values():
            for line in lines:
                if line.get("chunk") == chunk:
                    seen.setdefault(evidence_fact(line))
        return list(seen)

    def write(self, instance: Instance, chunk: int, store: MemoryStore) -> str:
        """The completion for `chunk`: JSON lines inserting its new facts, or NOTHING_TO_STORE."""
        stored = {entry.content for spec in store.schema.list_sections for entry in store.entries(spec.name)}
        kept, used = [], 0
        for fact in self.facts(instance, chunk):
            if fact in stored:
                continue
            line = call_line("memory_insert", {"memory_type": self.section, "content": fact})
            cost = self.count_tokens(line + "\n")
            if used + cost > self.max_completion_tokens:
                continue
            kept.append(line)
            used += cost
        return "\n".join(kept) if kept else NOTHING_TO_STORE
