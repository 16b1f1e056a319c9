"""Why a search found nothing: the constraint that bound, with its figures (memory needed
against the device's, the divisibility that failed, the engine rule that excluded it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError
from pipeline.planner.memory import MemoryBreakdown
from pipeline.planner.options import SearchOptions
from pipeline.planner.predict import PlanConfig
from pipeline.planner.profile import ModelProfile

__all__ = ["EXCLUSIONS", "SearchLog", "nothing_fits"]

GIB = 2**30
EXCLUSIONS = ("layers", "batch", "filters", "uniform", "interleaved", "size", "experts",
              "a2a")
"""Why the enumeration skips a grid point before pricing it: more stages than layers, a
data-parallel size that does not divide the global batch, the user's filters, the engine's
even layer split (`uniform_layers`), its interleaving rule (`interleaved_groups`), a
searched schedule's size cap (`zb_auto_max`, `searched_max`, `controllable_max`), no
expert-parallel size asked for that divides both dp and the experts."""


@dataclass
class SearchLog:
    """What a search dropped, kept for the message when nothing is left."""

    excluded: Counter[str] = field(default_factory=Counter)
    """Grid points skipped before pricing, by reason (`EXCLUSIONS`)."""
    over_at_peak: tuple[PlanConfig, MemoryBreakdown] | None = None
    """Of the configurations whose floor fit but whose schedule's peak did not, the one
    needing least."""
    refused: PlanConfig | None = None
    """A configuration that fit but its schedule refused."""
    grid: list[tuple[int, int, int]] = field(default_factory=list)
    """(tp, pp, dp) the devices allow with a layer per stage (before any other rule)."""

    def note_over(self, config: PlanConfig, memory: MemoryBreakdown) -> None:
        if self.over_at_peak is None or memory.total < self.over_at_peak[1].total:
            self.over_at_peak = (config, memory)


def _parts(memory: MemoryBreakdown) -> str:
    return ", ".join(f"{key} {value / GIB:.1f}" for key, value in memory.to_dict().items()
                     if key != "total")


def _memory_fix(memory: MemoryBreakdown, options: SearchOptions) -> str:
    """What would shrink the largest part of `memory`, given what the search could vary."""
    state = memory.parameters + memory.gradients + memory.optimizer
    if memory.runtime > max(state, memory.activations):
        return ("what the runtime holds besides tensors is the largest part (NCCL's buffers, "
                "cuBLAS workspaces, the margin: runtime_memory): a smaller --memory-margin, "
                "or a device with more memory")
    if memory.activations >= state:
        modes = options.recompute_modes()
        more = [] if set(modes) >= {"selective", "full"} else [
            "allow recomputation (--recompute selective,full)"]
        fixed = "other pipeline sizes (--pp)" if options.pipeline_parallel else \
            "more devices (--nodes)"
        return "activations are the largest part: " + ", ".join(
            [*more, "a smaller --seq", fixed])
    stages = (0, 1) if options.zero_stages is None else options.zero_stages
    zero = ([] if 1 in stages else ["allow ZeRO-1 (--zero 0,1)"]) + (
        [] if 3 in stages else ["allow ZeRO-2/3 (--zero 0,1,2,3: gradients and weights "
                                "sharded too)"])
    experts = ["allow larger expert parallelism (--ep)"] \
        if options.expert_parallel is not None else []
    return ("the model's state (parameters, gradients, optimizer) is the largest part: "
            + ", ".join(zero + experts
                        + ["more devices (--nodes)", "a smaller model"]))


def nothing_fits(log: SearchLog, considered: int, leanest: tuple[PlanConfig,
                 MemoryBreakdown] | None, cluster: ClusterSpec, global_batch: int,
                 model: ModelProfile, options: SearchOptions, blocks: int) -> PlanError:
    """The error of a search that simulated nothing, naming what bound it."""
    devices, device = cluster.num_devices, cluster.device_memory
    where = f"{model.name} on {devices} × {device / GIB:.1f} GiB devices"
    if not considered or leanest is None:
        return PlanError(f"no configuration of {where}: " + _exclusions(
            log, global_batch, options, blocks, len(model.layers), model.experts))
    config, floor = leanest
    if floor.total > device:
        return PlanError(
            f"{where} does not fit: even holding one microbatch per stage, the leanest "
            f"configuration ({config.label()}) needs {floor.total / GIB:.1f} GiB per device "
            f"({_parts(floor)} GiB) > {device / GIB:.1f} GiB; {_memory_fix(floor, options)}")
    if log.over_at_peak is not None:
        config, memory = log.over_at_peak
        refused = (f"; others that fit were refused by their schedule (e.g. "
                   f"{log.refused.label()})" if log.refused is not None else "")
        return PlanError(
            f"{where} does not fit: at its schedule's peak the leanest configuration "
            f"({config.label()}) needs {memory.total / GIB:.1f} GiB per device "
            f"({_parts(memory)} GiB) > {device / GIB:.1f} GiB{refused}; "
            f"{_memory_fix(memory, options)}")
    sample = log.refused.label() if log.refused is not None else "none"
    return PlanError(f"no configuration of {where}: every one that fits in memory is refused "
                     f"by its schedule (e.g. {sample}: the schedule does not accept its p, m, "
                     f"v); allow other --schedules or another --global-batch")


def _exclusions(log: SearchLog, global_batch: int, options: SearchOptions, blocks: int,
                layers: int, experts: int = 0) -> str:
    """What bound the enumeration, with its figures: the engine's even split, then the
    global batch's divisibility among the pipeline sizes left, then the rest."""
    excluded = log.excluded
    grid = log.grid
    texts = []
    if excluded["uniform"]:
        even = [(tp, pp, dp) for tp, pp, dp in grid if blocks % pp == 0]
        pps = sorted({pp for _, pp, _ in grid})
        dps = sorted({dp for _, _, dp in even})
        dividing = _list(sorted({pp for _, pp, _ in even})) or "none"
        text = (f"the engine splits the {blocks} blocks evenly over p·v stages "
                f"(uniform_layers: p·v must divide {blocks}); of the pipeline sizes the "
                f"devices allow ({_list(pps)}) only {dividing} divide it")
        if even:
            text += (f", which leave data-parallel sizes {_list(dps)}, none of which divides "
                     f"the global batch {global_batch}" if excluded["batch"] and not any(
                         global_batch % dp == 0 for dp in dps) else "")
        texts.append(text + "; use a global batch or layer count that fits these, or "
                     "another --engine")
    elif excluded["batch"]:
        dps = sorted({dp for _, _, dp in grid})
        texts.append(f"the data-parallel size (devices / (tp · pp): {_list(dps)}) must divide "
                     f"the global batch {global_batch}, and "
                     f"{_list([d for d in dps if global_batch % d == 0]) or 'none'} do; use a "
                     f"global batch divisible by one of them")
    if excluded["interleaved"]:
        texts.append(f"the engine interleaves only at p >= {options.interleaved_min_pp} "
                     f"with m a multiple of p (interleaved_groups)")
    if excluded["experts"]:
        dps = sorted({dp for _, _, dp in grid if global_batch % dp == 0})
        valid = sorted({ep for dp in dps for ep in range(1, dp + 1)
                        if dp % ep == 0 and experts % ep == 0})
        texts.append(f"expert parallelism: ep must divide dp (the experts are split over dp "
                     f"replicas) and the {experts} experts; the expert-parallel sizes asked "
                     f"({_list(list(options.expert_parallel or ()))}) divide none of the "
                     f"data-parallel sizes left ({_list(dps)}); use one of {_list(valid)}")
    if excluded["a2a"]:
        texts.append("--cp-comm-type a2a: the heads (and key/value heads) per tp rank must "
                     "divide by cp (each cp rank attends to heads / (tp · cp)); choose tp and "
                     "cp whose product divides them, or another --cp-comm-type")
    if excluded["size"]:
        texts.append("a searched schedule's size cap (p·m over zb_auto_max, searched_max or "
                     "controllable_max)")
    if excluded["filters"]:
        names = [name for name in ("pipeline_parallel", "data_parallel", "microbatch_sizes",
                                   "zero_stages", "recompute_choices", "tensor_parallel")
                 if getattr(options, name) is not None]
        texts.append(f"the filters {', '.join(names) or '(none)'}; loosen them")
    if not texts:
        return f"a pipeline of p stages needs p <= {layers} layers, and no size is left"
    return "; ".join(texts)


def _list(values: list[int]) -> str:
    shown = ", ".join(map(str, values[:12]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > 12 else "")
