"""The partition methods and schedule memory models, and parsing them from user strings."""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum

from partition.errors import InvalidOptionError, NoMatchingLayerError, UnknownMethodError

__all__ = [
    "Method",
    "ScheduleMemory",
    "match_types",
    "parse_method",
    "parse_schedule_memory",
]


class Method(Enum):
    """How stage boundaries are chosen."""

    UNIFORM = "uniform"
    """Equal layer counts (the first ``n mod p`` stages get one more layer)."""
    PARAMETERS = "parameters"
    """Minimise the largest per-stage parameter total."""
    TYPE = "type"
    """Minimise the largest per-stage count of layers whose class name matches a regex."""
    EXPLICIT = "explicit"
    """Boundaries given by the user."""
    BALANCED = "balanced"
    """Minimise the slowest stage's compute + communication time under a memory cap."""


class ScheduleMemory(Enum):
    """Which schedule's activation lifetime the memory model assumes."""

    ONE_F_ONE_B = "1f1b"
    """1F1B: stage k (0-based) holds min(p - k, m) microbatches of activations."""
    GPIPE = "gpipe"
    """GPipe: every stage holds all m microbatches' activations before the backward."""


_METHOD_SPELLINGS: tuple[str, ...] = (
    "uniform",
    "parameters",
    "type:<regex>",
    "explicit",
    "balanced",
)


def parse_method(text: str) -> tuple[Method, str | None]:
    """Parse ``"uniform"``, ``"parameters"``, ``"type:<regex>"``, ``"explicit"`` or
    ``"balanced"`` (case-insensitive names) into a method and its argument (the regex of
    ``type:``, else None)."""
    stripped = text.strip()
    name, colon, argument = stripped.partition(":")
    lowered = name.strip().lower()
    if lowered == Method.TYPE.value:
        if not colon or not argument:
            raise UnknownMethodError(text, _METHOD_SPELLINGS)
        return Method.TYPE, argument
    if colon:
        raise UnknownMethodError(text, _METHOD_SPELLINGS)
    for method in Method:
        if method is not Method.TYPE and method.value == lowered:
            return method, None
    raise UnknownMethodError(text, _METHOD_SPELLINGS)


def parse_schedule_memory(value: ScheduleMemory | str) -> ScheduleMemory:
    """Accept a `ScheduleMemory` or its text form (``"1f1b"`` or ``"gpipe"``)."""
    if isinstance(value, ScheduleMemory):
        return value
    lowered = value.strip().lower()
    for schedule in ScheduleMemory:
        if schedule.value == lowered:
            return schedule
    raise UnknownMethodError(
        value, tuple(s.value for s in ScheduleMemory), kind="schedule memory model"
    )


def match_types(type_names: Sequence[str], pattern: str) -> list[float]:
    """1.0 for each layer whose type name matches ``pattern`` anywhere, case-insensitively
    (DeepSpeed's ``type:`` rule), else 0.0; raises if nothing matches."""
    try:
        compiled = re.compile(pattern, re.IGNORECASE)
    except re.error as error:
        raise InvalidOptionError(
            f"type pattern {pattern!r} is not a valid regular expression ({error})"
        ) from error
    weights = [1.0 if compiled.search(name) else 0.0 for name in type_names]
    if not any(weights):
        raise NoMatchingLayerError(pattern, tuple(dict.fromkeys(type_names)))
    return weights
