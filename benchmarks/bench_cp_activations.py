"""Activation bytes one context-parallel rank holds against the planner's prediction, at cp 1,
2 and 4, beside autograd through the K/V all-gather (which keeps the gathered K/V) as the peer
(`tests/support/cp_activation_counts.py`: a tiny HF Llama, s=128, b=2, one stage, one
microbatch, 4 gloo ranks).

    PYTHONPATH=$PWD python benchmarks/bench_cp_activations.py

Counted bytes are exact and repeatable (saved-tensor hooks over a one-microbatch step); the
prediction is `PlanContext`'s held activations for the same config.json and configuration.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline import launch
from tests.interop.test_cp_activation_counts import _counts_honest_and_planted
from tests.support.cp_activation_counts import B, S

__all__ = ["main"]


def main() -> None:
    honest, kept = launch(_counts_honest_and_planted, 4, timeout=120,
                          join_timeout=900)[0]
    print(f"activation bytes of one microbatch on one rank: tiny HF Llama (2 blocks, h=32, "
          f"4 heads, 2 kv heads, V=50), s={S} b={B}, pp 1, fp32, all-gather attention")
    print(f"{'cp':>3}{'predicted':>12}{'counted':>12}{'counted/predicted':>19}"
          f"{'peak / cp 1':>13}{'gathered K/V kept (peer)':>26}{'peer / cp 1':>13}")
    for mine, peer in zip(honest, kept, strict=True):
        print(f"{mine.cp:>3}{mine.predicted:>12.0f}{mine.counted:>12}"
              f"{mine.counted / mine.predicted:>19.3f}"
              f"{mine.counted / honest[0].counted:>13.3f}{peer.counted:>26}"
              f"{peer.counted / kept[0].counted:>13.3f}")


if __name__ == "__main__":
    main()
