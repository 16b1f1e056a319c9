"""A MoE block's MLP on one rank as the engines run it: the router, the token permutations
around the all-to-all, each local expert's own GEMMs on the busiest rank's rows, and the
shared expert, priced by the device model (`kernels.gemm_seconds`, element-wise streams).

What runs (Megatron-Core's all-to-all dispatcher, NVIDIA/Megatron-LM d98e8a64dd,
`megatron/core/transformer/moe/token_dispatcher.py` `MoEAlltoAllTokenDispatcher`, with
`moe_utils.permute`, `sort_chunks_by_idxs`, `unpermute`; this engine's
`pipeline.moe.expert_parallel.AllToAllDispatcher` runs the same steps), per MoE layer on a
rank routing n tokens (b·s/t with sequence parallelism: `expert_parallel`'s tp × ep), h
hidden, e bytes an element, L rows arriving at the rank (mean n·k; the busiest rank's
`routed_rows`):

1. router: logits n × E (a GEMM), top-k, softmax of the k, the dense probabilities and
   routing map [n, E], the auxiliary loss's scores (`topk_routing_with_score_function`);
2. permutation 1: gather the n·k routed rows (`tokens.index_select`);
3. all-to-all (`expert_parallel.expert_all_to_all`), then permutation 2: the received
   chunks sorted by local expert (`sort_chunks_by_idxs`: split and cat), when E/ep > 1;
4. each of the E/ep local experts: its gate/up GEMM, the activation, its down GEMM on its
   rows. `--moe-grouped-gemm`'s TEGroupedMLP (Transformer Engine's GroupedLinear,
   `general_grouped_gemm`: one cuBLAS GEMM per expert, NVIDIA/TransformerEngine
   `common/gemm/cublaslt_gemm.cu` `multi_stream_cublas_gemm`) and SequentialMLP / this
   engine's `pipeline.moe.experts.expert_outputs` (a loop over the local experts) both run
   one GEMM per expert, each quantized into its own tiles and waves: priced so, one after
   another (TE spreads them over 4 streams, where one's last partial wave may share the SMs
   with the next's first: not priced);
5. permutation 2 undone, the all-to-all back, then unpermute: the rows × their
   probabilities, scatter-added into n zeroed rows.

The backward runs each step's gradient (the permutations' as their inverse gathers and
scatters, the probabilities' gradient a reduction over h). The busiest ep rank sets the
layer's time: every rank waits for it at the combine all-to-all (`routing_load`).
"""

from __future__ import annotations

import math
from dataclasses import replace

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.kernels import (
    TILE_ROW_GRANULE,
    KernelTimes,
    LayerShape,
    elementwise_seconds,
    gemm_seconds,
    layer_kernel_times,
)
from pipeline.planner.moe_shape import RoutedExperts
from pipeline.planner.profile import LayerProfile
from pipeline.planner.routing_load import (
    busiest_rank_ratio,
    local_expert_variance,
    rows_distribution,
)

__all__ = ["block_kernel_times", "expert_gemm_times", "expert_rows", "gathered_rows",
           "moe_mlp_times", "permutation_times", "rank_load_ratio", "rank_tokens", "routed_rows",
           "router_times", "stage_load_ratio"]

Times = tuple[float, float, float]
"""(forward, input gradient, weight gradient) seconds."""


def rank_tokens(shape: LayerShape, batch: int, tp: int) -> int:
    """n: the tokens one rank routes per microbatch, its sequence slice b·s/(t·cp) (sequence
    parallelism, which experts beside tp > 1 require; context parallelism's cp ranks each
    route their own s/cp, `RoutedExperts.cp`)."""
    cp = shape.routed.cp if shape.routed is not None else 1
    return math.ceil(batch * shape.seq / (tp * cp))


def rank_load_ratio(routed: RoutedExperts, tokens: int, tp: int) -> float:
    """The busiest ep rank's rows over the mean n·k: 1 at ep = 1 (one rank runs every
    expert: all n·k rows, however they spread); the user's measured `imbalance` where given
    (at most ep: one rank cannot take more than all of its group's rows); else the
    sampling floor of a balanced router (`routing_load.busiest_rank_ratio`) over the
    independent ep groups that wait for each other inside the layer: the t of a replica,
    and at cp > 1 the cp / gcd(cp, ep) groups a replica's cp ranks fall in (consecutive
    replicas, cp-minor: their next attention all-gathers K/V over cp)."""
    if routed.ep == 1:
        return 1.0
    if routed.imbalance is not None:
        return min(routed.imbalance, float(routed.ep))
    sets = tp * routed.cp // math.gcd(routed.cp, routed.ep)
    return busiest_rank_ratio(tokens, routed.topk, routed.experts, routed.ep, sets)


def routed_rows(shape: LayerShape, batch: int, tp: int) -> float:
    """L: rows the busiest ep rank's experts run, n·k × `rank_load_ratio`."""
    assert shape.routed is not None
    tokens = rank_tokens(shape, batch, tp)
    return tokens * shape.routed.topk * rank_load_ratio(shape.routed, tokens, tp)


def gathered_rows(shape: LayerShape, batch: int, tp: int) -> float:
    """G: rows the busiest ep rank's experts run in a microbatch. At expert tensor
    parallelism 1, its own L (`routed_rows`). At t (`RoutedExperts.expert_tp`) the tp group
    gathers its t ranks' rows (each of the t routed its own n tokens through its own ep
    group): ep rank j's G is the sum of t such loads, one load of a pool of t·ep·n tokens,
    t·n·k × `rank_load_ratio` of t·n tokens in one set per replica's cp ranks."""
    routed = shape.routed
    assert routed is not None
    if routed.expert_tp == 1:
        return routed_rows(shape, batch, tp)
    tokens = rank_tokens(shape, batch, tp) * routed.expert_tp
    return tokens * routed.topk * rank_load_ratio(routed, tokens, 1)


def _linear(rows: int, inputs: int, outputs: int, cluster: ClusterSpec, precision: str,
            element: int) -> Times:
    """Y = X·W, X rows × inputs: forward, input-gradient and weight-gradient GEMMs."""
    def gemm(m: int, n: int, k: int) -> float:
        return gemm_seconds(m, n, k, cluster, precision, element=element)

    return gemm(rows, outputs, inputs), gemm(rows, inputs, outputs), gemm(inputs, outputs, rows)


def _mlp(rows: int, width: int, shape: LayerShape, cluster: ClusterSpec, precision: str
         ) -> Times:
    """One expert's (or the shared expert's) MLP on `rows` rows: gate and up at once (2f
    wide when gated), the activation as one fused pass (reads gate and up, writes one; 1.5×
    in the backward, as `kernels` prices a dense block's), down."""
    e, h, inner = shape.element, shape.hidden, 2 if shape.gated else 1
    up = _linear(rows, h, inner * width, cluster, precision, e)
    down = _linear(rows, width, h, cluster, precision, e)
    act = elementwise_seconds((inner + 1) * rows * width * e, cluster) if rows else 0.0
    return up[0] + down[0] + act, up[1] + down[1] + 1.5 * act, up[2] + down[2]


def expert_rows(shape: LayerShape, batch: int, tp: int) -> tuple[tuple[int, float], ...]:
    """(rows, probability): the distribution of the rows one of the busiest rank's E/ep
    local experts runs in a microbatch, whichever one: mean G·ep/E (`gathered_rows`: its
    own L, or its tp group's at expert tensor parallelism t, over t·n tokens), the
    balanced router's sampling variance about the rank's mean
    (`routing_load.local_expert_variance`), whole rows
    (`routing_load.rows_distribution`, binned within the GEMM tiles' row granule)."""
    routed = shape.routed
    assert routed is not None
    mean = gathered_rows(shape, batch, tp) / routed.local_experts
    variance = local_expert_variance(rank_tokens(shape, batch, tp) * routed.expert_tp,
                                     routed.topk, routed.experts, routed.ep)
    return rows_distribution(mean, variance, TILE_ROW_GRANULE)


def expert_gemm_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                      precision: str) -> Times:
    """The E/ep local experts on the busiest rank, one after another, each its own GEMMs
    (module docstring, step 4) on its own rows, at their expected time: E/ep × E[T(X)] over
    one expert's rows X (`expert_rows`), plus the shared expert: one dense MLP on the rank's
    n tokens at its full width f_s. At expert tensor parallelism t each expert's GEMMs are
    1/t of f_e wide (gate/up column-split, down row-split) on its tp group's gathered rows;
    the shared expert stays whole.

    Why the expectation of one expert's time, times E/ep: the rank's experts' rows X_j sum
    to its load, and Σ_j T(X_j) is the same sum whatever their order, so E[Σ_j T(X_j)] =
    Σ_j E[T(X_j)], and the X_j share one law (`routing_load.local_expert_variance`); the
    sorted experts' expected rows (order statistics) at T(E[X_(i)]) priced each GEMM's tile
    quantization at a point the rows rarely sit on (Jensen: E[T(X)] != T(E[X]) for a step
    function T)."""
    routed = shape.routed
    assert routed is not None
    expected = [0.0, 0.0, 0.0]
    width = math.ceil(routed.expert_ffn / routed.expert_tp)  # its 1/t at expert tp t
    for rows, probability in expert_rows(shape, batch, tp):
        for i, seconds in enumerate(_mlp(rows, width, shape, cluster, precision)):
            expected[i] += routed.local_experts * probability * seconds
    if routed.shared_ffn:
        shared = _mlp(rank_tokens(shape, batch, tp), routed.shared_ffn, shape, cluster,
                      precision)
        expected = [a + b for a, b in zip(expected, shared, strict=True)]
    return expected[0], expected[1], expected[2]


def router_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                 precision: str) -> Times:
    """The router on the rank's n tokens: the logits GEMM n × h · h × E (its three GEMMs),
    and its element-wise passes over the n × E scores (fp32, 4 bytes; `moe_utils.
    topk_routing_with_score_function`, `compute_routing_scores_for_aux_loss`): forward
    top-k (read), the dense probabilities and routing map scattered into zeros (write 4 + 1),
    the auxiliary loss's softmax (read, write) and its sum over tokens (read): 21 bytes an
    element in 5 kernels, plus the k probabilities and int64 indices (12 bytes a choice);
    backward the loss's softmax backward (read 2, write 1) and the probabilities' gradient
    gathered back through the top-k (read, write): 20 bytes an element in 3 kernels."""
    routed = shape.routed
    assert routed is not None
    n, experts = rank_tokens(shape, batch, tp), routed.experts
    logits = _linear(n, shape.hidden, experts, cluster, precision, shape.element)
    forward = elementwise_seconds(21 * n * experts + 12 * n * routed.topk, cluster, 5)
    backward = elementwise_seconds(20 * n * experts, cluster, 3)
    return logits[0] + forward, logits[1] + backward, logits[2]


def permutation_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec) -> Times:
    """The token permutations as memory-bound streams (module docstring, steps 2, 3, 5), each
    row h·e bytes; the rank's own n·k rows (balanced: every rank sends exactly n·k) for
    permutation 1 and unpermute, the busiest rank's L rows for permutation 2.

    forward: gather n·k rows (read, write: 2 n·k) after sorting the [E, n] map (1 kernel);
    sort L rows by local expert (read, write 2 L) and back (2 L), when E/ep > 1; unpermute:
    × probabilities (read, write: 2 n·k), zeros (n), scatter-add (read n·k, write n·k):
    4 n·k + n, 3 kernels.
    backward: unpermute's, gather the output gradient to n·k rows (read, write 2 n·k), × the
    probabilities (2 n·k) and the probabilities' gradient, a row-wise dot of the gradient
    and the rows (read 2 n·k): 6 n·k, 3 kernels; the two sorts' (2 L each); the gather's,
    zeros and scatter-add into n rows: n + 2 n·k, 2 kernels.
    At expert tensor parallelism t (`pipeline.moe.expert_tensor_parallel`), each pass also:
    the own L rows repeated t times for the gather (read L, write t·L), the G gathered rows
    regrouped by expert and back (2 G each), the t partial sums of the own rows (read t·L,
    write L): 2(t+1)·L + 4 G, 4 kernels (the backward runs their inverses)."""
    routed = shape.routed
    assert routed is not None
    row, n = shape.hidden * shape.element, rank_tokens(shape, batch, tp)
    slots = n * routed.topk
    rows = routed_rows(shape, batch, tp)
    sorts = 2 if routed.local_experts > 1 else 0
    forward = elementwise_seconds((2 * slots + 2 * sorts * rows + 4 * slots + n) * row,
                                  cluster, 2 + sorts + 3)
    backward = elementwise_seconds((6 * slots + 2 * sorts * rows + n + 2 * slots) * row,
                                   cluster, 3 + sorts + 2)
    if routed.expert_tp > 1:  # the tp group's rows around its experts, each pass
        t, gathered = routed.expert_tp, gathered_rows(shape, batch, tp)
        extra = elementwise_seconds((2 * (t + 1) * rows + 4 * gathered) * row, cluster, 4)
        forward, backward = forward + extra, backward + extra
    return forward, backward, 0.0


def moe_mlp_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                  precision: str) -> Times:
    """A MoE block's MLP on the busiest rank of its ep group: router, permutations, the
    local experts' and the shared expert's GEMMs (`router_times`, `permutation_times`,
    `expert_gemm_times`); (0, 0, 0) for a layer without routed experts. At cp > 1 (each rank
    routing its own b·s/(t·cp) tokens, `rank_tokens`) the busiest rank's times × cp: the
    stage table prices a layer on the whole sequence and divides it by cp
    (`StageTable._price`), which leaves the rank's own."""
    if shape.routed is None or shape.role != "block":
        return 0.0, 0.0, 0.0
    parts = (router_times(shape, batch, tp, cluster, precision),
             permutation_times(shape, batch, tp, cluster),
             expert_gemm_times(shape, batch, tp, cluster, precision))
    # a cp rank's own s/cp tokens, times cp: `StageTable` divides every layer's time by cp
    scale = shape.routed.cp
    return (scale * sum(p[0] for p in parts), scale * sum(p[1] for p in parts),
            scale * sum(p[2] for p in parts))


def block_kernel_times(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                       precision: str) -> KernelTimes:
    """`kernels.layer_kernel_times` (a MoE block's attention, norms and residuals) with the
    block's MoE MLP added (`moe_mlp_times`): what `pricing` prices a layer's kernels by."""
    rest = layer_kernel_times(shape, batch, tp, cluster, precision)
    moe = moe_mlp_times(shape, batch, tp, cluster, precision)
    return KernelTimes(rest.forward + moe[0], rest.input_grad + moe[1],
                       rest.weight_grad + moe[2])


def stage_load_ratio(layers: tuple[LayerProfile, ...], *, batch: int, tp: int,
                     ep: int) -> float:
    """The busiest ep rank's share of a stage's all-to-all bytes over the even share: it
    receives L rows in the dispatch and sends them back in the combine, L = n·k ×
    `rank_load_ratio` (the stage's first MoE layer's; a model's MoE layers share E and k);
    1 for a stage without one, or at ep = 1."""
    for layer in layers:
        if layer.shape is not None and layer.shape.routed is not None:
            routed = replace(layer.shape.routed, ep=ep)
            return rank_load_ratio(routed, rank_tokens(layer.shape, batch, tp), tp)
    return 1.0
