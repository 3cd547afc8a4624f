"""Minimal client for OpenAI-compatible chat completions (vLLM, llama.cpp server, Ollama) over HTTP.

Standard library only. The API key is read from the environment variable named in the config and is
never put into messages, logs or exceptions.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from memalpha.config import ModelConfig
from memalpha.errors import ServiceError
from memalpha.text import encodable


class EndpointError(ServiceError):
    """The endpoint is unreachable or answered with an error or an unexpected body."""


class OpenAIChatClient:
    """POSTs `{base_url}/chat/completions`; `complete_many` sends requests concurrently so a serving
    engine can batch them."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 60.0,
        concurrency: int = 8,
        start_hint: str = "start the server or fix model.openai_base_url",
    ):
        if not model:
            raise ValueError("model.openai_model is empty: name the model the endpoint serves")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.timeout = timeout
        self.concurrency = max(1, concurrency)
        self.start_hint = start_hint

    @classmethod
    def from_config(cls, model_cfg: ModelConfig) -> OpenAIChatClient:
        return cls(model_cfg.openai_base_url, model_cfg.openai_model, model_cfg.openai_api_key_env)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def complete(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0) -> str:
        """The assistant message text of one chat completion."""
        body = json.dumps(
            {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        ).encode()
        request = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise EndpointError(f"{self.url} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EndpointError(
                f"cannot reach the OpenAI-compatible endpoint {self.url} ({reason}); {self.start_hint}"
            ) from None
        try:
            content = json.loads(payload)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.url} returned an unexpected body: {payload[:300]!r}") from None
        return encodable(content or "")

    def complete_many(self, conversations: list[list[dict[str, str]]], max_tokens: int) -> list[str]:
        """Completions for many conversations, in order."""
        if len(conversations) <= 1 or self.concurrency == 1:
            return [self.complete(m, max_tokens) for m in conversations]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(lambda m: self.complete(m, max_tokens), conversations))
