"""Typed errors of the runtime: configuration, a failed instruction, a failed rank, a checkpoint."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "NonFiniteError",
    "PipelineConfigError",
    "PipelineError",
    "PipelineLayerError",
    "PipelineStepError",
    "RankFailedError",
]


class PipelineError(RuntimeError):
    """Base class of every error the pipeline runtime raises."""


class PipelineConfigError(PipelineError, ValueError):
    """The module, schedule, batch or ranks do not fit together; raised before any step runs."""


class PipelineLayerError(PipelineError):
    """A layer raised while a stage ran; `layer` is its global index in the layer list."""

    def __init__(self, message: str, *, layer: int) -> None:
        self.layer = layer
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:  # keep the field across pickling (launcher)
        return (_rebuild_layer_error, (str(self), self.layer))


def _rebuild_layer_error(message: str, layer: int) -> PipelineLayerError:
    return PipelineLayerError(message, layer=layer)


class PipelineStepError(PipelineError):
    """An instruction failed on a rank while a step ran.

    `rank` is the global rank, `instruction` the text form of the failing instruction (e.g.
    ``1F3``), `step` its index in the rank's stream. The message ends with the rank × step
    grid around it. `caused_by` is the global rank whose failure stopped this one (None when
    this rank failed by itself).
    """

    def __init__(self, message: str, *, rank: int, instruction: str, step: int,
                 caused_by: int | None = None) -> None:
        self.rank = rank
        self.instruction = instruction
        self.step = step
        self.caused_by = caused_by
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:  # keep the fields across pickling (launcher)
        return (_rebuild_step_error, (str(self), self.rank, self.instruction, self.step,
                                      self.caused_by))


def _rebuild_step_error(message: str, rank: int, instruction: str, step: int,
                        caused_by: int | None) -> PipelineStepError:
    return PipelineStepError(message, rank=rank, instruction=instruction, step=step,
                             caused_by=caused_by)


class RankFailedError(PipelineError):
    """A launched rank failed; every other rank was stopped.

    `rank` is the first rank that failed, `instruction` the instruction it failed at when the
    engine knew it (else None), `exit_codes` every process's exit code.
    """

    def __init__(self, message: str, *, rank: int, instruction: str | None = None,
                 exit_codes: tuple[int | None, ...] = ()) -> None:
        self.rank = rank
        self.instruction = instruction
        self.exit_codes = exit_codes
        super().__init__(message)


class CheckpointError(PipelineError, ValueError):
    """A checkpoint that cannot be written, or is missing, torn, corrupt or does not fit.

    `path` is the file or directory at fault. Loading raises it before any state changes, on
    every rank, so a refused checkpoint leaves the engine as it was.
    """

    def __init__(self, message: str, *, path: str) -> None:
        self.path = path
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:  # keep `path` across pickling (launcher)
        return (_rebuild_checkpoint_error, (str(self), self.path))


def _rebuild_checkpoint_error(message: str, path: str) -> CheckpointError:
    return CheckpointError(message, path=path)


class NonFiniteError(PipelineError):
    """A training step's loss or gradients held inf or NaN; the update was skipped on every
    rank. `stage`, `microbatch` and `where` ('output', 'loss' or 'gradients') say where the
    non-finite values first appeared (stage -1 when no forward value was non-finite)."""

    def __init__(self, message: str, *, stage: int, microbatch: int, where: str) -> None:
        self.stage, self.microbatch, self.where = stage, microbatch, where
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:  # keep the fields across pickling (launcher)
        return (_rebuild_nonfinite_error, (str(self), self.stage, self.microbatch, self.where))


def _rebuild_nonfinite_error(message: str, stage: int, microbatch: int,
                             where: str) -> NonFiniteError:
    return NonFiniteError(message, stage=stage, microbatch=microbatch, where=where)
