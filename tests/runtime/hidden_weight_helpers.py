"""Layers that hide trainable weights from `PipelineModule`'s build check, one per hiding
place (test helper: a module of its own, so one case is an attribute of an imported module)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["NORM", "ClassAttributeBlock", "ClassAttributeCallable", "SlotsCallable",
           "TensorAttributeBlock"]

NORM = nn.LayerNorm(4)
"""Reached as ``hidden_weight_helpers.NORM`` by a lambda in the test module."""


class ClassAttributeBlock(nn.Module):
    """A module whose weights live on its class: shared by instances, registered by none."""

    proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class ClassAttributeCallable:
    """A plain callable whose module is a class attribute."""

    norm = nn.LayerNorm(4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class SlotsCallable:
    """A callable with __slots__ (no __dict__) holding a module."""

    __slots__ = ("proj",)

    def __init__(self) -> None:
        self.proj = nn.Linear(4, 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class TensorAttributeBlock(nn.Module):
    """A module holding a plain tensor with requires_grad=True instead of an nn.Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(4, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale
