"""The one episode loop: same memories as the loops it replaced, cheap copies, training truncation."""

import json
from pathlib import Path

import pytest

from memalpha.config import MemoryConfig, RolloutConfig, RunConfig
from memalpha.data.schema import Instance, Question
from memalpha.data.synth import SynthConfig, generate
from memalpha.env.episode import Episode
from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.evaluation.methods import EvalEnv, make_method
from memalpha.memory.schema import MEMALPHA_SCHEMA
from memalpha.models.loading import build_tiny, is_prepared
from memalpha.teacher.rule_writer import RuleWriter, run_rule_writer
from memalpha.tokens import regex_token_count, tokenizer_counter
from memalpha.training.data import truncate_for_training

GOLDEN = json.loads((Path(__file__).parent / "data" / "episode_golden.json").read_text())
# the budgets the golden memories were recorded with (the writer view decides what an update can see)
CFG = RunConfig(memory=MemoryConfig(writer_view_tokens=1024, reader_view_tokens=2048),
                rollout=RolloutConfig(max_completion_length=128))


def golden_instances() -> list[Instance]:
    return generate(SynthConfig(instances=8, chunks_per_instance=(4, 6), chunk_tokens=384, seed=5))


def insert(content: str, section: str = "semantic") -> str:
    return json.dumps({"name": "memory_insert", "arguments": {"memory_type": section, "content": content}})


def test_rule_writer_memories_match_the_loops_the_episode_replaced():
    writer = RuleWriter(MEMALPHA_SCHEMA, max_completion_tokens=128)
    memories = []
    for instance in golden_instances():
        episode = Episode(instance, MEMALPHA_SCHEMA, CFG.memory, CFG.retrieval, regex_token_count)
        run_rule_writer(episode, writer)
        memories.append(episode.store.to_dict())
    assert memories == GOLDEN["rule_writer_plain"]
    # the evaluation baseline drives the same loop
    built = make_method("rule_writer", EvalEnv(CFG, regex_token_count)).build(golden_instances(), 0)
    assert [b.memory for b in built] == GOLDEN["rule_writer_plain"]


@pytest.mark.skipif(not is_prepared(), reason="needs the prepared SmolLM2 tokenizer")
def test_chat_rendered_episode_matches_the_replaced_loop():
    tokenizer = build_tiny()[1]
    count = tokenizer_counter(tokenizer)
    writer = RuleWriter(MEMALPHA_SCHEMA, max_completion_tokens=128, count_tokens=count)
    memories = []
    for instance in golden_instances():
        episode = Episode(instance, MEMALPHA_SCHEMA, CFG.memory, CFG.retrieval, count, tokenizer)
        steps = run_rule_writer(episode, writer)
        assert all(s.prompt.endswith("<|im_start|>assistant\n") for s in steps)
        memories.append(episode.store.to_dict())
    assert memories == GOLDEN["rule_writer_chat"]


def test_copy_branches_without_touching_the_original():
    instance = Instance("i", "test", "accurate_retrieval", ["Maya: I adopted a cat named Mochi.", "Maya: hi", "Leo: hello"],
                        [Question("q", "What is Maya's cat called?", ["Mochi"], "single_hop", [0])], {})
    episode = Episode(instance, MEMALPHA_SCHEMA, CFG.memory, CFG.retrieval, regex_token_count)
    episode.step(insert("Maya adopted a cat named Mochi."))
    branch = episode.copy()
    branch.step(insert("Maya greeted Leo in the garden."))
    assert episode.position == 1 and branch.position == 2
    assert episode.store.entry_count() == 1 and branch.store.entry_count() == 2
    assert episode.index.search("semantic", "garden") == [] and branch.index.search("semantic", "garden")
    assert episode.prompt() != branch.prompt()
    episode.step(NOTHING_TO_STORE)
    assert branch.store.entry_count() == 2 and len(branch.steps) == 2 and len(episode.steps) == 2


def test_step_records_support_for_the_questions_its_chunk_can_answer():
    instance = Instance("i", "test", "accurate_retrieval", ["Maya: I work at Northwind Robotics.", "Leo: nice weather"],
                        [Question("q", "Where does Maya work?", ["Northwind Robotics"], "single_hop", [0])], {})
    episode = Episode(instance, MEMALPHA_SCHEMA, CFG.memory, CFG.retrieval, regex_token_count)
    assert episode.relevant_questions == [[0], []]
    assert episode.step(insert("Maya works at Northwind.")).support == {0: 0.5}  # one of the answer's two words
    assert episode.step(insert("Leo likes the weather.")).support == {}
    with pytest.raises(IndexError, match="already read"):
        episode.step(NOTHING_TO_STORE)


def test_truncation_keeps_only_questions_whose_evidence_all_survives():
    def q(evidence):
        return Question(f"q{evidence}", "?", ["a"], "single_hop", evidence)

    whole = Instance("a", "t", "accurate_retrieval", ["c0", "c1", "c2"], [q([0]), q([0, 2]), q(None)], {})
    lost = Instance("b", "t", "accurate_retrieval", ["c0", "c1", "c2"], [q([1, 2])], {})
    short = Instance("c", "t", "accurate_retrieval", ["c0"], [q([0])], {})
    kept, dropped = truncate_for_training([whole, lost, short], 2)
    assert dropped == 1 and [i.instance_id for i in kept] == ["a", "c"]
    assert kept[0].chunks == ["c0", "c1"] and [x.evidence_chunks for x in kept[0].questions] == [[0], None]
    assert kept[1] is short
    assert truncate_for_training([lost], 0) == ([lost], 0)
