"""Causal load balancing: the sequence cut into 2·cp chunks, rank i keeping chunks i and 2·cp−1−i.

Legend: S the sequence length, cp the context-parallel size, c = S / (2·cp) one chunk.
Under a causal mask chunk j attends to j + 1 chunks, so chunk i alone would leave rank
cp−1 with 2·cp−1 times rank 0's work; pairing i with its mirror 2·cp−1−i gives every rank
2·cp + 1 chunk-pairs of work (Megatron-Core's ``get_batch_on_this_cp_rank``):

    cp = 2, S = 8:  chunks  [0 1][2 3][4 5][6 7]
                    rank 0   c0              c3   -> positions 0 1 6 7
                    rank 1        c1    c2        -> positions 2 3 4 5
"""

from __future__ import annotations

import torch

from pipeline.errors import PipelineConfigError

__all__ = ["check_context_parallel_sequence", "gathered_positions", "rank_positions",
           "sequence_chunks", "shard_sequence"]


def sequence_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices (of 2·cp) that rank `cp_rank` keeps, in the order it holds them."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp - 1}")
    return cp_rank, 2 * cp - 1 - cp_rank


def check_context_parallel_sequence(length: int, cp: int) -> None:
    """Raise `PipelineConfigError` (one line: the values and the fix) unless a sequence of
    `length` tokens cuts into 2·cp equal chunks. Call it before ranks start."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise PipelineConfigError(f"context_parallel must be an int >= 1, got {cp!r}")
    if length % (2 * cp):
        fits = [k for k in range(1, length // 2 + 1) if length % (2 * k) == 0]
        raise PipelineConfigError(
            f"context_parallel={cp} cuts each sequence into 2·cp = {2 * cp} chunks, but the "
            f"sequence length {length} is not a multiple of {2 * cp}; pad the sequences to a "
            f"multiple of {2 * cp} (e.g. {length + (-length) % (2 * cp)}) or choose "
            f"context_parallel among {fits}")


def rank_positions(length: int, cp_rank: int, cp: int,
                   device: torch.device | None = None) -> torch.Tensor:
    """The global positions (0..length-1) of the tokens rank `cp_rank` holds, in its order."""
    check_context_parallel_sequence(length, cp)
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(j * chunk, (j + 1) * chunk, device=device)
                      for j in sequence_chunks(cp_rank, cp)])


def gathered_positions(length: int, cp: int, device: torch.device | None = None
                       ) -> torch.Tensor:
    """The global positions of the tokens an all-gather over the cp group concatenates
    (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([rank_positions(length, r, cp, device) for r in range(cp)])


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp: int, dim: int = 1
                   ) -> torch.Tensor:
    """Rank `cp_rank`'s two chunks of `tensor` along `dim`, concatenated."""
    length = tensor.shape[dim]
    if cp == 1:
        return tensor
    return tensor.index_select(dim, rank_positions(length, cp_rank, cp, tensor.device))
