"""Sequence-parallel tp blocks train under bf16/fp16 autocast with fp32 parameters (issue 49
item 10: the first backward failed with ``Half != float``, the tp GEMMs' backward ran outside
the forward's autocast); loss and gradients against fp32 at the half-precision tolerance."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineEngine, PipelineModule
from pipeline.parallel.tensor.layers import ParallelTransformerBlock, TransformerBlock
from pipeline.parallel.tensor.sequence import GatherSequence, ScatterSequence
from tests.support.engine3d_models import VOCAB, sequence_parallel_layers
from tests.support.rank_harness import run_ranks

HIDDEN, HEADS, FFN, BATCH, SEQ = 16, 4, 32, 2, 8
HALF_TOLERANCE = 2e-2
"""Relative error of a half-precision run against fp32 (the engine's bf16 tolerance)."""


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _blocks_step(sequence_parallel_blocks: nn.Module, x: torch.Tensor, target: torch.Tensor,
                 dtype: torch.dtype | None) -> torch.Tensor:
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = sequence_parallel_blocks(x)
    loss = (out.float() - target).pow(2).mean()
    loss.backward()
    return loss.detach()


def _blocks_under_autocast(rank: int, size: int) -> None:
    """Two blocks at tp 2 with sequence parallelism (sequential and overlapped) under
    bf16 and fp16 autocast against the same blocks in fp32."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    for overlap in (False, True):
        for dtype in (torch.bfloat16, torch.float16):
            torch.manual_seed(11)
            plain = [TransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN) for _ in range(2)]
            runs = []
            for precision in (None, dtype):
                blocks = [ParallelTransformerBlock.from_full(
                    block, group, sequence_parallel=True, overlap=overlap, chunks=2)
                    for block in plain]
                model = nn.Sequential(ScatterSequence(group), *blocks, GatherSequence(group))
                torch.manual_seed(5)
                x, target = torch.randn(BATCH, SEQ, HIDDEN), torch.randn(BATCH, SEQ, HIDDEN)
                loss = _blocks_step(model, x.requires_grad_(), target, precision)
                grads = {name: param.grad for name, param in model.named_parameters()}
                runs.append((loss, grads))
            (want_loss, want_grads), (loss, grads) = runs
            label = f"overlap={overlap} {dtype}"
            assert _relative(loss, want_loss) < HALF_TOLERANCE, label
            for name, grad in grads.items():
                want = want_grads[name]
                assert grad is not None and want is not None, (label, name)
                assert grad.dtype == torch.float32, (label, name)
                assert _relative(grad, want) < HALF_TOLERANCE, (label, name)


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _engine_bf16_equals_fp32(rank: int, size: int) -> None:
    """The engine at pp 2 × tp 2 with sequence parallelism, precision='bf16' (fp32
    parameters, autocast) against precision='fp32': one step's loss and gradients."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randint(0, VOCAB, (8, 6), generator=generator)
    targets = torch.randint(0, VOCAB, (8, 6), generator=generator)
    results: list[tuple[float, dict[Any, torch.Tensor]]] = []
    for precision in ("fp32", "bf16"):
        module = PipelineModule(sequence_parallel_layers(), num_stages=2, loss_fn=_token_loss)
        engine = PipelineEngine(module, num_microbatches=2, tensor_parallel=2,
                                precision=precision, timeout=60)
        loss = engine.train_batch(inputs, targets)
        results.append((loss, engine.reduced_gradients()))
    (want_loss, want), (loss, got) = results
    assert abs(loss - want_loss) / abs(want_loss) < HALF_TOLERANCE, (loss, want_loss)
    for key, grad in got.items():
        assert grad.dtype == torch.float32, key
        assert _relative(grad, want[key]) < HALF_TOLERANCE, (key, _relative(grad, want[key]))


@pytest.mark.multiprocess
def test_sequence_parallel_blocks_backward_under_half_autocast_with_fp32_weights() -> None:
    run_ranks(_blocks_under_autocast, 2, timeout=180)


@pytest.mark.multiprocess
def test_engine_bf16_with_sequence_parallelism_equals_fp32() -> None:
    run_ranks(_engine_bf16_equals_fp32, 4, timeout=240)
