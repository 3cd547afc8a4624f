"""The per-chunk content reward on hand-written completions: content beats format, honest skips are
free, verbatim copies lose to facts, and questions without evidence are attributed (docs/REWARDS.md)."""

import json
from types import SimpleNamespace

import pytest

from memalpha.config import RunConfig
from memalpha.data.schema import Instance, Question
from memalpha.env.episode import Episode, answers_lost
from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.models.readers import EvidenceReader
from memalpha.rewards.coverage import (
    answer_support,
    attribution_credit,
    coverage_chunks,
    retention,
)
from memalpha.rewards.rubric import score_episodes, score_step
from memalpha.tokens import regex_token_count
from memalpha.training.rollout import _new_episodes as new_episodes

CFG = RunConfig()
HEADER = "The following is a conversation from 3 May 2024. Please remember it.\n"
CHUNKS = [
    HEADER + "Maya: Hi Leo, how are you?\nLeo: Fine, thanks.\nMaya: I signed with Northwind Robotics last week.",
    HEADER + "Leo: Lovely weather today.\nMaya: Yes, so sunny and warm.\nLeo: Perfect for a walk.",
    HEADER + "Leo: My sister Ana is visiting.\nMaya: I adopted a parrot named Kiwi.\nLeo: Cute!",
]
QUESTIONS = [
    Question("q0", "Where does Maya work?", ["Northwind Robotics"], "single_hop", [0]),
    Question("q1", "What is the name of Maya's parrot?", ["Kiwi"], "single_hop", [2]),
]


def insert(content: str, section: str = "semantic") -> str:
    return json.dumps({"name": "memory_insert", "arguments": {"memory_type": section, "content": content}})


WRITERS = {
    "facts": [insert("Maya signed with Northwind Robotics in May 2024."), NOTHING_TO_STORE,
              insert("Maya adopted a parrot named Kiwi.")],
    "small_talk": [insert("Maya and Leo greeted each other warmly."), insert("Maya and Leo talked about the sunny weather."),
                   insert("Leo thinks the news is cute.")],
    "skip_all": [NOTHING_TO_STORE] * 3,
    "verbatim": ["\n".join(insert(line) for line in chunk.splitlines()[1:]) for chunk in CHUNKS],
}


def update(memory_id: str, content: str, section: str = "semantic") -> str:
    return json.dumps({"name": "memory_update", "arguments": {"memory_type": section, "memory_id": memory_id,
                                                              "new_content": content}})


def new_episode(questions=QUESTIONS, config=CFG) -> Episode:
    instance = Instance("fixture", "test", "accurate_retrieval", CHUNKS, questions, {})
    return Episode(instance, MEMALPHA_SCHEMA, config.memory, config.retrieval, regex_token_count)


def run(completions: list[str], questions=QUESTIONS, config=CFG):
    episode = new_episode(questions, config)
    for completion in completions:
        episode.step(completion)
    [score] = score_episodes([episode], config, EvidenceReader())
    return score


@pytest.fixture(scope="module")
def scored():
    return {name: run(completions) for name, completions in WRITERS.items()}


def totals(score) -> list[float]:
    return [r.total for r in score.rewards]


def test_storing_the_facts_beats_small_talk_on_every_chunk_with_evidence(scored):
    facts, talk = scored["facts"], scored["small_talk"]
    for t in (0, 2):
        assert facts.rewards[t].holds_evidence and facts.rewards[t].coverage == 1.0
        assert talk.rewards[t].coverage == 0.0 and talk.rewards[t].r2 == 1.0  # well-formed but empty of content
        assert facts.rewards[t].total > talk.rewards[t].total
    assert facts.qa_score == 1.0 and talk.qa_score == 0.0
    assert sum(totals(facts)) > sum(totals(talk))


def test_skipping_a_chunk_without_evidence_scores_like_a_correct_write(scored):
    facts = scored["facts"]
    skip, write = facts.rewards[1], facts.rewards[0]
    assert skip.nothing_to_store and skip.holds_evidence is False
    assert skip.total == pytest.approx(write.total)


def test_skipping_a_chunk_with_evidence_scores_lower(scored):
    skipped, written = scored["skip_all"].rewards[0], scored["facts"].rewards[0]
    assert skipped.coverage == 0.0 and skipped.r2 == 0.0 and skipped.r4 == 0.0
    assert skipped.total < written.total
    assert sum(totals(scored["skip_all"])) < sum(totals(scored["facts"]))


def test_a_verbatim_copy_scores_below_the_facts(scored):
    facts, verbatim = scored["facts"], scored["verbatim"]
    assert verbatim.qa_score == 1.0  # the answers are in there...
    assert verbatim.rewards[0].r3 < facts.rewards[0].r3  # ...at the cost of compression
    assert sum(totals(verbatim)) < sum(totals(facts))


def test_the_rule_writer_ranks_first_on_the_fixture(scored):
    ranked = sorted(scored, key=lambda name: -sum(totals(scored[name])))
    assert ranked[0] == "facts"


def test_attribution_without_evidence_credits_the_chunk_that_wrote_the_entry():
    questions = [Question("q0", "Where does Maya work?", ["Northwind Robotics"], "single_hop", None)]
    completions = [insert("Leo and Maya met for coffee in May 2024."), NOTHING_TO_STORE,
                   insert("Maya works for Northwind Robotics.")]
    for mode in ("whole_if_fits", "retrieve"):
        config = CFG.model_copy(update={"reward": CFG.reward.model_copy(update={"reader_view": mode})})
        score = run(completions, questions, config)
        assert score.qa_score == 1.0
        assert [r.coverage for r in score.rewards] == [0.0, 0.0, 1.0]
        assert all(r.holds_evidence is None for r in score.rewards)


def test_attribution_shares_a_score_over_the_entries_shown():
    assert attribution_credit([1.0, 0.5], [[0, 2], [2]], 3) == pytest.approx([0.25, 0.0, 0.25 + 0.25])
    assert attribution_credit([1.0], [[]], 2) == [0.0, 0.0]


def test_coverage_chunks_are_the_evidence_chunks_that_state_the_answer():
    chunks = ["Maya lived in Oslo.", "Maya moved to Graz.", "Maya likes tea."]
    conflict = Question("q", "Where does Maya live?", ["Graz"], "conflict", [0, 1], ["Oslo"])
    worked_out = Question("q", "How many cities?", ["2"], "multi_hop", [0, 1])
    assert coverage_chunks(conflict, chunks) == [1]
    assert coverage_chunks(worked_out, chunks) == [0, 1]
    assert coverage_chunks(Question("q", "?", ["x"], "single_hop"), chunks) is None


def test_answer_support_gives_partial_credit_and_respects_superseded_values():
    listing = Question("q", "Hobbies?", ["pottery, camping, painting"], "multi_hop", [0])
    assert answer_support(listing, "Maya enjoys pottery and camping.", "", lambda: "") == pytest.approx(2 / 3)
    summary = Question("q", "Summary?", ["garden", "harbour", "violin"], "summary", [0])
    chunk = "We talked about the garden and the harbour."
    assert answer_support(summary, "Notes on the garden.", chunk, lambda: "") == 0.5  # 1 of the 2 it states
    conflict = Question("q", "Where does Maya live?", ["Graz"], "conflict", [1], ["Oslo"])
    assert answer_support(conflict, "Maya lives in Graz.", "", lambda: "- sem-1: Maya lives in Graz.") == 1.0
    assert answer_support(conflict, "Maya lives in Graz.", "", lambda: "- sem-1: Maya lives in Oslo.\n- sem-2: Maya lives in Graz.") == 0.5
    assert answer_support(conflict, "Maya lives in Oslo.", "", lambda: "") == 0.0


def conflict_support(chunks: list[str], completion: str, config=CFG) -> float:
    """Support of "Where does Maya live now?" (Graz, formerly Oslo) for `completion` on the second chunk,
    after a first step that stored Oslo as sem-1."""
    conflict = Question("q", "Where does Maya live now?", ["Graz"], "conflict", [0, 1], ["Oslo"])
    writer = SimpleNamespace(count_tokens=regex_token_count, tokenizer=None)  # a policy, as rollouts see it
    [episode] = new_episodes(writer, [Instance("c", "test", "conflict_resolution", chunks, [conflict], {})], config, 1)
    episode.step(insert("Maya lives in Oslo."))
    return episode.step(completion).support[0]


@pytest.mark.parametrize("credit", [0.5, 0.0])
def test_shadowing_a_stale_entry_earns_the_configured_credit_and_updating_it_earns_all(credit):
    chunks = [HEADER + "Maya: I live in Oslo now.", HEADER + "Maya: I moved to Graz last month."]
    config = CFG.model_copy(update={"reward": CFG.reward.model_copy(update={"shadowed_conflict_credit": credit})})
    assert conflict_support(chunks, insert("Maya lives in Graz."), config) == credit  # Oslo is still asserted beside it
    assert conflict_support(chunks, update("sem-1", "Maya lives in Graz."), config) == 1.0


def test_overwriting_the_stale_entry_with_an_unrelated_fact_does_not_resolve_the_conflict():
    chunks = [HEADER + "Maya: I live in Oslo now.\nLeo: My sister Ana is visiting.",
              HEADER + "Maya: I moved to Graz last month.\nLeo: Ana loves the harbour."]
    aimed = update("sem-1", "Maya moved from Oslo to Graz last month.")
    misaimed = insert("Maya moved to Graz last month.") + "\n" + update("sem-1", "Leo's sister Ana loves the harbour.")
    assert conflict_support(chunks, aimed) == 1.0
    # Oslo is gone from the memory either way, but only the aimed update replaced it
    assert conflict_support(chunks, misaimed) == CFG.reward.shadowed_conflict_credit


def test_the_paper_reward_is_still_expressible(scored):
    paper = CFG.model_copy(update={"reward": CFG.reward.model_copy(update={"coverage_weight": 0.0, "content_gate": False})})
    score = run(WRITERS["facts"], config=paper)
    skip = score.rewards[1]
    assert skip.r2 == 0.0 and skip.r4 == 0.0  # the paper gives a chunk without calls nothing
    write = score.rewards[0]
    assert write.total == pytest.approx(write.r1 + write.r2 + 0.05 * write.r3 + 0.1 * write.r4)


def test_retention_is_the_share_of_earlier_support_left():
    assert retention({}, {}) == 1.0
    assert retention({0: 1.0, 1: 1.0}, {0: 1.0}) == 0.5
    assert retention({0: 1.0, 1: 0.5}, {0: 1.0, 1: 1.0, 2: 1.0}) == 1.0  # gains do not count
    assert retention({0: 1.0, 1: 1.0}, {1: 1.0, 2: 1.0}) == 0.5  # nor make up for a loss


def test_overwriting_a_stored_answer_scores_below_skipping_the_chunk():
    def step_reward(completion, config=CFG):
        episode = new_episode(config=config)
        episode.step(insert("Maya signed with Northwind Robotics in May 2024."))
        step = episode.step(completion)
        return step, score_step(episode, config)

    overwrite = update("sem-1", "Maya and Leo talked about the sunny weather.")
    step, destroyed = step_reward(overwrite)
    assert step.retention == 0.0 and step.memory_support == {}
    skip_step, skipped = step_reward(NOTHING_TO_STORE)
    assert skip_step.retention == 1.0 and skip_step.memory_support == {0: 1.0}
    assert destroyed.coverage == 0.0 and destroyed.r2 == 1.0  # the update ran, and cost the answer
    assert destroyed.total < skipped.total
    assert skipped.total == pytest.approx(step_reward(insert("Maya and Leo enjoy walks in the sun."))[1].total)

    kept_off = CFG.model_copy(update={"reward": CFG.reward.model_copy(update={"retention": False})})
    # without retention only the judge tells them apart: the update is misaimed (r4 = 0, the skip's is 1)
    assert step_reward(overwrite, kept_off)[1].r4 == 0.0
    assert step_reward(overwrite, kept_off)[1].total == pytest.approx(
        step_reward(NOTHING_TO_STORE, kept_off)[1].total - CFG.reward.gamma)


def test_a_trajectory_that_overwrites_an_answer_loses_credit_on_that_chunk(scored):
    kept = scored["facts"]
    lost = run([WRITERS["facts"][0], update("sem-1", "Leo likes sunny weather."), WRITERS["facts"][2]])
    assert lost.rewards[1].retention == 0.0 and kept.rewards[1].retention == 1.0
    assert lost.rewards[1].total < kept.rewards[1].total
    assert lost.qa_score < kept.qa_score


def test_answers_lost_counts_answers_stored_then_overwritten():
    episode = new_episode()
    episode.step(insert("Maya signed with Northwind Robotics in May 2024."))
    episode.step(NOTHING_TO_STORE)
    assert answers_lost([step.memory_support for step in episode.steps]) == 0
    episode.step(update("sem-1", "Maya adopted a parrot named Kiwi."))  # the new answer replaced the old one
    assert episode.steps[-1].memory_support == {1: 1.0}
    assert answers_lost([step.memory_support for step in episode.steps]) == 1 and answers_lost([]) == 0


