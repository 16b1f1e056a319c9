"""Sent stage outputs are freed (Megatron's `deallocate_output_tensor`): rank 0 of 1F1B at p = 4
holds p - 1 fewer stage outputs at its peak, counted in bytes, and training still equals the
single process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, launch
from pipeline.model.reference import build_reference, reference_step
from pipeline.runtime.interpreter import free_output_data
from pipeline.runtime.saved_memory import SavedTensorMeter
from tests.support.equivalence import TOLERANCE, describe_errors, new_errors, record_step

pytestmark = pytest.mark.multiprocess

P, M, ROWS, WIDTH = 4, 6, 4, 16
"""Stages, microbatches, rows per microbatch, hidden width."""


def _layers() -> list[Any]:
    # each stage is Linear then GELU: GELU saves its input, so the stage output is held
    # only as the backward's root, and freeing it must show in the count
    layers: list[Any] = []
    for _ in range(P):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), nn.GELU()]
    return layers


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(M * ROWS, WIDTH, generator=generator),
            torch.randn(M * ROWS, WIDTH, generator=generator))


def _first_stage_saved_bytes() -> int:
    """Oracle: the bytes one microbatch's forward of the first stage leaves saved (plain
    autograd, no engine), its input batch not counted (data, not activations)."""
    torch.manual_seed(0)
    linear, gelu = nn.Linear(WIDTH, WIDTH), nn.GELU()
    x = torch.randn(ROWS, WIDTH)
    with SavedTensorMeter(ignore=[*linear.parameters(), x]) as meter:
        gelu(linear(x))
    return meter.peak


def _rank(p: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    peaks: dict[bool, int] = {}
    errors = new_errors()
    for free in (False, True):
        module = PipelineModule(_layers(), num_stages=p, loss_fn=_loss,
                                partition_method="uniform")
        engine = PipelineEngine(module, schedule="1f1b", num_microbatches=M,
                                optimizer=_sgd, free_sent_outputs=free, timeout=60)
        reference = build_reference(_layers())
        for step in range(2):
            inputs, targets = _batch(step)
            # the input batch is data every microbatch's view shares, not activations
            meter = SavedTensorMeter(ignore=[*module.parameters(), inputs])
            with meter:
                loss = engine.train_batch(inputs, targets)
            peaks[free] = meter.peak
            expected = reference_step(reference, inputs, targets, loss_fn=_loss,
                                      optimizer=_sgd)
            if free:
                record_step(errors, module.named_layer_parameters(), loss, expected, "free")
        engine.stop_watchdog()
    return {"peaks": peaks, "errors": errors, "pp_rank": engine.pp_rank}


def test_rank0_peak_drops_by_p_minus_1_outputs_and_training_is_unchanged() -> None:
    per_rank = launch(_rank, P, P, timeout=60, join_timeout=240)
    problems = [line for rank, result in enumerate(per_rank)
                for line in describe_errors(rank, "free_sent_outputs", result["errors"],
                                            TOLERANCE)]
    assert not problems, "\n".join(problems)
    output = ROWS * WIDTH * 4  # one microbatch's stage output, fp32
    saved = _first_stage_saved_bytes()  # GELU's input
    assert saved == output
    rank0 = per_rank[0]["peaks"]
    # 1F1B rank 0 holds p microbatches: each keeps its saved tensors and, unfreed, its
    # output; freed, only the newest output (not yet sent) is still there at the peak
    assert rank0[False] == P * (saved + output)
    assert rank0[True] == P * saved + output
    assert rank0[False] - rank0[True] == (P - 1) * output
    # the last stage sends nothing: the same either way
    assert per_rank[-1]["peaks"][False] == per_rank[-1]["peaks"][True]


def test_free_output_data_keeps_the_node_and_frees_only_owned_data() -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    out = torch.tanh(x @ weight)  # tanh saves its own output: the swap must not touch it
    expected = torch.autograd.grad(torch.tanh(x @ weight).sum(), weight)[0]
    assert free_output_data(out)
    assert out.shape == (2, 3) and out.untyped_storage().nbytes() == 4
    torch.autograd.backward([out], [torch.ones(2, 3)])
    assert weight.grad is not None and torch.equal(weight.grad, expected)
    leaf = torch.randn(2, 3, requires_grad=True)
    assert not free_output_data(leaf) and leaf.untyped_storage().nbytes() == 24
    view = (x @ weight)[:, :2]
    assert not free_output_data(view)
