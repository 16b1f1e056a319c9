"""The job `pipesched run` runs on every rank: a HF model directory trained on a token file,
checkpointed every N steps and resumed from the latest, with per-step throughput."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.interop.ds_client_state import CLIENT_STATE, client_state_bytes, read_client_state
from pipeline.jobs.step_metrics import (
    StepMeter,
    device_peak_flops,
    flop_model,
    peak_memory_bytes,
)
from pipeline.jobs.token_data import TokenBatches, open_token_file

__all__ = ["RunConfig", "RunReport", "build_layers", "run_rank"]

DATA_STATE = "data"
"""The client-state key under which a checkpoint keeps the data position."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a rank needs; checked by `pipeline.cli.run_cmd` before any rank starts."""

    model: str
    """A HF model directory (config.json and the safetensors `save_pretrained` writes)."""
    data: str
    """A flat token file (`pipeline.jobs.token_data`)."""
    data_dtype: str | None = None
    """The token dtype, or None: from the file's sidecar JSON."""
    stages: int = 1
    chunks: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    batch_size: int = 1
    """Global batch in sequences (all replicas together)."""
    seq_len: int = 128
    steps: int = 1
    """Train until the engine's global step reaches this (a resumed run counts its past)."""
    lr: float = 3e-4
    partition: tuple[int, ...] | str = "parameters"
    """Cut indices into `layers_from_hf`'s layers (p·v + 1 of them), or a partition method."""
    zero_stage: int = 0
    recompute: str = "none"
    recompute_layers: int | None = None
    sequence_parallel: bool = False
    tp_overlap: bool = False
    precision: str = "fp32"
    shuffle_seed: int | None = None
    """None: sequences in file order; else each epoch a permutation drawn from it."""
    checkpoint: str | None = None
    save_every: int = 0
    """Save every this many steps (0: only after the last step); needs `checkpoint`."""
    metrics: str | None = None
    tensorboard: str | None = None
    peak_tflops: float | None = None
    timeout: float = 300.0


@dataclass(frozen=True)
class RunReport:
    """What rank 0 brings back."""

    losses: dict[int, float]
    """Loss of each step this run trained, by step number (1-based)."""
    resumed_from: int
    """The step of the checkpoint it resumed from (0: a fresh start)."""


def build_layers(config: RunConfig) -> tuple[Any, Any]:
    """The HF layers (split over tp when it is > 1) and the loss the engine trains: token
    cross entropy summed with its count (the engine averages over every token of the step),
    targets already shifted (`token_data` gives each input its next token)."""
    import transformers

    from pipeline.interop.hf_layers import layers_from_hf
    from pipeline.runtime.loss_normalization import token_cross_entropy

    hf = layers_from_hf(transformers.AutoConfig.from_pretrained(config.model))
    if config.tensor_parallel > 1:
        from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf

        hf = tensor_parallel_hf(hf, sequence_parallel=config.sequence_parallel,
                                overlap=config.tp_overlap, shift_labels=False)
        return hf, hf.summed_loss
    return hf, token_cross_entropy(shift=False)


def _resume(engine: Any, config: RunConfig) -> int:
    """Load the latest checkpoint under `config.checkpoint` if there is one; the data
    position it saved (0 on a fresh start)."""
    if config.checkpoint is None or not (Path(config.checkpoint) / "latest").exists():
        return 0
    info = engine.load_checkpoint(config.checkpoint)
    saved = read_client_state(Path(info.directory)).get("client_state", {}).get(DATA_STATE)
    if not isinstance(saved, dict):
        raise ValueError(f"--checkpoint {config.checkpoint}: {info.directory} holds no data "
                         "position (not written by pipesched run); pass a new --checkpoint DIR")
    for key, now in (("seq_len", config.seq_len), ("shuffle_seed", config.shuffle_seed)):
        if saved.get(key) != now:
            raise ValueError(f"--checkpoint {config.checkpoint}: saved with {key} "
                             f"{saved.get(key)!r}, resumed with {now!r}: the data position "
                             f"would point elsewhere; resume with the same {key}")
    return int(saved["position"])


def _save(engine: Any, config: RunConfig, root: str, position: int) -> None:
    """A checkpoint under `root`, rank 0 adding the data position as client state."""
    state = {"client_state": {DATA_STATE: {"position": position, "data": config.data,
                                           "seq_len": config.seq_len,
                                           "global_batch": config.batch_size,
                                           "shuffle_seed": config.shuffle_seed}}}
    extra = {CLIENT_STATE: client_state_bytes(state)} if dist.get_rank() == 0 else {}
    engine.save_checkpoint(root, extra_files=extra)


def run_rank(config: RunConfig) -> RunReport | None:
    """Build this rank's stages from the HF directory, resume, train to `config.steps`,
    checkpoint; rank 0 logs each step and returns the report."""
    from pipeline.interop.hf_weights import load_hf_weights
    from pipeline.model.module import PipelineModule
    from pipeline.runtime.engine import PipelineEngine

    rank = dist.get_rank()
    hf, loss_fn = build_layers(config)
    partition = list(config.partition) if isinstance(config.partition, tuple) \
        else config.partition
    module = PipelineModule(hf.layers, num_stages=config.stages, chunks=config.chunks,
                            loss_fn=loss_fn, partition_method=partition,
                            recompute=config.recompute,  # type: ignore[arg-type]
                            recompute_layers=config.recompute_layers)
    load_hf_weights(module, hf, config.model)
    engine = PipelineEngine(
        module, schedule=config.schedule, num_microbatches=config.microbatches,
        data_parallel=config.data_parallel, tensor_parallel=config.tensor_parallel,
        zero_stage=config.zero_stage, precision=config.precision, timeout=config.timeout,
        optimizer=lambda params: torch.optim.AdamW(params, lr=config.lr))
    batches = TokenBatches(open_token_file(config.data, config.data_dtype),
                           seq_len=config.seq_len, global_batch=config.batch_size,
                           data_parallel=config.data_parallel,
                           replica=engine.position.dp_rank, vocab_size=hf.config.vocab_size,
                           seed=config.shuffle_seed)
    position = _resume(engine, config)
    resumed_from = engine.global_step
    world = dist.get_world_size()
    peak, source = device_peak_flops(engine.device, config.precision,
                                     None if config.peak_tflops is None
                                     else config.peak_tflops * 1e12)
    meter = StepMeter(flop_model(hf.config, config.seq_len),
                      tokens_per_step=config.batch_size * config.seq_len, devices=world,
                      peak_flops=peak, writer=rank == 0,
                      metrics=Path(config.metrics) if config.metrics else None,
                      tensorboard=Path(config.tensorboard) if config.tensorboard else None)
    if rank == 0:
        start = f"resumed at step {resumed_from}" if resumed_from else "from the HF weights"
        peak_text = "unknown" if peak is None else f"{peak / 1e12:.4g} TFLOP/s"
        print(f"pipesched run: {world} ranks (pp {config.stages}, dp {config.data_parallel}, "
              f"tp {config.tensor_parallel}), {config.schedule} m={config.microbatches}, "
              f"{start}; {meter.flops.per_token() / 1e6:.3g} MFLOP/token "
              f"(6N + 12LHQT, N={meter.flops.parameters:,}); peak per device {peak_text} "
              f"({source})", flush=True)
    losses: dict[int, float] = {}
    try:
        while engine.global_step < config.steps:
            inputs, targets = batches.batch(position)
            meter.start()
            loss = engine.train_batch(inputs, targets)
            position = batches.advance(position)
            memory = torch.tensor([float(peak_memory_bytes(engine.device))])
            dist.all_reduce(memory, op=dist.ReduceOp.MAX)
            step = engine.global_step
            record = meter.stop(step, loss, int(memory[0]), position)
            losses[step] = loss
            if rank == 0:
                print(record.line(config.steps), flush=True)
            if not math.isfinite(loss):
                raise FloatingPointError(f"step {step}: the loss is {loss}; lower --lr")
            last = step == config.steps
            if config.checkpoint and (last or (config.save_every
                                               and step % config.save_every == 0)):
                _save(engine, config, config.checkpoint, position)
    finally:
        meter.close()
        engine.stop_watchdog()
    return RunReport(losses, resumed_from) if rank == 0 else None
