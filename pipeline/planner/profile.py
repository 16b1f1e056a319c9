"""What the planner knows of a model: per-layer FLOPs, kernel shapes or measured times,
parameters and activation bytes (priced on a cluster by `pipeline.planner.pricing`)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.limits import MAX_NUMBER
from pipeline.planner.errors import PlanError
from pipeline.planner.kernels import LayerShape
from pipeline.planner.node_limited import ExpertRouting

__all__ = ["LayerProfile", "ModelProfile", "profile_from_cost_json"]


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """One pipeline layer. "split" parts are divided over tensor-parallel ranks, "replicated"
    parts are held (or computed) whole on each of them."""

    name: str
    flops_split: float = 0.0
    """Forward FLOPs per sample of the layer's matmuls (split over tp)."""
    flops_replicated: float = 0.0
    params_split: float = 0.0
    """Parameters (a count) split over tp."""
    params_replicated: float = 0.0
    tied_params_split: float = 0.0
    """Parameters (a count, split over tp) of the model's first layer that this one re-uses
    (a tied output projection: the embedding's weight). Not its own, counted once in the
    model, but held again, with its gradient and optimizer state, where this layer's stage
    is on another rank than the first layer's, the two copies' gradients all-reduced once
    a step (Megatron-LM's `word_embeddings` on the last stage; the engine's
    `TiedLayerSpec`, `pipeline.parallel.tied_sync`)."""
    expert_params: float = 0.0
    """Parameters (a count) of the layer's routed experts: split over the ep ranks of an
    expert-parallel group (not over tp), their gradients reduced over dp / ep."""
    all_to_all_bytes: float = 0.0
    """Bytes per sample of one expert all-to-all (the dispatch of each token's hidden state
    to its k experts; the combine returns as many, the backward repeats both)."""
    held_split: float = 0.0
    """Bytes per sample the forward saves for the backward, split over tp."""
    held_replicated: float = 0.0
    output_bytes: float = 0.0
    """Bytes per sample of the layer's output (what crosses a stage boundary)."""
    input_bytes: float = 0.0
    """Bytes per sample of the layer's input: all a recomputed layer keeps."""
    input_split: bool = False
    """The input is split over tp (sequence parallelism): a recomputed layer keeps 1/t."""
    loss_held_split: float = 0.0
    """Of `held_split`, the bytes the loss saves from this layer's output (the last layer's
    fp32 softmax of the logits): the loss runs after the stage, outside any recomputation,
    so a recomputed layer keeps them too."""
    selective_held_split: float | None = None
    """Bytes per sample (split over tp) kept under selective recomputation, which redoes
    attention's core in the backward (replicated bytes unchanged); None: the layer has no
    such part, selective recomputation keeps all it holds."""
    selective_flops_split: float = 0.0
    """Forward FLOPs per sample (split over tp) selective recomputation redoes."""
    tp_allreduces: int = 0
    """All-reduces per pass (forward, and again backward) over the tp group (Megatron: 2)."""
    tp_allreduce_bytes: float = 0.0
    """Bytes per sample of each of those all-reduces."""
    forward_seconds: float | None = None
    """Measured forward seconds per sample; None prices the FLOPs on the cluster instead."""
    backward_seconds: float | None = None
    """Measured backward seconds per sample (input and weight gradients together)."""
    forward_fixed: float = 0.0
    """Measured seconds per forward call whatever the batch (dispatch, small kernels)."""
    backward_fixed: float = 0.0
    split_seconds: tuple[float, float] | None = None
    """Measured seconds per sample of a split backward's input-gradient (I) and weight-
    gradient (W) halves; None: half of the backward each."""
    split_fixed: tuple[float, float] = (0.0, 0.0)
    shape: LayerShape | None = None
    """The layer's kernel shapes, for the device model (`pipeline.planner.kernels`); None:
    priced by its FLOPs or its measured times."""
    checkpointed: bool = True
    """Full recomputation covers the layer (it keeps its input only and runs its forward
    again). False: the engine's checkpointing leaves it out, so it keeps what it holds and
    runs once (Megatron-LM 2021 checkpoints the transformer blocks only)."""

    def __post_init__(self) -> None:
        values = {**vars(self), "split_fixed": None, "split_seconds": None, "shape": None,
                  "selective_held_split": self.selective_held_split or 0.0,
                  "input_split": None, "checkpointed": None,
                  "split_0": (self.split_seconds or (0.0, 0.0))[0],
                  "split_1": (self.split_seconds or (0.0, 0.0))[1],
                  "split_fixed_0": self.split_fixed[0], "split_fixed_1": self.split_fixed[1]}
        bad = [f"{name}={value!r}" for name, value in values.items()
               if name != "name" and value is not None and (
                   isinstance(value, bool) or not isinstance(value, int | float)
                   or not math.isfinite(value) or value < 0)]
        if bad:
            raise PlanError(f"layer {self.name!r}: {', '.join(bad)} must be finite numbers >= 0")

    @property
    def measured(self) -> bool:
        return self.forward_seconds is not None

    def params(self, tp: int) -> float:
        """Parameters one tensor-parallel rank holds."""
        return self.params_split / tp + self.params_replicated

    def held(self, tp: int) -> float:
        """Activation bytes per sample one tp rank keeps for the backward."""
        return self.held_split / tp + self.held_replicated

    def kept_input(self, tp: int) -> float:
        """Bytes per sample one tp rank keeps of a fully recomputed layer: its input (and
        what the loss after it keeps); all it holds where the recomputation leaves it out
        (`checkpointed` False)."""
        if not self.checkpointed:
            return self.held(tp)
        kept = self.input_bytes / tp if self.input_split else self.input_bytes
        return kept + self.loss_held_split / tp

    def held_selective(self, tp: int) -> float:
        """Activation bytes per sample one tp rank keeps under selective recomputation."""
        if self.selective_held_split is None:
            return self.held(tp)
        return self.selective_held_split / tp + self.held_replicated


@dataclass(frozen=True)
class ModelProfile:
    """The pipeline layers in order, and what the search may vary."""

    layers: tuple[LayerProfile, ...]
    name: str = "model"
    heads: int | None = None
    """Attention heads (tp must divide them); None: the model cannot be tensor-split."""
    seq: int = 1
    """Tokens per sample (for tokens/s)."""
    tp_divides: tuple[tuple[str, int], ...] = ()
    """(what, size) a tensor-parallel size must divide besides the heads: a transformer's
    key/value heads and MLP width (Megatron-Core splits each evenly, `divide()` asserting
    it)."""
    experts: int = 0
    """Routed experts of each MoE layer (ep must divide them); 0: a dense model."""
    routing: ExpertRouting | None = None
    """How a MoE layer's tokens pick their experts (top-k, group limit), for the
    all-to-all's cross-node bytes (`node_limited.off_node_scale`); None: not known."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanError("a model needs at least one layer")

    @property
    def num_parameters(self) -> float:
        return sum(layer.params(1) + layer.expert_params for layer in self.layers)

    @property
    def flops_per_sample(self) -> float:
        """Forward FLOPs of one sample through the whole model."""
        return sum(layer.flops_split + layer.flops_replicated for layer in self.layers)

    def tp_refusals(self, tp: int) -> list[str]:
        """What `tp` does not divide ("attention heads 12", ...); [] when it splits."""
        sizes = (("attention heads", self.heads),) if self.heads is not None else ()
        return [f"{size} {what}" for what, size in dict(sizes + self.tp_divides).items()
                if size % tp]

    @property
    def tensor_parallel_ok(self) -> bool:
        return self.heads is not None and not any(layer.measured for layer in self.layers)

    @property
    def sequence_parallel(self) -> bool:
        """Its blocks run with sequence parallelism (norms, residuals and, in a MoE block,
        the tokens entering the expert all-to-all split over tp)."""
        return any(layer.shape is not None and layer.shape.sequence_parallel
                   for layer in self.layers)


def profile_from_cost_json(source: str | os.PathLike[str] | Mapping[str, Any], *,
                           cost_batch: int = 1) -> ModelProfile:
    """The partitioner's cost JSON (see partition/README.md) as a profile: times and
    activation bytes are for a microbatch of `cost_batch` samples, so they are divided by it;
    `params` are fp32 bytes; a layer's `activation` (its output) is what it holds."""
    from partition import graph_from_json

    if isinstance(cost_batch, bool) or not isinstance(cost_batch, int) or cost_batch < 1:
        raise PlanError(f"cost_batch={cost_batch!r} must be a whole number >= 1")
    graph = graph_from_json(source)
    layers = []
    previous = 0.0
    for index, cost in enumerate(graph.layers):
        for field in ("forward", "backward", "params", "activation"):
            if getattr(cost, field) > MAX_NUMBER:  # 1e300 s printed a 300-digit plan
                raise PlanError(f"layer {index} ({cost.name}) of the cost file has {field} "
                                f"{getattr(cost, field):g}, over {MAX_NUMBER:g}: give seconds "
                                "and bytes of one layer")
        per_sample = cost.activation / cost_batch
        layers.append(LayerProfile(
            name=cost.name, params_replicated=cost.params / 4, held_replicated=per_sample,
            output_bytes=per_sample, input_bytes=previous,
            forward_seconds=cost.forward / cost_batch,
            backward_seconds=cost.backward / cost_batch))
        previous = per_sample
    label = os.fspath(source) if not isinstance(source, Mapping) else "costs"
    return ModelProfile(tuple(layers), name=os.path.basename(label))

