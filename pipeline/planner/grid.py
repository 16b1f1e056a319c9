"""The grid the search walks: every configuration the engine runs, the rest counted."""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.config import PlanConfig
from pipeline.planner.context_comm import model_a2a_refusal
from pipeline.planner.diagnose import SearchLog
from pipeline.planner.expert_parallel import expert_sizes, expert_tp_refusal
from pipeline.planner.options import CONTROLLABLE, SearchOptions
from pipeline.planner.profile import ModelProfile
from pipeline.planner.rank_pricing import is_cost_aware
from pipeline.planner.stages import block_span
from schedules import SCHEDULES

__all__ = ["configurations", "divisors", "engine_refuses"]


def _recompute_options(mode: str, stage_layers: int) -> list[tuple[str, int]]:
    """(recompute, recompute_layers) of one searched mode; partial: k = ¼, ½, ¾ of a
    stage's layers (at least 1, fewer than all; none when a stage has one layer)."""
    if mode != "partial":
        return [(mode, 0)]
    ks = sorted({max(1, round(stage_layers * share)) for share in (0.25, 0.5, 0.75)})
    return [("full", k) for k in ks if k < stage_layers]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _chunk_options(name: str, pp: int, num_layers: int, max_chunks: int) -> list[int]:
    """Chunks per rank to try: 2..max_chunks for the looping schedules (v = 1 is 1F1B or
    GPipe again), the schedule's fixed count otherwise; p·v stages need p·v layers."""
    low, high = SCHEDULES[name].chunks
    if high is None:
        return list(range(max(low, 2), min(max_chunks, num_layers // pp) + 1))
    return [low] if low * pp <= num_layers else []


def engine_refuses(options: SearchOptions, blocks: int, pp: int, name: str, chunks: int,
                   m: int) -> str:
    """The rule of the engine the options describe that refuses this point ("" if none):
    "uniform" (`uniform_layers`: p·v must divide the blocks) or "interleaved"
    (`interleaved_groups`: interleaving needs p > 2 and p | m)."""
    if options.uniform_layers and blocks % (pp * chunks):
        return "uniform"
    if options.interleaved_groups and name == "interleaved" and (
            pp < options.interleaved_min_pp or m % pp != 0):
        return "interleaved"
    return ""


def _tensor_sizes(model: ModelProfile, cluster: ClusterSpec,
                  options: SearchOptions) -> list[int]:
    if options.tensor_parallel is not None:
        return list(options.tensor_parallel)
    if model.experts and not model.sequence_parallel:  # `check_request`'s rule
        return [1]
    if model.tensor_parallel_ok and model.heads is not None:
        return [t for t in divisors(cluster.devices_per_node) if not model.tp_refusals(t)
                and not (options.expert_tensor_parallel and expert_tp_refusal(model, t))]
    return [1]


def configurations(model: ModelProfile, cluster: ClusterSpec, global_batch: int,
                   options: SearchOptions, log: SearchLog | None = None) -> Iterator[PlanConfig]:
    """Every grid point the engine runs; `log` counts the others by reason."""
    devices, n = cluster.num_devices, len(model.layers)
    first, end = block_span(model.layers)
    log = log if log is not None else SearchLog()
    excluded = log.excluded
    modes = options.recompute_modes()

    def allowed(value: int, choices: tuple[int, ...] | None) -> bool:
        return choices is None or value in choices

    for tp, cp in ((t, c) for t in _tensor_sizes(model, cluster, options)
                   for c in options.context_parallel):
        if devices % (tp * cp):
            continue
        if options.cp_attention == "a2a" and model_a2a_refusal(model, tp, cp):
            excluded["a2a"] += 1  # TE asserts each tp rank's heads split over cp
            continue
        for pp in divisors(devices // (tp * cp)):
            dp = devices // (tp * pp * cp)
            if pp > n:
                excluded["layers"] += 1
                continue
            log.grid.append((tp, pp, dp))
            if global_batch % dp:
                excluded["batch"] += 1
                continue
            if not allowed(pp, options.pipeline_parallel) \
                    or not allowed(dp, options.data_parallel):
                excluded["filters"] += 1
                continue
            # ep carved from the dp × cp replicas (`Topology`: replica = dp_rank·cp + cp_rank)
            eps = expert_sizes(dp * cp, model.experts, options.expert_parallel)
            if not eps:
                excluded["experts"] += 1
                continue
            names = ("1f1b",) if pp == 1 else options.schedules
            zeros = _zero_stages(dp * cp, options.zero_stages)  # ZeRO shards over dp × cp
            for name in names:
                for chunks in _chunk_options(name, pp, n, options.max_chunks):
                    recomputes = [choice for mode in modes
                                  for choice in _recompute_options(mode, -(-n // (pp * chunks)))]
                    for b in divisors(global_batch // dp):
                        if not allowed(b, options.microbatch_sizes):
                            excluded["filters"] += 1
                            continue
                        m = global_batch // dp // b
                        refused = engine_refuses(options, end - first, pp, name, chunks, m)
                        if refused:
                            excluded[refused] += 1
                            continue
                        if (is_cost_aware(name) and pp * m > (
                                options.zb_auto_max if name == "zb-auto"
                                else options.searched_max)) or (
                                name in CONTROLLABLE and pp * m > options.controllable_max):
                            excluded["size"] += 1
                            continue
                        for zero in zeros:
                            if not allowed(zero, options.zero_stages):
                                excluded["filters"] += 1
                                continue
                            for recompute, k in recomputes:
                                for ep in eps:
                                    yield PlanConfig.enumerated(
                                        pp=pp, tp=tp, dp=dp, schedule=name, chunks=chunks,
                                        microbatch_size=b, num_microbatches=m,
                                        zero_stage=zero, recompute=recompute,
                                        recompute_layers=k, ep=ep, cp=cp)


def _zero_stages(dp: int, asked: tuple[int, ...] | None) -> tuple[int, ...]:
    """The ZeRO stages to enumerate over `dp` sharding ranks (dp · cp): 0 and 1 by default,
    2 and 3 only when asked (`SearchOptions.zero_stages`: they trade m collectives a step
    for memory); 0 alone at dp = 1, where nothing is sharded."""
    if dp == 1:
        return (0,)
    return (0, 1, 2, 3) if asked is not None and any(z >= 2 for z in asked) else (0, 1)
