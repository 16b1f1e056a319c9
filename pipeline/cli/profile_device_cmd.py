"""`pipesched profile-device`: time GEMMs, memory streaming and collectives on this machine's
device and write the device profile `pipesched plan --device-profile` reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.options import positive_int

__all__ = ["register", "run"]


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 256,1024, got {text!r}") \
            from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, got {text!r}")
    return sizes


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "profile-device", help="measure this device for the planner (GEMMs, memory, links)",
        description="Time every m × n × k GEMM of --sizes, a streaming copy and all-reduces "
                    "over --ranks local ranks on this machine's device (a GPU if there is "
                    "one, else the CPU), and write them as a device profile for "
                    "`pipesched plan --device-profile FILE`.")
    parser.add_argument("--output", type=Path, required=True, metavar="FILE")
    parser.add_argument("--sizes", type=_sizes, default=(64, 256, 1024), metavar="SIZES",
                        help="GEMM dimensions to combine (default 64,256,1024)")
    parser.add_argument("--ranks", type=positive_int, default=2, metavar="N",
                        help="local ranks for the collectives (1: none measured)")
    parser.add_argument("--repeats", type=positive_int, default=3, metavar="N",
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
          f"memory {profile['memory_bandwidth'] / 1e9:.1f} GB/s; wrote {args.output}",
          file=sys.stderr)
    return 0
