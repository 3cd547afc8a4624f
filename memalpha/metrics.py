"""QA metrics: the only place answers are scored.

Normalisation (SQuAD-style, plus numbers): lowercase; punctuation becomes a space ("New-York" ==
"New York"), except a decimal point between digits; drop commas inside numbers ("1,000" -> "1000"); write decimals canonically ("3.50" -> "3.5",
"3.0" -> "3"); drop the articles a/an/the; collapse whitespace. Gold answers may be ints or floats;
they go through the same path, so "3", 3 and 3.0 are all the answer "3" (and "3.5" never equals "35").

Matches are on word boundaries: the gold "3" is not found in "13", nor "art" in "party".
A gold answer that normalises to nothing (e.g. "the") can never be matched and scores 0.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, Protocol, Sequence, Union

from memalpha.question_types import metric_for_question_type

Answer = Union[str, int, float]

# Any punctuation mark except a decimal point between two digits.
_PUNCT_RE = re.compile(r"(?!(?<=\d)\.(?=\d))[" + re.escape(string.punctuation) + "]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_DECIMAL = re.compile(r"\b\d+\.\d+\b")
_ARTICLES = re.compile(r"\b(a|an|the)\b")

class AnswerJudge(Protocol):
    """An LLM (or other) judge: a score in [0, 1] for a prediction against the gold answers."""

    def __call__(self, question: str, prediction: str, answers: Sequence[str]) -> float: ...


def _canonical_decimal(match: re.Match[str]) -> str:
    text = match.group(0).rstrip("0").rstrip(".")
    return text or "0"


def normalize_answer(text: Answer) -> str:
    """Lowercase, punctuation to spaces (keeping decimal points), canonical numbers, no articles, single spaces."""
    if isinstance(text, bool):
        text = str(text)
    elif isinstance(text, float) and text.is_integer():
        text = str(int(text))
    text = str(text).lower()
    text = _THOUSANDS.sub("", text)
    text = _DECIMAL.sub(_canonical_decimal, text)
    text = _PUNCT_RE.sub(" ", text)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(answers: Answer | Iterable[Answer]) -> list[str]:
    if isinstance(answers, (str, int, float)):
        answers = [answers]
    return [g for g in (normalize_answer(a) for a in answers) if g]


def _contains(haystack: str, needle: str) -> bool:
    return bool(needle) and f" {needle} " in f" {haystack} "


def substring_em(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    """1.0 when any normalised gold answer occurs (on word boundaries) in the normalised prediction."""
    pred = normalize_answer(prediction)
    return float(any(_contains(pred, g) for g in _golds(answers)))


def exact_match(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return float(any(pred == g for g in _golds(answers)))


def token_f1(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    """Best SQuAD token F1 of the prediction over the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in _golds(answers):
        gold_tokens = gold.split()
        common = sum((Counter(pred) & Counter(gold_tokens)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` (nested braces allowed), or None when there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, pos = 0, start + len("\\boxed")
        for pos in range(start + len("\\boxed"), len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{") : pos]
        start = text.rfind("\\boxed{", 0, start)
    return None


def boxed_em(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    r"""Exact match of the last `\boxed{...}` content against the gold label(s); no box scores 0."""
    boxed = last_boxed(prediction)
    return 0.0 if boxed is None else exact_match(boxed, answers)


def keyword_hit_rate(prediction: str, keywords: Answer | Iterable[Answer]) -> float:
    """Share of the gold keywords that occur (normalised, on word boundaries) in the prediction."""
    golds = _golds(keywords)
    if not golds:
        return 0.0
    pred = normalize_answer(prediction)
    return sum(_contains(pred, g) for g in golds) / len(golds)


_METRICS = {
    "substring_em": substring_em,
    "exact_match": exact_match,
    "f1": token_f1,
    "boxed_em": boxed_em,
    "keyword_hit": keyword_hit_rate,
}


def states_superseded(prediction: str, answers: Iterable[Answer], superseded: Iterable[Answer]) -> bool:
    # Blank out the current answers first, so an old value that is part of the new one
    # ("New York" inside "New York City") is not mistaken for stating the old value.
    pred = f" {normalize_answer(prediction)} "
    for gold in sorted(_golds(answers), key=len, reverse=True):
        pred = pred.replace(f" {gold} ", " | ")
    return any(_contains(pred.strip(), old) for old in _golds(superseded))


def score_answer(
    prediction: str,
    answers: Answer | Sequence[Answer],
    question_type: str,
    superseded: Sequence[Answer] = (),
    metric: str = "auto",
    judge: AnswerJudge | None = None,
    question: str = "",
) -> float:
    """Score one prediction in [0, 1].

    `metric="auto"` picks by question type (memalpha.question_types); otherwise one of substring_em,
    exact_match, f1, boxed_em, keyword_hit, llm_judge (needs `judge`). When the question's fact was
    superseded, a prediction that states any superseded value scores 0, even if it also states the new one.
    """
    if metric == "auto":
        metric = metric_for_question_type(question_type)
    answer_list = [answers] if isinstance(answers, (str, int, float)) else list(answers)
    if superseded and states_superseded(prediction, answer_list, superseded):
        return 0.0
    if metric == "llm_judge":
        if judge is None:
            raise ValueError("metric 'llm_judge' needs a judge callable")
        return min(1.0, max(0.0, float(judge(question, prediction, [str(a) for a in answer_list]))))
    if metric not in _METRICS:
        raise ValueError(f"unknown QA metric {metric!r} (known: auto, llm_judge, {', '.join(_METRICS)})")
    return _METRICS[metric](prediction, answer_list)
