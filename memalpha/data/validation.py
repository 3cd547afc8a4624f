"""Question and chunk validation: a great-expectations suite over three tables (instances, chunks,
questions; one validation pass each), semantic checks (gold answers occur in the context, duplicate
questions), an optional closed-book filter, and a readable report.

Rejection granularity: a bad question drops that question; a bad chunk or instance-level problem drops
the whole instance (dropping one chunk would shift every evidence index); an instance left without
questions is dropped. Duplicate questions are removed (not an error); closed-book answerable questions
are removed when a reader is configured."""

from __future__ import annotations

import html
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from memalpha.config import DataConfig
from memalpha.data.chunking import TokenCounts
from memalpha.data.schema import SPLITS, Instance
from memalpha.rewards.qa import normalize_answer
from memalpha.rewards.question_types import COMPETENCIES, QUESTION_TYPES
from memalpha.text import MONTHS

Reader = Callable[[str], str]
"""Closed-book reader: question -> answer text, with no memory or context."""

_CONTENT_WORD = re.compile(r"[a-z0-9]{4,}")
_YEAR = re.compile(r"\b(?:1[5-9]|20)\d\d\b")
_NUMBER_ANSWER = re.compile(r"\d+(?:\.\d+)?(?: \w+){0,2}")
_LIST_SEPARATORS = re.compile(r",|;|\band\b|\bor\b")
_LONG_ANSWER_WORDS = 6
_STOPWORDS = frozenset("that this with from have were they their there which about would into been when what".split())
ERRORS_SHOWN = 20


@dataclass(frozen=True)
class Limits:
    """Bounds checked by the expectation suite (see DataConfig for the meaning of each)."""

    max_answer_tokens: int
    max_chunk_tokens: int
    max_chunks: int
    max_questions: int
    min_keyword_share: float

    @classmethod
    def from_config(cls, data_cfg: DataConfig | None = None) -> Limits:
        """The limits of a DataConfig (the defaults when None)."""
        data_cfg = data_cfg or DataConfig()
        return cls(data_cfg.max_answer_tokens, data_cfg.max_chunk_tokens, data_cfg.max_chunks,
                   data_cfg.max_questions, data_cfg.min_keyword_share)


@dataclass
class ValidationResult:
    """Valid instances, rejected rows (one dict per problem, see io.REJECTED_COLUMNS) and run notes."""

    valid: list[Instance]
    rejected: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    check_counts: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> list[dict[str, Any]]:
        """Problems that make the input invalid (removals such as duplicates are not errors)."""
        return [r for r in self.rejected if r["check"] not in REMOVALS]

    def describe_errors(self, origins: dict[str, str] | None = None, limit: int = ERRORS_SHOWN) -> str:
        """The problems, one a line, each naming instance (and its file row), chunk or question and field."""
        lines = [_describe(r, origins or {}) for r in self.errors[:limit]]
        if len(self.errors) > limit:
            lines.append(f"... and {len(self.errors) - limit} more (see the rejected table)")
        return "\n".join(lines)

    def report_markdown(self, title: str = "Validation report") -> str:
        """A human-readable markdown report."""
        out = [f"# {title}", "", "| | count |", "|---|---|"]
        out += [f"| {k.replace('_', ' ')} | {v} |" for k, v in self.counts.items()]
        if self.check_counts:
            out += ["", "## Rejections by check", "", "| check | rows |", "|---|---|"]
            out += [f"| {k} | {v} |" for k, v in sorted(self.check_counts.items())]
        if self.notes:
            out += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if self.rejected:
            out += ["", "## Rejected rows", "", "| table | instance | question | chunk | field | check | reason |",
                    "|---|---|---|---|---|---|---|"]
            for r in self.rejected[:500]:
                cells = [r.get(k) for k in ("table", "instance_id", "question_id", "chunk_index", "field", "check", "reason")]
                out.append("| " + " | ".join("" if c is None else str(c).replace("|", "\\|") for c in cells) + " |")
            if len(self.rejected) > 500:
                out.append(f"\n{len(self.rejected) - 500} more rows in rejected.parquet")
        return "\n".join(out) + "\n"

    def report_html(self, title: str = "Validation report") -> str:
        """The same report as a standalone HTML page."""
        def table(header: list[str], rows: list[list[Any]]) -> str:
            head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
            body = "".join("<tr>" + "".join(f"<td>{html.escape('' if c is None else str(c))}</td>" for c in row) + "</tr>"
                           for row in rows)
            return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        keys = ["table", "instance_id", "question_id", "chunk_index", "field", "check", "reason"]
        parts = [f"<h1>{html.escape(title)}</h1>", table(["", "count"], [[k.replace("_", " "), v] for k, v in self.counts.items()])]
        if self.check_counts:
            parts += ["<h2>Rejections by check</h2>", table(["check", "rows"], sorted(self.check_counts.items()))]
        if self.notes:
            parts += ["<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>"]
        if self.rejected:
            parts += ["<h2>Rejected rows</h2>", table(keys, [[r.get(k) for k in keys] for r in self.rejected[:2000]])]
        style = "body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
        return f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>{''.join(parts)}</body></html>\n"


REMOVALS = ("duplicate_question", "closed_book", "memory_not_in_conversation")


def _describe(r: dict[str, Any], origins: dict[str, str]) -> str:
    where = f"instance {r['instance_id']!r}"
    if r["instance_id"] in origins:
        where += f" ({origins[r['instance_id']]})"
    if r.get("chunk_index") is not None:
        where += f": chunk {r['chunk_index']}"
    if r.get("question_id") is not None:
        where += f": question {r['question_id']!r}"
    return f"{where}: field {r['field']!r}: {r['reason']} [{r['check']}]"


def _tables(instances: list[Instance], counter: TokenCounts) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    inst_rows, chunk_rows, q_rows = [], [], []
    chunk_texts, answer_texts = [], []
    for row, inst in enumerate(instances):
        inst_rows.append({"row": row, "instance_id": inst.instance_id, "competency": inst.competency, "split": inst.split,
                          "num_chunks": len(inst.chunks), "num_questions": len(inst.questions)})
        for c, text in enumerate(inst.chunks):
            chunk_rows.append({"row": row, "chunk_index": c, "chunk_key": f"{row}/{c}", "text": text})
            chunk_texts.append(text)
        for qpos, q in enumerate(inst.questions):
            evidence_ok = q.evidence_chunks is None or all(0 <= e < len(inst.chunks) for e in q.evidence_chunks)
            q_rows.append({"row": row, "qpos": qpos, "question_id": q.question_id, "question_key": f"{row}/{q.question_id}",
                           "question": q.question.strip() or None, "answer": q.answer.strip() or None,
                           "num_answers": len(q.answers), "question_type": q.question_type,
                           "evidence_in_range": evidence_ok, "long_form": _is_long_form(q.question_type, q.answers)})
            answer_texts.extend(q.answers)
    chunk_counts = counter.counts(chunk_texts)
    answer_counts = iter(counter.counts(answer_texts))
    for r, n in zip(chunk_rows, chunk_counts):
        r["tokens"] = n if r["text"].strip() else 0  # whitespace-only counts as empty
    for r, inst_q in zip(q_rows, (q for inst in instances for q in inst.questions)):
        r["answer_tokens"] = max((next(answer_counts) for _ in inst_q.answers), default=0)
        if r["long_form"]:
            r["answer_tokens"] = min(r["answer_tokens"], 1)  # whole-summary answers are exempt from the cap
    columns = {
        "instances": ["row", "instance_id", "competency", "split", "num_chunks", "num_questions"],
        "chunks": ["row", "chunk_index", "chunk_key", "text", "tokens"],
        "questions": ["row", "qpos", "question_id", "question_key", "question", "answer", "num_answers", "question_type",
                      "evidence_in_range", "long_form", "answer_tokens"],
    }
    return (pd.DataFrame(inst_rows, columns=columns["instances"]), pd.DataFrame(chunk_rows, columns=columns["chunks"]),
            pd.DataFrame(q_rows, columns=columns["questions"]))


def _is_long_form(question_type: str, answers: list[str]) -> bool:
    return QUESTION_TYPES.get(question_type) == "long_range_understanding" and any(
        len(a.split()) >= _LONG_ANSWER_WORDS for a in answers)


def _suites(gx, limits: Limits) -> dict[str, list[tuple[Any, str, str]]]:
    """(expectation, field, reason) per table."""
    E = gx.expectations
    return {
        "instances": [
            (E.ExpectColumnValuesToBeUnique(column="instance_id"), "instance_id", "duplicate instance_id"),
            (E.ExpectColumnValuesToBeInSet(column="competency", value_set=list(COMPETENCIES)), "competency", "unknown competency"),
            (E.ExpectColumnValuesToBeInSet(column="split", value_set=[*SPLITS, ""]), "split", "unknown split"),
            (E.ExpectColumnValuesToBeBetween(column="num_chunks", min_value=1, max_value=limits.max_chunks),
             "chunks", f"number of chunks not in 1..{limits.max_chunks}"),
            (E.ExpectColumnValuesToBeBetween(column="num_questions", min_value=1, max_value=limits.max_questions),
             "questions_and_answers", f"number of questions not in 1..{limits.max_questions}"),
        ],
        "chunks": [
            (E.ExpectColumnValuesToNotBeNull(column="text"), "chunks", "missing chunk"),
            (E.ExpectColumnValuesToBeUnique(column="chunk_key"), "chunks", "duplicate chunk key"),
            (E.ExpectColumnValuesToBeBetween(column="tokens", min_value=1, max_value=limits.max_chunk_tokens),
             "chunks", "chunk token count out of bounds"),
        ],
        "questions": [
            (E.ExpectColumnValuesToNotBeNull(column="question"), "question", "empty question"),
            (E.ExpectColumnValuesToNotBeNull(column="answer"), "answer", "empty answer"),
            (E.ExpectColumnValuesToBeUnique(column="question_key"), "question_id", "duplicate question_id"),
            (E.ExpectColumnValuesToBeBetween(column="num_answers", min_value=1), "answers", "no gold answer"),
            (E.ExpectColumnValuesToBeInSet(column="question_type", value_set=list(QUESTION_TYPES)),
             "question_type", "unknown question type"),
            (E.ExpectColumnValuesToBeInSet(column="evidence_in_range", value_set=[True]), "evidence_chunks",
             "evidence chunk index out of range"),
            (E.ExpectColumnValuesToBeBetween(column="answer_tokens", min_value=0, max_value=limits.max_answer_tokens),
             "answers", f"answer longer than {limits.max_answer_tokens} tokens"),
        ],
    }


def run_expectations(tables: dict[str, pd.DataFrame], limits: Limits) -> dict[str, list[tuple[int, str, str, str]]]:
    """One great-expectations validation per table; returns failing (row position, check, field, reason)."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    for name in ("great_expectations", "great_expectations.core", "great_expectations.data_context"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("memalpha")
    failures: dict[str, list[tuple[int, str, str, str]]] = {}
    for table, expectations in _suites(gx, limits).items():
        frame = tables[table]
        failures[table] = []
        if frame.empty:
            continue
        suite = context.suites.add(gx.ExpectationSuite(name=f"memalpha_{table}"))
        meta = {}
        for expectation, field_name, reason in expectations:
            suite.add_expectation(expectation)
            meta[(expectation.expectation_type, expectation.column)] = (field_name, reason)
        batch = source.add_dataframe_asset(table).add_batch_definition_whole_dataframe("all").get_batch(
            batch_parameters={"dataframe": frame})
        result = batch.validate(suite, result_format={"result_format": "COMPLETE"})
        for item in result.results:
            if item.success:
                continue
            config = item.expectation_config
            field_name, reason = meta[(config.type, config.kwargs.get("column"))]
            check = f"{config.type}({config.kwargs.get('column')})"
            for index in item.result.get("unexpected_index_list") or []:
                failures[table].append((int(index), check, field_name, reason))
    return failures


def _keywords(answers: list[str], long_form: bool) -> list[str]:
    if not long_form:
        return [normalize_answer(a) for a in answers]
    words = dict.fromkeys(w for a in answers for w in _CONTENT_WORD.findall(normalize_answer(a)) if w not in _STOPWORDS)
    return list(words)


def worked_out_check(answers: list[str], context: str, min_share: float) -> str | None:
    """The check that supports a gold answer the context does not quote (LoCoMo's answers are often
    worked out: dates from "yesterday", lists gathered across turns, "Likely no"), or None.

    `context` is the normalised conversation with a space at each end. In order: `yes_no` (a yes/no
    answer, kept unverified), `date_parts` (every year, within one of a year in the context since "last
    year" is worked out from a session date, and every month the answer names occur), `list_items` (at
    least min_share of the items occur), `keywords` (at least min_share of its content words occur),
    `number` (a short numeric answer such as a count, kept unverified).
    """
    for answer in answers:
        norm = normalize_answer(answer)
        words = norm.split()
        if not words:
            continue
        if words[0] in ("yes", "no") or (len(words) <= 3 and {"yes", "no"} & set(words)):
            return "yes_no"
        years, months = _YEAR.findall(norm), [w for w in words if w in MONTHS]
        if years or months:
            near = lambda y: any(f" {int(y) + d} " in context for d in (-1, 0, 1))  # noqa: E731
            if all(near(y) for y in years) and all(f" {m} " in context for m in months):
                return "date_parts"
        items = [i for i in (normalize_answer(x) for x in _LIST_SEPARATORS.split(str(answer))) if i]
        if len(items) >= 2 and sum(f" {i} " in context for i in items) / len(items) >= min_share:
            return "list_items"
        content = list(dict.fromkeys(w for w in _CONTENT_WORD.findall(norm) if w not in _STOPWORDS))
        if content and sum(f" {w} " in context for w in content) / len(content) >= min_share:
            return "keywords"
        if _NUMBER_ANSWER.fullmatch(norm):
            return "number"
    return None


def validate(
    instances: list[Instance],
    tokenizer: Any,
    limits: Limits | None = None,
    reader: Reader | None = None,
    progress: bool = False,
) -> ValidationResult:
    """Validate instances; returns the valid ones (bad rows removed) and every rejected row with its reason."""
    from tqdm.auto import tqdm

    counter = tokenizer if isinstance(tokenizer, TokenCounts) else TokenCounts(tokenizer)
    limits = limits or Limits.from_config()
    inst_df, chunk_df, q_df = _tables(instances, counter)
    failures = run_expectations({"instances": inst_df, "chunks": chunk_df, "questions": q_df}, limits)

    rejected: list[dict[str, Any]] = []
    dead_instances: set[int] = set()
    dead_questions: set[tuple[int, int]] = set()
    first_row: dict[str, int] = {}
    for row, inst in enumerate(instances):
        first_row.setdefault(inst.instance_id, row)

    def reject(table, row, check, field_name, reason, question_id=None, chunk_index=None):
        rejected.append({"table": table, "instance_id": instances[row].instance_id, "question_id": question_id,
                         "chunk_index": chunk_index, "field": field_name, "check": check, "reason": reason})

    for pos, check, field_name, reason in failures["instances"]:
        row = int(inst_df.at[pos, "row"])
        if reason == "duplicate instance_id":
            if first_row[instances[row].instance_id] == row:
                continue  # the first occurrence is kept
            reason = f"duplicate instance_id (first at row {first_row[instances[row].instance_id]})"
        dead_instances.add(row)
        reject("instances", row, check, field_name, reason)
    for pos, check, field_name, reason in failures["chunks"]:
        row, c = int(chunk_df.at[pos, "row"]), int(chunk_df.at[pos, "chunk_index"])
        tokens = int(chunk_df.at[pos, "tokens"])
        if check.startswith("expect_column_values_to_be_between"):
            reason = "empty or whitespace-only chunk" if tokens == 0 else f"chunk has {tokens} tokens, more than {limits.max_chunk_tokens}"
        dead_instances.add(row)
        reject("chunks", row, check, field_name, reason, chunk_index=c)
    seen_keys: set[str] = set()
    for pos, check, field_name, reason in failures["questions"]:
        row, qid = int(q_df.at[pos, "row"]), str(q_df.at[pos, "question_id"])
        if reason == "duplicate question_id" and q_df.at[pos, "question_key"] not in seen_keys:
            seen_keys.add(q_df.at[pos, "question_key"])  # the first occurrence is kept
            continue
        dead_questions.add((row, int(q_df.at[pos, "qpos"])))
        reject("questions", row, check, field_name, reason, question_id=qid)

    notes = []
    if reader is None:
        notes.append("closed-book filter skipped: no reader configured")
    valid: list[Instance] = []
    valid_rows: list[int] = []
    removed, worked_out = Counter(), Counter()
    for row, inst in enumerate(tqdm(instances, desc="semantic checks", disable=not progress, unit="inst")):
        if row in dead_instances:
            continue
        context = f" {normalize_answer(' '.join(inst.chunks))} "
        kept, seen, answer_checks = [], set(), {}
        for qpos, q in enumerate(inst.questions):
            if (row, qpos) in dead_questions:
                continue
            key = normalize_answer(q.question)
            if key in seen:
                removed["duplicate_question"] += 1
                reject("questions", row, "duplicate_question", "question", "duplicate of an earlier question", q.question_id)
                continue
            seen.add(key)
            if q.question_type != "adversarial":
                keywords = [k for k in _keywords(q.answers, _is_long_form(q.question_type, q.answers)) if k]
                found = sum(f" {k} " in context for k in keywords)
                if QUESTION_TYPES.get(q.question_type) == "long_range_understanding":
                    share = found / len(keywords) if keywords else 0.0
                    if share < limits.min_keyword_share:
                        reject("questions", row, "keywords_in_context", "answers",
                               f"only {found}/{len(keywords)} keywords occur in the context", q.question_id)
                        continue
                elif not found:
                    check = worked_out_check(q.answers, context, limits.min_keyword_share)
                    if check is None:
                        reject("questions", row, "answer_in_context", "answers",
                               f"no gold answer occurs in the context, nor fits a worked-out check "
                               f"(answers: {q.answers[:3]})", q.question_id)
                        continue
                    worked_out[check] += 1
                    answer_checks[q.question_id] = check
            if reader is not None and QUESTION_TYPES.get(q.question_type) != "long_range_understanding":
                guess = f" {normalize_answer(reader(q.question))} "
                if any(f" {normalize_answer(a)} " in guess for a in q.answers if normalize_answer(a)):
                    removed["closed_book"] += 1
                    reject("questions", row, "closed_book", "question", "answered correctly without memory", q.question_id)
                    continue
            kept.append(q)
        if not kept:
            reject("instances", row, "has_questions", "questions_and_answers", "no valid questions left")
            continue
        valid_rows.append(row)
        metadata = {**inst.metadata, "answer_checks": answer_checks} if answer_checks else inst.metadata
        valid.append(Instance(inst.instance_id, inst.data_source, inst.competency, inst.chunks, kept, metadata, inst.split))

    check_counts = Counter(r["check"] for r in rejected)
    counts = {
        "instances_in": len(instances),
        "instances_valid": len(valid),
        "instances_rejected": len(instances) - len(valid),
        "questions_in": int(len(q_df)),
        "questions_valid": sum(len(i.questions) for i in valid),
        "duplicate_questions_removed": removed["duplicate_question"],
        "closed_book_removed": removed["closed_book"],
        **{f"worked_out_answers_{check}": n for check, n in sorted(worked_out.items())},
        "chunks_valid": sum(len(i.chunks) for i in valid),
        "tokens_valid": int(chunk_df.loc[chunk_df["row"].isin(valid_rows), "tokens"].sum()) if len(chunk_df) else 0,
    }
    return ValidationResult(valid, rejected, notes, counts, dict(check_counts))
