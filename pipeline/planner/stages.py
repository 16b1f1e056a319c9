"""Per-stage sums of a partition: memory per sample, and each microbatch size's times priced
once, so the search prices any configuration with a few array operations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import numpy as np

from partition import LayerCost, ModelGraph, chain_graph
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.memory import recompute_workspace, stage_activation_bytes
from pipeline.planner.pricing import (
    layer_selective_seconds,
    layer_split_times,
    layer_times,
    layer_tp_pass_seconds,
)
from pipeline.planner.profile import LayerProfile

__all__ = ["LayerPrices", "StageCosts", "StageTable", "block_span", "cost_graph",
           "uniform_boundaries"]


def block_span(layers: Sequence[LayerProfile]) -> tuple[int, int]:
    """(first, end) of the repeated transformer blocks among `layers`: the layers between a
    leading embedding and a trailing head (by their kernel shape's role); all of them when
    the layers carry no shapes (measured or cost-file layers)."""
    roles = [layer.shape.role if layer.shape is not None else "block" for layer in layers]
    blocks = [index for index, role in enumerate(roles) if role == "block"]
    if not blocks:
        return 0, len(layers)
    return blocks[0], blocks[-1] + 1


def uniform_boundaries(layers: Sequence[LayerProfile], stages: int) -> tuple[int, ...] | None:
    """Megatron-LM's split of `layers` into `stages`: the blocks divided evenly, the layers
    before them (the embedding) on the first stage, those after (final norm, LM head, loss)
    on the last (`ParallelTransformer`: num_layers // pipeline size per stage, asserted to
    divide; the interleaved schedule's chunks likewise). None when the blocks do not divide."""
    first, end = block_span(layers)
    blocks = end - first
    if stages < 1 or blocks % stages:
        return None
    per_stage = blocks // stages
    inner = [first + per_stage * index for index in range(1, stages)]
    return (0, *inner, len(layers))


def cost_graph(layers: Sequence[LayerProfile], cluster: ClusterSpec, precision: str, tp: int,
               again: bool, tp_overlap: str = "none") -> ModelGraph:
    """The chain of one-sample layer costs the exact partitioner cuts (compute only: every
    cut carries the same hidden-state bytes); `again`: each backward runs its forward again
    (full recomputation). Layers of one shape are priced once."""
    costs = []
    priced: dict[object, tuple[float, float]] = {}  # identical blocks priced once
    for layer in layers:
        same = layer.shape if layer.shape is not None else id(layer)
        if same not in priced:
            priced[same] = layer_times(layer, cluster, precision, 1, tp, tp_overlap)
        forward, backward = priced[same]
        costs.append(LayerCost(layer.name, forward=forward,
                               backward=backward + (forward if again else 0.0)))
    return chain_graph(costs)


@dataclass
class LayerPrices:
    """Prices the tables of one search at one tp size and recomputation mode share: each
    layer kind's per microbatch size, and each stage's sums, kept per the kinds it runs
    (a partition's stages mostly repeat a few). A kind is the first of the layers of one
    shape (a model's identical blocks, priced once), or a layer without a shape itself."""

    layers: tuple[LayerProfile, ...]
    kinds: tuple[int, ...]
    """Per layer, its kind: the index of the first layer of its shape."""
    same: tuple[int, ...]
    """Per layer, the index of the first layer equal to it but for its name."""
    runs: list[tuple[int, ...]] = field(default_factory=list)
    """The kinds of each run of layers numbered so far (`compositions`)."""
    _numbers: dict[tuple[int, ...], int] = field(default_factory=dict)
    _compositions: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], ...]] = field(
        default_factory=dict)
    _layer: dict[tuple[int, int], tuple[float, ...]] = field(default_factory=dict)
    _sums: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    _again: dict[tuple[int, int], float] = field(default_factory=dict)
    _sizes: dict[tuple[Any, ...], tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, layers: Sequence[LayerProfile], like: LayerPrices | None = None
           ) -> LayerPrices:
        """Empty prices of `layers`, their kinds taken from `like` (of the same layers)."""
        if like is not None and like.layers == tuple(layers):
            return cls(like.layers, like.kinds, like.same)
        shapes: dict[object, int] = {}
        kinds = tuple(shapes.setdefault(layer.shape if layer.shape is not None else
                                        (index,), index) for index, layer in enumerate(layers))
        equal: dict[LayerProfile, int] = {}
        same = tuple(equal.setdefault(replace(layer, name=""), index)
                     for index, layer in enumerate(layers))
        return cls(tuple(layers), kinds, same)

    def compositions(self, boundaries: tuple[int, ...], recompute_layers: int
                     ) -> tuple[tuple[int, ...], ...]:
        """Per stage of the cuts `boundaries`: the number of the kinds it runs (`runs`), and
        of those of its first `recompute_layers` layers (all when 0); stages that run the
        same kinds get the same numbers."""
        key = (boundaries, recompute_layers)
        if key not in self._compositions:
            stages = [self.kinds[a:b] for a, b in pairwise(boundaries)]
            k = recompute_layers
            self._compositions[key] = (
                tuple(self._number(kinds) for kinds in stages),
                tuple(self._number(kinds[:k or len(kinds)]) for kinds in stages))
        return self._compositions[key]

    def _number(self, kinds: tuple[int, ...]) -> int:
        if kinds not in self._numbers:
            self._numbers[kinds] = len(self.runs)
            self.runs.append(kinds)
        return self._numbers[kinds]

    def stage_sizes(self, stage: Sequence[LayerProfile], same: tuple[int, ...], tp: int,
                    recompute: str, recompute_layers: int) -> tuple[float, ...]:
        """A stage's parameters, tied parameters, held and workspace bytes per sample,
        output bytes per sample, experts' parameters, all-to-all bytes per sample and MoE
        layers (`StageTable`'s columns), once per run of equal layers (`same`)."""
        key = (same, tp, recompute, recompute_layers)
        if key not in self._sizes:
            mode = (recompute, recompute_layers)
            self._sizes[key] = (
                sum(layer.params(tp) for layer in stage),
                sum(layer.tied_params_split / tp for layer in stage),
                stage_activation_bytes(stage, tp, 1, *mode),
                recompute_workspace(stage, tp, 1, *mode), stage[-1].output_bytes,
                sum(layer.expert_params for layer in stage),
                sum(layer.all_to_all_bytes for layer in stage),
                sum(layer.all_to_all_bytes > 0 for layer in stage))
        return self._sizes[key]


@dataclass(frozen=True)
class StageCosts:
    """Per-stage seconds of one microbatch: forward, input gradient, weight gradient, and
    the tensor-parallel and recomputation shares inside them; boundary bytes."""

    forward: np.ndarray
    input_grad: np.ndarray
    weight_grad: np.ndarray
    tp_comm: np.ndarray
    recompute: np.ndarray
    boundary_bytes: np.ndarray
    cp_comm: np.ndarray | None = None
    """Context parallelism's K/V all-gathers and reduce-scatters inside the ops (None: cp 1)."""

    @property
    def total(self) -> np.ndarray:
        return self.forward + self.input_grad + self.weight_grad


@dataclass(frozen=True)
class StageTable:
    """One partition's stages at one tp size and recomputation mode.

    Memory is linear in the microbatch size b (per-sample bytes); times are not (kernels
    run in tile waves, every kernel and message has a fixed cost), so each b's stage times
    are priced once, when first asked for, and kept.
    """

    boundaries: tuple[int, ...]
    params: np.ndarray
    """Parameters one tp rank holds, per stage."""
    tied: np.ndarray
    """Parameters one tp rank holds, per stage, as its own copy of the first layer's tied
    weight (`LayerProfile.tied_params_split`), where the stage is not on the first stage's
    rank (`tied.stage_params` adds them there)."""
    held: np.ndarray
    """Activation bytes per sample a microbatch leaves between forward and backward."""
    workspace: np.ndarray
    """Recomputation workspace per sample (the stage's largest layer's activations)."""
    boundary: np.ndarray
    """Bytes per sample of each stage's output."""
    recompute: str
    """none, selective or full (`pipeline.model.recompute.RecomputeMode`)."""
    recompute_layers: int
    """The first k layers of each stage are recomputed (partial); 0: all of them."""
    stages: tuple[tuple[LayerProfile, ...], ...]
    cluster: ClusterSpec
    precision: str
    tp: int
    tp_overlap: str = "none"
    """The engine's rule for hiding tensor-parallel collectives (`pricing.TP_OVERLAPS`)."""
    experts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Routed experts' parameters per stage (all E of each MoE layer: ep splits them)."""
    all_to_all: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Bytes per sample of one all-to-all, summed over each stage's MoE layers."""
    moe_layers: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """MoE layers per stage (each pays its all-to-alls' latency)."""
    prices: LayerPrices | None = field(default=None, compare=False, repr=False)
    """The layer prices this table shares with others of its tp size and recomputation mode
    (`LayerPrices`, made for it alone when not given)."""
    cp: int = 1
    """Context parallelism (`context_parallel.context_table` makes a table with cp > 1)."""
    cp_bytes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    """Per stage: bytes per sample of its layers' gathered K/V (whole sequence), and how
    many attention layers gather them (`context_parallel.context_table`)."""
    cp_again: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    """The same of the layers recomputed whole (they gather again)."""
    cp_stride: int = 1
    """Ranks between cp neighbours (tp)."""
    cp_attention: str = "all-gather"
    """How cp attention moves K/V (`SearchOptions.cp_attention`): this engine's
    "all-gather" (`context_parallel.context_costs`), or Megatron-Core's --cp-comm-type:
    "ring" (p2p, overlapped with the attention, `context_ring`), "a2a" or "kv-allgather",
    all three priced by `context_comm.comm_costs`."""
    grad_sum: np.ndarray | None = None
    """Per stage, seconds an engine's per-microbatch sum of the MoE gradients over tp adds
    to the op computing them (W, or B fused), exposed, a tp collective
    (`expert_grad_sync.tp_gradient_sum_seconds`); None: none (Megatron-Core's rule)."""
    _priced: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict, compare=False)

    @classmethod
    def build(cls, layers: Sequence[LayerProfile], boundaries: Sequence[int],
              cluster: ClusterSpec, precision: str, tp: int, recompute: str,
              recompute_layers: int = 0, tp_overlap: str = "none",
              prices: LayerPrices | None = None) -> StageTable:
        """The table of `layers` cut at `boundaries`; `prices` shared with the other tables
        of this tp size and recomputation mode on these layers, if given."""
        stages = tuple(tuple(layers[a:b]) for a, b in pairwise(boundaries))
        prices = prices if prices is not None else LayerPrices.of(layers)
        rows = [prices.stage_sizes(stage, prices.same[a:b], tp, recompute, recompute_layers)
                for stage, (a, b) in zip(stages, pairwise(boundaries), strict=True)]
        params, tied, held, workspace, boundary, experts, all_to_all, moe_layers = (
            np.array(column) for column in zip(*rows, strict=True))
        return cls(
            prices=prices, boundaries=tuple(boundaries), params=params, tied=tied, held=held,
            workspace=workspace, boundary=boundary, recompute=recompute,
            recompute_layers=recompute_layers, stages=stages, cluster=cluster,
            precision=precision, tp=tp, tp_overlap=tp_overlap, experts=experts,
            all_to_all=all_to_all, moe_layers=moe_layers)

    def _price(self, batch: int) -> tuple[np.ndarray, ...]:
        """Per stage at `batch` samples: forward, backward, I, W, tp collectives (both
        passes), each F, B, I or W paying the runtime's fixed cost once, and the seconds
        recomputation adds (the recomputed layers' forwards, or their attention cores).
        Layers of one shape (a model's identical blocks) are priced once, and stages of the
        same kinds of layers summed once (`LayerPrices`)."""
        if batch not in self._priced:
            assert self.prices is not None
            prices, layers = self.prices, self.prices.layers

            def price(kind: int) -> tuple[float, ...]:
                key = (kind, batch)
                if key not in prices._layer:
                    layer = layers[kind]
                    args = (self.cluster, self.precision, batch, self.tp)
                    times = layer_times(layer, *args, self.tp_overlap)
                    comm = layer_tp_pass_seconds(layer, self.cluster, self.precision, batch,
                                                 self.tp, self.tp_overlap)
                    # a recomputed forward's collectives are exposed again (Megatron's
                    # recomputation reruns the layer, its all-gathers included); a layer the
                    # engine's checkpointing leaves out runs once
                    again = {"none": 0.0, "full": times[0] if layer.checkpointed else 0.0,
                             "selective": layer_selective_seconds(layer, *args)}
                    prices._layer[key] = (*times,
                                          *layer_split_times(layer, *args, self.tp_overlap),
                                          sum(comm), again[self.recompute])
                return prices._layer[key]

            def stage_sums(run: int) -> np.ndarray:
                key = (run, batch)
                if key not in prices._sums:
                    prices._sums[key] = np.sum([price(kind)[:5] for kind in prices.runs[run]],
                                               axis=0)
                return prices._sums[key]

            def stage_again(run: int) -> float:
                key = (run, batch)
                if key not in prices._again:
                    prices._again[key] = sum(price(kind)[5] for kind in prices.runs[run])
                return prices._again[key]

            overhead = self.cluster.op_overhead  # the runtime's fixed cost, once per op
            stages, recomputed = prices.compositions(self.boundaries, self.recompute_layers)
            # context parallelism: each of cp ranks runs 1/cp of every layer's work (causal
            # load balancing), each op still paying the fixed cost once
            sums = np.array([stage_sums(run) for run in stages]) / self.cp
            again = np.array([stage_again(run) for run in recomputed]) / self.cp
            sums[:, :4] += overhead
            if self.recompute != "none":  # the recomputation is one more forward op
                again += overhead
            self._priced[batch] = (*sums.T, again)
        return self._priced[batch]

    def costs(self, batch: int, split: bool = False) -> StageCosts:
        """Seconds of one microbatch of `batch` samples on every stage. A fused backward is
        given as two halves (the simulator adds them for B); a `split` one as its own I and
        W (profiled layers measure them: the runtime's W may cost more than half a
        backward). Recomputation runs the forward again before the input gradient."""
        forward, backward, input_grad, weight_grad, comm, recompute = self._price(batch)
        if not split:
            input_grad, weight_grad = backward / 2, backward / 2
        costs = StageCosts(forward, input_grad + recompute, weight_grad, comm, recompute,
                           self.boundary * batch)
        if self.cp > 1:
            from pipeline.planner.context_comm import comm_costs
            from pipeline.planner.context_parallel import context_costs

            costs = (context_costs if self.cp_attention == "all-gather" else comm_costs)(
                self, costs, batch)
        if self.grad_sum is None:
            return costs
        return replace(costs, weight_grad=costs.weight_grad + self.grad_sum,
                       tp_comm=costs.tp_comm + self.grad_sum)
