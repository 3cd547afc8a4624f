"""Real conversations: PerLTQA in its release's shape, splits by conversation, training windows, the
evidence teacher and the training mix."""

import json

import polars as pl
import pytest

from memalpha.config import load_config
from memalpha.data.chunking import TokenCounts, Turn
from memalpha.data.conversations import LOCOMO_SPLITS, conversation_split, sessions, training_windows
from memalpha.data.io import read_dataset
from memalpha.data.loaders import RawInstance, load_source, to_instance
from memalpha.data.perltqa import NOT_IN_CONVERSATION, load_perltqa
from memalpha.data.prep import prepare
from memalpha.data.schema import DataError, Instance, Question
from memalpha.env.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.memory import MemoryStore
from memalpha.rewards.qa import score_answer
from memalpha.teacher.evidence_writer import EvidenceWriter
from memalpha.tokens import regex_token_count
from memalpha.training.data import TrainingData, mix_splits


def _qa(question, answer, ref, anchors):
    return {"Question": question, "Answer": answer, "Reference Memory": ref,
            "Memory Anchors": [{a: [-1, -1]} for a in anchors]}


def write_perltqa(folder):
    """Two characters in the shape of perltmem_en_v2.json / perltqa_en_v2.json (dialogues out of date order)."""
    folder.mkdir(parents=True, exist_ok=True)
    memory = {
        "Wang Xiaoming": {
            "profile": {"Protagonist": "Wang Xiaoming", "Hobbies": "photography, basketball", "Age": 28},
            "profile_description": "...",
            "social_relationship": {"1_0": {"Supporting Characters": "Li Ting", "Relationship": "girlfriend"}},
            "events": {"1_0_0": {"content": "They visited Dreamland.", "Creation Time": "May 8, 2022"},
                       "1_0_1": {"content": "An event nobody talks about.", "Creation Time": "June 1, 2022"}},
            "dialogues": {
                "1_0_0#2": {"events": "1_0_0", "contents": {"2022-05-10 10:00": [
                    "Wang Xiaoming: The stone bridge in the village was perfect for photography.",
                    "Li Ting: Next time we bring the macro lens."]}},
                "1_0_0#1": {"events": "1_0_0", "contents": {"2022-05-08 10:00": [
                    "Wang Xiaoming: I'm so excited to visit Dreamland today, Li Ting!",
                    "Li Ting: Me too. I packed my wide-angle lens for the sea of flowers."]}},
            },
        },
        "Zhang Wei": {"profile": {}, "social_relationship": {}, "events": {}, "dialogues": {
            "2_0_0#1": {"events": "2_0_0", "contents": {"2021-01-02 09:00": ["Zhang Wei: I ran a marathon in Paris."]}}}},
    }
    qa = [
        {"Wang Xiaoming": {
            "profile": [_qa("What are his hobbies?", "His hobbies are photography and basketball.", "Hobbies",
                            ["photography"]),
                        _qa("How old is he?", "He is 28.", "Age", ["28"])],
            "social_relationship": [{"1_0": [_qa("Who is his girlfriend?", "Li Ting is his girlfriend.", "['1_0']", ["Li Ting"])]}],
            "events": [{"1_0_0": [_qa("Which lens did Li Ting pack?", "She packed a wide-angle lens.", "['1_0_0']",
                                      ["wide-angle lens"])]},
                       {"1_0_1": [_qa("What happened in June?", "An event.", "['1_0_1']", ["event"])]}],
            "dialogues": [{"1_0_0#2": [_qa("What did they talk about?", "They talked about a stone bridge.",
                                           "['1_0_0#2']", ["a village in the north"])]}],
        }},
        {"Zhang Wei": {"profile": [], "social_relationship": [], "events": [], "dialogues": [
            {"2_0_0#1": [_qa("Where did Zhang Wei run a marathon?", "In Paris.", "['2_0_0#1']", ["Paris"])]}]}},
    ]
    (folder / "perltmem_en_v2.json").write_text(json.dumps(memory))
    (folder / "perltqa_en_v2.json").write_text(json.dumps(qa))
    return folder


def test_perltqa_character_is_a_dated_conversation_with_evidence_and_short_golds(tmp_path):
    loaded = load_perltqa(write_perltqa(tmp_path / "Dataset" / "en_v2").parents[1])
    wang = next(i for i in loaded.items if i.instance_id == "perltqa-wang-xiaoming")
    assert [t.date for t in wang.turns] == ["2022-05-08 10:00"] * 2 + ["2022-05-10 10:00"] * 2  # time order
    assert wang.turns[0].speaker == "Wang Xiaoming" and wang.turns[1].text.startswith("Me too.")
    by_q = {q.question: q for q in wang.questions}
    assert by_q["What are his hobbies?"].answers == ["photography"]  # anchor stated in a dialogue
    assert wang.evidence_turns[by_q["What are his hobbies?"].question_id] == ["1_0_0#2:0"]
    assert by_q["Which lens did Li Ting pack?"].answers == ["wide-angle lens"]
    assert wang.evidence_turns[by_q["Which lens did Li Ting pack?"].question_id] == ["1_0_0#1:1"]
    # no anchor in the answer or the dialogue: the sentence is the gold, scored by F1
    talk = by_q["What did they talk about?"]
    assert talk.answers == ["They talked about a stone bridge."] and talk.question_type == "sentence_answer"
    # token F1 after normalisation (no articles): precision 2/2, recall 2/5
    assert score_answer("a stone bridge", talk.answers, talk.question_type) == pytest.approx(2 * 0.4 / 1.4)
    # the age no dialogue states and the event no dialogue narrates are dropped, with the reason counted
    dropped = [r for r in loaded.rejected if r["instance_id"] == "perltqa-wang-xiaoming"]
    assert len(dropped) == 2 and {r["check"] for r in dropped} == {NOT_IN_CONVERSATION}
    assert "How old is he?" not in by_q and "What happened in June?" not in by_q


def test_perltqa_prep_writes_rejected_rows_and_chunk_evidence(tmp_path):
    src = write_perltqa(tmp_path / "release")
    data_cfg = load_config(None, ["data.split_ratios=[0, 0, 1]"]).data  # everything test: whole conversations
    summary = prepare("perltqa", src, tmp_path / "out", tokenizer=regex_token_count, tokenizer_name="regex",
                      data_cfg=data_cfg, chunk_tokens=512, drop_invalid=True)
    assert summary.rejected_by_check[NOT_IN_CONVERSATION] == 2
    rejected = pl.read_parquet(tmp_path / "out" / "rejected.parquet")
    assert rejected.filter(pl.col("check") == NOT_IN_CONVERSATION).height == 2
    wang = next(i for i in read_dataset(tmp_path / "out") if i.instance_id == "perltqa-wang-xiaoming")
    assert wang.chunks[0].startswith("The following is a conversation from 2022-05-08 10:00")
    assert all(q.evidence_chunks == [0] for q in wang.questions)
    lens = next(q for q in wang.questions if q.answers == ["wide-angle lens"])
    assert wang.metadata["evidence_turns"][lens.question_id][0]["speaker"] == "Li Ting"


@pytest.mark.parametrize("memory, message", [
    ({"A": {"dialogues": []}}, "character 'A': field 'dialogues': expected an object"),
    ({"A": {"dialogues": {"1#1": {"contents": {"2020-01-01": "hi"}}}}}, "field 'dialogues.1#1'.contents.2020-01-01: expected a list"),
])
def test_perltqa_bad_input_names_the_character_and_field(tmp_path, memory, message):
    (tmp_path / "perltmem_en_v2.json").write_text(json.dumps(memory))
    (tmp_path / "perltqa_en_v2.json").write_text(json.dumps([{"A": {"profile": []}}]))
    with pytest.raises(DataError, match=message):
        load_perltqa(tmp_path)


def test_perltqa_missing_files_say_where_to_get_them(tmp_path):
    with pytest.raises(DataError, match="perltmem_en_v2.json and perltqa_en_v2.json"):
        load_source("perltqa", tmp_path)


def _conversation(sessions_count=4, turns_per_session=3):
    turns, questions, evidence = [], [], {}
    for s in range(sessions_count):
        for t in range(turns_per_session):
            turns.append(Turn(f"In session {s} turn {t} Ana mentions the word alpha{s}x{t} once.", "Ana",
                              f"1:00 pm on {s + 1} May, 2023", f"D{s + 1}:{t + 1}"))
        questions.append(Question(f"q{s}", f"What did Ana say in session {s}?", [f"alpha{s}x1"], "single_hop"))
        evidence[f"q{s}"] = [f"D{s + 1}:2"]
    questions.append(Question("q_span", "Across sessions 0 and 3?", ["alpha0x0"], "multi_hop"))
    evidence["q_span"] = ["D1:1", "D4:1"]
    return RawInstance("locomo-conv-26", "locomo", "accurate_retrieval", turns, questions, evidence)


def test_training_windows_keep_the_questions_whose_evidence_lies_inside():
    raw = _conversation()
    counter = TokenCounts(regex_token_count)
    assert [len(s) for s in sessions(raw.turns)] == [3, 3, 3, 3]
    session_tokens = sum(counter.counts([f"Ana: {t.text}" for t in raw.turns[:3]]))
    windows = training_windows(raw, counter, 2 * session_tokens)
    assert [w.instance_id for w in windows] == [f"locomo-conv-26-w{i:02d}" for i in range(4)]
    assert [q.question_id for q in windows[0].questions] == ["q0", "q1"]
    assert [q.question_id for q in windows[3].questions] == ["q3"]  # the last window holds one session
    assert all("q_span" not in [q.question_id for q in w.questions] for w in windows)  # spans 4 sessions
    whole = training_windows(raw, counter, 10**6)[0]
    assert "q_span" in [q.question_id for q in whole.questions]
    chunked = to_instance(windows[1], regex_token_count, 512)
    assert chunked.metadata["window"] == {"conversation": "locomo-conv-26", "first_session": 1, "sessions": 2}
    assert chunked.metadata["evidence_turns"]["q1"][0]["text"].startswith("In session 1 turn 1")


def test_locomo_split_is_fixed_by_conversation():
    assert conversation_split("locomo-conv-26", "locomo", [0.8, 0.1, 0.1], 0) == "train"
    assert conversation_split("locomo-conv-41", "locomo", [0.8, 0.1, 0.1], 0) == "validation"
    assert conversation_split("locomo-conv-50", "locomo", [0.8, 0.1, 0.1], 0) == "test"
    assert sorted(LOCOMO_SPLITS.values()) == ["train", "train", "validation"]


def test_locomo_prep_windows_training_conversations_and_keeps_test_ones_whole(tmp_path):
    def conv(sample_id, n_sessions):
        c = {"speaker_a": "Ana", "speaker_b": "Ben"}
        qa = []
        for s in range(1, n_sessions + 1):
            c[f"session_{s}"] = [{"speaker": "Ana", "dia_id": f"D{s}:1", "text": f"I adopted a cat named Tom{s}."},
                                 {"speaker": "Ben", "dia_id": f"D{s}:2", "text": "Nice!"}]
            c[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
            qa.append({"question": f"Cat {s}?", "answer": f"Tom{s}", "evidence": [f"D{s}:1"], "category": 4})
        return {"sample_id": sample_id, "conversation": c, "qa": qa}

    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([conv("conv-26", 3), conv("conv-41", 2), conv("conv-50", 3)]))
    prepare("locomo", path, tmp_path / "out", tokenizer=regex_token_count, tokenizer_name="regex",
            data_cfg=load_config(None, ["data.train_window_tokens=25"]).data, chunk_tokens=512, drop_invalid=True)
    by_split = {}
    for inst in read_dataset(tmp_path / "out"):
        by_split.setdefault(inst.split, []).append(inst)
    assert sorted(i.instance_id for i in by_split["train"]) == [f"locomo-conv-26-w0{i}" for i in range(3)]
    assert sorted(i.instance_id for i in by_split["validation"]) == ["locomo-conv-41-w00", "locomo-conv-41-w01"]
    assert [i.instance_id for i in by_split["test"]] == ["locomo-conv-50"]
    assert len(by_split["test"][0].questions) == 3


def _instance_with_evidence():
    chunks = ["Ana: I moved to Lisbon.\nBen: Cool.", "Ben: The weather is nice.", "Ana: I work at a bakery now."]
    return Instance("locomo-x", "locomo", "accurate_retrieval", chunks,
                    [Question("q0", "Where does Ana live?", ["Lisbon"], "single_hop", [0]),
                     Question("q1", "Where does Ana work?", ["a bakery"], "single_hop", [2])],
                    {"evidence_turns": {"q0": [{"chunk": 0, "speaker": "Ana", "date": "1:00 pm on 8 May, 2023", "text": "I moved to Lisbon."}],
                                        "q1": [{"chunk": 2, "speaker": "Ana", "date": "9:00 am on 9 May, 2023", "text": "I work at a bakery now."}]}})


def test_evidence_writer_stores_dated_named_facts_of_the_chunk_only_once():
    config = load_config(None)
    schema = config.memory.schema()
    writer = EvidenceWriter(schema, 192, regex_token_count)
    instance = _instance_with_evidence()
    store = MemoryStore(schema)
    first = parse_tool_calls(writer.write(instance, 0, store)).calls
    assert [(c.name, c.arguments["memory_type"], c.arguments["content"]) for c in first] == [
        ("memory_insert", "episodic", "Ana, 8 May 2023: I moved to Lisbon.")]
    assert writer.write(instance, 1, store) == NOTHING_TO_STORE
    store.insert("episodic", "Ana, 8 May 2023: I moved to Lisbon.", 0)
    assert writer.write(instance, 0, store) == NOTHING_TO_STORE  # stored already
    assert EvidenceWriter(schema, 5, regex_token_count).write(instance, 2, store) == NOTHING_TO_STORE  # over budget


def test_demonstrations_use_the_evidence_teacher_for_real_data():
    from memalpha.models.loading import build_tiny
    from memalpha.teacher.demonstrations import build_demonstrations

    config = load_config(None, ["sft.nothing_to_store_share=0.34"])
    demos = build_demonstrations([_instance_with_evidence()], config, build_tiny()[1], count=3)
    by_chunk = {d.chunk_index: d.completion for d in demos}
    assert "Lisbon" in by_chunk[0] and by_chunk[1] == NOTHING_TO_STORE and "bakery" in by_chunk[2]


def test_mix_gives_each_folder_its_weight_and_interleaves_validation():
    def part(tag, n_train, n_val):
        make = lambda split, k: Instance(f"{tag}{split}{k}", tag, "accurate_retrieval", ["c"], [], {}, split)
        return TrainingData({"train": [make("train", k) for k in range(n_train)],
                             "validation": [make("validation", k) for k in range(n_val)], "test": []}, {"train": 0})

    mixed = mix_splits([part("s", 8, 3), part("r", 2, 3)], [1.0, 1.0], seed=0)
    train = [i.data_source for i in mixed.splits["train"]]
    assert len(train) == 10 and train.count("s") == 5 and train.count("r") == 5  # r repeated, s cut
    assert [i.data_source for i in mixed.splits["validation"]] == ["s", "r"] * 3
    with pytest.raises(Exception, match="data.mix"):
        mix_splits([part("s", 1, 0)], [0.0])


def test_chunks_longer_than_the_writers_are_cut_to_it_and_evidence_follows():
    from memalpha.data.chunking import fit_instance
    from memalpha.teacher.record import WRITER, writer_chunk_tokens

    counter = TokenCounts(regex_token_count)
    long_chunk = "\n".join(f"Ana: line {i} mentions the keyword k{i} and nothing else at all." for i in range(60))
    instance = Instance("x", "user", "accurate_retrieval", ["Ben: hi", long_chunk, "Ben: bye"],
                        [Question("q", "k59?", ["k59"], "single_hop", [1]), Question("r", "bye?", ["bye"], "single_hop", [2])],
                        {"chunk_tokens": 2048})
    fitted, cut = fit_instance(instance, counter, 128)
    assert cut and len(fitted.chunks) > 4 and max(counter.counts(fitted.chunks)) <= 128
    assert all(c.endswith("else at all.") for c in fitted.chunks[1:-1])  # cut at line breaks
    assert "k59" in "".join(fitted.chunks[i] for i in fitted.questions[0].evidence_chunks)
    assert fitted.questions[1].evidence_chunks == [len(fitted.chunks) - 1]
    assert fitted.metadata["rechunked_from"] == 2048 and fitted.metadata["chunk_tokens"] == 128
    assert fit_instance(fitted, counter, 128) == (fitted, False)
    assert writer_chunk_tokens(WRITER) == 512  # the shipped writer's record names its chunk size


def test_grpo_eta_counts_only_the_steps_the_time_budget_leaves(monkeypatch):
    import time as time_module

    from memalpha.progress import StepMeter

    meter = StepMeter(total=8)
    meter.started -= 100.0  # one step ran, in 100 s
    now = time_module.time()
    assert meter.rate_and_eta(1).endswith("ETA 11m 40s")  # 7 steps left
    assert meter.rate_and_eta(1, deadline=now + 250).endswith("time budget: 2 more steps of 7 left, ETA 3m 20s")
    assert meter.rate_and_eta(1, deadline=now + 50).endswith("time budget: 0 more steps of 7 left, stopping")
    # the trainer's count (its step times leave out the held-out checks) is what the line says
    assert meter.rate_and_eta(1, deadline=now + 50, fit=1).endswith("time budget: 1 more step of 7 left, ETA 1m 40s")
