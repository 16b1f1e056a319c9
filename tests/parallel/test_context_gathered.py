"""The cp attentions against SDPA under autograd, forward and backward, through the fused CPU
kernel pair and through the plain-torch arithmetic (`ops.TorchContextOps`): the all-gather
one (`gathered_attention`) in one process (the gathers are the identity at cp 1), keeping
neither a dense mask nor more than its inputs, output and log-sum-exp; and at cp 2 and 4
the all-gather and ring attention (with and without overlap) on gloo ranks, each rank's
load-balanced chunks against the whole sequence's attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.parallel.context import gathered
from pipeline.parallel.context.mask import PositionMask, context_mask
from pipeline.parallel.context.ops import TorchContextOps
from pipeline.parallel.context.ring import ring_attention
from pipeline.parallel.context.sharding import gathered_positions, rank_positions, shard_sequence
from tests.support.rank_harness import run_ranks

__all__: list[str] = []


def _inputs(padded: bool) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 8, 8, generator=generator, dtype=torch.float64)
    key = torch.randn(2, 2, 8, 8, generator=generator, dtype=torch.float64)
    value = torch.randn(2, 2, 8, 8, generator=generator, dtype=torch.float64)
    padding = torch.ones(2, 8, dtype=torch.long)
    if padded:
        padding[1, 5:] = 0
    return query, key, value, padding


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("padded, window", [(False, None), (True, None), (False, 3)])
def test_gathered_attention_equals_sdpa_forward_and_backward(
        fused: bool, padded: bool, window: int | None) -> None:
    query, key, value, padding = _inputs(padded)
    positions = torch.tensor([[0, 1, 6, 7, 2, 3, 4, 5]])  # any order: the mask is global
    keys = torch.arange(8)
    mask = PositionMask(positions, keys, padding if padded else None, window)
    grad = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    mine = [t.clone().requires_grad_() for t in (query, key, value)]
    want = [t.clone().requires_grad_() for t in (query, key, value)]
    out = gathered.gathered_attention(*mine, mask, None, 0.3, TorchContextOps(fused))
    expected = F.scaled_dot_product_attention(
        *want, attn_mask=context_mask(positions, keys, padding if padded else None, window),
        scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.backward(grad)
    expected.backward(grad)
    for got, reference in zip(mine, want, strict=True):
        torch.testing.assert_close(got.grad, reference.grad, rtol=1e-10, atol=1e-12)


def test_only_the_slice_output_and_log_sum_exp_are_kept() -> None:
    query, key, value, padding = _inputs(padded=True)
    mask = PositionMask(torch.arange(8)[None], torch.arange(8), padding, None)
    saved: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    inputs = [t.requires_grad_() for t in (query, key, value)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gathered.gathered_attention(*inputs, mask, None, 0.3)  # type: ignore[arg-type]
    # q, k, v, out, lse (b, a, n), and the positions (O(S)): no (queries × keys) mask
    assert sorted(map(tuple, saved)) == sorted([
        (2, 4, 8, 8), (2, 2, 8, 8), (2, 2, 8, 8), (2, 4, 8, 8), (2, 4, 8), (1, 8), (8,),
        (2, 8)])


def test_a_mask_without_its_tensors_says_how_to_fix_it() -> None:
    mask = PositionMask(torch.arange(4)[None], torch.arange(4), None, None).without_tensors()
    with pytest.raises(ValueError, match="with_tensors"):
        mask.dense()


def _split_attention_errors(rank: int, world: int) -> None:
    """Every variant's output and gradients on this rank's chunks against SDPA over the whole
    sequence (the same on every rank), then the largest error over the variants."""
    torch.set_num_threads(1)
    group = torch.distributed.group.WORLD
    length = 4 * world
    generator = torch.Generator().manual_seed(1)
    whole = [torch.randn(2, heads, length, 8, generator=generator, dtype=torch.float64)
             for heads in (4, 2, 2)]
    padding = torch.ones(2, length, dtype=torch.long)
    padding[1, length - 3:] = 0
    grad = torch.randn(2, 4, length, 8, generator=generator, dtype=torch.float64)
    reference = [t.clone().requires_grad_() for t in whole]
    everything = torch.arange(length)
    expected = F.scaled_dot_product_attention(
        *reference, attn_mask=context_mask(everything[None], everything, padding, 5),
        scale=0.3, enable_gqa=True)
    expected.backward(grad)
    positions = rank_positions(length, rank, world)[None]
    mask = PositionMask(positions, gathered_positions(length, world), padding, 5)
    for name in ("gathered", "ring", "ring without overlap"):
        for fused in (True, False):
            mine = [shard_sequence(t, rank, world, dim=2).clone().requires_grad_()
                    for t in whole]
            ops = TorchContextOps(fused)
            out = gathered.gathered_attention(*mine, mask, group, 0.3, ops) \
                if name == "gathered" else ring_attention(
                    *mine, mask, group, 0.3, overlap=name == "ring", ops=ops)
            out.backward(shard_sequence(grad, rank, world, dim=2))
            torch.testing.assert_close(out, shard_sequence(expected, rank, world, dim=2),
                                       rtol=1e-10, atol=1e-12, msg=f"{name} {fused}")
            for got, want in zip(mine, reference, strict=True):
                torch.testing.assert_close(got.grad, shard_sequence(want.grad, rank, world,
                                                                    dim=2),
                                           rtol=1e-10, atol=1e-12, msg=f"{name} {fused}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_gathered_and_ring_attention_equal_sdpa_over_the_cp_group(cp: int) -> None:
    run_ranks(_split_attention_errors, cp, timeout=300)
