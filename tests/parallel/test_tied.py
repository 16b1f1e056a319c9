"""Tied weights across the first and last stage (pp2 × dp2): one value, owners' gradients summed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeline.model.tied import TiedLayerSpec
from pipeline.parallel.data_parallel import BucketedGradReducer, broadcast_parameters
from pipeline.parallel.groups import create_process_groups
from pipeline.parallel.param_marks import is_tied_duplicate
from pipeline.parallel.precision import clip_grad_norm_global
from pipeline.parallel.tied_sync import (
    TiedGradReducer,
    TiedWeightSynchronizer,
    create_tied_groups,
    split_tied,
)
from pipeline.parallel.topology import Topology
from pipeline.parallel.zero import ShardedOptimizer
from tests.support.rank_harness import run_ranks

SPEC = TiedLayerSpec("embed", nn.Embedding, 10, 4,
                     forward_fn=lambda module, h: h @ module.weight.T)


def test_tied_layer_spec_is_a_plain_value() -> None:
    same = TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=SPEC.forward_fn)
    assert same == SPEC and SPEC.tied_weight_attr == ("weight",)
    module = SPEC.build()
    assert SPEC.tied_parameters(module) == [module.weight]
    assert "TiedLayerSpec('embed', Embedding" in repr(SPEC)
    with pytest.raises(TypeError, match=r"key must be a non-empty str.*tied_weight_attr"):
        TiedLayerSpec("", nn.Embedding, tied_weight_attr=())
    with pytest.raises(AttributeError, match="no parameter 'bias'; fix tied_weight_attr"):
        TiedLayerSpec("e", nn.Embedding, 3, 2, tied_weight_attr="bias").tied_parameters(
            nn.Embedding(3, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(9)
    return torch.randint(0, 10, (8,)), torch.randn(8, 4)


def _stage_losses(embed: nn.Embedding, inner: nn.Linear, stage: int, ids: torch.Tensor,
                  hidden: torch.Tensor) -> torch.Tensor:
    """Stage 0 embeds ids; stage 1 uses the same weight as its output head."""
    if stage == 0:
        return inner(embed(ids)).tanh().pow(2).mean()
    assert SPEC.forward_fn is not None
    return torch.logsumexp(SPEC.forward_fn(embed, inner(hidden)), dim=-1).mean()


def _reference() -> tuple[nn.Embedding, nn.Linear, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    embed = SPEC.build()
    torch.manual_seed(1)
    inner0 = nn.Linear(4, 4)
    torch.manual_seed(2)
    inner1 = nn.Linear(4, 4)
    ids, hidden = _data()
    loss = _stage_losses(embed, inner0, 0, ids, hidden) + \
        _stage_losses(embed, inner1, 1, ids, hidden)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(
        [embed.weight, *inner0.parameters(), *inner1.parameters()], 1e9)
    return embed, inner0, inner1, norm


def _check_tied(rank: int, world_size: int) -> None:
    topology = Topology(pp=2, dp=2)
    groups = create_process_groups(topology)
    stage, dp_rank = groups.position.pp_rank, groups.position.dp_rank
    tied_groups = create_tied_groups(topology, {"embed": [0, 1]})
    ref_embed, ref0, ref1, ref_norm = _reference()
    for mode in ("dp", "zero"):
        torch.manual_seed(0 if rank == 0 else 100 + rank)
        embed = SPEC.build()  # rank 0 starts like the reference, every other rank randomly
        torch.manual_seed(1 + stage)
        inner = nn.Linear(4, 4)
        params = [*SPEC.tied_parameters(embed), *inner.parameters()]
        broadcast_parameters(params, groups.dp_group)  # replicas of a stage start alike
        tied = TiedWeightSynchronizer({"embed": SPEC.tied_parameters(embed)}, tied_groups)
        tied.broadcast_initial()  # the last stage's copy takes the first stage's value
        assert torch.equal(embed.weight, ref_embed.weight)
        assert is_tied_duplicate(embed.weight) == (stage == 1)

        ids, hidden = _data()
        local = slice(dp_rank * 4, (dp_rank + 1) * 4)
        _stage_losses(embed, inner, stage, ids[local], hidden[local]).backward()
        if mode == "dp":
            reducer = TiedGradReducer(BucketedGradReducer(groups.dp_group, bucket_mb=1e-4), tied)
            reducer.reduce_stage(stage, params)
            reducer.wait()
            torch.testing.assert_close(embed.weight.grad, ref_embed.weight.grad)
            ref_inner = ref0 if stage == 0 else ref1
            for mine, ref in zip(inner.parameters(), ref_inner.parameters()):
                torch.testing.assert_close(mine.grad, ref.grad)
            norm = clip_grad_norm_global(params, 1e9, groups.model_parallel_group)
            torch.testing.assert_close(norm, ref_norm)  # the tied weight counted once
        else:
            zero = ShardedOptimizer(split_tied({stage: params}, tied.params),
                                    lambda shards: torch.optim.SGD(shards, lr=0.5),
                                    groups.dp_group, bucket_mb=1e-4)
            reducer = TiedGradReducer(zero, tied)
            reducer.reduce_stage(stage, params)
            reducer.wait()
            zero.step()
            expected = ref_embed.weight - 0.5 * ref_embed.weight.grad
            torch.testing.assert_close(embed.weight, expected)  # copies still identical
            ref_inner = ref0 if stage == 0 else ref1
            for mine, ref in zip(inner.parameters(), ref_inner.parameters()):
                torch.testing.assert_close(mine, ref - 0.5 * ref.grad)
        dist.barrier()


@pytest.mark.multiprocess
def test_tied_copies_stay_identical_with_dp_and_zero1() -> None:
    run_ranks(_check_tied, 4)
