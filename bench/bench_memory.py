"""Memory and retrieval benchmark: tool-call throughput, retrieval latency, index-sync throughput.

Synthetic entries are Zipf-distributed words with names and numbers (like memory facts); queries mix
words of one entry with common words. Dense numbers use random unit vectors so that index operations
are measured apart from the encoder; the encoder's own throughput is measured separately.

    python -m bench.bench_memory            # writes bench/results/memory.json and memory.md
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import numpy as np

from memalpha.config import RetrievalConfig
from memalpha.env.parsing import parse_tool_calls
from memalpha.env.tools import execute_text
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.memory.store import MemoryStore
from memalpha.retrieval import BM25Retriever, DenseRetriever, Embedder, MemoryIndex

SIZES = (1_000, 10_000, 100_000)
QUERIES = 200
DIM = 384
TARGETS = {"bm25_p50_ms_at_100k": 5.0, "inserts_100k_seconds": 10.0}


class Corpus:
    """Deterministic synthetic memory entries and questions."""

    def __init__(self, seed: int = 0, vocab: int = 20_000):
        self.rng = np.random.default_rng(seed)
        self.words = np.array([f"w{i}" for i in range(vocab)])
        ranks = np.arange(1, vocab + 1)
        self.p = (1 / ranks**1.1) / (1 / ranks**1.1).sum()
        self.names = [f"Person{i}" for i in range(500)]

    def entry(self, i: int) -> str:
        n = int(self.rng.integers(8, 20))
        words = " ".join(self.rng.choice(self.words, size=n, p=self.p))
        return f"{self.names[i % len(self.names)]} {words} {int(self.rng.integers(0, 3000))}"

    def sentence(self, i: int) -> str:
        """An English memory entry (~25 word pieces), for the encoder: its cost depends on text length."""
        return (
            f"On day {i % 365} {self.names[i % len(self.names)]} told the assistant that they moved to city "
            f"{i % 97} and started a new job as a {('nurse', 'teacher', 'baker', 'pilot')[i % 4]}."
        )

    def entries(self, n: int) -> list[str]:
        return [self.entry(i) for i in range(n)]

    def query(self, entries: list[str]) -> str:
        source = entries[int(self.rng.integers(len(entries)))].split()
        picked = self.rng.choice(source, size=min(3, len(source)), replace=False).tolist()
        common = self.rng.choice(self.words, size=3, p=self.p).tolist()
        return "what about " + " ".join(picked + common) + "?"


def _ms_percentiles(times: list[float]) -> dict[str, float]:
    ms = np.asarray(times) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)), "mean_ms": float(ms.mean())}


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_tool_calls(corpus: Corpus, outputs: int = 2_000) -> dict[str, float]:
    """Writer outputs of 4 calls each (inserts, an update, a delete; 1 in 10 outputs malformed)."""
    texts = []
    for t in range(outputs):
        lines = [json.dumps({"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": corpus.entry(t)}})]
        lines.append(json.dumps({"name": "memory_insert", "arguments": {"memory_type": "episodic", "content": corpus.entry(t + 1)}}))
        lines.append(json.dumps({"name": "memory_update", "arguments": {"memory_type": "semantic", "memory_id": f"sem-{2 * t + 1}", "new_content": corpus.entry(t + 2)}}))
        lines.append(json.dumps({"name": "memory_delete", "arguments": {"memory_type": "episodic", "memory_id": f"epi-{2 * t + 2}"}}))
        if t % 10 == 9:
            lines[0] = lines[0][:-5]  # truncated JSON: repaired or reported
        texts.append("\n".join(lines))
    calls = sum(len(p.calls) + len(p.errors) for p in map(parse_tool_calls, texts))  # each error is one failed call
    parse_s = _time(lambda: [parse_tool_calls(t) for t in texts])
    store = MemoryStore(MEMALPHA_SCHEMA)
    executed = 0

    def execute() -> None:
        nonlocal executed
        for chunk, text in enumerate(texts):
            executed += sum(r.ok for r in execute_text(store, text, chunk)[1])

    exec_s = _time(execute)
    index_store = MemoryStore(MEMALPHA_SCHEMA)
    MemoryIndex(index_store, RetrievalConfig(method="bm25"))
    indexed_s = _time(lambda: [execute_text(index_store, text, c) for c, text in enumerate(texts)])
    return {
        "outputs": outputs,
        "calls": int(calls),
        "executed_ok": executed,
        "parse_calls_per_s": calls / parse_s,
        "parse_and_execute_calls_per_s": calls / exec_s,
        "parse_execute_with_bm25_index_calls_per_s": calls / indexed_s,
    }


def bench_bm25(corpus: Corpus, entries: list[str], n: int) -> dict[str, float]:
    retriever = BM25Retriever()
    add_s = _time(lambda: [retriever.add(f"e-{i}", entries[i]) for i in range(n)])
    queries = [corpus.query(entries[:n]) for _ in range(QUERIES)]
    build_s = _time(lambda: retriever.search(queries[0], 20))  # the first search after writes rebuilds
    times = [_time(lambda q=q: retriever.search(q, 20)) for q in queries]
    edit_then_search = [_time(lambda i=i: (retriever.update(f"e-{i}", entries[-i - 1]), retriever.search(queries[i], 20))) for i in range(5)]
    return {"entries": n, "add_s": add_s, "first_search_rebuild_s": build_s, **_ms_percentiles(times), "search_after_edit_mean_s": float(np.mean(edit_then_search))}


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


class _NoEncoder:
    """Dense retrievers here only see precomputed vectors; encoding is measured separately."""

    dim = DIM

    def encode(self, texts):
        raise RuntimeError("bench_memory feeds precomputed vectors")


def bench_dense(n: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    vectors = _unit(rng, n)
    retriever = DenseRetriever(_NoEncoder())
    ids = [f"e-{i}" for i in range(n)]
    add_s = _time(lambda: [retriever.add_vectors([ids[i]], vectors[i : i + 1]) for i in range(n)])
    queries = _unit(rng, QUERIES)
    times = [_time(lambda q=q: retriever.search_vector(q, 20)) for q in queries]
    return {"entries": n, "one_by_one_insert_s": add_s, **_ms_percentiles(times)}


def bench_sync(n: int = 100_000, edits: int = 10_000, seed: int = 1) -> dict[str, float]:
    """Insert n entries one by one, then update and delete `edits` each; faiss kept in sync."""
    rng = np.random.default_rng(seed)
    vectors = _unit(rng, n + edits)
    retriever = DenseRetriever(_NoEncoder())
    ids = [f"e-{i}" for i in range(n)]
    insert_s = _time(lambda: [retriever.add_vectors([ids[i]], vectors[i : i + 1]) for i in range(n)])
    update_s = _time(lambda: [retriever.update_vector(ids[i], vectors[n + i]) for i in range(edits)])
    delete_s = _time(lambda: [retriever.remove(ids[-i - 1]) for i in range(edits)])
    flush_s = _time(retriever.sync)  # applies the queued removals in one remove_ids pass
    assert retriever.index.ntotal == len(retriever) == n - edits
    probe = retriever.search_vector(vectors[n + 3], 1)
    assert probe[0][0] == ids[3], "updated vector not found under its id"
    return {
        "entries": n,
        "edits": edits,
        "inserts_per_s": n / insert_s,
        "insert_total_s": insert_s,
        "updates_per_s": edits / update_s,
        "deletes_per_s": edits / delete_s,
        "flush_removals_s": flush_s,
        "updates_and_deletes_incl_flush_per_s": 2 * edits / (update_s + delete_s + flush_s),
    }


def bench_store_with_bm25(corpus: Corpus, entries: list[str]) -> dict[str, float]:
    """100K MemoryStore inserts with a BM25 MemoryIndex listening, then one search (rebuild)."""
    store = MemoryStore(MEMALPHA_SCHEMA)
    index = MemoryIndex(store, RetrievalConfig(method="bm25"))
    insert_s = _time(lambda: [store.insert("semantic", text, 0) for text in entries])
    rebuild_s = _time(lambda: index.search("semantic", corpus.query(entries), 20))
    assert len(index) == store.entry_count()
    return {"entries": len(entries), "insert_total_s": insert_s, "inserts_per_s": len(entries) / insert_s, "first_search_rebuild_s": rebuild_s}


def bench_embedding(corpus: Corpus, n: int = 1024) -> dict[str, float]:
    """The real all-MiniLM-L6-v2 encoder (cache off) on English entries: batch throughput, one-query latency."""
    embedder = Embedder(cache_size=0)  # no cache: every text is encoded
    texts = [corpus.sentence(i) for i in range(n)]
    embedder.encode(texts[:64])  # warm-up
    batch_s = _time(lambda: embedder.encode(texts))
    single = [_time(lambda i=i: embedder.encode([f"question {i} about {texts[i]}"])) for i in range(50)]
    rate = n / batch_s
    return {"texts": n, "batch_size": embedder.batch_size, "texts_per_s": rate, "est_100k_entries_s": 100_000 / rate, **{f"query_{k}": v for k, v in _ms_percentiles(single).items()}}


def run() -> dict[str, Any]:
    """All measurements of this benchmark."""
    corpus = Corpus()
    entries = corpus.entries(max(SIZES))
    results: dict[str, Any] = {"threads": {"cpus": len(os.sched_getaffinity(0)), "load_average_1m_at_start": round(os.getloadavg()[0], 2)}}
    results["tool_calls"] = bench_tool_calls(corpus)
    results["bm25"] = {str(n): bench_bm25(corpus, entries, n) for n in SIZES}
    results["dense_random_vectors"] = {str(n): bench_dense(n) for n in SIZES}
    results["dense_sync_random_vectors"] = bench_sync()
    results["store_insert_with_bm25_index"] = bench_store_with_bm25(corpus, entries)
    results["embedding_minilm"] = bench_embedding(corpus)
    bm25_p50 = results["bm25"][str(max(SIZES))]["p50_ms"]
    results["targets"] = {
        "bm25_p50_ms_at_100k": {"target": TARGETS["bm25_p50_ms_at_100k"], "measured": bm25_p50, "met": bm25_p50 < TARGETS["bm25_p50_ms_at_100k"]},
        "store_100k_inserts_with_bm25_s": {
            "target": TARGETS["inserts_100k_seconds"],
            "measured": results["store_insert_with_bm25_index"]["insert_total_s"],
            "met": results["store_insert_with_bm25_index"]["insert_total_s"] < TARGETS["inserts_100k_seconds"],
        },
        "faiss_100k_inserts_s": {
            "target": TARGETS["inserts_100k_seconds"],
            "measured": results["dense_sync_random_vectors"]["insert_total_s"],
            "met": results["dense_sync_random_vectors"]["insert_total_s"] < TARGETS["inserts_100k_seconds"],
        },
    }
    return results


def to_markdown(r: dict[str, Any]) -> str:
    """Human-readable tables of `run()`'s results."""
    f = lambda x: f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3g}"  # noqa: E731
    tc = r["tool_calls"]
    lines = [
        "# Memory and retrieval benchmark",
        "",
        f"CPUs: {r['threads']['cpus']}; 1-minute load average at the start: {r['threads']['load_average_1m_at_start']} "
        "(the machine is shared; a load above the CPU count inflates every time below). "
        f"Queries per size: {QUERIES}, top-20.",
        "",
        "## Targets",
        "",
        "| target | limit | measured | met |",
        "|---|---|---|---|",
        *[f"| {k} | {v['target']} | {f(v['measured'])} | {'yes' if v['met'] else 'NO'} |" for k, v in r["targets"].items()],
        "",
        "## Tool calls (parse_tool_calls + execute_text on a MemoryStore)",
        "",
        f"{tc['outputs']} outputs, {tc['calls']} calls ({tc['executed_ok']} executed ok).",
        "",
        "| stage | calls/s |",
        "|---|---|",
        f"| parse only | {f(tc['parse_calls_per_s'])} |",
        f"| parse + execute | {f(tc['parse_and_execute_calls_per_s'])} |",
        f"| parse + execute + BM25 MemoryIndex in sync | {f(tc['parse_execute_with_bm25_index_calls_per_s'])} |",
        "",
        "## Query latency (ms)",
        "",
        "| entries | BM25 p50 | BM25 p95 | dense p50 | dense p95 | BM25 rebuild after writes (s) |",
        "|---|---|---|---|---|---|",
    ]
    for n in r["bm25"]:
        b, d = r["bm25"][n], r["dense_random_vectors"][n]
        lines.append(f"| {int(n):,} | {f(b['p50_ms'])} | {f(b['p95_ms'])} | {f(d['p50_ms'])} | {f(d['p95_ms'])} | {f(b['first_search_rebuild_s'])} |")
    s, st, e = r["dense_sync_random_vectors"], r["store_insert_with_bm25_index"], r["embedding_minilm"]
    lines += [
        "",
        "Dense latency excludes encoding the query (see the encoder below).",
        "",
        "## Index sync throughput",
        "",
        "| operation | rate |",
        "|---|---|",
        f"| faiss inserts, one call per entry, precomputed random vectors ({s['entries']:,}) | {f(s['inserts_per_s'])}/s ({f(s['insert_total_s'])} s total) |",
        f"| faiss updates (new vector, old queued for removal) | {f(s['updates_per_s'])}/s |",
        f"| faiss deletes (queued) | {f(s['deletes_per_s'])}/s |",
        f"| one batched remove_ids of {2 * s['edits']:,} stale vectors | {f(s['flush_removals_s'])} s |",
        f"| updates + deletes including the flush | {f(s['updates_and_deletes_incl_flush_per_s'])}/s |",
        f"| MemoryStore inserts with a BM25 MemoryIndex listening ({st['entries']:,}) | {f(st['inserts_per_s'])}/s ({f(st['insert_total_s'])} s total; first search rebuilds in {f(st['first_search_rebuild_s'])} s) |",
        "",
        "## Embedding (real all-MiniLM-L6-v2 on CPU, measured separately)",
        "",
        f"{e['texts']} English entries, batch {e['batch_size']}: {f(e['texts_per_s'])} texts/s, so about {f(e['est_100k_entries_s'])} s to embed 100K entries. "
        f"One query: p50 {f(e['query_p50_ms'])} ms, p95 {f(e['query_p95_ms'])} ms.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    """Run and write bench/results/memory.json and memory.md."""
    from bench.run_all import write_results

    results = run()
    json_path, md_path = write_results("memory", results, to_markdown(results))
    print(md_path.read_text())


if __name__ == "__main__":
    main()
