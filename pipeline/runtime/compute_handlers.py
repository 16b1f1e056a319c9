"""The interpreter's compute handlers: LOAD, F (with the loss), B, I and W of one stage."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.errors import PipelineConfigError
from pipeline.moe.interleave import in_turns
from pipeline.parallel.precision import autocast
from pipeline.runtime.batch import Batch, Layout
from pipeline.runtime.finite import all_finite
from pipeline.runtime.interpreter_base import InterpreterBase
from pipeline.runtime.loss_call import call_loss
from pipeline.runtime.loss_probe import summed_loss_problem
from pipeline.runtime.saved_memory import hold_outputs
from pipeline.runtime.split_backward import LayerGrads, forward_capturing
from pipeline.runtime.stage_tensors import batch_to, detach_batch, float_tensors, make_leaves
from pipeline.runtime.step_state import SavedForward
from pipeline.runtime.two_batch import join_halves, two_batch_forward
from schedules import Instruction, Kind

__all__ = ["ComputeHandlers"]


class ComputeHandlers(InterpreterBase):
    """LOAD, F, B (and an overlapped pair's B), I and W on this rank's stages."""

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
