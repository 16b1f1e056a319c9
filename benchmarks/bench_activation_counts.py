"""Activation bytes the engine holds against the planner's prediction, per recomputation mode,
with and without sequence parallelism, at tp = 2 (`tests/support/activation_counts.py`: one
stage of the engine's tensor-parallel embedding, blocks, head and vocab-parallel loss).

    PYTHONPATH=$PWD python benchmarks/bench_activation_counts.py

Counted bytes are exact and repeatable (saved-tensor hooks over a one-microbatch step);
the prediction is `PlanContext.memory`'s activations for the same shape and configuration.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline import launch
from tests.support.activation_counts import FFN, VOCAB, A, B, H, L, S, launched_counts

__all__ = ["main"]


def main() -> None:
    counts = launch(launched_counts, 2, timeout=120, join_timeout=600)[0]
    print(f"activation bytes of one microbatch, tp 2, pp 1: s={S} b={B} h={H} a={A} f={FFN} "
          f"V={VOCAB}, {L} blocks + embedding + head + loss, fp32, fused attention, no "
          "dropout (rank 0)")
    print(f"{'recompute':<11}{'sequence parallel':<19}{'predicted':>11}{'counted':>11}"
          f"{'counted/predicted':>19}")
    for count in counts:
        print(f"{count.mode:<11}{'yes' if count.sequence_parallel else 'no':<19}"
              f"{count.predicted:>11.0f}{count.counted:>11}"
              f"{count.counted / count.predicted:>19.3f}")


if __name__ == "__main__":
    main()
