"""The compared methods. Each builds, for every instance, one reader context per question; the runner
then has the same reader answer all of them and scores with memalpha.rewards.qa.score_answer.

Every context obeys the same budget, `memory.reader_view_tokens` tokens of the shared token counter:
- memory methods (`policy`, `base`, `sft`, `rule_writer`): the reader view of the finished memory (core
  plus retrieved entries, `retrieval.method`, top `retrieval.top_k` per list);
- `rag`: the `eval.rag_top_k` raw chunks the retriever ranks highest for the question;
- `long_context`: the last `eval.long_context_tokens` tokens of the raw conversation (default: the
  budget itself);
- `no_memory`: nothing (closed book);
- `oracle_evidence`: the question's gold evidence turns (LoCoMo), else its evidence chunks: the reader's
  ceiling, what it scores when the memory holds exactly what the question needs;
- `llm_writer_0.5b`, `llm_writer_1.5b`: the untrained Qwen2.5-Coder Instruct models prompted as writers
  through the same tools, parser and memory, on llama.cpp, each completion constrained by the tool-call
  grammar (the paper's "base model" rows).

"Memory tokens" is what a method keeps to answer from: the memory store's size for memory methods,
every raw chunk for RAG (it must keep the whole conversation indexed), the kept tail for long context,
and 0 for closed book.
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from memalpha.config import EVAL_METHODS, RunConfig
from memalpha.data.schema import Instance
from memalpha.env.episode import Episode, answers_lost, whole_memory_text
from memalpha.errors import UserError
from memalpha.memory import MemoryStore, reader_view, truncate_to_tokens
from memalpha.models.policy import ADAPTER_CONFIG
from memalpha.retrieval import ChunkIndex, MemoryIndex
from memalpha.rewards.coverage import memory_support
from memalpha.teacher.rule_writer import rule_writer_for, run_rule_writer
from memalpha.tokens import TokenCounter
from memalpha.training.checkpoint import (
    ADAPTER,
    BEST,
    latest_checkpoint,
    policy_adapter,
)

if TYPE_CHECKING:
    from memalpha.retrieval import TextEncoder


_WORD_START = re.compile(r"\S+")


@dataclass
class Built:
    """What a method built for one instance: one reader context per question, and its costs."""

    contexts: list[str]
    memory_tokens: int
    tool_calls: int = 0
    tool_calls_ok: int = 0
    seconds: float = 0.0
    """Time spent building (for batched methods, the batch's time shared evenly over its instances)."""
    memory: dict[str, Any] | None = None
    """The finished memory (MemoryStore.to_dict) for memory methods, kept for inspection."""
    answers_lost: int | None = None
    """For memory writers: answers the memory held after some chunk and lost by the end (`answers_lost`)."""
    prompts_cut: int = 0
    """For memory writers: writer prompts longer than rollout.max_prompt_tokens, whose start was cut."""
    rechunked: bool = False
    """For memory writers: the instance's chunks were longer than the writer's and were cut to its size."""


@dataclass
class EvalEnv:
    """What every method shares: the config, the one token counter, the memory layout and the embedder."""

    config: RunConfig
    count_tokens: TokenCounter
    embedder: "TextEncoder | None" = None
    """Dense retrieval encoder; None loads the shared one for retrieval.embedding_model when needed."""
    progress: Callable[[str], None] | None = None
    """Where long-running methods report progress (one line per rollout batch)."""

    def say(self, message: str) -> None:
        if self.progress is not None:
            self.progress(message)

    @cached_property
    def schema(self):
        return self.config.memory.schema()

    @property
    def budget(self) -> int:
        """Reader context budget in tokens, the same for every method."""
        return self.config.memory.reader_view_tokens

    def new_store(self) -> MemoryStore:
        return MemoryStore(self.schema, count_tokens=self.count_tokens)

    def memory_contexts(self, store: MemoryStore, index: MemoryIndex, instance: Instance) -> list[str]:
        """The reader view of a finished memory for each question of the instance."""
        top_k = self.config.retrieval.top_k
        return [
            reader_view(store, q.question, search=index.search, budget_tokens=self.budget, top_k=top_k)
            for q in instance.questions
        ]


class Method(ABC):
    """A way to give the reader a context. `stochastic` methods are re-run for each seed."""

    name: str = ""
    stochastic: bool = False

    def __init__(self, env: EvalEnv):
        self.env = env

    @abstractmethod
    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        """One `Built` per instance, in order."""

    def close(self) -> None:
        """Release models or other resources (called once the method has run)."""


class NoMemory(Method):
    """Closed book: the reader answers with an empty context."""

    name = "no_memory"

    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        return [Built(contexts=["" for _ in inst.questions], memory_tokens=0) for inst in instances]


def tail_tokens(text: str, max_tokens: int, count: TokenCounter) -> str:
    """Longest suffix of `text` starting at a word boundary with at most `max_tokens` tokens."""
    if max_tokens <= 0:
        return ""
    if count(text) <= max_tokens:
        return text
    starts = [m.start() for m in _WORD_START.finditer(text)]
    lo, hi = 0, len(starts)  # invariant: the suffix from starts[hi] fits (hi == len: empty suffix)
    while lo < hi:
        mid = (lo + hi) // 2
        if count(text[starts[mid]:]) <= max_tokens:
            hi = mid
        else:
            lo = mid + 1
    return text[starts[hi]:] if hi < len(starts) else ""


class LongContext(Method):
    """The reader sees the last N tokens of the raw conversation (N = eval.long_context_tokens or the budget)."""

    name = "long_context"

    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        limit = self.env.config.eval.long_context_tokens or self.env.budget
        count = self.env.count_tokens
        built = []
        for inst in instances:
            # walk back over chunks so only the tail is tokenised, however long the instance
            kept: list[str] = []
            used = 0
            for chunk in reversed(inst.chunks):
                room = limit - used
                if room <= 0:
                    break
                tokens = count(chunk)
                if tokens <= room:
                    kept.append(chunk)
                    used += tokens
                else:
                    kept.append(tail_tokens(chunk, room, count))
                    break
            context = "\n\n".join(reversed([k for k in kept if k]))
            # the separators may add a token or two; enforce the limit on the joined text
            context = tail_tokens(context, limit, count)
            built.append(Built(contexts=[context for _ in inst.questions], memory_tokens=count(context)))
        return built


class RagTopK(Method):
    """BM25 (retrieval.method) over the raw chunks: the top `eval.rag_top_k` chunks for each question,
    most relevant first into the budget, shown in conversation order."""

    name = "rag"

    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        cfg = self.env.config
        count = self.env.count_tokens
        built = []
        for inst in instances:
            index = ChunkIndex(inst.chunks, cfg.retrieval, self.env.embedder)
            contexts = []
            for question in inst.questions:
                chosen: dict[int, str] = {}
                used = 0
                for position in index.search(question.question, cfg.eval.rag_top_k):
                    room = self.env.budget - used
                    if room <= 0:
                        break
                    text, _ = truncate_to_tokens(inst.chunks[position], room, count)
                    chosen[position] = text
                    used += count(text) + 1
                joined = "\n\n".join(chosen[p] for p in sorted(chosen))
                contexts.append(truncate_to_tokens(joined, self.env.budget, count)[0])
            built.append(Built(contexts=contexts, memory_tokens=sum(count(c) for c in inst.chunks)))
        return built


class OracleEvidence(Method):
    """The reader's ceiling: each question's gold evidence turns ("date, speaker: text", from the instance's
    `evidence_turns` metadata), else its evidence chunks, in conversation order within the budget."""

    name = "oracle_evidence"

    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        count = self.env.count_tokens
        built = []
        for inst in instances:
            turns = inst.metadata.get("evidence_turns") or {}
            contexts = []
            for q in inst.questions:
                if turns.get(q.question_id):
                    lines = [f"{t['date'] + ', ' if t.get('date') else ''}{t['speaker']}: {t['text']}"
                             for t in sorted(turns[q.question_id], key=lambda t: t["chunk"])]
                else:
                    lines = [inst.chunks[c] for c in sorted(set(q.evidence_chunks or [])) if 0 <= c < len(inst.chunks)]
                contexts.append(truncate_to_tokens("\n".join(lines), self.env.budget, count)[0])
            built.append(Built(contexts=contexts, memory_tokens=count("\n".join(dict.fromkeys(contexts)))))
        return built


class RuleWriterMethod(Method):
    """The rule-based writer builds the memory chunk by chunk through the tools, seeing what a policy
    sees (it can only update entries the writer view shows)."""

    name = "rule_writer"

    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        cfg = self.env.config
        writer = rule_writer_for(cfg, self.env.count_tokens)
        built = []
        for inst in instances:
            episode = Episode(inst, self.env.schema, cfg.memory, cfg.retrieval, self.env.count_tokens,
                              embedder=self.env.embedder, shadowed_conflict_credit=cfg.reward.shadowed_conflict_credit)
            steps = list(run_rule_writer(episode, writer))
            results = [r for step in steps for r in step.results]
            built.append(
                Built(
                    contexts=self.env.memory_contexts(episode.store, episode.index, inst),
                    memory_tokens=episode.store.token_count(),
                    tool_calls=len(results),
                    tool_calls_ok=sum(r.ok for r in results),
                    memory=episode.store.to_dict(),
                    answers_lost=answers_lost([step.memory_support for step in steps]),
                )
            )
        return built


class PolicyMethod(Method):
    """A LoRA policy writes the memory through the rollout machinery (memalpha.training.rollout), G=1 per
    instance, batched over `eval.batch_size` instances; greedy unless `eval.temperature` > 0.

    `policy`: the trained adapter; `sft`: the warm-start adapter; `base`: a fresh LoRA (zero update), i.e.
    the untrained base model. Instances reach the rollout without their questions: the shared reader
    answers them afterwards, like every other method's.
    """

    def __init__(self, env: EvalEnv, name: str, adapter: str | Path | None):
        super().__init__(env)
        self.name = name
        self.adapter = adapter
        self.stochastic = env.config.eval.temperature > 0
        self._policy = None

    @property
    def policy(self):
        if self._policy is None:
            from memalpha.models.policy import load_policy
            from memalpha.training.engines import check_engine

            cfg = self.env.config
            if cfg.rollout.engine == "llamacpp":
                from memalpha.models.llamacpp import served_policy

                self._policy = served_policy(cfg.model, self.env.schema, self.adapter)
            else:
                check_engine(cfg.rollout, cfg.model.policy)  # rollout.engine=vllm: its server
                self._policy = load_policy(cfg.model, adapter=self.adapter, trainable=False)
        return self._policy

    def _rollout_config(self) -> RunConfig:
        cfg = self.env.config
        rollout = {"temperature": cfg.eval.temperature or cfg.rollout.temperature, "top_p": cfg.eval.top_p}
        return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})

    def build(self, instances: list[Instance], seed: int) -> list[Built]:
        import torch

        from memalpha.data.chunking import TokenCounts, fit_instance
        from memalpha.teacher.record import writer_chunk_tokens
        from memalpha.training.rollout import write_unasked
        from memalpha.progress import WriteProgress

        chunk_tokens = writer_chunk_tokens(self.adapter)
        fitted = [fit_instance(inst, TokenCounts(self.policy.tokenizer), chunk_tokens) for inst in instances]
        instances, rechunked = [f[0] for f in fitted], {f[0].instance_id for f in fitted if f[1]}
        if rechunked:
            self.env.say(f"  {self.name}: {len(rechunked)} of {len(instances)} instances have chunks longer than the "
                         f"writer's {chunk_tokens} tokens: cut to that size")
        generator = None if not self.stochastic else torch.Generator(device=self.policy.device).manual_seed(seed)
        size = self.env.config.eval.batch_size
        progress = WriteProgress(sum(len(i.chunks) for i in instances), self.env.say, label=f"  {self.name}: writing")
        with progress:
            batches = write_unasked(self.policy, instances, self._rollout_config(), batch_size=size,
                                    generator=generator, greedy=not self.stochastic, on_chunks=progress)
            built: list[Built] = []
            began = time.perf_counter()  # each batch is written when the loop asks for it
            for number, (written, rollouts) in enumerate(batches, 1):
                elapsed = time.perf_counter() - began
                self.env.say(
                    f"  {self.name}: batch {number}/{-(-len(instances) // size)} ({len(written)} instances, "
                    f"{max(len(w.instance.chunks) for w in written)} chunk steps, {rollouts.generated_tokens:,} tokens generated) in {elapsed:.1f} s"
                )
                for w in written:
                    results = [res for sample in w.samples for res in sample.results]
                    # the policy wrote without the questions: their support is read off each step's memory now
                    supports = [memory_support(w.instance.questions, whole_memory_text(MemoryStore.from_json(s.memory_json)))
                                for s in w.samples]
                    # measured by the evaluation's one counter, not the writer's tokenizer: every method's sizes
                    # and reader budget in the same tokens
                    memory = MemoryStore.from_dict(w.memory.to_dict(), self.env.count_tokens)
                    index = MemoryIndex(memory, self.env.config.retrieval, self.env.embedder)
                    built.append(Built(
                        contexts=self.env.memory_contexts(memory, index, w.instance),
                        memory_tokens=memory.token_count(),
                        tool_calls=len(results),
                        tool_calls_ok=sum(r.ok for r in results),
                        seconds=elapsed / len(written),
                        memory=w.memory.to_dict(),
                        answers_lost=answers_lost(supports),
                        prompts_cut=sum(s.prompt_truncated for s in w.samples),
                        rechunked=w.instance.instance_id in rechunked,
                    ))
                began = time.perf_counter()
        return built

    def close(self) -> None:
        self._policy = None


LLM_WRITERS = {"llm_writer_0.5b": "qwen2.5-coder-0.5b", "llm_writer_1.5b": "qwen2.5-coder-1.5b"}
LLM_WRITER_COMPLETION_TOKENS = 384
"""An LLM writer's token cap a chunk: room for the grammar's MAX_CALLS_PER_CHUNK calls of a few dozen tokens."""


def llm_writer_config(config: RunConfig, model: str, max_completion_length: int = LLM_WRITER_COMPLETION_TOKENS,
                      temperature: float | None = None) -> RunConfig:
    """`config` with the packaged LLM `model` as the writer on its llama.cpp server (`served_policy` of its
    `model`, rollouts through `training.rollout` as any policy's), `max_completion_length` tokens a chunk and,
    when given, its sampling `temperature` (the LLM teacher's)."""
    rollout = {"engine": "llamacpp", "max_completion_length": max_completion_length}
    if temperature is not None:
        rollout["temperature"] = temperature
    return config.model_copy(update={"model": config.model.model_copy(update={"policy": model}),
                                     "rollout": config.rollout.model_copy(update=rollout)})


def llm_writer(env: EvalEnv, name: str) -> PolicyMethod:
    """A packaged LLM prompted as the writer on its llama.cpp server (no adapter, greedy unless eval.temperature)."""
    config = llm_writer_config(env.config, LLM_WRITERS[name])
    return PolicyMethod(EvalEnv(config, env.count_tokens, env.embedder, env.progress), name, adapter=None)


_BASELINE_CLASSES: dict[str, type[Method]] = {
    "oracle_evidence": OracleEvidence,
    "no_memory": NoMemory,
    "long_context": LongContext,
    "rag": RagTopK,
    "rule_writer": RuleWriterMethod,
}


def make_method(name: str, env: EvalEnv, model_uri: str | None = None) -> Method:
    """The method called `name`; `policy` evaluates the adapter at `model_uri`, `sft` the configured
    warm-start adapter, `base` the untrained base policy."""
    if name in _BASELINE_CLASSES:
        return _BASELINE_CLASSES[name](env)
    if name == "policy":
        if model_uri is None:
            raise ValueError("method 'policy' needs a model (an adapter folder)")
        return PolicyMethod(env, "policy", adapter=model_uri)
    if name == "sft":
        if not env.config.eval.sft_adapter:
            raise ValueError("method 'sft' needs eval.sft_adapter (the warm-start adapter folder)")
        return PolicyMethod(env, "sft", adapter=env.config.eval.sft_adapter)
    if name == "base":
        return PolicyMethod(env, "base", adapter=None)
    if name in LLM_WRITERS:
        return llm_writer(env, name)
    raise ValueError(f"unknown evaluation method {name!r}; choose from {', '.join(EVAL_METHODS)}")


_URI_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:", "s3://", "gs://", "http://", "https://")


MLMODEL = "MLmodel"


def model_artifacts(folder: Path) -> dict[str, Path]:
    """The artifacts of a downloaded memory-writer model (`serving/writer_model.py`, a pyfunc): the paths its
    MLmodel file names under `flavors.python_function.artifacts` (`adapter`, `base_model`, `config`),
    resolved inside `folder`; {} when it names none."""
    flavors = (yaml.safe_load((Path(folder) / MLMODEL).read_text()) or {}).get("flavors", {})
    artifacts = (flavors.get("python_function") or {}).get("artifacts") or {}
    return {name: Path(folder) / spec["path"] for name, spec in artifacts.items() if isinstance(spec, dict) and "path" in spec}


def resolve_adapter(model: str | Path) -> Path:
    """The LoRA adapter folder behind `model`: an adapter folder itself (a shipped one in `adapters/` too),
    a training checkpoint (`<ckpt>/adapter`), a run folder (the adapter it selected on validation QA,
    `best/adapter`, else its latest checkpoint's), or a downloaded registered model (the `adapter`
    artifact its MLmodel names). MLflow URIs are resolved by the tasks layer, not here."""
    text = str(model)
    if text.startswith(_URI_SCHEMES):
        raise UserError(
            f"--model {text}: remote/MLflow URIs are resolved by the pipeline (flow `evaluate`); download the model "
            "first (`mlflow artifacts download -u URI -d DIR`) and pass the folder"
        )
    path = Path(text).expanduser()
    if not path.exists():
        raise UserError(f"--model {path}: no such file or folder")
    if (path / ADAPTER_CONFIG).is_file():
        return path
    if (path / ADAPTER / ADAPTER_CONFIG).is_file():
        return policy_adapter(path)
    if (path / BEST / ADAPTER / ADAPTER_CONFIG).is_file():
        return path / BEST / ADAPTER
    latest = latest_checkpoint(path)
    if latest is not None and (latest / ADAPTER / ADAPTER_CONFIG).is_file():
        return policy_adapter(latest)
    if (path / MLMODEL).is_file():
        adapter = model_artifacts(path).get("adapter")
        if adapter is not None and (adapter / ADAPTER_CONFIG).is_file():
            return adapter
        raise UserError(f"--model {path}: the MLmodel names no adapter artifact with {ADAPTER_CONFIG} (a memory-writer "
                        f"model logged by memalpha has one)")
    raise UserError(
        f"--model {path}: not an adapter folder ({ADAPTER_CONFIG}), checkpoint (adapter/), run folder (best/, checkpoints/) "
        "or downloaded registered model (MLmodel)"
    )
