"""ZeRO-1's parameter all-gather on a rank's timeline: blocking after the step, or overlapped.

The rule the simulator (`simulate` with `CostModel.gather`) and the planner share; it is the
engine's (`pipeline.parallel.param_gather`, `ParallelConfig.overlap_param_gather`):

- After the optimizer steps its shard, each stage's parameters are all-gathered in k equal
  buckets (the same buckets as its reduce-scatter), the buffer's head (the stage's first
  layers) first, the rank's stages in the order the engine keeps its regions: ascending
  stage index, which is also the order the rank's first forwards need them in every
  schedule here. A stage whose whole gather takes G spends G/k per bucket, one bucket at a
  time on the rank's communication lane (the one the reduction uses, `reduction`).
- Blocking (`overlap_param_gather=False`): STEP waits for the rank's reductions, steps, then
  gathers and waits: the gathers start on the lane when the later of the rank's compute and
  its reduction ends, and the step ends with them. All of it is exposed.
- Overlapped (`overlap_param_gather=True`, steady state, one step simulated): the previous
  step's gathers occupy the lane from the step's start (time 0), before any of this step's
  reductions, and only each stage's FIRST forward of the step waits for them: the engine's
  forward pre-hook makes each layer wait for the buckets holding its parameters. With a
  stage of n equal layers (one forward of length L) and k equal buckets arriving at
  a_0 <= ... <= a_{k-1}, layer l needs buckets up to b(l) = ceil((l + 1)k/n) - 1 and runs
  for L/n, so the forward ends at  max(ready + L, max_l (a_{b(l)} + (n - l)L/n)):  the same
  end as one contiguous forward that cannot start before

      release = max_l (a_{b(l)} - l·L/n)

  which is how the simulator runs it (its busy time stays L). n = 1 waits for the whole
  stage's buckets (the engine's case for a one-layer stage); n unset takes n = k, each
  bucket's share of the forward waiting for that bucket only: the finest the engine can do,
  so a lower bound on its wait when layers hold several buckets. The exposed gather of a
  rank is the time its forwards wait (release - ready where positive): what the engine's
  `StepStats.exposed_gather` measures; a wait that delays other ranks shows in the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["forward_release", "gather_lane"]


def gather_lane(stages: Sequence[int], seconds: Sequence[float], buckets: Sequence[int],
                start: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rank's gather buckets on its lane from `start`, `stages` in ascending order,
    each stage's buckets head first: (stage, bucket, start, end) columns."""
    stage_of, index, length = [], [], []
    for s in sorted(stages):
        k = buckets[s]
        stage_of.append(np.full(k, s))
        index.append(np.arange(k))
        length.append(np.full(k, seconds[s] / k))
    if not stage_of:
        empty = np.zeros(0)
        return empty.astype(np.int64), empty.astype(np.int64), empty, empty
    duration = np.concatenate(length)
    end = start + np.cumsum(duration)
    return np.concatenate(stage_of), np.concatenate(index), end - duration, end


def forward_release(arrivals: np.ndarray, forward: float, layers: int | None) -> float:
    """The earliest start of a stage's first forward (length `forward`, `layers` equal
    layers; None: as many as buckets) whose buckets arrive at `arrivals`, head first
    (module docstring)."""
    k = len(arrivals)
    if k == 0:
        return 0.0
    n = k if layers is None else layers
    if n < 1:
        raise ValueError(f"layers must be >= 1, got {n}")
    layer = np.arange(n)
    last_bucket = -(-(layer + 1) * k // n) - 1  # ceil((l + 1)k / n) - 1
    return float((arrivals[last_bucket] - layer * forward / n).max())
