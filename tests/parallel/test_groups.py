"""Process groups built from a Topology match it, on a DeviceMesh (the engine's path) and not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline.parallel.groups import check_world_size, create_process_groups
from pipeline.parallel.topology import Topology, TopologyError
from tests.support.rank_harness import run_ranks


def test_world_size_mismatch_names_the_sizes_and_the_fix() -> None:
    with pytest.raises(TopologyError, match=r"world size 6 .* = 8; launch 8 processes"):
        check_world_size(Topology(2, 2, 2), 6)


def _check_groups(rank: int, world_size: int) -> None:
    for topology in (Topology(2, 2, 1), Topology(1, 2, 2), Topology(2, 1, 2)):
        for use_mesh in (True, False):
            groups = create_process_groups(topology, use_device_mesh=use_mesh)
            position = topology.position(rank)
            assert groups.position == position
            assert (groups.mesh is not None) == use_mesh
            for group, ranks in ((groups.pp_group, position.pipeline_ranks),
                                 (groups.dp_group, position.dp_group),
                                 (groups.tp_group, position.tp_group)):
                assert tuple(dist.get_process_group_ranks(group)) == ranks
                # the group really connects those ranks: summing global ranks over it
                total = torch.tensor([float(rank)])
                dist.all_reduce(total, group=group)
                assert total.item() == sum(ranks)
            model_parallel = dist.get_process_group_ranks(groups.model_parallel_group)
            assert sorted(model_parallel) == sorted(
                topology.rank_of(k, position.dp_rank, t)
                for k in range(topology.pp) for t in range(topology.tp))
    with pytest.raises(TopologyError, match="world size 4 does not match"):
        create_process_groups(Topology(2, 2, 2))


@pytest.mark.multiprocess
def test_groups_match_topology_on_4_ranks() -> None:
    run_ranks(_check_groups, 4)
