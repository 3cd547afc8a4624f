"""Memory layout as data: which sections exist, paragraph or list, token caps and descriptions.

The Mem-alpha layout (core paragraph + semantic and episodic lists) and the persona layout (core + nine
persona categories) are two configurations of the same `MemoryStore`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

SectionKind = Literal["paragraph", "list"]
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class SectionSpec:
    """One memory section.

    `max_tokens` caps the paragraph (or, for a list, each entry's content); longer content is cut at a
    word boundary. `id_prefix` starts the ids of a list's entries (`sem-3`); it defaults to the name.
    """

    name: str
    kind: SectionKind
    description: str
    max_tokens: int | None = None
    id_prefix: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"section name {self.name!r} must be lower-case letters, digits and underscores")
        if self.kind not in ("paragraph", "list"):
            raise ValueError(f"section {self.name!r}: kind must be 'paragraph' or 'list', not {self.kind!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"section {self.name!r}: max_tokens must be positive, not {self.max_tokens}")
        if self.id_prefix and not _NAME.match(self.id_prefix):
            raise ValueError(f"section {self.name!r}: id_prefix {self.id_prefix!r} must be lower-case letters/digits")

    @property
    def prefix(self) -> str:
        """Prefix of entry ids in this section."""
        return self.id_prefix or self.name

    @property
    def is_list(self) -> bool:
        return self.kind == "list"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "max_tokens": self.max_tokens,
            "id_prefix": self.id_prefix,
        }


@dataclass(frozen=True)
class MemorySchema:
    """An ordered set of sections with unique names and unique id prefixes. A writer names the list
    entry it updates or deletes by its id (`sem-3`), as the paper's tools do."""

    name: str
    sections: tuple[SectionSpec, ...]

    def __post_init__(self) -> None:
        if not self.sections:
            raise ValueError(f"memory schema {self.name!r} has no sections")
        names = [s.name for s in self.sections]
        if len(set(names)) != len(names):
            raise ValueError(f"memory schema {self.name!r}: section names repeat: {names}")
        prefixes = [s.prefix for s in self.sections if s.is_list]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError(f"memory schema {self.name!r}: list id prefixes repeat: {prefixes}")

    def section(self, name: str) -> SectionSpec:
        """The section called `name`; KeyError naming the known sections otherwise."""
        for spec in self.sections:
            if spec.name == name:
                return spec
        raise KeyError(f"memory schema {self.name!r} has no section {name!r} (known: {', '.join(self.names)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sections)

    @property
    def list_sections(self) -> tuple[SectionSpec, ...]:
        return tuple(s for s in self.sections if s.is_list)

    @property
    def paragraph_sections(self) -> tuple[SectionSpec, ...]:
        return tuple(s for s in self.sections if not s.is_list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sections": [s.to_dict() for s in self.sections]}

    @classmethod
    def from_dict(cls, data: Any) -> MemorySchema:
        """Inverse of `to_dict`; ValueError naming the bad field."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ValueError("schema: expected an object with a string 'name'")
        raw_sections = data.get("sections")
        if not isinstance(raw_sections, list):
            raise ValueError("schema.sections: expected a list")
        sections = []
        for i, raw in enumerate(raw_sections):
            if not isinstance(raw, dict):
                raise ValueError(f"schema.sections[{i}]: expected an object")
            try:
                sections.append(
                    SectionSpec(
                        name=raw["name"],
                        kind=raw["kind"],
                        description=raw.get("description", ""),
                        max_tokens=raw.get("max_tokens"),
                        id_prefix=raw.get("id_prefix", ""),
                    )
                )
            except (KeyError, TypeError) as exc:
                raise ValueError(f"schema.sections[{i}]: missing or invalid field {exc}") from None
        return cls(name=data["name"], sections=tuple(sections))


_CORE = SectionSpec(
    "core",
    "paragraph",
    "One short paragraph with the most important persistent facts (who the user is, goals, key "
    "preferences, the main topic). Rewritten as a whole with memory_update.",
    max_tokens=512,
)

MEMALPHA_SCHEMA = MemorySchema(
    "memalpha",
    (
        _CORE,
        SectionSpec(
            "semantic",
            "list",
            "General facts and knowledge: about the user, people, entities and the world, true "
            "independent of when they were said.",
            id_prefix="sem",
        ),
        SectionSpec(
            "episodic",
            "list",
            "Events with their time: what happened, when, with whom, in order.",
            id_prefix="epi",
        ),
    ),
)

PERSONA_SCHEMA = MemorySchema(
    "persona",
    (
        _CORE,
        SectionSpec("sensory_lifestyle", "list", "Daily habits, routines, food, clothing and sensory tastes.", id_prefix="sen"),
        SectionSpec("culture_entertainment", "list", "Hobbies, media, music, books, games, travel and cultural interests.", id_prefix="cul"),
        SectionSpec("cognition_work", "list", "Education, job, skills, projects and ways of thinking and learning.", id_prefix="cog"),
        SectionSpec("values", "list", "Beliefs, principles, priorities, moral and political views.", id_prefix="val"),
        SectionSpec("physiology_health", "list", "Health, body, sleep, exercise, diet and medical conditions.", id_prefix="phy"),
        SectionSpec("resource_economic", "list", "Money, income, spending, possessions and housing.", id_prefix="res"),
        SectionSpec("social_interpersonal", "list", "Family, friends, colleagues and how the user relates to them.", id_prefix="soc"),
        SectionSpec("spatiotemporal_context", "list", "Places lived or visited, schedules, dates and time zones.", id_prefix="spa"),
        SectionSpec("psychological_defense", "list", "Emotions, fears, stressors and ways of coping.", id_prefix="psy"),
    ),
)

_SCHEMAS = {s.name: s for s in (MEMALPHA_SCHEMA, PERSONA_SCHEMA)}


def get_schema(name: str, core_max_tokens: int = 512) -> MemorySchema:
    """The named layout (`memalpha` or `persona`) with the core paragraph capped at `core_max_tokens`."""
    if name not in _SCHEMAS:
        raise ValueError(f"unknown memory schema {name!r} (known: {', '.join(_SCHEMAS)})")
    if core_max_tokens < 1:
        raise ValueError(f"core_max_tokens must be positive, not {core_max_tokens}")
    base = _SCHEMAS[name]
    sections = tuple(replace(s, max_tokens=core_max_tokens) if s.name == "core" else s for s in base.sections)
    return MemorySchema(base.name, sections)
