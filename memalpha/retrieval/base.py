"""The retriever protocol shared by every retrieval method, and its helpers."""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Retriever(Protocol):
    """A mutable index over (doc_id, text) items; `search` always reflects every prior edit."""

    def add(self, doc_id: str, text: str) -> None: ...

    def update(self, doc_id: str, text: str) -> None: ...

    def remove(self, doc_id: str) -> None: ...

    def search(self, query: str, k: int) -> list[tuple[str, float]]: ...

    def __len__(self) -> int: ...


def add_many(retriever: Retriever, items: Iterable[tuple[str, str]]) -> None:
    """Add many items, through the retriever's batched `add_many` when it has one."""
    batched = getattr(retriever, "add_many", None)
    if batched is not None:
        batched(items)
        return
    for doc_id, text in items:
        retriever.add(doc_id, text)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest scores, best first (ties: lower position first)."""
    if k <= 0 or scores.size == 0:
        return np.empty(0, dtype=np.int64)
    if k < scores.size:
        part = np.argpartition(-scores, k - 1)[:k]
    else:
        part = np.arange(scores.size)
    return part[np.lexsort((part, -scores[part]))]
