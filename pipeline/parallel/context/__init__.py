"""Context parallelism: each sequence split over cp ranks, attention over the cp group."""

from pipeline.parallel.context.attention import context_mask, context_parallel_attention
from pipeline.parallel.context.sharding import (
    check_context_parallel_sequence,
    gathered_positions,
    rank_positions,
    sequence_chunks,
    shard_sequence,
)

__all__ = [
    "check_context_parallel_sequence",
    "context_mask",
    "context_parallel_attention",
    "gathered_positions",
    "rank_positions",
    "sequence_chunks",
    "shard_sequence",
]
