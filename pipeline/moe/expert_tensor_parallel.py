"""Expert tensor parallelism: each expert's gate/up projections column-split and its down
projection row-split over the tp group, as the dense MLP is (expert_tensor_parallel = tp).

Megatron-Core's ``--expert-tensor-parallel-size`` equal to tp. After the dispatch (the ep
all-to-all, or none at ep 1) each tp rank holds the rows its own tokens sent to its local
experts; the experts' GEMMs then run on the tp group's rows together (legend: t = tp,
L = local experts, n_r = the rows tp rank r holds)::

    own rows [n_me] ──gather over tp──> [n_0 + … + n_{t-1}] regrouped by expert
        -> gate/up column shard -> act · up -> down row shard  (a partial sum per row)
        ──reduce-scatter over tp──> own rows [n_me], each the sum of the t partials

Both exchanges are all-to-alls of variable split sizes (`exchange_rows`), so autograd runs
them backwards: the gather's backward sums each rank's row gradients over tp, the
reduce-scatter's copies them to every shard. The expert weights' gradients are per shard
(no sum over tp); the router and shared experts stay whole, as at expert tp 1.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.errors import PipelineConfigError
from pipeline.moe import experts as bank
from pipeline.moe.expert_parallel import exchange_rows, expert_major_order
from pipeline.moe.layer import MoEFeedForward
from pipeline.parallel.groups import ProcessGroups
from pipeline.parallel.param_marks import expert_shard, mark_expert_shard
from pipeline.parallel.tensor.shard_layout import ShardLayout, layout_of, mark_sharded

__all__ = ["split_experts_over_tensor_parallel", "tensor_parallel_expert_outputs"]


def tensor_parallel_expert_outputs(experts: nn.Module, rows: torch.Tensor, counts: list[int],
                                   group: ProcessGroup) -> torch.Tensor:
    """`pipeline.moe.experts.expert_outputs` of this tp rank's rows (``counts[e]`` for local
    expert e) through experts whose weights are split over `group` (module docstring)."""
    size = dist.get_world_size(group)
    mine = torch.tensor(counts, dtype=torch.int64)
    gathered_counts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered_counts, mine, group=group)
    matrix = torch.stack(gathered_counts)  # [tp rank, local expert]
    held = matrix.sum(1).tolist()  # n_r
    own = rows.shape[0]
    # gather: every rank sends its rows to each rank (the all-to-all's backward sums the
    # t gradients of each row back onto its sender)
    gathered = exchange_rows(rows.repeat(size, 1), held, [own] * size, group)
    regroup = expert_major_order(matrix)
    partial = bank.expert_outputs(experts, gathered[regroup], matrix.sum(0).tolist())
    # reduce-scatter: each rank gets every shard's partials of its own rows and sums them
    returned = exchange_rows(partial[torch.argsort(regroup)], [own] * size, held, group)
    return returned.view(size, own, *returned.shape[1:]).sum(0)


def _split(whole: torch.Tensor, layout: ShardLayout) -> nn.Parameter:
    shard = nn.Parameter(layout.shard(whole.detach()), requires_grad=whole.requires_grad)
    placed = expert_shard(whole)
    if placed is not None:
        mark_expert_shard(shard, *placed)
    return mark_sharded(shard, layout)


def split_experts_over_tensor_parallel(module: nn.Module, groups: ProcessGroups) -> int:
    """Keep this tp rank's column slice of every MoE layer's experts' gate / up projections
    and row slice of their down projections (sliced from the weights the rank holds, after
    expert parallelism took its experts) and run them over the tp group. Returns how many
    MoE layers this rank's stages hold were split (a stage may hold none)."""
    tp, rank = groups.topology.tp, groups.position.tp_rank
    if tp == 1:
        return 0
    layers = [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    for layer in layers:
        gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            raise PipelineConfigError("expert_tensor_parallel splits stacked expert weights "
                                      "gate_up_proj / down_proj; this MoE layer has none")
        if layout_of(gate_up) is not None:
            raise PipelineConfigError("the experts are split over tp already: "
                                      "split_experts_over_tensor_parallel ran twice?")
        width = down.shape[-1]  # I, the expert's intermediate size
        if width % tp:
            raise PipelineConfigError(
                f"expert_tensor_parallel={tp} must divide the experts' intermediate size "
                f"{width} (each tp rank keeps I / t of its columns); use "
                "expert_tensor_parallel=1")
        layer.experts.gate_up_proj = _split(gate_up, ShardLayout(1, (width, width), rank, tp))
        layer.experts.down_proj = _split(down, ShardLayout(2, (width,), rank, tp))
        layer.dispatcher.expert_outputs = functools.partial(  # type: ignore[attr-defined]
            tensor_parallel_expert_outputs, group=groups.tp_group)
    return len(layers)
