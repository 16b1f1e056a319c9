"""Cross entropy over logits split by vocabulary across tp ranks, never gathering them.

Megatron's vocab-parallel cross entropy (Shoeybi et al., 2019, §3): with rank r holding
logits z[..., V_r] for its vocabulary slice V_r, per token

    loss = log Σ_r Σ_{v ∈ V_r} exp(z_v - m) - (z_target - m),   m = max_r max_{v ∈ V_r} z_v

needs three all-reduces of one number per token (the max, the sum of exponentials, the
target's logit, found on the one rank that holds it) instead of gathering b·s·V logits.
The sums pass through g (all-reduce forward, identity backward), so autograd gives each
rank softmax - one-hot on its own slice. Every tp rank computes the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.tensor.collectives import reduce_from_tensor_parallel_region

__all__ = ["vocab_parallel_token_losses"]


def vocab_parallel_token_losses(logits: torch.Tensor, targets: torch.Tensor,
                                vocab_start: int, group: ProcessGroup | None,
                                ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross entropy (fp32, 0 where the target is `ignore_index`) and the mask of
    counted tokens, from this rank's logits over vocabulary ids [vocab_start, vocab_start
    + logits.shape[-1])."""
    z = logits.float()
    with torch.no_grad():
        peak = z.max(dim=-1).values
        if group is not None:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    z = z - peak.unsqueeze(-1)
    total = reduce_from_tensor_parallel_region(z.exp().sum(dim=-1), group)
    counted = targets != ignore_index
    local = targets - vocab_start
    here = counted & (local >= 0) & (local < z.shape[-1])
    # indexing, not `gather`: gather's backward keeps the whole shifted logits (b·s·V/t
    # more bytes held to the backward); indexing keeps the indices only
    flat = z.reshape(-1, z.shape[-1])
    rows = torch.arange(flat.shape[0], device=z.device)
    picked = flat[rows, local.masked_fill(~here, 0).reshape(-1)].view(here.shape)
    target_logit = reduce_from_tensor_parallel_region(picked.masked_fill(~here, 0.0), group)
    losses = (torch.log(total) - target_logit).masked_fill(~counted, 0.0)
    return losses, counted
