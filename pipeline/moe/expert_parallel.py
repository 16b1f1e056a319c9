"""Expert parallelism: a model's MoE layers keep 1/ep of their experts and exchange tokens
with the other ranks of their ep group by all-to-all (dropless, variable split sizes).

`parallelize_experts(module, groups)` turns a built pipeline module into its
expert-parallel form (torchtitan's way: one function over the model, nothing threaded
through the engine's interpreter); the engine calls it when the topology has ep > 1.

One MoE layer on ep ranks (E experts, L = E / ep local ones, n tokens each, top-k)::

    route -> n·k slots sorted by expert = by owner rank ──all-to-all──> rows by (source,
    local expert) -> regroup by local expert -> experts -> back in (source, expert) order
    ──all-to-all──> slots -> × combine weights -> summed into their tokens

The slot counts go first (an all-to-all of E integers), so every rank knows its split sizes.
Autograd runs the same exchanges backwards (`_Exchange`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.errors import PipelineConfigError
from pipeline.moe import experts as bank
from pipeline.moe.interleave import hand_over
from pipeline.moe.layer import MoEFeedForward
from pipeline.parallel.groups import ProcessGroups
from pipeline.parallel.param_marks import mark_expert_shard

__all__ = ["AllToAllDispatcher", "check_expert_layers", "exchange_rows",
           "expert_major_order", "expert_parallel_problem", "local_experts", "parallelize_experts"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The stacked expert tensors, experts along dim 0."""


def expert_parallel_problem(num_experts: int, top_k: int, ep: int) -> str | None:
    """Why E experts with top-k routing cannot be split over ep ranks (None if they can)."""
    if not 1 <= top_k <= num_experts:
        return (f"top_k {top_k} must be in 1..{num_experts} (the number of experts); lower "
                "num_experts_per_tok")
    if num_experts % ep:
        return (f"expert_parallel={ep} must divide the {num_experts} experts of each MoE layer "
                f"(each ep rank holds E / ep); choose among "
                f"{[k for k in range(1, min(num_experts, 64) + 1) if num_experts % k == 0]}")
    return None


def check_expert_layers(modules: Iterable[nn.Module], ep: int) -> None:
    """Refuse, in one line, built layers whose MoE layers cannot split over ep ranks (or,
    at ep > 1, that hold none); for callers holding layers before any rank starts."""
    layers = [m for module in modules for m in module.modules()
              if isinstance(m, MoEFeedForward)]
    if ep > 1 and not layers:
        raise PipelineConfigError(f"expert_parallel={ep} but the model has no MoE layers "
                                  "(pipeline.moe.layer.MoEFeedForward) to split; use 1")
    for layer in layers:
        problem = expert_parallel_problem(layer.config.num_experts, layer.config.top_k, ep)
        if problem is not None:
            raise PipelineConfigError(problem)


def _all_to_all(out: torch.Tensor, rows: torch.Tensor, receive: list[int], send: list[int],
                group: ProcessGroup) -> None:
    work = dist.all_to_all_single(out, rows, receive, send, group=group, async_op=True)
    if work is not None:
        hand_over(work)


class _Exchange(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse exchange, both launched asynchronously
    and waited through `interleave.hand_over` (an overlapped pair's other microbatch computes
    meanwhile). Our own because
    torch.distributed.nn's is deprecated and the functional collectives' autograd variant
    is private API."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, receive: list[int], send: list[int],
                group: ProcessGroup) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        _all_to_all(out, rows.contiguous(), receive, send, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        _all_to_all(back, grad.contiguous(), ctx.send, ctx.receive, ctx.group)
        return back, None, None, None


def exchange_rows(rows: torch.Tensor, receive: list[int], send: list[int],
                  group: ProcessGroup) -> torch.Tensor:
    """Rows to the ranks of `group`: send[r] of them to rank r, receive[r] from it."""
    result: torch.Tensor = _Exchange.apply(rows, receive, send, group)
    return result


def expert_major_order(matrix: torch.Tensor) -> torch.Tensor:
    """The order that takes received rows from (source, local expert) blocks, `matrix[s, e]`
    rows each, to (local expert, source) blocks: each expert's rows contiguous."""
    sources, local = matrix.shape
    cell = torch.arange(sources * local).repeat_interleave(matrix.reshape(-1))
    return torch.argsort((cell % local) * sources + cell // local, stable=True)


class AllToAllDispatcher:
    """Dispatch to and combine from the experts of an ep group (this rank holds experts
    first_expert .. first_expert + E/ep - 1)."""

    all_to_all_inside = True
    """Its dispatch and combine wait through `interleave.hand_over`."""

    def __init__(self, group: ProcessGroup, num_experts: int, ep: int) -> None:
        self.group = group
        self.num_experts = num_experts
        self.ep = ep
        self.local = num_experts // ep
        self.expert_outputs: bank.ExpertOutputs = bank.expert_outputs
        """The experts' GEMMs (expert tensor parallelism swaps in its own)."""

    def __call__(self, experts: nn.Module, hidden: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        top_k = chosen.shape[-1]
        order, counts = bank.group_by_expert(chosen, self.num_experts)
        token_of_slot = order // top_k
        # 1. Split sizes: rank r sends counts[r·L:(r+1)·L] slots to rank r; it receives a
        #    [source, local expert] matrix of counts.
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        matrix = received_counts.view(self.ep, self.local)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        receive = matrix.sum(1).tolist()
        # 2. Dispatch; regroup the received rows from (source, expert) to (expert, source).
        received = exchange_rows(hidden[token_of_slot], receive, send, self.group)
        regroup = expert_major_order(matrix)
        out = self.expert_outputs(experts, received[regroup], matrix.sum(0).tolist())
        # 3. Combine: back to (source, expert) order, to the sources, weighted into tokens.
        returned = exchange_rows(out[torch.argsort(regroup)], send, receive, self.group)
        returned = returned * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add_(0, token_of_slot,
                                                   returned.to(hidden.dtype))


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The experts of each MoE layer that ep rank `ep_rank` of `ep` keeps: 1/ep of them,
    consecutive (ep divides `num_experts`, `expert_parallel_problem`)."""
    local = num_experts // ep
    return range(ep_rank * local, (ep_rank + 1) * local)


def parallelize_experts(module: nn.Module, groups: ProcessGroups) -> int:
    """Keep this rank's 1/ep of every MoE layer's experts (sliced from the whole layer,
    so weights loaded before stay the same values) and dispatch over the ep group.
    Returns how many MoE layers were parallelised."""
    ep, ep_rank = groups.topology.ep, groups.position.ep_rank
    if ep == 1:
        return 0
    if groups.ep_group is None:
        raise PipelineConfigError(f"ep={ep} but the process groups hold no ep group; build "
                                  "them with create_process_groups(topology)")
    layers = [m for m in module.modules() if isinstance(m, MoEFeedForward)]
    for layer in layers:
        config = layer.config
        problem = expert_parallel_problem(config.num_experts, config.top_k, ep)
        if problem is not None:
            raise PipelineConfigError(problem)
        kept = local_experts(config.num_experts, ep, ep_rank)
        first, local = kept.start, len(kept)
        for name in EXPERT_WEIGHTS:
            whole = getattr(layer.experts, name)
            if whole.shape[0] != config.num_experts:
                raise PipelineConfigError(f"{name} holds {whole.shape[0]} experts, not "
                                          f"{config.num_experts}: parallelised twice?")
            shard = nn.Parameter(whole.detach()[first:first + local].clone(),
                                 requires_grad=whole.requires_grad)
            mark_expert_shard(shard, first, config.num_experts)
            setattr(layer.experts, name, shard)
        layer.dispatcher = AllToAllDispatcher(groups.ep_group, config.num_experts, ep)
    return len(layers)
