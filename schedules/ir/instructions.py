"""Pipeline instructions: small frozen values with a compact text form that parses back."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from enum import Enum
from functools import partial
from itertools import repeat
from typing import NamedTuple

from schedules.ir.errors import ScheduleParseError

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "NONE",
    "SHARED_OPS_LIMIT",
    "Instruction",
    "Kind",
    "compute_ops",
    "format_stream",
    "instruction_from",
    "parse_instruction",
    "parse_stream",
    "stage_ops",
]

NONE = -1
"""Value of `stage`, `microbatch` or `peer` when an instruction has none."""


class Kind(Enum):
    """What an instruction does. The value is its text in the compact form."""

    F = "F"  # forward of one stage for one microbatch
    B = "B"  # full backward: input and weight gradients together
    I = "I"  # noqa: E741  (the zero-bubble papers' name) backward for the input grad only
    W = "W"  # backward for the weight gradients only, after I
    SEND_F = "SEND_F"  # send this stage's output activation to the next stage's rank
    RECV_F = "RECV_F"  # receive this stage's input activation from the previous rank
    SEND_B = "SEND_B"  # send the gradient of this stage's input to the previous rank
    RECV_B = "RECV_B"  # receive the gradient of this stage's output from the next rank
    LOAD = "LOAD"  # load a microbatch: inputs on the first stage, targets on the last
    REDUCE_GRAD = "REDUCE_GRAD"  # reduce a stage's gradients (data parallel), once a step
    STEP = "STEP"  # optimizer step of everything on the rank
    # A full backward (like B) overlapped with the F just before it on the rank (DualPipe's
    # F&B pair, torch's OVERLAP_F_B): the pair costs one overlapped time, both outputs leave
    # when it ends. The two must be of different microbatches; an engine may run F then B.
    OVERLAP_B = "OVERLAP_B"
    # A stage's expert all-to-all (MoE dispatch / combine) inside an F or B of a microbatch:
    # a simulated timeline's row on the rank's all-to-all lane, never an instruction of a
    # stream (the engine runs it inside the op; `schedules.analysis.all_to_all`).
    ALL_TO_ALL = "ALL_TO_ALL"

    # Enum's own __hash__ is Python code (hash of the name), paid on every `kind in
    # COMPUTE_KINDS` of millions of ops; members are singletons compared by identity, so
    # the C identity hash is as valid (set order was never fixed: names hash per process)
    __hash__ = object.__hash__


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_B})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
_BY_TEXT = {kind.value: kind for kind in Kind}
_PATTERN = re.compile(r"(\d*)([A-Z_]+?)(\d*)(?:@(\d+))?")


class Instruction(NamedTuple):
    """One step of a rank's stream.

    Text form: ``{stage}{kind}{microbatch}`` with ``@{peer rank}`` on communication,
    e.g. ``2F0``, ``1B3``, ``1SEND_F0@2``, ``0LOAD3``, ``1REDUCE_GRAD``, ``STEP``; an
    overlapped pair is two words, ``0F3 3OVERLAP_B1`` (torch: ``(0F3;3B1)OVERLAP_F_B``).
    Fields that an instruction does not use hold `NONE` (-1).
    """

    kind: Kind
    stage: int = NONE
    microbatch: int = NONE
    peer: int = NONE

    def __str__(self) -> str:
        kind, stage, microbatch, peer = self
        text = kind.value
        if stage != NONE:
            text = f"{stage}{text}"
        if microbatch != NONE:
            text = f"{text}{microbatch}"
        if peer != NONE:
            text = f"{text}@{peer}"
        return text

    def __repr__(self) -> str:
        return f"Instruction({self})"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS


_NEEDS = {  # which fields each kind carries: (stage, microbatch, peer)
    Kind.F: (True, True, False), Kind.B: (True, True, False),
    Kind.I: (True, True, False), Kind.W: (True, True, False),
    Kind.SEND_F: (True, True, True), Kind.RECV_F: (True, True, True),
    Kind.SEND_B: (True, True, True), Kind.RECV_B: (True, True, True),
    Kind.LOAD: (True, True, False), Kind.REDUCE_GRAD: (True, False, False),
    Kind.STEP: (False, False, False), Kind.OVERLAP_B: (True, True, False),
    Kind.ALL_TO_ALL: (True, True, False),
}


instruction_from: Callable[[tuple[Kind, int, int, int]], Instruction] = partial(
    tuple.__new__, Instruction)
"""Build an `Instruction` from a ``(kind, stage, microbatch, peer)`` tuple without checks.

`tuple.__new__` skips NamedTuple's argument handling and, bound by a C `partial`, costs no
Python frame: generators and `lower` build ~1M instructions, where that is most of the time.
"""


def compute_ops(kind: Kind, stages: Iterable[int], microbatches: Iterable[int]) -> list[
        Instruction]:
    """``Instruction(kind, stage, microbatch)`` for each pair of `stages` and `microbatches`
    (as far as the shorter goes; `itertools.repeat` gives one stage for all), built by C
    iterators with no Python frame per instruction (see `instruction_from`)."""
    return list(map(instruction_from, zip(repeat(kind), stages, microbatches, repeat(NONE))))


SHARED_OPS_LIMIT = 1_000_000
"""Most instructions `stage_ops` keeps (~100 MB at most, ~50 MB after a 3,072-device plan
search); past it, it forgets them all and starts again."""
_shared: dict[tuple[Kind, int], list[Instruction]] = {}
_num_shared = 0


def stage_ops(kind: Kind, stage: int, count: int) -> list[Instruction]:
    """``Instruction(kind, stage, i)`` for i = 0, 1, ..., count - 1 and maybe beyond: one
    list per (kind, stage), shared by every schedule built in this process. Read it, never
    change it.

    Instructions are immutable values, so schedules may share them; a plan search builds
    ~100 schedules with ~2.7 million instructions of which ~0.5 million differ, and copying
    a slice of shared ones costs a fraction of making new ones (and of the garbage
    collector's later passes over them).
    """
    global _num_shared
    table = _shared.get((kind, stage), [])
    if len(table) < count:
        if _num_shared + count > SHARED_OPS_LIMIT:
            _shared.clear()
            _num_shared, table = 0, []
        # a new list, never a published one extended: a reader's list stays as it was
        table = table + compute_ops(kind, repeat(stage), range(len(table), count))
        _num_shared += count - len(_shared.get((kind, stage), ()))
        _shared[kind, stage] = table
    return table


def parse_instruction(text: str) -> Instruction:
    """Parse one instruction from its text form (the inverse of `str`)."""
    match = _PATTERN.fullmatch(text.strip())
    kind = _BY_TEXT.get(match.group(2)) if match else None
    if match is None or kind is None:
        raise ScheduleParseError(
            f"cannot parse instruction {text!r}: expected e.g. '2F0', '1B3', '1SEND_F0@2', "
            f"'0LOAD3', '1REDUCE_GRAD' or 'STEP' (kinds: {', '.join(_BY_TEXT)})"
        )
    stage_text, _, microbatch_text, peer_text = match.groups()
    needs_stage, needs_microbatch, needs_peer = _NEEDS[kind]
    present = (bool(stage_text), bool(microbatch_text), peer_text is not None)
    if present != (needs_stage, needs_microbatch, needs_peer):
        form = ("{stage}" if needs_stage else "") + kind.value
        form += ("{microbatch}" if needs_microbatch else "") + ("@{peer}" if needs_peer else "")
        raise ScheduleParseError(f"instruction {text!r} does not have the form {form!r}")
    return Instruction(
        kind,
        int(stage_text) if stage_text else NONE,
        int(microbatch_text) if microbatch_text else NONE,
        int(peer_text) if peer_text is not None else NONE,
    )


def format_stream(stream: Iterable[Instruction]) -> str:
    """One rank's stream on one line, instructions separated by spaces."""
    return " ".join(map(str, stream))


def parse_stream(text: str) -> tuple[Instruction, ...]:
    """Parse a line written by `format_stream` (commas are accepted as separators too)."""
    return tuple(parse_instruction(word) for word in text.replace(",", " ").split())
