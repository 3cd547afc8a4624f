"""The LLM teacher of the warm start (memalpha/teacher/llm_teacher.py): samples scored by the evidence their
memory holds, dropped when their replay is not what their rollout wrote, the best kept over a threshold, cached
by window and resumed (on hand-written caches and a stubbed writer), its adapter never reused for another
teacher; and once on the real llama-server, the 0.5B writing one 1-chunk window twice under a 48-token cap."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.llama_server import installed, local_llama_server
from memalpha.config import RunConfig, load_config
from memalpha.data.schema import Instance, Question
from memalpha.env.episode import Episode
from memalpha.env.parsing import NOTHING_TO_STORE
from memalpha.env.tools import call_line, execute_text
from memalpha.errors import UserError
from memalpha.memory import MemoryStore
from memalpha.models import loading
from memalpha.models.llamacpp import LlamaCppClient
from memalpha.teacher import llm_teacher
from memalpha.teacher.demonstrations import DemoStats, build_demonstrations
from memalpha.teacher.llm_teacher import (
    LLMTeacher,
    evidence_held,
    memory_state,
    read_samples,
    sample_cache,
    score_sample,
    taught_completion,
    window_digest,
)
from memalpha.teacher.record import warm_start_hash
from memalpha.teacher.warm_start import ADAPTER_FILE, warm_start
from memalpha.tokens import tokenizer_counter

TEACHER = "qwen2.5-coder-0.5b"
CAP = 48
"""The tiny case's completion cap (rollout.max_completion_length), the teacher's and its demonstrations'."""
PROBE = json.loads((Path(__file__).resolve().parent / "data" / "probe_chat.json").read_text())


def on_llama(test):
    """Marked like tests/test_llamacpp.py: a real llama-server, skipped where llama.cpp is not built."""
    for mark in (pytest.mark.slow, pytest.mark.llamacpp,
                 pytest.mark.skipif(not installed(), reason="no llama-server: run `make llm` to test the LLM teacher")):
        test = mark(test)
    return test


def facts_window() -> Instance:
    """The probe chat's first session: 6 facts in one chunk, more than a 48-token completion can store."""
    turns = PROBE["turns"][:13]
    chunk = "\n".join(f"[{t['date']}] {t['speaker']}: {t['text']}" for t in turns)
    questions = [Question(f"q{i}", q, [a], "single_hop", [0])
                 for i, (q, a) in enumerate(zip(PROBE["questions"][:6], PROBE["answers"][:6]))]
    return Instance("facts", "user", "accurate_retrieval", [chunk], questions)


def short_window() -> Instance:
    chunks = ["Ana: I just adopted a puppy called Biscuit.\nLeo: Cute! I started a new job at the Harbor Library.",
              "Ana: Biscuit already chewed my red sneakers.\nLeo: Ha, nice weather today."]
    questions = [Question("s0", "What is the name of Ana's puppy?", ["Biscuit"], "single_hop", [0]),
                 Question("s1", "Where does Leo work?", ["Harbor Library"], "single_hop", [0])]
    return Instance("short", "user", "accurate_retrieval", chunks, questions)


def insert(text: str) -> str:
    return call_line("memory_insert", {"memory_type": "semantic", "content": text})


PUPPY, LIBRARY = insert("Ana's puppy is called Biscuit."), insert("Leo works at the Harbor Library.")


@pytest.fixture(scope="module")
def config() -> RunConfig:
    """The default config: room for a few calls a chunk."""
    return load_config(None)


@pytest.fixture(scope="module")
def tiny() -> RunConfig:
    return load_config(None, [f"rollout.max_completion_length={CAP}"])


@pytest.fixture(scope="module")
def student():
    return loading.load_tokenizer(str(loading.default_model_dir()))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A model cache of the test's own."""
    monkeypatch.setattr(llm_teacher, "cache_dir", lambda: tmp_path)
    return tmp_path


def teacher_of(samples: int = 2, **options) -> LLMTeacher:
    return LLMTeacher(TEACHER, samples=samples, say=lambda _line: None, **options)


def record_of(window: Instance, samples: list[list[str]], config: RunConfig, count) -> dict:
    """A cache record as `_Writer.write` makes it: each sample's memory as its rollout wrote it (every call of a
    completion executed as the episode executes it, without the replay's budget)."""
    memories = []
    for completions in samples:
        store = MemoryStore(config.memory.schema(), count)
        for chunk, text in enumerate(completions):
            execute_text(store, text, chunk)
        memories.append(memory_state(store))
    return {"instance_id": window.instance_id, "digest": window_digest(window), "samples": samples,
            "memories": memories, "tokens": 0, "seconds": 1.0}


def write_cache(config, teacher, records: list[dict]) -> Path:
    path = sample_cache(config, teacher)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_evidence_counts_the_stated_answers_a_memory_holds():
    window = "Maya: my cat is called Pepper. Tom: I moved from Porto to Lisbon. Maya: see you on the 7th."
    questions = [Question("q0", "Cat?", ["Pepper"], "single_hop"),
                 Question("q1", "Where does Tom live now?", ["Lisbon"], "conflict", superseded_answers=["Porto"]),
                 Question("q2", "When?", ["7 May 2023"], "temporal")]  # worked out, stated nowhere: not counted
    assert evidence_held(questions, window, "Maya's cat is Pepper. Tom lives in Lisbon.") == 1.0
    assert evidence_held(questions, window, "Tom lives in Lisbon and in Porto.") == 0.0  # the stale value shadows it
    assert evidence_held(questions, window, "Pepper.") == 0.5
    assert evidence_held(questions[2:], window, "7 May 2023") is None  # nothing to measure a window by


def test_a_completion_is_taught_as_its_executed_calls_within_the_budget(tiny, student):
    schema, count = tiny.memory.schema(), tokenizer_counter(student)
    store = MemoryStore(schema, count)
    cat, job = insert("Maya's cat is called Pepper."), insert("Tom works at the bakery.")
    stale = call_line("memory_update", {"memory_type": "semantic", "memory_id": "sem-99", "new_content": "x"})
    assert taught_completion(store, f"{cat}\n{stale}\n{job[:30]}", 0, count, CAP) == cat  # failed and cut calls go
    assert taught_completion(store, NOTHING_TO_STORE, 1, count, CAP) == NOTHING_TO_STORE
    for malformed in ("", "{not json", job[:30], "I will remember the cat."):
        assert taught_completion(store, malformed, 1, count, CAP) is None
    dog = insert("Maya has no dog.")
    assert taught_completion(store, f"{job}\n{dog}", 2, count, count(job + "\n")) == job  # the budget
    assert [e.content for e in store.entries("semantic")] == ["Maya's cat is called Pepper.", "Tom works at the bakery."]


def test_the_teacher_is_part_of_the_warm_start_hash():
    teacher = LLMTeacher(TEACHER, samples=2)
    assert warm_start_hash(RunConfig(), teacher.describe()) != warm_start_hash(RunConfig())
    assert warm_start_hash(RunConfig(), LLMTeacher(TEACHER, samples=3).describe()) != warm_start_hash(RunConfig(), teacher.describe())
    assert LLMTeacher.from_spec("rule") is None


def test_a_malformed_sample_is_data_not_a_crash(cache, config, student):
    window, count = short_window(), tokenizer_counter(student)
    teacher = teacher_of(samples=3, min_evidence=0.5)
    samples = [["", "{not json"], [PUPPY, NOTHING_TO_STORE], ["I will remember that.", PUPPY[:40]]]
    write_cache(config, teacher, [record_of(window, samples, config, count)])
    stats = DemoStats()
    demos = build_demonstrations([window], config, student, count=10, nothing_share=0.5, stats=stats, teacher=teacher)
    assert teacher.stats.every == [0.0, 0.5, 0.0] and teacher.stats.kept == 1  # the second sample holds 1 of 2 answers
    assert sorted(d.completion for d in demos) == sorted([PUPPY, NOTHING_TO_STORE]) and stats.unlabelled == 0
    assert teacher.stats.generated == 0  # read from the cache: no server needed


def test_the_best_sample_becomes_demonstrations_in_the_rollout_prompt_format(cache, config, student):
    window, count, schema = short_window(), tokenizer_counter(student), config.memory.schema()
    teacher = teacher_of(min_evidence=0.5)
    samples = [[PUPPY, NOTHING_TO_STORE], [f"{PUPPY}\n{LIBRARY}", "I will remember that."]]
    write_cache(config, teacher, [record_of(window, samples, config, count)])
    stats = DemoStats()
    demos = build_demonstrations([window], config, student, count=10, nothing_share=0.5, stats=stats, teacher=teacher)
    assert teacher.stats.best == {"short": 1.0} and teacher.stats.every == [0.5, 1.0]
    assert stats.chunks == 2 and stats.unlabelled == 1  # the best sample's second chunk executed nothing
    episode = Episode(window, schema, config.memory, config.retrieval, count, student)
    assert [(d.prompt, d.completion, d.chunk_index) for d in demos] == [(episode.prompt(), f"{PUPPY}\n{LIBRARY}", 0)]
    assert demos[0].prompt.startswith("<|im_start|>system")


def test_a_window_under_the_threshold_is_dropped(cache, config, student):
    count = tokenizer_counter(student)
    short, facts = short_window(), facts_window()
    cat = insert("Maya's cat is called Pepper.")
    teacher = teacher_of(min_evidence=1.0)
    write_cache(config, teacher, [record_of(short, [[PUPPY, NOTHING_TO_STORE], [f"{PUPPY}\n{LIBRARY}", ""]], config, count),
                                  record_of(facts, [[cat], [NOTHING_TO_STORE]], config, count)])
    kept, _ = teacher.labels([short, facts], config, count)
    assert teacher.stats.best == {"short": 1.0, "facts": 1 / 6}
    assert [w.instance_id for w in kept] == ["short"] and teacher.stats.generated == 0


def test_a_sample_whose_replay_is_not_its_rollout_is_dropped(cache, student):
    """Re-rendered with spaces, two compact calls that fit the cap in the rollout no longer do in the replay:
    its memory would lack the second, so the sample is not taught."""
    count, window = tokenizer_counter(student), short_window()
    compact = "\n".join(json.dumps(json.loads(line), separators=(",", ":")) for line in (PUPPY, LIBRARY))
    config = load_config(None, [f"rollout.max_completion_length={count(compact)}"])
    assert count(f"{PUPPY}\n{LIBRARY}\n") > count(compact)
    teacher = teacher_of(min_evidence=0.0)
    write_cache(config, teacher, [record_of(window, [[compact, NOTHING_TO_STORE], [PUPPY, NOTHING_TO_STORE]], config, count)])
    kept, label = teacher.labels([window], config, count)
    assert teacher.stats.diverged == 1 and teacher.stats.every == [0.5] and teacher.stats.best == {"short": 0.5}
    assert kept == [window] and label(window, Episode(window, config.memory.schema(), config.memory,
                                                      config.retrieval, count)) == PUPPY


@contextmanager
def stubbed_writer(calls: list, config, count):
    """`_Writer.write` answering canned samples (each window's chunks stored whole, then nothing), each call
    appended to `calls`: no server."""
    def write(self, instance, seed, on_chunks):
        calls.append(instance.instance_id)
        on_chunks(self.teacher.samples * len(instance.chunks))
        canned = [insert(chunk[:60]) for chunk in instance.chunks]
        return record_of(instance, [canned] * self.teacher.samples, config, count)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm_teacher._Writer, "write", write)
        yield


def test_a_stopped_run_resumes_and_a_finished_one_is_read_back(cache, config, student):
    count, windows = tokenizer_counter(student), [short_window(), facts_window()]
    calls, lines = [], []
    teacher = LLMTeacher(TEACHER, samples=2, min_evidence=0.0, say=lines.append)
    with stubbed_writer(calls, config, count):
        kept, _ = teacher.labels(windows, config, count)
    path = sample_cache(config, teacher)
    assert calls == ["short", "facts"] and teacher.stats.generated == 2 and len(kept) == 2
    assert any("6/6 chunks" in line for line in lines) and "2 kept" in lines[-1]
    assert json.loads(path.with_suffix(".json").read_text())["teacher"]["samples"] == 2

    with stubbed_writer(calls, config, count):  # finished: read back
        teacher = teacher_of(min_evidence=0.0)
        assert len(teacher.labels(windows, config, count)[0]) == 2
    assert calls == ["short", "facts"] and teacher.stats.generated == 0

    first = path.read_text().split("\n")[0]  # a run stopped while appending its second window
    path.write_text(first + "\n" + '{"instance_id": "facts", "samples": [["NOTHING')
    with stubbed_writer(calls, config, count):
        teacher = teacher_of(min_evidence=0.0)
        teacher.labels(windows, config, count)
    assert calls[2:] == ["facts"] and teacher.stats.generated == 1
    assert [json.loads(line)["instance_id"] for line in path.read_text().splitlines()] == ["short", "facts"]

    path.write_text(first)  # stopped just before its newline: the next append must not join that line
    with stubbed_writer(calls, config, count):
        teacher_of().labels(windows, config, count)
    assert calls[3:] == ["facts"] and path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 2
    assert not list(path.parent.glob("*.tmp"))


def test_another_draw_or_an_edited_window_writes_only_what_the_cache_lacks(cache, config, student):
    count, calls = tokenizer_counter(student), []
    short, facts = short_window(), facts_window()
    with stubbed_writer(calls, config, count):
        teacher_of().labels([short], config, count)
        teacher_of().labels([short, facts], config, count)  # another draw, same cache file
        edited = Instance("short", short.data_source, short.competency, [short.chunks[0], "Ana: Biscuit is asleep."],
                          short.questions)
        teacher_of().labels([edited, facts], config, count)
        teacher_of().labels([short, facts], config, count)  # the original window's record stays
    assert calls == ["short", "facts", "short"]
    assert len(sample_cache(config, teacher_of()).read_text().splitlines()) == 3


def test_the_teachers_server_runs_only_while_windows_are_written(cache, config, student):
    from contextlib import contextmanager

    count, calls, entered = tokenizer_counter(student), [], []

    @contextmanager
    def server():
        entered.append(list(calls))  # what had been written when the server came up
        yield
        entered.append("stopped")

    with stubbed_writer(calls, config, count):
        LLMTeacher(TEACHER, samples=2, say=lambda _line: None, server=server).labels([short_window()], config, count)
        LLMTeacher(TEACHER, samples=2, say=lambda _line: None, server=server).labels([short_window()], config, count)
    assert calls == ["short"] and entered == [[], "stopped"], "up for the missing window, not for a cached one"


def test_a_record_that_is_not_whole_is_written_again(tmp_path, config, student):
    window, count = short_window(), tokenizer_counter(student)
    good = record_of(window, [["a", "b"]], config, count)
    path = tmp_path / "samples.jsonl"
    bad = [{**good, "samples": [["only one chunk"]]}, {**good, "seconds": "1.5"}, {**good, "seconds": None},
           {**good, "memories": []}, {k: v for k, v in good.items() if k != "digest"}, [good]]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*bad, good]) + '{"seconds": NaN}\n')
    assert read_samples(path, [window], 1) == {"short": good}
    assert path.read_text() == json.dumps(good) + "\n"
    other = Instance("other", "user", "accurate_retrieval", ["x", "y", "z"], [])
    assert read_samples(path, [other], 1) == {} and path.read_text() == json.dumps(good) + "\n"  # another window's: kept


def test_an_adapter_another_teacher_taught_is_not_reused(tmp_path, config):
    class Policy:
        loaded = None

        def load_adapter(self, folder):
            self.loaded = folder

    llm = teacher_of()
    for made_by, asked in ((None, llm), ({**llm.describe(), "stats": {}}, None),
                           ({**teacher_of(samples=4).describe(), "stats": {}}, llm)):
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}" / "sft"
        out.mkdir(parents=True)
        (out / ADAPTER_FILE).write_bytes(b"")
        (out / "sft_result.json").write_text(json.dumps({"steps": 1, **({"teacher": made_by} if made_by else {})}))
        with pytest.raises(UserError, match="holds a warm start taught by"):
            warm_start(config, out, Policy(), [], teacher=asked)
    (out / "sft_result.json").write_text(json.dumps({"teacher": {**llm.describe(), "stats": {}}}))
    policy = Policy()
    assert warm_start(config, out, policy, [], teacher=llm) == out and policy.loaded == out

    # restored from a shipped warm start: no sft_result.json, its record names the teacher
    (out / "sft_result.json").unlink()
    (out / "record.json").write_text(json.dumps({"hash": "h", "recipe": {"teacher": llm.describe()}}))
    assert warm_start(config, out, Policy(), [], teacher=llm) == out
    with pytest.raises(UserError, match="holds a warm start taught by"):
        warm_start(config, out, Policy(), [], teacher=teacher_of(samples=4))


@contextmanager
def counted(requests: list):
    """Every completion request sent to a llama-server while inside, appended to `requests`."""
    real = LlamaCppClient.complete
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LlamaCppClient, "complete", lambda self, *a, **k: requests.append(1) or real(self, *a, **k))
        yield


@on_llama
def test_the_real_teacher_writes_scores_and_keeps_the_best_sample(cache, tiny, student):
    config, window, count, schema = tiny, facts_window(), tokenizer_counter(student), tiny.memory.schema()
    requests, lines = [], []
    with local_llama_server(cache / "state", TEACHER, offset=400), counted(requests):
        teacher = LLMTeacher(TEACHER, samples=2, min_evidence=0.0, say=lines.append)
        kept, label = teacher.labels([window], config, count)
    assert len(requests) == 2  # a request a sample a chunk
    stats = teacher.stats.to_dict()
    assert stats["windows"] == 1 and stats["samples"] == 2 and stats["generated"] == 1
    assert any("2/2 chunks" in line for line in lines)

    record = read_samples(sample_cache(config, teacher), [window], 2)["facts"]
    scored = [score_sample(window, s, schema, count, CAP) for s in record["samples"]]
    agree = [s for s, memory in zip(scored, record["memories"]) if s.memory == memory]
    assert teacher.stats.diverged == 2 - len(agree)
    print(f"\nfacts: {record['seconds']:.1f} s, sample evidence {[round(s.evidence, 2) for s in scored]}, "
          f"{len(agree)} replayed as written")
    if not agree:
        return
    assert teacher.stats.best == {"facts": max(s.evidence for s in agree)} and kept == [window]
    best = max(agree, key=lambda s: s.evidence)
    episode = Episode(window, schema, config.memory, config.retrieval, count, student)
    assert label(window, episode) == best.labels[0]
    demos = build_demonstrations([window], config, student, count=10, nothing_share=0.5,
                                 teacher=teacher_of(min_evidence=0.0))  # read from the cache, the server gone
    assert [(d.prompt, d.completion) for d in demos] == ([(episode.prompt(), best.labels[0])] if best.labels[0] else [])


def test_a_dialogue_teacher_leaves_the_synthetic_data_to_the_rule_writer(cache, config, student):
    from dataclasses import replace

    from memalpha.teacher.demonstrations import build_mixed_demonstrations

    count = tokenizer_counter(student)
    synthetic = replace(short_window(), instance_id="synthetic")
    dialogue = replace(short_window(), instance_id="dialogue", metadata={"evidence_turns": {"s0": ["Ana: Biscuit"]}})
    write_cache(config, teacher_of(), [record_of(dialogue, [[f"{PUPPY}\n{LIBRARY}", NOTHING_TO_STORE]] * 2, config, count)])
    teacher = teacher_of(scope="dialogue")  # the scope is not part of the cache key: the samples are the same
    assert teacher.describe()["scope"] == "dialogue" and "scope" not in teacher_of().describe()
    assert not teacher.teaches([synthetic]) and teacher.teaches([dialogue])
    demos = build_mixed_demonstrations([[synthetic], [dialogue]], [1.0, 1.0], config, student, teacher=teacher)
    # the dialogue window is the teacher's best sample; the synthetic one the rule writer's, with no sample cached
    assert teacher.stats.windows == 1 and teacher.stats.kept == 1 and teacher.stats.generated == 0
    by_window = {d.instance_id: d.completion for d in demos if d.chunk_index == 0}
    assert by_window["dialogue"] == f"{PUPPY}\n{LIBRARY}"
    assert by_window["synthetic"] != by_window["dialogue"] and "memory_insert" in by_window["synthetic"]
    with pytest.raises(UserError, match="--teach"):
        teacher_of(scope="synthetic")

    class Policy:
        tokenizer = student

    with pytest.raises(UserError, match="teaches none of this data"):  # not a warm start recorded as the LLM's
        warm_start(config, cache / "sft", Policy(), [synthetic], teacher=teacher_of(scope="dialogue"))
