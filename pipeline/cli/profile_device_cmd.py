"""`pipesched profile-device`: time GEMMs, memory streaming and collectives on this machine's
device and write the device profile `pipesched plan --device-profile` reads."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pipeline.cli.options import positive_int
from pipeline.files import OutputFileType

__all__ = ["MAX_GEMM_SIZE", "MAX_REPEATS", "MAX_SIZES", "register", "run"]

MAX_GEMM_SIZE = 8192
"""Largest GEMM dimension profiled (three 8192² fp32 matrices: 805 MB)."""
MAX_SIZES = 8
"""Most GEMM dimensions: every m × n × k combination of them is timed (8³ = 512 GEMMs)."""
MAX_REPEATS = 100
"""Most timed runs of each kernel."""


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 256,1024, got {text!r}") \
            from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text[:60]!r}")
    if max(sizes) > MAX_GEMM_SIZE or len(sizes) > MAX_SIZES:
        # every m × n × k combination is timed: 20,000 ran past 300 s, 100,000 ran out of
        # memory allocating its matrices
        raise argparse.ArgumentTypeError(
            f"at most {MAX_SIZES} sizes of at most {MAX_GEMM_SIZE:,} each (every m × n × k "
            f"of them is timed), got {len(sizes)} up to {max(sizes):,}")
    return sizes


def _repeats(text: str) -> int:
    value = positive_int(text)
    if value > MAX_REPEATS:
        raise argparse.ArgumentTypeError(f"at most {MAX_REPEATS} timed runs per kernel (the "
                                         f"fastest is kept), got {value:,}")
    return value


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "profile-device", help="measure this device for the planner (GEMMs, memory, links)",
        description="Time every m × n × k GEMM of --sizes, a streaming copy, the host's "
                    "seconds per eager autograd op and all-reduces over --ranks local ranks "
                    "on this machine's device (a GPU if there is one, else the CPU), and "
                    "write them as a device profile for "
                    "`pipesched plan --device-profile FILE`.")
    parser.add_argument("--output", type=OutputFileType(), required=True, metavar="FILE")
    parser.add_argument("--sizes", type=_sizes, default=(64, 256, 1024), metavar="SIZES",
                        help="GEMM dimensions to combine (default 64,256,1024)")
    parser.add_argument("--ranks", type=positive_int, default=2, metavar="N",
                        help="local ranks for the collectives (1: none measured)")
    parser.add_argument("--repeats", type=_repeats, default=3, metavar="N",
                        help="timed runs of each kernel, the fastest kept")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.planner.calibrate import profile_device
    from pipeline.planner.device_profile import write_device_profile

    profile = profile_device(gemm_sizes=args.sizes, repeats=args.repeats, ranks=args.ranks,
                             precision=args.precision)
    write_device_profile(args.output, profile)
    print(f"pipesched profile-device: {len(profile['gemms'])} GEMMs on {profile['device']}, "
          f"memory {profile['memory_bandwidth'] / 1e9:.1f} GB/s, host "
          f"{profile['host_op_seconds'] * 1e6:.1f} µs an op; wrote {args.output}",
          file=sys.stderr)
    return 0
