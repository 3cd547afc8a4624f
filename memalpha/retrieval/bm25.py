"""BM25 over a mutable collection, on top of bm25s (whose indexes are built in batch).

Edits only touch a token table and mark the index dirty; the next search rebuilds it once. Readers ask
many questions between writes, so a query costs one sparse lookup: the postings of the query terms are
summed with a single `np.bincount` over bm25s's precomputed CSC score matrix.
"""

from __future__ import annotations

import logging
from typing import Iterable

import bm25s
import numpy as np

from memalpha.retrieval.base import top_k
from memalpha.text import tokenize

# bm25s sets its own logger to DEBUG, so any root handler prints a line per index rebuild (thousands a run)
logging.getLogger("bm25s").setLevel(logging.WARNING)


class BM25Retriever:
    """BM25 (Lucene variant, k1=1.5, b=0.75) over (doc_id, text); only documents sharing a term with the query are returned."""

    def __init__(self, k1: float = 1.5, b: float = 0.75):
        self.k1 = k1
        self.b = b
        self._tokens: dict[str, list[str]] = {}
        self._dirty = True
        self._ids: list[str] = []
        self._vocab: dict[str, int] = {}
        self._data = self._indices = self._indptr = None
        self.rebuilds = 0
        """How many times the bm25s index was rebuilt (observability for benchmarks and tests)."""

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, doc_id: str) -> bool:
        return doc_id in self._tokens

    def add(self, doc_id: str, text: str) -> None:
        """Index a new document; an existing id is an error (use `update`)."""
        if doc_id in self._tokens:
            raise KeyError(f"document {doc_id!r} is already indexed")
        self.add_tokens(doc_id, tokenize(text))

    def add_many(self, items: Iterable[tuple[str, str]]) -> None:
        """Index many new documents."""
        for doc_id, text in items:
            self.add(doc_id, text)

    def add_tokens(self, doc_id: str, tokens: list[str]) -> None:
        """Index or replace a document given already tokenized text (see `tokenize`)."""
        self._tokens[doc_id] = tokens
        self._dirty = True

    def update(self, doc_id: str, text: str) -> None:
        """Replace the text of an indexed document."""
        if doc_id not in self._tokens:
            raise KeyError(f"document {doc_id!r} is not indexed")
        self.add_tokens(doc_id, tokenize(text))

    def remove(self, doc_id: str) -> None:
        """Drop a document."""
        if self._tokens.pop(doc_id, None) is None:
            raise KeyError(f"document {doc_id!r} is not indexed")
        self._dirty = True

    def tokens(self, doc_id: str) -> list[str]:
        """The indexed tokens of a document."""
        return self._tokens[doc_id]

    def _rebuild(self) -> None:
        self._ids = list(self._tokens)
        corpus = [self._tokens[i] for i in self._ids]
        self._vocab = {}
        self._data = None
        if any(corpus):
            model = bm25s.BM25(k1=self.k1, b=self.b)
            model.index(corpus, show_progress=False)
            self._vocab = model.vocab_dict
            self._data = model.scores["data"]
            self._indices = model.scores["indices"]
            self._indptr = model.scores["indptr"]
        self._dirty = False
        self.rebuilds += 1

    def scores(self, query: str) -> tuple[list[str], np.ndarray]:
        """BM25 score of every document (ids in index order) for the query."""
        if self._dirty:
            self._rebuild()
        term_ids = [self._vocab[t] for t in set(tokenize(query)) if t in self._vocab]
        if not term_ids or self._data is None:
            return self._ids, np.zeros(len(self._ids), dtype=np.float32)
        spans = [(self._indptr[t], self._indptr[t + 1]) for t in term_ids]
        postings = np.concatenate([self._indices[s:e] for s, e in spans])
        weights = np.concatenate([self._data[s:e] for s, e in spans])
        return self._ids, np.bincount(postings, weights=weights, minlength=len(self._ids)).astype(np.float32)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """Top-k documents with a positive BM25 score, best first."""
        ids, scores = self.scores(query)
        best = top_k(scores, min(k, int(np.count_nonzero(scores > 0))))
        return [(ids[i], float(scores[i])) for i in best]
