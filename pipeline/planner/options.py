"""What a search may vary besides the grid, and how the engine it models runs: the search's
options (`SearchOptions`), validated once."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.planner.data_parallel import ADAM_UPDATE_BYTES
from pipeline.planner.errors import PlanError
from pipeline.planner.expert_grad_sync import check_expert_grad_group
from pipeline.planner.memory import GRAD_BYTES
from pipeline.planner.moe_shape import check_routing_imbalance
from pipeline.planner.node_limited import DISPATCHERS
from pipeline.planner.pricing import TP_OVERLAPS
from schedules import SCHEDULES

__all__ = ["CONTROLLABLE", "CP_ATTENTIONS", "RECOMPUTE_CHOICES", "TRAINING_SCHEDULES",
           "UNPRICED", "SearchOptions"]

UNPRICED = ("forward-only", "zb-optimal")
"""Not searched. forward-only trains nothing. zb-optimal proves its order with a solver
(up to 10 s per configuration, thousands of configurations a search): the searched
zero-bubble family (zb-auto, zb-v-auto, interleaved-zb) stands for it."""
CONTROLLABLE = ("v-half", "v-min")
TRAINING_SCHEDULES = tuple(name for name in SCHEDULES if name not in UNPRICED)


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the search may vary besides the grid."""

    schedules: tuple[str, ...] = TRAINING_SCHEDULES
    max_chunks: int = 4
    """Largest v tried for schedules with a free chunk count (interleaved, looped-bfs)."""
    recompute: bool = True
    """Also try activation recomputation (selective, full, partial)."""
    tensor_parallel: tuple[int, ...] | None = None
    """tp sizes to try; None: every divisor of the devices per node that divides the heads."""
    pipeline_parallel: tuple[int, ...] | None = None
    """pp sizes to try; None: every divisor of the devices."""
    data_parallel: tuple[int, ...] | None = None
    """dp sizes to try; None: every size the devices and the global batch allow."""
    microbatch_sizes: tuple[int, ...] | None = None
    """Samples per microbatch to try; None: every divisor of a replica's batch."""
    expert_parallel: tuple[int, ...] | None = None
    """ep sizes to try for a mixture-of-experts model; None: every divisor of dp that
    divides the experts (`expert_parallel.expert_sizes`)."""
    context_parallel: tuple[int, ...] = (1,)
    """cp sizes to try (context parallelism; each must cut the sequence into 2·cp chunks)."""
    prices_experts: bool = True
    """The engine's mixture-of-experts runs are priced (this engine's expert parallelism);
    False: a MoE model is refused by name for this engine."""
    zero_stages: tuple[int, ...] | None = None
    """ZeRO stages to try (0-3); None: 0 and 1 where dp > 1 (2 and 3 only when asked:
    `grid._zero_stages`)."""
    recompute_choices: tuple[str | bool, ...] | None = None
    """Recomputation modes to try: none, selective (attention's core), full (every layer),
    partial (full on the first k layers of each stage, k a quarter, half and three quarters
    of a stage's layers); False / True are none / full. None: all four when `recompute`,
    else none."""
    step_gradient_bytes: float = 0.0
    """Bytes per parameter the engine holds at its optimizer step only
    (`PlanContext.step_gradient_bytes`; 4 for Megatron-LM 2021's fp32 gradient copies)."""
    update_bytes: float = ADAM_UPDATE_BYTES
    """Memory traffic of the optimizer step per parameter (`PlanContext.update_bytes`; 52
    for Megatron-LM 2021's mixed-precision step)."""
    overlap_grad_reduce: bool = True
    """Price the data-parallel reduction overlapped with the last backward (the engine's
    hooks); False: after the pipeline drains (`PlanContext.overlap_grad_reduce`)."""
    overlap_grad_reduce_unpipelined: bool = False
    """With `overlap_grad_reduce` False, still overlap it where pp = 1
    (`PlanContext.overlap_grad_reduce_unpipelined`: Megatron-LM 2021's torch DDP)."""
    uniform_layers: bool = False
    """Split as Megatron-LM does: the blocks evenly over the p·v stages (p·v must divide
    them), the embedding on the first stage, the head and loss on the last; False: the
    exact partitioner balances the stages' costs (this engine)."""
    interleaved_groups: bool = False
    """The interleaved schedule only where Megatron-LM 2021 runs it: p > 2 (`arguments.py`:
    "pipeline-model-parallel size should be greater than 2 with interleaved schedule") and
    m a multiple of p (`training.py`: "number of microbatches is not divisible by
    pipeline-parallel size when using interleaved schedule")."""
    blocking_p2p: bool = False
    """Price point-to-point messages as blocking both ranks (`PlanContext.blocking_p2p`)."""
    grad_reduce_bytes: float = GRAD_BYTES
    """Bytes per gradient element in the data-parallel reduction
    (`PlanContext.grad_reduce_bytes`; 2 for Megatron-LM 2021's fp16 all-reduce)."""
    tied_reduce_at_step: bool = True
    """Tied weights reduced over dp at STEP (this engine); False: with their stage's other
    gradients (Megatron-LM; `PlanContext.tied_reduce_at_step`)."""
    overlap_param_gather: bool = False
    """Price ZeRO-1's parameter all-gather overlapped with the next step's forwards (the
    engine's `overlap_param_gather`, `PlanContext.overlap_param_gather`); False: exposed."""
    tp_overlap: str = "none"
    """How the engine hides tensor-parallel collectives (`pricing.TP_OVERLAPS`)."""
    two_batch_overlap: bool = False
    """Price the engine's `two_batch_overlap` on MoE configurations (ep > 1, microbatches
    of two samples or more): a forward outside an F&B pair as two halves taking turns at
    their all-to-alls (`PlanContext.two_batch_overlap`); False: exposed."""
    expert_tensor_parallel: bool = False
    """Split each MoE expert over the tp group too, expert tensor parallelism = tp at every
    tp searched (the engine's `expert_tensor_parallel=tp`, `pipesched train
    --expert-tensor-parallel`, Megatron-Core's `--expert-tensor-parallel-size`): its GEMMs
    1/t wide on the group's gathered rows (`expert_kernels`), the gather and reduce-scatter
    priced (`pricing.expert_tp_seconds`), its parameters over tp · ep; False: whole on its ep
    rank (Megatron-Core's `--expert-tensor-parallel-size 1`)."""
    moe_dispatcher: str = "alltoall"
    """How the engine dispatches tokens to experts (`node_limited.DISPATCHERS`): one copy
    per (token, expert) pair, or one per destination node (deepep)."""
    routing_imbalance: float | None = None
    """The busiest expert-parallel rank's routed tokens over the mean, as measured on the
    user's runs (`pipesched plan --routing-imbalance`; a number >= 1): the MoE blocks'
    expert compute and all-to-all priced at it (`expert_kernels.rank_load_ratio`); None: a
    balanced router's sampling floor (`routing_load.busiest_rank_ratio`)."""
    state_bytes: tuple[float, float, float] | None = None
    """(parameter, gradient, optimizer) bytes per parameter of another engine
    (`PlanContext.state_bytes`); None: this engine's."""
    cp_attention: str = "all-gather"
    """How context-parallel attention moves K/V (`CP_ATTENTIONS`): this engine's
    "all-gather", or Megatron-Core's --cp-comm-type (`context_comm.CP_COMM_TYPES`): "ring"
    (p2p, Transformer Engine's ring overlapped with the attention), "a2a" (Q, K, V and O
    all-to-all over cp, exposed) or "kv-allgather" (allgather: K/V all-gathered, dK/dV
    reduce-scattered, exposed)."""
    expert_grad_group: str = "tp_rank"
    """At tp > 1 with experts: "tp_rank", this engine's per-microbatch sum of the MoE
    gradients over tp and its expert group of the d / ep ranks of one tp rank; "megatron",
    Megatron-Core's once-a-step reduction over t·d / ep (`expert_grad_sync`)."""
    p2p_overlap_interleaved: bool = False
    """`PlanContext.p2p_overlap_interleaved`: interleaved messages overlap, 1F1B's block."""
    p2p_gather: bool = True
    """`PlanContext.p2p_gather`: blocking messages are gathered over NVLink."""
    interleaved_min_pp: int = 3
    """With `interleaved_groups`, the fewest stages interleaving runs on: 3 for
    Megatron-LM 2021 (p > 2), 2 for Megatron-Core with --overlap-p2p-communication."""
    top: int = 10
    """Configurations kept exactly ranked (the bound never skips one of them)."""
    prune: bool = True
    """Drop a configuration whose memory floor is over the device's, and skip one that its
    lower bounds show can be neither in the top nor on the Pareto front; False: price every
    configuration's exact memory and simulate every one that fits (the reference the tests
    compare the pruned search with)."""
    zb_auto_max: int = 1024
    """zb-auto (a greedy search per configuration, ~p²·m work) only where p·m is at most
    this; larger pipelines get the fixed zero-bubble schedules (zb-h1, zb-h2, zb-v)."""
    searched_max: int = 32
    """zb-v-auto and interleaved-zb (searches of several orders per configuration, 3-6×
    zb-auto's time: 0.2 s at p·m = 128, 0.6 s at 512 here) only where p·m is at most this:
    the 64-device search takes 6 s at 32, 9 s at 64, 15 s at 128."""

    controllable_max: int = 1024
    """v-half and v-min (built from a block, then squeezed: ~p²·m work, 9 s at p = 64,
    m = 512 here, 3 s at p·m = 4096) only where p·m is at most this; larger pipelines get
    the other V-shaped schedules (zb-v, dualpipev)."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.schedules if name not in TRAINING_SCHEDULES]
        if unknown or not self.schedules:
            raise PlanError(f"schedules {unknown or '(none)'} are not training schedules; "
                            f"choose from {', '.join(TRAINING_SCHEDULES)}")
        for name in ("max_chunks", "top", "zb_auto_max", "searched_max", "controllable_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a whole number >= 1")
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel",
                     "microbatch_sizes", "expert_parallel", "context_parallel"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or any(
                    isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sizes)):
                raise PlanError(f"{name}={sizes!r} must be whole numbers >= 1")
        if self.zero_stages is not None and (not self.zero_stages or any(
                z not in (0, 1, 2, 3) or isinstance(z, bool) for z in self.zero_stages)):
            raise PlanError(f"zero_stages={self.zero_stages!r} must be ZeRO stages among "
                            f"0, 1, 2, 3")
        for name in ("step_gradient_bytes", "update_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise PlanError(f"{name}={value!r} must be a number of bytes >= 0")
        if isinstance(self.grad_reduce_bytes, bool) or not isinstance(
                self.grad_reduce_bytes, int | float) or not self.grad_reduce_bytes > 0:
            raise PlanError(f"grad_reduce_bytes={self.grad_reduce_bytes!r} must be a number "
                            f"> 0 (4 for fp32 gradients, 2 for fp16)")
        check_routing_imbalance(self.routing_imbalance)
        check_expert_grad_group(self.expert_grad_group)
        if self.cp_attention not in CP_ATTENTIONS:
            raise PlanError(f"cp_attention={self.cp_attention!r} must be one of "
                            f"{', '.join(CP_ATTENTIONS)}")
        if self.tp_overlap not in TP_OVERLAPS:
            raise PlanError(f"tp_overlap={self.tp_overlap!r} must be one of "
                            f"{', '.join(TP_OVERLAPS)}")
        if self.moe_dispatcher not in DISPATCHERS:
            raise PlanError(f"moe_dispatcher={self.moe_dispatcher!r} must be one of "
                            f"{', '.join(DISPATCHERS)}")
        if self.recompute_choices is not None and (not self.recompute_choices or any(
                not isinstance(x, bool) and x not in RECOMPUTE_CHOICES
                for x in self.recompute_choices)):
            raise PlanError(f"recompute_choices={self.recompute_choices!r} must be some of "
                            f"{', '.join(RECOMPUTE_CHOICES)} (or False / True)")

    def recompute_modes(self) -> tuple[str, ...]:
        """The recomputation modes searched, by name (`RECOMPUTE_CHOICES`)."""
        if self.recompute_choices is not None:
            return tuple(dict.fromkeys(
                ("full" if x else "none") if isinstance(x, bool) else x
                for x in self.recompute_choices))
        return RECOMPUTE_CHOICES if self.recompute else ("none",)


CP_ATTENTIONS = ("all-gather", "ring", "a2a", "kv-allgather")
"""How context-parallel attention may move K/V (`SearchOptions.cp_attention`)."""

RECOMPUTE_CHOICES = ("none", "selective", "full", "partial")
"""The recomputation modes the search knows (`SearchOptions.recompute_choices`)."""
