"""What `pipesched train` would allocate on this host, estimated before anything is built, so
sizes that would exhaust the machine are refused in one line instead of killed by the kernel."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pipeline.demo.language_model import TinyLMConfig

__all__ = ["PROCESS_BYTES", "TrainFootprint", "check_footprint", "host_memory_bytes"]

PROCESS_BYTES = 400 * 2**20
"""Resident memory of one rank before its model (the interpreter, torch, gloo), measured at
~300 MB here; rounded up."""
_FLOAT = 4  # fp32 bytes
_ADAM = 4  # parameter, gradient and Adam's two moments, each fp32


@dataclass(frozen=True)
class TrainFootprint:
    """Bytes one demo run holds on this host, summed over its ranks and the launcher."""

    processes: int
    parameters: int
    activations: int
    data: int

    @property
    def total(self) -> int:
        return self.processes + self.parameters + self.activations + self.data

    def describe(self) -> str:
        gib = 2**30
        return (f"{self.total / gib:.1f} GiB (ranks {self.processes / gib:.1f}, parameters "
                f"and Adam state {self.parameters / gib:.1f}, activations "
                f"{self.activations / gib:.1f}, token batches {self.data / gib:.1f})")


def estimate(model: TinyLMConfig, *, batch_size: int, world_size: int) -> TrainFootprint:
    """An upper estimate: every microbatch's activations alive at once (GPipe's peak), the
    launcher's profiling copy of the whole model, and each rank's copy of the token batch."""
    w, s, blocks = model.width, model.seq_len, model.blocks
    # per block: attention in/out projections 4w² + MLP 8w², biases and norms ~13w
    block_params = 12 * w * w + 13 * w
    params = blocks * block_params + model.vocab * w * 2 + s * w + 3 * w
    # per sample and block: ~34·s·w floats of saved tensors plus the s×s attention scores
    # (scores, softmax, mask) for each head (Korthikanti et al., 2022, "Reducing Activation
    # Recomputation in Large Transformer Models", section 4.1, fp32 here)
    per_sample = blocks * (34 * s * w + 3 * model.heads * s * s) + 2 * s * (w + model.vocab)
    return TrainFootprint(
        processes=(world_size + 1) * PROCESS_BYTES,
        parameters=params * _FLOAT * _ADAM + params * _FLOAT,  # ranks' share + profiling copy
        activations=batch_size * per_sample * _FLOAT,
        data=(world_size + 1) * batch_size * (s + 1) * 8 * 2)


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_footprint(model: TinyLMConfig, *, batch_size: int, world_size: int,
                    fraction: float = 0.5) -> TrainFootprint:
    """Raise `ValueError` when the run would need more than `fraction` of this host's memory."""
    footprint = estimate(model, batch_size=batch_size, world_size=world_size)
    limit = int(fraction * host_memory_bytes())
    if footprint.total > limit:
        raise ValueError(
            f"this run would need about {footprint.describe()}, more than the limit of "
            f"{limit / 2**30:.1f} GiB ({fraction:.0%} of this machine's memory); lower "
            f"--seq-len, --width, --blocks, --batch-size or --stages × --data-parallel")
    return footprint
