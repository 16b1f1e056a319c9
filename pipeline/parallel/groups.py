"""Process groups for a pp × dp × cp × tp `Topology`, and the ZeRO-stage check for pipelines."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.parallel.topology import RankPosition, Topology, TopologyError

__all__ = [
    "MESH_DIM_NAMES",
    "ProcessGroups",
    "check_world_size",
    "create_expert_gather_group",
    "create_gather_group",
    "create_process_groups",
]

MESH_DIM_NAMES = ("pp", "dp", "tp")
"""DeviceMesh dimension names, outermost first: the mesh is arange(world).view(pp, dp, tp),
which is exactly `Topology`'s rank order."""


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of one rank, created collectively from one `Topology`."""

    topology: Topology
    position: RankPosition
    """This rank's place in the grid (pp/dp/tp ranks, neighbours, group members)."""
    pp_group: ProcessGroup
    """The ranks of this rank's pipeline (same dp and tp coordinates)."""
    dp_group: ProcessGroup
    """Replicas of this rank's stage shard: gradients are reduced (or reduce-scattered) here
    (the dp × cp ranks under context parallelism)."""
    tp_group: ProcessGroup
    """The ranks that split this stage's tensors (Megatron's tensor-model-parallel group)."""
    model_parallel_group: ProcessGroup
    """pp × tp ranks sharing this rank's dp (and cp) coordinate: one whole model replica. A gradient
    norm over replicated (non-ZeRO) gradients is summed here, not over the world, so that
    data-parallel copies are not counted dp times (Megatron's model-parallel group)."""
    world_group: ProcessGroup
    """Every rank: the fp16 overflow vote and ZeRO gradient norms span it."""
    mesh: DeviceMesh | None
    """The ("pp", "dp", "tp") DeviceMesh when groups were built on one, else None."""
    ep_group: ProcessGroup | None = None
    """The replicas splitting this stage's experts (all-to-all); None when ep = 1."""
    expert_dp_group: ProcessGroup | None = None
    """The replicas holding this rank's experts (their gradients' reduction); None when
    ep = 1 (then it is dp_group)."""
    cp_group: ProcessGroup | None = None
    """The ranks splitting one sequence (attention gathers keys and values over them);
    None when cp = 1."""

    @property
    def rank(self) -> int:
        return self.position.rank

    @property
    def dp_size(self) -> int:
        """Ranks in `dp_group` (dp, or dp × cp under context parallelism)."""
        return self.topology.gradient_replicas



def check_world_size(topology: Topology, world_size: int) -> None:
    """Raise `TopologyError` unless `world_size` equals pp · dp · cp · tp."""
    if world_size != topology.world_size:
        context = f"context_parallel={topology.cp} × " if topology.cp > 1 else ""
        raise TopologyError(
            f"world size {world_size} does not match pipeline_parallel={topology.pp} × "
            f"data_parallel={topology.dp} × {context}tensor_parallel={topology.tp} = "
            f"{topology.world_size}; launch {topology.world_size} processes or choose sizes "
            f"whose product is {world_size} (Topology.for_world({world_size}, dp=..., tp=...))")


def create_process_groups(topology: Topology, *, use_device_mesh: bool = True) -> ProcessGroups:
    """Create every group of `topology` on the default process group. Collective: every rank
    must call it, with the same topology, at the same point.

    With `use_device_mesh` the pp/dp/tp groups come from a CPU `DeviceMesh` with dims
    ("pp", "dp", "tp"); without it, from `new_group` over `Topology.all_*_groups()`, created
    in the same fixed order on every rank (a `new_group` call is itself collective). With
    cp > 1 the groups come from `new_group` (the dp × cp gradient group is no mesh dimension).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call dist.init_process_group (e.g. with "
            "backend='gloo') before create_process_groups")
    check_world_size(topology, dist.get_world_size())
    position = topology.position(dist.get_rank())
    mesh: DeviceMesh | None = None
    if use_device_mesh and topology.cp == 1:
        mesh = init_device_mesh(
            "cpu", (topology.pp, topology.dp, topology.tp), mesh_dim_names=MESH_DIM_NAMES)
        pp_group, dp_group, tp_group = (mesh.get_group(name) for name in MESH_DIM_NAMES)
    else:
        pp_group = _own_group(topology.all_pipeline_groups(), position.pipeline_ranks)
        dp_group = _own_group(topology.all_dp_groups(), position.dp_group)
        tp_group = _own_group(topology.all_tp_groups(), position.tp_group)
    # DeviceMesh has no flattened (pp, tp) group without private API; build it directly.
    model_parallel_group = _own_group(
        _model_parallel_groups(topology),
        _model_parallel_ranks(topology, position.dp_rank, position.cp_rank))
    world_group = dist.group.WORLD
    if world_group is None:  # only when the default group was destroyed meanwhile
        raise RuntimeError("the default process group disappeared while creating groups")
    ep_group = expert_dp_group = None
    if topology.ep > 1:
        ep_group = _own_group(topology.all_ep_groups(), position.ep_group)
        expert_dp_group = _own_group(topology.all_expert_dp_groups(),
                                     position.expert_dp_group)
    cp_group = _own_group(topology.all_cp_groups(), position.cp_group) \
        if topology.cp > 1 else None
    groups = ProcessGroups(topology=topology, position=position, pp_group=pp_group,
                           dp_group=dp_group, tp_group=tp_group,
                           model_parallel_group=model_parallel_group,
                           world_group=world_group, mesh=mesh, ep_group=ep_group,
                           expert_dp_group=expert_dp_group, cp_group=cp_group)
    _check_members(groups)
    return groups


def _model_parallel_ranks(topology: Topology, dp_rank: int, cp_rank: int = 0
                         ) -> tuple[int, ...]:
    return tuple(topology.rank_of(k, dp_rank, t, cp_rank)
                 for k in range(topology.pp) for t in range(topology.tp))


def _model_parallel_groups(topology: Topology) -> list[tuple[int, ...]]:
    return [_model_parallel_ranks(topology, d, c)
            for d in range(topology.dp) for c in range(topology.cp)]


def create_gather_group(groups: ProcessGroups) -> ProcessGroup:
    """A second group over this rank's data-parallel replicas (ZeRO-3's parameter gathers,
    which must not share an order with the gradient reductions on `dp_group`). Collective:
    every rank calls it, in the same order."""
    return _own_group(groups.topology.all_dp_groups(), groups.position.dp_group)


def create_expert_gather_group(groups: ProcessGroups) -> ProcessGroup:
    """A second group over this rank's expert-data-parallel replicas (ZeRO-3's gathers of
    expert parameters, as `create_gather_group`'s for dense ones). Collective: every rank
    calls it, in the same order; needs ep > 1."""
    if groups.expert_dp_group is None:
        raise TopologyError(f"{groups.topology} has no expert-data-parallel group (ep = 1): "
                            f"gather expert parameters over create_gather_group's group")
    return _own_group(groups.topology.all_expert_dp_groups(), groups.position.expert_dp_group)


def _own_group(all_groups: list[tuple[int, ...]], mine: tuple[int, ...]) -> ProcessGroup:
    """Create every group in order (collective) and return the one this rank belongs to."""
    own: ProcessGroup | None = None
    for ranks in all_groups:
        group = dist.new_group(ranks=list(ranks))
        if ranks == mine:
            own = group
    if own is None:
        raise TopologyError(f"this rank's group {mine} is not among {all_groups}")
    return own


def _check_members(groups: ProcessGroups) -> None:
    """The mesh must order ranks like `Topology`; a mismatch would reduce the wrong tensors."""
    position = groups.position
    expected = {"pp": position.pipeline_ranks, "dp": position.dp_group, "tp": position.tp_group}
    actual = {"pp": groups.pp_group, "dp": groups.dp_group, "tp": groups.tp_group}
    wrong = [f"{name}: {tuple(dist.get_process_group_ranks(actual[name]))} != {ranks}"
             for name, ranks in expected.items()
             if tuple(dist.get_process_group_ranks(actual[name])) != ranks]
    if wrong:
        raise TopologyError(
            f"rank {position.rank}: process groups disagree with {groups.topology}: "
            f"{'; '.join(wrong)}; build groups with use_device_mesh=False")
