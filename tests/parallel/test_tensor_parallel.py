"""Tensor-parallel layers on 2 ranks equal the plain single-process layers, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.parallel.param_marks import is_tensor_parallel
from pipeline.parallel.tensor.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
    split_last_dim,
)
from pipeline.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelTransformerBlock,
    RowParallelLinear,
    TransformerBlock,
    VocabParallelEmbedding,
    parallel_lm_logits,
)
from tests.support.rank_harness import run_ranks


def _rows(full: torch.Tensor, rank: int, size: int, parts: int = 1) -> torch.Tensor:
    return torch.cat([block.chunk(size, dim=0)[rank] for block in full.chunk(parts, dim=0)])


def _input(*shape: int) -> torch.Tensor:
    torch.manual_seed(7)  # the same input on every tp rank, as after f / g
    return torch.randn(*shape, requires_grad=True)


def _check_operators(rank: int, size: int) -> None:
    group = dist.group.WORLD
    x = torch.full((2, 4), float(rank + 1), requires_grad=True)
    copy_to_tensor_parallel_region(x, group).sum().backward()
    assert torch.equal(x.grad, torch.full((2, 4), float(size)))  # all-reduced backward
    x.grad = None
    y = reduce_from_tensor_parallel_region(x, group)
    assert torch.equal(y, torch.full((2, 4), 3.0))
    assert torch.equal(x, torch.full((2, 4), rank + 1.0))  # the input is not reduced in place
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 4))  # identity backward
    full = torch.arange(8.0).view(2, 4).requires_grad_()
    mine = scatter_to_tensor_parallel_region(full, group)
    assert torch.equal(mine, split_last_dim(full.detach(), size, rank))
    gathered = gather_from_tensor_parallel_region(mine, group)
    assert torch.equal(gathered, full.detach())
    (gathered * torch.arange(8.0).view(2, 4)).sum().backward()
    # gather's backward keeps this rank's slice, scatter's backward all-gathers the slices
    assert torch.equal(full.grad, torch.arange(8.0).view(2, 4))


def _check_linear_and_embedding(rank: int, size: int) -> None:
    group = dist.group.WORLD
    for gather in (True, False):
        torch.manual_seed(3)
        plain = nn.Linear(6, 8)
        torch.manual_seed(3)
        column = ColumnParallelLinear(6, 8, group, gather_output=gather)  # same seed
        x_plain, x_tp = _input(3, 6), _input(3, 6)
        out = column(x_tp)
        expected = plain(x_plain)
        torch.testing.assert_close(
            out, expected if gather else split_last_dim(expected, size, rank))
        weights = torch.arange(24.0).view(3, 8)
        (expected * weights).sum().backward()
        (out * (weights if gather else split_last_dim(weights, size, rank))).sum().backward()
        torch.testing.assert_close(column.weight.grad, _rows(plain.weight.grad, rank, size))
        torch.testing.assert_close(column.bias.grad, _rows(plain.bias.grad, rank, size))
        torch.testing.assert_close(x_tp.grad, x_plain.grad)

    torch.manual_seed(4)
    plain = nn.Linear(8, 5)
    row = RowParallelLinear.from_full(plain, group, input_is_parallel=False)
    assert not is_tensor_parallel(row.bias) and is_tensor_parallel(row.weight)
    x_plain, x_tp = _input(3, 8), _input(3, 8)
    torch.testing.assert_close(row(x_tp), plain(x_plain))
    (plain(x_plain) ** 2).sum().backward()
    (row(x_tp) ** 2).sum().backward()
    torch.testing.assert_close(row.weight.grad, plain.weight.grad.chunk(size, dim=1)[rank])
    torch.testing.assert_close(row.bias.grad, plain.bias.grad)
    torch.testing.assert_close(x_tp.grad, x_plain.grad)

    # vocab-parallel embedding tied to the output head (input and output use the same rows)
    torch.manual_seed(5)
    plain_emb = nn.Embedding(10, 4)
    emb = VocabParallelEmbedding.from_full(plain_emb, group)
    ids = torch.tensor([[0, 9, 4, 5], [7, 2, 2, 8]])  # ids from both halves of the vocabulary
    targets = torch.tensor([[1, 5, 6, 0], [9, 3, 4, 4]])
    loss_fn = nn.CrossEntropyLoss()
    plain_logits = torch.tanh(plain_emb(ids)) @ plain_emb.weight.T
    logits = parallel_lm_logits(torch.tanh(emb(ids)), emb)
    torch.testing.assert_close(logits, plain_logits)
    loss_fn(plain_logits.reshape(-1, 10), targets.reshape(-1)).backward()
    loss_fn(logits.reshape(-1, 10), targets.reshape(-1)).backward()
    torch.testing.assert_close(emb.weight.grad, _rows(plain_emb.weight.grad, rank, size))


def _check_block(rank: int, size: int) -> None:
    group = dist.group.WORLD
    torch.manual_seed(11)
    plain = TransformerBlock(8, 4, ffn_hidden=12)
    torch.manual_seed(11)
    block = ParallelTransformerBlock(8, 4, group, ffn_hidden=12)  # init from the same seed
    assert block.local_heads == 4 // size
    x_plain, x_tp = _input(2, 5, 8), _input(2, 5, 8)
    out_plain, out = plain(x_plain), block(x_tp)
    torch.testing.assert_close(out, out_plain)
    target = torch.randn(2, 5, 8)
    ((out_plain - target) ** 2).mean().backward()
    ((out - target) ** 2).mean().backward()
    torch.testing.assert_close(x_tp.grad, x_plain.grad)
    expected = {
        "ln1.weight": plain.ln1.weight.grad, "ln1.bias": plain.ln1.bias.grad,
        "ln2.weight": plain.ln2.weight.grad, "ln2.bias": plain.ln2.bias.grad,
        "qkv.weight": _rows(plain.qkv.weight.grad, rank, size, 3),
        "qkv.bias": _rows(plain.qkv.bias.grad, rank, size, 3),
        "proj.weight": plain.proj.weight.grad.chunk(size, dim=1)[rank],
        "proj.bias": plain.proj.bias.grad,
        "fc1.weight": _rows(plain.fc1.weight.grad, rank, size),
        "fc1.bias": _rows(plain.fc1.bias.grad, rank, size),
        "fc2.weight": plain.fc2.weight.grad.chunk(size, dim=1)[rank],
        "fc2.bias": plain.fc2.bias.grad,
    }
    for name, param in block.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=name)
    with pytest.raises(ValueError, match="num_heads = 3 is not divisible by the tensor-parallel"):
        ParallelTransformerBlock.from_full(TransformerBlock(6, 3), group)


@pytest.mark.multiprocess
def test_tensor_parallel_layers_equal_plain_layers() -> None:
    run_ranks(_check_operators, 2)
    run_ranks(_check_linear_and_embedding, 2)


@pytest.mark.multiprocess
def test_parallel_transformer_block_equals_plain_block() -> None:
    run_ranks(_check_block, 2)

