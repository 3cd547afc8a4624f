"""Length generalisation: the same methods on synthetic instances 1x, 4x, 16x the training length.

A 1x instance has `eval.length_base_chunks` chunks of the training preset's chunk size (the synthetic
`train` preset: 512-token chunks, 4-12 chunks an instance); a kx instance has k times as many chunks
with the same number of facts, so the evidence gets k times sparser. The instances come from the data
module's generator with `LENGTH_SEED`, a seed the training set does not use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import polars as pl

from memalpha.config import RunConfig
from memalpha.data.schema import Instance
from memalpha.data.synth import PRESETS, generate
from memalpha.evaluation.report import markdown_table, plot_score_vs_length
from memalpha.evaluation.results import EvalResult, metric_name
from memalpha.evaluation.answering import policy_tokenizer
from memalpha.evaluation.runner import Progress, evaluate

LENGTH_SEED = 1
"""Generator seed of the length-generalisation instances; the synthetic default (0) trains."""


def length_instances(config: RunConfig, multiplier: int, tokenizer: Any) -> list[Instance]:
    """`eval.length_instances` synthetic instances `multiplier` times the training length."""
    preset = dataclasses.replace(
        PRESETS["train"],
        instances=config.eval.length_instances,
        chunks_per_instance=(config.eval.length_base_chunks * multiplier,),
        seed=LENGTH_SEED,
    )
    instances = generate(preset, tokenizer)
    for inst in instances:
        # one id space per length, so records of several lengths never collide
        inst.instance_id = f"{inst.instance_id}-x{multiplier}"
        inst.metadata["length_multiplier"] = multiplier
    return instances


@dataclass
class LengthResult:
    """One EvalResult per length multiplier, and the table across them."""

    results: dict[int, EvalResult] = field(default_factory=dict)

    def table(self) -> pl.DataFrame:
        """Per (method, multiplier): score (mean/std over seeds), memory, compression, mean input tokens."""
        frames = [
            result.summary().with_columns(pl.lit(k).alias("length_x"))
            for k, result in sorted(self.results.items())
        ]
        table = pl.concat(frames, how="diagonal_relaxed")
        leading = ["method", "length_x"]
        return table.select(leading + [c for c in table.columns if c not in leading])

    def metrics(self) -> dict[str, float]:
        """`<method>/length_<k>x/score` (+ `_std`), `/memory_tokens`, `/input_tokens` for every multiplier."""
        metrics: dict[str, float] = {}
        for row in self.table().iter_rows(named=True):
            prefix = f"{metric_name(row['method'])}/length_{row['length_x']}x"
            for name in ("score", "score_std", "memory_tokens", "input_tokens"):
                if row.get(name) is not None:
                    metrics[f"{prefix}/{name}"] = float(row[name])
        return metrics

    def markdown(self) -> str:
        """The length table as markdown."""
        columns = [("method", "method"), ("length_x", "length (x training)"), ("input_tokens", "input tokens"),
                   ("score", "score"), ("memory_tokens", "memory tokens"), ("compression", "compression"),
                   ("tool_success", "tool-call success"), ("seconds", "time (s)"), ("instances", "instances"),
                   ("seeds", "seeds")]
        return "### Length generalisation\n\n" + markdown_table(self.table(), columns)

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """length.csv, length.md, length_generalisation.png and the raw records of every length."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        table = self.table()
        paths = {"length_csv": out / "length.csv", "length_md": out / "length.md"}
        table.write_csv(paths["length_csv"])
        paths["length_md"].write_text(self.markdown() + "\n\n![length generalisation](length_generalisation.png)\n")
        paths["length_plot"] = plot_score_vs_length(
            table.select("method", "input_tokens", "score", "score_std"), out / "length_generalisation.png",
            title="Length generalisation: score vs input length",
        )
        merged = EvalResult()
        for result in self.results.values():
            merged = merged.merge(result)
        paths["length_questions"] = out / "length_questions.csv"
        merged.questions.write_csv(paths["length_questions"])
        paths["length_instances"] = out / "length_instances.csv"
        merged.instances.write_csv(paths["length_instances"])
        return paths


def evaluate_length(
    config: RunConfig,
    methods: Sequence[str] | None = None,
    model_uri: str | Path | None = None,
    seeds: Sequence[int] | None = None,
    *,
    multipliers: Sequence[int] | None = None,
    progress: Progress | None = print,
) -> LengthResult:
    """Run `evaluate` on generated instances of each length multiplier (default `eval.length_multipliers`)."""
    say = progress or (lambda _message: None)
    tokenizer, _ = policy_tokenizer(config)
    result = LengthResult()
    for k in multipliers or config.eval.length_multipliers:
        instances = length_instances(config, k, tokenizer)
        say(f"length {k}x: {len(instances)} instances of {len(instances[0].chunks)} chunks")
        result.results[k] = evaluate(config, methods=methods, model_uri=model_uri, seeds=seeds, instances=instances, progress=progress)
    return result
