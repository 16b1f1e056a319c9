"""Measure layers on the local device: median forward/backward time, output and parameter bytes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from partition.errors import InvalidOptionError, ProfileError

__all__ = ["Measurement", "measure", "parameter_bytes", "profile_sequence", "tensor_bytes"]

# torch is imported inside the functions: `import partition` must work without it.


@dataclass(frozen=True, slots=True)
class Measurement:
    """One callable's cost on one input."""

    forward: float
    """Median forward seconds (with autograd recording, as in training)."""
    backward: float
    """Median backward seconds from the outputs back to the inputs and parameters."""
    output: Any
    """The output of the last run, detached, to feed the next layer."""
    output_bytes: int
    """Bytes of every tensor in the output."""


def _tensors(value: Any) -> Iterator[Any]:
    """Every tensor inside nested tuples, lists and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _map_tensors(value: Any, change: Callable[[Any], Any]) -> Any:
    """A copy of nested tuples, lists and dicts with every tensor replaced by change(tensor)."""
    import torch

    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(item, change) for item in value))
    if isinstance(value, tuple | list):
        return type(value)(_map_tensors(item, change) for item in value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, change) for key, item in value.items()}
    return value


def tensor_bytes(value: Any) -> int:
    """Total bytes of the tensors inside ``value`` (nested tuples, lists, dicts)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in _tensors(value))


def parameter_bytes(layer: Any) -> int:
    """Bytes of a module's parameters, each counted once; 0 for anything without
    ``.parameters()``."""
    parameters = getattr(layer, "parameters", None)
    if not callable(parameters):
        return 0
    unique = {id(parameter): parameter for parameter in parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def _fresh_inputs(sample: Any) -> Any:
    """Inputs for one run: floating tensors become new graph roots (cloned, so layers that
    work in place cannot touch the sample or a leaf), others are detached."""

    def fresh(tensor: Any) -> Any:
        if tensor.is_floating_point():
            return tensor.detach().requires_grad_(True).clone()
        return tensor.detach()

    return _map_tensors(sample, fresh)


def _synchronize(sample: Any) -> None:
    """Wait for queued device work before reading the clock (no-op on CPU)."""
    import torch

    for tensor in _tensors(sample):
        if tensor.device.type != "cpu":
            torch.accelerator.synchronize(tensor.device)
        return


def _state_of(layer: Any) -> list[tuple[Any, Any]]:
    """(tensor, saved copy) for every buffer and parameter gradient that profiling may
    change (BatchNorm running statistics, accumulated .grad)."""
    saved: list[tuple[Any, Any]] = []
    for buffer in getattr(layer, "buffers", lambda: [])():
        saved.append((buffer, buffer.detach().clone()))
    return saved


def measure(
    call: Callable[[Any], Any],
    sample: Any,
    *,
    name: str,
    layer: Any = None,
    repeats: int = 5,
    warmup: int = 1,
) -> Measurement:
    """Time ``call(inputs)`` forward and backward on fresh copies of ``sample``: ``warmup``
    unrecorded runs, then the median of ``repeats``. ``layer`` (a module, if any) has its
    buffers and parameter gradients restored afterwards."""
    import torch

    if repeats < 1 or warmup < 0:
        raise InvalidOptionError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    saved = _state_of(layer)
    parameters = list(getattr(layer, "parameters", lambda: [])())
    gradients = [parameter.grad for parameter in parameters]
    forward_times: list[float] = []
    backward_times: list[float] = []
    output: Any = None
    try:
        for run in range(warmup + repeats):
            inputs = _fresh_inputs(sample)
            _synchronize(inputs)
            started = time.perf_counter()
            output = call(inputs)
            _synchronize(output)
            forwarded = time.perf_counter()
            roots = [t for t in _tensors(output) if t.requires_grad]
            seeds = [torch.ones_like(root) for root in roots]
            _synchronize(seeds)
            backward_started = time.perf_counter()
            if roots:
                torch.autograd.backward(roots, seeds)
            _synchronize(output)
            finished = time.perf_counter()
            if run >= warmup:
                forward_times.append(forwarded - started)
                backward_times.append(finished - backward_started)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ProfileError(
            f"layer {name!r} failed forward/backward on the sample input: {error}; "
            "check the sample's shape and dtype, or pass costs directly (chain_graph)"
        ) from error
    finally:
        with torch.no_grad():
            for tensor, copy in saved:
                tensor.copy_(copy)
        for parameter, gradient in zip(parameters, gradients, strict=True):
            parameter.grad = gradient
    detached = _map_tensors(output, lambda tensor: tensor.detach())
    return Measurement(
        forward=statistics.median(forward_times),
        backward=statistics.median(backward_times),
        output=detached,
        output_bytes=tensor_bytes(detached),
    )


def profile_sequence(
    layers: Sequence[Callable[[Any], Any]],
    sample_input: Any,
    *,
    names: Sequence[str],
    repeats: int = 5,
    warmup: int = 1,
) -> list[tuple[Measurement, int]]:
    """(measurement, parameter bytes) per layer, each run on the previous layer's output."""
    results = []
    value = sample_input
    for layer, name in zip(layers, names, strict=True):
        measurement = measure(
            layer,
            value,
            name=name,
            layer=layer,
            repeats=repeats,
            warmup=warmup,
        )
        results.append((measurement, parameter_bytes(layer)))
        value = measurement.output
    return results
