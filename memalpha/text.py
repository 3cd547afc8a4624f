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


_NOT_A_SUBJECT = frozenset(tokenize(" ".join(("said", *MONTHS))))


def subject_words(text: str) -> set[str]:
    """The words that say what a statement is about: `tokenize`'s, without reported speech, months and numbers."""
    return {w for w in tokenize(text) if w not in _NOT_A_SUBJECT and not w.isdigit()}


UPDATE_SHARED_WORDS = 2
"""Subject words an update must share with the entry it replaces: the rule writer's updates do in 95% of
cases (its change announcements name the person and the attribute), 88% of its warm start's updates (most
overwrite an unrelated fact) do not (docs/REWARDS.md)."""


def keeps_subject(previous: str, new: str) -> bool:
    """An update of a list entry is about what it replaces: the two share `UPDATE_SHARED_WORDS` subject
    words. Otherwise it overwrites one fact with an unrelated one, an insert that destroys a fact."""
    return len(subject_words(previous) & subject_words(new)) >= UPDATE_SHARED_WORDS
