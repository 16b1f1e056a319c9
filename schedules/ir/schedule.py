"""The `Schedule` value: per-rank instruction streams plus the stage placement they assume."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import wraps
from operator import itemgetter
from typing import ParamSpec, TypeVar, cast

from schedules.ir.errors import ScheduleConfigError, ScheduleParseError
from schedules.ir.instructions import COMPUTE_KINDS, Instruction, Kind, format_stream, parse_stream

__all__ = ["Schedule", "check_count", "count_problem", "gc_paused", "loop_placement",
           "v_placement"]

_kind_of = itemgetter(0)  # an Instruction's kind

_LABEL = re.compile(r"\s*rank\s+0*(\d+)\s*", re.IGNORECASE)
_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextmanager
def _paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def gc_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run `fn` with the cyclic garbage collector off.

    Building ~1M instruction tuples triggers hundreds of collections that find nothing
    (tuples of ints and enums hold no cycles) and cost more than the work itself.
    """

    @wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with _paused():
            return fn(*args, **kwargs)

    return wrapper


def count_problem(name: str, value: object, *, minimum: int = 1, hint: str = "") -> str | None:
    """What is wrong with `value` as a count (an int >= `minimum`, not a bool), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an int >= {minimum}, got {value!r}{hint}"
    if value < minimum:
        return f"{name} must be >= {minimum}, got {value}{hint}"
    return None


def check_count(name: str, value: object, *, minimum: int = 1, hint: str = "") -> int:
    """Return `value` if it is an int >= `minimum`, else raise a `ScheduleConfigError`."""
    problem = count_problem(name, value, minimum=minimum, hint=hint)
    if problem is not None:
        raise ScheduleConfigError(problem)
    return cast(int, value)  # count_problem proved it an int


def loop_placement(num_ranks: int, chunks: int) -> tuple[int, ...]:
    """Megatron's virtual-stage placement: stage s lives on rank s mod p."""
    return tuple(stage % num_ranks for stage in range(num_ranks * chunks))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: rank r holds stages r and 2p-1-r."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered stream, the stage → rank placement, and the sizes they were made for.

    A generator returns compute-only streams (F, B, I, W); `lower` adds communication and
    loads, `add_optimizer_step` the gradient reduction and optimizer step. The same value
    feeds the validator, the simulator, the plots and the engine.
    """

    name: str
    num_microbatches: int
    placement: tuple[int, ...]
    streams: tuple[tuple[Instruction, ...], ...]
    lowered: bool = False
    """True once `lower` added send/recv and load instructions."""
    _stages_of: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_ranks = len(self.streams)
        check_count("num_microbatches", self.num_microbatches)
        if num_ranks < 1:
            raise ScheduleConfigError("a schedule needs at least one rank's stream")
        bad = [rank for rank in self.placement if not 0 <= rank < num_ranks]
        if bad or not self.placement:
            raise ScheduleConfigError(
                f"placement {self.placement} must map every stage to a rank in 0..{num_ranks - 1}"
            )
        stages_of: list[list[int]] = [[] for _ in range(num_ranks)]
        for stage, rank in enumerate(self.placement):
            stages_of[rank].append(stage)
        idle = [rank for rank, stages in enumerate(stages_of) if not stages]
        if idle:  # a rank with nothing to run has no place in a pipeline (and no stream)
            raise ScheduleConfigError(
                f"rank(s) {idle} hold no stage under placement {self.placement}; give every "
                f"rank of the {num_ranks} at least one stage, or drop the idle ranks' lines")
        object.__setattr__(self, "_stages_of", tuple(tuple(s) for s in stages_of))

    @property
    def num_ranks(self) -> int:
        return len(self.streams)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def chunks(self) -> int:
        """Stages per rank (v); placements built here give every rank the same number."""
        return max(len(stages) for stages in self._stages_of)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that `rank` holds, in increasing order."""
        return self._stages_of[rank]

    @property
    def has_backward(self) -> bool:
        """False for a forward-only (inference) schedule."""
        return any(op.kind is not Kind.F and op.kind in COMPUTE_KINDS
                   for stream in self.streams for op in stream)

    @property
    def num_instructions(self) -> int:
        return sum(len(stream) for stream in self.streams)

    def compute_streams(self) -> tuple[tuple[Instruction, ...], ...]:
        """The streams with only F, B, I and W kept, in order."""
        # a generator's stream is compute only: its kinds are read in C (map, itemgetter)
        # and the stream kept as it is; a lowered one is filtered op by op
        return tuple(tuple(stream) if COMPUTE_KINDS.issuperset(map(_kind_of, stream)) else
                     tuple(op for op in stream if op.kind in COMPUTE_KINDS)
                     for stream in self.streams)

    def replace_streams(self, streams: tuple[tuple[Instruction, ...], ...], *,
                        lowered: bool | None = None) -> Schedule:
        """A copy with other streams (the passes use this)."""
        return Schedule(self.name, self.num_microbatches, self.placement, streams,
                        self.lowered if lowered is None else lowered)

    def format(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 ...`` (parses back with `from_text`)."""
        return "\n".join(f"rank {rank}: {format_stream(stream)}"
                         for rank, stream in enumerate(self.streams))

    @classmethod
    def from_text(cls, text: str, *, name: str = "custom", num_microbatches: int | None = None,
                  placement: tuple[int, ...] | None = None) -> Schedule:
        """Read streams written by `format` (``rank R:`` prefixes optional, one rank a line).

        A ``rank R:`` label must match the line's place (the first non-blank line is rank 0):
        a file whose labels disagree with its order is refused, never silently reordered.
        Without `placement`, each stage is placed on the rank whose stream computes it;
        without `num_microbatches`, it is one more than the largest microbatch seen.
        """
        numbered = [(number, line) for number, line in enumerate(text.splitlines(), 1)
                    if line.strip()]
        streams = tuple(parse_stream(_stream_text(line, number, rank))
                        for rank, (number, line) in enumerate(numbered))
        ops = [(rank, op) for rank, stream in enumerate(streams) for op in stream]
        if num_microbatches is None:
            num_microbatches = 1 + max((op.microbatch for _, op in ops), default=0)
        if placement is None:
            owner: dict[int, int] = {}
            for rank, op in ops:
                if op.kind in COMPUTE_KINDS:
                    owner.setdefault(op.stage, rank)
            if sorted(owner) != list(range(len(owner))) or not owner:
                raise ScheduleConfigError(
                    f"stages computed in the text are {sorted(owner)}; expected 0..S-1 with "
                    "none missing (or pass placement= explicitly)"
                )
            placement = tuple(owner[stage] for stage in range(len(owner)))
        lowered = any(op.kind not in COMPUTE_KINDS for _, op in ops)
        return cls(name, num_microbatches, placement, streams, lowered)


def _stream_text(line: str, number: int, rank: int) -> str:
    """The stream of `line` (line `number`, holding `rank`'s stream), its label checked."""
    if ":" not in line:
        return line
    label, stream = line.split(":", 1)
    match = _LABEL.fullmatch(label)
    if match is None:
        raise ScheduleParseError(
            f"line {number}: {label.strip()[:40]!r} before ':' is not a rank label; write "
            f"'rank {rank}: ...' or the stream alone")
    if match.group(1) != str(rank):  # compared as text: a 5,000-digit label is just wrong
        shown = match.group(1) if len(match.group(1)) <= 12 else match.group(1)[:12] + "..."
        raise ScheduleParseError(
            f"line {number} is labelled 'rank {shown}' but holds rank {rank}'s stream (the "
            f"{_ordinal(rank + 1)} non-blank line); list the ranks in order, rank 0 first, one "
            "line each")
    return stream


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
