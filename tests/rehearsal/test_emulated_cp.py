"""Emulated cp attention on a virtual clock: the exposed message time of the ring (with and
without overlap) and of the all-gather attention equals `predict_exposed`'s closed form
exactly, at cp 2 and 4; a ring that waits each pass before its block (overlap planted away)
fails it. The costs' refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline.errors import PipelineConfigError
from pipeline.parallel.context import ring
from pipeline.parallel.context.gathered import gathered_attention
from pipeline.parallel.context.mask import PositionMask
from pipeline.parallel.context.sharding import gathered_positions, rank_positions
from pipeline.rehearsal.emulated_cp import EmulatedContextCosts, EmulatedContextOps, predict_exposed
from tests.support.rank_harness import run_ranks

__all__: list[str] = []

BATCH, HEADS, KV_HEADS, TOKENS, HEAD_DIM = 1, 4, 2, 8, 4
# a K/V pass (512 B) costs 1 + 5.12 ms; a block 4.1 ms forward, 10.2 ms backward
COSTS = EmulatedContextCosts(flop_seconds=1e-6, byte_seconds=1e-5, latency=1e-3)
FREE = EmulatedContextCosts(flop_seconds=1e-6, byte_seconds=0.0)


class VirtualClock:
    """Time that passes only by waiting: no host time, so a step lasts its nominal waits."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    def sleep_until(self, deadline: float, label: str) -> None:
        self.time = max(self.time, deadline)


def _step_seconds(costs: EmulatedContextCosts, attention: str, overlap: bool) -> float:
    """Virtual seconds of two attention calls' forward and backward on this rank."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    clock = VirtualClock()
    ops = EmulatedContextOps(costs, clock)
    length = TOKENS * cp
    mask = PositionMask(rank_positions(length, rank, cp)[None], gathered_positions(length, cp),
                        None, None)
    total = torch.zeros(())
    for _ in range(2):
        q, k, v = (torch.randn(BATCH, heads, TOKENS, HEAD_DIM, requires_grad=True)
                   for heads in (HEADS, KV_HEADS, KV_HEADS))
        out = ring.ring_attention(q, k, v, mask, dist.group.WORLD, 0.5, overlap=overlap,
                                  ops=ops) if attention == "ring" else \
            gathered_attention(q, k, v, mask, dist.group.WORLD, 0.5, ops)
        total = total + out.sum()
    total.backward()
    return clock.time


def _exposed_errors(rank: int, world: int, planted: bool) -> None:
    torch.set_num_threads(1)
    for attention, overlap in (("ring", True), ("ring", False), ("all-gather", False)):
        measured = _step_seconds(COSTS, attention, overlap) - \
            _step_seconds(FREE, attention, overlap)
        predicted = 2 * predict_exposed(COSTS, attention=attention,  # type: ignore[arg-type]
                                        overlap=overlap, cp=world, batch=BATCH, heads=HEADS,
                                        kv_heads=KV_HEADS, tokens=TOKENS, head_dim=HEAD_DIM)
        if planted and attention == "ring" and overlap:
            assert measured > predicted * 1.1, (measured, predicted)
        elif not planted:
            assert measured == pytest.approx(predicted, rel=1e-9), (attention, overlap)
    if not planted:  # the overlap hides something at these costs
        hidden = predict_exposed(COSTS, attention="ring", overlap=True, cp=world, batch=BATCH,
                                 heads=HEADS, kv_heads=KV_HEADS, tokens=TOKENS,
                                 head_dim=HEAD_DIM)
        assert hidden < predict_exposed(COSTS, attention="ring", overlap=False, cp=world,
                                        batch=BATCH, heads=HEADS, kv_heads=KV_HEADS,
                                        tokens=TOKENS, head_dim=HEAD_DIM)


def _planted(rank: int, world: int) -> None:
    """Planted bug: the ring's forward and backward wait each pass as soon as it starts, even
    when asked to overlap."""
    honest_apply = ring._RingAttention.apply

    def no_overlap(*args: object) -> torch.Tensor:
        *rest, _, ops = args
        return honest_apply(*rest, False, ops)  # type: ignore[no-any-return]

    ring._RingAttention.apply = no_overlap  # type: ignore[method-assign]
    try:
        _exposed_errors(rank, world, planted=True)
    finally:
        ring._RingAttention.apply = honest_apply  # type: ignore[method-assign]


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_exposed_cp_communication_equals_the_closed_form(cp: int) -> None:
    run_ranks(_exposed_errors, cp, False, timeout=300)


@pytest.mark.multiprocess
def test_a_ring_that_does_not_overlap_fails_the_prediction() -> None:
    run_ranks(_planted, 2, timeout=300)


@pytest.mark.parametrize("field", ["flop_seconds", "byte_seconds", "latency"])
def test_costs_refuse_a_negative_or_infinite_time(field: str) -> None:
    values = {"flop_seconds": 1.0, "byte_seconds": 1.0, field: -1.0}
    with pytest.raises(PipelineConfigError, match=f"emulated {field} must be a finite"):
        EmulatedContextCosts(**values)
    values[field] = float("inf")
    with pytest.raises(PipelineConfigError, match=f"emulated {field} must be a finite"):
        EmulatedContextCosts(**values)
