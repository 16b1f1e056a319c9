"""Batches and activations: split into microbatches, join back, describe by their `Layout`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from pipeline.errors import PipelineConfigError

__all__ = [
    "Batch",
    "Layout",
    "TensorLayout",
    "as_tensors",
    "batch_size",
    "describe",
    "join_microbatches",
    "split_microbatches",
]

Batch = torch.Tensor | tuple[torch.Tensor, ...]
"""What flows into and between stages: a tensor or a tuple of tensors."""

TensorLayout = tuple[tuple[int, ...], torch.dtype]
"""Shape and dtype of one tensor."""


class Layout(NamedTuple):
    """The layout of one message (an activation, its gradient, a batch): what a receiver
    must know to allocate it, and what a shape header carries."""

    is_tuple: bool
    """Whether the value is a tuple of tensors (else one tensor)."""
    tensors: tuple[TensorLayout, ...]
    """Shape and dtype of each tensor, in order."""

    @classmethod
    def of(cls, value: Batch, what: str = "value") -> Layout:
        """The layout of `value`; equal layouts mean equal messages."""
        return cls(not isinstance(value, torch.Tensor),
                   tuple((tuple(t.shape), t.dtype) for t in as_tensors(value, what)))


def as_tensors(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """`value` as a tuple of tensors (a lone tensor becomes a 1-tuple)."""
    items = (value,) if isinstance(value, torch.Tensor) else value
    if isinstance(value, Iterator):
        raise TypeError(f"{what} is an iterator ({type(value).__name__}): a DeepSpeed-style "
                        "data iterator goes in as train_batch(data_iter=it) / "
                        "eval_batch(data_iter=it) (or use pipeline.initialize, whose engine "
                        "takes train_batch(it) as DeepSpeed does)")
    if not isinstance(items, tuple | list) or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"{what} must be a tensor or a tuple of tensors, got "
                        f"{describe(value)}")
    return tuple(items)


def describe(value: Any) -> str:
    """A value's type for an error message (a sequence: its items' types)."""
    if isinstance(value, tuple | list):
        return f"{type(value).__name__} of ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def split_microbatches(batch: Any, num_microbatches: int, what: str) -> list[Any]:
    """Cut every tensor of `batch` along dim 0 into m equal microbatches (same structure)."""
    tensors = as_tensors(batch, what)
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(t.shape) for t in tensors]
        raise PipelineConfigError(f"every tensor of {what} needs the same batch size in dim 0; "
                                  f"got shapes {shapes}")
    size = int(next(iter(sizes)))  # type: ignore[arg-type]
    if size == 0:
        raise PipelineConfigError(f"{what} is an empty batch (0 samples, shapes "
                                  f"{[tuple(t.shape) for t in tensors]}); pass at least "
                                  f"num_microbatches={num_microbatches} samples")
    if size % num_microbatches:
        raise PipelineConfigError(
            f"{what} batch size {size} is not divisible by num_microbatches="
            f"{num_microbatches}; use a batch size that is a multiple of {num_microbatches} "
            "(so the mean loss over microbatches equals the full-batch mean)")
    parts = [t.chunk(num_microbatches) for t in tensors]
    if isinstance(batch, torch.Tensor):
        return list(parts[0])
    return [tuple(part[i] for part in parts) for i in range(num_microbatches)]


def batch_size(microbatches: Sequence[Any] | None) -> int:
    """Samples in these microbatches (dim 0 of each one's first tensor); 0 when unknown (no
    microbatches, or targets the loss takes in another form)."""
    if not microbatches:
        return 0
    total = 0
    for part in microbatches:
        items = (part,) if isinstance(part, torch.Tensor) else part
        if not isinstance(items, tuple | list) or not items or not isinstance(
                items[0], torch.Tensor) or items[0].dim() == 0:
            return 0
        total += int(items[0].shape[0])
    return total


def join_microbatches(outputs: Sequence[Any]) -> Any:
    """Concatenate per-microbatch outputs (tensors or tuples of tensors) along dim 0."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    return tuple(torch.cat([out[k] for out in outputs]) for k in range(len(first)))
