"""Where rollouts are sampled (`rollout.engine`): every sampling path (trajectory and step-level GRPO, the
held-out evaluation, `memalpha eval --methods policy`) calls `sampling` once per batch of rollouts and
`sample` once per chunk position.

`hf`: memalpha's batched transformers loop (memalpha.training.generation) on the policy itself, the LoRA
merged into the weights for the duration.

`vllm`: a vLLM OpenAI-compatible server in its own process and environment (`make vllm`, then
`bash infra/servers.sh start-vllm`), serving the policy's base model with LoRA enabled. `sampling` hot-swaps the
policy's current LoRA into it when its weights changed since the last load (saved to a folder, loaded
under a new name, the previous one unloaded); `sample` sends one completion request per prompt with
`n` = its copies, the run's temperature and top-p and a seed drawn from the run's sampling generator, so
a resumed run sends the same seeds. Identical prompts share their prefill through vLLM's prefix cache.
The update stays memalpha's: the trainer recomputes the log-probs of what vLLM sampled.

`llamacpp`: a llama.cpp `llama-server` (`make llm`, `bash infra/servers.sh start-llama NAME`) writes for a
`ServedPolicy` (memalpha.models.llamacpp): a packaged LLM as an untrained prompted writer, or a trained
writer exported to GGUF (`memalpha export`). Prompts go as token ids, several completions of a prompt in one
request, and every completion is constrained by the tool-call grammar (`env.tools.tool_call_grammar`), so
it is valid JSON with at most MAX_CALLS_PER_CHUNK calls.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from memalpha.config import RolloutConfig
from memalpha.errors import ServiceError, UserError
from memalpha.training.generation import Generation, generate

SEED_RANGE = 2**31 - 1
REQUEST_TIMEOUT_S = 600.0
"""Longest wait for one vLLM request before the step fails (and is resumed like a crashed step)."""


class EngineError(ServiceError):
    """The vLLM server died, timed out or refused a request mid-step: the step is not logged, and the run
    resumes from its last checkpoint like any crashed step."""


@contextmanager
def sampling(policy, rcfg: RolloutConfig) -> Iterator[None]:
    """The policy ready to sample for one batch of rollouts."""
    if rcfg.engine == "vllm":
        vllm_client(rcfg).sync(policy)
        yield
    elif rcfg.engine == "llamacpp":
        served(policy).check()
        yield
    else:
        with policy.merged_adapter():  # sampling only (eval mode); the update runs the unmerged adapter
            yield


def sample(policy, prompts: list[list[int]], rcfg: RolloutConfig, *, copies: int, greedy: bool,
           generator: torch.Generator | None, eos_token_ids: list[int] | None = None) -> Generation:
    """`copies` completions of each tokenised prompt (copies of a prompt adjacent), on the chosen engine.
    `eos_token_ids`: where a completion ends (default: the tokenizer's end and pad tokens; [] runs every row
    to rollout.max_completion_length, for benchmarks)."""
    tokenizer = policy.tokenizer
    eos_ids = eos_token_ids if eos_token_ids is not None else (
        [tokenizer.eos_token_id] + ([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else []))
    if rcfg.engine == "llamacpp":
        return llamacpp_generate(served(policy), prompts, rcfg, copies=copies, greedy=greedy, generator=generator,
                                 to_cap=eos_token_ids == [])
    if rcfg.engine == "vllm":
        return vllm_client(rcfg).generate(prompts, copies=copies, max_new_tokens=rcfg.max_completion_length,
                                          eos_token_ids=eos_ids, temperature=rcfg.temperature, top_p=rcfg.top_p,
                                          greedy=greedy, generator=generator)
    return generate(policy.model, [x for x in prompts for _ in range(copies)], max_new_tokens=rcfg.max_completion_length,
                    eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id, temperature=rcfg.temperature,
                    top_p=rcfg.top_p, greedy=greedy, generator=generator)


def check_engine(rcfg: RolloutConfig, policy: str) -> None:
    """Fail early, with what to do, when a training run asks for `rollout.engine=llamacpp` (it writes with a
    served writer, not the run's policy), or `vllm` has no server or one serving another model than `policy`."""
    if rcfg.engine == "llamacpp":
        raise UserError("rollout.engine=llamacpp writes and evaluates (a packaged LLM or a `memalpha export`); "
                        "training samples on hf or vllm")
    if rcfg.engine == "vllm":
        from memalpha.models.loading import resolve_model_path

        vllm_client(rcfg).check_serves(resolve_model_path(policy))


def served(policy):
    """The ServedPolicy behind `rollout.engine=llamacpp` (loaded by `memalpha.models.llamacpp.served_policy`)."""
    from memalpha.models.llamacpp import ServedPolicy

    if not isinstance(policy, ServedPolicy):
        raise UserError("rollout.engine=llamacpp writes with a served writer: a packaged LLM (model.policy="
                        "qwen2.5-coder-0.5b) or a writer exported by `memalpha export`, not a policy loaded in-process")
    return policy


def _seeds(count: int, greedy: bool, generator: torch.Generator | None) -> list[int]:
    """One request seed per prompt from the run's sampling generator, so a resumed run sends the same seeds."""
    if generator is not None and not greedy:
        return torch.randint(SEED_RANGE, (count,), generator=generator, device=generator.device).tolist()
    return [0] * count


def llamacpp_generate(policy, prompts: list[list[int]], rcfg: RolloutConfig, *, copies: int, greedy: bool,
                      generator: torch.Generator | None, to_cap: bool = False) -> Generation:
    """One grammar-constrained request per prompt with `copies` completions; rows as the hf engine's.
    `to_cap`: no grammar and no end token, every row runs to the cap (benchmarks)."""
    if not prompts:
        return Generation([], [], [])
    start = time.perf_counter()
    jobs = [{"prompt": prompt, "max_tokens": rcfg.max_completion_length, "temperature": 0.0 if greedy else rcfg.temperature,
             "top_p": 1.0 if greedy else rcfg.top_p, "seed": int(seed), "copies": 1 if greedy else copies,
             "grammar": None if to_cap else policy.grammar, "ignore_eos": to_cap} for prompt, seed in zip(prompts, _seeds(len(prompts), greedy, generator))]
    answers = policy.client.complete_many(jobs)
    out = Generation([], [], [], decode_s=time.perf_counter() - start, prefilled_prompts=len({tuple(p) for p in prompts}))
    for completions in answers:
        for c in completions * copies if greedy else completions:  # greedy copies are identical: asked once
            out.completion_ids.append(c["tokens"])
            out.logps.append([0.0] * len(c["tokens"]))  # not asked: only an update reads them, and it recomputes
            out.truncated.append(not c["stopped"])
    return out


_CLIENTS: dict[str, VLLMClient] = {}


def vllm_client(rcfg: RolloutConfig) -> VLLMClient:
    """One client per server URL in this process, so the adapter it loaded is remembered between calls."""
    if rcfg.vllm_url not in _CLIENTS:
        _CLIENTS[rcfg.vllm_url] = VLLMClient(rcfg.vllm_url, timeout=REQUEST_TIMEOUT_S)
    return _CLIENTS[rcfg.vllm_url]


def lora_fingerprint(policy) -> str:
    """Hash of the LoRA weights: whether the server holds the policy's current adapter."""
    digest = hashlib.blake2b(digest_size=16)
    for name, param in policy.model.named_parameters():
        if "lora_" in name:
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


class VLLMClient:
    """HTTP client of one vLLM OpenAI-compatible server (`/v1/completions`, `/v1/load_lora_adapter`)."""

    def __init__(self, url: str, timeout: float):
        import httpx

        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout)
        self.base_model = self._models()[0]["id"]
        self.adapter_name: str | None = None
        self.adapter_dir: Path | None = None
        self.fingerprint: str | None = None
        self.loads = 0

    def _request(self, method: str, path: str, **kwargs):
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self._forget_adapter()
            raise EngineError(f"vLLM server {self.url} did not answer {path} ({type(exc).__name__}: {exc}); "
                              "restart it (`bash infra/servers.sh start-vllm`) and resume the run") from exc
        if response.status_code >= 400:
            self._forget_adapter()
            raise EngineError(f"vLLM server {self.url} refused {path}: HTTP {response.status_code} {response.text[:500]}")
        return response

    def _forget_adapter(self) -> None:
        """After a failed request the server may be a restarted one without our adapter: the next `sync`
        loads it again (a retried step in the same process, e.g. a Prefect task retry)."""
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.adapter_name, self.adapter_dir, self.fingerprint = None, None, None

    def _models(self) -> list[dict]:
        try:
            return self._request("GET", "/v1/models").json()["data"]
        except EngineError as exc:
            raise UserError(f"rollout.engine=vllm: no vLLM server answers at rollout.vllm_url={self.url} ({exc}). "
                            "Install it with `make vllm` and start it with `bash infra/servers.sh start-vllm` (or "
                            "`make up VLLM=1`), or set rollout.vllm_url") from exc

    def check_serves(self, policy_path: str) -> None:
        served = self._models()[0].get("root", self.base_model)
        if Path(served).resolve() != Path(policy_path).resolve() and served != policy_path:
            raise UserError(f"rollout.engine=vllm: the server at {self.url} serves {served}, the policy is "
                            f"{policy_path}; start the server on the policy's model (MEMALPHA_VLLM_MODEL)")

    def sync(self, policy) -> None:
        """Load the policy's current LoRA into the server unless it holds it already."""
        fingerprint = lora_fingerprint(policy)
        if fingerprint == self.fingerprint:
            return
        folder = Path(tempfile.mkdtemp(prefix="memalpha-vllm-lora-"))
        policy.save_adapter(folder)
        name = f"policy-{os.getpid()}-{self.loads}"
        self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        previous, previous_dir = self.adapter_name, self.adapter_dir
        self.adapter_name, self.adapter_dir, self.fingerprint = name, folder, fingerprint
        self.loads += 1
        if previous is not None:
            self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": previous})
            shutil.rmtree(previous_dir, ignore_errors=True)

    def generate(self, prompts: list[list[int]], *, copies: int, max_new_tokens: int, eos_token_ids: list[int],
                 temperature: float, top_p: float, greedy: bool, generator: torch.Generator | None) -> Generation:
        """One request per prompt with n=copies; rows in the order of the hf engine (copies adjacent)."""
        if not prompts:
            return Generation([], [], [])
        seeds = _seeds(len(prompts), greedy, generator)
        # vLLM refuses n > 1 when greedy; greedy copies are identical, so one is asked and repeated
        body = {"model": self.adapter_name or self.base_model, "n": 1 if greedy else copies, "max_tokens": max_new_tokens,
                "temperature": 0.0 if greedy else temperature, "top_p": 1.0 if greedy else top_p,
                "logprobs": 0, "return_tokens_as_token_ids": True, "stop_token_ids": sorted(set(eos_token_ids)),
                "skip_special_tokens": False, "ignore_eos": not eos_token_ids}  # no end tokens: run to max_tokens
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:
            answers = list(pool.map(lambda job: self._request("POST", "/v1/completions", json={
                **body, "prompt": job[0], "seed": int(job[1])}).json(), zip(prompts, seeds)))
        out = Generation([], [], [], decode_s=time.perf_counter() - start,
                         prefilled_prompts=len({tuple(p) for p in prompts}))
        eos = set(eos_token_ids)
        for answer in answers:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            for choice in choices * copies if greedy else choices:
                ids = [int(token.split(":", 1)[1]) for token in choice["logprobs"]["tokens"]]
                logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                out.completion_ids.append(ids)
                out.logps.append(logps)
                out.truncated.append(not (ids and ids[-1] in eos))
        return out
