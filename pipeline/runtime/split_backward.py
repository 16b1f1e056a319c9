"""Split backward without recomputation: I keeps each layer's output gradient, W uses it.

Zero-bubble schedules run a stage's backward as I (gradient of the stage input) and, later,
W (gradients of the weights). Differentiating the stage output again in W would redo the
whole input-gradient chain. Instead, the forward hooks every parameterised layer's output;
I, which must pass through those outputs to reach the stage input, leaves dL/dy_l in the
hooks; W then differentiates each layer alone, y_l -> θ_l, which touches only that layer's
weight-gradient ops (for a Linear, g^T x and nothing else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipeline.model.layer_rng import current_forward_key
from pipeline.model.module import Stage
from pipeline.model.recompute import selective_recompute
from pipeline.runtime.batch import as_tensors

__all__ = ["LayerGrads", "forward_capturing"]


class LayerGrads:
    """Each parameterised layer's outputs, their captured gradients, and its parameters."""

    def __init__(self) -> None:
        self.layers: list[tuple[list[nn.Parameter], list[torch.Tensor],
                                list[torch.Tensor | None]]] = []
        self.starts = [0]
        """Where each forward's layers begin in `layers` (two for a two-batch forward's
        halves, `merged`)."""

    @classmethod
    def merged(cls, parts: Sequence[LayerGrads | None]) -> LayerGrads | None:
        """One microbatch's captures from the forwards of its parts (the halves of a
        two-batch forward, `pipeline.moe.two_batch`); None if a part captured nothing."""
        whole = cls()
        whole.starts = []
        for part in parts:
            if part is None:
                return None
            whole.starts += [len(whole.layers) + start for start in part.starts]
            whole.layers += part.layers
        return whole

    def watch(self, layer: nn.Module, output: Any) -> None:
        """Hook the floating outputs of `layer` that require grad (none: nothing to do)."""
        params = [p for p in layer.parameters() if p.requires_grad]
        outputs = [t for t in as_tensors(output, "a layer's output")
                   if t.is_floating_point() and t.requires_grad]
        if not params or not outputs:
            return
        grads: list[torch.Tensor | None] = [None] * len(outputs)
        for k, tensor in enumerate(outputs):
            tensor.register_hook(_store(grads, k))
        self.layers.append((params, outputs, grads))

    def complete(self) -> bool:
        """True when I delivered every hooked gradient (else W must start from the roots)."""
        return all(g is not None for _, _, grads in self.layers for g in grads)

    def backward_inputs(self, roots: list[torch.Tensor],
                        grads: list[torch.Tensor] | None) -> None:
        """I on a stage with no input to differentiate (the first): carry the gradient down
        to the first hooked layer's outputs, leaving every layer's output gradient for W
        (else W would run the whole input-gradient chain itself)."""
        firsts = [self.layers[k] for k in sorted(set(self.starts)) if k < len(self.layers)]
        if not firsts:
            return
        outputs = [t for _, tensors, _ in firsts for t in tensors]
        found = iter(torch.autograd.grad(roots, outputs, grads, retain_graph=True,
                                         allow_unused=True))
        for _, tensors, first in firsts:  # each forward's (each half's) first hooked layer
            for k in range(len(tensors)):
                grad = next(found)
                if grad is not None:
                    first[k] = grad

    def backward_weights(self) -> None:
        """W: accumulate every layer's weight gradients from its captured output gradient."""
        layers, self.layers = self.layers, []
        for params, outputs, grads in reversed(layers):
            torch.autograd.backward(outputs, grads, inputs=params)


def _store(grads: list[torch.Tensor | None], k: int) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        grads[k] = grad
    return hook


def forward_capturing(stage: Stage, x: Any) -> tuple[Any, LayerGrads | None]:
    """Run `stage` layer by layer, hooking outputs for a split backward; with activation
    checkpointing (whole layers) the layer outputs do not exist outside the checkpoints, so
    plain forward."""
    if stage.checkpoint_interval > 0:
        return stage(x), None
    captured = LayerGrads()
    x = stage.prepare_input(x)
    key = current_forward_key()
    policy = stage.recompute  # selective recomputation of the first layers, as in forward
    selected = policy.recomputed(len(stage.layers)) if policy.mode == "selective" else 0
    for position, (index, layer) in enumerate(stage.layers.items()):
        with selective_recompute(position < selected):
            x = stage.call_layer(int(index), layer, x, key)  # seeded as `Stage.forward` does
        captured.watch(layer, x)
    return x, captured
