"""Retrieval over memory entries or raw chunks: BM25, dense (faiss), hybrid RRF and two-layer."""

from memalpha.retrieval.base import Retriever, add_many
from memalpha.retrieval.bm25 import BM25Retriever
from memalpha.retrieval.dense import DenseRetriever
from memalpha.retrieval.embedder import Embedder, TextEncoder, load_embedder
from memalpha.retrieval.hybrid import HybridRetriever, reciprocal_rank_fusion
from memalpha.retrieval.memory_index import ChunkIndex, MemoryIndex, make_retriever
from memalpha.retrieval.two_layer import TwoLayerRetriever

__all__ = [
    "BM25Retriever",
    "ChunkIndex",
    "DenseRetriever",
    "Embedder",
    "HybridRetriever",
    "MemoryIndex",
    "Retriever",
    "TextEncoder",
    "TwoLayerRetriever",
    "add_many",
    "load_embedder",
    "make_retriever",
    "reciprocal_rank_fusion",
]
