"""pp2 × dp2 with ZeRO-1 on 4 CPU processes: step time against DeepSpeed's pipeline engine, and
bytes each rank sends per step against the theoretical figure.

Both engines train the same model (Linear + GELU layers, Adam, fp32) on the same global
batch, 1F1B with m microbatches, each data-parallel replica on its half of the batch; they
run in the same processes, one timed step each per round, so machine noise hits both.

Bytes sent are measured, not counted by our code: the growth of ``wchar`` in /proc/self/io
(bytes passed to write-family syscalls, which is how gloo's TCP transport sends) around
each step, plus, for our engine, the bytes its one-host datagram link handed to `sendmsg`
(`LocalLink.sent_bytes`: the kernel counts `sendmsg` on a Unix socket in no field of
/proc/self/io). The theory for one rank per step, N = its stage's parameter bytes, d = dp:

    activations or their gradients: m · microbatch · width · 4 bytes to the neighbour stage
    ZeRO-1: reduce-scatter (d-1)/d · N + all-gather (d-1)/d · N     (ring algorithms)

    python benchmarks/bench_3d.py                       # m = 8, 10 timed steps
    python benchmarks/bench_3d.py --steps 5 --no-deepspeed
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_common import deepspeed_available
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, launch

__all__ = ["main"]

WIDTH, DEPTH, BATCH, PP, DP = 512, 16, 128, 2, 2
Step = Callable[[torch.Tensor, torch.Tensor], None]


def _layers(spec: Any) -> list[Any]:
    """DEPTH × (Linear(WIDTH), GELU) as 2·DEPTH layer entries, with either LayerSpec."""
    return [entry for _ in range(DEPTH)
            for entry in (spec(nn.Linear, WIDTH, WIDTH), spec(nn.GELU))]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor))


def _ours(m: int) -> tuple[Step, Callable[[], int], int, Callable[[], int]]:
    module = PipelineModule(_layers(LayerSpec), num_stages=PP, loss_fn=F.mse_loss,
                            partition_method="uniform")
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=m, optimizer=_adam,
                            data_parallel=DP, zero_stage=1)
    stage_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    link = engine.comm.local
    return ((lambda x, y: engine.train_batch(x, y)), engine.optimizer_state_bytes,
            stage_bytes, lambda: link.sent_bytes if link is not None else 0)


def _deepspeed(m: int) -> tuple[Step, Callable[[], int]]:
    import deepspeed
    from deepspeed.pipe import LayerSpec as DSLayerSpec
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    module = DSPipelineModule(layers=_layers(DSLayerSpec), num_stages=PP, loss_fn=F.mse_loss,
                              partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=_adam(list(module.parameters())), config={
            "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // (DP * m),
            "gradient_accumulation_steps": m, "steps_per_print": 10**9,
            "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True})
    size = BATCH // (DP * m)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_batch(data_iter=iter([(x[k * size:(k + 1) * size],
                                            y[k * size:(k + 1) * size]) for k in range(m)]))
    return step, lambda: _state_bytes(engine.optimizer.optimizer)


def _written() -> int:
    with open("/proc/self/io") as handle:
        fields = dict(line.split(": ") for line in handle.read().splitlines())
    return int(fields["wchar"])


def _timed(step: Step, x: torch.Tensor, y: torch.Tensor,
           datagrams: Callable[[], int]) -> tuple[float, int]:
    dist.barrier()
    start, written, linked = time.perf_counter(), _written(), datagrams()
    step(x, y)
    sent = _written() - written + datagrams() - linked
    dist.barrier()
    return time.perf_counter() - start, sent


def _bench_rank(m: int, steps: int, warmup: int, use_deepspeed: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH,
                                                                      generator=generator)
    ours, ours_state, stage_bytes, ours_datagrams = _ours(m)
    runners: dict[str, tuple[Step, Callable[[], int], Callable[[], int]]] = {
        "ours": (ours, ours_state, ours_datagrams)}
    if use_deepspeed:
        runners["deepspeed"] = (*_deepspeed(m), lambda: 0)
    torch.set_num_threads(1)  # in case a framework changed it
    replica = dist.get_rank() % DP  # global rank = pp_rank · dp + dp_rank in both engines
    half = slice(replica * BATCH // DP, (replica + 1) * BATCH // DP)
    times: dict[str, list[float]] = {name: [] for name in runners}
    sent: dict[str, list[int]] = {name: [] for name in runners}
    for round_index in range(warmup + steps):
        for name, (step, _, datagrams) in runners.items():
            elapsed, written = _timed(step, x[half], y[half], datagrams)
            if round_index >= warmup:
                times[name].append(elapsed)
                sent[name].append(written)
    activations = m * (BATCH // (DP * m)) * WIDTH * 4
    return {"rank": dist.get_rank(), "time": {k: statistics.median(v) for k, v in times.items()},
            "sent": {k: statistics.median(v) for k, v in sent.items()},
            "state": {name: state() for name, (_, state, _) in runners.items()},
            "theory": activations + 2 * (DP - 1) * stage_bytes // DP,
            "stage_bytes": stage_bytes}


def _tables(rows: list[dict[str, Any]]) -> str:
    names = list(rows[0]["time"])
    slowest = {name: max(row["time"][name] for row in rows) for name in names}
    lines = ["| engine | step time (ms) | ours / DeepSpeed | Adam state bytes / rank "
             "(unsharded) |", "|---|---|---|---|"]
    unsharded = 2 * rows[0]["stage_bytes"]  # exp_avg + exp_avg_sq in fp32, one stage
    for name in names:
        ratio = (f"{slowest['ours'] / slowest['deepspeed']:.2f}" if "deepspeed" in slowest
                 else "n/a")
        lines.append(f"| {name} | {slowest[name] * 1e3:.0f} | {ratio if name == 'ours' else ''}"
                     f" | {rows[0]['state'][name]:,} ({unsharded:,}) |")
    lines += ["", "| rank | stage | ours sent (bytes) | DeepSpeed sent (bytes) | theory "
              "(bytes) | ours / theory |", "|---|---|---|---|---|---|"]
    for row in rows:
        ds = f"{row['sent']['deepspeed']:,.0f}" if "deepspeed" in row["sent"] else "n/a"
        lines.append(f"| {row['rank']} | {row['rank'] // DP} | {row['sent']['ours']:,.0f} | "
                     f"{ds} | {row['theory']:,} | {row['sent']['ours'] / row['theory']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args(argv)
    use_deepspeed = deepspeed_available(not args.no_deepspeed, "ours only")
    started = time.time()
    rows = launch(_bench_rank, PP * DP, args.microbatches, args.steps, args.warmup,
                  use_deepspeed, timeout=600, threads_per_rank=1)
    print(f"pp{PP} × dp{DP}, ZeRO-1, 4 ranks (gloo, 1 thread each), {DEPTH} × "
          f"(Linear({WIDTH}), GELU), Adam fp32, global batch {BATCH}, m = {args.microbatches}"
          f" (1F1B); medians of {args.steps} steps, slowest rank; torch {torch.__version__}; "
          f"{time.time() - started:.0f} s")
    print(_tables(rows))


if __name__ == "__main__":
    main()
