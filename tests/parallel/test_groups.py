"""Process groups built from a Topology match it, on a DeviceMesh and without; ZeRO-stage rules."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeline.parallel.groups import (
    ZeroStageError,
    check_world_size,
    check_zero_stage,
    create_process_groups,
)
from pipeline.parallel.topology import Topology, TopologyError
from tests.support.rank_harness import run_ranks


def test_zero_1_is_allowed_with_a_pipeline() -> None:
    check_zero_stage(0, 4)
    check_zero_stage(1, 4)
    check_zero_stage(3, 1)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_are_refused_with_a_pipeline(stage: int) -> None:
    with pytest.raises(ZeroStageError,
                       match=f"zero_stage={stage}.*pipeline_parallel=2.*microbatch"):
        check_zero_stage(stage, 2)


@pytest.mark.parametrize("stage", [-1, 4, True, "1"])
def test_unknown_zero_stage_is_refused(stage: object) -> None:
    with pytest.raises(ZeroStageError, match="must be 0, 1, 2 or 3"):
        check_zero_stage(stage, 1)  # type: ignore[arg-type]


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
