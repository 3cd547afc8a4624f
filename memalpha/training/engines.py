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

`llamacpp`: a llama.cpp `llama-server` (`make llm`) samples. For a `ServedPolicy` (memalpha.models.llamacpp;
`bash infra/servers.sh start-llama NAME`): a packaged LLM as an untrained prompted writer, or a trained writer
exported to GGUF (`memalpha export`); every completion is constrained by the tool-call grammar
(`env.tools.tool_call_grammar`), so it is valid JSON with at most MAX_CALLS_PER_CHUNK calls. For a policy
trained in this process: the `rollout` server (`LlamaRolloutServer`), restarted on the policy's current LoRA
whenever it changed, unconstrained like the other engines, so the rollouts are the policy's own samples.
Prompts go as token ids, several completions of a prompt in one request, each sampled token with its
log-prob; the update recomputes the trainer's.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
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
    """The vLLM server died, timed out or refused a request mid-step, or the llama.cpp rollout server did not
    start: the step is not logged, and the run resumes from its last checkpoint like any crashed step."""


@contextmanager
def sampling(policy, rcfg: RolloutConfig) -> Iterator[None]:
    """The policy ready to sample for one batch of rollouts."""
    if rcfg.engine == "vllm":
        vllm_client(rcfg).sync(policy)
        yield
    elif rcfg.engine == "llamacpp":
        if is_served(policy):
            policy.check()
        else:
            llama_rollout_server().sync(policy)
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
        if is_served(policy):
            return llamacpp_generate(policy.client, policy.grammar, prompts, rcfg, copies=copies, greedy=greedy,
                                     generator=generator, to_cap=eos_token_ids == [])
        return llama_rollout_server().generate(prompts, rcfg, copies=copies, greedy=greedy, generator=generator,
                                               to_cap=eos_token_ids == [])
    if rcfg.engine == "vllm":
        return vllm_client(rcfg).generate(prompts, copies=copies, max_new_tokens=rcfg.max_completion_length,
                                          eos_token_ids=eos_ids, temperature=rcfg.temperature, top_p=rcfg.top_p,
                                          greedy=greedy, generator=generator)
    return generate(policy.model, [x for x in prompts for _ in range(copies)], max_new_tokens=rcfg.max_completion_length,
                    eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id, temperature=rcfg.temperature,
                    top_p=rcfg.top_p, greedy=greedy, generator=generator)


def check_engine(rcfg: RolloutConfig, policy: str) -> None:
    """Fail early, with what to do, when `rollout.engine=llamacpp` cannot sample `policy` in training (no
    packaged GGUF of its base, no llama-server built, several processes), or `vllm` has no server or one
    serving another model than `policy`."""
    if rcfg.engine == "llamacpp":
        from memalpha.models.llamacpp import server_binary
        from memalpha.models.loading import PACKAGED_POLICIES

        if policy not in PACKAGED_POLICIES:
            raise UserError(f"rollout.engine=llamacpp trains policies whose base ships as a GGUF "
                            f"({', '.join(PACKAGED_POLICIES)}); model.policy={policy!r} has none: sample with "
                            "rollout.engine=hf or vllm")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError("rollout.engine=llamacpp trains in one process (one rollout server); sample with "
                            "rollout.engine=hf or vllm under torchrun")
        server_binary()  # built by `make llm`, else a UserError saying so
    if rcfg.engine == "vllm":
        from memalpha.models.loading import resolve_model_path

        vllm_client(rcfg).check_serves(resolve_model_path(policy))


def is_served(policy) -> bool:
    """Whether `policy` is a writer llama.cpp serves (`memalpha.models.llamacpp.served_policy`), not one loaded
    in this process."""
    from memalpha.models.llamacpp import ServedPolicy

    return isinstance(policy, ServedPolicy)


def _seeds(count: int, greedy: bool, generator: torch.Generator | None) -> list[int]:
    """One request seed per prompt from the run's sampling generator, so a resumed run sends the same seeds."""
    if generator is not None and not greedy:
        return torch.randint(SEED_RANGE, (count,), generator=generator, device=generator.device).tolist()
    return [0] * count


def llamacpp_generate(client, grammar: str | None, prompts: list[list[int]], rcfg: RolloutConfig, *, copies: int,
                      greedy: bool, generator: torch.Generator | None, to_cap: bool = False) -> Generation:
    """One request per prompt to `client` (a LlamaCppClient) with `copies` completions, constrained by `grammar`
    if any; rows as the hf engine's. `to_cap`: no grammar and no end token, every row runs to the cap (benchmarks)."""
    if not prompts:
        return Generation([], [], [])
    start = time.perf_counter()
    jobs = [{"prompt": prompt, "max_tokens": rcfg.max_completion_length, "temperature": 0.0 if greedy else rcfg.temperature,
             "top_p": 1.0 if greedy else rcfg.top_p, "seed": int(seed), "copies": 1 if greedy else copies,
             "grammar": None if to_cap else grammar, "ignore_eos": to_cap, "logprobs": True}
            for prompt, seed in zip(prompts, _seeds(len(prompts), greedy, generator))]
    answers = client.complete_many(jobs)
    out = Generation([], [], [], decode_s=time.perf_counter() - start, prefilled_prompts=len({tuple(p) for p in prompts}))
    for completions in answers:
        for c in completions * copies if greedy else completions:  # greedy copies are identical: asked once
            out.completion_ids.append(c["tokens"])
            out.logps.append(c["logps"])
            out.truncated.append(not c["stopped"])
    return out


class LlamaRolloutServer:
    """The llama.cpp server that samples a policy trained in this process (server name `rollout`, its port
    PORTS["rollout"] + MEMALPHA_LLAMA_PORT_OFFSET, its PID file and log where infra/servers.sh keeps them).
    llama-server reads LoRA files only at start (`--lora`; at runtime its /lora-adapters route sets the
    scales of those, it loads no new file), so `sync` restarts it: when the policy's LoRA changed since the
    last start, the adapter is saved, converted to a GGUF LoRA by `memalpha export`'s conversion against the
    policy's packaged base GGUF, and the server stopped and started on it by `infra/servers.sh`. Stopped when
    this process exits (one left by a killed run is stopped by the next run's first `sync`, or `make down`)."""

    NAME = "rollout"

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="memalpha-llama-rollout-"))
        # the state folder and port offset of its start, so the stop at exit finds the same server
        self.env = dict(os.environ)
        self.fingerprint: str | None = None
        self.exported: str | None = None
        """The fingerprint of the LoRA converted in `folder`: a restart after a crash reuses it."""
        self.client = None
        self.starts = 0
        self.sync_s = 0.0
        """Seconds of the last restart: the adapter saved and converted, the server stopped and started."""
        atexit.register(self.close)

    def _servers(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        from memalpha.models.loading import repo_root

        return subprocess.run(["bash", str(repo_root() / "infra" / "servers.sh"), *args, self.NAME],
                              env={**self.env, **env}, capture_output=True, text=True, timeout=600)

    def sync(self, policy) -> None:
        """Restart the server on the policy's current LoRA unless it runs it already."""
        from memalpha.commands.export import export
        from memalpha.models.llamacpp import LlamaCppClient, server_command

        fingerprint = lora_fingerprint(policy)
        if fingerprint == self.fingerprint:
            return
        start = time.perf_counter()
        self._forget()  # until the server runs this adapter
        if fingerprint != self.exported:
            self.exported = None  # until the new conversion is complete
            adapter = policy.save_adapter(self.folder / "adapter")
            export(adapter, self.folder / "export", policy.name)
            self.exported = fingerprint
        self._servers("stop-llama")
        command = server_command(self.NAME, export_dir=self.folder / "export")
        self.starts += 1
        started = self._servers("start-llama", MEMALPHA_LLAMA_COMMAND="\n".join(command))
        if started.returncode != 0:
            raise EngineError(f"the llama.cpp rollout server did not start on the step's LoRA: "
                              f"{(started.stderr or started.stdout).strip()[-1500:]}")
        self.client, self.fingerprint = LlamaCppClient(self.NAME), fingerprint
        self.sync_s = time.perf_counter() - start

    def _forget(self) -> None:
        if self.client is not None:
            self.client.http.close()  # its kept-alive connections would hold up the server's exit
        self.fingerprint, self.client = None, None

    def generate(self, prompts: list[list[int]], rcfg: RolloutConfig, *, copies: int, greedy: bool,
                 generator: torch.Generator | None, to_cap: bool) -> Generation:
        """`llamacpp_generate` on this server, without a grammar; after a failed request the next `sync`
        restarts it (a retried step in the same process)."""
        from memalpha.models.llamacpp import LlamaServerError

        if self.client is None:
            raise EngineError("the llama.cpp rollout server is not running the policy's LoRA: sample inside "
                              "`engines.sampling`, which (re)starts it")
        try:
            return llamacpp_generate(self.client, None, prompts, rcfg, copies=copies, greedy=greedy,
                                     generator=generator, to_cap=to_cap)
        except LlamaServerError:
            self._forget()
            raise

    def close(self) -> None:
        """Stop the server (at exit, or by a caller done with it); the next `llama_rollout_server` makes a new one."""
        self._forget()
        if self.starts:
            self._servers("stop-llama")
        self.starts, self.exported = 0, None
        shutil.rmtree(self.folder, ignore_errors=True)
        for key in [k for k, server in _ROLLOUT_SERVERS.items() if server is self]:
            del _ROLLOUT_SERVERS[key]


_ROLLOUT_SERVERS: dict[tuple[str, str], LlamaRolloutServer] = {}


def llama_rollout_server() -> LlamaRolloutServer:
    """One rollout server per port offset and state folder in this process, so its adapter is remembered
    between calls."""
    key = (os.environ.get("MEMALPHA_LLAMA_PORT_OFFSET", "0"), os.environ.get("MEMALPHA_STATE", ""))
    if key not in _ROLLOUT_SERVERS:
        _ROLLOUT_SERVERS[key] = LlamaRolloutServer()
    return _ROLLOUT_SERVERS[key]


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
