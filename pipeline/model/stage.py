"""`Stage`: the consecutive layers of one pipeline stage, run (and recomputed) as one."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.errors import PipelineLayerError
from pipeline.model.layer_rng import (
    ForwardKey,
    call_seeded,
    current_forward_key,
    layer_seed,
)
from pipeline.model.recompute import ForwardOnce, RecomputePolicy, selective_recompute

__all__ = ["Stage", "run_layer"]


class Stage(nn.Module):
    """The consecutive layers of one pipeline stage; the value between layers is passed as is
    (a tensor or a tuple of tensors), as in DeepSpeed's `PipelineModule`.

    With ``checkpoint_interval = k > 0`` every run of k layers is an activation checkpoint:
    only its input is kept, and its forward is recomputed during the backward; a
    `RecomputePolicy` (`recompute`, which then replaces the interval) also offers selective
    recomputation and limiting either to the first layers of the stage. With a
    `base_seed`, inside the engine's `forward_key` each layer draws from its own seeded
    stream (`pipeline.model.layer_rng`), the recompute included. With `clone_input`, a
    received input (a leaf that requires grad) is cloned first, so a first layer that writes
    into its input (``ReLU(inplace=True)``) works as in a single process.
    """

    def __init__(self, index: int, first_layer: int, layers: Sequence[nn.Module],
                 checkpoint_interval: int = 0, base_seed: int | None = None,
                 clone_input: bool = False, *, recompute: RecomputePolicy | None = None
                 ) -> None:
        super().__init__()
        self.index = index
        self.first_layer = first_layer
        # keyed by global layer index, so parameter names do not depend on the partition
        self.layers = nn.ModuleDict({str(first_layer + k): layer for k, layer in enumerate(layers)})
        self.recompute = recompute or RecomputePolicy.of("none", None, checkpoint_interval)
        """What this stage recomputes in its backward."""
        self.checkpoint_interval = self.recompute.interval if self.recompute.mode == "full" \
            else 0
        """Layers per checkpoint segment when whole layers are recomputed, else 0."""
        self.base_seed = base_seed
        self.clone_input = clone_input

    def prepare_input(self, x: Any) -> Any:
        """The stage input as its first layer may use it (cloned when `clone_input`)."""
        return _clone_leaves(x) if self.clone_input else x

    def forward(self, x: Any) -> Any:
        x = self.prepare_input(x)
        # read once, here: a checkpointed segment gets it as an argument, so the recompute
        # during the backward (outside this forward's key) reseeds exactly as the forward did
        key = current_forward_key()
        layers = [(int(name), layer) for name, layer in self.layers.items()]
        policy = self.recompute
        if policy.mode == "none" or not torch.is_grad_enabled():
            return self._run(layers, x, key)
        # partial recomputation: the policy covers the first `count` layers, the rest keep
        # everything (the last layers' activations are the first the backward needs)
        count = policy.recomputed(len(layers))
        head, tail = layers[:count], layers[count:]
        if policy.mode == "selective":
            with selective_recompute(True):
                x = self._run(head, x, key)
            return self._run(tail, x, key)
        for start in range(0, count, policy.interval):
            segment = head[start:start + policy.interval]
            x = checkpoint(ForwardOnce(self._run, [layer for _, layer in segment]), segment,
                           x, key, use_reentrant=False)
        return self._run(tail, x, key)

    def _run(self, layers: Sequence[tuple[int, nn.Module]], x: Any, key: ForwardKey | None
             ) -> Any:
        for index, layer in layers:
            x = self.call_layer(index, layer, x, key)
        return x

    def call_layer(self, index: int, layer: nn.Module, x: Any, key: ForwardKey | None) -> Any:
        """Global layer `index`'s forward; under a key (and a `base_seed`) its random draws
        come from `layer_seed(base_seed, index, key.step, key.microbatch)`. An error becomes a
        `PipelineLayerError` naming the layer."""
        if key is None or self.base_seed is None:
            return run_layer(index, layer, x)
        seed = layer_seed(self.base_seed, index, key.step, key.microbatch)
        return call_seeded(seed, key.device, functools.partial(run_layer, index, layer), x)


def _clone_leaves(x: Any) -> Any:
    """Leaves that require grad (a received activation) cloned; anything else as is."""
    def clone(t: Any) -> Any:
        return t.clone() if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad \
            else t
    return clone(x) if isinstance(x, torch.Tensor) else type(x)(clone(t) for t in x)


_IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"


def run_layer(index: int, layer: nn.Module, x: Any) -> Any:
    """``layer(x)``; an error becomes a `PipelineLayerError` naming global layer `index`."""
    try:
        return layer(x)
    except PipelineLayerError:
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError) as error:
        # (not every Exception: torch's checkpoint recomputation stops by raising its own)
        fix = ("pass PipelineModule(..., clone_stage_inputs=True) so received activations "
               "are cloned" if _IN_PLACE_ON_LEAF in str(error) else
               "check the inputs given to the pipeline" if index == 0 else
               f"check that layer {index - 1}'s output is what layer {index} takes")
        raise PipelineLayerError(
            f"layer {index} ({type(layer).__name__}) failed: {type(error).__name__}: "
            f"{error}; {fix}", layer=index) from error
