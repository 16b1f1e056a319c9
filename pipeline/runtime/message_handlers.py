"""The interpreter's message and optimizer handlers: SEND/RECV, REDUCE_GRAD and STEP."""

from __future__ import annotations

import time

import torch

from pipeline.runtime.batch import Layout, as_tensors
from pipeline.runtime.interpreter_base import InterpreterBase
from pipeline.runtime.stage_tensors import free_output_data
from pipeline.runtime.step_state import StepState
from schedules import Instruction

__all__ = ["MessageHandlers"]

_now = time.perf_counter


class MessageHandlers(InterpreterBase):
    """SEND_F/RECV_F/SEND_B/RECV_B through `Comm`, then the step's reduction and STEP."""

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
