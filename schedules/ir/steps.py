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

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import NONE, Instruction, Kind, stage_ops

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
    chunk; fused and input backwards of its chunk, which share a counter; Ws of its chunk;
    bare Ws), which has `stride` of them: in repeat t it takes the counter's value +
    t·stride + offset.
    """

    tokens: tuple[tuple[Kind, int], ...]
    offsets: tuple[int, ...]
    strides: tuple[int, ...]
    inputs_before: tuple[int, ...]
    """Per token: the pattern's I tokens before it (of its chunk; of any for a bare W)."""
    input_slot: tuple[int, ...]
    """Per I token: its place among the I tokens of its chunk (others: -1)."""
    input_order: tuple[int, ...]
    """Per I token: its place among all I tokens of the pattern (others: -1)."""
    inputs: tuple[int, ...]
    """Per chunk: the pattern's I tokens."""
    weights: tuple[int, ...]
    """Per chunk: the pattern's W tokens of that chunk."""
    bare_weights: int
    """The pattern's bare W tokens."""
    num_inputs: int
    """The pattern's I tokens."""
    counted: tuple[tuple[int, int, Kind, int, int, int], ...]
    """(token, counter, kind, chunk, offset, stride) of each F, B and I token: counter 0
    forwards, 1 backwards."""
    input_tokens: tuple[int, ...]
    weight_tokens: tuple[int, ...]
    advances: tuple[tuple[int, int, int], ...]
    """(counter, chunk, tokens per repeat): counter 0 forwards, 1 backwards, 2 the Ws taken
    by W<c> tokens."""


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
        inputs_before.append(inputs[chunk] if chunk != NONE else sum(inputs))
        if kind is Kind.I:
            input_slot.append(inputs[chunk])
            input_order.append(sum(inputs))
            inputs[chunk] += 1
        else:
            input_slot.append(-1)
            input_order.append(-1)
        if kind is Kind.W and chunk != NONE:
            weights[chunk] += 1
    strides = tuple(seen[group] for group in groups)
    counters = {"F": 0, "B": 1, "W": 2}
    counted = tuple((j, counters[groups[j][0]], kind, chunk, offsets[j], strides[j])
                    for j, (kind, chunk) in enumerate(tokens) if kind is not Kind.W)
    advances = tuple((counters[name], chunk, total) for (name, chunk), total in seen.items()
                     if chunk != NONE)
    return _Layout(tokens, tuple(offsets), strides, tuple(inputs_before), tuple(input_slot),
                   tuple(input_order), tuple(inputs), tuple(weights), seen.get(("W", NONE), 0),
                   sum(inputs), counted,
                   tuple(j for j, (kind, _) in enumerate(tokens) if kind is Kind.I),
                   tuple(j for j, (kind, _) in enumerate(tokens) if kind is Kind.W), advances)


class _Counters:
    """The state between tokens: per chunk the next forward and backward microbatch, and the
    queue of Ws (one per I, in I order; the module docstring's queue).

    The queue is kept whole, `queue[k]` the W of the k-th I (None when its microbatch is
    dropped), with per chunk the positions of its Is and how many of them a W took: a W<c>
    takes its chunk's oldest, a bare W the oldest of any chunk. While every W taken was the
    queue's oldest (`in_order`), the taken ones are a prefix of the queue.
    """

    def __init__(self, stages: Sequence[int], num_microbatches: int) -> None:
        chunks = len(stages)
        self.stages, self.m = stages, num_microbatches
        self.forward = [0] * chunks
        self.backward = [0] * chunks
        self.queue: list[Instruction | None] = []
        self.queue_chunks: list[int] = []
        self.positions: list[list[int]] = [[] for _ in range(chunks)]
        self.taken = [0] * chunks
        self.in_order = True
        self._tables: dict[tuple[Kind, int], list[Instruction]] = {}

    def ops(self, kind: Kind, chunk: int) -> list[Instruction]:
        """The shared ops of `kind` on the chunk's stage, microbatches 0..m-1 (and maybe on)."""
        table = self._tables.get((kind, chunk))
        if table is None:
            table = self._tables[kind, chunk] = stage_ops(kind, self.stages[chunk], self.m)
        return table

    def can_repeat(self, layout: _Layout, count: int) -> bool:
        """Whether `repeat` gives these `count` repeats: every W finds a W queued (a W<c> one
        of its chunk), and bare Ws take a prefix of the queue. Supply and demand both grow
        linearly with the repeat, so the first and the last repeat decide."""
        if not layout.weight_tokens:
            return True
        if layout.bare_weights and (any(layout.weights) or not self.in_order):
            return False
        waiting = len(self.queue) - sum(self.taken)
        for j in layout.weight_tokens:
            chunk = layout.tokens[j][1]
            for t in (0, count - 1):
                if chunk == NONE:
                    wanted = t * layout.bare_weights + layout.offsets[j]
                    supply = waiting + t * layout.num_inputs + layout.inputs_before[j]
                else:
                    wanted = self.taken[chunk] + t * layout.weights[chunk] + layout.offsets[j]
                    supply = (len(self.positions[chunk]) + t * layout.inputs[chunk]
                              + layout.inputs_before[j])
                if wanted >= supply:
                    return False
        return True

    def step(self, kind: Kind, chunk: int) -> Instruction | None:
        """One token's op, or None: a dropped microbatch, or a bare W with nothing queued."""
        if kind is Kind.W:
            if chunk == NONE:
                waiting = [c for c, taken in enumerate(self.taken)
                           if taken < len(self.positions[c])]
                if not waiting:
                    return None
                chunk = min(waiting, key=lambda c: self.positions[c][self.taken[c]])
            elif self.taken[chunk] == len(self.positions[chunk]):
                raise ScheduleConfigError(
                    f"step table asks for W of chunk {chunk} with no I of that chunk queued; "
                    "a W must follow its I")
            position = self.positions[chunk][self.taken[chunk]]
            self.in_order = self.in_order and position == sum(self.taken)
            self.taken[chunk] += 1
            return self.queue[position]
        counter = self.forward if kind is Kind.F else self.backward
        microbatch = counter[chunk]
        counter[chunk] += 1
        m = self.m
        if kind is Kind.I:
            self.positions[chunk].append(len(self.queue))
            self.queue.append(self.ops(Kind.W, chunk)[microbatch] if microbatch < m else None)
            self.queue_chunks.append(chunk)
        return self.ops(kind, chunk)[microbatch] if microbatch < m else None

    def repeat(self, layout: _Layout, count: int) -> list[Instruction | None]:
        """`count` repeats of the pattern at once (`can_repeat` said yes): a token's ops are
        every stride-th microbatch of its counter, so its lane of the row is a slice of the
        shared ops (for a W, of the queue); None where an op is dropped."""
        m, width = self.m, len(layout.tokens)
        counters = (self.forward, self.backward)
        lanes: list[list[Instruction | None]] = [[]] * width
        for j, counter, kind, chunk, offset, stride in layout.counted:
            start = counters[counter][chunk] + offset
            lane = cast(list[Instruction | None],
                        self.ops(kind, chunk)[start:min(start + count * stride, m):stride])
            if len(lane) < count:
                lane.extend([None] * (count - len(lane)))
            lanes[j] = lane
            if kind is Kind.I:
                self._queue(layout, j, count, start, stride)
        head = sum(self.taken)
        for j in layout.weight_tokens:  # after the Is of the row have joined the queue
            chunk, first, stride = layout.tokens[j][1], layout.offsets[j], layout.strides[j]
            if chunk == NONE:  # the oldest, a prefix of the queue
                lanes[j] = self.queue[head + first:head + first + count * stride:stride]
            else:
                first += self.taken[chunk]
                lanes[j] = [*map(self.queue.__getitem__,
                                 self.positions[chunk][first:first + count * stride:stride])]
                self.in_order = False  # need not be the oldest
        if width == 1:
            row = lanes[0]
        else:
            row = [None] * (count * width)
            for j, lane in enumerate(lanes):
                row[j::width] = lane
        for counter, chunk, per_repeat in layout.advances:
            (self.forward, self.backward, self.taken)[counter][chunk] += count * per_repeat
        if layout.bare_weights:
            taken = self.queue_chunks[head:head + count * layout.bare_weights]
            for c in range(len(self.taken)):
                self.taken[c] += taken.count(c)
        return row

    def _queue(self, layout: _Layout, j: int, count: int, start: int, stride: int) -> None:
        """The Ws of I token j's `count` ops join the queue, among the row's other Is."""
        chunk, m = layout.tokens[j][1], self.m
        per_repeat, num_inputs = layout.inputs[chunk], layout.num_inputs
        if layout.input_order[j] == 0:  # the row's first I token: room for all
            self.queue.extend([None] * (count * num_inputs))
            self.queue_chunks.extend([0] * (count * num_inputs))
        if layout.input_slot[j] == 0:  # the chunk's first I token
            self.positions[chunk].extend([0] * (count * per_repeat))
        base = len(self.queue) - count * num_inputs + layout.input_order[j]
        weights = self.ops(Kind.W, chunk)[start:min(start + count * stride, m):stride]
        self.queue[base:base + len(weights) * num_inputs:num_inputs] = weights
        self.queue_chunks[base::num_inputs] = [chunk] * count
        first = len(self.positions[chunk]) - count * per_repeat + layout.input_slot[j]
        self.positions[chunk][first::per_repeat] = range(base, base + count * num_inputs,
                                                         num_inputs)


def emit_steps(stages: Sequence[int], steps: StepTable, num_microbatches: int) -> tuple[
        Instruction, ...]:
    """The compute stream a step table describes for a rank holding `stages` (chunk c is
    stages[c]).

    Ops of microbatches >= `num_microbatches` are dropped: a generator may run its table
    for more microbatches than asked and keep the prefix. That stays executable because
    whole microbatches are removed and every dependency is within one microbatch.
    """
    counters = _Counters(stages, num_microbatches)
    out: list[Instruction] = []
    for count, pattern in steps:
        layout = _layout(pattern, len(stages))
        if count <= 0:
            continue
        if counters.can_repeat(layout, count):
            out.extend(filter(None, counters.repeat(layout, count)))
            continue
        # token by token: a W finds no I (the error is raised where it happens), or bare Ws
        # after Ws of a chunk took from the middle of the queue
        for _ in range(count):
            for kind, chunk in layout.tokens:
                op = counters.step(kind, chunk)
                if op is not None:
                    out.append(op)
    return tuple(out)
