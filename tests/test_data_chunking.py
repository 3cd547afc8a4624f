"""Token-based chunking with a real fast tokenizer (built in-process) and the regex counter."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from memalpha.data.chunking import TokenCounts, Turn, chunk_turns, text_turns
from memalpha.tokens import regex_token_count

CORPUS = ["Ann: I adopted a dog named Rex. Bob: Nice! The following is a conversation from May. Please remember it."] * 5


@pytest.fixture(scope="module")
def hf_tokenizer():
    backend = Tokenizer(models.BPE(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def _turns(n, date_every=10):
    return [Turn(f"turn {i} about the weather and a dog named Rex number {i}.", speaker="Ann" if i % 2 else "Bob",
                 date=f"{1 + i // date_every} May 2023", turn_id=f"t{i}") for i in range(n)]


@pytest.mark.parametrize("kind", ["hf", "regex"])
def test_chunks_respect_limit_and_keep_every_turn(hf_tokenizer, kind):
    tokenizer = hf_tokenizer if kind == "hf" else regex_token_count
    counter = TokenCounts(tokenizer)
    turns = _turns(300)
    out = chunk_turns(turns, tokenizer, 512)
    assert len(out.chunks) > 3
    assert out.token_counts == counter.counts(out.chunks)
    assert max(out.token_counts) <= 512
    # every turn is in exactly one chunk, in order
    assert [out.turn_chunks[t.turn_id] for t in turns] == sorted(out.turn_chunks[t.turn_id] for t in turns)
    assert all(len(out.turn_chunks[t.turn_id]) == 1 for t in turns)
    for t in turns:
        assert f"{t.speaker}: {t.text}" in out.chunks[out.turn_chunks[t.turn_id][0]]
    # packing is greedy: no two neighbouring chunks would fit in one
    assert all(a + b > 512 for a, b in zip(out.token_counts, out.token_counts[1:]))


def test_template_is_dated_and_marks_new_sessions():
    out = chunk_turns(_turns(30), regex_token_count, 2048)
    assert len(out.chunks) == 1
    chunk = out.chunks[0]
    assert chunk.startswith("The following is a conversation from 1 May 2023. Please remember it.\n\nBob: turn 0")
    assert "Later, on 2 May 2023:\nBob: turn 10" in chunk and "Later, on 3 May 2023:" in chunk


def test_long_turn_is_split_only_when_it_alone_exceeds(hf_tokenizer):
    sentence = "Rex is a very good dog and Ann likes him. "
    long_turn = Turn(sentence * 200, speaker="Ann", date="1 May", turn_id="long")
    short = [Turn("short one.", speaker="Bob", date="1 May", turn_id=f"s{i}") for i in range(3)]
    out = chunk_turns([short[0], long_turn, short[1], short[2]], hf_tokenizer, 512)
    assert len(out.turn_chunks["long"]) > 1
    assert max(out.token_counts) <= 512
    pieces = [c for i, c in enumerate(out.chunks) if i in out.turn_chunks["long"]]
    assert all("Ann: " in p for p in pieces)  # each piece keeps its speaker
    assert "".join(pieces).count("Rex is a very good dog") == 200
    # short turns that fit are never split
    assert all(len(out.turn_chunks[f"s{i}"]) == 1 for i in range(3))


def test_forced_boundaries_start_new_chunks():
    turns = _turns(6)
    turns[3].new_chunk = True
    out = chunk_turns(turns, regex_token_count, 2048)
    assert len(out.chunks) == 2 and out.turn_chunks["t3"] == [1] and out.turn_chunks["t2"] == [0]


def test_text_units_cover_the_text_and_use_the_document_template():
    text = "First sentence here. Second one!\n\nA new paragraph? Yes.  Trailing"
    units = text_turns(text, "u")
    assert "".join(u.text for u in units) == text
    assert [u.turn_id for u in units] == [f"u{i}" for i in range(len(units))] and len(units) == 5
    out = chunk_turns(units, regex_token_count, 512)
    assert out.chunks[0].startswith("The following is part of a document. Please remember it.\n\nFirst sentence here.")


def test_too_small_limit_is_an_error():
    with pytest.raises(ValueError, match="no room after the template"):
        chunk_turns(_turns(3), regex_token_count, 20)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=40),
       limit=st.sampled_from([128, 256, 512]), breaks=st.sets(st.integers(min_value=0, max_value=39)))
def test_packing_properties(lengths, limit, breaks):
    turns = [Turn(" ".join(f"w{i}x{j}" for j in range(n)), speaker="A", date=f"{i // 7} May", turn_id=f"t{i}",
                  new_chunk=i in breaks) for i, n in enumerate(lengths)]
    out = chunk_turns(turns, regex_token_count, limit)
    assert out.token_counts == [regex_token_count(c) for c in out.chunks]
    assert max(out.token_counts) <= limit
    for i, turn in enumerate(turns):
        where = out.turn_chunks[turn.turn_id]
        assert where == list(range(where[0], where[-1] + 1))  # a split turn occupies consecutive chunks
        if i and turn.new_chunk:
            assert where[0] > out.turn_chunks[turns[i - 1].turn_id][-1]
    words = [w for c in out.chunks for w in c.split() if w.startswith("w") and "x" in w]
    assert words == [f"w{i}x{j}" for i, n in enumerate(lengths) for j in range(n)]  # nothing lost or reordered
