"""Retrieval over a MemoryStore's list sections (kept in sync through store listeners), over raw
chunks (the RAG baseline), and the factory that builds a retriever from RetrievalConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from memalpha.config import RetrievalConfig
from memalpha.retrieval.base import Retriever, add_many
from memalpha.retrieval.bm25 import BM25Retriever
from memalpha.retrieval.dense import DenseRetriever
from memalpha.retrieval.embedder import TextEncoder, load_embedder
from memalpha.retrieval.hybrid import HybridRetriever
from memalpha.retrieval.two_layer import TwoLayerRetriever

if TYPE_CHECKING:
    from memalpha.memory.store import Entry, MemoryStore


def make_retriever(cfg: RetrievalConfig, embedder: TextEncoder | None = None) -> Retriever:
    """A flat retriever for `cfg.method`; `two_layer` ranks entries with BM25 inside its chosen sections.

    The dense methods use `embedder`, or the shared one for `cfg.embedding_model`.
    """
    if cfg.method in ("bm25", "two_layer"):
        return BM25Retriever()
    encoder = embedder if embedder is not None else load_embedder(cfg.embedding_model)
    if cfg.method == "dense":
        return DenseRetriever(encoder)
    if cfg.method == "hybrid":
        return HybridRetriever(BM25Retriever(), DenseRetriever(encoder))
    raise ValueError(f"retrieval.method: unknown method {cfg.method!r}")


class MemoryIndex:
    """Search over the list sections of one MemoryStore, updated on every insert/update/delete.

    Flat methods keep one retriever per list section. `two_layer` keeps one TwoLayerRetriever over all
    lists; a section it does not choose for a query yields no entries.
    """

    def __init__(self, store: MemoryStore, cfg: RetrievalConfig, embedder: TextEncoder | None = None):
        self.store = store
        self.cfg = cfg
        self.sections = [spec.name for spec in store.schema.list_sections]
        self._two_layer: TwoLayerRetriever | None = None
        self._per_section: dict[str, Retriever] = {}
        if cfg.method == "two_layer":
            self._two_layer = TwoLayerRetriever(
                make_retriever(cfg, embedder),
                sections_per_query=cfg.sections_per_query,
                descriptions={spec.name: spec.description for spec in store.schema.list_sections},
            )
            for name in self.sections:
                for entry in store.entries(name):
                    self._two_layer.add(entry.id, entry.content, section=name)
        else:
            for name in self.sections:
                retriever = make_retriever(cfg, embedder)
                add_many(retriever, [(e.id, e.content) for e in store.entries(name)])
                self._per_section[name] = retriever
        store.add_listener(self._on_event)

    def _on_event(self, event: str, section: str, entry: Entry | None) -> None:
        if section not in self.sections or entry is None:
            return
        target = self._two_layer if self._two_layer is not None else self._per_section[section]
        if event == "insert":
            if self._two_layer is not None:
                self._two_layer.add(entry.id, entry.content, section=section)
            else:
                target.add(entry.id, entry.content)
        elif event == "update":
            target.update(entry.id, entry.content)
        elif event == "delete":
            target.remove(entry.id)
        else:
            raise ValueError(f"unknown memory event {event!r}")

    def __len__(self) -> int:
        if self._two_layer is not None:
            return len(self._two_layer)
        return sum(len(r) for r in self._per_section.values())

    def search(self, section: str, query: str, k: int | None = None) -> list[str]:
        """Ids of the top-k entries of `section` for the query (k defaults to cfg.top_k), best first."""
        if section not in self.sections:
            raise KeyError(f"no list section {section!r} (known: {', '.join(self.sections)})")
        k = self.cfg.top_k if k is None else k
        if self._two_layer is not None:
            chosen = self._two_layer.choose_sections(query)
            if section not in chosen:
                return []
            return [d for d, _ in self._two_layer.search(query, k, sections=[section])]
        return [d for d, _ in self._per_section[section].search(query, k)]

    def search_all(self, query: str, k: int | None = None) -> dict[str, list[str]]:
        """Top-k entry ids of every list section (empty for sections two-layer retrieval skips)."""
        if self._two_layer is not None:
            chosen = set(self._two_layer.choose_sections(query))
            k = self.cfg.top_k if k is None else k
            return {
                s: [d for d, _ in self._two_layer.search(query, k, sections=[s])] if s in chosen else []
                for s in self.sections
            }
        return {s: self.search(s, query, k) for s in self.sections}


class ChunkIndex:
    """Retrieval over an instance's raw chunks, for the RAG baseline; results are chunk positions."""

    def __init__(self, chunks: Sequence[str], cfg: RetrievalConfig, embedder: TextEncoder | None = None):
        flat = cfg if cfg.method != "two_layer" else cfg.model_copy(update={"method": "bm25"})
        self.chunks = list(chunks)
        self.retriever = make_retriever(flat, embedder)
        add_many(self.retriever, [(str(i), text) for i, text in enumerate(self.chunks)])

    def search(self, query: str, k: int) -> list[int]:
        """Positions of the top-k chunks for the query, best first."""
        return [int(d) for d, _ in self.retriever.search(query, k)]

    def top_chunks(self, query: str, k: int) -> list[str]:
        """The top-k chunks in their original order (so the context reads chronologically)."""
        return [self.chunks[i] for i in sorted(self.search(query, k))]
