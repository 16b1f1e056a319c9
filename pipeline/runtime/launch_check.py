"""`LaunchCheck`: what a launched function will build, checked before any rank starts.

``launch(main, 4, check=LaunchCheck(module, config, inputs=x, targets=y))`` refuses a module,
engine options or batch that every rank would refuse, once, in the launching process, before
any process is spawned (instead of 20-40 s later, after every rank imported torch and built
its process group). The checks are the engine's own (`resolve_topology`, `resolve_schedule`,
`split_microbatches`), run on the same values, so the parent refuses exactly what the ranks
would; and one microbatch runs through the layers on the meta device (`shape_trace`), so a
batch of a shape the model does not take is found too.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from types import FrameType
from typing import Any

from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from pipeline.runtime.batch import batch_size, split_microbatches
from pipeline.runtime.config import EngineConfig
from pipeline.runtime.parallel_setup import resolve_topology
from pipeline.runtime.schedule_setup import resolve_schedule
from pipeline.runtime.shape_trace import trace_problem

__all__ = ["LaunchCheck"]


class LaunchCheck:
    """The `PipelineModule`, engine options and one rank's batch that `fn` will use, for
    `launch(..., check=)` to check against the world size before it starts any rank.

    Build the module and options in the launching process and hand the same objects to
    `fn` (``launch(main, 4, module, config, check=LaunchCheck(module, config))``): a
    `PipelineModule` builds no layer until the engine places its stages, so this is cheap.
    Options go as an `EngineConfig` or as `PipelineEngine`'s keywords
    (``LaunchCheck(module, schedule="zb-h1", num_microbatches=8)``); either is checked here,
    on construction (a misspelt schedule is refused with the closest name).
    """

    def __init__(self, module: PipelineModule, config: EngineConfig | None = None, *,
                 inputs: Any = None, targets: Any = None, trace: bool = True,
                 trace_timeout: float = 60.0, **options: Any) -> None:
        if not isinstance(module, PipelineModule):
            raise PipelineConfigError(f"LaunchCheck needs the PipelineModule that fn builds, "
                                      f"got {type(module).__name__}")
        if config is not None and options:
            raise PipelineConfigError(f"LaunchCheck: pass either config= or the options "
                                      f"{sorted(options)} (EngineConfig fields), not both")
        if not isinstance(trace, bool):
            raise PipelineConfigError(f"LaunchCheck: trace must be True or False, got "
                                      f"{trace!r}")
        if isinstance(trace_timeout, bool) or not isinstance(trace_timeout, int | float) \
                or not math.isfinite(trace_timeout) or trace_timeout <= 0:
            raise PipelineConfigError(f"LaunchCheck: trace_timeout must be a number of "
                                      f"seconds > 0, got {trace_timeout!r}")
        if config is not None and not isinstance(config, EngineConfig):
            raise PipelineConfigError(f"LaunchCheck: config must be an EngineConfig, got "
                                      f"{config!r}")
        self.module = module
        self.config = config if config is not None else EngineConfig.from_options(**options)
        """The engine's options (checked field by field on construction)."""
        self.inputs = inputs
        """One rank's `train_batch` inputs (a sample of the same batch size will do), or None."""
        self.targets = targets
        """One rank's `train_batch` targets, or None."""
        self.trace = trace
        """Run one microbatch of `inputs` through the layers and the loss on the meta device
        (`shape_trace`): a batch of the wrong shape is found here too."""
        self.trace_timeout = float(trace_timeout)
        """Seconds the trace may take: a layer that never returns is refused, not waited on."""

    def problems(self, world_size: int) -> list[str]:
        """Every reason the ranks of a `world_size` launch would refuse the run (empty: none
        that can be known before they start)."""
        found: list[str] = []
        try:  # pp × dp × tp against the world size
            resolve_topology(world_size, self.module.num_stages, None, self.config.parallel)
        except PipelineConfigError as error:
            found.append(str(error))
        num_microbatches = self.config.num_microbatches
        try:  # the schedule fits the module's stages and validates
            num_microbatches = resolve_schedule(self.config.schedule, self.module,
                                                num_microbatches).num_microbatches
        except PipelineConfigError as error:
            found.append(str(error))
        if num_microbatches is None:
            return found
        batch = _batch_problems(self.inputs, self.targets, num_microbatches)
        if not batch and self.trace and self.inputs is not None:
            first = [None if value is None else split_microbatches(value, num_microbatches,
                                                                   what)[0]
                     for what, value in (("inputs", self.inputs), ("targets", self.targets))]
            autocast = self.config.parallel.precision != "fp32"
            batch = [problem for problem in [_bounded_trace(
                self.module, first, autocast, self.trace_timeout)] if problem is not None]
        return found + batch

    def check(self, world_size: int) -> None:
        """Raise one `PipelineConfigError` naming every problem `problems` finds."""
        found = self.problems(world_size)
        if found:
            raise PipelineConfigError(f"launch(world_size={world_size}) refused before "
                                      f"starting any rank: " + "; ".join(found))

    def __repr__(self) -> str:
        return (f"LaunchCheck(num_stages={self.module.num_stages}, chunks={self.module.chunks}, "
                f"config={self.config!r})")


class _TraceStopped(BaseException):
    """Raised inside a trace past its time (not an `Exception`: a layer's own handler
    should not swallow it)."""


def _bounded_trace(module: PipelineModule, first: list[Any], autocast: bool,
                   timeout: float) -> str | None:
    """`trace_problem` in a thread given `timeout` seconds; past it, the trace is stopped
    (an exception raised in the thread at its next Python line) and refused: a layer or
    loss that loops would hang every rank, and here the launching process."""
    outcome: list[Any] = []

    def trace() -> None:
        try:
            outcome.append(("done", trace_problem(module, *first, autocast=autocast)))
        except _TraceStopped:
            pass
        except BaseException as error:  # raised in the caller's thread below
            outcome.append(("raised", error))

    worker = threading.Thread(target=trace, name="pipesched-launch-check-trace", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive() and worker.ident is not None:
        _stop(worker.ident)
        return (f"one microbatch through the layers and the loss on the meta device did not "
                f"finish within trace_timeout={timeout:g} s: a layer or loss that never "
                f"returns would hang every rank; fix it, or pass LaunchCheck(..., "
                f"trace_timeout=<more seconds>) or trace=False")
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    result: str | None = value
    return result


def _stop(ident: int, patience: float = 2.0) -> None:
    """Raise `_TraceStopped` in thread `ident` at its next Python line, once it is outside
    any import (stopping an import half-way would leave a half-initialised module, e.g.
    torch's lazy sympy, for the whole process); a thread still importing after `patience`
    seconds is left to run (a daemon, ended with the process)."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(ident)
        if frame is None:
            return
        if not _importing(frame):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                       ctypes.py_object(_TraceStopped))
            return
        time.sleep(0.01)


def _importing(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _batch_problems(inputs: Any, targets: Any, m: int) -> list[str]:
    """What `train_batch(inputs, targets)` would refuse with `m` microbatches (the split the
    engine makes; inputs and targets holding one sample count)."""
    found: list[str] = []
    if inputs is None and targets is not None:
        found.append("targets given without inputs: every rank's train_batch(inputs, targets) "
                     "needs the batch's inputs too; pass LaunchCheck(..., inputs=one rank's "
                     "inputs, targets=...)")
    sizes: dict[str, int] = {}
    for what, value in (("inputs", inputs), ("targets", targets)):
        if value is None:
            continue
        try:
            sizes[what] = batch_size(split_microbatches(value, m, what))
        except (PipelineConfigError, TypeError) as error:
            found.append(str(error))
    if len(sizes) == 2 and sizes["inputs"] and sizes["targets"] and \
            sizes["inputs"] != sizes["targets"]:
        found.append(f"inputs hold {sizes['inputs']} samples but targets {sizes['targets']}; "
                     f"pass one target per input sample (same size in dim 0)")
    return found
