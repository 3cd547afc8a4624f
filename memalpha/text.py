"""Word-level text facts shared by retrieval, rewards and the rule writer."""

from __future__ import annotations

import re

import Stemmer
from bm25s.stopwords import STOPWORDS_EN

MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december")
MONTH_ABBREVIATIONS = ("jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")

_WORD = re.compile(r"\w+")
_STOPWORDS = frozenset(STOPWORDS_EN)
_STEMMER = Stemmer.Stemmer("english")


def encodable(text: str) -> str:
    """`text` with every lone UTF-16 surrogate (a model can emit "\\ud83d" inside JSON) written as its
    escape, so the string can be encoded as UTF-8 wherever it is stored."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def tokenize(text: str) -> list[str]:
    """Lowercased words (numbers and one-letter words kept), English stopwords dropped, Snowball-stemmed:
    the terms BM25 indexes and the words the rule judge compares."""
    words = [w for w in _WORD.findall(text.lower()) if w not in _STOPWORDS]
    return _STEMMER.stemWords(words)
