"""Two-layer retrieval (the original design): choose the sections relevant to the query, then rank
the entries inside them.

Layer 1 is BM25 over one pseudo-document per section (its description plus all its entries). Layer 2
ranks entries with one retriever over all sections, so scores are comparable across sections, and keeps
those in the chosen sections.
"""

from __future__ import annotations

from memalpha.retrieval.base import Retriever
from memalpha.retrieval.bm25 import BM25Retriever
from memalpha.text import tokenize


class TwoLayerRetriever:
    """Sections first, then entries; `add` takes the entry's section."""

    def __init__(self, entries: Retriever, sections_per_query: int = 3, descriptions: dict[str, str] | None = None):
        self.entries = entries
        self.sections_per_query = sections_per_query
        self._descriptions = {name: tokenize(text) for name, text in (descriptions or {}).items()}
        self._section_of: dict[str, str] = {}
        self._members: dict[str, dict[str, list[str]]] = {name: {} for name in self._descriptions}
        self._sections = BM25Retriever()
        self._dirty: set[str] = set(self._descriptions)

    def __len__(self) -> int:
        return len(self._section_of)

    def add(self, doc_id: str, text: str, section: str = "default") -> None:
        """Index a new entry of `section`."""
        self.entries.add(doc_id, text)
        self._section_of[doc_id] = section
        self._members.setdefault(section, {})[doc_id] = tokenize(text)
        self._dirty.add(section)

    def update(self, doc_id: str, text: str) -> None:
        """Replace an entry's text (it stays in its section)."""
        self.entries.update(doc_id, text)
        section = self._section_of[doc_id]
        self._members[section][doc_id] = tokenize(text)
        self._dirty.add(section)

    def remove(self, doc_id: str) -> None:
        """Drop an entry."""
        self.entries.remove(doc_id)
        section = self._section_of.pop(doc_id)
        del self._members[section][doc_id]
        self._dirty.add(section)

    def choose_sections(self, query: str) -> list[str]:
        """The sections_per_query non-empty sections whose content best matches the query; when fewer
        match at all, the rest are filled in first-added order."""
        for section in self._dirty:
            tokens = list(self._descriptions.get(section, []))
            for entry_tokens in self._members[section].values():
                tokens.extend(entry_tokens)
            self._sections.add_tokens(section, tokens)
        self._dirty.clear()
        populated = {s for s, members in self._members.items() if members}
        ranked = [s for s, _ in self._sections.search(query, len(self._members)) if s in populated]
        ranked += [s for s in self._members if s in populated and s not in ranked]
        return ranked[: self.sections_per_query]

    def search(self, query: str, k: int, sections: list[str] | None = None) -> list[tuple[str, float]]:
        """Top-k entries of the chosen sections (or of `sections` when given), best first."""
        allowed = set(self.choose_sections(query) if sections is None else sections)
        wanted = sum(len(self._members.get(s, ())) for s in allowed)
        depth = max(k, 1)
        while True:
            hits = self.entries.search(query, depth)
            kept = [(d, s) for d, s in hits if self._section_of[d] in allowed]
            if len(kept) >= min(k, wanted) or len(hits) < depth:
                return kept[:k]
            depth *= 4

    def section_of(self, doc_id: str) -> str:
        """The section an entry was added to."""
        return self._section_of[doc_id]
