"""ZeRO stages 0-3 inside pipeline stages: live model-state bytes per parameter after a step,
next to the ZeRO paper's formulas, and the bytes each rank sends a step.

pp2 × dp2 (4 CPU ranks), 8 × Linear(256) per stage pair, fp32 Adam, 4 microbatches of 1F1B.
Bytes are counted on the live storages right after the step (`count_model_states`: each
storage once; ZeRO-3's gathered layers are freed by then); the formula column is
`schedules.analysis.accounting.model_state_bytes` (Rajbhandari et al. 2020: 16, 8 + 8/d,
4 + 12/d, 16/d for fp32 Adam). Also ZeRO-3's most bytes of layers gathered at once during
the step (with and without `reshard_after_forward` and `prefetch_next_unit`).

Mixed precision (bf16 parameters, fp32 master shards, `half_parameters=True`), pp1 × dp d for
d = 2 and 4: the same count next to the accounting and DeepSpeed's published mixed-precision
figures (ZeRO-1 4 + 12/d, ZeRO-2 2 + 14/d, ZeRO-3 16/d), and the step's peak: the most
model-state bytes alive at any point of the step (sampled at every layer's forward, every
parameter's gradient arrival and the inner optimizer's step: gathered layers, bucket buffers
and the fp32 gradient copies included; activations not).

    PYTHONPATH=$PWD python benchmarks/bench_zero_stages.py
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.parallel.model_state import count_model_states
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero3 import FullyShardedOptimizer
from schedules.analysis.accounting import model_state_bytes

__all__ = ["main"]

WIDTH, LAYERS, DP = 256, 8, 2
CONFIGS = [(0, True, True), (1, True, True), (2, True, True), (3, True, True),
           (3, True, False), (3, False, True)]
"""(ZeRO stage, reshard_after_forward, prefetch_next_unit)."""


def _peak_gathered(sharded: FullyShardedOptimizer, peak: list[int]) -> None:
    launch_gather = sharded.prefetch  # every gather that collects launches here

    def counted(key: int) -> None:
        launch_gather(key)
        peak[0] = max(peak[0], sum(sharded.layouts()[k].size * 4
                                   for k in sharded.gathered_units()))
    sharded.prefetch = counted  # type: ignore[method-assign]


def _measure() -> list[dict[str, Any]]:
    rows = []
    for zero, reshard, prefetch in CONFIGS:
        torch.manual_seed(0)
        module = PipelineModule([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], num_stages=2,
                                loss_fn=F.mse_loss)
        engine = PipelineEngine(module, schedule="1f1b", num_microbatches=4, data_parallel=DP,
                                zero_stage=zero, reshard_after_forward=reshard,
                                prefetch_next_unit=prefetch,
                                optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))
        peak = [0]
        if isinstance(engine.optimizer, FullyShardedOptimizer):
            _peak_gathered(engine.optimizer, peak)
        x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
        stats = engine.optimizer.stats if isinstance(engine.optimizer, ShardedOptimizer) \
            else getattr(engine.gradient_reducer, "stats", None)
        if stats is not None:
            stats.reset()
        engine.train_batch(x, y)
        counted = count_model_states(engine.module, engine.optimizer)
        rows.append({"zero": zero, "reshard": reshard, "prefetch": prefetch,
                     "per_parameter": counted.per_parameter,
                     "gradients": counted.gradients / counted.num_parameters,
                     "sent": 0 if stats is None else stats.payload_bytes,
                     "params": counted.num_parameters, "peak_gathered": peak[0]})
        engine.stop_watchdog()
    return rows


def _track_peak(module: nn.Module, sharded: ShardedOptimizer, peak: list[int]) -> None:
    """Sample the live model-state bytes (and ZeRO-2 / 3's bucket buffers) into `peak[0]` at
    every point where they may be at their most: hooks registered after the optimizer's own
    (so a layer is gathered, a gradient added into its bucket, the fp32 copies made)."""
    def sample(*_: object) -> None:
        live = count_model_states(module, sharded).total + sharded.transient_bytes()
        peak[0] = max(peak[0], live)
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(sample)
            for param in layer.parameters():
                param.register_post_accumulate_grad_hook(sample)
    sharded.optimizer.register_step_pre_hook(sample)
    sharded.optimizer.register_step_post_hook(sample)


def _measure_half() -> list[dict[str, Any]]:
    rows = []
    for zero in (1, 2, 3):
        torch.manual_seed(0)
        module = PipelineModule([nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)], num_stages=1,
                                loss_fn=F.mse_loss)
        d = torch.distributed.get_world_size()
        engine = PipelineEngine(module, num_microbatches=4, data_parallel=d, zero_stage=zero,
                                precision="bf16", half_parameters=True,
                                optimizer=lambda p: torch.optim.Adam(p, lr=1e-4))
        sharded = engine.optimizer
        assert isinstance(sharded, ShardedOptimizer)
        peak = [0]
        _track_peak(engine.module, sharded, peak)
        engine.train_batch(torch.randn(8 * d, WIDTH), torch.randn(8 * d, WIDTH))
        counted = count_model_states(engine.module, sharded)
        rows.append({"zero": zero, "d": d, "per_parameter": counted.per_parameter,
                     "peak": peak[0] / counted.num_parameters})
        engine.stop_watchdog()
    return rows


DEEPSPEED = {1: lambda d: 4 + 12 / d, 2: lambda d: 2 + 14 / d, 3: lambda d: 16 / d}
"""Rajbhandari et al. 2020, Figure 1 / DeepSpeed's docs: mixed-precision Adam, bytes per
parameter per rank (K = 12)."""


def main_half() -> None:
    rows = [row for d in (2, 4) for row in launch(_measure_half, d, join_timeout=900)[0]]
    print(f"\n## Model states per rank, bf16 parameters + fp32 masters, pp1 × dp d, Adam "
          f"({LAYERS} × Linear({WIDTH}), rank 0)\n")
    print("| d | ZeRO | ours (B/param) | accounting (B/param) | DeepSpeed (B/param) | "
          "step peak (B/param) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        accounted = model_state_bytes("bf16", zero_stage=row["zero"],
                                      data_parallel=row["d"]).total
        print(f"| {row['d']} | {row['zero']} | {row['per_parameter']:.3f} | {accounted:.3f} | "
              f"{DEEPSPEED[row['zero']](row['d']):.3f} | {row['peak']:.3f} |")
    at4 = {row["zero"]: row["peak"] for row in rows if row["d"] == 4}
    print(f"\nd = 4: ZeRO-3's step peak is {at4[3] / at4[1]:.2f}× ZeRO-1's")


def main() -> None:
    main_half()
    rows = launch(_measure, 2 * DP, join_timeout=900)[0]
    print(f"\n## Model states per rank, pp2 × dp{DP}, fp32 Adam (rank 0, {rows[0]['params']:,} "
          f"parameters)\n")
    print("| ZeRO | reshard_after_forward | prefetch_next_unit | ours (B/param) | paper "
          "(B/param) | gradients (B/param) | payload sent a step (KiB) | ZeRO-3 peak gathered "
          "(KiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        paper = model_state_bytes("fp32", zero_stage=row["zero"], data_parallel=DP).total
        print(f"| {row['zero']} | {row['reshard'] if row['zero'] == 3 else '-'} | "
              f"{row['prefetch'] if row['zero'] == 3 else '-'} | "
              f"{row['per_parameter']:.2f} | {paper:.2f} | {row['gradients']:.2f} | "
              f"{row['sent'] / 1024:.0f} | "
              f"{row['peak_gathered'] / 1024 if row['zero'] == 3 else 0:.0f} |")


if __name__ == "__main__":
    main()
