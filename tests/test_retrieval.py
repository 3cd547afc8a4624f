"""Retrievers over (doc_id, text): ranking, sync under edits, fusion, two-layer, and MemoryIndex."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from memalpha.config import RetrievalConfig
from memalpha.memory.schema import MEMALPHA_SCHEMA, PERSONA_SCHEMA
from memalpha.memory.store import MemoryStore
from memalpha.retrieval import (
    BM25Retriever,
    ChunkIndex,
    DenseRetriever,
    HybridRetriever,
    MemoryIndex,
    TwoLayerRetriever,
    load_embedder,
    make_retriever,
    reciprocal_rank_fusion,
)

DOCS = {
    "d1": "Alice moved to Lisbon in March 2023 for a new job.",
    "d2": "Bob's favourite food is pizza with anchovies.",
    "d3": "The team meeting was moved from Monday to Thursday.",
    "d4": "Carol adopted a grey cat named Pixel.",
    "d5": "The quarterly budget review is due next week.",
}


@pytest.fixture(scope="module")
def embedder():
    """The real packaged all-MiniLM-L6-v2, loaded once for this module."""
    return load_embedder("all-MiniLM-L6-v2")


def _filled(retriever):
    for doc_id, text in DOCS.items():
        retriever.add(doc_id, text)
    return retriever


def test_bm25_ranks_the_right_document_first():
    r = _filled(BM25Retriever())
    assert r.search("Where did Alice move?", 3)[0][0] == "d1"
    assert r.search("what pet does carol have, a cat?", 3)[0][0] == "d4"
    assert r.search("pizza", 5) == [("d2", pytest.approx(r.search("pizza", 5)[0][1]))]  # only docs sharing a term


def test_bm25_stems_and_keeps_numbers():
    r = _filled(BM25Retriever())
    assert r.search("moving", 5)[0][0] in {"d1", "d3"}  # "moving" -> "move" matches "moved"
    assert [d for d, _ in r.search("2023", 5)] == ["d1"]


def test_bm25_stays_in_sync_after_update_and_remove():
    r = _filled(BM25Retriever())
    r.search("pizza", 1)
    r.update("d2", "Bob now prefers sushi to everything else.")
    assert r.search("pizza", 5) == []
    assert r.search("sushi", 5)[0][0] == "d2"
    r.remove("d1")
    assert all(d != "d1" for d, _ in r.search("Alice Lisbon", 5))
    assert len(r) == 4
    with pytest.raises(KeyError):
        r.remove("d1")
    with pytest.raises(KeyError):
        r.add("d2", "again")


def test_bm25_does_not_rebuild_between_repeated_queries():
    r = _filled(BM25Retriever())
    for _ in range(5):
        r.search("Alice", 2)
    assert r.rebuilds == 1
    r.add("d6", "Alice likes tea")
    r.search("Alice", 2)
    assert r.rebuilds == 2


def test_bm25_rebuilds_log_nothing_under_a_root_debug_handler(caplog):
    caplog.set_level(logging.DEBUG)
    _filled(BM25Retriever()).search("Alice", 2)
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]


def test_bm25_empty_and_unknown_queries():
    r = BM25Retriever()
    assert r.search("anything", 3) == []
    _filled(r)
    assert r.search("the of and", 3) == []  # only stopwords
    assert r.search("zeppelin", 3) == []


def test_dense_finds_a_paraphrase_and_syncs(embedder):
    r = _filled(DenseRetriever(embedder))
    assert r.search("Which city did Alice relocate to?", 1)[0][0] == "d1"
    assert r.search("Carol's kitten", 1)[0][0] == "d4"
    before = dict(r.search("Carol's kitten", 5))["d4"]
    r.update("d4", "Carol sold her bicycle last summer.")
    after = dict(r.search("Carol's kitten", 5))["d4"]
    expected = float(embedder.encode(["Carol's kitten"])[0] @ embedder.encode(["Carol sold her bicycle last summer."])[0])
    assert after == pytest.approx(expected, abs=1e-5) and after < before
    r.remove("d1")
    assert "d1" not in [d for d, _ in r.search("Which city did Alice relocate to?", 5)]
    assert len(r) == 4 and r.index.ntotal == 4


def test_dense_vectors_stay_aligned_with_ids():
    class Unit:
        dim = 4

        def encode(self, texts):
            raise AssertionError("not used")

    r = DenseRetriever(Unit())
    eye = np.eye(4, dtype=np.float32)
    r.add_vectors(["a", "b", "c"], eye[:3])
    r.update_vector("a", eye[3])
    r.remove("b")
    assert r.search_vector(eye[3], 1) == [("a", pytest.approx(1.0))]
    assert r.search_vector(eye[2], 1)[0][0] == "c"
    assert {d for d, _ in r.search_vector(eye[1], 5)} == {"a", "c"}
    assert r.index.ntotal == 2
    with pytest.raises(ValueError):
        r.add_vectors(["d"], np.ones((1, 3), dtype=np.float32))


def test_reciprocal_rank_fusion_worked_example():
    fused = dict(reciprocal_rank_fusion([["a", "b"], ["b", "c"]], rrf_k=60))
    assert fused["b"] == pytest.approx(1 / 62 + 1 / 61)
    assert fused["a"] == pytest.approx(1 / 61)
    assert fused["c"] == pytest.approx(1 / 62)
    assert list(fused) == ["b", "a", "c"]


def test_hybrid_combines_lexical_and_dense(embedder):
    r = _filled(HybridRetriever(BM25Retriever(), DenseRetriever(embedder), rrf_k=60))
    assert r.search("Which city did Alice relocate to?", 1)[0][0] == "d1"
    assert r.search("anchovies", 1)[0][0] == "d2"
    r.remove("d2")
    assert "d2" not in [d for d, _ in r.search("anchovies", 5)]
    assert len(r) == 4


def test_two_layer_chooses_sections_then_entries():
    two = TwoLayerRetriever(
        BM25Retriever(),
        sections_per_query=1,
        descriptions={"health": "Health, sleep, exercise", "work": "Job, skills, projects"},
    )
    two.add("h1", "User runs 5 km every morning", section="health")
    two.add("h2", "User sleeps badly before deadlines", section="health")
    two.add("w1", "User works as a data engineer on deadlines", section="work")
    assert two.choose_sections("how much does the user exercise and sleep?") == ["health"]
    hits = [d for d, _ in two.search("sleep deadlines", 5)]
    assert set(hits) <= {"h1", "h2"} and hits[0] == "h2"
    assert [d for d, _ in two.search("deadlines", 5, sections=["work"])] == ["w1"]
    two.remove("h2")
    two.update("h1", "User quit running")
    assert two.choose_sections("job projects") == ["work"]


def test_memory_index_stays_in_sync_with_store_edits():
    store = MemoryStore(MEMALPHA_SCHEMA)
    store.insert("semantic", "Alice is allergic to peanuts.", 0)
    index = MemoryIndex(store, RetrievalConfig(method="bm25"))  # indexes existing entries
    ins = store.insert("episodic", "On 2024-05-02 Alice visited Porto with Bob.", 1)
    sem = store.insert("semantic", "Bob works at a bakery.", 1)
    assert index.search("semantic", "peanut allergy") == [store.entries("semantic")[0].id]
    assert index.search("episodic", "when did Alice visit Porto", 3) == [ins.entry_id]
    store.update("semantic", sem.entry_id, "Bob works at a bank.", 2)
    assert index.search("semantic", "bakery", 5) == []
    assert index.search("semantic", "bank", 5) == [sem.entry_id]
    store.delete("episodic", ins.entry_id, 3)
    assert index.search_all("Porto", 5) == {"semantic": [], "episodic": []}
    assert len(index) == store.entry_count() == 2
    with pytest.raises(KeyError):
        index.search("core", "anything")


def test_memory_index_two_layer_skips_unchosen_sections():
    store = MemoryStore(PERSONA_SCHEMA)
    store.insert("physiology_health", "User has asthma and avoids running in cold air.", 0)
    store.insert("resource_economic", "User rents a flat for 900 euros a month.", 0)
    index = MemoryIndex(store, RetrievalConfig(method="two_layer", sections_per_query=1))
    found = index.search_all("does the user have asthma", 5)
    assert found["physiology_health"] and not found["resource_economic"]
    assert index.search("resource_economic", "does the user have asthma", 5) == []
    store.insert("resource_economic", "User has asthma medication costs of 30 euros.", 1)
    assert sum(len(v) for v in index.search_all("asthma", 5).values()) == 1


def test_memory_index_dense_with_given_embedder(embedder):
    store = MemoryStore(MEMALPHA_SCHEMA)
    index = MemoryIndex(store, RetrievalConfig(method="hybrid"), embedder=embedder)
    a = store.insert("semantic", "Alice relocated to Lisbon.", 0)
    store.insert("semantic", "Bob's favourite food is pizza.", 0)
    assert index.search("semantic", "Which city does Alice live in now?", 1) == [a.entry_id]


def test_make_retriever_by_method(embedder):
    assert isinstance(make_retriever(RetrievalConfig(method="bm25")), BM25Retriever)
    assert isinstance(make_retriever(RetrievalConfig(method="dense"), embedder), DenseRetriever)
    assert isinstance(make_retriever(RetrievalConfig(method="hybrid"), embedder), HybridRetriever)


def test_chunk_index_returns_positions_in_reading_order():
    chunks = ["We talked about the weather.", "Alice said she moved to Lisbon.", "Lisbon is sunny; Alice loves it."]
    index = ChunkIndex(chunks, RetrievalConfig(method="bm25"))
    assert set(index.search("Alice Lisbon", 2)) == {1, 2}
    assert index.top_chunks("Alice Lisbon", 2) == chunks[1:]


def test_embedder_cache_and_normalisation(embedder):
    vectors = embedder.encode(["hello there", "hello there", "general kenobi"])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(vectors[0], vectors[1])


def test_dense_embeds_pending_writes_in_one_batch(embedder):
    class Counting:
        dim = embedder.dim

        def __init__(self):
            self.batches = []

        def encode(self, texts):
            self.batches.append(list(texts))
            return embedder.encode(texts)

    counting = Counting()
    r = DenseRetriever(counting)
    r.add("a", "Alice moved to Lisbon.")
    r.add("b", "Bob likes pizza.")
    r.update("b", "Bob likes sushi.")
    r.add("c", "temporary")
    r.remove("c")
    assert len(r) == 2 and counting.batches == []
    assert r.search("Who likes sushi?", 1)[0][0] == "b"
    # the query, then one batch for all pending writes with only the latest text of each
    assert counting.batches == [["Who likes sushi?"], ["Alice moved to Lisbon.", "Bob likes sushi."]]
    r.update("a", "Alice moved to Madrid.")
    assert r.search("Madrid", 1)[0][0] == "a" and r.index.ntotal == 2
