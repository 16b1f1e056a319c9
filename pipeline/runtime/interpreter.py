"""Run one rank's lowered instruction stream: a table from instruction kind to a small handler.

Legend: s stage, i microbatch, m microbatches, S stages; F forward, B full backward, I
input-gradient backward, W weight-gradient backward. Activations flow F(s,i) -> F(s+1,i)
and gradients B|I(s+1,i) -> B|I(s,i), over the network when the neighbour stage lives on
another rank (SEND/RECV in the stream), through `StepState` when it lives on this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from pipeline.model.layer_rng import forward_key
from pipeline.model.module import LossFn, PipelineModule, Stage
from pipeline.moe.interleave import run_interleaved
from pipeline.parallel.data_parallel import GradReducer, OverlappingReducer
from pipeline.parallel.optimizer_step import OptimizerStep
from pipeline.parallel.precision import Precision
from pipeline.parallel.zero_grad_store import notify_backward_done
from pipeline.runtime.comm import Comm
from pipeline.runtime.compute_handlers import ComputeHandlers
from pipeline.runtime.lookahead import early_receives
from pipeline.runtime.loss_normalization import is_summed
from pipeline.runtime.message_handlers import MessageHandlers
from pipeline.runtime.send_release import MessageKey, send_witnesses
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.stage_tensors import free_output_data
from pipeline.runtime.step_state import StepState
from pipeline.runtime.stream_scan import interleavable_pairs, last_backwards, pair_spans
from pipeline.runtime.trace import Trace
from pipeline.runtime.two_batch import declared_row_sums
from pipeline.supervision.progress import ProgressRecord
from schedules import Instruction, Kind

_WEIGHT_GRADIENTS = frozenset({Kind.B, Kind.OVERLAP_B, Kind.W})
"""Instructions after which a stage's weight gradients of one microbatch are complete."""
_QUEUEING = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B, Kind.LOAD})
"""Instructions that queue messages (or only load local data); every other one first
launches what is queued (`Comm.flush`)."""

__all__ = ["InstructionFailed", "Interpreter", "StepState", "free_output_data", "last_backwards"]

_now = time.perf_counter


class InstructionFailed(Exception):
    """Instruction `step` of a stream (`op`) raised; the cause is `__cause__`."""

    def __init__(self, step: int, op: Instruction) -> None:
        super().__init__(f"instruction {op} (step {step}) failed")
        self.step, self.op = step, op


class Interpreter(ComputeHandlers, MessageHandlers):
    """Executes instruction streams on one rank: one handler per `Kind` (the compute ones in
    `compute_handlers`, the message and optimizer ones in `message_handlers`)."""

    def __init__(self, *, module: PipelineModule, pp_rank: int, placement: Sequence[int],
                 num_microbatches: int, comm: Comm, shapes: ShapeBook, trace: Trace,
                 reducer: GradReducer, loss_fn: LossFn | None,
                 optimizer_step: OptimizerStep,
                 device: torch.device, split_stages: frozenset[int] = frozenset(),
                 precision: Precision = "fp32",
                 loss_scale: Callable[[], float] = lambda: 1.0,
                 progress: ProgressRecord | None = None, shares_loss: bool = True,
                 overlap_grad_reduce: bool = False, free_sent_outputs: bool = True,
                 interleave_pairs: bool = False,
                 two_batch_stages: frozenset[int] = frozenset()) -> None:
        self.module = module
        self.pp_rank = pp_rank
        self.placement = tuple(placement)
        self.last_stage = len(placement) - 1
        self.m = num_microbatches
        self.comm = comm
        self.shapes = shapes
        self.trace = trace
        self.reducer = reducer
        self.loss_fn = loss_fn
        self._loss_checked = is_summed(loss_fn)
        """Whether the loss was probed for summing over items (a SummedLoss needs not be)."""
        self.optimizer_step = optimizer_step
        """STEP after the reducer's wait: its vote, then the step."""
        self.shares_loss = shares_loss
        """Whether this rank's losses count in the step's loss sum (one tensor-parallel rank
        each)."""
        self.device = device
        self.precision = precision
        """Stages run under this autocast; the loss is computed in fp32 from their output."""
        self.loss_scale = loss_scale
        """fp16's current loss scale (1 otherwise): backward starts from loss · scale."""
        self.split_stages = split_stages
        self.free_sent_outputs = free_sent_outputs
        """Free a stage output's data once it is sent (`free_output_data`)."""
        """Stages whose backward runs as I then W: their forwards hook layer outputs."""
        self.stages: dict[int, Stage] = {int(k): module.stage(int(k)) for k in module.stages}
        self.stage_params: dict[int, list[nn.Parameter]] = {
            s: module.stage_parameters(s) for s in self.stages}
        self.state = StepState(None, None, True)
        self.progress = progress or ProgressRecord(comm.pipeline_ranks[pp_rank])
        """What this rank does, for stall probes (the engine's record, read by its watchdog)."""
        self.overlap = overlap_grad_reduce and isinstance(reducer, OverlappingReducer)
        """Whether each stage's last B tells the reducer to launch buckets from its hooks."""
        self.interleave_pairs = interleave_pairs
        """Run each overlapped pair's F and B interleaved at their all-to-alls
        (`pipeline.moe.interleave`); else F, then B."""
        self.pair_handovers = 0
        """Times an overlapped pair's all-to-all ran under the other microbatch's compute."""
        self.two_batch = {s: declared_row_sums(self.stages[s]) for s in two_batch_stages
                          if s in self.stages}
        """Stages whose training F runs as two halves of its microbatch, taking turns at
        their all-to-alls outside a pair, one after the other inside one
        (`pipeline.runtime.two_batch`), with their row-sum positions."""
        self.two_batch_handovers = 0
        self._pairs: tuple[Sequence[Instruction], dict[int, int]] = ((), {})
        self.op_start = 0.0
        self._early: tuple[Sequence[Instruction], dict[int, list[int]]] = ((), {})
        self._witnesses: tuple[object, dict[MessageKey, list[MessageKey]]] = ((), {})
        self._last: tuple[Sequence[Instruction], dict[int, int]] = ((), {})
        self.handlers: dict[Kind, Callable[[Instruction], None]] = {
            Kind.LOAD: self.load, Kind.F: self.forward, Kind.B: self.backward,
            # an overlapped pair's B: its F ran as the instruction before, as its own call
            Kind.OVERLAP_B: self.backward,
            Kind.I: self.input_grad, Kind.W: self.weight_grad,
            Kind.SEND_F: self.send_forward, Kind.RECV_F: self.recv_forward,
            Kind.SEND_B: self.send_backward, Kind.RECV_B: self.recv_backward,
            Kind.REDUCE_GRAD: self.reduce_grad, Kind.STEP: self.step,
        }

    def run(self, stream: Sequence[Instruction], state: StepState, *,
            streams: Sequence[Sequence[Instruction]] | None = None) -> None:
        """Run one step's `stream` on `state` (this rank's microbatches and what the step
        holds); an instruction that raises is reported as `InstructionFailed`. Given every
        rank's `streams`, sends are waited (their tensors dropped) as soon as a received
        message proves them taken (`send_witnesses`), not only at the step's end."""
        self.state = state
        if streams is None:
            self._witnesses = ((), {})
        elif self._witnesses[0] is not streams:
            self._witnesses = (streams, send_witnesses(streams, self.pp_rank))
        if self._early[0] is not stream:
            self._early = (stream, early_receives(stream))
        early = self._early[1]
        if self.overlap and self._last[0] is not stream:
            self._last = (stream, last_backwards(stream))
        if self.interleave_pairs and self._pairs[0] is not stream:
            self._pairs = (stream, interleavable_pairs(stream))
        pairs = self._pairs[1] if self.interleave_pairs else {}
        posted: set[int] = set()  # receives posted ahead of their place; B run in a pair
        try:
            for step, op in enumerate(stream):
                if step in posted:
                    continue
                for k in early.get(step, ()):
                    if not self._can_post_early(stream[k]):
                        break  # the later ones wait too: a peer's messages match in order
                    self._run_one(k, stream[k], state)
                    posted.add(k)
                if step in pairs:
                    self._run_pair(step, op, pairs[step], stream[pairs[step]], state)
                    posted.add(pairs[step])
                else:
                    self._run_one(step, op, state)
        finally:
            self.state = StepState(None, None, True)  # hold nothing between steps

    def _run_one(self, step: int, op: Instruction, state: StepState) -> None:
        try:
            if self.overlap and step in self._last[1]:
                cast(OverlappingReducer, self.reducer).last_backward(op.stage)
            if op.kind is Kind.F:  # its layers draw dropout masks from this key
                with forward_key(state.step, state.first_microbatch + op.microbatch,
                                 self.device):
                    self.execute(op)
            else:  # a recompute in B gets the key through its checkpointed segment
                self.execute(op)
        except Exception as error:
            raise InstructionFailed(step, op) from error

    def _run_pair(self, step: int, op: Instruction, b_step: int, b_op: Instruction,
                  state: StepState) -> None:
        """F and its OVERLAP_B taking turns at their all-to-alls (`run_interleaved`)."""
        try:
            if self.overlap and b_step in self._last[1]:
                cast(OverlappingReducer, self.reducer).last_backward(b_op.stage)
            saved, grads = self._backward_inputs(b_op)  # here: it may wait on a receive
            self.progress.execute(op)
            self.comm.flush()
            start, forward_end = _now(), [0.0]

            def forward() -> None:
                with forward_key(state.step, state.first_microbatch + op.microbatch,
                                 self.device):
                    self.forward(op)
                forward_end[0] = _now()

            self.pair_handovers += run_interleaved(
                lambda: self._apply_backward(b_op, saved, grads), forward)
            notify_backward_done(self.reducer, b_op.stage)  # ZeRO-2 / 3
            f_span, b_span = pair_spans(start, forward_end[0], _now())
            self.trace.record(op.kind, op.stage, op.microbatch, *f_span)
            self.trace.record(b_op.kind, b_op.stage, b_op.microbatch, *b_span)
        except Exception as error:
            raise InstructionFailed(step, op) from error

    def execute(self, op: Instruction) -> None:
        """Run one instruction and record its span (receive waits get their own span)."""
        self.progress.execute(op)
        if op.kind not in _QUEUEING:  # before compute, a reduction or the step's votes:
            self.comm.flush()          # the messages queued since the last such op go out
        self.op_start = _now()
        self.handlers[op.kind](op)
        if op.kind in _WEIGHT_GRADIENTS:  # ZeRO-2 / 3 reduce each backward's gradients
            notify_backward_done(self.reducer, op.stage)
        if op.kind is not Kind.RECV_F and op.kind is not Kind.RECV_B:
            self.trace.record(op.kind, op.stage, op.microbatch, self.op_start, _now())

    def _can_post_early(self, op: Instruction) -> bool:
        """Whether a receive can be posted now without blocking: its layout is known (a
        gradient's from its forward, an activation's from the shape cache)."""
        if op.kind is Kind.RECV_B:
            return (op.stage, op.microbatch) in self.state.saved
        return self.shapes.cached(op.stage)
