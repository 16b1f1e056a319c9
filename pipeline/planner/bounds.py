"""What the search prunes with before it builds or simulates a schedule: each configuration's
memory floor and a step time no schedule can beat, from per-rank sums kept per partition.

Legend: p ranks, S = p·v stages, m microbatches; rank r holds the stages Q_r; F forward,
I input-gradient backward, W weight-gradient backward, B fused (I + W); fill_r: the
forwards of every stage before r's first (microbatch 0 must pass them before r starts).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.planner.expert_grad_sync import expert_replicas
from pipeline.planner.memory import RankStates, rank_states
from pipeline.planner.peaks import WARM_UP_FORMS, same_trace_as, warm_up_held
from pipeline.planner.predict import PlanConfig, PlanContext, schedule_placement
from schedules import SCHEDULES

__all__ = ["FUSED_BACKWARD", "SearchBounds"]

FUSED_BACKWARD = frozenset({"gpipe", "1f1b", "interleaved", "looped-bfs"})
"""Schedules whose generators emit F and fused B only (no I, no W): the planner simulates
them on fused costs (`PlanContext.predict`), so their bound may too (a test checks them)."""


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


@functools.lru_cache(maxsize=1024)
def _rank_layout(placement: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The placement as an array, and each rank's first stage."""
    firsts: dict[int, int] = {}
    for stage, rank in enumerate(placement):
        firsts.setdefault(rank, stage)
    return np.asarray(placement), np.array([firsts[rank] for rank in range(len(firsts))])


_warm_up_held = functools.lru_cache(maxsize=4096)(warm_up_held)
"""`peaks.warm_up_held`, asked once per (schedule, p, m, v) of a search (it is not mutated)."""


_WARM = frozenset(name for name in SCHEDULES if same_trace_as(name) in WARM_UP_FORMS)


@dataclass
class SearchBounds:
    """The bounds of one search's configurations, sharing `context`'s tables."""

    context: PlanContext
    _parts: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = field(default_factory=dict)
    _floors: dict[tuple[Any, ...], float] = field(default_factory=dict)
    _bounds: dict[tuple[Any, ...], float] = field(default_factory=dict)
    _warm_held: dict[tuple[Any, ...], np.ndarray] = field(default_factory=dict)
    _states: dict[tuple[Any, ...], RankStates] = field(default_factory=dict)
    _groups: dict[tuple[Any, ...], tuple[RankStates, dict[int, tuple[int, float, float]]]] = \
        field(default_factory=dict)
    _placement_ids: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _placements: dict[tuple[int, ...], int] = field(default_factory=dict)

    def memory_floor(self, config: PlanConfig) -> float:
        """`context.memory(config, floor=True)[0].total` (one microbatch of each of a rank's
        stages; no schedule holds less), from the per-rank sums, or for zb-v and dualpipev
        what they hold at their first release (`peaks.warm_up_held`): asked of every
        configuration; schedules with one placement share it."""
        warm = config.schedule if config.schedule in _WARM else None
        key = (config.pp, config.chunks, config.tp, config.recompute, config.recompute_layers,
               self._placement_id(config), config.zero_stage, config.dp, warm, config.ep,
               config.cp, config.microbatch_size)
        floor = self._floors.get(key)
        if floor is None:
            floor = self._floors[key] = self._floor(config, key)
        return floor

    def _placement_id(self, config: PlanConfig) -> int:
        """A number for the schedule's placement, the same for schedules of one placement."""
        key = (config.schedule, config.pp, config.chunks)
        if key not in self._placement_ids:
            placement = schedule_placement(*key)
            self._placement_ids[key] = self._placements.setdefault(placement,
                                                                   len(self._placements))
        return self._placement_ids[key]

    def _floor(self, config: PlanConfig, key: tuple[Any, ...]) -> float:
        """The floor of `key` (`memory_floor`'s, b last): per rank, one sample's held bytes
        times b against the model states, both kept per what they depend on (`RankStates`:
        partition, placement, dp, ZeRO, ep). Every b that divides the dp replica's batch is
        priced at once, the same element-wise operations on one row per b; each row's
        breakdown is summed when its b is asked for."""
        b, replica = config.microbatch_size, self.context.global_batch // config.dp
        searched = b * config.num_microbatches == replica  # as the search makes them
        group = self._groups.get(key[:-1]) if searched else None
        if group is None or b not in group[1]:
            sizes = _divisors(replica) if searched else (b,)
            counts = [replica // size for size in sizes] if searched \
                else [config.num_microbatches]
            group = self._group(config, sizes, counts)
            if searched:
                self._groups[key[:-1]] = group
        states, rows = group
        return states.total_at(*rows[b])

    def _group(self, config: PlanConfig, sizes: tuple[int, ...], counts: list[int]
               ) -> tuple[RankStates, dict[int, tuple[int, float, float]]]:
        """The model states of `config`'s ranks, and per microbatch size in `sizes` (with
        `counts` microbatches) what `RankStates.peak_rows` finds of its held bytes."""
        placement = schedule_placement(config.schedule, config.pp, config.chunks)
        partition = (config.pp * config.chunks, config.tp, config.recompute,
                     config.recompute_layers, placement, config.cp, config.ep)
        states_key = (partition, config.dp, config.zero_stage, config.ep,
                      self.context.torch_ddp(config))
        states = self._states.get(states_key)
        if states is None:
            states = self._states[states_key] = self._rank_states(config, placement)
        _, each, workspace = self.context.rank_sums(config)
        if config.schedule in _WARM:  # what a rank holds at its first release depends on m
            each = np.array([self._warm_bytes(config, partition, m, each) for m in counts])
        batch = np.array(sizes, dtype=float)[:, None]  # one row per b
        held = each * batch + workspace * batch if config.recomputes else each * batch
        return states, dict(zip(sizes, states.peak_rows(held), strict=True))

    def _rank_states(self, config: PlanConfig, placement: tuple[int, ...]) -> RankStates:
        """The model states of each rank (its stages summed: one "stage" per rank)."""
        params = self.context.rank_sums(config)[0]
        tied = self.context.tied_grad_bytes(config)
        if tied is not None:  # per rank, as `params` and `held` are
            tied = np.bincount(placement, weights=tied, minlength=config.pp)
        return rank_states(params, range(config.pp), config.pp, dp=config.dp * config.cp,
                           zero=config.zero_stage, stage_gradient_bytes=tied,
                           stage_expert_params=self.context.rank_experts(config),
                           expert_parallel=self.context.expert_shards(config),
                           expert_replicas=expert_replicas(
                               config.tp, self.context.expert_rule(config)),
                           runtime=self.context.runtime_bytes(config),
                           **self.context.engine_bytes(config))

    def _warm_bytes(self, config: PlanConfig, partition: tuple[Any, ...], m: int,
                    each: np.ndarray) -> np.ndarray:
        """Per rank, the bytes per sample `peaks.warm_up_held` counts at m microbatches
        (`each`, one of each stage, where it has none): kept per partition and the counts,
        which stop changing with m once m passes them."""
        held_first = _warm_up_held(config.schedule, config.pp, m, config.chunks)
        if held_first is None:
            return each
        key = (partition, held_first.held.tobytes())
        if key not in self._warm_held:
            self._warm_held[key] = held_first.peak_bytes(self.context.table(config).held)
        return self._warm_held[key]

    def lower_bound(self, config: PlanConfig) -> float:
        """A step time no schedule can beat, the larger of two per-rank bounds:
        - all of r's work: fill_r + m · Σ_{Q_r} (F + I + W), then r's tied all-reduce
          (`PlanContext.update_seconds`) and update;
        - r's forwards and input gradients, then a gradient's way back to stage 0:
          fill_r + m · Σ_{Q_r} (F + g) + Σ_{s < min Q_r} g, then rank 0's tied all-reduce
          and update, g the cheapest op that can carry a stage's input gradient (I, or B).
          The last of r's F, I and B ops is a backward (each F's own backward comes after
          it on r); that microbatch's gradient must then pass every earlier stage, one op
          each.
        With one stage per rank the second, on the last rank, is the pipeline's drain.
        Kept per what it depends on: configurations differing only in a schedule of the
        same placement and backward share it."""
        key = (self._parts_key(config), config.num_microbatches, config.dp,
               config.zero_stage, config.ep, config.cp)
        if key not in self._bounds:
            self._bounds[key] = self._bound(config)
        return self._bounds[key]

    def _bound(self, config: PlanConfig) -> float:
        fill, busy, chain_work, chain_back = self._parts_of(config)
        step, gather, tied = self.context.update_seconds(config)
        step = step + tied  # a tied copy's all-reduce before it
        m = config.num_microbatches
        bound = float((fill + m * busy + step + gather).max())
        first = schedule_placement(config.schedule, config.pp, config.chunks)[0]
        drain = fill + m * chain_work + chain_back + step[first] + gather[first]
        return max(bound, float(drain.max()))

    def _parts_of(self, config: PlanConfig) -> tuple[np.ndarray, ...]:
        """Per rank: fill, work, F + g work and the gradient's way back, kept per
        partition, placement, microbatch size and whether the backward is fused."""
        key = self._parts_key(config)
        placement, fused, b = key[4], key[6], config.microbatch_size
        if key not in self._parts:
            table = self.context.table(config)
            costs = table.costs(b)
            fused_backward = costs.input_grad + costs.weight_grad  # what B costs fused
            if fused:  # simulated on fused costs, every backward a B
                totals, chain = costs.total, fused_backward
            else:  # split costs when it has an I (B = I + W there), fused ones otherwise
                split = table.costs(b, split=True)
                totals = np.minimum(costs.total, split.total)
                chain = np.minimum(split.input_grad, fused_backward)
            where, first = _rank_layout(placement)
            busy = np.bincount(where, weights=totals, minlength=config.pp)
            fill = np.concatenate([[0.0], np.cumsum(costs.forward)])[first]
            chain_work = np.bincount(where, weights=costs.forward + chain, minlength=config.pp)
            chain_back = np.concatenate([[0.0], np.cumsum(chain)])[first]
            self._parts[key] = (fill, busy, chain_work, chain_back)
        return self._parts[key]

    @staticmethod
    def _parts_key(config: PlanConfig) -> tuple[Any, ...]:
        """What `_parts_of` depends on: the partition, the placement, the microbatch size,
        whether the backward is fused, cp and ep (a MoE block's price depends on it)."""
        placement = schedule_placement(config.schedule, config.pp, config.chunks)
        return (config.pp * config.chunks, config.tp, config.recompute,
                config.recompute_layers, placement, config.microbatch_size,
                config.schedule in FUSED_BACKWARD, config.cp, config.ep)
