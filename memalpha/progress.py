"""One progress line per step, for people watching a run: step k/N, what was measured, seconds per step
and ETA; for writing memories, chunks written of the total with rate and ETA (`WriteProgress`); inside a
GRPO step that runs long, a line at least every 30 s (`StepProgress`). The same lines go to the terminal
(`memalpha train|sft`) and to the Prefect flow-run logs (the tasks pass their logger's `info` as `emit`).

    warm start step 4/16 | loss 0.8123 | 41.2 s/step | ETA 8m 14s
    grpo step 3/5: rollouts 40/64 chunks, 30s so far
    grpo step 3/5 | reward 1.412 (coverage 0.30 retention 0.95 gated r2 0.24 gated r4 0.21) | trajectory QA 0.250 | held-out QA 0.125 | 38.0 s/step | ETA 1m 16s
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from memalpha.rewards.rubric import REWARD_COMPONENTS

Emit = Callable[[str], None]


def duration(seconds: float) -> str:
    """`1h 02m`, `8m 14s` or `41s`."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


class StepMeter:
    """Seconds per step and ETA, measured from the first step this process ran (a resumed run's earlier
    steps did not cost this process anything)."""

    def __init__(self, total: int, done: int = 0):
        self.total, self.first = total, done
        self.started = time.perf_counter()

    def seconds_per_step(self, step: int) -> float | None:
        ran = step - self.first
        return (time.perf_counter() - self.started) / ran if ran > 0 else None

    def rate_and_eta(self, step: int, deadline: float | None = None, fit: int | None = None) -> str:
        """`s/step | ETA`; under a time budget (`deadline`, a `time.time()`) the ETA counts only the steps
        that fit before it (`fit`, the trainer's count when given), and says so."""
        ran = step - self.first
        if ran <= 0:
            return "starting"
        per_step = (time.perf_counter() - self.started) / ran
        left = max(self.total - step, 0)
        if deadline is not None:
            fit = max(int((deadline - time.time()) // per_step), 0) if fit is None else fit
            if fit < left:
                return (f"{per_step:.1f} s/step | time budget: {fit} more step{'s' if fit != 1 else ''} of {left} left"
                        + (f", ETA {duration(per_step * fit)}" if fit else ", stopping"))
        return f"{per_step:.1f} s/step | ETA {duration(per_step * left)}"


STEP_TERMS = {"coverage": "coverage", "retention": "retention", "r2_gated": "gated r2", "r4_gated": "gated r4"}
"""What step-level sampling's reward is made of (`rubric.score_step`: r1 and r3 need the final memory, so they
are 0 there), as `rewards/<key>/mean` keys and their labels."""


def grpo_line(step: int, total: int, metrics: dict[str, float], meter: StepMeter, warm_start_qa: float | None = None,
              deadline: float | None = None, sampling: str = "step") -> str:
    """The line of one GRPO step: the reward and the parts it is made of under `sampling` (`grpo.sampling`),
    under step-level sampling the QA of the trajectory the step advanced along (not part of its reward), and
    the held-out QA when it was evaluated (beside the warm start's, when known)."""
    terms = STEP_TERMS if sampling == "step" else {name: name for name in REWARD_COMPONENTS}
    parts = " ".join(f"{label} {metrics[f'rewards/{key}/mean']:.2f}" for key, label in terms.items()
                     if f"rewards/{key}/mean" in metrics)
    line = f"grpo step {step}/{total} | reward {metrics.get('reward', float('nan')):.3f} ({parts})"
    if sampling == "step" and "qa_score" in metrics:
        line += f" | trajectory QA {metrics['qa_score']:.3f}"
    if "eval/qa_score" in metrics:
        line += f" | held-out QA {metrics['eval/qa_score']:.3f}"
        if warm_start_qa is not None:
            line += f" (warm start {warm_start_qa:.3f})"
    fit = metrics.get("time_budget/steps_that_fit")
    return f"{line} | {meter.rate_and_eta(step, deadline, None if fit is None else int(fit))}"


class GRPOProgress:
    """`Trainer.train` callback: one `grpo_line` per step, through `emit`."""

    def __init__(self, total: int, done: int = 0, emit: Emit = print, deadline: float | None = None,
                 sampling: str = "step"):
        self.total, self.emit, self.deadline, self.sampling = total, emit, deadline, sampling
        self.meter = StepMeter(total, done)
        self.warm_start_qa: float | None = None

    def __call__(self, result) -> None:
        self.warm_start_qa = result.metrics.get("warm_start/eval/qa_score", self.warm_start_qa)
        self.emit(grpo_line(result.step, self.total, result.metrics, self.meter, self.warm_start_qa, self.deadline,
                            self.sampling))


class SFTProgress:
    """`run_sft` on_log callback: a line per optimizer step (loss) and per held-out extraction check. When
    the time budget will stop SFT before its last step, the line says when and after which step."""

    def __init__(self, emit: Emit = print):
        self.emit = emit
        self.meter: StepMeter | None = None

    def __call__(self, record: dict) -> None:
        step, total = int(record.get("step", 0)), int(record.get("max_steps", 0))
        if self.meter is None or self.meter.total != total:
            self.meter = StepMeter(total, step)
        if "token_loss" in record:
            line = f"warm start step {step}/{total} | loss {float(record['token_loss']):.4f} | {self.meter.rate_and_eta(step)}"
            self.emit(line + self._budget(step, total, record.get("deadline")))
        if "sft_eval/evidence_recall" in record:
            shown = ", ".join(f"{k.removeprefix('sft_eval/')} {v:.3f}" for k, v in record.items() if k.startswith("sft_eval/"))
            self.emit(f"warm start epoch {record.get('epoch')} held-out extraction: {shown}")

    def _budget(self, step: int, total: int, deadline: float | None) -> str:
        per_step = self.meter.seconds_per_step(step) if self.meter else None
        if deadline is None or not per_step:
            return ""
        left = deadline - time.time()
        last = min(total, step + max(int(left // per_step), 0) + 1)  # a step that starts before the deadline ends
        return "" if last >= total else f" | time budget: stops after step {last} of {total}, in {duration(left)}"


class WriteProgress:
    """Progress of writing: a line at most every `every` seconds as chunks are written (and at the end):
    chunks written of the total, rate, ETA. Used as a context manager it also says, every `heartbeat`
    seconds without a line, that writing goes on: one batched writer call can outlast 30 s on a CPU."""

    def __init__(self, total_chunks: int, emit: Callable[[str], None], every: float = 10.0, label: str = "writing",
                 heartbeat: float = 30.0):
        self.total, self.emit, self.every, self.label, self.heartbeat = total_chunks, emit, every, label, heartbeat
        self.done, self.started, self.last = 0, time.perf_counter(), time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def __call__(self, chunks: int) -> None:
        with self._lock:
            self.done += chunks
            now = time.perf_counter()
            if now - self.last < self.every and self.done < self.total:
                return
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            eta = duration((self.total - self.done) / rate) if rate > 0 else "?"
            self.emit(f"{self.label}: {self.done}/{self.total} chunks | {rate:.2f} chunks/s | ETA {eta}")

    def __enter__(self) -> WriteProgress:
        threading.Thread(target=self._beat, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat / 3):
            with self._lock:
                now = time.perf_counter()
                if now - self.last >= self.heartbeat and (line := self._waiting(now)):
                    self.last = now
                    self.emit(line)

    def _waiting(self, now: float) -> str | None:
        """The heartbeat's line (None: nothing is waited for)."""
        if self.done >= self.total:
            return None
        return f"{self.label}: {self.done}/{self.total} chunks | writing the next ones, {duration(now - self.started)} so far"


class StepProgress(WriteProgress):
    """Inside one GRPO step (a context manager around its rollouts and update): quiet while the step is short,
    then a line every `heartbeat` seconds: rollout chunks written of the step's total, then scoring, then the
    update. Called with the chunks each batched writer call wrote; `updating()` when the update starts."""

    def __init__(self, step: int, total_steps: int, total_chunks: int, emit: Emit, heartbeat: float = 30.0):
        super().__init__(total_chunks, emit, label=f"grpo step {step}/{total_steps}", heartbeat=heartbeat)
        self.updating_since: float | None = None

    def __call__(self, chunks: int) -> None:
        with self._lock:  # counted only: the heartbeat says where the step is
            self.done += chunks

    def updating(self) -> None:
        with self._lock:
            self.updating_since = time.perf_counter()

    def _waiting(self, now: float) -> str:
        so_far = duration(now - self.started)
        if self.updating_since is not None:
            return f"{self.label}: rollouts done in {duration(self.updating_since - self.started)}, updating, {so_far} so far"
        if self.done >= self.total:
            return f"{self.label}: rollouts {self.done}/{self.total} chunks, scoring them, {so_far} so far"
        return f"{self.label}: rollouts {self.done}/{self.total} chunks, {so_far} so far"
