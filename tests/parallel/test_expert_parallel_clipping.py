"""Gradient clipping and overlapped parameter gathers with expert parallelism: tiny Mixtral
at ep = 2 steps as single-process HF with torch's clip_grad_norm_; planted norms that miss
or double-count gradients fail."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

from pipeline.errors import PipelineConfigError
from pipeline.parallel import expert_clipping
from pipeline.parallel.config import ParallelConfig
from pipeline.parallel.expert_reduction import split_expert_parameters
from pipeline.parallel.expert_zero import _ExpertShards
from tests.support.rank_harness import run_ranks

pytest.importorskip("transformers")

CLIP = 0.05
TOLERANCE = 1e-5


def _within(found: dict[str, Any]) -> bool:
    return all(found[k] <= TOLERANCE for k in ("loss", "grad", "param", "norm"))


def _experts_on_every_replica(params: Sequence[nn.Parameter], dp_rank: int, ep: int,
                              tp_rank: int) -> list[torch.Tensor]:
    """Planted bug: expert shards counted on every replica holding them (dp / ep times)."""
    dense, experts = split_expert_parameters(params)
    counted = (dense if dp_rank == 0 else []) + experts
    return [p.grad for p in counted if p.grad is not None]


def _no_expert_pieces(self: Any, tp_rank: int) -> Iterator[torch.Tensor]:
    """Planted bug (ZeRO-1): the expert half's shards left out of the norm."""
    del self, tp_rank
    return iter(())


@contextmanager
def _planted(target: Any, name: str, replacement: Any) -> Iterator[None]:
    saved = getattr(target, name)
    setattr(target, name, replacement)
    try:
        yield
    finally:
        setattr(target, name, saved)


def _check(rank: int, world_size: int) -> None:
    from tests.support.hf_moe_equivalence import moe_step_differences

    torch.set_num_threads(1)
    # pp 2 × dp 2, ep 2: dense counted once over the two stages, experts once over ep
    found = moe_step_differences("mixtral", pp=2, dp=2, ep=2, clip=CLIP)
    assert found["clipped"] and _within(found), found
    # dp 4, ep 2, ZeRO-1 with overlapped parameter gathers: the second step's forwards wait
    # for the first step's dense and expert gathers (each over its own group); clipped too
    found = moe_step_differences("mixtral", pp=1, dp=4, ep=2, zero=True, clip=CLIP, steps=2,
                                 overlap_param_gather=True)
    assert found["clipped"] and _within(found), found
    with _planted(expert_clipping, "expert_norm_pieces", _experts_on_every_replica):
        found = moe_step_differences("mixtral", pp=1, dp=4, ep=2, clip=CLIP)
    assert found["norm"] > TOLERANCE and not _within(found), found
    with _planted(_ExpertShards, "_norm_pieces", _no_expert_pieces):
        found = moe_step_differences("mixtral", pp=1, dp=4, ep=2, zero=True, clip=CLIP)
    assert found["norm"] > TOLERANCE and not _within(found), found


@pytest.mark.multiprocess
@pytest.mark.slow
def test_clipped_expert_parallel_steps_equal_hf_with_clip_grad_norm() -> None:
    """Tiny Mixtral with gradient_clipping at ep 2: pp 2 × dp 2 without ZeRO, and dp 4 with
    ZeRO-1 and overlap_param_gather over two steps: the norm before clipping, the loss,
    every clipped gradient and the weights within 1e-5 of HF's with torch's clip_grad_norm_
    (the clip binds); norms counting the experts on every replica holding them, or (ZeRO-1)
    leaving the expert shards out, fail."""
    run_ranks(_check, 4, timeout=400)


def test_ep_with_tensor_parallel_and_clipping_are_accepted_but_expert_tp_4_at_tp_2_is_not(
) -> None:
    ParallelConfig(data_parallel=2, tensor_parallel=2, expert_parallel=2)
    with pytest.raises(PipelineConfigError, match=r"expert_tensor_parallel=4 is not supported"):
        ParallelConfig(data_parallel=2, tensor_parallel=2, expert_parallel=2,
                       expert_tensor_parallel=4)
    ParallelConfig(data_parallel=2, expert_parallel=2, gradient_clipping=1.0, zero_stage=1,
                   overlap_param_gather=True)
