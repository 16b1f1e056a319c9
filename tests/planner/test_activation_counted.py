"""The planner's activation bytes against the bytes the engine holds, counted: one stage of
the engine's tensor-parallel embedding, blocks, head and vocab-parallel loss at tp = 2, for
every recomputation mode, with and without sequence parallelism (within 5 %)."""

from __future__ import annotations

import pytest

from pipeline import launch
from tests.support.activation_counts import MODES, Count, launched_counts

__all__: list[str] = []


@pytest.mark.multiprocess
def test_counted_activation_bytes_match_the_planner_for_every_mode() -> None:
    per_rank: list[list[Count]] = launch(launched_counts, 2, timeout=60.0, join_timeout=240.0)
    for counts in per_rank:
        assert [(c.mode, c.sequence_parallel) for c in counts] == [
            (mode, sp) for sp in (False, True) for mode in MODES]
        for count in counts:
            assert count.counted == pytest.approx(count.predicted, rel=0.05), count
        by = {(c.mode, c.sequence_parallel): c.counted for c in counts}
        for sp in (False, True):  # what each mode drops, counted
            assert by["full", sp] < by["selective", sp] < by["none", sp]
        for mode in MODES:  # sequence parallelism splits the norms' and residuals' bytes
            assert by[mode, True] < 0.9 * by[mode, False]
    assert per_rank[0] == per_rank[1]  # the tp ranks hold alike
