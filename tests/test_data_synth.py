"""The synthetic generator: determinism, the four competencies, knobs, and splits."""

from collections import Counter
from dataclasses import replace

import pytest

from memalpha.data.chunking import TokenCounts
from memalpha.data.splits import assign_splits, split_of
from memalpha.data.synth import PRESETS, SynthConfig, generate
from memalpha.rewards.qa import normalize_answer
from memalpha.rewards.question_types import COMPETENCIES
from memalpha.tokens import regex_token_count

CFG = SynthConfig(instances=8, chunks_per_instance=(5,), chunk_tokens=512, facts_per_instance=6,
                  distractor_share=0.4, updates_per_fact=3, seed=7)


@pytest.fixture(scope="module")
def instances():
    return generate(CFG)


def _has(text, answer):
    return f" {normalize_answer(answer)} " in f" {normalize_answer(text)} "


def test_deterministic_and_seeded(instances):
    assert generate(CFG) == instances
    other = generate(replace(CFG, seed=8))
    assert [i.chunks for i in other] != [i.chunks for i in instances]
    # an instance does not depend on how many others are generated
    assert generate(replace(CFG, instances=3)) == instances[:3]


def test_all_competencies_and_shapes(instances):
    assert Counter(i.competency for i in instances) == {c: 2 for c in COMPETENCIES}
    counter = TokenCounts(regex_token_count)
    for inst in instances:
        assert len(inst.chunks) == 5
        assert max(counter.counts(inst.chunks)) <= 512
        assert inst.chunks[0].startswith("The following is a conversation from ")
        speakers = inst.metadata["speakers"]
        assert all(f"{speakers[0]}:" in c or f"{speakers[1]}:" in c for c in inst.chunks)
        assert len({q.question for q in inst.questions}) == len(inst.questions)


def test_gold_answers_are_in_their_evidence_chunks(instances):
    for inst in instances:
        for q in inst.questions:
            assert q.evidence_chunks, q
            evidence = " ".join(inst.chunks[c] for c in q.evidence_chunks)
            if q.question_type == "summary":
                assert all(_has(evidence, k) for k in q.answers)
            else:
                assert _has(evidence, q.answer), (q, evidence)


def test_distractor_chunks_hold_no_facts(instances):
    for inst in instances:
        distractors = set(inst.metadata["distractor_chunks"])
        assert len(distractors) == 2  # round(0.4 * 5)
        used = {c for q in inst.questions for c in q.evidence_chunks}
        assert not used & distractors


def test_accurate_retrieval_single_and_multi_hop(instances):
    ar = [i for i in instances if i.competency == "accurate_retrieval"]
    types = Counter(q.question_type for i in ar for q in i.questions)
    assert types == {"single_hop": 8, "multi_hop": 4}


def test_test_time_learning_numeric_labels(instances):
    for inst in (i for i in instances if i.competency == "test_time_learning"):
        for q in inst.questions:
            assert q.question_type == "classification" and q.answer.isdigit()
            assert "\\boxed{label}" in q.question
            assert f"label {q.answer}" in " ".join(inst.chunks).lower() or f"category {q.answer}" in " ".join(inst.chunks)


def test_conflict_resolution_updates_in_order(instances):
    counts = Counter()
    for inst in (i for i in instances if i.competency == "conflict_resolution"):
        text = " ".join(inst.chunks)
        for q in inst.questions:
            assert q.question_type == "conflict" and 1 <= len(q.superseded_answers) <= 3
            counts[len(q.superseded_answers)] += 1
            history = [*q.superseded_answers, q.answer]
            # each value is stated before the next one; the current one is the last
            positions = [text.find(v) for v in history]
            assert -1 not in positions and positions == sorted(positions)
    assert len(counts) > 1  # some facts were updated more than once


def test_long_range_summary_keywords(instances):
    for inst in (i for i in instances if i.competency == "long_range_understanding"):
        (q,) = inst.questions
        assert q.question_type == "summary" and q.question.startswith("Summarize") and len(q.answers) >= 5
        assert len(q.evidence_chunks) >= 2  # the story spans sessions


def test_lengths_cycle_and_longgen_preset_is_long():
    cfg = replace(PRESETS["longgen"], instances=8, chunks_per_instance=(2, 40))
    lengths = [len(i.chunks) for i in generate(cfg)]
    assert lengths == [2, 2, 2, 2, 40, 40, 40, 40]
    assert max(PRESETS["longgen"].chunks_per_instance) * PRESETS["longgen"].chunk_tokens <= 500_000
    assert max(PRESETS["train"].chunks_per_instance) * PRESETS["train"].chunk_tokens < 30_000


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="distractor_share"):
        SynthConfig(distractor_share=1.5)
    with pytest.raises(ValueError, match="too many for conflict_resolution"):
        generate(SynthConfig(instances=1, facts_per_instance=13, competencies=("conflict_resolution",)))
    with pytest.raises(ValueError, match="too many for accurate_retrieval"):
        generate(SynthConfig(instances=1, facts_per_instance=30, competencies=("accurate_retrieval",)))


def test_splits_are_deterministic_by_instance(instances):
    a = assign_splits(instances, [0.5, 0.25, 0.25], seed=1)
    b = assign_splits(list(reversed(instances)), [0.5, 0.25, 0.25], seed=1)
    assert {i.instance_id: i.split for i in a} == {i.instance_id: i.split for i in b}
    ids = [f"inst-{n}" for n in range(2000)]
    shares = Counter(split_of(i, [0.8, 0.1, 0.1], 0) for i in ids)
    assert 1500 < shares["train"] < 1700 and 130 < shares["validation"] < 270
    assert [split_of(i, [0, 0, 1], 0) for i in ids[:5]] == ["test"] * 5
    kept = assign_splits([replace(instances[0], split="test")], [1, 0, 0])
    assert kept[0].split == "test"
