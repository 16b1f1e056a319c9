"""The cp attention mask as global positions (O(S) to keep), made dense only while it is used."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["PositionMask", "context_mask"]


def context_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                 padding: torch.Tensor | None = None, window: int | None = None
                 ) -> torch.Tensor:
    """Boolean mask (batch, 1, queries, keys), True where a query may attend to a key:
    causal on global positions, within `window` (Mistral / Qwen2's sliding window: the
    query's position minus the key's below it), and not onto padding (`padding`: the whole
    sequence's 0/1 attention mask). A row allowed nothing (a padding query before any real
    token) attends everywhere instead of producing NaN; it feeds no real token's loss."""
    query = query_positions.reshape(-1, query_positions.shape[-1])[:, None, :, None]
    key = key_positions.reshape(1, 1, 1, -1)
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    if padding is not None:
        allowed = allowed & padding.bool()[:, key_positions][:, None, None, :]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


@dataclasses.dataclass(frozen=True)
class PositionMask:
    """What `context_mask` needs, handed to the attention in place of its dense mask: this
    rank's query positions, the gathered keys' positions, the whole sequence's padding mask
    (or None) and the sliding window (or None). A backward keeps these (`tensors`), not the
    dense (queries × keys) mask, and rebuilds it (`dense`)."""

    queries: torch.Tensor | None
    keys: torch.Tensor | None
    padding: torch.Tensor | None
    window: int | None

    def dense(self) -> torch.Tensor:
        """`context_mask` of these positions."""
        if self.queries is None or self.keys is None:
            raise ValueError("this PositionMask had its tensors taken out (without_tensors); "
                             "put them back with with_tensors before dense()")
        return context_mask(self.queries, self.keys, self.padding, self.window)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Its tensors, for ``ctx.save_for_backward`` (the padding only when there is one)."""
        assert self.queries is not None and self.keys is not None
        return (self.queries, self.keys, *(() if self.padding is None else (self.padding,)))

    def without_tensors(self) -> PositionMask:
        """Its non-tensor part (the window), kept on an autograd ctx beside `tensors`."""
        return PositionMask(None, None, None, self.window)

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> PositionMask:
        """`without_tensors`'s result made whole again from `tensors`'s saved tensors."""
        queries, keys, *padding = tensors
        return PositionMask(queries, keys, padding[0] if padding else None, self.window)
