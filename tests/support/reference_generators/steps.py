"""Emit one rank's compute stream from a step table: counted repeats of short op patterns.

The V-shaped schedules (ZB-V, DualPipeV) are published as such tables, e.g. DualPipe's
``# Step 4 (Main step): nF0B1F1B0``; writing them the same way keeps the code next to the
paper's figure. A table is a list of ``(count, pattern)``; a pattern is space-separated
tokens, each a kind and a chunk: ``F0`` (forward of the rank's chunk 0), ``B1`` (fused
backward of chunk 1), ``I0`` (input-gradient backward; its W is queued), ``W1`` (the
oldest queued W of chunk 1) or a bare ``W`` (the oldest queued W of any chunk, DualPipe's
weight queue). Every chunk takes its microbatches in order 0, 1, 2, ... per kind.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from

__all__ = ["StepTable", "emit_steps"]

StepTable = Sequence[tuple[int, str]]
"""(repeat count, pattern) rows; a count <= 0 skips the row."""

_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


def _parse(pattern: str, chunks: int) -> list[tuple[Kind, int]]:
    """Tokens of one pattern as (kind, chunk); chunk NONE for a bare ``W``."""
    tokens = []
    for token in pattern.split():
        kind = _KINDS.get(token[0])
        chunk_text = token[1:]
        if kind is None or (chunk_text and not chunk_text.isdigit()) or \
                (not chunk_text and kind is not Kind.W):
            raise ScheduleConfigError(f"step token {token!r} is not one of F<c>, B<c>, I<c>, "
                                      "W<c> or W (c a chunk number)")
        chunk = int(chunk_text) if chunk_text else NONE
        if chunk >= chunks:
            raise ScheduleConfigError(f"step token {token!r} names chunk {chunk}, but the rank "
                                      f"holds {chunks} chunks")
        tokens.append((kind, chunk))
    return tokens


def emit_steps(stages: Sequence[int], steps: StepTable, num_microbatches: int) -> tuple[
        Instruction, ...]:
    """The compute stream a step table describes for a rank holding `stages` (chunk c is
    stages[c]).

    Ops of microbatches >= `num_microbatches` are dropped: a generator may run its table
    for more microbatches than asked and keep the prefix. That stays executable because
    whole microbatches are removed and every dependency is within one microbatch.
    """
    m = num_microbatches
    chunks = len(stages)
    next_forward = [0] * chunks
    next_backward = [0] * chunks
    queued: deque[tuple[int, int]] = deque()  # (chunk, microbatch) whose W is still to come
    out: list[Instruction] = []
    emit, make = out.append, instruction_from  # inlined: ~10^6 ops a search at scale

    for count, pattern in steps:
        tokens = _parse(pattern, chunks)
        for _ in range(max(count, 0)):
            for kind, chunk in tokens:
                if kind is Kind.F:
                    microbatch = next_forward[chunk]
                    next_forward[chunk] += 1
                elif kind is Kind.W:
                    picked = _pop_weight(queued, chunk)
                    if picked is None:
                        continue
                    chunk, microbatch = picked
                else:
                    microbatch = next_backward[chunk]
                    next_backward[chunk] += 1
                    if kind is Kind.I:
                        queued.append((chunk, microbatch))
                if microbatch < m:
                    emit(make((kind, stages[chunk], microbatch, NONE)))
    return tuple(out)


def _pop_weight(queued: deque[tuple[int, int]], chunk: int) -> tuple[int, int] | None:
    """Remove and return the oldest queued W (of `chunk`, or of any chunk when NONE)."""
    if chunk == NONE:
        return queued.popleft() if queued else None
    for index, (queued_chunk, _) in enumerate(queued):
        if queued_chunk == chunk:
            picked = queued[index]
            del queued[index]
            return picked
    raise ScheduleConfigError(f"step table asks for W of chunk {chunk} with no I of that chunk "
                              "queued; a W must follow its I")
