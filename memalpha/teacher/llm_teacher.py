"""An LLM teacher for the warm start: best-of-n episodes of a prompted packaged LLM, filtered by evidence.

A packaged LLM (`qwen2.5-coder-1.5b`) writes each training window `samples` times, as the `llm_writer_*`
evaluation methods do: the same rollout machinery (`training.rollout.write_unasked`: writer prompt, episode,
tools, parser), on its llama.cpp server, every completion constrained by the tool-call grammar, here sampled
at `TEMPERATURE` with per-window seeds derived from the warm start's seed. Each sample is replayed on a fresh
memory the way a demonstration teaches it: its executed calls re-rendered as JSON lines (`env.tools.call_line`)
within the rollout's completion budget, its failed calls and a call the token cap cut dropped. A sample whose
replayed memory differs from the one its rollout wrote is dropped (its demonstrations would not be what the
teacher did); the others are scored by how much of their questions' evidence the final memory holds
(`evidence_held`). The best sample of a window is kept when that score reaches `min_evidence`; its chunks then
become demonstrations exactly as the rule writer's do (`teacher.demonstrations`: the student's prompt at each
chunk, the same length limits).

Samples are cached in a JSONL file under the model cache (`sample_cache`, keyed by the teacher and the config),
a window a line, appended as each window is written and matched by the window's id and the digest of its
chunks: a stopped run continues where it stopped, a finished one is read back without a server, and another
draw of windows or an edited window writes only the windows the file lacks. The cache holds what the teacher
wrote, not what is kept: a new threshold reuses it. LoCoMo is CC BY-NC, so demonstrations drawn from it are
never written into the repository.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from memalpha.config import RunConfig
from memalpha.data.schema import Instance, Question
from memalpha.env.episode import whole_memory_text
from memalpha.env.parsing import NOTHING_TO_STORE, parse_tool_calls
from memalpha.env.prompts import writer_system_prompt
from memalpha.env.tools import call_line, execute_call, tool_schemas
from memalpha.errors import UserError
from memalpha.memory import MemorySchema, MemoryStore
from memalpha.models.loading import LLM_MODELS, cache_dir
from memalpha.progress import WriteProgress, duration
from memalpha.rewards.coverage import mentions
from memalpha.rewards.qa import score_answer
from memalpha.teacher.demonstrations import Label
from memalpha.tokens import TokenCounter

RULE = "rule"
"""`--teacher rule`: the rule writer, and the evidence writer on real dialogue (`teacher.demonstrations`)."""
LLM_PREFIX = "llm:"
SAMPLES = 4
"""Episodes a window: one request each per chunk, so the default fills the llama.cpp server's slots
(`models.llamacpp.PARALLEL`)."""
TEMPERATURE = 1.0
"""The model's own distribution: best-of-n needs samples that differ."""
MIN_EVIDENCE = 0.5
"""A window is kept when its best sample's memory holds at least half the answers the window states. Prompted,
the 1.5B holds 4 of the 10 facts of the probe chat (tests/data/probe_chat.json), so a typical sample falls under
this bar and filtering is what makes the LLM a teacher; a memory holding less than half of what its window
states teaches the student to miss most of it."""
PROGRESS_EVERY_S = 15.0
CACHE_FOLDER = "demonstrations"
SCOPES = ("all", "dialogue")
"""What the LLM teaches: every dataset's windows, or only real dialogue's (windows that carry evidence turns),
the rule writer keeping the synthetic ones. Prompted, the 1.5B kept 1 of 16 synthetic windows at
MIN_EVIDENCE (docs/experiments.md, L-T1), while the rule writer labels every synthetic chunk."""


def evidence_held(questions: list[Question], window_text: str, memory_text: str) -> float | None:
    """The share of the questions whose gold answer the window states (`rewards.coverage.mentions`) that the
    memory answers under the evidence reader of the reports (`models.readers.EvidenceReader`: a gold answer
    occurs in it; a conflict counts only without its superseded value). None when the window states none:
    its worked-out answers (dates computed from "yesterday") cannot be found in any memory text."""
    from memalpha.models.readers import EvidenceReader  # memalpha.models loads torch on import

    stated = [q for q in questions if any(mentions(window_text, a) for a in q.answers)]
    if not stated:
        return None
    reader = EvidenceReader()
    return sum(score_answer(reader.answer_one(memory_text, q), q.answers, q.question_type, q.superseded_answers)
               for q in stated) / len(stated)


def taught_completion(store: MemoryStore, completion: str, chunk: int, count_tokens: TokenCounter,
                      budget: int) -> str | None:
    """Execute `completion` on `store` as its demonstration teaches it and return that demonstration: its
    calls that execute, as JSON lines, while they fit `budget` tokens (the calls after are not executed), or
    NOTHING_TO_STORE when it says so; None when nothing of it executes (an empty or unparseable output, or one
    the token cap cut inside its first call): a skip there would teach what the teacher did not choose."""
    parsed = parse_tool_calls(completion)
    if parsed.nothing_to_store:
        return NOTHING_TO_STORE
    lines, used = [], 0
    for call in parsed.calls:
        line = call_line(call.name, call.arguments)
        cost = count_tokens(line + "\n")
        if used + cost > budget:
            break
        if execute_call(store, call, chunk).ok:
            lines.append(line)
            used += cost
    return "\n".join(lines) or None


def memory_state(store: MemoryStore) -> dict[str, Any]:
    """A memory's paragraphs and entries (ids, texts, chunks), as a cache record keeps what a rollout wrote."""
    data = store.to_dict()
    return {"paragraphs": data["paragraphs"], "lists": data["lists"]}


def window_digest(instance: Instance) -> str:
    """What the teacher saw of a window: its chunks (its questions are withheld from the writer and score the
    samples when they are read, so editing them needs no new samples)."""
    return hashlib.sha256(json.dumps(instance.chunks, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class Scored:
    """One sample replayed as taught: its label per chunk, the memory the replay ends with and the evidence it
    holds."""

    labels: list[str | None]
    memory: dict[str, Any]
    evidence: float | None


def score_sample(instance: Instance, completions: list[str], schema: MemorySchema, count_tokens: TokenCounter,
                 budget: int) -> Scored:
    """Replay one sampled episode on a fresh memory (`taught_completion` per chunk) and score its final memory."""
    store = MemoryStore(schema, count_tokens)
    labels = [taught_completion(store, text, chunk, count_tokens, budget) for chunk, text in enumerate(completions)]
    return Scored(labels, memory_state(store),
                  evidence_held(instance.questions, "\n".join(instance.chunks), whole_memory_text(store)))


@dataclass
class TeacherStats:
    """What the LLM teacher wrote and kept, added up over the calls that share it (one a dataset of a mix)."""

    windows: int = 0
    samples: int = 0
    kept: int = 0
    unscored: int = 0
    """Windows that state no gold answer of their questions (dropped: nothing to measure a sample by)."""
    diverged: int = 0
    """Samples dropped because their replay's memory is not the one their rollout wrote (a call the replay's
    budget cut that executed in the rollout, or one that executes differently once re-rendered)."""
    generated: int = 0
    """Windows written by this process; the others were read from the cache."""
    best: dict[str, float] = field(default_factory=dict)
    """Per scored window (by instance_id), its best sample's evidence."""
    every: list[float] = field(default_factory=list)
    """Every scored sample's evidence."""
    seconds: float = 0.0
    """Generation time of the windows, cached ones as they were measured."""

    def to_dict(self) -> dict[str, Any]:
        mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
        return {"windows": self.windows, "samples": self.samples, "kept": self.kept, "unscored": self.unscored,
                "diverged": self.diverged, "generated": self.generated,
                "mean_best_evidence": mean(list(self.best.values())), "mean_evidence": mean(self.every),
                "minutes": round(self.seconds / 60, 2)}

    def line(self) -> str:
        d = self.to_dict()
        return (f"{d['windows']} windows x {d['samples'] // max(d['windows'], 1)} samples, {d['kept']} kept "
                f"({d['unscored']} state no answer; {d['diverged']} samples dropped, their replay not their memory) "
                f"| evidence: best {d['mean_best_evidence']}, all samples {d['mean_evidence']} | {d['minutes']} min "
                f"of generation ({d['generated']} windows written now)")


@dataclass
class LLMTeacher:
    """The LLM teacher of a warm start (`memalpha sft --teacher llm:MODEL`)."""

    model: str
    samples: int = SAMPLES
    min_evidence: float = MIN_EVIDENCE
    windows: int | None = None
    """Write at most this many windows of each dataset (a draw seeded by `grpo.seed`); None: all."""
    temperature: float = TEMPERATURE
    scope: str = "all"
    """One of SCOPES."""
    say: Callable[[str], None] = field(default=print, repr=False, compare=False)
    server: Callable[[], AbstractContextManager] | None = field(default=None, repr=False, compare=False)
    """A context the model's llama.cpp server runs in while windows are written (a benchmark starts it there);
    None: it is up already. Nothing is started when every window is cached."""
    stats: TeacherStats = field(default_factory=TeacherStats, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model not in LLM_MODELS:
            raise UserError(f"--teacher {LLM_PREFIX}{self.model}: no packaged LLM of that name; choose from "
                            + ", ".join(LLM_PREFIX + name for name in LLM_MODELS))
        if self.samples < 1:
            raise UserError(f"--samples {self.samples}: the teacher needs at least 1 sample a window")
        if not 0.0 <= self.min_evidence <= 1.0:
            raise UserError(f"--min-evidence {self.min_evidence}: a share of a window's questions, in [0, 1]")
        if self.scope not in SCOPES:
            raise UserError(f"--teach {self.scope}: choose from {', '.join(SCOPES)}")
        if self.windows is not None and self.windows < 1:
            raise UserError(f"--windows {self.windows}: at least 1 (leave it out for every training window)")

    @classmethod
    def from_spec(cls, spec: str, **options: Any) -> LLMTeacher | None:
        """`rule` -> None (the rule and evidence writers); `llm:MODEL` -> that LLM as the teacher."""
        if spec == RULE:
            return None
        if not spec.startswith(LLM_PREFIX):
            raise UserError(f"--teacher {spec}: use {RULE} or {LLM_PREFIX}MODEL ("
                            + ", ".join(LLM_PREFIX + name for name in LLM_MODELS) + ")")
        return cls(spec[len(LLM_PREFIX):], **options)

    def describe(self) -> dict[str, Any]:
        """What the teacher is, for the warm start's record and hash (`teacher.record.warm_start_fields`)."""
        return {"model": self.model, "gguf_sha256": LLM_MODELS[self.model].sha256, "samples": self.samples,
                "temperature": self.temperature, "min_evidence": self.min_evidence, "windows": self.windows,
                **({"scope": self.scope} if self.scope != "all" else {})}

    def teaches(self, instances: list[Instance]) -> bool:
        """Whether this teacher labels `instances` (one dataset); False leaves them to the rule writer."""
        from memalpha.teacher.evidence_writer import EvidenceWriter

        return self.scope == "all" or any(EvidenceWriter.applies(i) for i in instances)

    def labels(self, instances: list[Instance], config: RunConfig, count_tokens: TokenCounter) -> tuple[list[Instance], Label]:
        """The windows whose best sample holds at least `min_evidence` of their evidence, and that sample's
        label of each chunk. Writes the windows the cache lacks first (`_write`)."""
        chosen = self._draw(instances, config.grpo.seed)
        path = sample_cache(config, self)
        records = read_samples(path, chosen, self.samples)
        missing = [i for i in chosen if i.instance_id not in records]
        if missing:
            records.update(self._write(missing, config, path))
        schema, budget = config.memory.schema(), config.rollout.max_completion_length
        kept: dict[str, list[str | None]] = {}
        stats = self.stats
        for instance in chosen:
            record = records[instance.instance_id]
            scored = [score_sample(instance, completions, schema, count_tokens, budget) for completions in record["samples"]]
            agree = [s for s, memory in zip(scored, record["memories"]) if s.memory == memory]
            stats.windows += 1
            stats.samples += len(scored)
            stats.diverged += len(scored) - len(agree)
            stats.seconds += record["seconds"]
            if scored[0].evidence is None:
                stats.unscored += 1
            elif agree:
                best = max(agree, key=lambda s: s.evidence)  # the first of equals
                stats.best[instance.instance_id] = best.evidence
                stats.every.extend(s.evidence for s in agree)
                if best.evidence >= self.min_evidence:
                    kept[instance.instance_id] = best.labels
                    stats.kept += 1
        self.say(f"llm teacher {self.model}: {stats.line()}")
        return [i for i in chosen if i.instance_id in kept], lambda instance, episode: kept[instance.instance_id][episode.position]

    def _write(self, missing: list[Instance], config: RunConfig, path: Path) -> dict[str, dict[str, Any]]:
        """Write the `missing` windows on the served LLM, appending each to the cache as it is written; a line
        every PROGRESS_EVERY_S seconds as chunks are written, and at least every 30 s during a long request."""
        with self.server() if self.server is not None else nullcontext():
            return self._write_served(missing, config, path)

    def _write_served(self, missing: list[Instance], config: RunConfig, path: Path) -> dict[str, dict[str, Any]]:
        writer = _Writer(self, config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps(cache_fields(config, self), indent=1, sort_keys=True) + "\n")
        total = self.samples * sum(len(i.chunks) for i in missing)
        self.say(f"llm teacher {self.model}: writing {len(missing)} windows x {self.samples} samples ({total} chunks "
                 f"in all) into {path}")
        records = {}
        with _Progress(total, self.say, every=PROGRESS_EVERY_S, label=f"llm teacher {self.model}") as progress:
            for instance in missing:
                record = writer.write(instance, config.grpo.seed, progress)
                with path.open("a") as f:
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                records[instance.instance_id] = record
                self.stats.generated += 1
        return records

    def _draw(self, instances: list[Instance], seed: int) -> list[Instance]:
        twice = sorted(x for x, n in Counter(i.instance_id for i in instances).items() if n > 1)
        if twice:
            raise UserError(f"the LLM teacher keys its samples by instance_id, and these occur twice: {', '.join(twice[:5])}")
        if self.windows is None or self.windows >= len(instances):
            return list(instances)
        return random.Random(seed).sample(list(instances), self.windows)


def sample_cache(config: RunConfig, teacher: LLMTeacher) -> Path:
    """`<model cache>/demonstrations/<key>.jsonl`, the key hashing `cache_fields`; the `<key>.json` beside it,
    written when windows are first written, lists them."""
    key = hashlib.sha256(json.dumps(cache_fields(config, teacher), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / CACHE_FOLDER / f"{key}.jsonl"


def cache_fields(config: RunConfig, teacher: LLMTeacher) -> dict[str, Any]:
    """What the samples depend on besides their window (each record carries its window's digest): the teacher
    (model, its GGUF, samples, temperature), the seed, and what shapes its prompts and completions (memory
    layout, retrieval, prompt and tools, token budgets). Not the threshold: it is applied when reading; nor the
    scope: a window's samples are the same whichever datasets the teacher labels."""
    schema = config.memory.schema()
    return {
        "teacher": {k: v for k, v in teacher.describe().items() if k not in ("min_evidence", "windows", "scope")},
        "seed": config.grpo.seed, "top_p": config.rollout.top_p,
        "memory": config.memory.model_dump(mode="json"), "retrieval": config.retrieval.model_dump(mode="json"),
        "rollout": {k: getattr(config.rollout, k) for k in ("max_prompt_tokens", "max_completion_length")},
        "prompt": writer_system_prompt(schema), "tools": tool_schemas(schema),
    }


def read_samples(path: Path, instances: list[Instance], samples: int) -> dict[str, dict[str, Any]]:
    """{instance_id: record} of the `instances` whose window `path` holds whole (same id and chunks' digest):
    `samples` episodes of one completion a chunk, the memory each rollout wrote, the seconds it took. A line
    that is not such a record (a run stopped while appending it, an edit) is dropped from the file, so its
    window is written again; the file is then rewritten, as it is when its last line lacks its newline (a stop
    just before it), so the next append starts a line of its own. Records of other windows stay."""
    if not path.is_file():
        return {}
    wanted = {(i.instance_id, window_digest(i)): len(i.chunks) for i in instances}
    text = path.read_text()
    lines = text.removesuffix("\n").split("\n") if text else []  # not splitlines: a text may hold U+2028
    records, good = {}, []
    for line in lines:
        record = _record(line, samples)
        if record is None:
            continue
        key = (record["instance_id"], record["digest"])
        if key in wanted:
            if len(record["samples"][0]) != wanted[key]:
                continue
            records[record["instance_id"]] = record
        good.append(line)
    if len(good) < len(lines) or not text.endswith("\n") and text:
        _replace(path, "".join(line + "\n" for line in good))
    return records


def _record(line: str, samples: int) -> dict[str, Any] | None:
    """The cache record `line` holds, None unless it is one whole."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    episodes, memories, seconds = record.get("samples"), record.get("memories"), record.get("seconds")
    whole = (isinstance(record.get("instance_id"), str) and isinstance(record.get("digest"), str)
             and isinstance(episodes, list) and len(episodes) == samples
             and all(isinstance(e, list) and e and len(e) == len(episodes[0]) and all(isinstance(c, str) for c in e)
                     for e in episodes)
             and isinstance(memories, list) and len(memories) == samples and all(isinstance(m, dict) for m in memories)
             and isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
             and math.isfinite(seconds) and seconds >= 0)
    return record if whole else None


def _replace(path: Path, text: str) -> None:
    """`path` holds `text`, or (killed meanwhile) what it held: a rewrite in place could leave half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Writer:
    """Writes windows with the served LLM, started on first use (so a run read from its cache needs no server)."""

    def __init__(self, teacher: LLMTeacher, config: RunConfig):
        from memalpha.evaluation.methods import llm_writer_config

        self.teacher = teacher
        # completions capped at what a rollout may generate: a longer one would be cut in its demonstration
        self.config = llm_writer_config(config, teacher.model, config.rollout.max_completion_length, teacher.temperature)
        self._policy = None

    def write(self, instance: Instance, seed: int, on_chunks: Callable[[int], None]) -> dict[str, Any]:
        """The cache record of `instance`: its samples' completions and the memories their rollouts wrote."""
        import torch

        from memalpha.training.rollout import write_unasked

        if self._policy is None:
            from memalpha.models.llamacpp import served_policy

            self._policy = served_policy(self.config.model, self.config.memory.schema())
        # one generator a window: its samples do not depend on which windows a resumed run still had to write
        digest = hashlib.sha256(f"{seed}:{instance.instance_id}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
        began = time.perf_counter()
        n = self.teacher.samples
        written, rollouts = next(write_unasked(self._policy, [instance] * n, self.config, batch_size=n,
                                               generator=generator, greedy=False, on_chunks=on_chunks))
        return {"instance_id": instance.instance_id, "digest": window_digest(instance),
                "samples": [[s.completion for s in w.samples] for w in written],
                "memories": [memory_state(w.memory) for w in written],
                "tokens": rollouts.generated_tokens, "seconds": round(time.perf_counter() - began, 3)}


class _Progress(WriteProgress):
    """`WriteProgress` over the chunks the samples still need; its heartbeat, which a request that outlasts 30 s
    on a CPU brings, gives the rate and ETA too once a chunk is written."""

    def _waiting(self, now: float) -> str | None:
        line = super()._waiting(now)
        if line is None or not self.done:
            return line
        rate = self.done / (now - self.started)
        return f"{line} | {rate:.3f} chunks/s | ETA {duration((self.total - self.done) / rate)}"
