"""Training engines the planner can price besides this one: each a set of `SearchOptions`
that describe what the engine can run and how it runs it (`pipesched plan --engine`)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from pipeline.planner.errors import PlanError
from pipeline.planner.predict import PlanConfig

__all__ = ["ENGINES", "OUTSIDE_SPACE", "engine_options", "launch_lines", "outside_space"]

OUTSIDE_SPACE: MappingProxyType[str, str] = MappingProxyType({
    "context parallelism": "the sequence split over ranks (Megatron-Core's "
                           "--context-parallel-size, ring attention)",
    "ZeRO-2/3": "gradients (ZeRO-2) or parameters too (ZeRO-3, FSDP) sharded over dp, "
                "gathered and reduced every microbatch",
    "FP8": "FP8 GEMMs (Transformer Engine's --fp8-format)",
})
"""Parallelism and precision the search cannot express, as the engine does not run them:
`plan` refuses a request for one, by name, rather than price something else."""


def outside_space(asked: str, feature: str) -> PlanError:
    """The error for a request (`asked`, as the user wrote it) of a feature in
    `OUTSIDE_SPACE`."""
    return PlanError(f"{asked}: {feature} ({OUTSIDE_SPACE[feature]}) is outside pipesched "
                     f"plan's space: it searches pp × tp × dp with ZeRO-0/1, the schedules, "
                     f"microbatching and recomputation in bf16/fp16/fp32, what the engine runs; "
                     f"plan without it (add it to the engine first)")

MEGATRON_LM_2021: MappingProxyType[str, Any] = MappingProxyType({
    "schedules": ("1f1b", "interleaved"), "recompute_choices": ("none", "full"),
    "zero_stages": (0,), "overlap_grad_reduce": False,
    "overlap_grad_reduce_unpipelined": True, "step_gradient_bytes": 4.0,
    "uniform_layers": True, "interleaved_groups": True, "blocking_p2p": True,
    "grad_reduce_bytes": 2.0, "update_bytes": 52.0, "tied_reduce_at_step": False})
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

ENGINES: MappingProxyType[str, MappingProxyType[str, Any]] = MappingProxyType({
    "pipesched": MappingProxyType({}), "megatron-2021": MEGATRON_LM_2021})
"""Engine name: the `SearchOptions` fields that describe it (pipesched: the defaults)."""


def engine_options(name: str, **given: Any) -> dict[str, Any]:
    """`SearchOptions` keyword arguments for engine `name` with the user's `given` filters
    (None: not given). A filter may narrow the engine's schedules, ZeRO stages or
    recomputation modes, never widen them: what the engine cannot run is refused, named."""
    if name not in ENGINES:
        raise PlanError(f"engine {name!r} is not known; choose from {', '.join(ENGINES)}")
    options = dict(ENGINES[name])
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


def launch_lines(name: str, config: PlanConfig, global_batch: int, blocks: int) -> list[str]:
    """How to run `config` on engine `name`: this engine's `PipelineModule`/`PipelineEngine`
    arguments and `pipesched train` line; Megatron-LM 2021's `pretrain_gpt.py` arguments (the
    flags of its SC'21 scripts, `examples/sc21/CONFIG.sh` and `run_table_1.sh`; `blocks`
    transformer layers, for the layers per virtual stage)."""
    if name == "megatron-2021":
        flags = [f"--tensor-model-parallel-size {config.tp}",
                 f"--pipeline-model-parallel-size {config.pp}",
                 f"--micro-batch-size {config.microbatch_size}",
                 f"--global-batch-size {global_batch}"]
        if config.schedule == "interleaved":
            flags.append(f"--num-layers-per-virtual-pipeline-stage "
                         f"{blocks // (config.pp * config.chunks)}")
        if config.recompute == "full":
            flags.append("--checkpoint-activations")
        flags.append(f"--DDP-impl {'torch' if config.pp == 1 else 'local'}")
        return ["Megatron-LM (2021) pretrain_gpt.py " + " ".join(flags)]
    arguments = ", ".join(f"{key}={value!r}" for key, value in config.engine_arguments().items())
    return [f"PipelineModule/PipelineEngine: {arguments}", config.train_command(global_batch)]
