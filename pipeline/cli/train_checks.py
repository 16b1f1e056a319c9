"""`pipesched train`'s refusals: impossible flag combinations, a missing --model file and
sizes this host cannot hold, all before any rank starts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from schedules import generate_schedule

__all__ = ["check_experts", "check_model_file", "check_train_args", "demo_heads"]


def demo_heads(width: int) -> int:
    """Attention heads of the demo LM of hidden size `width`: 4, 2 or 1, whichever divides it."""
    return max(h for h in (4, 2, 1) if width % h == 0)


def check_model_file(model: str | None) -> None:
    """A --model naming a .py file that is not there, refused before torch is imported (a
    refusal in a fraction of a second, not after seconds of imports)."""
    module = (model or "").split(":", 1)[0]
    if module.endswith(".py") and not Path(module).is_file():
        raise ValueError(f"--model: no file {module}; give an existing .py path or an "
                         "importable module name")


def check_train_args(args: argparse.Namespace) -> int:
    """Refuse impossible combinations, and sizes this host cannot hold, before any process
    starts; return chunks per rank. Every check before the model's is torch-free."""
    schedule = generate_schedule(args.schedule, args.stages, args.microbatches, args.chunks)
    if not schedule.has_backward:  # it ended in "the step ended holding {'saved': 2}"
        raise ValueError(f"--schedule {args.schedule} runs forwards only (inference): train "
                         "needs a schedule with a backward, e.g. 1f1b, interleaved or zb-h1")
    chunks = schedule.chunks
    from pipeline.limits import check_local_ranks

    check_local_ranks(args.stages * args.data_parallel * args.cp * args.tp,
                      "--stages × --data-parallel × --cp × --tp")
    if not args.reshard_after_forward and args.zero_stage != 3:
        raise ValueError("--no-reshard-after-forward is ZeRO-3's: add --zero-stage 3")
    if args.cp > 1 and args.model is None:
        raise ValueError(f"--cp {args.cp}: the demo model has no context-parallel form; pass "
                         "--model with a recipe of context-parallel layers (e.g. "
                         "examples/hf_tensor_parallel_recipe.py:build), or --cp 1")
    if args.tp > 1 and args.model is None:
        raise ValueError(f"--tp {args.tp}: the demo model has no tensor-parallel form; pass "
                         "--model with a recipe of split layers (e.g. tensor_parallel_hf's), "
                         "or --tp 1")
    if args.expert_tensor_parallel not in (1, args.tp):
        raise ValueError(f"--expert-tensor-parallel {args.expert_tensor_parallel} must be 1 "
                         f"(experts whole) or --tp {args.tp} (experts split over tp)")
    if args.expert_parallel > 1:
        if args.model is None:
            raise ValueError(f"--expert-parallel {args.expert_parallel}: the demo model has no "
                             "experts; pass --model with MoE layers (e.g. "
                             "examples/hf_moe_recipe.py:build), or --expert-parallel 1")
        replicas = args.data_parallel * args.cp  # the engine carves ep from dp × cp
        if replicas % args.expert_parallel:
            sizes = [k for k in range(1, replicas + 1) if replicas % k == 0]
            over = f"--data-parallel {args.data_parallel}" + (
                f" × --cp {args.cp} = {replicas}" if args.cp > 1 else "")
            raise ValueError(
                f"--expert-parallel {args.expert_parallel} must divide {over} (the experts are "
                f"split over the data-parallel × context-parallel replicas); choose among "
                f"{sizes}")
    if args.two_batch_overlap and args.expert_parallel == 1:
        raise ValueError("--two-batch-overlap hides the expert all-to-all, which runs only "
                         "with --expert-parallel > 1; pass --expert-parallel E or drop "
                         "--two-batch-overlap")
    per_replica, left = divmod(args.batch_size, args.data_parallel)
    if left or per_replica % args.microbatches:
        raise ValueError(
            f"--batch-size {args.batch_size} must split into --data-parallel "
            f"{args.data_parallel} replicas of --microbatches {args.microbatches} equal "
            f"microbatches; use a multiple of {args.data_parallel * args.microbatches}")
    if args.model is not None:
        from pipeline.demo.user_model import check_recipe, load_recipe

        args.recipe = load_recipe(args.model)
        layers = len(args.recipe.layers)
        if layers < args.stages * chunks:
            raise ValueError(f"--model {args.model} has {layers} layers, too few for "
                             f"{args.stages} stages × {chunks} chunks; use fewer --stages")
        check_recipe(args.model, args.recipe, stages=args.stages, chunks=chunks,
                     batch_size=args.batch_size)
        if args.tp > 1:
            if args.recipe.check_tensor_parallel is None:
                raise ValueError(f"--tp {args.tp}: --model {args.model}'s recipe has no "
                                 "check_tensor_parallel, so it does not say its layers split "
                                 "over tp; set it (for tensor_parallel_hf layers: "
                                 "functools.partial(check_tensor_parallel_size, config)) or "
                                 "use --tp 1")
            args.recipe.check_tensor_parallel(args.tp)
        if args.cp > 1:
            if args.recipe.check_context_parallel is None:
                raise ValueError(f"--cp {args.cp}: --model {args.model}'s recipe has no "
                                 "check_context_parallel, so it does not say its layers "
                                 "split sequences; set it (for context_parallel_hf layers: "
                                 "functools.partial(check_context_parallel_sequence, length)) "
                                 "or use --cp 1")
            args.recipe.check_context_parallel(args.cp)
    layers = args.blocks + 2
    if args.model is None:  # a user's model (--model) has no size flags to estimate from
        from pipeline.demo.footprint import check_footprint
        from pipeline.demo.language_model import TinyLMConfig

        check_footprint(TinyLMConfig(width=args.width, blocks=args.blocks, seq_len=args.seq_len,
                                     heads=demo_heads(args.width)),
                        batch_size=args.batch_size, world_size=args.stages * args.data_parallel)
    if args.model is None and layers < args.stages * chunks:
        raise ValueError(f"{layers} layers (--blocks {args.blocks} + embedding + head) cannot "
                         f"fill {args.stages} stages × {chunks} chunks; raise --blocks to at "
                         f"least {args.stages * chunks - 2}")
    from viz import FIGURE_FORMATS, TRACE_FORMATS, check_output_path

    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {args.out}: cannot create the directory "
                         f"({error.strerror or error}); pass a writable --out DIR") from None
    for name in ("timeline.png", "loss.png"):
        check_output_path(args.out / name, FIGURE_FORMATS)
    check_output_path(args.out / "trace.json", TRACE_FORMATS)
    return chunks


def check_experts(layers: list[Any], ep: int, etp: int) -> None:
    """The --model's MoE layers against --expert-parallel and --expert-tensor-parallel; HF's
    whole-batch balancing loss (which needs `train_batch_balanced`, not the demo's
    `train_batch`) is refused."""
    from pipeline.moe.expert_parallel import check_expert_layers
    from pipeline.moe.layer import MoEFeedForward

    check_expert_layers(layers, ep)
    moe = [m for layer in layers for m in layer.modules() if isinstance(m, MoEFeedForward)]
    if etp > 1 and not moe:
        raise ValueError(f"--expert-tensor-parallel {etp}: --model has no MoE layers; use 1")
    downs: list[Any] = [m.experts.down_proj for m in moe]  # [E, H, I] each
    widths = sorted({int(down.shape[-1]) for down in downs})
    if any(width % etp for width in widths):
        raise ValueError(f"--expert-tensor-parallel {etp} must divide the experts' "
                         f"intermediate size {widths}; use 1")
    if any(isinstance(m, MoEFeedForward) and m.balance is not None
           for layer in layers for m in layer.modules()):
        raise ValueError("--model's MoE layers add HF's whole-batch load-balancing loss "
                         "(balancing 'hf-batch', output_router_logits=True), which pipesched "
                         "train does not run (it needs a census forward: pipeline.moe."
                         "balance_loss.train_batch_balanced): build them with "
                         "layers_from_hf(config, balancing='microbatch') (Megatron-Core's "
                         "per-microbatch loss), 'sequence', 'aux-free' or 'none'")
