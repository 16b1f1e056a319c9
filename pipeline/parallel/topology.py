"""The pp × dp × cp × tp process grid as one immutable value (tp innermost, pp outermost),
with expert parallelism (ep) carved from each stage's dp × cp ranks.

Pure Python: the same value names every rank's neighbours and groups before any process
group exists, so configuration errors surface before processes start.
"""

from __future__ import annotations

from dataclasses import dataclass

from schedules.ir.schedule import count_problem

__all__ = ["RankPosition", "Topology", "TopologyError"]


class TopologyError(ValueError):
    """Sizes that do not make a grid, or a rank outside it."""


@dataclass(frozen=True)
class RankPosition:
    """Where one global rank sits in the grid, and the ranks it talks to."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    is_first_stage: bool
    is_last_stage: bool
    pipeline_ranks: tuple[int, ...]
    """Global ranks of pipeline ranks 0..pp-1 that share this rank's (dp, tp) coordinates:
    the ranks this one exchanges activations with."""
    dp_group: tuple[int, ...]
    """Ranks holding the same stage and tensor shard: gradients are reduced over them (with
    context parallelism the dp × cp ranks, as Megatron-Core reduces over dp × cp)."""
    tp_group: tuple[int, ...]
    """Ranks that split this stage's tensors."""
    ep_rank: int = 0
    """Which 1/ep of each MoE layer's experts this rank holds: (dp_rank · cp + cp_rank) mod
    ep (dp_rank mod ep without context parallelism)."""
    ep_group: tuple[int, ...] = ()
    """The ep consecutive ranks of the stage's dp × cp ranks (dp-major, cp-minor: in global
    rank order) that split the experts between them: tokens are dispatched and combined
    over them (all-to-all). Same pp and tp coordinates: at tp > 1 each tp rank dispatches
    its own 1/t of the tokens (`pipeline.interop.hf_moe_tp`); at cp > 1 each cp rank its
    own chunks of the sequence."""
    expert_dp_group: tuple[int, ...] = ()
    """Ranks holding the same experts (same ep_rank, dp · cp / ep of them): expert
    gradients are reduced over them only."""
    cp_rank: int = 0
    """Which two of the sequence's 2·cp chunks this rank keeps (context parallelism)."""
    cp_group: tuple[int, ...] = ()
    """Ranks splitting one sequence (same pp, dp, tp): attention gathers keys and values
    over them."""


@dataclass(frozen=True)
class Topology:
    """pp pipeline ranks × dp data-parallel replicas × cp context-parallel ranks × tp
    tensor-parallel shards.

    Global rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank, the order
    Megatron uses (tp, then cp, innermost), so tensor-parallel ranks (the chattiest) are
    neighbours, then the context-parallel ones.
    """

    pp: int
    dp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: each stage's dp × cp ranks (same tp rank) form dp · cp / ep
    groups of ep consecutive ones that split every MoE layer's experts (ep divides dp · cp;
    Megatron-Core carves it from dp × cp the same way, DeepSpeed-MoE from dp)."""
    cp: int = 1
    """Context parallelism: cp ranks per (pp, dp, tp) coordinate take the same batch and
    each keeps 2 of its 2·cp sequence chunks (`pipeline.parallel.context`)."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep", "cp"):
            problem = count_problem(name, getattr(self, name))
            if problem is not None:
                raise TopologyError(problem)
        replicas = self.dp * self.cp
        if replicas % self.ep:
            over = f"dp={self.dp} × cp={self.cp} = {replicas}" if self.cp > 1 else \
                f"data parallelism dp={self.dp}"
            raise TopologyError(
                f"expert parallelism ep={self.ep} must divide {over} (the experts are split "
                f"over those ranks); choose ep among "
                f"{[k for k in range(1, replicas + 1) if replicas % k == 0]}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def gradient_replicas(self) -> int:
        """dp · cp: the ranks whose gradients of one parameter (shard) are averaged."""
        return self.dp * self.cp

    def rank_of(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0,
                cp_rank: int = 0) -> int:
        """Global rank at grid coordinates (pp_rank, dp_rank, cp_rank, tp_rank)."""
        for name, value, size in (("pp_rank", pp_rank, self.pp), ("dp_rank", dp_rank, self.dp),
                                  ("tp_rank", tp_rank, self.tp), ("cp_rank", cp_rank, self.cp)):
            if not 0 <= value < size:
                raise TopologyError(f"{name} {value} is outside 0..{size - 1}")
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def position(self, rank: int) -> RankPosition:
        """Everything one global rank needs to know about its place in the grid."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(
                f"rank {rank} is outside 0..{self.world_size - 1} (pp={self.pp} × dp={self.dp} "
                f"× cp={self.cp} × tp={self.tp})")
        tp_rank = rank % self.tp
        cp_rank = (rank // self.tp) % self.cp
        dp_rank = (rank // (self.tp * self.cp)) % self.dp
        pp_rank = rank // (self.tp * self.cp * self.dp)
        replica = dp_rank * self.cp + cp_rank  # among the stage's dp × cp ranks
        ep_rank, first = replica % self.ep, replica - replica % self.ep
        return RankPosition(
            rank=rank, pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank,
            is_first_stage=pp_rank == 0, is_last_stage=pp_rank == self.pp - 1,
            pipeline_ranks=tuple(self.rank_of(k, dp_rank, tp_rank, cp_rank)
                                 for k in range(self.pp)),
            dp_group=tuple(self.rank_of(pp_rank, d, tp_rank, c)
                           for d in range(self.dp) for c in range(self.cp)),
            tp_group=tuple(self.rank_of(pp_rank, dp_rank, t, cp_rank) for t in range(self.tp)),
            cp_rank=cp_rank,
            cp_group=tuple(self.rank_of(pp_rank, dp_rank, tp_rank, c) for c in range(self.cp)),
            ep_rank=ep_rank,
            ep_group=tuple(self._replica_rank(pp_rank, first + e, tp_rank)
                           for e in range(self.ep)),
            expert_dp_group=tuple(self._replica_rank(pp_rank, j, tp_rank)
                                  for j in range(ep_rank, self.dp * self.cp, self.ep)),
        )

    def _replica_rank(self, pp_rank: int, replica: int, tp_rank: int) -> int:
        """The global rank of the stage's `replica`-th dp × cp rank (dp-major)."""
        return self.rank_of(pp_rank, replica // self.cp, tp_rank, replica % self.cp)

    def all_dp_groups(self) -> list[tuple[int, ...]]:
        """Every data-parallel group, in a fixed order (all ranks must create groups alike)."""
        return [self.position(self.rank_of(k, 0, t)).dp_group
                for k in range(self.pp) for t in range(self.tp)]

    def all_tp_groups(self) -> list[tuple[int, ...]]:
        """Every tensor-parallel group, in a fixed order."""
        return [self.position(self.rank_of(k, d, 0, c)).tp_group
                for k in range(self.pp) for d in range(self.dp) for c in range(self.cp)]

    def all_cp_groups(self) -> list[tuple[int, ...]]:
        """Every context-parallel group, in a fixed order."""
        return [self.position(self.rank_of(k, d, t)).cp_group
                for k in range(self.pp) for d in range(self.dp) for t in range(self.tp)]

    def all_ep_groups(self) -> list[tuple[int, ...]]:
        """Every expert-parallel group, in a fixed order."""
        return [self.position(self._replica_rank(k, j, t)).ep_group
                for k in range(self.pp) for t in range(self.tp)
                for j in range(0, self.dp * self.cp, self.ep)]

    def all_expert_dp_groups(self) -> list[tuple[int, ...]]:
        """Every expert-data-parallel group, in a fixed order."""
        return [self.position(self._replica_rank(k, e, t)).expert_dp_group
                for k in range(self.pp) for t in range(self.tp) for e in range(self.ep)]

    def all_pipeline_groups(self) -> list[tuple[int, ...]]:
        """Every pipeline (pp) group, in a fixed order."""
        return [self.position(self.rank_of(0, d, t, c)).pipeline_ranks
                for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    @classmethod
    def for_world(cls, world_size: int, *, dp: int = 1, tp: int = 1) -> Topology:
        """The grid for `world_size` ranks with the given dp and tp; pp is what remains."""
        if world_size % (dp * tp):
            raise TopologyError(
                f"world size {world_size} is not divisible by dp × tp = {dp} × {tp}; choose "
                f"dp and tp whose product divides {world_size}")
        return cls(world_size // (dp * tp), dp, tp)
