"""QA metrics: the only place answers are scored.

Normalisation follows MemoryAgentBench's reference (SQuAD/DrQA): lowercase, delete punctuation ("A.I."
-> "ai", "don't" -> "dont", "8:30" -> "830"), drop the articles a/an/the, collapse whitespace; exact
match compares the normalised strings, F1 their tokens (a yes/no answer must match exactly). Deliberate
differences, each with a worked example in docs/EVALUATION.md:
- Unicode punctuation (curly quotes, guillemets, the ellipsis, the ideographic full stop) is deleted like
  ASCII punctuation, and the Unicode dashes (en, em, minus) separate words: "Paris—the capital" reads
  "paris capital". The ASCII hyphen is deleted as in the reference ("e-mail" == "email").
- Numbers: a decimal point between digits stays ("3.5" never equals "35"), commas inside numbers go
  ("1,000" -> "1000"), decimals are canonical ("3.50" -> "3.5", "3.0" -> "3"); ints and floats given as
  gold answers go through the same path.
- Substring match is on word boundaries: the gold "3" is not found in "13", nor "art" in "party".
- A gold answer that normalises to nothing ("the") is compared in lowercase with its punctuation and
  articles kept, so an identical prediction scores 1 (the reference scores any prediction 1 on substring).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import Iterable, Protocol, Sequence, Union

from memalpha.rewards.question_types import metric_for_question_type

Answer = Union[str, int, float]

_DASHES = re.compile(r"[\u2010-\u2015\u2212\ufe58\ufe63\uff0d]")  # the ASCII hyphen is deleted, as in the reference
_DECIMAL_POINT = "\x00"  # stands in for a decimal point while punctuation is deleted
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_DECIMAL = re.compile(r"\b\d+\.\d+\b")
_ARTICLES = re.compile(r"\b(a|an|the)\b")

class AnswerJudge(Protocol):
    """An LLM (or other) judge: a score in [0, 1] for a prediction against the gold answers."""

    def __call__(self, question: str, prediction: str, answers: Sequence[str]) -> float: ...


def _canonical_decimal(match: re.Match[str]) -> str:
    text = match.group(0).rstrip("0").rstrip(".")
    return text or "0"


def _is_punctuation(char: str) -> bool:
    return char in string.punctuation or unicodedata.category(char).startswith("P")


def normalize_answer(text: Answer) -> str:
    """Lowercase, canonical numbers, dashes to spaces, other punctuation deleted (decimal points kept),
    no articles, single spaces."""
    if isinstance(text, bool):
        text = str(text)
    elif isinstance(text, float) and text.is_integer():
        text = str(int(text))
    text = str(text).lower()
    text = _THOUSANDS.sub("", text)
    text = _DECIMAL.sub(lambda m: _canonical_decimal(m).replace(".", _DECIMAL_POINT), text)
    text = _DASHES.sub(" ", text)
    text = "".join(ch for ch in text if not _is_punctuation(ch)).replace(_DECIMAL_POINT, ".")
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _literal(text: Answer) -> str:
    """Lowercase with single spaces: the fallback form of a gold answer that normalises to nothing."""
    return " ".join(str(text).lower().split())


def _as_list(answers: Answer | Iterable[Answer]) -> list[Answer]:
    return [answers] if isinstance(answers, (str, int, float)) else list(answers)


def _golds(answers: Answer | Iterable[Answer]) -> list[str]:
    return [g for g in (normalize_answer(a) for a in _as_list(answers)) if g]


def _pairs(prediction: str, answers: Answer | Iterable[Answer]) -> list[tuple[str, str]]:
    """(prediction, gold) in the form they are compared: normalised, or literal for a gold that
    normalises to nothing."""
    pairs = []
    for answer in _as_list(answers):
        gold = normalize_answer(answer)
        if gold:
            pairs.append((normalize_answer(prediction), gold))
        elif _literal(answer):
            pairs.append((_literal(prediction), _literal(answer)))
    return pairs


def _contains(haystack: str, needle: str) -> bool:
    return bool(needle) and f" {needle} " in f" {haystack} "


def substring_em(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    """1.0 when any normalised gold answer occurs (on word boundaries) in the normalised prediction."""
    return float(any(_contains(pred, gold) for pred, gold in _pairs(prediction, answers)))


def exact_match(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    return float(any(pred == gold for pred, gold in _pairs(prediction, answers)))


_YES_NO = frozenset({"yes", "no", "noanswer"})


def token_f1(prediction: str, answers: Answer | Iterable[Answer]) -> float:
    """Best SQuAD token F1 of the prediction over the gold answers; a yes/no/noanswer prediction or gold
    scores only when both are identical (the reference's rule)."""
    best = 0.0
    for pred, gold in _pairs(prediction, answers):
        if (pred in _YES_NO or gold in _YES_NO) and pred != gold:
            continue
        pred_tokens, gold_tokens = pred.split(), gold.split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common:
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
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


CONFLICT_MEMORY_STATES = ("current", "both", "superseded", "neither")
_CONFLICT_STATE_BY_VALUES = {(True, False): "current", (True, True): "both", (False, True): "superseded", (False, False): "neither"}


def conflict_memory_state(asserted: str, answers: Iterable[Answer], superseded: Iterable[Answer]) -> str:
    """What a memory holds for one conflict question, read from `asserted`, the values its lines assert
    (the evidence reader's answer on the whole memory): the current value only, `both` (the stale value
    shadows the new one, so a reader cannot tell which holds), the `superseded` value only (the change was
    not stored), or `neither`. Only `current` answers the question."""
    return _CONFLICT_STATE_BY_VALUES[bool(substring_em(asserted, answers)), states_superseded(asserted, answers, superseded)]


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

    `metric="auto"` picks by question type (memalpha.rewards.question_types); otherwise one of substring_em,
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
