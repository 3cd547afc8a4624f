"""Hybrid retrieval: reciprocal rank fusion (RRF) of BM25 and dense rankings."""

from __future__ import annotations

from typing import Iterable

from memalpha.retrieval.base import Retriever, add_many


def reciprocal_rank_fusion(rankings: list[list[str]], rrf_k: int = 60) -> list[tuple[str, float]]:
    """Fuse rankings: score(d) = sum over rankings of 1 / (rrf_k + rank of d), ranks from 1; best first."""
    fused: dict[str, float] = {}
    for ranking in rankings:
        for rank, doc_id in enumerate(ranking, start=1):
            fused[doc_id] = fused.get(doc_id, 0.0) + 1.0 / (rrf_k + rank)
    return sorted(fused.items(), key=lambda item: -item[1])


class HybridRetriever:
    """RRF of a lexical and a dense retriever kept over the same items."""

    def __init__(self, lexical: Retriever, dense: Retriever, rrf_k: int = 60, depth: int = 50):
        self.lexical = lexical
        self.dense = dense
        self.rrf_k = rrf_k
        self.depth = depth
        """Each retriever contributes its top max(k, depth) to the fusion."""

    def __len__(self) -> int:
        return len(self.lexical)

    def add(self, doc_id: str, text: str) -> None:
        """Index a new document in both retrievers."""
        self.lexical.add(doc_id, text)
        self.dense.add(doc_id, text)

    def add_many(self, items: Iterable[tuple[str, str]]) -> None:
        """Index many new documents in both retrievers (batched embedding)."""
        items = list(items)
        add_many(self.lexical, items)
        add_many(self.dense, items)

    def update(self, doc_id: str, text: str) -> None:
        """Replace a document's text in both retrievers."""
        self.lexical.update(doc_id, text)
        self.dense.update(doc_id, text)

    def remove(self, doc_id: str) -> None:
        """Drop a document from both retrievers."""
        self.lexical.remove(doc_id)
        self.dense.remove(doc_id)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """Top-k by fused RRF score, best first."""
        depth = max(k, self.depth)
        rankings = [[d for d, _ in r.search(query, depth)] for r in (self.lexical, self.dense)]
        return reciprocal_rank_fusion(rankings, self.rrf_k)[:k]
