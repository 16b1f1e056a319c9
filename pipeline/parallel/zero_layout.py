"""Where ZeRO-1 shards lie in a region's flat buffer: every bucket split d ways (Megatron's layout).

Legend: d = data-parallel size, r = a rank's index in the dp group, N = the region's number of
elements, k = its number of buckets, s = the elements of one bucket one rank owns. The flat
buffer (parameters laid end to end, padding at the tail) is cut into k equal buckets of d·s
elements, and rank r owns the r-th d-th of each:

    flat buffer | bucket 0              | bucket 1              | ... | bucket k-1 (+ pad) |
    owner       | r=0 | r=1 | ... | d-1 | r=0 | r=1 | ... | d-1 | ... | r=0 | ... | d-1  |

so a bucket's reduce-scatter hands every rank its own piece as soon as that bucket of the
last backward is final (the backward finalises the buffer's tail first), and the reduction
hides behind the whole backward, not only its last 1/d. Rank r's shard is the strided view
`flat.view(k, d, s)[:, r, :]`: one (k, s) tensor per region, so the fp32 master of fp32
parameters stays a view of them (no copy) and the optimizer keeps one tensor per region.
Equal buckets keep the padding below k·d elements: k = ceil(N / B) for buckets of at most B
elements, then s = ceil(N / (k·d)).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["ShardLayout"]


@dataclass(frozen=True)
class ShardLayout:
    """One region's buckets and shards (see the module's legend)."""

    numel: int
    """N: the region's elements (its parameters laid end to end)."""
    dp_size: int
    """d: ranks sharing the region."""
    num_buckets: int
    """k: equal buckets of d·s elements."""
    piece: int
    """s: the elements of one bucket a rank owns."""

    @classmethod
    def plan(cls, numel: int, dp_size: int, bucket_elements: int) -> ShardLayout:
        """The layout of `numel` elements over `dp_size` ranks in buckets of at most
        `bucket_elements` (rounded up to a multiple of d) each."""
        if numel < 0 or dp_size < 1 or bucket_elements < 1:
            raise ValueError(f"a ZeRO region needs numel >= 0, dp_size and bucket_elements "
                             f">= 1, got {numel}, {dp_size}, {bucket_elements}")
        per_rank = max(1, bucket_elements // dp_size)
        filled = max(1, numel)  # empty parameters still get one (padding) element per rank
        num_buckets = math.ceil(filled / (per_rank * dp_size))
        return cls(numel, dp_size, num_buckets, math.ceil(filled / (num_buckets * dp_size)))

    @property
    def size(self) -> int:
        """Elements of the padded flat buffer: k·d·s."""
        return self.num_buckets * self.dp_size * self.piece

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns: k·s."""
        return self.num_buckets * self.piece

    def bucket(self, b: int) -> tuple[int, int]:
        """[start, end) of bucket b in the flat buffer."""
        start = b * self.dp_size * self.piece
        return start, start + self.dp_size * self.piece

    def owned(self, b: int, rank: int) -> tuple[int, int]:
        """[start, end) of bucket b's piece that `rank` owns, in the flat buffer."""
        start = (b * self.dp_size + rank) * self.piece
        return start, start + self.piece

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s shard of a flat buffer of this layout: a (k, s) strided view."""
        return flat.view(self.num_buckets, self.dp_size, self.piece)[:, rank, :]

    def buckets_of(self, offset: int, numel: int) -> range:
        """The buckets that elements [offset, offset + numel) meet (none when empty)."""
        width = self.dp_size * self.piece
        if numel < 1:
            return range(0)
        return range(offset // width, (offset + numel - 1) // width + 1)

    def overlaps(self, offset: int, numel: int, rank: int
                 ) -> Iterator[tuple[int, slice, slice]]:
        """Where `rank`'s shard meets elements [offset, offset + numel): (bucket b, the range
        within those elements, the range within row b of the shard)."""
        for b in self.buckets_of(offset, numel):
            first, last = self.owned(b, rank)
            lo, hi = max(first, offset), min(last, offset + numel)
            if lo < hi:
                yield b, slice(lo - offset, hi - offset), slice(lo - first, hi - first)
