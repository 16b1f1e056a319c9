"""Exposed ZeRO-2 / 3 communication of a stage's step: the engine's rule walked on one link.

Pure (numbers in, numbers out). The rule `pipeline.parallel.zero2` / `zero3` follow, on one
data-parallel rank running its stage's m microbatches back to back (F then B each, as 1F1B
runs a single stage), every collective on one link that runs one at a time, in launch order:

- ZeRO-3 forward of layer u: wait for unit u's all-gather (launched now unless prefetched),
  then, with prefetch, launch unit u+1's; compute; with `reshard_after_forward` free u.
- backward of layer u (L-1 down to 0): ZeRO-3 waits for unit u's gather (prefetched by
  layer u+1, or launched now) and launches unit u-1's with prefetch; the part of the
  backward before the layer's gradients are final (`weight_grad`: the emulated layer's W
  runs before its I), then the layer's bucket reduce-scatter is launched, keeping at most
  `window` unsettled (launching one more first waits for the oldest:
  `GradShardedOptimizer.MAX_IN_FLIGHT`); then the rest (`input_grad`). At the backward's
  end the reductions of earlier backwards are waited for (`ShardGradStore.backward_done`).
- the step waits for every reduction; ZeRO-2 then all-gathers the updated stage
  (`step_gather`, ZeRO-1's gather, blocking).

Without `reshard_after_forward` a unit gathered at its first forward stays gathered through
the step: only the first microbatch's forward gathers. A wait exposes max(0, end - now).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir.errors import ScheduleConfigError

__all__ = ["ZeroExposure", "ZeroLayerCosts", "zero_exposed"]


@dataclass(frozen=True)
class ZeroLayerCosts:
    """One layer's seconds for one microbatch on one dp rank."""

    forward: float
    weight_grad: float
    """The part of its backward before its parameters' gradients are final."""
    input_grad: float
    """The part after (0 for a model's first layer, which needs no input gradient)."""
    gather: float
    """All-gathering its parameters (a ZeRO-3 unit); unused at ZeRO-2."""
    reduce: float
    """Reduce-scattering its gradients (one bucket per layer)."""

    def __post_init__(self) -> None:
        for name in ("forward", "weight_grad", "input_grad", "gather", "reduce"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0:
                raise ScheduleConfigError(f"ZeroLayerCosts.{name} must be a finite number "
                                          f">= 0, got {value!r}")


@dataclass(frozen=True)
class ZeroExposure:
    """Seconds of one step a rank waits on ZeRO's collectives, by where it waits."""

    forward: float
    """In the forwards (ZeRO-3's gathers, behind reductions still on the link)."""
    backward: float
    """In the backwards (gathers, a full reduction window, earlier backwards' tails)."""
    step: float
    """At the step: the last reductions, then ZeRO-2's parameter all-gather."""

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.step


class _Link:
    """The walk's clock and link (see the module docstring)."""

    def __init__(self) -> None:
        self.now, self.free = 0.0, -math.inf
        self.waited = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.phase = "forward"

    def launch(self, seconds: float) -> float:
        self.free = max(self.now, self.free) + seconds
        return self.free

    def wait(self, end: float) -> None:
        if end > self.now:
            self.waited[self.phase] += end - self.now
            self.now = end


def zero_exposed(layers: Sequence[ZeroLayerCosts], *, zero_stage: int, microbatches: int,
                 prefetch: bool = True, reshard_after_forward: bool = True,
                 step_gather: Sequence[float] = (), window: int = 2,
                 shortcut: bool = True) -> ZeroExposure:
    """The seconds one step of a stage of `layers` waits on ZeRO-`zero_stage` (2 or 3)
    collectives (module docstring); `step_gather`: ZeRO-2's all-gathers after the step,
    one per bucket. Once a microbatch leaves the link as the one before it did (relative to
    its end), the rest repeat it and are not walked (`shortcut`; O(L) for a planner, not
    O(m·L))."""
    if zero_stage not in (2, 3):
        raise ScheduleConfigError(f"zero_stage must be 2 or 3, got {zero_stage!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleConfigError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if not layers:
        raise ScheduleConfigError("zero_exposed needs at least one layer")
    link, count = _Link(), len(layers)
    gathered: dict[int, float] = {}  # unit -> the end of its gather (launched or waited)
    in_window: deque[list[float]] = deque()  # [end, settled] of launched reductions
    earlier: list[list[float]] = []  # this backward's, settled at the next backward's end

    def gather(unit: int) -> None:
        if unit not in gathered:
            gathered[unit] = link.launch(layers[unit].gather)
        link.wait(gathered[unit])

    def ahead(unit: int) -> None:
        if prefetch and 0 <= unit < count and unit not in gathered:
            gathered[unit] = link.launch(layers[unit].gather)

    def settle(entries: Sequence[list[float]]) -> None:
        for entry in entries:
            if not entry[1]:
                link.wait(entry[0])
                entry[1] = 1.0

    def state() -> tuple[object, ...]:
        """Everything the next microbatch depends on, relative to now."""
        def rel(end: float) -> float:
            return round(end - link.now, 12)
        return (rel(link.free), tuple(sorted((u, rel(e)) for u, e in gathered.items())),
                tuple((rel(e[0]), e[1]) for e in in_window),
                tuple((rel(e[0]), e[1]) for e in earlier))

    last: tuple[object, ...] | None = None
    done = 0
    while done < microbatches:
        before, waited = link.now, dict(link.waited)
        link.phase = "forward"
        for unit, layer in enumerate(layers):
            if zero_stage == 3:
                gather(unit)
                ahead(unit + 1)
            link.now += layer.forward
            if zero_stage == 3 and reshard_after_forward:
                gathered.pop(unit, None)  # its gather was waited for
        link.phase = "backward"
        launched: list[list[float]] = []
        for unit in range(count - 1, -1, -1):
            layer = layers[unit]
            if zero_stage == 3:
                if reshard_after_forward:  # every other unit is freed (none in flight)
                    for other in [key for key in gathered if key != unit]:
                        link.wait(gathered.pop(other))
                gather(unit)
                ahead(unit - 1)
            link.now += layer.weight_grad
            entry = [link.launch(layer.reduce), 0.0]
            launched.append(entry)
            in_window.append(entry)
            while len(in_window) > window:
                settle([in_window.popleft()])
            link.now += layer.input_grad
        settle(earlier)
        earlier = launched
        if zero_stage == 3 and reshard_after_forward:
            for other in list(gathered):
                link.wait(gathered.pop(other))
        done += 1
        now = state()
        if shortcut and now == last and done < microbatches:  # periodic: the rest repeats this one
            repeat = microbatches - done
            shift = repeat * (link.now - before)
            for phase in link.waited:
                link.waited[phase] += repeat * (link.waited[phase] - waited[phase])
            link.now += shift
            link.free += shift
            gathered = {u: e + shift for u, e in gathered.items()}
            for entry in {id(e): e for e in [*in_window, *earlier]}.values():
                entry[0] += shift
            done = microbatches
        last = now
    link.phase = "step"
    settle(earlier)
    if zero_stage == 2:
        for seconds in step_gather:
            link.launch(seconds)
        link.wait(link.free)
    return ZeroExposure(**link.waited)
