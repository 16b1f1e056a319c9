"""`EngineConfig`: everything `PipelineEngine` is told besides the objects it is handed."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pipeline.errors import PipelineConfigError
from pipeline.limits import MAX_TIMEOUT
from pipeline.parallel.config import ParallelConfig
from schedules import SCHEDULES, Schedule
from schedules.ir.schedule import count_problem

__all__ = ["EngineConfig", "NonFinitePolicy"]

NonFinitePolicy = Literal["raise", "skip"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one engine runs: the schedule, microbatching, parallelism inside stages and the
    failure timeout. Every field is checked here, once, on construction; what needs the
    module (does the schedule fit its stages?) is checked when the engine is built."""

    schedule: str | Schedule = "1f1b"
    """A registered schedule name (see `pipesched schedule --list`), or a `Schedule` value
    (e.g. read from a file) whose stages match the module's."""
    num_microbatches: int | None = None
    """Microbatches per step (DeepSpeed's gradient_accumulation_steps). None: the number of
    pipeline stages, or the given `Schedule`'s."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data / tensor parallel sizes, ZeRO stage, precision, clipping and loss scaling."""
    timeout: float = 300.0
    """Seconds any wait for another rank may take before the step fails with the rank named."""
    dynamic_shapes: bool = False
    """Send a shape header with every activation (shapes may change between microbatches);
    otherwise headers are sent only when a step's batch signature changes."""
    local_p2p: bool = True
    """Gloo on one host: send point-to-point messages of up to 64 KiB between the pipeline's
    ranks as Unix datagrams (`pipeline.parallel.local_p2p`), not through gloo's TCP. Used only
    when every pipeline rank is on this host; False keeps every message on gloo."""
    free_sent_outputs: bool = True
    """Free a stage output's data as soon as it is sent, keeping only its autograd node for
    the backward (Megatron's `deallocate_output_tensor`): a rank holding k microbatches in
    flight keeps k - 1 fewer stage outputs. False keeps them until their backward."""
    two_batch_overlap: bool = False
    """On stages with an expert all-to-all, run each training F as two halves of its
    microbatch's rows (SGLang's two-batch overlap; `pipeline.runtime.two_batch`): outside an
    overlapped F&B pair the halves take turns at their all-to-alls, one half's dispatch or
    combine hiding under the other's compute; inside one they run in order. Exact where
    layers treat rows independently; refused with a capacity factor or active dropout."""
    on_nonfinite: NonFinitePolicy = "raise"
    """A step whose loss or gradients hold inf/NaN never updates the weights (a vote over
    every rank, as fp16's overflow vote); 'raise' then stops with `NonFiniteError` naming the
    first stage and microbatch where the values appeared, 'skip' goes on (the step is
    counted in `last_step_skipped`). fp16 overflows are the loss scaler's and never raise."""

    def __post_init__(self) -> None:
        problems: list[str | None] = []
        if not isinstance(self.schedule, str | Schedule):
            problems.append(f"schedule must be a schedule name such as '1f1b' or a Schedule, "
                            f"got {self.schedule!r}")
        elif isinstance(self.schedule, str) and self.schedule not in SCHEDULES:
            close = difflib.get_close_matches(self.schedule, SCHEDULES, 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"schedule {self.schedule!r} is not a registered schedule{hint}; "
                            f"choose one of {', '.join(SCHEDULES)}")
        if self.num_microbatches is not None:
            problems.append(count_problem("num_microbatches", self.num_microbatches))
        if not isinstance(self.parallel, ParallelConfig):
            problems.append(f"parallel must be a ParallelConfig, got {self.parallel!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not (
                math.isfinite(self.timeout) and 0 < self.timeout <= MAX_TIMEOUT):
            problems.append(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}] "
                            f"(30 days), got {self.timeout!r}")
        if not isinstance(self.dynamic_shapes, bool):
            problems.append(f"dynamic_shapes must be True or False, got {self.dynamic_shapes!r}")
        if not isinstance(self.free_sent_outputs, bool):
            problems.append(f"free_sent_outputs must be True or False, got "
                            f"{self.free_sent_outputs!r}")
        if not isinstance(self.two_batch_overlap, bool):
            problems.append(f"two_batch_overlap must be True or False, got "
                            f"{self.two_batch_overlap!r}")
        if not isinstance(self.local_p2p, bool):
            problems.append(f"local_p2p must be True or False, got {self.local_p2p!r}")
        if self.on_nonfinite not in get_args(NonFinitePolicy):
            problems.append(f"on_nonfinite must be one of {get_args(NonFinitePolicy)}, got "
                            f"{self.on_nonfinite!r}")
        found = [problem for problem in problems if problem is not None]
        if found:
            raise PipelineConfigError("PipelineEngine: " + "; ".join(found))

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """The config of `PipelineEngine`'s keyword form: any `EngineConfig` field and any
        `ParallelConfig` field by name (``zero_stage=1, num_microbatches=8``)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"parallel"}
        parallel = {f.name for f in dataclasses.fields(ParallelConfig)}
        unknown = sorted(set(options) - own - parallel)
        if unknown:
            hints = [f"{name!r}" + "".join(f" (did you mean {close!r}?)" for close in
                                           difflib.get_close_matches(name, own | parallel, 1))
                     for name in unknown]
            raise PipelineConfigError(f"PipelineEngine got unknown option(s) {', '.join(hints)}; "
                                      f"the options are {sorted(own | parallel)}")
        return cls(parallel=ParallelConfig(**{k: v for k, v in options.items() if k in parallel}),
                   **{k: v for k, v in options.items() if k in own})
