"""Refuse a plan request no configuration can satisfy, naming the cause, before any pricing."""

from __future__ import annotations

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.context_comm import model_a2a_refusal
from pipeline.planner.errors import PlanError
from pipeline.planner.expert_parallel import expert_tp_refusal
from pipeline.planner.grid import divisors
from pipeline.planner.options import SearchOptions
from pipeline.planner.profile import ModelProfile

__all__ = ["check_request"]


def check_request(model: ModelProfile, cluster: ClusterSpec, global_batch: int,
                  options: SearchOptions) -> None:
    """Refuse, before any pricing, a request no configuration can satisfy, naming the cause:
    a tp that does not divide the heads or the devices, a pp or dp that does not divide the
    devices, a dp that does not divide the global batch."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch {global_batch!r} must be a whole number >= 1")
    devices = cluster.num_devices
    problems = []
    tp_sizes = options.tensor_parallel or ()
    if any(size > 1 for size in tp_sizes) and not model.tensor_parallel_ok:
        raise PlanError(f"tensor_parallel {list(tp_sizes)}: {model.name} has measured or "
                        f"cost-file layers, which cannot be split over tensor-parallel ranks; "
                        f"give a transformer shape, or tensor_parallel 1")
    if model.heads is not None:
        valid = [d for d in divisors(model.heads) if devices % d == 0
                 and not model.tp_refusals(d)]
        for t in tp_sizes:
            refused = model.tp_refusals(t)
            if refused:
                problems.append(f"tensor-parallel size {t} does not divide the model's "
                                f"{', '.join(refused)} (use one of "
                                f"{', '.join(map(str, valid))})")
    for what, sizes in (("tensor-parallel", tp_sizes),
                        ("pipeline-parallel", options.pipeline_parallel or ()),
                        ("data-parallel", options.data_parallel or ())):
        bad = [size for size in sizes if devices % size]
        if bad:
            problems.append(f"{what} size {', '.join(map(str, bad))} does not divide the "
                            f"{devices} devices (use a divisor of {devices}, or change --nodes)")
    bad = [size for size in options.data_parallel or () if global_batch % size]
    if bad:
        problems.append(f"data-parallel size {', '.join(map(str, bad))} does not divide the "
                        f"global batch {global_batch}")
    problems += _expert_problems(model, options)
    for cp in options.context_parallel:
        if cp > 1 and (model.seq % (2 * cp) or devices % cp):
            problems.append(f"context-parallel size {cp} needs 2·cp = {2 * cp} to divide the "
                            f"sequence {model.seq} and cp to divide the {devices} devices; "
                            f"choose a cp with both")
        elif cp > 1 and any(layer.shape is not None and layer.shape.latent is not None
                            for layer in model.layers):
            problems.append(f"context-parallel size {cp}: {model.name} has multi-head latent "
                            "attention, which the engine's context parallelism does not run "
                            "(its attention function is not swapped for MLA); use cp 1")
    if options.cp_attention == "a2a":
        problems += _a2a_problems(model, cluster, options)
    if problems:
        raise PlanError("; ".join(problems))


def _a2a_problems(model: ModelProfile, cluster: ClusterSpec, options: SearchOptions
                  ) -> list[str]:
    """The (tp, cp) pairs asked that --cp-comm-type a2a cannot run (each tp asked with each
    cp > 1; without --tp, a cp no searched tp leaves runnable), the grid skipping the rest."""
    tps = options.tensor_parallel or (tuple(
        t for t in divisors(cluster.devices_per_node) if not model.tp_refusals(t))
        if model.tensor_parallel_ok else (1,))
    problems = []
    for cp in (c for c in options.context_parallel if c > 1):
        refused = [model_a2a_refusal(model, t, cp) for t in tps]
        if options.tensor_parallel is not None:
            problems += [f"{why}; choose a tp · cp dividing them, or another --cp-comm-type"
                         for why in refused if why]
        elif refused and all(refused):
            problems.append(f"{refused[0]} at every tp searched ({', '.join(map(str, tps))}); "
                            f"choose a cp dividing the heads per tp rank, or another "
                            f"--cp-comm-type")
    return problems


def _expert_problems(model: ModelProfile, options: SearchOptions) -> list[str]:
    """What of the request the engine cannot run with the model's experts: expert tensor
    parallelism without experts, or at a tp that does not divide f_e; an engine whose
    MoE runs are not priced, tp > 1 with experts but without sequence parallelism, an ep
    size that is not 1 for a dense model, or that does not divide the experts or any of the
    data-parallel sizes asked for."""
    sizes, experts = options.expert_parallel or (), model.experts
    if not experts:
        bad = [size for size in sizes if size > 1]
        dense = [f"expert-parallel size {', '.join(map(str, bad))}: {model.name} has no "
                 "experts (use --ep 1 or give a mixture-of-experts model)"] if bad else []
        if options.expert_tensor_parallel:
            dense.append(f"expert tensor parallelism: {model.name} has no experts to split "
                         f"over tp (drop --expert-tensor-parallel or give a "
                         f"mixture-of-experts model)")
        return dense
    if not options.prices_experts:
        return [f"{model.name} is a mixture of experts; the engine these options model "
                "(--engine) has its MoE runs unpriced: plan it with --engine pipesched"]
    problems = []
    if any(size > 1 for size in options.tensor_parallel or ()) \
            and not model.sequence_parallel:
        problems.append(f"tensor-parallel size {', '.join(map(str, options.tensor_parallel or ()))}"
                        f": tensor parallelism with experts runs with sequence parallelism "
                        f"only (each tp rank routes its s/t tokens; Megatron-Core: \"sequence "
                        f"parallelism must be used\" with experts and tp); add "
                        f"--sequence-parallel, or use --tp 1 and --ep for the experts")
    if options.expert_tensor_parallel:
        refused = [f"{t} ({expert_tp_refusal(model, t)})" for t in options.tensor_parallel or ()
                   if expert_tp_refusal(model, t)]
        if refused:
            problems.append(f"tensor-parallel size {', '.join(refused)}: expert tensor "
                            f"parallelism splits each expert's intermediate size over tp, "
                            f"which must divide it; choose a tp dividing it or drop "
                            f"--expert-tensor-parallel")
    valid = [k for k in range(1, experts + 1) if experts % k == 0]
    bad = [size for size in sizes if experts % size]
    if bad:
        problems.append(f"expert-parallel size {', '.join(map(str, bad))} does not divide "
                        f"the model's {experts} experts (each ep rank holds E / ep); use one "
                        f"of {', '.join(map(str, valid))}")
    if options.data_parallel is not None:
        replicas = [dp * cp for dp in options.data_parallel for cp in options.context_parallel]
        bad = [size for size in sizes if not any(d % size == 0 for d in replicas)]
        if bad:
            dps = ", ".join(map(str, sorted(set(replicas))))
            fits = [k for k in valid if any(d % k == 0 for d in replicas)]
            what = "data-parallel sizes" if options.context_parallel == (1,) \
                else "data-parallel × context-parallel sizes"
            problems.append(f"expert-parallel size {', '.join(map(str, bad))} divides none of "
                            f"the {what} {dps} (ep is carved from dp × cp); use one "
                            f"of {', '.join(map(str, fits))}")
    return problems
