"""Sequence-parallel and overlapped tensor-parallel blocks equal the plain single-process blocks:
loss, input and weight gradients and the weights after an optimizer step (fp32, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipeline.parallel.tensor.layers as layers_module
import pipeline.parallel.tensor.overlap as overlap_module
from pipeline.parallel.tensor.layers import ParallelTransformerBlock, TransformerBlock
from pipeline.parallel.tensor.sequence import (
    GatherSequence,
    PendingCollective,
    ScatterSequence,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    split_sequence,
    start_all_gather,
)
from pipeline.runtime.saved_memory import SavedTensorMeter
from schedules.analysis.accounting import layer_activation_bytes
from tests.support.rank_harness import run_ranks

HIDDEN, HEADS, FFN, BATCH, SEQ = 8, 4, 16, 2, 8


def _shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's part of the plain block's tensor `name` (the layers' slicing, restated)."""
    if name.startswith("qkv."):
        return torch.cat([block.chunk(size, dim=0)[rank] for block in full.chunk(3, dim=0)])
    if name.startswith("fc1."):
        return full.chunk(size, dim=0)[rank]
    if name in ("proj.weight", "fc2.weight"):
        return full.chunk(size, dim=1)[rank]
    return full  # norms and row-parallel biases are replicated


def _step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = ((model(x) - target) ** 2).mean()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return loss.detach()


def _compare(rank: int, size: int, sequence_parallel: bool, overlap: bool) -> None:
    """One step of two blocks at tp = `size` against the plain blocks."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    torch.manual_seed(11)
    plain = [TransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN) for _ in range(2)]
    parallel = [ParallelTransformerBlock.from_full(block, group,
                                                   sequence_parallel=sequence_parallel,
                                                   overlap=overlap, chunks=2)
                for block in plain]
    inner: list[nn.Module] = list(parallel)
    if sequence_parallel:
        inner = [ScatterSequence(group), *parallel, GatherSequence(group)]
    model, reference = nn.Sequential(*inner), nn.Sequential(*plain)
    torch.manual_seed(5)
    x, target = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
    x_plain, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected_grads = {}
    loss_plain = _step(reference, x_plain, target)
    for index, block in enumerate(plain):
        for name, param in block.named_parameters():
            expected_grads[f"{index}.{name}"] = param.grad
    loss = _step(model, x_tp, target)
    torch.testing.assert_close(loss, loss_plain, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x_tp.grad, x_plain.grad, rtol=1e-5, atol=1e-7)
    for index, (block, full) in enumerate(zip(parallel, plain, strict=True)):
        full_params = dict(full.named_parameters())
        for name, param in block.named_parameters():
            torch.testing.assert_close(
                param.grad, _shard(name, expected_grads[f"{index}.{name}"], rank, size),
                rtol=1e-5, atol=1e-7, msg=f"gradient of block {index} {name}")
            torch.testing.assert_close(  # the weights after the optimizer step
                param.detach(), _shard(name, full_params[name].detach(), rank, size),
                rtol=1e-5, atol=1e-7, msg=f"updated block {index} {name}")


def _check_primitives(rank: int, size: int) -> None:
    """Each operator against its definition, forward and backward."""
    group = dist.group.WORLD
    full = torch.arange(2.0 * 4 * 3).view(2, 4, 3)
    weights = torch.arange(2.0 * 4 * 3).view(2, 4, 3).flip(1)
    mine = split_sequence(full, size, rank)
    assert torch.equal(mine, full[:, rank * 4 // size:(rank + 1) * 4 // size])
    x = full.clone().requires_grad_()
    piece = scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(piece, mine)
    gathered = gather_from_sequence_parallel_region(piece, group, reduce_grads=False)
    assert torch.equal(gathered, full)
    (gathered * weights).sum().backward()  # keep my slice, then all-gather the slices
    assert torch.equal(x.grad, weights)
    # before a column region: each rank's gradient is a partial sum, reduce-scattered back
    local = mine.clone().requires_grad_()
    out = gather_from_sequence_parallel_region(local, group)
    (out * weights * (rank + 1)).sum().backward()
    total = sum(range(1, size + 1))
    assert torch.equal(local.grad, split_sequence(weights, size, rank) * total)
    partial = (full * (rank + 1)).requires_grad_()
    reduced = reduce_scatter_to_sequence_parallel_region(partial, group)
    assert torch.equal(reduced, mine * total)
    (reduced * split_sequence(weights, size, rank)).sum().backward()
    assert torch.equal(partial.grad, weights)  # all-gathered
    pending = start_all_gather(mine, group)
    assert isinstance(pending, PendingCollective) and torch.equal(pending.wait(), full)
    with pytest.raises(ValueError, match=r"sequence length 5 .* not divisible"):
        split_sequence(torch.zeros(1, 5, 2), 2, 0)


def _missing_reduce_scatter(rank: int, size: int) -> None:
    """Planted bug: the reduce-scatter only slices (no sum over ranks): the check fails."""
    def slice_only(tensor: torch.Tensor, group: object, dim: int = 1, *,
                   async_op: bool = True) -> PendingCollective:
        return PendingCollective(None, split_sequence(tensor, size, rank, dim).movedim(dim, 0),
                                 dim)

    overlap_module.start_reduce_scatter = slice_only  # type: ignore[assignment]
    with pytest.raises(AssertionError):
        _compare(rank, size, True, True)


def _norm_grads_not_reduced(rank: int, size: int) -> None:
    """Planted bug: the norms' gradients stay per sequence slice: the check fails."""
    layers_module.reduce_grad = (  # type: ignore[assignment]
        lambda parameter, group, ops: parameter)
    with pytest.raises(AssertionError, match="ln"):
        _compare(rank, size, True, False)


def _activation_bytes(rank: int, size: int) -> None:
    """Counted saved bytes of two blocks per tp rank against the one accounting (fp32: twice
    its 16-bit bytes; no dropout; fused attention), with and without sequence parallelism."""
    torch.set_num_threads(1)
    s, b, h, a, f = 64, 2, 64, 4, 256
    counted = {}
    for sequence_parallel in (False, True):
        for overlap in (False, True):
            torch.manual_seed(0)
            blocks = [ParallelTransformerBlock(h, a, dist.group.WORLD, ffn_hidden=f,
                                               sequence_parallel=sequence_parallel,
                                               overlap=overlap) for _ in range(2)]
            x = torch.randn(b, s, h)
            if sequence_parallel:
                x = split_sequence(x, size, rank)
            x.requires_grad_()
            with SavedTensorMeter(ignore=[p for blk in blocks for p in blk.parameters()]) \
                    as meter:
                y = x
                for block in blocks:
                    y = block(y)
            predicted = 2 * 2 * layer_activation_bytes(
                s, b, h, a, attention="fused", t=size, sequence_parallel=sequence_parallel,
                dropout_mask_bytes=0, ffn=f)
            assert meter.live == pytest.approx(predicted, rel=0.05), (sequence_parallel,
                                                                      overlap)
            counted[sequence_parallel] = meter.live
    assert counted[True] < 0.85 * counted[False]  # the norms' and residuals' bytes / t


def _all_modes(rank: int, size: int) -> None:
    for sequence_parallel in (False, True):
        for overlap in (False, True):
            _compare(rank, size, sequence_parallel, overlap)


def _two_rank_checks(rank: int, size: int) -> None:
    _check_primitives(rank, size)
    _all_modes(rank, size)
    _activation_bytes(rank, size)


@pytest.mark.multiprocess
def test_sequence_parallel_and_overlapped_blocks_equal_plain_blocks() -> None:
    """Primitives against their definitions; every (sequence parallel, overlap) pair against
    the plain blocks; saved activation bytes against the accounting (one launch: cheap)."""
    run_ranks(_two_rank_checks, 2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sequence_parallel_overlapped_blocks_at_tp4() -> None:
    run_ranks(_compare, 4, True, True)


@pytest.mark.multiprocess
def test_planted_missing_reduce_scatter_fails_the_equivalence() -> None:
    run_ranks(_missing_reduce_scatter, 2)


@pytest.mark.multiprocess
def test_planted_unreduced_norm_gradients_fail_the_equivalence() -> None:
    run_ranks(_norm_grads_not_reduced, 2)
