"""`peak_rank_memory`'s one-stage-per-rank dense path equals its general path, to the bit."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner.memory import peak_rank_memory

sizes = st.floats(min_value=0.0, max_value=1e11, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(1, 12), st.integers(1, 64), st.sampled_from([0, 1]),
       st.booleans(), sizes, sizes,
       st.one_of(st.none(), st.tuples(sizes, sizes, sizes)))
def test_dense_path_equals_the_general_one(data: st.DataObject, ranks: int, dp: int,
                                           zero: int, recompute: bool, extra: float,
                                           at_step: float,
                                           state_bytes: tuple[float, float, float] | None
                                           ) -> None:
    """Without experts and per-stage gradient bytes the dense path runs; given them as
    zeros, the general one: every field and the rank agree exactly."""
    def arrays() -> np.ndarray:
        return np.array(data.draw(st.lists(sizes, min_size=ranks, max_size=ranks)))

    params, activations, workspace = arrays(), arrays(), arrays()
    common = dict(dp=dp, zero=zero, recompute=recompute, extra_gradient_bytes=extra,
                  step_gradient_bytes=at_step, state_bytes=state_bytes)
    fast = peak_rank_memory(params, activations, workspace, range(ranks), **common)
    general = peak_rank_memory(params, activations, workspace, range(ranks),
                               stage_expert_params=np.zeros(ranks),
                               stage_gradient_bytes=np.zeros(ranks), **common)
    assert fast == general
