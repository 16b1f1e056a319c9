"""Stage inputs and outputs as the interpreter handles them: their floating tensors, detached
copies, fresh leaves for a stage's backward, and a sent output's data freed."""

from __future__ import annotations

import torch

from pipeline.runtime.batch import Batch, as_tensors

__all__ = ["batch_to", "detach_batch", "float_tensors", "free_output_data", "make_leaves"]


def float_tensors(value: Batch) -> list[torch.Tensor]:
    return [t for t in as_tensors(value, "a stage's output") if t.is_floating_point()]


def detach_batch(value: Batch) -> Batch:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return tuple(t.detach() for t in value)


def free_output_data(tensor: torch.Tensor) -> bool:
    """Swap a sent stage output's data for a one-element placeholder of the same shape (a
    stride-0 view), keeping its autograd node: the backward needs only the node and the
    incoming gradient (Megatron's `deallocate_output_tensor`). The bytes go once the send
    holding the data completes. A view or a leaf keeps its data (freeing it would free
    nothing, or would break the leaf's own gradient); returns whether the data was swapped.
    """
    if tensor._base is not None or tensor.grad_fn is None or tensor.numel() <= 1:
        return False
    tensor.data = torch.empty((), dtype=tensor.dtype, device=tensor.device).expand(
        tensor.shape)
    return True


def make_leaves(value: Batch) -> tuple[Batch, list[torch.Tensor]]:
    """Detached copy of `value` whose floating tensors require grad, and those tensors."""
    tensors = [t.detach().requires_grad_(True) if t.is_floating_point() else t
               for t in as_tensors(value, "a stage's input")]
    leaves = [t for t in tensors if t.requires_grad]
    return (tensors[0] if isinstance(value, torch.Tensor) else tuple(tensors)), leaves


def batch_to(value: Batch, device: torch.device) -> Batch:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return tuple(t.to(device, non_blocking=True) for t in value)
