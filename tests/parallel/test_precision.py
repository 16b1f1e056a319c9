"""Mixed precision: bf16 autocast tolerance, the rank-wide loss-scale vote, global-norm clipping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.parallel.precision import (
    DynamicLossScaler,
    autocast,
    clip_grad_norm_global,
)
from pipeline.parallel.tensor.layers import ParallelTransformerBlock, TransformerBlock
from tests.support.rank_harness import run_ranks

BF16_RTOL = 2e-2
"""bf16 keeps 8 mantissa bits (relative step 2^-8 ≈ 4e-3); a few matmuls in, 2 % is the
tolerance we state for bf16 against the fp32 reference."""


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def test_bf16_autocast_agrees_with_fp32_within_stated_tolerance() -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    losses, grads = {}, {}
    for precision in ("fp32", "bf16"):
        model = _mlp()
        with autocast(precision):  # type: ignore[arg-type]
            out = model(x)
        assert out.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 masters
        losses[precision] = loss.detach()
        grads[precision] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(losses["bf16"], losses["fp32"], rtol=BF16_RTOL, atol=0.0)
    error = (grads["bf16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert error < BF16_RTOL


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision must be 'fp32', 'bf16' or 'fp16'"):
        autocast("fp8")  # type: ignore[arg-type]


def test_loss_scale_backs_off_on_overflow_and_grows_after_clean_steps() -> None:
    scaler = DynamicLossScaler(None, init_scale=8.0, growth_interval=2)
    assert scaler.scale == 8.0
    scaler.update(overflow=True)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 8.0
    with pytest.raises(ValueError, match=r"backoff_factor must be in .*; growth_interval"):
        DynamicLossScaler(None, backoff_factor=1.5, growth_interval=0)


def _check_overflow_vote(rank: int, world_size: int) -> None:
    scaler = DynamicLossScaler(dist.group.WORLD, init_scale=2.0**10)
    steps: list[int] = []
    for step in range(2):
        grad = torch.full((4,), scaler.scale, dtype=torch.float16)  # a scaled gradient of 1
        if step == 0 and rank == world_size - 1:
            grad[1] = float("inf")  # only the last rank overflows
        took = scaler.step([grad], lambda step=step: steps.append(step))
        assert took == (step == 1), (rank, step)
        if took:
            assert torch.equal(grad, torch.ones(4, dtype=torch.float16))  # unscaled
    assert steps == [1]  # every rank skipped step 0 together
    assert scaler.scale == 2.0**9 and scaler.skipped_steps == 1


def _check_clip_over_tensor_parallel_ranks(rank: int, world_size: int) -> None:
    group = dist.group.WORLD  # the tp group; with pp and dp it is the model-parallel group
    torch.manual_seed(2)
    plain = TransformerBlock(8, 2, ffn_hidden=16)
    block = ParallelTransformerBlock.from_full(plain, group)
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8)
    plain(x).pow(2).sum().backward()
    block(x).pow(2).sum().backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    norm = clip_grad_norm_global(list(block.parameters()), 0.1, group, tp_rank=rank)
    torch.testing.assert_close(norm, expected_norm)
    # clipped gradients are the clipped full gradients' slices (layer norms: whole)
    torch.testing.assert_close(block.ln1.weight.grad, plain.ln1.weight.grad)
    torch.testing.assert_close(block.fc2.weight.grad,
                               plain.fc2.weight.grad.chunk(world_size, dim=1)[rank])


@pytest.mark.multiprocess
def test_fp16_overflow_on_one_rank_makes_every_rank_skip() -> None:
    run_ranks(_check_overflow_vote, 2)


@pytest.mark.multiprocess
def test_global_norm_clipping_counts_tensor_parallel_replicas_once() -> None:
    run_ranks(_check_clip_over_tensor_parallel_ranks, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("planted", [None, float("nan"), float("inf"), -float("inf")])
def test_holds_nonfinite_equals_the_elementwise_definition(dtype: torch.dtype,
                                                           planted: float | None) -> None:
    """The min/max check (no full-size temporaries) against "some element is not finite",
    element by element; an empty tensor holds nothing."""
    from pipeline.parallel.precision import holds_nonfinite

    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(shape, generator=generator).to(dtype) * 1e3
               for shape in ((5, 7), (0,), (13,), (2, 3, 4))]
    if planted is not None:
        tensors[3].view(-1)[17] = planted
    expected = any(not torch.isfinite(value).item() for t in tensors for value in t.flatten())
    assert holds_nonfinite(tensors) == expected == (planted is not None)
    assert holds_nonfinite([]) is False and holds_nonfinite([torch.empty(0)]) is False


def test_global_grad_norm_is_the_float64_norm_for_large_and_small_gradients() -> None:
    """The blocked fp32 sum of squares against the definition in float64 (one vector_norm of
    this 3M-element tensor is 6e-5 off on CPU, past the 1e-6 asked; the blocks stay near
    fp32 rounding)."""
    from pipeline.parallel.precision import global_grad_norm

    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(3_000_017, generator=generator), torch.randn(7, 3, generator=generator),
             torch.empty(0), torch.randn(65_536, generator=generator).bfloat16()]
    exact = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
    assert float(global_grad_norm(grads, None)) == pytest.approx(exact, rel=1e-6)
