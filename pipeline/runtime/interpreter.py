"""Run one rank's lowered instruction stream: a table from instruction kind to a small handler.

Legend: s stage, i microbatch, m microbatches, S stages; F forward, B full backward, I
input-gradient backward, W weight-gradient backward. Activations flow F(s,i) -> F(s+1,i)
and gradients B|I(s+1,i) -> B|I(s,i), over the network when the neighbour stage lives on
another rank (SEND/RECV in the stream), through `StepState` when it lives on this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.model.layer_rng import forward_key
from pipeline.model.module import LossFn, PipelineModule, Stage
from pipeline.moe.interleave import in_turns, run_interleaved
from pipeline.parallel.data_parallel import GradReducer, OverlappingReducer
from pipeline.parallel.optimizer_step import OptimizerStep
from pipeline.parallel.precision import Precision, autocast
from pipeline.parallel.zero_grad_store import notify_backward_done
from pipeline.runtime.batch import Batch, Layout, as_tensors
from pipeline.runtime.comm import Comm, PendingRecv
from pipeline.runtime.finite import all_finite
from pipeline.runtime.lookahead import early_receives
from pipeline.runtime.loss_call import call_loss
from pipeline.runtime.loss_normalization import is_summed
from pipeline.runtime.loss_probe import summed_loss_problem
from pipeline.runtime.saved_memory import hold_outputs
from pipeline.runtime.send_release import MessageKey, send_witnesses
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.split_backward import LayerGrads, forward_capturing
from pipeline.runtime.stage_tensors import (
    batch_to,
    detach_batch,
    float_tensors,
    free_output_data,
    make_leaves,
)
from pipeline.runtime.step_state import SavedForward, StepState
from pipeline.runtime.stream_scan import interleavable_pairs, last_backwards, pair_spans
from pipeline.runtime.trace import Trace
from pipeline.runtime.two_batch import declared_row_sums, join_halves, two_batch_forward
from pipeline.supervision.progress import ProgressRecord, StallError, explain_stall
from schedules import Instruction, Kind

_WEIGHT_GRADIENTS = frozenset({Kind.B, Kind.OVERLAP_B, Kind.W})
"""Instructions after which a stage's weight gradients of one microbatch are complete."""
_QUEUEING = frozenset({Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B, Kind.LOAD})
"""Instructions that queue messages (or only load local data); every other one first
launches what is queued (`Comm.flush`)."""

__all__ = ["InstructionFailed", "Interpreter", "StepState", "free_output_data", "last_backwards"]

_T = TypeVar("_T")
_now = time.perf_counter


class InstructionFailed(Exception):
    """Instruction `step` of a stream (`op`) raised; the cause is `__cause__`."""

    def __init__(self, step: int, op: Instruction) -> None:
        super().__init__(f"instruction {op} (step {step}) failed")
        self.step, self.op = step, op


class Interpreter:
    """Executes instruction streams on one rank: one handler per `Kind`."""

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

    def _local(self, stage: int) -> bool:
        return 0 <= stage <= self.last_stage and self.placement[stage] == self.pp_rank

    def _blocked(self, peer: int, what: str, wait: Callable[[], _T]) -> _T:
        """Run `wait` (blocked on data from pipeline rank `peer`); on a timeout, ask the other
        ranks what they do and say which one holds the pipeline up."""
        rank = self.comm.pipeline_ranks[peer]
        self.progress.wait_on(rank)
        try:
            result = wait()
        except RuntimeError as error:
            stall = explain_stall(self.progress.rank, list(self.comm.pipeline_ranks), rank)
            why = f"; {stall.explanation}" if stall.explanation else ""
            raise StallError(f"no data from pipeline rank {peer} (global rank {rank}) for "
                             f"{what}: {error}{why}", culprit=stall.culprit) from error
        self.progress.wait_on(None)
        return result

    def _wait(self, pending: PendingRecv, kind: Kind, stage: int,
              microbatch: int) -> list[torch.Tensor]:
        start = _now()
        tensors = self._blocked(pending.peer, f"{stage}{kind.value}{microbatch}", pending.wait)
        proven = self._witnesses[1].get((kind, stage, microbatch))
        if proven:  # the peer posted the receives of these sends: they are taken
            self.comm.release(proven)
        end = _now()
        self.trace.record(kind, stage, microbatch, start, end)
        self.state.recv_wait += end - start
        self.op_start = end
        return tensors

    # -- data ------------------------------------------------------------------------------

    def load(self, op: Instruction) -> None:
        state, i = self.state, op.microbatch
        if op.stage == 0:
            if state.microbatches is None:
                raise ValueError("this rank holds the first stage: pass the inputs to "
                                 "train_batch / eval_batch on it")
            state.inputs[(0, i)] = batch_to(state.microbatches[i], self.device)
        if op.stage == self.last_stage and state.training:
            if state.targets is None:
                raise ValueError("this rank holds the last stage: pass the targets to "
                                 "train_batch on it")
            state.loaded_targets[i] = batch_to(state.targets[i], self.device)

    # -- compute ---------------------------------------------------------------------------

    def _take_input(self, s: int, i: int) -> Batch:
        state = self.state
        if s == 0 or self._local(s - 1):
            return state.inputs.pop((s, i))
        pending, is_tuple = state.recv_f.pop((s, i))
        tensors = self._wait(pending, Kind.RECV_F, s, i)
        return tuple(tensors) if is_tuple else tensors[0]

    def forward(self, op: Instruction) -> None:
        s, i, state = op.stage, op.microbatch, self.state
        x = self._take_input(s, i)
        if not state.training:
            with torch.no_grad():
                out = self._run_stage(s, x)
                if s == self.last_stage and state.targets is not None and self.loss_fn:
                    state.losses.append(self._loss(self._loss_input(out),
                                                  batch_to(state.targets[i], self.device)))
            self._forward_done(s, i, out)
            return
        leaves: list[torch.Tensor] = []
        if s > 0:
            x, leaves = make_leaves(x)
        out, layer_grads = self._train_stage(s, x)
        state.finite.append((s, i, "output", all_finite(out)))
        if s == self.last_stage:
            loss = self._loss(self._loss_input(out), state.loaded_targets.pop(i))
            # a copy: on CPU a 0-d loss can be a view keeping its elementwise buffer alive
            state.losses.append(loss.detach().clone())
            state.finite.append((s, i, "loss", torch.isfinite(loss.detach()).all()))
            # mean over the full batch = mean of the m equal microbatches' means; fp16
            # scales it so small gradients survive the half-precision backward
            scale = self.loss_scale()
            root = loss / self.m if scale == 1.0 else loss * (scale / self.m)
            saved = SavedForward(leaves, [root], [], Layout(True, ()))
        else:
            floats = float_tensors(out)
            index = [k for k, t in enumerate(floats) if t.requires_grad]
            saved = SavedForward(leaves, [floats[k] for k in index], index,
                                 Layout.of(tuple(floats)))
            saved.held_outputs = hold_outputs(saved.roots)
            self._forward_done(s, i, out)
        saved.layer_grads = layer_grads
        state.saved[(s, i)] = saved
        state.peak_activations = max(state.peak_activations, len(state.saved))

    def _capture(self, s: int, x: Batch) -> tuple[Batch, LayerGrads | None]:
        """Stage `s`'s training forward, hooked for I and W when its backward is split."""
        if s not in self.split_stages:
            return self._run_stage(s, x), None
        with autocast(self.precision, self.device.type):
            return forward_capturing(self.stages[s], x)

    def _train_stage(self, s: int, x: Batch) -> tuple[Batch, LayerGrads | None]:
        """`_capture`, as two halves of the microbatch where two-batch overlap applies."""
        sums = self.two_batch.get(s)
        if sums is None:
            return self._capture(s, x)

        def join(a: tuple[Batch, LayerGrads | None], b: tuple[Batch, LayerGrads | None],
                 rows: tuple[int, int]) -> tuple[Batch, LayerGrads | None]:
            return (join_halves(a[0], b[0], rows, sums, f"stage {s}"),
                    LayerGrads.merged([a[1], b[1]]) if s in self.split_stages else None)
        # in an overlapped pair the halves run one after the other on the pair's forward
        # thread: its backward, of a forward run as halves too, hands over at each half's
        # all-to-all, and so does this forward (the pair's order, repeated, costs the same)
        done = two_batch_forward(lambda half: self._capture(s, half), x, sums, join,
                                 interleaved=not in_turns())
        if done is None:  # a microbatch of one row
            return self._capture(s, x)
        self.two_batch_handovers += done[1]
        return done[0]

    def _run_stage(self, s: int, x: Batch) -> Batch:
        with autocast(self.precision, self.device.type):
            return self.stages[s](x)

    def _loss_input(self, out: Any) -> Any:
        """The last stage's output as the loss sees it: fp32 under mixed precision (the loss
        and its softmax/reductions are computed in full precision, as Megatron does)."""
        if self.precision == "fp32":
            return out
        if isinstance(out, torch.Tensor):
            return out.float() if out.is_floating_point() else out
        return tuple(t.float() if t.is_floating_point() else t for t in out)

    def _loss(self, out: Any, target: Any) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("training needs a loss: PipelineModule(..., loss_fn=...)")
        loss = call_loss(self.loss_fn, out, target)
        if not self._loss_checked:  # once: a lambda's reduction="sum" is seen only by calling
            problem = summed_loss_problem(self.loss_fn, out, target, loss)
            if problem is not None:
                raise PipelineConfigError(problem)
            self._loss_checked = float(loss.detach()) != 0.0
        return loss

    def _forward_done(self, s: int, i: int, out: Batch) -> None:
        state = self.state
        if s == self.last_stage:
            state.outputs[i] = detach_batch(out)
        elif self._local(s + 1):
            state.inputs[(s + 1, i)] = detach_batch(out)
        else:
            state.send_f[(s, i)] = out

    def _root_grads(self, s: int, i: int, saved: SavedForward) -> list[torch.Tensor] | None:
        if s == self.last_stage:
            return None  # the loss is a scalar: d loss / d loss = 1
        if self._local(s + 1):
            grads = self.state.out_grads.pop((s, i))
        else:
            grads = self._wait(self.state.recv_b.pop((s, i)), Kind.RECV_B, s, i)
        return [grads[k] for k in saved.root_index]

    def _pass_input_grads(self, s: int, i: int, leaves: list[torch.Tensor]) -> None:
        if s == 0:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        if self._local(s - 1):
            self.state.out_grads[(s - 1, i)] = grads
        else:
            self.state.send_b[(s, i)] = grads

    def backward(self, op: Instruction) -> None:
        self._apply_backward(op, *self._backward_inputs(op))

    def _backward_inputs(self, op: Instruction
                         ) -> tuple[SavedForward, list[torch.Tensor] | None]:
        saved = self.state.saved.pop((op.stage, op.microbatch))
        return saved, self._root_grads(op.stage, op.microbatch, saved)

    def _apply_backward(self, op: Instruction, saved: SavedForward,
                        grads: list[torch.Tensor] | None) -> None:
        if saved.roots:
            torch.autograd.backward(saved.roots, grads)
        self._pass_input_grads(op.stage, op.microbatch, saved.leaves)

    def input_grad(self, op: Instruction) -> None:
        s, i = op.stage, op.microbatch
        saved = self.state.saved[(s, i)]
        grads = self._root_grads(s, i, saved)
        saved.root_grads = grads
        if saved.roots and saved.leaves:
            torch.autograd.backward(saved.roots, grads, inputs=saved.leaves, retain_graph=True)
        elif saved.roots and saved.layer_grads is not None:  # first stage: no input grad
            saved.layer_grads.backward_inputs(saved.roots, grads)
        self._pass_input_grads(s, i, saved.leaves)
        saved.leaves = []  # their gradients are sent; W needs only the roots

    def weight_grad(self, op: Instruction) -> None:
        s, i = op.stage, op.microbatch
        saved = self.state.saved.pop((s, i))
        if saved.layer_grads is not None and saved.layer_grads.complete():
            saved.layer_grads.backward_weights()
            return
        params = self.stage_params[s]  # I did not pass every layer (stage 0): one backward
        if saved.roots and params:
            torch.autograd.backward(saved.roots, saved.root_grads, inputs=params)

    # -- communication ---------------------------------------------------------------------

    def send_forward(self, op: Instruction) -> None:
        out = self.state.send_f.pop((op.stage, op.microbatch))
        tensors = as_tensors(out, "a stage's output")
        header = self.shapes.sending(op.stage + 1, Layout.of(out))
        self.comm.send(tensors, op.peer, header=header, tag=(op.kind, op.stage, op.microbatch))
        saved = self.state.saved.get((op.stage, op.microbatch))
        if self.free_sent_outputs and saved is not None:
            # the send holds the data until it completes; the roots keep only their nodes
            kept = [not free_output_data(root) for root in saved.roots]
            saved.held_outputs = [held for held, keep in zip(saved.held_outputs, kept)
                                  if keep]

    def recv_forward(self, op: Instruction) -> None:
        s = op.stage
        message = self.shapes.receiving(s, lambda: self._blocked(
            op.peer, f"the shape header of {op}", lambda: self.comm.recv_header(op.peer)))
        self.state.recv_f[(s, op.microbatch)] = (self.comm.recv(message, op.peer),
                                                 message.is_tuple)

    def send_backward(self, op: Instruction) -> None:
        grads = self.state.send_b.pop((op.stage, op.microbatch))
        self.comm.send(grads, op.peer, header=None, tag=(op.kind, op.stage, op.microbatch))

    def recv_backward(self, op: Instruction) -> None:
        key = (op.stage, op.microbatch)
        saved = self.state.saved.get(key)
        if saved is None:
            raise RuntimeError(f"RECV_B of {op.stage}B{op.microbatch} before its forward ran")
        self.state.recv_b[key] = self.comm.recv(saved.grad_layout, op.peer)

    # -- optimizer -------------------------------------------------------------------------

    def reduce_grad(self, op: Instruction) -> None:
        self.reducer.reduce_stage(op.stage, self.stage_params[op.stage])
        self.state.exposed_reduction += _now() - self.op_start

    def step(self, op: Instruction) -> None:
        self.reducer.wait()
        self.state.exposed_reduction += _now() - self.op_start
        # the last stage has every loss by now: their sum rides the vote's message, so the
        # loss costs no collective of its own
        self.state.loss_sum = self.loss_share(self.state)
        self.optimizer_step.vote(self.state.loss_sum)
        self.optimizer_step()

    def loss_share(self, state: StepState) -> torch.Tensor:
        """This rank's part of the step's loss sum over the world (float64, CPU, shape (1,)):
        the mean of its losses, or zero off the last stage and tensor-parallel rank 0."""
        share = torch.zeros(1, dtype=torch.float64)
        if state.losses and self.shares_loss:
            share += torch.stack(state.losses).sum().double().cpu() / self.m
        return share

