"""What STEP steps on one rank: a torch optimizer, or ZeRO-1's sharded optimizer."""

from __future__ import annotations

import torch

from pipeline.parallel.zero import ShardedOptimizer

__all__ = ["RankOptimizer"]

RankOptimizer = torch.optim.Optimizer | ShardedOptimizer
"""A torch optimizer over this rank's parameters, or ZeRO-1's over its shards of them."""
