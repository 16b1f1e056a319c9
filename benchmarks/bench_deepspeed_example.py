"""DeepSpeed's own pipeline example (AlexNet, DeepSpeedExamples training/pipeline_parallelism):
step time of DeepSpeed's engine against ours through `pipeline.initialize`, same run.

Both engines get the example's model (``join_layers(AlexNet(num_classes=10))``, the
``parameters`` partition, ``CrossEntropyLoss``), the same ds_config (Adam, batch and
microbatch sizes below) and the same microbatches of synthetic CIFAR-shaped images (no
download here; images are SIDE × SIDE, the original crops to 224). They run in the same
processes, one timed step each per round (which goes first alternates), so machine noise hits
both. The example's cut puts ``ReLU(inplace=True)`` first on stage 1, so stage 1 clones its
received input: a hook times that clone again in place, and the last row is its cost per step.

    python benchmarks/bench_deepspeed_example.py                 # 2 ranks, 6 timed steps
    python benchmarks/bench_deepspeed_example.py --deepspeed-cpu-adam  # DeepSpeed's own Adam
    python benchmarks/bench_deepspeed_example.py --side 64 --steps 3 --no-deepspeed
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
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "deepspeed_alexnet"))

import torch
import torch.distributed as dist
from bench_common import deepspeed_available

from pipeline import PipelineModule, ProgressReporter, initialize, launch

__all__ = ["main"]

PP, SEED = 2, 1138
Step = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]


def _config(batch: int, micro: int, torch_adam: bool) -> dict[str, Any]:
    """The example's ds_config with the batch sizes given. With `torch_adam` DeepSpeed steps
    torch's AdamW, as ours does; without, its own compiled CPU Adam. weight_decay 0 is
    spelled out: it is FusedAdam's default (the example's), but torch_adam takes torch's
    AdamW default, 0.01."""
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
            "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                     "eps": 1e-8, "weight_decay": 0,
                                                     "torch_adam": torch_adam}},
            "steps_per_print": 10**9}


class _CloneClock:
    """Times, in place, the clone a stage makes of its received input (once more per call:
    the stage's own clone is not touched), so its cost can be set against the step."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, stage: torch.nn.Module, args: tuple[Any, ...]) -> None:
        start = time.perf_counter()
        args[0].clone()
        self.seconds += time.perf_counter() - start


def _ours(config: dict[str, Any], clock: _CloneClock) -> Step:
    from train import AlexNet, join_layers  # the example's own model and layer list

    torch.manual_seed(SEED)
    module = PipelineModule(layers=join_layers(AlexNet(num_classes=10)),
                            loss_fn=torch.nn.CrossEntropyLoss(), num_stages=PP,
                            partition_method="parameters")
    engine, _, _, _ = initialize(model=module, config=config)
    for index in engine.engine.stage_ids:
        if module.stage(index).clone_input:
            module.stage(index).register_forward_pre_hook(clock)
    return lambda batches: engine.train_batch(data_iter=iter(batches)) and None


def _deepspeed(config: dict[str, Any]) -> Step:
    import deepspeed
    from deepspeed.pipe import PipelineModule as DSPipelineModule
    from train import AlexNet, join_layers

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(SEED)
    module = DSPipelineModule(layers=join_layers(AlexNet(num_classes=10)),
                              loss_fn=torch.nn.CrossEntropyLoss(), num_stages=PP,
                              partition_method="parameters", activation_checkpoint_interval=0)
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=config)
    return lambda batches: engine.train_batch(data_iter=iter(batches)) and None


def _timed(step: Step, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step(batches)
    dist.barrier()
    return time.perf_counter() - start


def _bench_rank(side: int, batch: int, micro: int, steps: int, warmup: int,
                use_deepspeed: bool, torch_adam: bool) -> dict[str, float]:
    torch.set_num_threads(1)
    config = _config(batch, micro, torch_adam)
    clock = _CloneClock()
    runners: dict[str, Step] = {"ours": _ours(config, clock)}
    if use_deepspeed:
        runners["DeepSpeed"] = _deepspeed(config)
    torch.set_num_threads(1)  # in case a framework changed it
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(micro, 3, side, side, generator=generator),
                torch.randint(0, 10, (micro,), generator=generator))
               for _ in range(batch // micro)]
    times: dict[str, list[float]] = {name: [] for name in runners}
    # minutes of work on a loaded machine: rank 0 says where it stands after each round
    progress = ProgressReporter(warmup + steps, what="round", every=0.0)
    for round_index in progress.track(range(warmup + steps)):
        order = list(runners.items())
        for name, step in order if round_index % 2 else reversed(order):  # alternate first
            if name == "ours" and round_index == warmup:
                clock.seconds = 0.0
            elapsed = _timed(step, batches)
            if round_index >= warmup:
                times[name].append(elapsed)
    times["ours: cloning received inputs"] = [clock.seconds / steps]
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=64, help="image side (>= 64)")
    parser.add_argument("--batch", type=int, default=32, help="train_batch_size")
    parser.add_argument("--micro", type=int, default=4, help="train_micro_batch_size_per_gpu")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--deepspeed-cpu-adam", action="store_true",
                        help="let DeepSpeed step its own compiled CPU Adam (default: torch's "
                             "AdamW in both engines, via torch_adam)")
    args = parser.parse_args(argv)
    use_deepspeed = deepspeed_available(not args.no_deepspeed, "ours only")
    started = time.time()
    rows = launch(_bench_rank, PP, args.side, args.batch, args.micro, args.steps, args.warmup,
                  use_deepspeed, not args.deepspeed_cpu_adam, timeout=1800,
                  threads_per_rank=1)
    slowest = {name: max(row[name] for row in rows) for name in rows[0]}
    print(f"DeepSpeed's AlexNet pipeline example, p = {PP} (gloo, 1 thread per rank), images "
          f"{args.side}², batch {args.batch}, microbatch {args.micro} (m = "
          f"{args.batch // args.micro}, 1F1B), Adam fp32 ("
          f"{'DeepSpeed CPU Adam' if args.deepspeed_cpu_adam else 'torch AdamW in both'}); "
          f"medians of {args.steps} steps, slowest rank; torch {torch.__version__}; "
          f"{time.time() - started:.0f} s")
    clone = slowest.pop("ours: cloning received inputs")
    base = slowest.get("DeepSpeed")
    print("| engine | step time (ms) | / DeepSpeed |\n|---|---|---|")
    for name, value in slowest.items():
        ratio = f"{value / base:.2f}" if base else "n/a"
        print(f"| {name} | {value * 1e3:.0f} | {ratio} |")
    print(f"\ncloning the received input before the in-place ReLU: {clone * 1e3:.2f} ms per "
          f"step ({100 * clone / slowest['ours']:.2f}% of our step)")


if __name__ == "__main__":
    main()
