"""Point-to-point messages that block both ranks, as Megatron-LM 2021 sends them, priced into
the forward and input-gradient ops of the stages on either side of a rank boundary."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.pricing import allgather_seconds, p2p_link

__all__ = ["blocking_p2p"]


def blocking_p2p(cluster: ClusterSpec, placement: Sequence[int], *, tp: int, devices: int,
                 forward: np.ndarray, input_grad: np.ndarray, boundary_bytes: np.ndarray,
                 gather: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Forward and input-gradient seconds per stage with blocking messages in them.

    Legend: stage s sends its output to s + 1 after F and receives the gradient of that
    output before B; a message crosses ranks where the two stages' ranks (`placement`)
    differ, over the link spanning all `devices` (the pipeline outermost in the rank order).
    Each of the t tensor-parallel ranks sends 1/t of the bytes over its own link (scatter),
    the receivers all-gather the pieces over NVLink (gather). Blocking: the sender's op ends
    when its message is through (α + n/(tβ), `pricing.p2p_link`); the receiver's op begins
    with the all-gather.
    The dependency itself then adds no delay: its cost is in the ops. Without `gather`
    (Megatron-Core: under sequence parallelism each tp rank's part is its own) no
    all-gather."""
    where = np.asarray(placement)
    crosses = where[:-1] != where[1:]  # between stage s and s + 1
    bandwidth, latency = p2p_link(cluster, devices, float(np.max(boundary_bytes, initial=0)) / tp)
    message = np.where(crosses, latency + boundary_bytes[:-1] / tp / bandwidth, 0.0)
    if cluster.nccl_arch:  # NCCL's all-gather over the tp ranks
        ring = np.array([allgather_seconds(float(x), tp, 1, cluster)
                         for x in boundary_bytes[:-1]])
    else:  # a ring all-gather: (t-1)/t of the bytes in, t-1 hops
        intra_bandwidth, intra_latency = cluster.link(tp)
        ring = (tp - 1) / tp * boundary_bytes[:-1] / intra_bandwidth + (tp - 1) * intra_latency
    gathered = np.where(crosses & gather, ring, 0.0)
    forward, input_grad = forward.copy(), input_grad.copy()
    forward[:-1] += message  # F of s sends its output to s + 1
    forward[1:] += gathered  # F of s + 1 gathers its input
    input_grad[1:] += message  # B of s + 1 sends its input's gradient to s
    input_grad[:-1] += gathered  # B of s gathers its output's gradient
    return forward, input_grad
