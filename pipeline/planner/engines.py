"""Training engines the planner can price besides this one: each a set of `SearchOptions`
that describe what the engine can run and how it runs it (`pipesched plan --engine`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from pipeline.planner.errors import PlanError
from pipeline.planner.launch import launch_lines

__all__ = ["DEEPSPEED", "ENGINES", "ENGINE_PROFILES", "MEGATRON_CORE", "MOE_DISPATCHERS",
           "OUTSIDE_SPACE", "engine_options", "launch_lines", "outside_space"]

OUTSIDE_SPACE: MappingProxyType[str, str] = MappingProxyType({
    "context parallelism": "the sequence split over ranks: searched for --engine pipesched "
                           "and megatron-core only",
    "FP8": "FP8 GEMMs (Transformer Engine's --fp8-format)",
})
"""Parallelism and precision the search cannot express, as the engine does not run them:
`plan` refuses a request for one, by name, rather than price something else."""


def outside_space(asked: str, feature: str) -> PlanError:
    """The error for a request (`asked`, as the user wrote it) of a feature in
    `OUTSIDE_SPACE`."""
    return PlanError(f"{asked}: {feature} ({OUTSIDE_SPACE[feature]}) is outside pipesched "
                     f"plan's space: it searches pp × tp × dp with ZeRO-0 to 3, the schedules, "
                     f"microbatching and recomputation in bf16/fp16/fp32, what the engine runs; "
                     f"plan without it (add it to the engine first)")

MEGATRON_LM_2021: MappingProxyType[str, Any] = MappingProxyType({
    "schedules": ("1f1b", "interleaved"), "recompute_choices": ("none", "full"),
    "zero_stages": (0,), "overlap_grad_reduce": False,
    "overlap_grad_reduce_unpipelined": True, "step_gradient_bytes": 4.0,
    "uniform_layers": True, "interleaved_groups": True, "blocking_p2p": True,
    "grad_reduce_bytes": 2.0, "update_bytes": 52.0, "tied_reduce_at_step": False,
    "prices_experts": False})
"""Megatron-LM as Narayanan et al. 2021 ran it (SC'21; the code of April 2021, commit
f32a638d2d, and the paper's scripts `examples/sc21/`):
- its two schedules, interleaving only at p > 2 with m a multiple of p
  (`interleaved_groups`); no recomputation or full (`--checkpoint-activations`; selective
  came in 2022); no distributed optimizer (ZeRO-1 came later);
- the blocks split evenly, p·v dividing them, the embedding on the first stage, the head and
  loss on the last (`uniform_layers`);
- the gradient all-reduce in fp16 (`grad_reduce_bytes`, its default without
  --accumulate-allreduce-grads-in-fp32), overlapped with the backward by torch's DDP at
  p = 1 and after the pipeline flush above (`--DDP-impl torch` / `local` in the scripts);
- blocking point-to-point messages (`p2p_communication.py` waits on every
  `batch_isend_irecv`, then `torch.cuda.synchronize()`), scattered over the t ranks' links
  and gathered over NVLink (`blocking_p2p`);
- memory per parameter: 16 bytes through the pipeline (fp16 weights and gradients, fp32
  master weights, Adam's two moments), as this engine; torch DDP's buckets copy the fp16
  gradients at p = 1 (2 more, `PlanContext.torch_ddp`); at the optimizer step, when the
  activations are gone, fp32 copies of the gradients (`_copy_model_grads_to_main_grads`:
  `main_param.grad = model_param.grad.float()`, 4 more, `step_gradient_bytes`). A rank's
  peak is max(18P + activations, 22P) at p = 1 and max(16P + activations, 20P) above
  (`--DDP-impl local` flattens the gradients into one more copy for the all-reduce, 18P
  after the flush, below the step's);
- the word-embedding copy's gradient reduced over dp with the rest, then summed over the
  first and last stage (`tied_reduce_at_step` False);
- its optimizer step, memory traffic per parameter (`Float16OptimizerWithFloat16Params.step`):
  fp16 gradients to fp32 copies (read 2, write 4), unscale and inf check (read and write
  4), the gradient norm for clipping (read 4), apex's fused Adam (read parameter, gradient
  and both moments, write three: 28), fp32 weights back to fp16 (read 4, write 2): 52
  bytes (`update_bytes`; the clip's rescale, 8 more, only when the norm exceeds the clip,
  is not counted)."""

MEGATRON_CORE_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
"""The NVIDIA/Megatron-LM commit (2026-08-22) `MEGATRON_CORE` is read from."""

MEGATRON_CORE: MappingProxyType[str, Any] = MappingProxyType({
    "schedules": ("1f1b", "interleaved"),
    "recompute_choices": ("none", "selective", "full", "partial"),
    "zero_stages": (0, 1), "overlap_grad_reduce": True, "overlap_param_gather": True,
    "uniform_layers": True, "interleaved_groups": True, "interleaved_min_pp": 2,
    "blocking_p2p": True, "p2p_overlap_interleaved": True, "p2p_gather": False,
    "grad_reduce_bytes": 4.0, "update_bytes": 38.0, "tied_reduce_at_step": False,
    "tp_overlap": "megatron-core", "state_bytes": (2.0, 4.0, 12.0),
    "expert_grad_group": "megatron", "cp_attention": "ring"})
"""Megatron-Core as its current scripts run it (`MEGATRON_CORE_COMMIT`;
`examples/llama/train_llama3_8b_h100_fp8.sh`: --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather, and
--tp-comm-overlap where tp > 1):
- 1F1B and the interleaved schedule (`pipeline_parallel/schedules.py`); interleaving at
  p >= 2 with --overlap-p2p-communication (its default; `arguments.py`: "pipeline-model-
  parallel size should be greater than 2" only without it) and m a multiple of p (the
  microbatch group per virtual stage defaults to p, and `schedules.py` refuses a last
  group of fewer than p);
- the blocks split evenly, p·v dividing them (`arguments.py`: "Number of layers should be
  divisible by the pipeline-model-parallel size"; uneven splits need
  --decoder-first-pipeline-num-layers, not searched);
- recomputation: none, selective (--recompute-granularity selective), full, and full on the
  first k layers of each stage (--recompute-method block --recompute-num-layers k);
- the distributed optimizer (ZeRO-1) or none; bf16 weights (2 bytes), fp32 main
  gradients (4: bf16 accumulates and reduces in fp32 unless --grad-reduce-in-bf16,
  `arguments.py`), fp32 master weights and Adam's moments (12, sharded over dp with the
  distributed optimizer) (`state_bytes`); the step: fused Adam on the fp32 shard (28),
  the gradient norm (4), the bf16 copy of the weights (6): 38 (`update_bytes`);
- gradient reduce-scatter overlapped with the backward, parameter all-gather with the next
  forwards (--overlap-grad-reduce, --overlap-param-gather);
- 1F1B's point-to-point messages waited on (`p2p_communication.py`: `wait_on_reqs` True
  outside the interleaved schedule), the interleaved schedule's overlapped; under sequence
  parallelism each tp rank sends its own s/t part: nothing to gather (`p2p_gather`);
- tensor-parallel collectives overlapped with the GEMMs (--tp-comm-overlap, which
  `arguments.py` allows only with sequence parallelism: `ENGINE_PROFILES`), priced by
  `pricing.layer_tp_pass_seconds`;
- the tied word embeddings' gradient reduced with the rest (`tied_reduce_at_step` False).
- mixture-of-experts models with --expert-model-parallel-size ep and
  --expert-tensor-parallel-size 1 (the pick's line gives it: its default is tp), tp > 1
  beside it under sequence parallelism (`arguments.py` requires it with experts and tp):
  attention and the dense layers split over tp, the experts over ep only, each tp rank's
  s/t tokens through the all-to-all token dispatcher (`--moe-token-dispatcher-type
  alltoall`), the experts' gradients and distributed-optimizer shards over the t·d / ep
  ranks holding the same experts, once a step (`expert_grad_group` "megatron":
  `expert_parallel.expert_group`; this engine sums them over tp in every backward and
  shards them over d / ep, `expert_grad_sync`); priced as this
  engine's MoE is (one GEMM of the k·f_e width at balanced routing, ep carved from dp t
  ranks apart, not the newer "parallel folding" of ep over tp × dp).
- context parallelism with --context-parallel-size and --cp-comm-type p2p (its default):
  Transformer Engine's ring, the K/V exchange overlapped with each step's attention
  (`cp_attention` "ring": `context_ring`), cp ranks tp apart (`parallel_state.py`'s order
  "tp-cp-ep-dp-pp"); a2a and allgather when asked (`pipesched plan --cp-comm-type`,
  `context_comm`: exposed all-to-alls of Q, K, V, O, or K/V all-gathers and dK/dV
  reduce-scatters); the hierarchical a2a+p2p is not priced.
Not modelled: FP8, FSDP (`OUTSIDE_SPACE`)."""

DEEPSPEED_COMMIT = "38327e07f6cd39b63418f60cedd1651b0be3e7c3"
"""The microsoft/DeepSpeed commit (2025-02-21) `DEEPSPEED` is read from."""

DEEPSPEED: MappingProxyType[str, Any] = MappingProxyType({
    "schedules": ("1f1b",), "recompute_choices": ("none", "full"), "zero_stages": (0, 1),
    "overlap_grad_reduce": False, "blocking_p2p": True, "p2p_gather": True,
    "grad_reduce_bytes": 4.0, "update_bytes": 38.0, "tied_reduce_at_step": False,
    "state_bytes": (2.0, 6.0, 12.0), "prices_experts": False})
"""DeepSpeed's pipeline engine (`deepspeed/runtime/pipe/`, `DEEPSPEED_COMMIT`):
- one schedule, `TrainSchedule`: 1F1B (`schedule.py`);
- ZeRO 0 or 1 (`engine.py`: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
  parallelism");
- recomputation of whole layers (`activation_checkpoint_interval`) or none;
- the gradient all-reduce after the pipeline drains: `ReduceTiedGrads`, `ReduceGrads`,
  `OptimizerStep` end the schedule, never overlapped with a backward
  (`overlap_grad_reduce` False, the tied weights with the rest);
- blocking point-to-point messages (`p2p.py`: `dist.send` / `dist.recv`), each tp rank
  sending 1/t of the activation and the receiver all-gathering them
  (`pipe_partitioned`, on with tensor parallelism);
- bf16 with ZeRO-1 (`BF16_Optimizer`): bf16 weights (2), bf16 gradients and their fp32
  accumulation (6: `fp32_groups_gradients_flat` is `zeros_like` the whole flat bf16 group,
  full-size on every dp rank, not a shard), fp32 master weights and Adam's moments (12,
  sharded over dp)
  (`state_bytes`); fp32 gradients reduced (`_bf16_reduce_grads`);
- the stages cut by the planner's balanced partition (DeepSpeed's default
  partition_method="parameters" balances parameter counts instead: give the printed
  boundaries as `partition_method`, see `launch_lines`)."""

ENGINES: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType({
    "pipesched": MappingProxyType({}), "megatron-2021": MEGATRON_LM_2021,
    "megatron-core": MEGATRON_CORE, "deepspeed": DEEPSPEED})
"""Engine name: the `SearchOptions` fields that describe it (pipesched: the defaults)."""

ENGINE_PROFILES: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType({
    "megatron-core": MappingProxyType({"sequence_parallel": True}),
    "megatron-2021": MappingProxyType({"engine": "megatron-2021"})})
"""Engine name: how its model runs, for `load_model` (Megatron-Core's scripts turn on
sequence parallelism, which its --tp-comm-overlap requires; Megatron-LM 2021's code runs
its own element-wise kernels and recomputes the blocks only: `transformer_profile`'s
`engine`)."""


MOE_DISPATCHERS: MappingProxyType[str, tuple[str, ...]] = MappingProxyType({
    "pipesched": ("alltoall",), "megatron-core": ("alltoall", "deepep")})
"""Engine name: the token dispatchers it runs (`SearchOptions.moe_dispatcher`), its default
first. This engine's (`pipeline.moe.expert_parallel`) sends one copy per (token, expert)
pair; Megatron-Core's `--moe-token-dispatcher-type alltoall` likewise, and `flex` with
`--moe-flex-dispatcher-backend deepep` one per destination node (`node_limited`). The
other engines price no MoE (`prices_experts`)."""


def engine_options(name: str, **given: Any) -> dict[str, Any]:
    """`SearchOptions` keyword arguments for engine `name` with the user's `given` filters
    (None: not given). A filter may narrow the engine's schedules, ZeRO stages or
    recomputation modes, never widen them: what the engine cannot run is refused, named."""
    if name not in ENGINES:
        raise PlanError(f"engine {name!r} is not known; choose from {', '.join(ENGINES)}")
    options = dict(ENGINES[name])
    dispatcher = given.get("moe_dispatcher")
    if dispatcher is not None and dispatcher not in MOE_DISPATCHERS.get(name, ()):
        runs = MOE_DISPATCHERS.get(name)
        raise PlanError(f"{name} does not run the {dispatcher!r} token dispatcher; "
                        + (f"it runs {', '.join(runs)}" if runs else "it prices no MoE")
                        + "; drop --moe-dispatcher or choose another --engine")
    for key, value in given.items():
        if value is None:
            continue
        allowed = options.get(key)
        if isinstance(allowed, tuple):
            outside = [item for item in value if item not in allowed]
            if outside:
                raise PlanError(f"{name} cannot run {key} {', '.join(map(str, outside))}; "
                                f"it runs {', '.join(map(str, allowed))}")
        options[key] = value
    return options
