"""The demo training job that `pipesched train` runs on every rank."""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeline.demo.language_model import TinyLMConfig, lm_layers, lm_loss, synthetic_batch
from pipeline.demo.user_model import load_recipe, rows_of
from pipeline.launcher.console import guard_standard_streams
from pipeline.model.module import PipelineModule
from pipeline.runtime.engine import PipelineEngine
from schedules import Timeline

__all__ = ["ProgressBar", "TrainConfig", "TrainReport", "train_rank"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a rank needs to run the demo; checked by the CLI before launching."""

    stages: int = 4
    """Pipeline ranks p."""
    schedule: str = "1f1b"
    microbatches: int = 8
    chunks: int = 1
    """Model chunks per rank (v); p·v stages in all."""
    data_parallel: int = 1
    """Replicas of the pipeline; each gets its own slice of every batch."""
    tensor_parallel: int = 1
    """Ranks each stage's layers are split over (the user model's layers must split)."""
    context_parallel: int = 1
    """Ranks each sequence is split over (every one of them is given the replica's rows)."""
    expert_parallel: int = 1
    """Replicas each MoE layer's experts are split over (carved from data_parallel)."""
    expert_tensor_parallel: int = 1
    """1: experts whole; tensor_parallel: each expert split over the tp group too."""
    two_batch_overlap: bool = False
    """Forwards of MoE stages as two halves taking turns (`EngineConfig.two_batch_overlap`)."""
    zero_stage: int = 0
    """ZeRO stage over the data-parallel replicas (0-3, `ParallelConfig.zero_stage`)."""
    reshard_after_forward: bool = True
    """ZeRO-3: free each layer's parameters after its forward (`ParallelConfig`)."""
    steps: int = 30
    batch_size: int = 32
    """Global batch (all data-parallel replicas together)."""
    lr: float = 3e-3
    seed: int = 0
    model: TinyLMConfig = field(default_factory=TinyLMConfig)
    user_model: str | None = None
    """``module:function`` giving a `ModelRecipe` to train instead of the demo LM."""
    boundaries: tuple[int, ...] = ()
    """Cut indices into the layer list (p·v + 1), chosen by the partitioner before launch."""
    progress: bool = True
    timeout: float = 120.0
    """Seconds any wait may take (the engine's receives and every collective) before the job
    fails naming the rank that stopped progressing."""

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or \
                not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got "
                             f"{self.timeout!r}")


@dataclass(frozen=True)
class TrainReport:
    """What rank 0 brings back."""

    losses: list[float]
    step_seconds: list[float]
    timeline: Timeline
    """Measured spans of the last step, every pipeline rank."""
    peak_activations: list[int]
    """Most activations each pipeline rank held in the last step."""


class ProgressBar:
    """A one-line progress bar on a terminal; one line per tenth of the run otherwise."""

    def __init__(self, total: int, width: int = 24) -> None:
        self.total = total
        self.width = width
        self.live = sys.stdout.isatty()

    def update(self, step: int, loss: float, seconds: float) -> None:
        done = step + 1
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] step {done}/{self.total}  loss {loss:.4f}  {1000 * seconds:.0f} ms/step"
        # a closed pipe (`| head -1`), a full or closed stdout is not a fault: the rank's
        # stdout is guarded (`pipeline.launcher.console`, train_rank's first step)
        if self.live:
            end = "\n" if done == self.total else ""
            print(f"\r{text}", end=end, flush=True)
        elif done == 1 or done == self.total or done % max(1, self.total // 10) == 0:
            print(text, flush=True)


def _demo_batch(config: TrainConfig, step: int, batch_size: int) -> tuple[Any, Any]:
    return synthetic_batch(step, batch_size, config.model, seed=config.seed)


def train_rank(config: TrainConfig) -> TrainReport | None:
    """Build this rank's stages, train `config.steps` steps, return the report on rank 0."""
    guard_standard_streams()
    rank = dist.get_rank()
    if config.user_model is not None:
        recipe = load_recipe(config.user_model)
        layers, loss_fn, make_batch = list(recipe.layers), recipe.loss_fn, recipe.batch
    else:
        layers, loss_fn = lm_layers(config.model), lm_loss
        make_batch = functools.partial(_demo_batch, config)
    module = PipelineModule(layers, num_stages=config.stages,
                            chunks=config.chunks, loss_fn=loss_fn,
                            partition_method=list(config.boundaries) or "parameters",
                            base_seed=config.seed)
    engine = PipelineEngine(module, schedule=config.schedule,
                            num_microbatches=config.microbatches,
                            optimizer=lambda params: torch.optim.Adam(params, lr=config.lr),
                            timeout=config.timeout, tensor_parallel=config.tensor_parallel,
                            context_parallel=config.context_parallel,
                            expert_parallel=config.expert_parallel,
                            expert_tensor_parallel=config.expert_tensor_parallel,
                            two_batch_overlap=config.two_batch_overlap,
                            zero_stage=config.zero_stage,
                            reshard_after_forward=config.reshard_after_forward)
    replica = engine.position.dp_rank
    per_replica = config.batch_size // config.data_parallel
    progress = ProgressBar(config.steps) if rank == 0 and config.progress else None
    losses, seconds = [], []
    for step in range(config.steps):
        inputs, targets = make_batch(step, config.batch_size)
        rows = slice(replica * per_replica, (replica + 1) * per_replica)
        start = time.perf_counter()
        loss = engine.train_batch(rows_of(inputs, rows), rows_of(targets, rows))
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        if progress is not None:
            progress.update(step, loss, seconds[-1])
    timeline = engine.last_timeline()  # a collective: every rank calls it
    peaks = [0] * config.stages
    stats = engine.last_stats
    gathered: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(gathered, stats.peak_activations if stats else 0)
    for global_rank, peak in enumerate(gathered):
        pp_rank = engine.topology.position(global_rank).pp_rank
        peaks[pp_rank] = max(peaks[pp_rank], peak)
    if rank != 0:
        return None
    return TrainReport(losses, seconds, timeline, peaks)
