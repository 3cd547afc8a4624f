"""The trainable policy: a causal LM wrapped with LoRA adapters (peft), plus its tokenizer and helpers.

The frozen reference (KL) and the "local" reader/judge are the same model with adapters disabled, so
only one copy of the base weights is in memory.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from memalpha.config import ModelConfig
from memalpha.models.loading import (
    choose_device,
    choose_dtype,
    load_base,
)
from memalpha.tokens import TokenCounter, tokenizer_counter
from memalpha.training.generation import generate, left_pad

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class AdapterError(ValueError):
    """An adapter folder is missing, incomplete or does not fit the policy's LoRA layout."""


def lora_config(model_cfg: ModelConfig):
    """The peft LoraConfig described by the model config."""
    from peft import LoraConfig

    return LoraConfig(
        r=model_cfg.lora_r,
        lora_alpha=model_cfg.lora_alpha,
        lora_dropout=model_cfg.lora_dropout,
        target_modules=list(model_cfg.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _adapted_layers(layers: int | list[int] | None) -> list[int] | None:
    """peft's `layers_to_transform` (one index, a list, or None for every layer) as a sorted list or None."""
    if layers is None or layers == []:
        return None
    return [layers] if isinstance(layers, int) else sorted(layers)


def _layout(r: int | None, target_modules, layers_to_transform) -> tuple:
    """What adapters must share to take each other's weights: rank, adapted modules (peft keeps them as a
    set, written in any order) and adapted layers."""
    return r, sorted(target_modules or []), _adapted_layers(layers_to_transform)


def _saved_layout(config: dict) -> tuple:
    return _layout(config.get("r"), config.get("target_modules"), config.get("layers_to_transform"))


def check_adapter_dir(path: str | Path) -> Path:
    """The adapter folder, or AdapterError naming what is missing."""
    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise AdapterError(f"adapter folder {path} has no {name}")
    return path


@dataclass
class Policy:
    """A LoRA-wrapped causal LM with its tokenizer (pad token set, left padding)."""

    model: "torch.nn.Module"  # peft.PeftModel
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    name: str
    count_tokens: TokenCounter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.count_tokens = tokenizer_counter(self.tokenizer)

    # --- adapters -------------------------------------------------------------------------------------
    @contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Run the frozen base model (reference policy for KL, local reader and judge)."""
        with self.model.disable_adapter():
            yield

    @contextmanager
    def merged_adapter(self) -> Iterator[None]:
        """Inference with the LoRA deltas folded into the base weights: one matmul per layer instead of
        three (10% more sampling throughput at batch 8 here, bench/results/rollout.md). The base tensors
        are swapped back on exit, bit for bit (peft's unmerge subtracts the delta again, which drifts in bf16).
        Runs in eval mode, where merging is exact (no LoRA dropout); the training flag is restored on exit."""
        from peft.tuners.lora import LoraLayer

        def merged_weights() -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
            for layer in self.model.modules():
                if not isinstance(layer, LoraLayer) or layer.merged:
                    continue
                adapters = [a for a in layer.active_adapters if a in layer.lora_A]
                if adapters:
                    weight = layer.get_base_layer().weight
                    yield weight, weight.data + sum(layer.get_delta_weight(a) for a in adapters).to(weight.dtype)

        with self._swapped_in_eval(merged_weights()), self.adapters_disabled():
            yield

    @contextmanager
    def _swapped_in_eval(self, replacements: Iterator[tuple[torch.nn.Parameter, torch.Tensor]]) -> Iterator[None]:
        """Eval mode with each parameter's tensor replaced (computed without gradients); the original tensors
        and the training flag come back on exit."""
        swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for param, replacement in replacements:
                    swapped.append((param, param.data))
                    param.data = replacement
            yield
        finally:
            for param, original in swapped:
                param.data = original
            self.model.train(was_training)

    def save_adapter(self, path: str | Path) -> Path:
        """Write the LoRA weights (safetensors) and adapter config to `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(path), safe_serialization=True)
        return path

    def load_adapter(self, path: str | Path) -> None:
        """Load LoRA weights saved by save_adapter into the current adapter (same rank and targets)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = check_adapter_dir(path)
        saved = json.loads((path / ADAPTER_CONFIG).read_text())
        current = self.model.peft_config["default"]
        saved_r, saved_targets, saved_layers = _saved_layout(saved)
        current_r, current_targets, current_layers = _layout(current.r, current.target_modules, current.layers_to_transform)
        if (saved_r, saved_targets, saved_layers) != (current_r, current_targets, current_layers):
            raise AdapterError(
                f"adapter {path} has r={saved_r} targets={saved_targets} layers={saved_layers or 'all'}, the policy "
                f"has r={current_r} targets={current_targets} layers={current_layers or 'all'}"
            )
        state = load_file(str(path / ADAPTER_WEIGHTS), device=str(self.device))
        result = set_peft_model_state_dict(self.model, state)
        if result.unexpected_keys:
            raise AdapterError(f"adapter {path} has weights the policy lacks: {result.unexpected_keys[:3]}")

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The LoRA parameters (the only ones with requires_grad)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    # --- text -----------------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Messages rendered with the tokenizer's chat template, as text."""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Left-padded batch of rendered prompts on the policy's device; the template already holds the
        special tokens, so none are added."""
        rows = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        ids, mask = left_pad(rows, self.tokenizer.pad_token_id, self.device)
        return {"input_ids": ids, "attention_mask": mask}

    @torch.no_grad()
    def generate_text(
        self, prompts: list[str], max_new_tokens: int, *, batch_size: int = 16, max_prompt_tokens: int | None = None
    ) -> list[str]:
        """Greedy completions (special tokens removed) of rendered prompts, in batches (the reader and the
        judge); prompts longer than max_prompt_tokens keep their last tokens."""
        tokenizer = self.tokenizer
        ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
        if max_prompt_tokens is not None:
            ids = [row[-max_prompt_tokens:] for row in ids]
        eos = [t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None]
        outputs: list[str] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(ids), batch_size):
                out = generate(self.model, ids[start : start + batch_size], max_new_tokens=max_new_tokens,
                               eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id, greedy=True)
                outputs.extend(tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True))
        finally:
            self.model.train(was_training)
        return [text.strip() for text in outputs]


def load_policy(
    model_cfg: ModelConfig,
    adapter: str | Path | None = None,
    *,
    trainable: bool = True,
    seed: int = 0,
) -> Policy:
    """Load the base model named by `model_cfg.policy` and wrap it with LoRA.

    `adapter`: an adapter folder (resume, SFT warm start, evaluation of a checkpoint) loaded instead of a
    fresh LoRA init; its own rank/targets win over the config. `seed` fixes the tiny model's weights and
    the fresh LoRA init.
    """
    from peft import PeftModel, get_peft_model

    device = choose_device(model_cfg.device)
    dtype = choose_dtype(model_cfg.dtype, device)
    base, tokenizer = load_base(model_cfg.policy, dtype, device, seed=seed)
    torch.manual_seed(seed)
    if adapter is not None:
        adapter_dir = check_adapter_dir(adapter)
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
    else:
        model = get_peft_model(base, lora_config(model_cfg))
        if not trainable:
            for param in model.parameters():
                param.requires_grad_(False)
    model.to(device)
    model.eval()  # training code switches to train() around its updates
    log.info("policy %s on %s (%s), adapter=%s", model_cfg.policy, device, dtype, adapter)
    return Policy(model=model, tokenizer=tokenizer, device=device, dtype=dtype, name=model_cfg.policy)
