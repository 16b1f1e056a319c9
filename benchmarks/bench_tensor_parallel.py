"""Tensor-parallel communication overlap on emulated devices, and our tp step against DTensor's.

Part 1 (emulated): two `ParallelTransformerBlock`s, and two blocks of a HF Llama split by
`tensor_parallel_hf` (fused q;k;v and gate;up, o_proj, down_proj), whose GEMMs and
collectives are timed waits (`pipeline.rehearsal.emulated_tp`), so tp ranks > cores overlap
for real (the HF blocks' attention core, rotary and norms run for real, alike in both steps
below). Per (blocks, sequence parallel, overlap): the exposed tp communication of one
forward + backward, measured as the step with the nominal collective costs minus the same
step with free collectives, beside the rule's prediction (`schedules.analysis.tp_overlap`,
the planner's), and measured / predicted.

Part 2 (real compute, gloo CPU, same run): Llama-shaped blocks (RMSNorm, q/k/v/o, SiLU-gated
MLP) at tp with sequence parallelism, ours (`ColumnParallelLinear` / `RowParallelLinear`,
fused qkv and gate/up, with and without overlap) against torch's DTensor tensor parallelism
(`parallelize_module` with torchtitan's Llama plan: SequenceParallel norms, Colwise q/k/v and
gate/up, Rowwise o and down to Shard(1)). One forward + backward + SGD step, one step of each
implementation per round (median of rounds); each one's output is checked against the
single-process blocks first.

    python benchmarks/bench_tensor_parallel.py                 # tp 4 emulated, tp 2 real
    python benchmarks/bench_tensor_parallel.py --tp 2 --steps 10
    python benchmarks/bench_tensor_parallel.py --skip-real --models hf   # HF blocks only
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tp_dtensor_compare import dtensor_compare_rank
from tp_emulated_overlap import emulated_overlap_rank

from pipeline import launch

__all__ = ["main"]


# ------------------------------------------------------------------------------- main
def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=4, help="emulated tp size (default 4)")
    parser.add_argument("--real-tp", type=int, default=2, help="tp of the DTensor comparison")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per row (median)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=2, help="overlap chunks")
    parser.add_argument("--flop-ns", type=float, default=60.0,
                        help="emulated ns per GEMM FLOP (default 60: a 128·64·64 GEMM 63 ms; "
                             "waits must dwarf the host's Python on a loaded machine)")
    parser.add_argument("--byte-ns", type=float, default=1200.0,
                        help="emulated ns per byte through the link")
    parser.add_argument("--latency-ms", type=float, default=6.0)
    parser.add_argument("--carry-ms", type=float, default=10.0,
                        help="an op issued this soon after the last wait ends starts where it "
                             "was due (a device queue the host keeps ahead of; emulated."
                             "WallClock's carry window; default 10: Python gaps on a loaded "
                             "host)")
    parser.add_argument("--llama-seq", type=int, default=128)
    parser.add_argument("--llama-hidden", type=int, default=256)
    parser.add_argument("--llama-heads", type=int, default=8)
    parser.add_argument("--llama-ffn", type=int, default=704)
    parser.add_argument("--skip-real", action="store_true", help="part 1 only")
    parser.add_argument("--models", default="engine,hf",
                        help="part 1's blocks: engine (ParallelTransformerBlock), hf (a HF "
                             "Llama's, tensor_parallel_hf); default both")
    args = parser.parse_args(argv)
    unknown = set(args.models.split(",")) - {"engine", "hf"}
    if unknown:
        parser.error(f"--models {args.models}: {', '.join(sorted(unknown))} is not engine or hf")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    rows = launch(emulated_overlap_rank, args.tp, args, timeout=120.0, join_timeout=1800.0)[0]
    real = None if args.skip_real else launch(dtensor_compare_rank, args.real_tp, args,
                                              timeout=120.0, join_timeout=1800.0)[0]
    print(f"## Exposed tp communication per step, emulated devices (tp {args.tp}, "
          f"{args.blocks} blocks, b {args.batch}, s {args.seq}, h {args.hidden}, "
          f"f {args.ffn}, chunks {args.chunks})\n")
    print("| blocks | sequence parallel | overlap | step ms | exposed tp comm ms (measured) | "
          "predicted ms | measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    names = {"engine": "ParallelTransformerBlock", "hf": "HF Llama (tensor_parallel_hf)"}
    for row in rows:
        ratio = row["exposed"] / row["predicted"] if row["predicted"] else float("nan")
        print(f"| {names[row['model']]} | {row['sequence_parallel']} | {row['overlap']} | "
              f"{row['step'] * 1e3:.1f} | {row['exposed'] * 1e3:.1f} | "
              f"{row['predicted'] * 1e3:.1f} | {ratio:.3f} |")
    for kind in dict.fromkeys(row["model"] for row in rows):
        for sp in (False, True):
            off, on = (next(r for r in rows if r["model"] == kind
                            and r["sequence_parallel"] == sp and r["overlap"] == o)
                       for o in (False, True))
            print(f"\n{names[kind]}, sequence parallel {sp}: overlap hides "
                  f"{1 - on['exposed'] / off['exposed']:.0%} of the exposed tp communication "
                  f"(predicted {1 - on['predicted'] / off['predicted']:.0%})")
    if real is not None:
        seconds = real["seconds"]
        print(f"\n## Llama-shaped blocks, real compute, gloo CPU, tp {args.real_tp}, sequence "
              f"parallel (b {args.batch}, s {args.llama_seq}, h {args.llama_hidden}, "
              f"heads {args.llama_heads}, f {args.llama_ffn}, {args.blocks} blocks)\n")
        print("| implementation | step ms | / DTensor | max |output - single process| |")
        print("|---|---|---|---|")
        for name, value in seconds.items():
            print(f"| {name} | {value * 1e3:.1f} | {value / seconds['DTensor']:.2f} | "
                  f"{real['max_difference'][name]:.1e} |")


if __name__ == "__main__":
    main()
