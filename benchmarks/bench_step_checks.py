"""The step's non-finite vote and clipping norm over DeepSpeed's AlexNet gradients: ours
(`holds_nonfinite`, `global_grad_norm`) against the plain torch forms they replaced
(``isfinite(g).all()``, ``g.float().pow(2).sum()``), and each norm's error from float64.

    python benchmarks/bench_step_checks.py            # 6 alternating rounds, one thread
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "deepspeed_alexnet"))

import torch

from pipeline.parallel.precision import global_grad_norm, holds_nonfinite

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    from train import AlexNet  # the example's model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    grads = [torch.randn_like(p) for p in AlexNet(num_classes=10).parameters()]

    def plain() -> float:
        any(not bool(torch.isfinite(g).all()) for g in grads)
        total = torch.zeros(())
        for g in grads:
            total += g.float().pow(2).sum()
        return float(total.sqrt())

    def ours() -> float:
        holds_nonfinite(grads)
        return float(global_grad_norm(grads, None))

    runners: dict[str, Callable[[], float]] = {"plain torch": plain, "ours": ours}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(args.rounds):
        order = list(runners.items())
        for name, run in order if round_index % 2 else reversed(order):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    exact = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
    per_tensor = float(torch.nn.utils.get_total_norm(grads))
    print(f"vote + norm over {sum(g.numel() for g in grads):,} gradient elements "
          f"(AlexNet), medians of {args.rounds}; load average {os.getloadavg()[0]:.1f}")
    print("| form | ms | norm's relative error |\n|---|---|---|")
    for name, run in runners.items():
        print(f"| {name} | {1000 * statistics.median(times[name]):.1f} | "
              f"{abs(run() - exact) / exact:.1e} |")
    print(f"| torch.nn.utils.get_total_norm (norm only) | - | "
          f"{abs(per_tensor - exact) / exact:.1e} |")


if __name__ == "__main__":
    main()
