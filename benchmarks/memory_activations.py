"""Activation sections of `bench_memory.py`: rank 0's peak with and without output freeing
(1F1B, p = 4), recomputation modes (saved bytes and step time each), and the accounting's
prediction against the bytes a `SavedTensorMeter` counts for a Korthikanti-shaped layer.

    PYTHONPATH=$PWD python benchmarks/bench_memory.py --section freeing
    PYTHONPATH=$PWD python benchmarks/bench_memory.py --section recompute
    PYTHONPATH=$PWD python benchmarks/bench_memory.py --section predicted

Counted bytes are exact and repeatable; times are medians of a few runs on a shared CPU and
noisy: compare within one run only.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline import LayerSpec, PipelineEngine, PipelineModule, launch
from pipeline.demo.language_model import DecoderBlock
from pipeline.model.recompute import recompute_region, selective_recompute
from pipeline.runtime.saved_memory import SavedTensorMeter
from schedules import build_schedule
from schedules.analysis.accounting import layer_activation_bytes, stream_peak

__all__ = ["ACTIVATION_SECTIONS", "KorthikantiLayer", "freeing_section", "predicted_section",
           "recompute_section"]

# -- rank 0's peak with and without output freeing ------------------------------------------

P, M, ROWS, WIDTH = 4, 8, 64, 512
"""1F1B over p ranks, m microbatches of ROWS rows, Linear(WIDTH) + GELU layers (2 a stage)."""


def _freeing_layers() -> list[Any]:
    layers: list[Any] = []
    for _ in range(2 * P):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), nn.GELU()]
    return layers


def _freeing_rank(_: int, rounds: int = 8) -> dict[bool, tuple[int, float]]:
    torch.set_num_threads(1)
    inputs = torch.randn(M * ROWS, WIDTH)
    engines, peaks = {}, {}
    for free in (False, True):
        module = PipelineModule(_freeing_layers(), num_stages=P, partition_method="uniform",
                                loss_fn=lambda out, target: ((out - target) ** 2).mean())
        engines[free] = PipelineEngine(module, schedule="1f1b", num_microbatches=M,
                                       free_sent_outputs=free,
                                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
        meter = SavedTensorMeter(ignore=[*module.parameters(), inputs])
        with meter:
            engines[free].train_batch(inputs, inputs)
        peaks[free] = meter.peak
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(rounds):  # alternate which goes first: noise hits both
        for free in ((False, True) if round_index % 2 == 0 else (True, False)):
            start = time.perf_counter()
            engines[free].train_batch(inputs, inputs)
            times[free].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.stop_watchdog()
    return {free: (peaks[free], statistics.median(times[free])) for free in (False, True)}


def freeing_section() -> None:
    """Rank 0's counted activation peak, 1F1B p = 4, with and without output freeing, and
    the accounting's prediction (`stream_peak`)."""
    per_rank = launch(_freeing_rank, P, P, timeout=120, join_timeout=600)
    unit = ROWS * WIDTH * 4  # one (rows × width) fp32 tensor
    # each stage: 2 × (Linear saves its input, GELU saves its input); stage 0's first
    # Linear input is the data batch (not counted); the output is one unit
    saved = [4.0 * unit - (unit if stage == 0 else 0) for stage in range(P)]
    output = [float(unit)] * P
    sends = [stage < P - 1 for stage in range(P)]
    schedule = build_schedule("1f1b", P, M)
    stream = [(op.kind, op.stage, op.microbatch) for op in schedule.compute_streams()[0]]
    print(f"\nrank 0's activation peak, 1F1B p={P} m={M}, {2 * P}×(Linear({WIDTH})+GELU), "
          f"{ROWS} rows/microbatch, fp32")
    print(f"{'outputs':<22}{'measured MiB':>14}{'predicted MiB':>15}{'step ms (noisy)':>17}")
    for free in (False, True):
        peak, seconds = per_rank[0][free]
        predicted = stream_peak(stream, saved, output, sends=sends,
                                free_sent_outputs=free).bytes
        label = "freed once sent" if free else "kept until backward"
        print(f"{label:<22}{peak / 2**20:>14.3f}{predicted / 2**20:>15.3f}"
              f"{1e3 * seconds:>17.1f}")
    drop = per_rank[0][False][0] - per_rank[0][True][0]
    print(f"drop: {drop / 2**20:.3f} MiB = {drop / unit:g} stage outputs (p - 1 = {P - 1})")


# -- recomputation modes: saved bytes and time ------------------------------------------------

BLOCKS, BATCH, LENGTH, LM_WIDTH, HEADS = 8, 8, 128, 128, 4


def _stage(mode: str, layers: int | None, attention: str) -> PipelineModule:
    specs = [LayerSpec(DecoderBlock, LM_WIDTH, HEADS, attention) for _ in range(BLOCKS)]
    module = PipelineModule(specs, num_stages=1, recompute=mode,  # type: ignore[arg-type]
                            recompute_layers=layers)
    module.materialize([0])
    return module


def _peak(module: PipelineModule, x: torch.Tensor) -> int:
    with SavedTensorMeter(ignore=[*module.parameters(), x]) as meter:
        module(x).square().mean().backward()
    return meter.peak


def _seconds(module: PipelineModule, x: torch.Tensor) -> float:
    start = time.perf_counter()
    module(x).square().mean().backward()
    return time.perf_counter() - start


def recompute_section() -> None:
    """One stage of the demo model's decoder blocks (fp32): saved-activation peak and
    forward+backward time per recompute mode, for both attention cores."""
    torch.set_num_threads(1)
    x = torch.randn(BATCH, LENGTH, LM_WIDTH, requires_grad=True)
    print(f"\nrecomputation, one stage of {BLOCKS} demo blocks (width {LM_WIDTH}, {HEADS} heads, "
          f"seq {LENGTH}, batch {BATCH}), fp32, forward+backward, 1 thread")
    print(f"{'attention':<10}{'mode':<22}{'saved MiB':>11}{'vs none':>9}{'ms (noisy)':>12}"
          f"{'vs none':>9}")
    modes: list[tuple[str, str, int | None]] = [
        ("none", "none", None), ("selective", "selective", None),
        ("partial selective k=4", "selective", 4),
        ("partial full k=2", "full", 2), ("partial full k=4", "full", 4),
        ("full", "full", None)]
    for attention in ("eager", "fused"):
        stages = [_stage(mode, layers, attention) for _, mode, layers in modes]
        peaks = [_peak(stage, x) for stage in stages]
        times: list[list[float]] = [[] for _ in stages]
        for round_index in range(5):  # every mode once per round, in turns: noise hits all
            order = range(len(stages)) if round_index % 2 == 0 else reversed(range(len(stages)))
            for k in order:
                times[k].append(_seconds(stages[k], x))
        medians = [statistics.median(t) for t in times]
        for (label, _, _), peak, seconds in zip(modes, peaks, medians):
            print(f"{attention:<10}{label:<22}{peak / 2**20:>11.2f}{peak / peaks[0]:>9.2f}"
                  f"{1e3 * seconds:>12.1f}{seconds / medians[0]:>9.2f}")


# -- predicted vs measured: a Korthikanti-shaped layer ---------------------------------------

class KorthikantiLayer(nn.Module):
    """A GPT layer laid out as in Korthikanti et al. 2022, section 4.1 (s, b, h order, 16-bit
    activations, dropout after attention probabilities, projection and MLP), so that its
    saved tensors are the paper's: the accounting's prediction must match them."""

    def __init__(self, h: int, a: int, attention: str, dropout: float = 0.1) -> None:
        super().__init__()
        self.a, self.attention, self.dropout = a, attention, dropout
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        d = h // self.a
        q, k, v = self.qkv(self.norm1(x)).view(s, b, self.a, 3 * d).split(d, dim=-1)
        context = recompute_region(self._core, q, k, v)
        x = x + F.dropout(self.proj(context), self.dropout)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))), self.dropout)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b, a, d = q.shape
        if self.attention == "fused":  # keeps Q, K, V, its output and the row log-sum-exp
            out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)))
            return out.permute(2, 0, 1, 3).reshape(s, b, a * d)
        # (b·a, s, d) views of the projection's output: bmm saves them, no copies
        qt, kt, vt = (t.reshape(s, b * a, d).transpose(0, 1) for t in (q, k, v))
        scores = torch.baddbmm(torch.empty(1, 1, 1, dtype=q.dtype), qt, kt.transpose(1, 2),
                               beta=0.0, alpha=1 / math.sqrt(d))
        probs = F.dropout(scores.softmax(dim=-1), self.dropout)
        return torch.bmm(probs, vt).transpose(0, 1).reshape(s, b, a * d)


def _layer_peak(layer: KorthikantiLayer, x: torch.Tensor, mode: str) -> int:
    run: Callable[[torch.Tensor], torch.Tensor] = layer
    with SavedTensorMeter(ignore=list(layer.parameters())) as meter:
        if mode == "full":
            checkpoint(run, x, use_reentrant=False)
        else:
            with selective_recompute(mode == "selective"):
                run(x)
    return meter.peak


def predicted_section() -> None:
    """Korthikanti's per-layer bytes (`layer_activation_bytes`) against the counted bytes."""
    torch.manual_seed(0)
    print("\nactivation bytes per transformer layer (bf16, dropout 0.1, CPU: 2-byte dropout "
          "masks): predicted (schedules.analysis.accounting) vs counted")
    print(f"{'s':>5}{'b':>3}{'h':>5}{'a':>3} {'attention':<10}{'mode':<11}{'predicted':>12}"
          f"{'measured':>12}{'error':>8}")
    for s, b, h, a in ((128, 2, 256, 8), (256, 1, 512, 8)):
        x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
        for attention, mode in (("eager", "none"), ("eager", "selective"), ("eager", "full"),
                                ("fused", "none")):
            layer = KorthikantiLayer(h, a, attention).to(torch.bfloat16)
            measured = _layer_peak(layer, x, mode)
            # torch's CPU dropout keeps its mask in bf16 (2 bytes), CUDA's in bool (1)
            predicted = layer_activation_bytes(
                s, b, h, a, attention=attention, recompute=mode,  # type: ignore[arg-type]
                dropout_mask_bytes=2)
            print(f"{s:>5}{b:>3}{h:>5}{a:>3} {attention:<10}{mode:<11}{predicted:>12.0f}"
                  f"{measured:>12}{(measured - predicted) / predicted:>8.1%}")


ACTIVATION_SECTIONS: dict[str, Callable[[], None]] = {
    "freeing": freeing_section, "recompute": recompute_section,
    "predicted": predicted_section}
"""`bench_memory.py --section NAME` runs these."""
