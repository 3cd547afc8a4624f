"""Evaluation: the trained policy against its base, the SFT warm start and the baselines (rule writer,
long context, RAG over raw chunks, closed book) under one reader and one context budget; per-source and
per-competency tables, length generalisation and the nightly regression check."""

from memalpha.evaluation.length import LengthResult, evaluate_length
from memalpha.evaluation.methods import model_artifacts, resolve_adapter
from memalpha.evaluation.regression import RegressionCheck, check_regression
from memalpha.evaluation.report import write_report
from memalpha.evaluation.results import EvalResult
from memalpha.evaluation.runner import evaluate

__all__ = [
    "EvalResult",
    "LengthResult",
    "RegressionCheck",
    "check_regression",
    "evaluate",
    "evaluate_length",
    "resolve_adapter",
    "model_artifacts",
    "write_report",
]
