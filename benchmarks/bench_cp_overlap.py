"""Context-parallel communication on emulated devices: exposed measured against predicted.

Per cp size and attention (ring with its passes overlapped with the blocks' computation,
ring without overlap, the K/V all-gather): `--layers` attention calls of this rank's
load-balanced chunks (a causal mask on global positions), one forward + backward, whose
attention blocks and messages are timed waits (`pipeline.rehearsal.emulated_cp`), so cp
ranks > cores overlap for real. The exposed cp communication is the step with the nominal
message costs minus the same step with free messages (median of the pairs, the two steps
alternating so the host's load hits both alike), beside `predict_exposed`'s closed form, and
measured / predicted.

    PYTHONPATH=$PWD python benchmarks/bench_cp_overlap.py              # cp 2 and 4
    PYTHONPATH=$PWD python benchmarks/bench_cp_overlap.py --cp 2 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from bench_common import timed_step

from pipeline import launch
from pipeline.parallel.context.gathered import gathered_attention
from pipeline.parallel.context.mask import PositionMask
from pipeline.parallel.context.ring import ring_attention
from pipeline.parallel.context.sharding import gathered_positions, rank_positions
from pipeline.rehearsal.emulated import WallClock
from pipeline.rehearsal.emulated_cp import EmulatedContextCosts, EmulatedContextOps, predict_exposed

__all__ = ["main"]

VARIANTS = (("ring", True), ("ring", False), ("all-gather", False))


def _rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    costs = EmulatedContextCosts(flop_seconds=args.flop_ns * 1e-9,
                                 byte_seconds=args.byte_ns * 1e-9,
                                 latency=args.latency_ms * 1e-3)
    free = EmulatedContextCosts(flop_seconds=costs.flop_seconds, byte_seconds=0.0)
    tokens = args.tokens  # this rank's
    length = tokens * cp
    mask = PositionMask(rank_positions(length, rank, cp)[None], gathered_positions(length, cp),
                        None, None)
    torch.manual_seed(rank)
    inputs = [[torch.randn(args.batch, heads, tokens, args.head_dim)
               for heads in (args.heads, args.kv_heads, args.kv_heads)]
              for _ in range(args.layers)]
    rows = []
    for attention, overlap in VARIANTS:
        steps = {}
        for name, model in (("nominal", costs), ("free", free)):
            ops = EmulatedContextOps(model, WallClock(carry_window=args.carry_ms * 1e-3))

            def step(ops: EmulatedContextOps = ops, attention: str = attention,
                     overlap: bool = overlap) -> None:
                total = torch.zeros(())
                for q, k, v in inputs:
                    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
                    out = ring_attention(q, k, v, mask, group, 0.125, overlap=overlap,
                                         ops=ops) if attention == "ring" else \
                        gathered_attention(q, k, v, mask, group, 0.125, ops)
                    total = total + out.sum()
                total.backward()

            steps[name] = step
        pairs = [(timed_step(steps["nominal"]), timed_step(steps["free"]))
                 for _ in range(args.steps + 1)][1:]
        predicted = args.layers * predict_exposed(
            costs, attention=attention, overlap=overlap,  # type: ignore[arg-type]
            cp=cp, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
            tokens=tokens, head_dim=args.head_dim)
        rows.append({"cp": cp, "attention": attention, "overlap": overlap,
                     "step": statistics.median(a for a, _ in pairs),
                     "exposed": statistics.median(a - b for a, b in pairs),
                     "predicted": predicted})
    return rows


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=7, help="timed pairs per row (median)")
    parser.add_argument("--layers", type=int, default=2, help="attention calls per step")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128, help="a rank's tokens (S / cp)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--flop-ns", type=float, default=2.0,
                        help="emulated ns per attention FLOP (default 2: a 128 × 128 block "
                             "of 4 heads of 32, 8.4 MFLOP, 17 ms forward, 42 ms backward)")
    parser.add_argument("--byte-ns", type=float, default=400.0,
                        help="emulated ns per byte through the link (default 400: a K/V "
                             "block pass of 64 KiB 26 ms)")
    parser.add_argument("--latency-ms", type=float, default=2.0)
    parser.add_argument("--carry-ms", type=float, default=10.0,
                        help="emulated.WallClock's carry window (Python gaps on a loaded host)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    rows = [row for cp in args.cp
            for row in launch(_rank, cp, args, timeout=120.0, join_timeout=1800.0)[0]]
    print(f"## Exposed cp communication per step, emulated devices ({args.layers} attention "
          f"calls, b {args.batch}, {args.heads} heads, {args.kv_heads} kv heads, "
          f"{args.tokens} tokens a rank, d {args.head_dim}, causal)\n")
    print("| cp | attention | overlap | step ms | exposed cp comm ms (measured) | "
          "predicted ms | measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['cp']} | {row['attention']} | {row['overlap']} | "
              f"{row['step'] * 1e3:.1f} | {row['exposed'] * 1e3:.1f} | "
              f"{row['predicted'] * 1e3:.1f} | {row['exposed'] / row['predicted']:.3f} |")
    for cp in args.cp:
        on, off = (next(r for r in rows if r["cp"] == cp and r["attention"] == "ring"
                        and r["overlap"] == o) for o in (True, False))
        print(f"\ncp {cp}: overlap hides {1 - on['exposed'] / off['exposed']:.0%} of the "
              f"ring's exposed communication (predicted "
              f"{1 - on['predicted'] / off['predicted']:.0%})")


if __name__ == "__main__":
    main()
