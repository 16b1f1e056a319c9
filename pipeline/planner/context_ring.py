"""Context parallelism as Megatron-Core runs it: K/V passed round the cp ring, overlapped."""

# Read from NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 and
# NVIDIA/TransformerEngine d0067d0da6cb01811b8072a7d304f0e00344ce2b (both 2026-08-22):
# - `megatron/training/arguments.py`: --cp-comm-type, default ["p2p"] (a2a and allgather:
#   `context_comm`; a2a+p2p is not priced); `megatron/core/extensions/transformer_engine.py`
#   (TEDotProductAttention) hands it to Transformer Engine's DotProductAttention.
# - `megatron/core/parallel_state.py`: order "tp-cp-ep-dp-pp", tp innermost, then cp, then
#   dp, then pp: the order `pipeline.parallel.topology` assumes, so cp neighbours are tp
#   ranks apart and a cp group spans cp·tp ranks (`context_parallel.context_table`'s stride).
# - `transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`,
#   `AttnFuncWithCPAndKVP2P` ("Exchange KV between CP ranks with P2P in ring topology ...
#   overlap current-step compute with next-step communication"). Forward: cp steps; at step
#   i < cp−1 the rank sends the K/V it holds (its own at step 0: k and v of its s/cp tokens,
#   h_kv/t heads) to the next rank and receives the previous rank's, while the attention of
#   step i runs on the K/V it holds; step i+1 waits for the receive. Backward: cp steps over
#   a [2, kv] buffer: step 0 sends the K/V, steps 1..cp−2 the K/V and the dK/dV accumulated
#   so far (one message of twice the bytes), step cp−1 the dK/dV only, each overlapped with
#   that step's attention backward, the last waited after it.
# With causal load balancing (2·cp chunks) every step does 1/cp of the rank's attention,
# which is 1/cp of the whole sequence's: a step's forward is the layer's attention core over
# cp², its backward twice that (the planner's backward of a GEMM is twice its forward;
# FlashAttention's 2.5× would hide a little more). A step costs max(message, attention):
# only the message's excess over the attention is exposed.

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.planner.context_parallel import gathered_kv_bytes
from pipeline.planner.pricing import layer_selective_seconds, p2p_seconds
from pipeline.planner.profile import LayerProfile

if TYPE_CHECKING:
    from pipeline.planner.stages import StageTable

__all__ = ["ring_layer_seconds"]


def ring_layer_seconds(layer: LayerProfile, table: StageTable, batch: int
                       ) -> tuple[float, float]:
    """(forward, backward) seconds one attention layer's K/V ring exposes on one cp rank of
    `table` for a microbatch of `batch` samples (module comment); (0, 0) without attention."""
    whole = gathered_kv_bytes(layer, table.tp) * batch
    if whole <= 0:
        return 0.0, 0.0
    cp, cluster = table.cp, table.cluster
    kv = whole / cp  # this rank's K and V: s/cp tokens
    span = cp * table.cp_stride  # the ring is as slow as its widest hop (the wrap-around)
    attention = layer_selective_seconds(layer, cluster, table.precision, batch,
                                        table.tp) / cp**2

    def exposed(nbytes: float, compute: float) -> float:
        return max(0.0, p2p_seconds(nbytes, span, cluster) - compute)

    forward = (cp - 1) * exposed(kv, attention)
    backward = 2 * exposed(kv, 2 * attention) + (cp - 2) * exposed(2 * kv, 2 * attention)
    return forward, backward
