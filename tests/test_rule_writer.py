"""The rule-based writer: facts, events, labelled examples, updates, small talk, and its output format."""

from __future__ import annotations

import json

import pytest

from memalpha.config import RunConfig
from memalpha.data.synth import SynthConfig, generate
from memalpha.env.episode import Episode
from memalpha.env.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.env.tools import execute_text
from memalpha.memory.schema import MEMALPHA_SCHEMA, PERSONA_SCHEMA
from memalpha.memory.store import MemoryStore
from memalpha.memory.views import reader_view, view_ids
from memalpha.models.readers import EvidenceReader, ReaderItem
from memalpha.retrieval import MemoryIndex
from memalpha.rewards.judge import rule_verdicts
from memalpha.rewards.qa import score_answer
from memalpha.teacher.rule_writer import RuleWriter, run_rule_writer, third_person
from memalpha.tokens import regex_token_count

HEADER = "The following is a conversation from 9:45 pm on 23 March, 2023. Please remember it.\n\n"


def run(writer: RuleWriter, store: MemoryStore, chunk: str, t: int = 0):
    text = writer.write(chunk, store)
    parsed, results = execute_text(store, text, t)
    return text, parsed, results


def contents(store: MemoryStore) -> str:
    return "\n".join(e.content for _, e in store.all_entries())


def test_facts_become_third_person_statements_in_exact_format():
    store = MemoryStore(MEMALPHA_SCHEMA)
    chunk = HEADER + (
        "Maya: Hi Sam, how are you?\n"
        "Sam: Not much, just the usual.\n"
        "Maya: I work as a pastry chef at Copperleaf Studios.\n"
        "Sam: Wow, I didn't see that coming.\n"
        "Maya: The gate code at my building is 4821, in case you visit.\n"
        "Maya: Our new parrot is called Pickle."
    )
    text, parsed, results = run(RuleWriter(MEMALPHA_SCHEMA), store, chunk)
    lines = text.splitlines()
    for line in lines:  # exactly the taught format: one JSON object a line with name + arguments
        call = json.loads(line)
        assert set(call) == {"name", "arguments"} and call["name"] in ("memory_insert", "memory_update")
    assert parsed.format == "json" and not parsed.errors and all(r.ok for r in results)
    memory = contents(store)
    assert "Maya works as a pastry chef at Copperleaf Studios." in memory
    assert "4821" in memory and "Pickle" in memory
    assert " my " not in f" {memory} " and "Hi Sam" not in memory
    # the core names the speakers and holds the job fact
    assert store.paragraph("core").startswith("Conversation between Maya and Sam.")
    assert "pastry chef" in store.paragraph("core")


def test_events_are_dated_and_go_to_episodic():
    store = MemoryStore(MEMALPHA_SCHEMA)
    chunk = HEADER + "Javier: I signed the contract with Northwind Robotics yesterday.\nPriya: Good for you!"
    run(RuleWriter(MEMALPHA_SCHEMA), store, chunk)
    (entry,) = store.entries("episodic")
    assert entry.content == "On 23 March 2023, Javier signed the contract with Northwind Robotics yesterday."


def test_reported_facts_keep_the_names_as_the_chunk_spells_them():
    # the writer copies what it reads: "said that zoe" would teach a token the chunk never shows
    store = MemoryStore(MEMALPHA_SCHEMA)
    chunk = HEADER + "Zeno: Zoe adopted a hamster named Sherbet.\nAlice: The new gate code is 4821."
    run(RuleWriter(MEMALPHA_SCHEMA), store, chunk)
    memory = contents(store)
    assert "Zeno said that Zoe adopted a hamster named Sherbet." in memory
    assert "Alice said that the new gate code is 4821." in memory


def test_labelled_examples_keep_input_and_label():
    store = MemoryStore(MEMALPHA_SCHEMA)
    chunk = HEADER + (
        'Gwen: Okay, this one: "Heatwave breaks records on Friday". Label 0.\n'
        "Ulla: Yep, same as the others.\n"
        'Gwen: Another example, "Acme Foods announces merger talks today", that\'s category 3.'
    )
    run(RuleWriter(MEMALPHA_SCHEMA), store, chunk)
    memory = contents(store)
    assert 'Label 0 covers inputs like "Heatwave breaks records on Friday"' in memory
    assert 'Label 3 covers inputs like "Acme Foods announces merger talks today"' in memory
    from memalpha.data.schema import Question

    question = Question("q", 'Which label fits "Heatwave breaks records again today"?', ["0"], "classification")
    assert EvidenceReader().answer([ReaderItem(reader_view(store, question.question), question)]) == ["\\boxed{0}"]


def test_changed_fact_updates_the_visible_entry():
    store = MemoryStore(MEMALPHA_SCHEMA)
    writer = RuleWriter(MEMALPHA_SCHEMA)
    run(writer, store, HEADER + "Nadia: I live in Tacoma these days.\nClara: That sounds exciting.")
    (before,) = store.entries("semantic")
    text, _, results = run(writer, store, HEADER + "Nadia: Big news: we moved from Tacoma to Graz!", 1)
    assert json.loads(text.splitlines()[0])["name"] == "memory_update"
    (after,) = store.entries("semantic")
    assert after.id == before.id and "Graz" in after.content
    # not visible to the writer -> no update it could not have made; a new entry instead
    store2 = MemoryStore(MEMALPHA_SCHEMA)
    run(writer, store2, HEADER + "Nadia: I live in Tacoma these days.")
    text = writer.write(HEADER + "Nadia: Big news: we moved from Tacoma to Graz!", store2, visible_ids=set())
    assert all(json.loads(line)["name"] != "memory_update" or json.loads(line)["arguments"]["memory_type"] == "core" for line in text.splitlines())


def test_two_changes_in_one_chunk_keep_only_the_latest():
    store = MemoryStore(MEMALPHA_SCHEMA)
    chunk = HEADER + "Rhea: Sold the teal hatchback, I drive a red camper van now.\nRhea: Sold the red camper van, I drive a orange motorbike now."
    run(RuleWriter(MEMALPHA_SCHEMA), store, chunk)
    (entry,) = store.entries("semantic")
    assert "orange motorbike" in entry.content and "red camper van, " in entry.content


@pytest.mark.parametrize(
    "lines",
    [
        ["Priya: Hi Javier, how are you?", "Javier: Not much, just the usual.", "Priya: Haha, classic."],
        ["Felix: Have you watched anything good lately?", "Jonas: Ugh, don't get me started.", "Felix: Sounds like a plan."],
    ],
)
def test_small_talk_is_nothing_to_store(lines):
    store = MemoryStore(MEMALPHA_SCHEMA)
    text, parsed, results = run(RuleWriter(MEMALPHA_SCHEMA), store, HEADER + "\n".join(lines))
    assert text == NOTHING_TO_STORE and parsed.nothing_to_store and results == []
    assert store.entry_count() == 0


def test_budget_keeps_the_most_valuable_calls():
    store = MemoryStore(MEMALPHA_SCHEMA)
    chunk = HEADER + "Maya: I work as a nurse.\nMaya: I made soup yesterday with Tessa.\nMaya: I adopted a cat named Mochi."
    full = RuleWriter(MEMALPHA_SCHEMA).write(chunk, store)
    short = RuleWriter(MEMALPHA_SCHEMA, max_completion_tokens=40).write(chunk, store)
    assert len(short.splitlines()) < len(full.splitlines())
    assert short and short != NOTHING_TO_STORE and not parse_tool_calls(short).errors


def test_third_person():
    assert third_person("I love my job and I go to the gym", "Maya") == "Maya loves Maya's job and Maya goes to the gym"
    assert third_person("I'm a nurse now; I don't live in Lisbon anymore", "Ana") == "Ana is a nurse now; Ana doesn't live in Lisbon anymore"


def test_persona_schema_writes_to_its_lists():
    store = MemoryStore(PERSONA_SCHEMA)
    text, parsed, results = run(RuleWriter(PERSONA_SCHEMA), store, HEADER + "Maya: I work as a florist at Bluefin Media.\nMaya: I drive a teal hatchback.")
    assert results and all(r.ok for r in results)
    assert [e.content for e in store.entries("cognition_work")] == ["Maya works as a florist at Bluefin Media."]
    assert [e.content for e in store.entries("resource_economic")] == ["Maya drives a teal hatchback."]


def test_visible_ids_read_from_a_rendered_view():
    view = "[semantic]\n- sem-3: a\n- sem-10: b\n[episodic]\n- epi-4: c\nnot - x-1: y"
    assert view_ids(view) == {"sem-3", "sem-10", "epi-4"}


def test_on_synthetic_data_high_evidence_recall_and_valid_calls():
    cfg = RunConfig()
    instances = generate(SynthConfig(instances=16, chunks_per_instance=(4, 6), chunk_tokens=384, seed=5))
    writer = RuleWriter(MEMALPHA_SCHEMA, max_completion_tokens=256)
    scores, valid, ok, skipped = [], [], [], []
    for instance in instances:
        episode = Episode(instance, MEMALPHA_SCHEMA, cfg.memory, cfg.retrieval, regex_token_count)
        steps = run_rule_writer(episode, writer)
        store = episode.store
        index = MemoryIndex(store, cfg.retrieval)
        items = [ReaderItem(reader_view(store, q.question, index.search), q) for q in instance.questions]
        for q, answer in zip(instance.questions, EvidenceReader().answer(items)):
            qtype = {"summary": "long_range_understanding", "classification": "test_time_learning"}.get(q.question_type, "conflict")
            scores.append((instance.competency, score_answer(answer, q.answers, qtype, q.superseded_answers)))
        for step, verdicts in zip(steps, rule_verdicts([s.results for s in steps], store)):
            valid += verdicts
            ok += [r.ok for r in step.results]
            skipped.append(step.parse.nothing_to_store)

    def mean(competency: str) -> float:
        values = [s for c, s in scores if c == competency]
        return sum(values) / len(values)

    assert mean("accurate_retrieval") >= 0.9
    assert mean("conflict_resolution") >= 0.8
    assert mean("test_time_learning") >= 0.6
    assert all(ok) and sum(valid) / len(valid) >= 0.9
    assert 0.1 <= sum(skipped) / len(skipped) <= 0.6  # distractor chunks are skipped, fact chunks are not
