"""The attention kernels and cp messages the context-parallel attentions run, behind one seam.

Legend: b batch, a / g query / key-value heads, n this rank's tokens, m a key block's tokens,
d head dimension; `allowed` is a boolean (b or 1, 1, n, m) mask (`mask.context_mask`).

`attend` returns a block's output and its per-row log-sum-exp (b, a, n), which ring
attention merges by an online softmax; `attend_backward` is that block's share of the
gradients given the *final* output and log-sum-exp (the flash-attention backward: with the
whole row's statistics a block's probabilities are exact, so its dQ, dK, dV are its exact
share). A row the block allows nothing gets log-sum-exp `MASKED`, which merges with weight
0. On CPU both are the fused SDPA kernel's own pair (``_scaled_dot_product_flash_attention_
for_cpu`` and its ``_backward``); elsewhere the same arithmetic in plain torch (the scores of
one block at a time). `TorchContextOps` is the real seam; `pipeline.rehearsal.emulated_cp`
times the same calls as an accelerator would take them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.tensor.sequence import start_all_gather, start_reduce_scatter

__all__ = ["MASKED", "SEQUENCE_DIM", "ContextParallelOps", "Pending", "TorchContextOps"]

MASKED = -1e30
"""The log-sum-exp of a row a block allows nothing: finite, so merging two such rows gives no
−inf − (−inf) = NaN, and a real block later outweighs it by e^(MASKED − lse) = 0."""
SEQUENCE_DIM = 2
"""(batch, heads, tokens, head_dim): the dimension the sequence is gathered and passed along."""


class Pending(Protocol):
    """A launched message: `wait` blocks until it is done and returns what arrived."""

    def wait(self) -> list[torch.Tensor]: ...


class ContextParallelOps(Protocol):
    """What a context-parallel attention computes and sends (see the module docstring)."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend_backward(self, grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        allowed: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def start_pass(self, tensors: Sequence[torch.Tensor], group: ProcessGroup) -> Pending: ...

    def start_gather(self, tensor: torch.Tensor, group: ProcessGroup | None) -> Pending: ...

    def start_reduce_scatter(self, tensor: torch.Tensor, group: ProcessGroup | None
                             ) -> Pending: ...


class _Done:
    def __init__(self, tensors: list[torch.Tensor], works: Sequence[object] = ()) -> None:
        self._tensors, self._works = tensors, list(works)

    def wait(self) -> list[torch.Tensor]:
        for work in self._works:
            work.wait()  # type: ignore[attr-defined]
        self._works = []
        return self._tensors


class _Collective:
    def __init__(self, pending: object) -> None:
        self._pending = pending

    def wait(self) -> list[torch.Tensor]:
        return [self._pending.wait()]  # type: ignore[attr-defined]


def _repeat(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _fold(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `_repeat`: each key/value head's query-head group summed."""
    batch, heads, *rest = tensor.shape
    return tensor.reshape(batch, kv_heads, heads // kv_heads, *rest).sum(dim=2)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, float("-inf"))


class TorchContextOps:
    """The real kernels and gloo/NCCL messages. `fused`: the fused CPU kernel pair on CPU
    tensors (False: the plain-torch arithmetic everywhere, as on other devices)."""

    def __init__(self, fused: bool = True) -> None:
        self.fused = fused

    def _fused(self, query: torch.Tensor) -> bool:
        return self.fused and query.device.type == "cpu"

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        nothing = ~allowed.any(dim=-1)  # (b or 1, 1, n): rows this block allows nothing
        if self._fused(query):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, False, attn_mask=_additive(allowed, query.dtype),
                scale=scale)
            return out, lse.masked_fill(nothing, MASKED)
        heads = query.shape[1]
        scores = (query @ _repeat(key, heads).transpose(-1, -2) * scale).masked_fill(
            ~allowed, MASKED)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse[..., None]) @ _repeat(value, heads)
        return out.masked_fill(nothing[..., None], 0.0), lse.masked_fill(nothing, MASKED)

    def attend_backward(self, grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        allowed: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        grad = grad.contiguous()
        if self._fused(query):
            grad_query, grad_key, grad_value = \
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad, query, key, value, out, lse, 0.0, False,
                    attn_mask=_additive(allowed, query.dtype), scale=scale)
            return grad_query, grad_key, grad_value
        heads, kv_heads = query.shape[1], key.shape[1]
        keys, values = _repeat(key, heads), _repeat(value, heads)
        scores = (query @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, MASKED)
        probabilities = torch.exp(scores - lse[..., None])  # this block's share of the row
        grad_probabilities = grad @ values.transpose(-1, -2)
        row = (grad * out).sum(dim=-1, keepdim=True)  # D = rowsum(dO ∘ O)
        grad_scores = probabilities * (grad_probabilities - row) * scale
        return (grad_scores @ keys, _fold(grad_scores.transpose(-1, -2) @ query, kv_heads),
                _fold(probabilities.transpose(-1, -2) @ grad, kv_heads))

    def start_pass(self, tensors: Sequence[torch.Tensor], group: ProcessGroup) -> Pending:
        """Send `tensors` to the next cp rank, receive the previous one's (all at once)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        to = dist.get_global_rank(group, (rank + 1) % size)
        source = dist.get_global_rank(group, (rank - 1) % size)
        sent = [tensor.contiguous() for tensor in tensors]
        received = [torch.empty_like(tensor) for tensor in sent]
        ops = [dist.P2POp(dist.isend, tensor, to, group) for tensor in sent] + \
              [dist.P2POp(dist.irecv, tensor, source, group) for tensor in received]
        return _Done(received, dist.batch_isend_irecv(ops))

    def start_gather(self, tensor: torch.Tensor, group: ProcessGroup | None) -> Pending:
        """All-gather of every cp rank's `tensor` along the sequence (rank order)."""
        return _Collective(start_all_gather(tensor, group, SEQUENCE_DIM))

    def start_reduce_scatter(self, tensor: torch.Tensor, group: ProcessGroup | None
                             ) -> Pending:
        """The sum over cp ranks of `tensor`, each keeping its part of the sequence."""
        return _Collective(start_reduce_scatter(tensor, group, SEQUENCE_DIM))
