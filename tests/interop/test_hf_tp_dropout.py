"""Dropout in a sequence-parallel region draws a mask per tp rank (issue 49 item 11).

Each tp rank holds other tokens there; one seed on every rank gave token t on rank 0 the
mask of token t + s/t on rank 1. As Megatron (its tp-rank generator forked around such
dropouts), each rank now draws from its own stream; replicated regions keep one mask on
every rank, runs stay reproducible, and a recompute replays the forked masks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

from pipeline import PipelineEngine, PipelineModule
from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf
from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf
from tests.support.hf_models import tiny_config, token_batch
from tests.support.rank_harness import run_ranks


def _step(sequence_parallel: bool, recompute: str = "none"
          ) -> tuple[float, list[torch.Tensor], dict[Any, torch.Tensor]]:
    """One pp 1 × tp 2 step of a tiny GPT-2 with embedding and residual dropout 0.5: its
    loss, the dropout masks drawn (in call order; the recompute's calls too) and the
    gradients."""
    config = tiny_config("gpt2")
    config.embd_pdrop = config.resid_pdrop = 0.5
    hf = tensor_parallel_hf(layers_from_hf(config), sequence_parallel=sequence_parallel)
    module = PipelineModule(hf.layers, num_stages=1, loss_fn=hf.loss_fn, recompute=recompute)
    engine = PipelineEngine(module, num_microbatches=2, tensor_parallel=2, timeout=60)
    masks: list[torch.Tensor] = []

    def record(_: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        masks.append(((out == 0) & (inputs[0] != 0)).detach().clone())

    dropouts = [m for m in module.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    assert len(dropouts) == 5, dropouts  # the embedding's, and two per block
    for dropout in dropouts:
        dropout.register_forward_hook(record)
    ids, _ = token_batch(4, 8, seed=1)
    loss = engine.train_batch(ids, causal_lm_targets(ids))
    return loss, masks, engine.reduced_gradients()


def _other_ranks(mask: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(mask) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mask)
    return parts[1 - dist.get_rank()]


def _masks_per_tp_rank(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    loss, masks, grads = _step(sequence_parallel=True)
    assert masks and all(mask.float().mean() > 0.3 for mask in masks)
    for index, mask in enumerate(masks):  # other tokens: masks of their own
        assert not torch.equal(mask, _other_ranks(mask)), f"dropout call {index}"
    again, masks_again, _ = _step(sequence_parallel=True)
    assert again == loss and all(map(torch.equal, masks, masks_again))
    recomputed, _, recomputed_grads = _step(sequence_parallel=True, recompute="full")
    assert recomputed == loss
    for key, grad in grads.items():  # the recompute drew the forward's forked masks
        assert torch.equal(grad, recomputed_grads[key]), key
    _, replicated, _ = _step(sequence_parallel=False)
    for index, mask in enumerate(replicated):  # whole activations on both ranks: one mask
        assert torch.equal(mask, _other_ranks(mask)), f"replicated dropout call {index}"


@pytest.mark.multiprocess
def test_sequence_parallel_dropout_draws_a_mask_per_tp_rank() -> None:
    run_ranks(_masks_per_tp_rank, 2, timeout=240)
