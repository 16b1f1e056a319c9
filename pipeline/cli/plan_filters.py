"""`pipesched plan`'s search filters (--schedules, --pp/--tp/--dp/..., --zero, --recompute)
parsed from their comma-separated text."""

from __future__ import annotations

import argparse

from pipeline.limits import MAX_COUNT

__all__ = ["parse_names", "parse_recompute", "parse_sizes", "parse_zero_stages"]


def parse_names(text: str | None, what: str) -> tuple[str, ...] | None:
    """The comma-separated items of --`what` (None when not given); refused if it names none."""
    if text is None:
        return None
    names = tuple(item.strip() for item in text.split(",") if item.strip())
    if not names:
        raise ValueError(f"--{what} {text!r} names nothing; give a comma-separated list")
    return names


def parse_sizes(text: str | None, what: str = "tensor-parallel") -> tuple[int, ...] | None:
    """The comma-separated sizes of --`what` (None when not given), each in 1..MAX_COUNT."""
    names = parse_names(text, what)
    if names is None:
        return None
    try:
        sizes = tuple(int(name) for name in names)
    except ValueError:
        raise ValueError(f"--{what} {text!r} must be whole numbers, e.g. 1,2,4") from None
    if any(not 1 <= size <= MAX_COUNT for size in sizes):
        raise ValueError(f"--{what} {str(text)[:60]!r} must be whole numbers in "
                         f"1..{MAX_COUNT:,}")
    return sizes


def parse_zero_stages(text: str | None, fsdp: bool) -> tuple[int, ...] | None:
    """The --zero stages; --fsdp (fully sharded data parallelism) is ZeRO-3."""
    names = parse_names(text, "zero")
    if fsdp and names is not None and "3" not in names:
        raise ValueError(f"--fsdp is ZeRO-3, but --zero {text} leaves 3 out: add 3 to --zero "
                         f"or drop --fsdp")
    if names is None:
        return (3,) if fsdp else None
    if any(name not in ("0", "1", "2", "3") for name in names):
        raise ValueError(f"--zero {text}: ZeRO stages are 0, 1, 2 and 3 (e.g. --zero 0,1,2,3)")
    return tuple(int(name) for name in names)


def parse_recompute(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The recomputation modes to search, from --recompute and --no-recompute."""
    from pipeline.planner.search import RECOMPUTE_CHOICES

    names = parse_names(args.recompute, "recompute")
    if names is None:
        return ("none",) if args.no_recompute else None
    unknown = [name for name in names if name not in RECOMPUTE_CHOICES]
    if unknown:
        raise ValueError(f"--recompute {args.recompute!r}: {', '.join(unknown)} unknown; "
                         f"use some of {','.join(RECOMPUTE_CHOICES)}")
    if args.no_recompute and set(names) - {"none"}:
        raise ValueError(f"--no-recompute contradicts --recompute {args.recompute}; give one "
                         f"of them")
    return tuple(dict.fromkeys(names))
