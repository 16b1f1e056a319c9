"""Stage boundaries as cut indices: the uniform split, validation, and layer-to-stage lookup."""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Sequence

from partition.errors import InvalidBoundariesError, InvalidOptionError, TooManyStagesError

__all__ = ["check_stage_count", "stage_of", "uniform_boundaries", "validate_boundaries"]

# Legend: n layers, p stages; boundaries b_0 = 0 < b_1 < ... < b_p = n, and stage k holds
# layers b_k .. b_{k+1} - 1.


def check_stage_count(num_stages: object, num_layers: int) -> int:
    """Return ``num_stages`` if it is an int in 1..num_layers, else raise a typed error."""
    if (
        isinstance(num_stages, bool)
        or not isinstance(num_stages, numbers.Integral)
        or int(num_stages) < 1
    ):
        raise InvalidOptionError(
            f"num_stages={num_stages!r} must be a positive integer number of stages"
        )
    if int(num_stages) > num_layers:
        raise TooManyStagesError(int(num_stages), num_layers)
    return int(num_stages)


def uniform_boundaries(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts; the first ``n mod p`` stages take one extra layer."""
    num_stages = check_stage_count(num_stages, num_layers)
    base, extra = divmod(num_layers, num_stages)
    cuts = [0]
    for stage in range(num_stages):
        cuts.append(cuts[-1] + base + (1 if stage < extra else 0))
    return tuple(cuts)


def validate_boundaries(
    boundaries: Sequence[int], num_layers: int, num_stages: int
) -> tuple[int, ...]:
    """Check user boundaries describe ``num_stages`` contiguous non-empty stages of
    ``num_layers`` layers and return them as a tuple of ints."""
    given = tuple(boundaries)
    if any(isinstance(cut, bool) or not isinstance(cut, numbers.Integral) for cut in given):
        raise InvalidBoundariesError(given, "every boundary must be an integer layer index")
    given = tuple(int(cut) for cut in given)
    if len(given) != num_stages + 1:
        raise InvalidBoundariesError(
            given,
            f"{num_stages} stages need {num_stages + 1} boundaries (first 0, last "
            f"{num_layers}), got {len(given)}",
        )
    if given[0] != 0 or given[-1] != num_layers:
        raise InvalidBoundariesError(
            given, f"the first boundary must be 0 and the last {num_layers} (the layer count)"
        )
    empty = [stage for stage in range(num_stages) if given[stage + 1] <= given[stage]]
    if empty:
        raise InvalidBoundariesError(
            given, f"boundaries must strictly increase; stages {empty} would be empty or reversed"
        )
    return given


def stage_of(boundaries: Sequence[int], layer_index: int) -> int:
    """The stage holding layer ``layer_index``."""
    if not 0 <= layer_index < boundaries[-1]:
        raise IndexError(f"layer index {layer_index} is outside 0..{boundaries[-1] - 1}")
    return bisect.bisect_right(boundaries, layer_index) - 1
