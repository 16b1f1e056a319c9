"""`_minimal_fit`: the smallest float stage cost B with prefix_start + B >= prefix_stop."""

from __future__ import annotations

import math
import struct

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from partition.bisection import _minimal_fit


def smallest_fit(start: float, stop: float) -> float:
    """The definition, searched over every non-negative float by bit pattern (the sum
    grows with B, and B = inf always fits)."""
    def value(bits: int) -> float:
        return float(struct.unpack("<d", struct.pack("<q", bits))[0])

    low, high = -1, int(struct.unpack("<q", struct.pack("<d", math.inf))[0])
    while high - low > 1:
        middle = (low + high) // 2
        if start + value(middle) >= stop:
            high = middle
        else:
            low = middle
    return value(high)


prefixes = st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(prefixes, prefixes, st.integers(0, 64))
def test_minimal_fit_is_the_smallest_fitting_float(start: float, extra: float,
                                                   ulps: int) -> None:
    """Wide and near-equal prefixes (stop a few ulps above start, where rounding makes a
    run of B equivalent), as Python and as numpy floats: the definition's B exactly."""
    stops = [start + extra, start + ulps * math.ulp(start) if start else extra]
    for stop in stops:
        expected = smallest_fit(start, stop)
        assert _minimal_fit(start, stop) == expected
        assert _minimal_fit(np.float64(start), np.float64(stop)) == expected
