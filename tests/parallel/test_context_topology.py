"""The pp × dp × cp × tp grid: every rank's coordinates and groups against an enumeration
written from the definition (tp innermost, then cp, dp, pp), and cp's refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.errors import PipelineConfigError
from pipeline.parallel.config import ParallelConfig
from pipeline.parallel.context.sharding import gathered_positions, rank_positions
from pipeline.parallel.topology import Topology, TopologyError
from pipeline.runtime.parallel_setup import resolve_topology

sizes = st.integers(1, 3)


@given(pp=sizes, dp=sizes, cp=sizes, tp=sizes)
def test_positions_and_groups_follow_the_definition(pp: int, dp: int, cp: int, tp: int
                                                    ) -> None:
    topology = Topology(pp, dp, tp, cp=cp)
    # the definition: ranks counted with tp innermost, then cp, dp and pp outermost
    coordinates = list(itertools.product(range(pp), range(dp), range(cp), range(tp)))
    assert topology.world_size == len(coordinates)

    def ranks(keep: tuple[int, ...], of: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(r for r, c in enumerate(coordinates)
                     if all(c[i] == of[i] for i in keep))

    for rank, (k, d, c, t) in enumerate(coordinates):
        position = topology.position(rank)
        here = (k, d, c, t)
        assert (position.pp_rank, position.dp_rank, position.cp_rank, position.tp_rank) == here
        assert topology.rank_of(k, d, t, c) == rank
        assert position.pipeline_ranks == ranks((1, 2, 3), here)
        assert position.dp_group == ranks((0, 3), here)  # gradients: over dp × cp
        assert position.cp_group == ranks((0, 1, 3), here)
        assert position.tp_group == ranks((0, 1, 2), here)
    assert sorted(r for group in topology.all_cp_groups() for r in group) == \
        list(range(topology.world_size))
    assert topology.gradient_replicas == dp * cp


def test_expert_parallel_is_carved_from_dp_x_cp() -> None:
    """ep divides dp · cp (no longer dp alone); the layout itself:
    tests/interop/test_hf_moe_context_parallel.py."""
    assert Topology(1, 1, 1, ep=2, cp=2).position(1).ep_group == (0, 1)
    assert ParallelConfig(data_parallel=1, expert_parallel=2, context_parallel=2)
    with pytest.raises(TopologyError, match=r"ep=3 must divide dp=2 × cp=2 = 4"):
        Topology(1, 2, 1, ep=3, cp=2)
    with pytest.raises(PipelineConfigError, match=r"expert_parallel=3 must divide "
                                                  r"data_parallel=2 × context_parallel=2 = 4"):
        ParallelConfig(data_parallel=2, expert_parallel=3, context_parallel=2)


def test_resolve_topology_leaves_dp_after_cp_and_names_cp_in_the_fix() -> None:
    topology = resolve_topology(8, 2, None, ParallelConfig(context_parallel=2))
    assert (topology.pp, topology.dp, topology.cp, topology.tp) == (2, 2, 2, 1)
    with pytest.raises(PipelineConfigError, match=r"world size 6 is not divisible by "
                                                  r"num_stages=2 × context_parallel=2"):
        resolve_topology(6, 2, None, ParallelConfig(context_parallel=2))


@given(cp=st.integers(1, 4), chunk=st.integers(1, 3))
def test_chunks_are_balanced_and_tile_the_sequence(cp: int, chunk: int) -> None:
    length = 2 * cp * chunk
    held = [rank_positions(length, r, cp).tolist() for r in range(cp)]
    assert sorted(p for part in held for p in part) == list(range(length))
    assert gathered_positions(length, cp).tolist() == [p for part in held for p in part]
    # causal work (keys each query sees, p + 1) is the same on every rank: the balancing
    work = {sum(p + 1 for p in part) for part in held}
    assert len(work) == 1
    for r, part in enumerate(held):  # rank r: chunk r, then its mirror 2·cp - 1 - r
        assert part[0] == r * chunk and part[-1] == (2 * cp - r) * chunk - 1
