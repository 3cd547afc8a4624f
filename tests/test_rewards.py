"""Reward components on real tool executions, the rule judge, and the skip-everything loophole."""

from __future__ import annotations

import json

import pytest

from memalpha.config import RewardConfig
from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.env.tools import execute_text
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.memory.store import MemoryStore
from memalpha.models.judges import JudgeItem, parse_verdict
from memalpha.rewards.judge import (
    JudgeContext,
    fits_memory_type,
    is_meta,
    is_placeholder,
    llm_verdicts,
    rule_judge,
    rule_verdicts,
)
from memalpha.rewards.rubric import chunk_rewards, compression
from memalpha.text import keeps_subject

CFG = RewardConfig(beta=0.05, gamma=0.1)


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def insert(memory_type: str, content: str) -> str:
    return call("memory_insert", memory_type=memory_type, content=content)


def run(outputs: list[str]):
    """Execute one writer output per chunk on a fresh memory: (store, results per chunk, nothing flags)."""
    store = MemoryStore(MEMALPHA_SCHEMA)
    results, flags = [], []
    for t, text in enumerate(outputs):
        parsed, res = execute_text(store, text, t)
        results.append(res)
        flags.append(parsed.nothing_to_store)
    return store, results, flags


def test_components_worked_example():
    store, results, flags = run(
        [
            "\n".join(
                [
                    insert("semantic", "Alice works as a nurse in Porto."),
                    insert("episodic", "On 2024-05-02 Alice visited Lisbon with Bob."),
                    call("memory_delete", memory_type="semantic", memory_id="sem-99"),  # unknown id: fails
                    insert("semantic", "INVALID"),  # executes, but is a placeholder
                ]
            )
        ]
    )
    [r] = chunk_rewards(0.5, results, flags, memory_tokens=20, input_tokens=100, cfg=CFG, memory=store)
    assert (r.calls, r.executed, r.valid) == (4, 3, 2)
    assert r.r1 == 0.5
    assert r.r2 == pytest.approx(3 / 4)
    assert r.r3 == pytest.approx(1 - 20 / 100)
    assert r.r4 == pytest.approx(2 / 4)
    assert r.total == pytest.approx(0.5 + 0.75 + 0.05 * 0.8 + 0.1 * 0.5)


def test_r1_and_r3_are_shared_r2_r4_per_chunk():
    store, results, flags = run(
        [insert("semantic", "Bob owns a bakery in Leeds."), "I think Bob is nice.", insert("core", "x")]
    )
    rewards = chunk_rewards(1.0, results, flags, store.token_count(), 200, CFG, memory=store)
    assert {r.r1 for r in rewards} == {1.0}
    assert len({r.r3 for r in rewards}) == 1
    assert [r.r2 for r in rewards] == [1.0, 0.0, 0.0]  # prose = one failed call; core is a paragraph -> insert fails
    assert [r.r4 for r in rewards] == [1.0, 0.0, 0.0]


def test_r3_is_clipped_and_needs_a_useful_nonempty_memory():
    assert compression(300, 100) == 0.0
    assert compression(0, 0) == 0.0
    store, results, flags = run([insert("semantic", "Bob owns a bakery in Leeds.")])
    assert chunk_rewards(0.0, results, flags, 10, 100, CFG, memory=store)[0].r3 == 0.0  # memory did not help
    assert chunk_rewards(1.0, results, flags, 10, 100, CFG, memory=store)[0].r3 == pytest.approx(0.9)
    assert chunk_rewards(1.0, results, flags, 500, 100, CFG, memory=store)[0].r3 == 0.0  # clipped


def test_skipping_everything_never_beats_a_useful_rollout():
    n = 3
    skip_store, skip_results, skip_flags = run([NOTHING_TO_STORE] * n)
    assert skip_flags == [True] * n and skip_results == [[]] * n and skip_store.token_count() == 0
    generous = RewardConfig(beta=0.05, gamma=0.1, nothing_to_store_r2=1.0)
    # even if the reader guesses right without memory, an empty memory earns no r2, r3 or r4
    for cfg in (CFG, generous):
        skip = chunk_rewards(0.2, skip_results, skip_flags, skip_store.token_count(), 900, cfg)
        assert [(r.r2, r.r3, r.r4) for r in skip] == [(0.0, 0.0, 0.0)] * n
        assert all(r.total == pytest.approx(0.2) for r in skip)

    useful_store, useful_results, useful_flags = run(
        [insert("semantic", "Alice is allergic to peanuts."), NOTHING_TO_STORE, insert("episodic", "Yesterday Alice met Bob in Paris.")]
    )
    useful = chunk_rewards(1.0, useful_results, useful_flags, useful_store.token_count(), 900, generous, memory=useful_store)
    assert [r.r2 for r in useful] == [1.0, 1.0, 1.0]  # the honest skip inside a useful rollout gets the configured credit
    assert useful[1].nothing_to_store and useful[1].r4 == 0.0
    assert sum(r.total for r in useful) > sum(r.total for r in skip)
    default = chunk_rewards(1.0, useful_results, useful_flags, useful_store.token_count(), 900, CFG, memory=useful_store)
    assert default[1].r2 == 0.0  # default nothing_to_store_r2 = 0


def test_unparseable_output_is_one_failed_call():
    store, results, flags = run(["Sure! I will remember that Alice likes tea."])
    [r] = chunk_rewards(1.0, results, flags, 0, 100, CFG, memory=store)
    assert (r.calls, r.executed, r.r2, r.r4) == (1, 0, 0.0, 0.0)
    assert r.total == pytest.approx(1.0)


def test_all_failed_calls_score_zero_r2_and_r4():
    store, results, flags = run(
        [
            "\n".join(
                [
                    call("memory_delete", memory_type="semantic", memory_id="sem-1"),
                    call("memory_forget", memory_type="semantic"),
                    insert("semantic", "   "),
                ]
            )
        ]
    )
    [r] = chunk_rewards(0.0, results, flags, 0, 100, CFG, memory=store)
    assert (r.calls, r.executed, r.valid) == (3, 0, 0)
    assert (r.r2, r.r3, r.r4, r.total) == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("content", ["INVALID", "N/A", "none", "...", "TODO", "<content>", "[fact]", "Lorem ipsum"])
def test_placeholders_are_invalid_writes(content):
    assert is_placeholder(content)
    store, results, flags = run([insert("semantic", content)])
    assert results[0][0].ok  # the store accepts it...
    assert rule_verdicts(results, store) == [[False]]  # ...the judge does not


@pytest.mark.parametrize("content", ["I will remember that Alice likes tea.", "Memory updated.", "Nothing to store in this chunk."])
def test_text_about_the_memory_is_invalid(content):
    assert is_meta(content)
    store, results, _ = run([insert("semantic", content)])
    assert rule_verdicts(results, store) == [[False]]


def test_memory_type_fit():
    assert fits_memory_type("episodic", "On 2024-05-02 Alice visited Porto.")
    assert fits_memory_type("episodic", "Bob adopted a grey cat.")  # past-tense action with an actor
    assert not fits_memory_type("episodic", "The sky is blue.")
    assert fits_memory_type("semantic", "Alice's job: nurse at the city hospital")
    assert not fits_memory_type("semantic", "Alice: I love tea so much!")  # a dialogue line
    assert not fits_memory_type("semantic", "Where does Bob live?")
    assert fits_memory_type("core", "Alice is a nurse in Porto who loves tea and cycling.")
    assert not fits_memory_type("core", "tea")


def test_near_duplicate_insert_is_invalid_but_the_first_copy_is_valid():
    store, results, flags = run(
        [insert("semantic", "Alice works as a nurse in Porto."), insert("semantic", "Alice works as nurse in Porto!")]
    )
    assert all(r.ok for chunk in results for r in chunk)  # not an exact duplicate, so the store accepts it
    assert rule_verdicts(results, store) == [[True], [False]]


def test_noop_update_is_invalid_and_real_update_valid():
    store, results, flags = run(
        [
            insert("semantic", "Alice lives in Lyon."),
            call("memory_update", memory_type="semantic", memory_id="sem-1", new_content="Alice lives in Lyon."),
            call("memory_update", memory_type="semantic", memory_id="sem-1", new_content="Alice now lives in Paris."),
        ]
    )
    assert rule_verdicts(results, store) == [[True], [False], [True]]


def test_an_update_that_replaces_an_unrelated_fact_is_invalid():
    store, results, flags = run(
        [
            "\n".join([insert("semantic", "Pavel lives in Leipzig these days."),
                        insert("episodic", "On 3 May 2023, Pavel had lunch with Gwen.")]),
            "\n".join([
                # misaimed: the city fact is overwritten with an unrelated one
                call("memory_update", memory_type="semantic", memory_id="sem-1", new_content="Gwen plays the oboe in a band."),
                # sharing only a date is no shared subject either
                call("memory_update", memory_type="episodic", memory_id="epi-2", new_content="On 3 May 2023, Gwen bought a van."),
                # a core paragraph is rewritten whole: nothing to aim at
                call("memory_update", memory_type="core", new_content="Conversation between Pavel and Gwen, two friends."),
            ]),
            # aimed: the entry now holds Gwen's instrument, and this changes it
            call("memory_update", memory_type="semantic", memory_id="sem-1",
                 new_content="Gwen switched from the oboe to the mandolin."),
        ]
    )
    assert all(r.ok for chunk in results for r in chunk)
    assert rule_verdicts(results, store) == [[True, True], [False, False, True], [True]]
    assert keeps_subject("Being a translator keeps Nadia busy.", "No longer a translator, Nadia works as a court reporter.")
    assert not keeps_subject("Stellan is moving to Bergen next month.", "Stellan said that work is busy.")


def test_delete_is_valid_only_for_a_duplicate_or_superseded_entry():
    store, results, flags = run(
        [
            "\n".join([insert("semantic", "Alice lives in Lyon."), insert("semantic", "Bob plays the cello.")]),
            insert("semantic", "Alice lives in Paris since June."),
            "\n".join(
                [
                    call("memory_delete", memory_type="semantic", memory_id="sem-1"),  # superseded by sem-3
                    call("memory_delete", memory_type="semantic", memory_id="sem-2"),  # unique information lost
                ]
            ),
        ]
    )
    assert rule_verdicts(results, store) == [[True, True], [True], [True, False]]
    rewards = chunk_rewards(1.0, results, flags, store.token_count(), 100, CFG, memory=store)
    assert rewards[2].r4 == 0.5
    # without the final memory no delete can be justified
    assert rule_verdicts(results)[2] == [False, False]


def test_rule_judge_on_a_failed_result_is_invalid():
    _, results, _ = run([call("memory_delete", memory_type="semantic", memory_id="sem-7")])
    assert rule_judge(results[0][0], JudgeContext()) is False


class ScriptedJudge:
    """An LLM judge stand-in replaying fixed raw verdict texts through the real strict parser."""

    def __init__(self, texts):
        self.texts = list(texts)
        self.items: list[JudgeItem] = []

    def judge(self, items):
        self.items.extend(items)
        return [parse_verdict(self.texts.pop(0)) for _ in items]


def test_llm_verdicts_parse_strictly_and_keep_the_rules():
    store, results, flags = run(
        [
            "\n".join(
                [
                    insert("semantic", "Alice works as a nurse in Porto."),
                    insert("semantic", "Bob plays the cello on weekends."),
                    insert("semantic", "Carol has two sons."),
                    insert("semantic", "INVALID"),
                ]
            )
        ]
    )
    judge = ScriptedJudge(["VALID", "INVALID", "not valid"])
    verdicts = llm_verdicts(results, ["chunk text"], judge, store, {"semantic": "facts"})
    assert verdicts == [[True, False, False, False]]  # "INVALID" never counts; placeholder never reaches the LLM
    assert [i.content for i in judge.items] == [
        "Alice works as a nurse in Porto.",
        "Bob plays the cello on weekends.",
        "Carol has two sons.",
    ]
    [r] = chunk_rewards(1.0, results, flags, 10, 100, CFG, verdicts=verdicts)
    assert r.r4 == 0.25


def test_bad_arguments_are_errors():
    _, results, flags = run([NOTHING_TO_STORE])
    with pytest.raises(ValueError, match="nothing_flags"):
        chunk_rewards(1.0, results, [], 0, 1, CFG)
    with pytest.raises(ValueError, match="qa_score"):
        chunk_rewards(1.5, results, flags, 0, 1, CFG)
    with pytest.raises(ValueError, match="verdicts"):
        chunk_rewards(1.0, results, flags, 0, 1, CFG, verdicts=[[True]])
