"""Writer and reader views: content, priorities and token budgets."""

import re

import pytest

from memalpha.memory import (
    MEMALPHA_SCHEMA,
    PERSONA_SCHEMA,
    MemoryStore,
    reader_view,
    writer_view,
)
from memalpha.tokens import regex_token_count


def overlap_search(store):
    """search(section, query, k): entries ranked by shared words with the query (ties: older first)."""

    def search(section, query, k):
        words = set(re.findall(r"\w+", query.lower()))
        scored = [(len(words & set(re.findall(r"\w+", e.content.lower()))), e.id) for e in store.entries(section)]
        return [entry_id for score, entry_id in sorted(scored, key=lambda s: -s[0]) if score > 0][:k]

    return search


def shown_ids(view):
    return re.findall(r"^- ([a-z]+-\d+):", view, flags=re.M)


@pytest.fixture
def store():
    store = MemoryStore(MEMALPHA_SCHEMA)
    store.update("core", None, "Alice is a teacher in Lyon.", 0)
    store.insert("semantic", "Alice's cat is called Miso.", 0)
    for i in range(30):
        store.insert("semantic", f"Filler fact number {i} about weather.", i + 1)
        store.insert("episodic", f"Day {i}: Alice went to work.", i + 1)
    return store


def test_writer_view_shows_core_newest_and_relevant_old_entries(store):
    view = writer_view(store, "Miso the cat was sick today.", overlap_search(store), budget_tokens=1024, newest=3, relevant=2)
    assert view.startswith("[core]\nAlice is a teacher in Lyon.")
    ids = shown_ids(view)
    assert "sem-1" in ids  # old but relevant
    assert {"sem-60", "sem-58", "sem-56", "epi-61", "epi-59", "epi-57"} <= set(ids)  # newest 3 of each list
    assert len(ids) == len(set(ids))
    assert "- sem-1: Alice's cat is called Miso." in view


def test_entries_are_shown_in_memory_order_under_section_headers(store):
    view = writer_view(store, "cat", overlap_search(store), newest=2, relevant=1)
    semantic = view.split("[semantic]\n")[1].split("\n\n")[0]
    assert shown_ids(semantic) == ["sem-1", "sem-58", "sem-60"]
    assert view.index("[semantic]") < view.index("[episodic]")


def test_writer_view_without_search_shows_only_newest(store):
    ids = shown_ids(writer_view(store, "Miso the cat", None, newest=2, relevant=5))
    assert sorted(ids) == ["epi-59", "epi-61", "sem-58", "sem-60"]


def test_entry_both_newest_and_relevant_is_shown_once():
    store = MemoryStore(MEMALPHA_SCHEMA)
    store.insert("semantic", "Alice likes tea.", 0)
    view = writer_view(store, "tea", overlap_search(store), newest=5, relevant=5)
    assert shown_ids(view) == ["sem-1"]


@pytest.mark.parametrize("budget", [40, 64, 100, 200, 400])
def test_writer_view_respects_budget_and_drops_low_priority_first(store, budget):
    view = writer_view(store, "Miso the cat", overlap_search(store), budget_tokens=budget, newest=5, relevant=5)
    assert regex_token_count(view) <= budget
    ids = shown_ids(view)
    if ids:  # the newest entry of the first list has the highest priority
        assert "sem-60" in ids
    full = shown_ids(writer_view(store, "Miso the cat", overlap_search(store), budget_tokens=10_000, newest=5, relevant=5))
    assert set(ids) <= set(full)


def test_budget_holds_with_a_counter_that_counts_newlines():
    def count(text):  # not additive over joined lines: every line break is a token
        return regex_token_count(text) + text.count("\n")

    store = MemoryStore(MEMALPHA_SCHEMA, count_tokens=count)
    for i in range(40):
        store.insert("semantic", f"fact {i} " * 5, i)
    for budget in (30, 77, 150):
        view = writer_view(store, "fact", None, budget_tokens=budget, newest=20)
        assert 0 < count(view) <= budget


def test_core_longer_than_budget_is_cut():
    store = MemoryStore(MEMALPHA_SCHEMA)
    store.update("core", None, " ".join(f"w{i}" for i in range(300)), 0)
    store.insert("semantic", "a fact", 0)
    view = writer_view(store, "", None, budget_tokens=64)
    assert view.startswith("[core]\nw0 w1") and regex_token_count(view) <= 64


def test_empty_memory_view():
    assert writer_view(MemoryStore(MEMALPHA_SCHEMA), "anything") == "[core]\n(empty)"


def test_stale_ids_from_search_are_skipped(store):
    view = writer_view(store, "x", lambda section, query, k: ["sem-999", "epi-1"], newest=0, relevant=3)
    assert shown_ids(view) == []  # epi-1 is not in the section searched first; sem-999 does not exist
    view = writer_view(store, "x", lambda section, query, k: [f"{section[:3]}-999"], newest=1, relevant=3)
    assert sorted(shown_ids(view)) == ["epi-61", "sem-60"]


def test_multiline_content_is_rendered_on_one_line():
    store = MemoryStore(MEMALPHA_SCHEMA)
    store.insert("semantic", "line one\nline two", 0)
    assert "- sem-1: line one line two" in writer_view(store, "")


def test_reader_view_shows_core_and_retrieved_entries(store):
    view = reader_view(store, "What is Alice's cat called?", overlap_search(store), budget_tokens=2048, top_k=3)
    assert view.startswith("[core]\nAlice is a teacher in Lyon.")
    ids = shown_ids(view)
    assert ids[0] == "sem-1" and len(ids) <= 6 and "Miso" in view


def test_reader_view_budget_and_fallback_without_search(store):
    for budget in (50, 120):
        view = reader_view(store, "cat Miso weather work", overlap_search(store), budget_tokens=budget, top_k=20)
        assert regex_token_count(view) <= budget and "[core]" in view
    ids = shown_ids(reader_view(store, "cat", None, top_k=2))
    assert sorted(ids) == ["epi-59", "epi-61", "sem-58", "sem-60"]


def test_persona_views():
    store = MemoryStore(PERSONA_SCHEMA)
    store.insert("values", "Values honesty.", 0)
    store.insert("physiology_health", "Allergic to peanuts.", 1)
    view = reader_view(store, "peanuts allergy", overlap_search(store), top_k=5)
    assert "[physiology_health]\n- phy-2: Allergic to peanuts." in view and "val-1" not in view
    assert "[values]\n- val-1: Values honesty." in writer_view(store, "", None)


