"""Per-step throughput of a training run: tokens/s, model TFLOP/s, MFU and peak memory, as a
log line on rank 0, a JSONL record and (when installed) TensorBoard scalars.

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B): 6·N + 12·L·H·Q·T for
a forward and backward, N the parameters, L layers, H heads, Q the head dimension, T the
sequence length (the second term is attention's score and value matmuls, which N misses).
N counts every parameter except the input embedding table (a lookup, no matmul); the LM
head counts even when tied to it. Recomputation is not counted (model FLOPs, not hardware
FLOPs), as in PaLM's and Megatron's MFU. MFU = achieved model FLOP/s / (devices × peak).
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch

from pipeline.device import accelerator_name, peak_memory_allocated

__all__ = ["FlopModel", "StepMeter", "StepRecord", "device_peak_flops", "flop_model"]

_GPU_PRESETS = (("A800", "a800-80g"), ("A100", "a100-80g"), ("H100", "h100-80g"),
                ("H200", "h100-80g"))
"""Accelerator names and the planner preset whose datasheet peak they have (the H200 is the
H100's chip with more memory: 989 TFLOP/s bf16 dense, 67 fp32, as its datasheet says)."""


@dataclass(frozen=True)
class FlopModel:
    """The model's size as PaLM's FLOP count needs it."""

    parameters: int
    """N: every parameter but the input embedding table."""
    layers: int
    attention_width: int
    """H·Q: heads × head dimension."""
    seq_len: int

    def per_token(self) -> float:
        """Model FLOPs of one token's forward and backward: 6·N + 12·L·H·Q·T."""
        return 6.0 * self.parameters + 12.0 * self.layers * self.attention_width * self.seq_len


def flop_model(config: Any, seq_len: int) -> FlopModel:
    """`FlopModel` of a HF causal-LM config, its parameters counted on the meta device (no
    memory, no weights)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return FlopModel(parameters=total - embedding + (embedding if tied else 0),
                     layers=config.num_hidden_layers, attention_width=heads * head_dim,
                     seq_len=seq_len)


def device_peak_flops(device: torch.device, precision: str, given: float | None
                      ) -> tuple[float | None, str]:
    """Peak FLOP/s of one device and where the figure comes from: `given` (``--peak-tflops``),
    the planner preset's datasheet figure for a known GPU, or on a CPU this rank's measured
    fp32 matmul rate (the `local` cluster's calibration); None for an unknown GPU."""
    if given is not None:
        return given, "--peak-tflops"
    name = accelerator_name(device)
    if name is None:
        from pipeline.planner.calibrate import matmul_flops

        return matmul_flops(), "measured fp32 matmul on this rank's CPU threads"
    from pipeline.planner.cluster import PRESETS

    for marker, preset in _GPU_PRESETS:
        if marker in name and precision in PRESETS[preset].peak_flops:
            return PRESETS[preset].peak_flops[precision], f"{name} datasheet ({preset})"
    return None, f"{name}: no datasheet peak known; pass --peak-tflops for MFU"


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this rank has held: the accelerator allocator's peak, or on a CPU the
    process's peak resident set (``getrusage`` ru_maxrss, KiB on Linux)."""
    peak = peak_memory_allocated(device)
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step's figures (a JSONL line of ``--metrics``)."""

    step: int
    loss: float
    seconds: float
    tokens: int
    tokens_per_second: float
    tflops_per_device: float
    """Achieved model TFLOP/s per device (PaLM's count over the step's wall time)."""
    mfu: float | None
    """Model FLOPs utilisation, a fraction (None: no peak known)."""
    peak_memory_bytes: int
    """The most any rank has held so far."""
    data_position: int
    """Sequences consumed after this step."""

    def line(self, steps: int) -> str:
        mfu = "n/a" if self.mfu is None else f"{100 * self.mfu:.2f}%"
        return (f"step {self.step}/{steps}  loss {self.loss:.4f}  {1000 * self.seconds:.0f} ms"
                f"  {self.tokens_per_second:,.0f} tokens/s  {self.tflops_per_device:.3g} "
                f"TFLOP/s/device  MFU {mfu}  peak mem {self.peak_memory_bytes / 2**20:.0f} MiB")


class StepMeter:
    """Times steps and reports them (rank 0 writes; every rank measures its memory)."""

    def __init__(self, flops: FlopModel, *, tokens_per_step: int, devices: int,
                 peak_flops: float | None, writer: bool, metrics: Path | None,
                 tensorboard: Path | None) -> None:
        self.flops = flops
        self.tokens_per_step = tokens_per_step
        self.devices = devices
        self.peak_flops = peak_flops
        self.writer = writer
        self._file: IO[str] | None = None
        if writer and metrics is not None:
            metrics.parent.mkdir(parents=True, exist_ok=True)
            self._file = metrics.open("a")
        self._board: Any = None
        if writer and tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._board = SummaryWriter(str(tensorboard))
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self, step: int, loss: float, peak_memory: int, data_position: int
             ) -> StepRecord:
        """The step that just ended, written out on the writing rank."""
        seconds = time.perf_counter() - self._start
        rate = self.tokens_per_step / seconds
        achieved = self.flops.per_token() * rate / self.devices
        record = StepRecord(step=step, loss=loss, seconds=seconds, tokens=self.tokens_per_step,
                            tokens_per_second=rate, tflops_per_device=achieved / 1e12,
                            mfu=None if self.peak_flops is None else achieved / self.peak_flops,
                            peak_memory_bytes=peak_memory, data_position=data_position)
        if self._file is not None:
            self._file.write(json.dumps(asdict(record)) + "\n")
            self._file.flush()
        if self._board is not None:
            for name in ("loss", "tokens_per_second", "tflops_per_device", "mfu"):
                value = getattr(record, name)
                if value is not None:
                    self._board.add_scalar(f"train/{name}", value, step)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()
