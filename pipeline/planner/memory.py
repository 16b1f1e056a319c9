"""Memory per rank: parameters, gradients, optimizer state (ZeRO-1 sharded), and the
activations held at the schedule's peak under each recomputation mode (none, selective,
full, or full on the first k layers of each stage).

The bytes per parameter are `schedules.analysis.accounting.model_state_bytes` (the one
accounting the simulator and `rehearse` use too): fp32 parameters and gradients, even
under bf16/fp16 autocast, and Adam's two fp32 moments, 4 + 4 + 8 = 16 bytes, the "16Ψ"
of Rajbhandari et al. 2020 (ZeRO, section 3.1); ZeRO-1 shards the optimizer state over dp
(8 + 8/dp, Megatron's distributed optimizer).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from pipeline.planner.profile import LayerProfile
from schedules.analysis.accounting import (
    HeldTrace,
    ParameterBytes,
    expert_state_bytes,
    held_peaks,
    model_state_bytes,
)
from schedules.analysis.accounting import stage_activation_bytes as accounting_stage_bytes

__all__ = ["PARAM_BYTES", "HeldTrace", "MemoryBreakdown", "RankStates", "held_peaks",
           "peak_rank_memory", "rank_states", "recompute_workspace", "stage_activation_bytes"]

PARAM_BYTES = model_state_bytes("fp32").parameters
"""fp32 weights."""
GRAD_BYTES = model_state_bytes("fp32").gradients
"""fp32 gradients, accumulated over the step's microbatches."""
ADAM_BYTES = model_state_bytes("fp32").optimizer
"""Adam's exp_avg and exp_avg_sq in fp32."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds at its peak."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    runtime: float = 0.0
    """What the runtime holds besides tensors: NCCL's buffers, cuBLAS workspaces and the
    cluster's margin (`runtime_memory.runtime_bytes`)."""

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.runtime)

    def to_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations,
                "runtime": self.runtime, "total": self.total}


def _recomputed(layers: Sequence[LayerProfile], recompute: str, recompute_layers: int
                ) -> int:
    """How many of a stage's first layers `recompute` applies to (0 for none; k for
    partial recomputation, every layer when k is 0)."""
    if recompute == "none":
        return 0
    return len(layers) if recompute_layers <= 0 else min(recompute_layers, len(layers))


def stage_activation_bytes(layers: Sequence[LayerProfile], tp: int, batch: int,
                           recompute: str | bool, recompute_layers: int = 0) -> float:
    """Bytes one microbatch of `batch` samples leaves on a stage between its forward and its
    backward, `schedules.analysis.accounting.stage_activation_bytes` of the per-layer sizes:
    the first `recompute_layers` layers (0: all) recomputed "full" keep their input only
    (Korthikanti et al. 2022, section 4.3: 2sbh per layer at 16 bits), "selective" keep all
    but attention's core (34sbh), the rest everything. A bool is "full" / "none"."""
    mode = _mode(recompute)
    kept = [layer.held(tp) for layer in layers]
    recomputed = ([layer.kept_input(tp) for layer in layers] if mode == "full" else
                  [layer.held_selective(tp) for layer in layers])
    return batch * accounting_stage_bytes(kept, recomputed,
                                          _recomputed(layers, mode, recompute_layers))


def recompute_workspace(layers: Sequence[LayerProfile], tp: int, batch: int,
                        recompute: str | bool = "full", recompute_layers: int = 0) -> float:
    """While a recomputed layer runs its backward, what it dropped is alive again, once per
    rank: the largest recomputed layer's activations (full), or its attention core's
    (selective)."""
    mode = _mode(recompute)
    k = _recomputed(layers, mode, recompute_layers)
    if mode == "selective":
        return batch * max((layer.held(tp) - layer.held_selective(tp)
                            for layer in layers[:k]), default=0.0)
    # what the loss keeps of the last layer is never dropped (`LayerProfile.loss_held_split`);
    # a layer the checkpointing leaves out drops nothing
    return batch * max((layer.held(tp) - layer.loss_held_split / tp for layer in layers[:k]
                        if layer.checkpointed), default=0.0)


@functools.lru_cache(maxsize=1024)
def _state_bytes(zero: int, dp: int) -> ParameterBytes:
    """This engine's fp32 model-state bytes per parameter (asked once per ZeRO stage and dp
    of a search, not per configuration)."""
    return model_state_bytes("fp32", zero_stage=zero, data_parallel=dp)


def _mode(recompute: str | bool) -> str:
    if isinstance(recompute, bool):
        return "full" if recompute else "none"
    return recompute


def peak_rank_memory(stage_params: ArrayLike, rank_activations: ArrayLike,
                     stage_workspace: ArrayLike, placement: Sequence[int], *, dp: int,
                     zero: int, recompute: bool, extra_gradient_bytes: float = 0.0,
                     step_gradient_bytes: float = 0.0,
                     stage_gradient_bytes: ArrayLike | None = None,
                     state_bytes: tuple[float, float, float] | None = None,
                     stage_expert_params: ArrayLike | None = None, expert_parallel: int = 1,
                     expert_replicas: int = 1, runtime: ArrayLike | None = None
                     ) -> tuple[MemoryBreakdown, int]:
    """Memory of the pipeline rank holding the most, and that rank.

    `stage_params`: parameters one tp rank holds, per stage; `rank_activations`: the
    activation bytes each rank holds at its peak (`HeldTrace.peak_bytes`);
    `stage_workspace`: the recomputation workspace per stage (`recompute_workspace`, added
    when `recompute`); rank
    r holds the stages `placement` puts on it.

    Model states per parameter from `schedules.analysis.accounting.model_state_bytes`: 16 bytes
    without ZeRO, 8 + 8/dp with ZeRO-1 (Megatron's distributed optimizer: gradients in one
    buffer, Adam's moments on a 1/dp shard that is a view of the fp32 parameters), 4 + 12/dp
    with ZeRO-2, 16/dp with ZeRO-3 (a gathered layer is transient, not priced here).

    Another engine's gradient bytes per parameter beyond these: `extra_gradient_bytes` held
    through the step, `step_gradient_bytes` only at its optimizer step, when no activation
    is left (Megatron-LM 2021's fp32 copies of the gradients): a rank's peak is then the
    larger of its schedule's peak and its step's.
    `stage_gradient_bytes`: per stage, gradient bytes held through the step besides these
    (this engine's second gradient of a tied weight under ZeRO-1, `tied.py`).
    `state_bytes`: another engine's (parameter, gradient, optimizer) bytes per parameter
    instead, the optimizer's sharded over dp under ZeRO-1 (Megatron-Core's distributed
    optimizer: bf16 weights 2, fp32 gradients 4, fp32 master weights and Adam 12).
    `runtime`: per rank, bytes the runtime holds besides tensors, through the step too
    (`runtime_memory.runtime_bytes`; None: none).
    """
    activations = np.asarray(rank_activations, dtype=float)
    ranks = len(activations)
    workspace = np.zeros(ranks)
    if isinstance(placement, range) and placement == range(ranks):
        workspace = np.maximum(workspace, np.asarray(stage_workspace, dtype=float))
    else:
        np.maximum.at(workspace, np.asarray(placement),
                      np.asarray(stage_workspace, dtype=float))
    states = rank_states(stage_params, placement, ranks, dp=dp, zero=zero,
                         extra_gradient_bytes=extra_gradient_bytes,
                         step_gradient_bytes=step_gradient_bytes,
                         stage_gradient_bytes=stage_gradient_bytes, state_bytes=state_bytes,
                         stage_expert_params=stage_expert_params,
                         expert_parallel=expert_parallel, expert_replicas=expert_replicas,
                         runtime=runtime)
    return states.peak(activations + (workspace if recompute else 0.0))


@dataclass(frozen=True)
class RankStates:
    """Per pipeline rank, the model states `peak_rank_memory` adds to the held activations:
    while the schedule runs (`during`) and at the optimizer step (`at_step`), and what a
    rank's breakdown is made of. Kept, they price the held activations of many
    configurations that differ in nothing else (the search's floors, one per microbatch
    size) with a few array operations each, the same ones in the same order."""

    params: np.ndarray
    during: np.ndarray
    """Bytes held besides the activations while the schedule runs."""
    at_step: np.ndarray
    """Bytes held at the optimizer step, when no activation is left."""
    per_parameter: tuple[float, float, float]
    """Parameter, gradient and optimizer bytes per parameter of a dense stage."""
    step_gradient_bytes: float
    more: np.ndarray | None = None
    """Per rank, gradient bytes held through the step besides these (None: the dense path,
    no such bytes and no experts)."""
    experts: np.ndarray | None = None
    expert_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    expert_parallel: int = 1
    runtime: np.ndarray | None = None
    """Per rank, the runtime's bytes (`runtime_memory.runtime_bytes`), in `during` and
    `at_step` too (None: none)."""

    def peak(self, held: np.ndarray) -> tuple[MemoryBreakdown, int]:
        """The rank holding the most with `held` activation bytes per rank, and its memory."""
        during = self.during + held
        rank = int(np.maximum(during, self.at_step).argmax())
        return MemoryBreakdown(*self._parts(rank, float(during[rank]), float(held[rank]))), rank

    def peak_rows(self, held: np.ndarray) -> list[tuple[int, float, float]]:
        """For each row of `held` (one set of held activations per row), what `peak` finds
        with the same element-wise operations, all rows at once: the rank holding the most,
        the bytes it holds while the schedule runs, and its activations (`total_at`)."""
        during = self.during + held
        ranks = np.maximum(during, self.at_step).argmax(axis=1)
        rows = np.arange(len(held))
        return list(zip(ranks.tolist(), during[rows, ranks].tolist(),
                        held[rows, ranks].tolist(), strict=True))

    def total_at(self, rank: int, during: float, held: float) -> float:
        """`peak(held)[0].total` from what `peak_rows` finds of one row of `held`."""
        parameters, gradients, optimizer, activations, runtime = self._parts(rank, during, held)
        return parameters + gradients + optimizer + activations + runtime

    def _parts(self, rank: int, during: float, held: float
               ) -> tuple[float, float, float, float, float]:
        """Parameters, gradients, optimizer state, activations and the runtime's bytes of
        `rank`, which holds `during` bytes while the schedule runs, `held` of them
        activations."""
        runtime = 0.0 if self.runtime is None else float(self.runtime[rank])
        parameters, gradients, optimizer = self.per_parameter
        activations, step_bytes = held, 0.0
        if self.at_step[rank] > during:  # the optimizer step's peak: no activations left
            gradients, activations = gradients + self.step_gradient_bytes, 0.0
            step_bytes = self.step_gradient_bytes / self.expert_parallel
        params = float(self.params[rank])
        if self.more is None or self.experts is None:
            return (params * parameters, params * gradients, params * optimizer, activations,
                    runtime)
        mine, (own, grads, optimizers) = float(self.experts[rank]), self.expert_bytes
        return (params * parameters + mine * own,
                params * gradients + float(self.more[rank]) + mine * (grads + step_bytes),
                params * optimizer + mine * optimizers, activations, runtime)


def rank_states(stage_params: ArrayLike, placement: Sequence[int], ranks: int, *, dp: int,
                zero: int, extra_gradient_bytes: float = 0.0, step_gradient_bytes: float = 0.0,
                stage_gradient_bytes: ArrayLike | None = None,
                state_bytes: tuple[float, float, float] | None = None,
                stage_expert_params: ArrayLike | None = None, expert_parallel: int = 1,
                expert_replicas: int = 1, runtime: ArrayLike | None = None) -> RankStates:
    """The model states of `peak_rank_memory`'s ranks (its arguments but the activations),
    to price held activations against (`RankStates.peak`). `expert_replicas`: the tp ranks
    of a replica holding the same experts (expert tensor parallelism 1), over which with
    the dp / ep replicas ZeRO-1 shards the experts' optimizer state. `runtime`: per rank,
    the runtime's bytes, held while the schedule runs and at the step alike."""
    extra = None if runtime is None else np.asarray(runtime, dtype=float)
    per_parameter = _bytes_per_parameter(dp=dp, zero=zero, state_bytes=state_bytes,
                                         extra_gradient_bytes=extra_gradient_bytes)
    parameters, gradients, optimizer = per_parameter
    # one stage per rank in order (the search's memory floor): the sums below are the
    # values themselves, skipped; without experts and per-stage gradient bytes, so are the
    # terms they add (x + 0.0 and 0.0 · y leave every finite value as it is; a test compares
    # the two paths)
    own = isinstance(placement, range) and placement == range(ranks)
    if own and stage_expert_params is None and stage_gradient_bytes is None:
        params = np.asarray(stage_params, dtype=float)
        during = params * (parameters + gradients + optimizer)
        at_step = params * (parameters + gradients + step_gradient_bytes + optimizer)
        if extra is not None:
            during, at_step = during + extra, at_step + extra
        return RankStates(params, during, at_step, per_parameter, step_gradient_bytes,
                          runtime=extra)
    where = np.asarray(placement)
    params = np.asarray(stage_params, dtype=float) if own else np.bincount(
        where, weights=np.asarray(stage_params, dtype=float), minlength=ranks)
    experts, expert_bytes = _expert_states(where, ranks, stage_expert_params, expert_parallel,
                                           dp=dp * expert_replicas, zero=zero,
                                           state_bytes=state_bytes,
                                           extra_gradient_bytes=extra_gradient_bytes)
    more = np.zeros(ranks) if stage_gradient_bytes is None else (
        np.asarray(stage_gradient_bytes, dtype=float) if own else np.bincount(
            where, weights=np.asarray(stage_gradient_bytes, dtype=float), minlength=ranks))
    expert_states = experts * expert_bytes.sum()
    during = params * (parameters + gradients + optimizer) + expert_states + more
    at_step = params * (parameters + gradients + step_gradient_bytes + optimizer) \
        + expert_states + experts * step_gradient_bytes / expert_parallel + more
    if extra is not None:
        during, at_step = during + extra, at_step + extra
    own_bytes, gradient_bytes, optimizer_bytes = (float(x) for x in expert_bytes)
    return RankStates(params, during, at_step, per_parameter, step_gradient_bytes, more,
                      experts, (own_bytes, gradient_bytes, optimizer_bytes), expert_parallel,
                      extra)


def _bytes_per_parameter(*, dp: int, zero: int, state_bytes: tuple[float, float, float] | None,
                         extra_gradient_bytes: float) -> tuple[float, float, float]:
    """Parameter, gradient and optimizer bytes per parameter of a dense stage: the engine's
    (`_state_bytes`: ZeRO-1 shards the optimizer's over dp, ZeRO-2 also the gradients,
    ZeRO-3 also the parameters) or the given `state_bytes`, ZeRO-1 sharding the
    optimizer's over dp."""
    states = _state_bytes(zero, dp)  # ZeRO-2 shards the gradients too, ZeRO-3 the weights
    parameters, gradients, optimizer = states.parameters, states.gradients, states.optimizer
    if state_bytes is not None:
        parameters, gradients, optimizer = state_bytes
        optimizer = optimizer / dp if zero else optimizer
    return parameters, gradients + extra_gradient_bytes, optimizer


def _expert_states(where: np.ndarray, ranks: int, stage_expert_params: ArrayLike | None,
                   expert_parallel: int, *, dp: int, zero: int,
                   state_bytes: tuple[float, float, float] | None,
                   extra_gradient_bytes: float) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the routed experts' parameters of its stages (all E), and the (parameter,
    gradient, optimizer) bytes a rank holds per such parameter: 1/ep of each, the optimizer
    state sharded over dp / ep under ZeRO-1 (`expert_state_bytes`); another engine's
    `state_bytes` split and sharded alike. Zeros for a dense model."""
    if stage_expert_params is None:
        return np.zeros(ranks), np.zeros(3)
    experts = np.bincount(where, weights=np.asarray(stage_expert_params, dtype=float),
                          minlength=ranks)
    if state_bytes is not None:
        expert_bytes = np.array(state_bytes) / expert_parallel
        expert_bytes[2] *= expert_parallel / dp if zero else 1.0
        return experts, expert_bytes
    own = expert_state_bytes("fp32", expert_parallel=expert_parallel, data_parallel=dp,
                             zero_stage=zero)
    return experts, np.array([own.parameters,
                              own.gradients + extra_gradient_bytes / expert_parallel,
                              own.optimizer])
