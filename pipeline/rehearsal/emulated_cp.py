"""Emulated context-parallel devices: the cp attentions' kernels and messages as timed waits.

`EmulatedContextOps` is a `pipeline.parallel.context.ops.ContextParallelOps`: each attention
block computes its (small) result, then waits its nominal time on the device queue
(`emulated.WallClock`); each message (a ring pass, an all-gather, a reduce-scatter) is a
timed wait on the link, which carries one message at a time and starts one when the device
has issued it and the link is free; its `wait` returns at the message's nominal end. What
arrives is a stand-in of the right shape made from this rank's tensors (no bytes move; the
cp ranks are symmetric, so each rank's timing is the group's), as
`emulated_tp.EmulatedTensorParallelOps` does for tp: time with it, never train.

Costs (`EmulatedContextCosts`), for a block of n queries against m keys, a query heads of
size d and batch b: the forward 4·b·a·n·m·d FLOPs (q kᵀ and p v), the backward 2.5 times
that (five such GEMMs: the scores again, dV, dP, dQ, dK); a ring pass the bytes it sends, an
all-gather (cp−1) times its input, a reduce-scatter (cp−1)/cp of its input, at
`byte_seconds` a byte, each message paying `latency` once. `predict_exposed` is what of the
messages these waits leave exposed, from the same costs in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.context.ops import SEQUENCE_DIM, Pending, TorchContextOps
from pipeline.rehearsal.emulated import WALL_CLOCK, Clock, check_nonnegative_seconds

__all__ = ["EmulatedContextCosts", "EmulatedContextOps", "predict_exposed"]

BACKWARD_FACTOR = 2.5
"""A block's backward FLOPs over its forward's (five GEMMs of the forward's two's size)."""


@dataclass(frozen=True, kw_only=True)
class EmulatedContextCosts:
    """Nominal seconds of the emulated attention blocks and messages."""

    flop_seconds: float
    """Seconds per FLOP of an attention block."""
    byte_seconds: float
    """Seconds per byte through a rank's link."""
    latency: float = 0.0
    """Seconds every message pays once."""

    def __post_init__(self) -> None:
        check_nonnegative_seconds(self, ("flop_seconds", "byte_seconds", "latency"))

    def attend(self, batch: int, heads: int, queries: int, keys: int, head_dim: int,
               backward: bool = False) -> float:
        """Seconds of one block's forward (or backward)."""
        flops = 4.0 * batch * heads * queries * keys * head_dim
        return flops * (BACKWARD_FACTOR if backward else 1.0) * self.flop_seconds

    def message(self, nbytes: float) -> float:
        """Seconds of a message putting `nbytes` through the link."""
        return self.latency + nbytes * self.byte_seconds


class _Timed:
    """A message's stand-in result, handed out no earlier than its nominal end."""

    def __init__(self, tensors: list[torch.Tensor], deadline: float, clock: Clock) -> None:
        self._tensors, self._deadline, self._clock = tensors, deadline, clock

    def wait(self) -> list[torch.Tensor]:
        self._clock.sleep_until(max(self._deadline, self._clock.now()), "cp-wait")
        return self._tensors


def _size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class EmulatedContextOps(TorchContextOps):
    """Blocks and messages that cost `costs`' nominal times (the module docstring)."""

    def __init__(self, costs: EmulatedContextCosts, clock: Clock = WALL_CLOCK) -> None:
        super().__init__(fused=True)
        self.costs, self.clock = costs, clock
        self._link_free = -math.inf

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               allowed: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.clock.now()
        result = super().attend(query, key, value, allowed, scale)
        batch, heads, queries, head_dim = query.shape
        self.clock.sleep_until(start + self.costs.attend(
            batch, heads, queries, key.shape[SEQUENCE_DIM], head_dim), "attend")
        return result

    def attend_backward(self, grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                        allowed: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start = self.clock.now()
        result = super().attend_backward(grad, query, key, value, out, lse, allowed, scale)
        batch, heads, queries, head_dim = query.shape
        self.clock.sleep_until(start + self.costs.attend(
            batch, heads, queries, key.shape[SEQUENCE_DIM], head_dim, backward=True),
            "attend-backward")
        return result

    def _send(self, stand_ins: list[torch.Tensor], nbytes: float) -> Pending:
        issued = self.clock.now()
        self._link_free = max(issued, self._link_free) + self.costs.message(nbytes)
        return _Timed(stand_ins, self._link_free, self.clock)

    def start_pass(self, tensors: Sequence[torch.Tensor], group: ProcessGroup) -> Pending:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self._send([t.clone() for t in tensors], nbytes)

    def start_gather(self, tensor: torch.Tensor, group: ProcessGroup | None) -> Pending:
        cp = _size(group)
        if cp == 1:
            return _Timed([tensor], -math.inf, self.clock)
        return self._send([torch.cat([tensor] * cp, SEQUENCE_DIM)],
                          (cp - 1) * tensor.numel() * tensor.element_size())

    def start_reduce_scatter(self, tensor: torch.Tensor, group: ProcessGroup | None
                             ) -> Pending:
        cp = _size(group)
        if cp == 1:
            return _Timed([tensor], -math.inf, self.clock)
        part = tensor.narrow(SEQUENCE_DIM, 0, tensor.shape[SEQUENCE_DIM] // cp).clone()
        return self._send([part], (cp - 1) / cp * tensor.numel() * tensor.element_size())


def predict_exposed(costs: EmulatedContextCosts, *, attention: Literal["all-gather", "ring"],
                    overlap: bool, cp: int, batch: int, heads: int, kv_heads: int,
                    tokens: int, head_dim: int, element: int = 4) -> float:
    """Exposed message seconds of one cp attention call's forward and backward on a rank
    holding `tokens` of the sequence (n), from `costs` in closed form:

    - ring: cp − 1 passes of the K/V block (2·b·g·n·d elements) each way; overlapped, a
      pass is exposed by what it exceeds its step's block (forward, or backward) by, else
      whole; then the reduce-scatters of the K and V gradients (cp·n tokens each), exposed;
    - all-gather: K and V gathered in the forward and again in the backward, the
      gradients reduce-scattered, all exposed (`overlap` does not apply)."""
    if cp == 1:
        return 0.0
    block = batch * kv_heads * tokens * head_dim * element  # one of K or V, one rank's
    scatter = 2 * costs.message((cp - 1) / cp * cp * block)
    if attention == "all-gather":
        return 4 * costs.message((cp - 1) * block) + scatter
    passing = costs.message(2 * block)
    forward = costs.attend(batch, heads, tokens, tokens, head_dim)
    backward = costs.attend(batch, heads, tokens, tokens, head_dim, backward=True)
    if overlap:
        steps = max(passing - forward, 0.0) + max(passing - backward, 0.0)
    else:
        steps = 2 * passing
    return (cp - 1) * steps + scatter
