"""llama.cpp as an engine: one `llama-server` per model on 127.0.0.1 (OpenAI-compatible, `--parallel` slots
batched continuously), what it is started with, and its client.

The binary is built once by `infra/llama_cpp.sh` (`make llm`) into <cache>/llama.cpp/<version>/;
`infra/servers.sh start-llama NAME` starts a server with the command `server_command` prints
(`python -m memalpha.models.llamacpp command NAME`), so the ports and flags live here only.

Served models: the packaged LLMs (`LLM_MODELS`: readers and prompted writers), a writer exported by
`memalpha export` (its base GGUF plus a GGUF LoRA, served under the writer's name), and `rollout`: the LoRA of
a policy being trained with `rollout.engine=llamacpp`, restarted by the run on each new adapter with the
command it passes to `infra/servers.sh` (memalpha.training.engines.LlamaRolloutServer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memalpha.errors import ServiceError, UserError
from memalpha.models.loading import LLM_MODELS, cache_dir, llm_gguf, llm_tokenizer, load_tokenizer, resolve_model_path

LLAMA_CPP_VERSION = "0.3.36"
"""The llama-cpp-python release whose vendored llama.cpp `infra/llama_cpp.sh` builds."""
PORTS = {"qwen2.5-coder-0.5b": 8200, "qwen2.5-coder-1.5b": 8201, "writer": 8202, "rollout": 8203}
"""Default port of each server; MEMALPHA_LLAMA_PORT_OFFSET shifts them all (tests, a second checkout)."""
PARALLEL = 4
"""Slots decoded together (llama-server also caps one request's completions, `n_cmpl`, at this)."""
SLOT_TOKENS = 2048
"""Context of one slot: a reader's 1,024-token view or a writer's 1,024-token prompt plus its completion."""
REQUEST_TIMEOUT_S = 900.0
EXPORT_MANIFEST = "export.json"


class LlamaServerError(ServiceError):
    """A llama-server is down, died mid-run or refused a request: nothing of the batch was kept, and the
    run resumes from its caches once the server is back (`bash infra/servers.sh start-llama NAME`)."""


def server_binary() -> Path:
    path = cache_dir() / "llama.cpp" / LLAMA_CPP_VERSION / "bin" / "llama-server"
    if not path.is_file():
        raise UserError(f"{path} is missing: build llama.cpp with `make llm` (bash infra/llama_cpp.sh, 5-7 min once)")
    return path


def port(name: str) -> int:
    if name not in PORTS:
        raise UserError(f"no llama.cpp server named {name!r}; choose from {', '.join(PORTS)}")
    return PORTS[name] + int(os.environ.get("MEMALPHA_LLAMA_PORT_OFFSET", "0"))


def server_url(name: str) -> str:
    """Base URL of the server of `name` (OpenAI routes under /v1, llama.cpp's own at the root)."""
    return f"http://127.0.0.1:{port(name)}"


def writer_dir() -> Path:
    """Where `infra/servers.sh start-llama writer` finds the writer to serve: MEMALPHA_LLAMA_WRITER, else the
    last `memalpha export` (<cache>/llama.cpp/writer)."""
    return Path(os.environ.get("MEMALPHA_LLAMA_WRITER") or cache_dir() / "llama.cpp" / "writer")


def server_command(name: str, threads: int | None = None, export_dir: Path | None = None) -> list[str]:
    """argv of the llama-server of `name`: a packaged LLM, or `writer` / `rollout`, an exported base GGUF + LoRA
    (`memalpha export`'s folder): `export_dir`, by default `writer_dir()` for the writer; the rollout server's
    is its training run's, which starts it."""
    if name in ("writer", "rollout"):
        if export_dir is None and name == "rollout":
            raise UserError("the `rollout` llama.cpp server samples for a training run, which starts it itself "
                            "(`memalpha train --set rollout.engine=llamacpp`)")
        folder = export_dir or writer_dir()
        manifest = folder / EXPORT_MANIFEST
        if not manifest.is_file():
            raise UserError(f"{manifest} is missing: export a trained writer first (`memalpha export ADAPTER`)")
        export = json.loads(manifest.read_text())
        model, extra = Path(export["base_gguf"]), ["--lora", str(folder / export["lora_gguf"])]
        alias = export_alias(name, export["adapter_sha256"])  # what it serves, so a client can check it
    else:
        if name not in LLM_MODELS:
            raise UserError(f"no llama.cpp server named {name!r}; choose from {', '.join(PORTS)}")
        model, extra, alias = llm_gguf(name), [], name
    argv = [str(server_binary()), "--model", str(model), "--alias", alias, "--host", "127.0.0.1",
            "--port", str(port(name)), "--parallel", str(PARALLEL), "--ctx-size", str(PARALLEL * SLOT_TOKENS),
            "--threads", str(threads or os.cpu_count() or 1), "--no-webui", "--metrics", *extra]
    if os.environ.get("MEMALPHA_LLAMA_ARGS"):
        argv += shlex.split(os.environ["MEMALPHA_LLAMA_ARGS"])
    return argv


def export_alias(name: str, adapter_sha256: str) -> str:
    """The model name an exported server answers to: its name and the adapter it serves, by its sha256."""
    return f"{name}-{adapter_sha256[:12]}"


class LlamaServerDown(LlamaServerError, UserError):
    """No llama.cpp server answers where one is needed: to a command, a setup step (UserError: exit code 2 and
    how to start it); to a service, a server it needs is down (ServiceError: the served writer's 503)."""


def check_server(name: str, timeout: float = 5.0) -> None:
    """Raise LlamaServerDown saying how to start it when the server of `name` does not answer /health."""
    import httpx

    url = server_url(name)
    try:
        response = httpx.get(f"{url}/health", timeout=timeout)
    except httpx.HTTPError as exc:
        raise LlamaServerDown(f"no llama.cpp server for {name!r} answers at {url} ({type(exc).__name__}); start it with "
                        f"`bash infra/servers.sh start-llama {name}` (after `make llm`)") from None
    if response.status_code != 200:
        raise LlamaServerDown(f"the llama.cpp server for {name!r} at {url} is not ready (HTTP {response.status_code}); "
                        f"see infra/state/llama-{name}.log")


def restart_hint(name: str) -> str:
    """What to do when the server of `name` did not answer."""
    if name == "rollout":
        log = Path(os.environ.get("MEMALPHA_STATE") or "infra/state") / "llama-rollout.log"
        return f"run again: a training run restarts its rollout server (its log: {log})"
    return f"restart it with `bash infra/servers.sh start-llama {name}` and run again"


class LlamaCppClient:
    """llama.cpp's own `/completion` route: token-id prompts, a grammar, several completions of a prompt,
    the sampled tokens and their log-probs. Requests go out concurrently so the server's slots batch them."""

    def __init__(self, name: str, timeout: float = REQUEST_TIMEOUT_S, concurrency: int = 2 * PARALLEL):
        import httpx

        self.name = name
        self.url = server_url(name)
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self.concurrency = concurrency

    def request(self, path: str, body: dict | None = None) -> dict:
        """The JSON answer of `path`: `body` posted to it, or a GET without one."""
        import httpx

        try:
            response = self.http.get(path) if body is None else self.http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise LlamaServerError(f"llama.cpp server {self.name!r} at {self.url} did not answer {path} "
                                   f"({type(exc).__name__}); {restart_hint(self.name)}") from None
        if response.status_code >= 400:
            raise LlamaServerError(f"llama.cpp server {self.name!r} refused {path}: HTTP {response.status_code} "
                                   f"{response.text[:300]}")
        try:
            return response.json()
        except ValueError:
            raise LlamaServerError(f"llama.cpp server {self.name!r} answered {path} with a body that is not JSON: "
                                   f"{response.text[:200]!r}") from None

    def complete(self, prompt: list[int] | str, *, max_tokens: int, temperature: float, top_p: float = 1.0,
                 seed: int = 0, copies: int = 1, grammar: str | None = None, logprobs: bool = False,
                 ignore_eos: bool = False) -> list[dict]:
        """`copies` completions of one prompt: each {"tokens", "logps", "text", "stopped"}; a completion ends
        at the model's end-of-generation tokens (kept in "tokens", as the hf engine keeps them) or the grammar's
        end. Greedy when temperature is 0. `logprobs`: each sampled token's log-prob under log softmax(logits /
        temperature), the trainer's convention: at temperature 1 (and greedy) the raw logits' softmax (top-p and
        a grammar's mask ignored); at another temperature the sampler chain's probability, which renormalises
        over top-p's nucleus when top_p < 1 and follows a grammar's mask."""
        answers = []
        for first in range(0, copies, PARALLEL):  # the server refuses n_cmpl above its slots
            # temperature first, as hf and vLLM apply it before top-k/top-p
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": temperature, "top_p": top_p,
                    "top_k": 0, "min_p": 0.0, "seed": seed + first, "cache_prompt": True, "return_tokens": True,
                    "samplers": ["temperature", "top_k", "top_p", "min_p"], "n_cmpl": min(PARALLEL, copies - first),
                    "ignore_eos": ignore_eos}
            if grammar:
                body["grammar"] = grammar
            if logprobs:
                body["n_probs"], body["post_sampling_probs"] = 1, temperature not in (0.0, 1.0)
            answer = self.request("/completion", body)
            answers += answer if isinstance(answer, list) else [answer]
        out = []
        for a in answers:
            tokens = [int(t) for t in a.get("tokens", [])]
            logps = [float(p["logprob"]) if "logprob" in p else math.log(max(float(p["prob"]), 1e-45))  # a 0 is a tiny p
                     for p in a.get("completion_probabilities", [])] if logprobs else []
            out.append({"tokens": tokens, "logps": logps, "text": a.get("content", ""),
                        "stopped": a.get("stop_type") in ("eos", "word")})
        return out

    def served_model(self) -> str:
        """The model name the server answers to (its `--alias`)."""
        return self.request("/v1/models")["data"][0]["id"]

    def complete_many(self, jobs: list[dict]) -> list[list[dict]]:
        """`complete(**job)` for each job, concurrently, in order."""
        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(jobs))) as pool:
            return list(pool.map(lambda job: self.complete(**job), jobs))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class ServedPolicy:
    """A writer that llama.cpp runs (`rollout.engine=llamacpp`): the tokenizer its prompts are rendered and
    tokenised with, the server that samples, and the tool-call grammar every completion obeys."""

    server: str
    tokenizer: object
    grammar: str
    device: "torch.device" = field(default_factory=lambda: torch.device("cpu"))
    count_tokens: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from memalpha.tokens import tokenizer_counter

        self.count_tokens = tokenizer_counter(self.tokenizer)
        self.client = LlamaCppClient(self.server)

    def check(self) -> None:
        check_server(self.server)


def served_policy(model_cfg, schema, adapter: str | Path | None = None) -> ServedPolicy:
    """The writer of `model.policy` (+ `adapter`) on llama.cpp: a packaged LLM untrained, or a trained adapter
    served by the `writer` server, which must hold that adapter's export (checked by its sha256)."""
    from memalpha.env.tools import tool_call_grammar

    grammar = tool_call_grammar(schema)
    if adapter is None:
        if model_cfg.policy not in LLM_MODELS:
            raise UserError(f"rollout.engine=llamacpp: model.policy={model_cfg.policy!r} has no llama.cpp server; use "
                            f"{' or '.join(LLM_MODELS)}, or export a trained writer (`memalpha export`)")
        policy = ServedPolicy(model_cfg.policy, llm_tokenizer(model_cfg.policy), grammar)
    else:
        weights = Path(adapter) / "adapter_model.safetensors"
        if not weights.is_file():
            raise UserError(f"rollout.engine=llamacpp: {weights} is missing (not an adapter folder)")
        wanted = export_alias("writer", file_sha256(weights))
        restart = ("`bash infra/servers.sh stop-llama writer; bash infra/servers.sh start-llama writer`")
        # the tokenizer of model.policy: where the writer is served from the registry, its base model artifact
        policy = ServedPolicy("writer", load_tokenizer(resolve_model_path(model_cfg.policy)), grammar)
        policy.check()
        served = policy.client.served_model()
        if served != wanted:
            raise UserError(f"rollout.engine=llamacpp: the writer server serves {served}, not {adapter} ({wanted}); "
                            f"run `memalpha export {adapter}`, then {restart}")
        return policy
    policy.check()
    return policy


def wait_healthy(name: str, timeout: float) -> None:
    """Poll /health until the server answers (for scripts that just started it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check_server(name, timeout=2.0)
            return
        except UserError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llama.cpp servers of memalpha (used by infra/servers.sh)")
    parser.add_argument("what", choices=["command", "port", "names"])
    parser.add_argument("name", nargs="?")
    args = parser.parse_args(argv)
    try:
        if args.what == "names":
            print("\n".join(PORTS))
        elif args.what == "port":
            print(port(args.name))
        else:
            print("\n".join(server_command(args.name)))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
