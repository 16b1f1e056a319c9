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

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from, stage_ops

__all__ = ["StepTable", "emit_steps"]

StepTable = Sequence[tuple[int, str]]
"""(repeat count, pattern) rows; a count <= 0 skips the row."""

_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


@lru_cache(maxsize=1024)
def _parse(pattern: str, chunks: int) -> tuple[tuple[Kind, int], ...]:
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
    return tuple(tokens)


@dataclass(frozen=True)
class _Layout:
    """Where each token of a pattern takes its microbatch from, per repeat of the pattern.

    A token is the `offset`-th of its counter's tokens in the pattern (forwards of its
    chunk; fused and input backwards of its chunk, which share a counter; Ws of its chunk),
    which has `stride` of them: in repeat t it takes the counter's value + t·stride + offset.
    """

    tokens: tuple[tuple[Kind, int], ...]
    offsets: tuple[int, ...]
    strides: tuple[int, ...]
    inputs_before: tuple[int, ...]
    """Per token: the pattern's I tokens of its chunk before it (a W's supply)."""
    input_slot: tuple[int, ...]
    """Per I token: its place among the I tokens of its chunk (others: -1)."""
    input_order: tuple[int, ...]
    """Per I token: its place among all I tokens of the pattern (others: -1)."""
    inputs: tuple[int, ...]
    """Per chunk: the pattern's I tokens."""
    weights: tuple[int, ...]
    """Per chunk: the pattern's W tokens (a bare W counts for none)."""
    bare_weight: bool
    """A bare W takes the oldest queued W of any chunk: such rows run token by token."""


@lru_cache(maxsize=1024)
def _layout(pattern: str, chunks: int) -> _Layout:
    tokens = _parse(pattern, chunks)
    seen: dict[tuple[str, int], int] = {}
    offsets, groups, inputs_before, input_slot, input_order = [], [], [], [], []
    inputs, weights = [0] * chunks, [0] * chunks
    for kind, chunk in tokens:
        group = ("F" if kind is Kind.F else "W" if kind is Kind.W else "B", chunk)
        groups.append(group)
        offsets.append(seen.get(group, 0))
        seen[group] = offsets[-1] + 1
        inputs_before.append(inputs[chunk] if chunk != NONE else 0)
        if kind is Kind.I:
            input_slot.append(inputs[chunk])
            input_order.append(sum(inputs))
            inputs[chunk] += 1
        else:
            input_slot.append(-1)
            input_order.append(-1)
        if kind is Kind.W and chunk != NONE:
            weights[chunk] += 1
    return _Layout(tokens, tuple(offsets), tuple(seen[group] for group in groups),
                   tuple(inputs_before), tuple(input_slot), tuple(input_order), tuple(inputs),
                   tuple(weights), any(chunk == NONE for _, chunk in tokens))


class _Counters:
    """Per chunk: the next forward and backward microbatch, every I so far (its microbatch
    and its place in the W queue) and how many of them a W took. The queue of the module
    docstring is these lists: a chunk's Ws leave in its I order, a bare W takes the chunk
    whose oldest waiting I came first."""

    def __init__(self, chunks: int) -> None:
        self.forward = [0] * chunks
        self.backward = [0] * chunks
        self.inputs: list[list[int]] = [[] for _ in range(chunks)]
        self.queued: list[list[int]] = [[] for _ in range(chunks)]
        self.taken = [0] * chunks
        self.num_queued = 0

    def weights_available(self, layout: _Layout, count: int) -> bool:
        """Every W<c> of `count` repeats finds an I of its chunk queued. Supply and demand
        both grow linearly with the repeat, so the first and the last repeat decide."""
        for j, (kind, chunk) in enumerate(layout.tokens):
            if kind is Kind.W:
                for t in (0, count - 1):
                    wanted = self.taken[chunk] + t * layout.weights[chunk] + layout.offsets[j]
                    supply = (len(self.inputs[chunk]) + t * layout.inputs[chunk]
                              + layout.inputs_before[j])
                    if wanted >= supply:
                        return False
        return True

    def step(self, kind: Kind, chunk: int) -> tuple[int, int] | None:
        """One token's (chunk, microbatch), or None for a bare W with nothing queued."""
        if kind is Kind.F:
            self.forward[chunk] += 1
            return chunk, self.forward[chunk] - 1
        if kind is Kind.W:
            if chunk == NONE:
                waiting = [c for c, taken in enumerate(self.taken) if taken < len(self.inputs[c])]
                if not waiting:
                    return None
                chunk = min(waiting, key=lambda c: self.queued[c][self.taken[c]])
            elif self.taken[chunk] == len(self.inputs[chunk]):
                raise ScheduleConfigError(
                    f"step table asks for W of chunk {chunk} with no I of that chunk queued; "
                    "a W must follow its I")
            self.taken[chunk] += 1
            return chunk, self.inputs[chunk][self.taken[chunk] - 1]
        microbatch = self.backward[chunk]
        self.backward[chunk] += 1
        if kind is Kind.I:
            self.inputs[chunk].append(microbatch)
            self.queued[chunk].append(self.num_queued)
            self.num_queued += 1
        return chunk, microbatch

    def repeat(self, layout: _Layout, count: int, stages: Sequence[int],
               num_microbatches: int) -> list[Instruction | None]:
        """`count` repeats of the pattern at once: each token's ops are every stride-th
        microbatch of its counter, so its lane of the row is one range (or, for a W, a slice
        of its chunk's Is); None where an op is dropped (microbatch >= num_microbatches)."""
        tokens = layout.tokens
        width = len(tokens)
        starts = []
        for j, (kind, chunk) in enumerate(tokens):
            counter = self.forward if kind is Kind.F else self.backward
            starts.append(counter[chunk] + layout.offsets[j] if kind is not Kind.W else 0)
        num_inputs = sum(layout.inputs)
        for j, (kind, chunk) in enumerate(tokens):  # the Is first: Ws of this row take them
            if kind is Kind.I:
                per_repeat = layout.inputs[chunk]
                if layout.input_slot[j] == 0:  # the chunk's first I token: room for all
                    self.inputs[chunk].extend([0] * (count * per_repeat))
                    self.queued[chunk].extend([0] * (count * per_repeat))
                first = len(self.inputs[chunk]) - count * per_repeat + layout.input_slot[j]
                stride = layout.strides[j]
                self.inputs[chunk][first::per_repeat] = range(
                    starts[j], starts[j] + count * stride, stride)
                order = self.num_queued + layout.input_order[j]
                self.queued[chunk][first::per_repeat] = range(
                    order, order + count * num_inputs, num_inputs)
        row: list[Instruction | None] = [None] * (count * width)
        for j, (kind, chunk) in enumerate(tokens):
            stride = layout.strides[j]
            ops = stage_ops(kind, stages[chunk], num_microbatches)
            if kind is Kind.W:
                first = self.taken[chunk] + layout.offsets[j]
                taken = self.inputs[chunk][first:first + count * stride:stride]
                del taken[bisect_left(taken, num_microbatches):]
                lane: list[Instruction | None] = [*map(ops.__getitem__, taken)]
            else:
                end = min(starts[j] + count * stride, num_microbatches)
                lane = [*ops[starts[j]:end:stride]]
            lane.extend([None] * (count - len(lane)))
            row[j::width] = lane
        for j, (kind, chunk) in enumerate(tokens):
            if layout.offsets[j] == 0:  # advance each counter once, by all its tokens
                if kind is Kind.F:
                    self.forward[chunk] += count * layout.strides[j]
                elif kind is Kind.W:
                    self.taken[chunk] += count * layout.strides[j]
                else:
                    self.backward[chunk] += count * layout.strides[j]
        self.num_queued += count * num_inputs
        return row


def emit_steps(stages: Sequence[int], steps: StepTable, num_microbatches: int) -> tuple[
        Instruction, ...]:
    """The compute stream a step table describes for a rank holding `stages` (chunk c is
    stages[c]).

    Ops of microbatches >= `num_microbatches` are dropped: a generator may run its table
    for more microbatches than asked and keep the prefix. That stays executable because
    whole microbatches are removed and every dependency is within one microbatch.
    """
    m = num_microbatches
    counters = _Counters(len(stages))
    out: list[Instruction] = []
    for count, pattern in steps:
        layout = _layout(pattern, len(stages))
        if count <= 0:
            continue
        if not layout.bare_weight and counters.weights_available(layout, count):
            out.extend(filter(None, counters.repeat(layout, count, stages, m)))
            continue
        # token by token: a bare W's chunk depends on the queue; or a W finds no I (the
        # error is raised where it happens)
        for _ in range(count):
            for kind, chunk in layout.tokens:
                taken = counters.step(kind, chunk)
                if taken is not None and taken[1] < m:
                    out.append(instruction_from((kind, stages[taken[0]], taken[1], NONE)))
    return tuple(out)
