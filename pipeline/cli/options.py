"""Arguments shared by the schedule commands, parsed once at the CLI edge into typed values."""

from __future__ import annotations

import argparse
import math

from pipeline.limits import MAX_COUNT, MAX_NUMBER
from schedules import SCHEDULES, CostModel, GradReduction, ParamGather
from schedules.analysis.reduction import ring_reduction_time
from schedules.ir.limits import MAX_COST, check_schedule_size

__all__ = [
    "BUCKET_BYTES",
    "MAX_SEARCHED_WORK",
    "MIN_TIMEOUT",
    "add_cost_arguments",
    "add_gather_arguments",
    "add_reduction_arguments",
    "add_schedule_arguments",
    "check_size",
    "chunks_of",
    "cost_model",
    "cost_number",
    "fraction",
    "grad_reduction",
    "non_negative_float",
    "param_gather",
    "positive_float",
    "positive_int",
    "seed_int",
    "timeout_seconds",
]

MIN_TIMEOUT = 1.0
"""Shortest timeout the command line takes, in seconds."""
BUCKET_BYTES = 25 * 2**20
"""The engine's default gradient bucket (`ParallelConfig.bucket_mb`, DDP's 25 MiB)."""


def positive_int(text: str) -> int:
    """argparse type: an int in 1..`MAX_COUNT`, with an error naming the value."""
    try:
        value = int(text)
    except ValueError:  # a word, or over 4,300 digits (int_max_str_digits)
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got "
                                         f"{_shown(text)}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT:,} (2^40), got "
                                         f"{_shown(text)}")
    return value


def seed_int(text: str) -> int:
    """argparse type of a random seed: a whole number torch takes, in [-2^63, 2^63)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {_shown(text)}") \
            from None
    if not -2**63 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"a seed must be in [-2^63, 2^63), got {_shown(text)}")
    return value


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got "
                                         f"{_shown(text)}") from None
    if not 0.0 <= value <= 1.0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {_shown(text)}")
    return value


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37] + "...")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number in 0..`MAX_NUMBER`."""
    value = _finite_non_negative(text)
    if value > MAX_NUMBER:
        raise argparse.ArgumentTypeError(f"{_shown(text)} is over {MAX_NUMBER:g}, the largest "
                                         "number a flag takes; use a larger unit")
    return value


def _finite_non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {_shown(text)}")
    return value


def timeout_seconds(text: str) -> float:
    """argparse type of a timeout: a number of seconds in (0, 30 days]."""
    from pipeline.limits import MAX_TIMEOUT

    value = positive_float(text)
    if value < MIN_TIMEOUT:  # 1e-9 was accepted and then blamed a rank for the wait
        raise argparse.ArgumentTypeError(f"must be at least {MIN_TIMEOUT:g} second (no wait "
                                         f"between ranks is shorter), got {_shown(text)}")
    if value > MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT:g} seconds (30 days), "
                                         f"got {text!r}")
    return value


def cost_number(text: str) -> float:
    """argparse type of a cost option: a number in 0..`MAX_COST`, so that sums of millions of
    op times stay finite (1e308 would print a makespan of inf and NaN figures)."""
    value = _finite_non_negative(text)
    if value > MAX_COST:
        raise argparse.ArgumentTypeError(
            f"{text!r} is over the largest cost we simulate, {MAX_COST:g} "
            "(schedules.ir.limits.MAX_COST); express the costs in a larger unit (e.g. ms "
            "instead of ns, MB instead of bytes)")
    return value


def add_schedule_arguments(parser: argparse.ArgumentParser, *, single: bool = True,
                           defaults: tuple[str, int, int] | None = None,
                           memory_limit: bool = True) -> None:
    """--schedule (when `single`), --stages, --microbatches, --chunks and --memory-limit.

    Required unless `defaults` gives (schedule, stages, microbatches).
    """
    schedule, stages, microbatches = defaults or (None, None, None)

    def shown(value: object) -> str:
        return f" (default {value})" if defaults else ""

    if single:
        parser.add_argument("--schedule", required=defaults is None, default=schedule,
                            choices=sorted(SCHEDULES), help=f"schedule name{shown(schedule)}")
    parser.add_argument("--stages", type=positive_int, required=defaults is None,
                        default=stages, metavar="P",
                        help=f"pipeline ranks p (stages = p × chunks){shown(stages)}")
    parser.add_argument("--microbatches", type=positive_int, required=defaults is None,
                        default=microbatches, metavar="M",
                        help=f"microbatches m per step{shown(microbatches)}")
    parser.add_argument("--chunks", type=positive_int, default=None, metavar="V",
                        help="model chunks per rank v (interleaved, looped-bfs, zb-v, "
                             "dualpipev: default 2; others: 1)")
    if memory_limit:
        parser.add_argument("--memory-limit", type=positive_int, default=None, metavar="K",
                            help="cost-aware schedules only (zb-auto, zb-v-auto, "
                                 "interleaved-zb, zb-optimal): (stage, microbatch) activations "
                                 "a rank may hold (default 2p; interleaved-zb v*p)")


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """Per-op costs of the simulator (the same for every stage)."""
    group = parser.add_argument_group(
        "costs (time units, the same on every rank; with v chunks each chunk costs 1/v)")
    group.add_argument("--forward", type=cost_number, default=1.0, metavar="TF",
                       help="forward time F of one rank's share of the model (default 1)")
    group.add_argument("--backward", type=cost_number, default=1.0, metavar="TB",
                       help="input-gradient backward time (default 1)")
    group.add_argument("--weight", type=cost_number, default=1.0, metavar="TW",
                       help="weight-gradient time (default 1); a fused B costs TB + TW")
    group.add_argument("--comm", type=cost_number, default=0.0, metavar="TC",
                       help="delay on every cross-rank dependency (default 0)")
    group.add_argument("--activation-bytes", type=cost_number, default=0.0,
                       metavar="BYTES", help="bytes of one microbatch's activation per stage")
    group.add_argument("--overlap", type=fraction, default=1.0, metavar="FRACTION",
                       help="time of an overlapped F&B pair (dualpipev-overlap) as a fraction "
                            "of F + B back to back (default 1: no gain)")


def add_reduction_arguments(parser: argparse.ArgumentParser) -> None:
    """The data-parallel gradient reduction (off unless --reduce-time or --reduce-bandwidth
    is given); its d and ZeRO stage are --data-parallel and --zero-stage."""
    group = parser.add_argument_group(
        "data-parallel gradient reduction (simulated when --reduce-time or --reduce-bandwidth "
        "is given; d and ZeRO-1 from --data-parallel and --zero-stage)")
    group.add_argument("--reduce-time", type=cost_number, default=None, metavar="TR",
                       help="time of one rank's whole gradient reduction (its all-reduce; "
                            "ZeRO-1: its reduce-scatter); with v chunks each chunk's is TR/v")
    group.add_argument("--reduce-bandwidth", type=positive_float, default=None, metavar="BW",
                       help="instead of --reduce-time: bytes per time unit of a ring over "
                            "--data-parallel ranks, reducing --params-bytes per stage")
    group.add_argument("--reduce-buckets", type=positive_int, default=None, metavar="K",
                       help="buckets per stage (default: --params-bytes in the engine's 25 MiB "
                            "buckets, else 1)")
    group.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce",
                       action="store_false",
                       help="launch each stage's reduction at its REDUCE_GRAD, after its last "
                            "backward (default: from the gradient hooks of that backward, as "
                            "each bucket becomes final)")


def grad_reduction(args: argparse.Namespace, chunks: int = 1) -> GradReduction | None:
    """The `GradReduction` the reduction arguments describe (None when not asked for)."""
    time, bandwidth = args.reduce_time, args.reduce_bandwidth
    if time is None and bandwidth is None:
        return None
    params = getattr(args, "params_bytes", None)
    if time is not None and bandwidth is not None:
        raise ValueError("give --reduce-time or --reduce-bandwidth, not both")
    if bandwidth is not None:
        if params is None:
            raise ValueError("--reduce-bandwidth reduces --params-bytes per stage: give "
                             "--params-bytes too (or --reduce-time)")
        time = ring_reduction_time(params, args.data_parallel, bandwidth,
                                   zero_stage=args.zero_stage)
    else:
        time = time / chunks
    return GradReduction(time=time, buckets=_buckets(args),
                         start="overlap" if args.overlap_grad_reduce else "after_backward")


def _buckets(args: argparse.Namespace) -> int:
    """--reduce-buckets, else --params-bytes in the engine's buckets, else 1."""
    params = getattr(args, "params_bytes", None)
    return args.reduce_buckets or (max(1, math.ceil(params / BUCKET_BYTES)) if params else 1)


def add_gather_arguments(parser: argparse.ArgumentParser) -> None:
    """ZeRO-1's parameter all-gather after the step (off unless --gather-time is given)."""
    group = parser.add_argument_group(
        "ZeRO-1 parameter all-gather (simulated when --gather-time is given, with "
        "--zero-stage 1; in the reduction's buckets, --reduce-buckets)")
    group.add_argument("--gather-time", type=cost_number, default=None, metavar="TG",
                       help="time of one rank's whole parameter all-gather after the step; "
                            "with v chunks each chunk's is TG/v")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="leave the gathers in flight for the next step's forwards, each "
                            "layer waiting for its own buckets (default: blocking at STEP, "
                            "after the reduction)")
    group.add_argument("--gather-layers", type=positive_int, default=None, metavar="N",
                       help="with --overlap-param-gather: equal layers per stage, each waiting "
                            "for the buckets holding its parameters (default: as many as "
                            "buckets)")


def param_gather(args: argparse.Namespace, chunks: int = 1) -> ParamGather | None:
    """The `ParamGather` the gather arguments describe (None when not asked for)."""
    if args.gather_time is None:
        if args.overlap_param_gather or args.gather_layers is not None:
            raise ValueError("--overlap-param-gather and --gather-layers describe the gather: "
                             "give --gather-time too")
        return None
    if getattr(args, "zero_stage", 0) != 1:
        raise ValueError("--gather-time is ZeRO-1's parameter all-gather: add --zero-stage 1")
    return ParamGather(time=args.gather_time / chunks, buckets=_buckets(args),
                       overlap=args.overlap_param_gather, layers=args.gather_layers)


MAX_SEARCHED_WORK = 16_384
"""Most p·m·v a cost-aware (searched) schedule is built for from the command line: their
search simulates up to about 40 candidate orders, so interleaved-zb at p=64, m=512, v=2
(65,536) took over a minute where the fixed schedules take a second."""


def check_size(name: str, args: argparse.Namespace, chunks: int | None, *,
               lowered: bool = True) -> None:
    """Refuse, before building, a schedule of `args.stages` × `args.microbatches` × `chunks`
    (the schedule's default when None) too large to build (see `schedules.ir.limits`)."""
    v = chunks if chunks is not None else SCHEDULES[name].default_chunks
    check_schedule_size(args.stages, args.microbatches, v, lowered=lowered,
                        names=("--stages", "--microbatches", "--chunks"))
    work = args.stages * args.microbatches * v
    if SCHEDULES[name].plan is not None and work > MAX_SEARCHED_WORK:  # a searched one
        raise ValueError(
            f"--schedule {name} searches dozens of candidate orders, each simulated: --stages "
            f"{args.stages:,} × --microbatches {args.microbatches:,} × {v} chunks is "
            f"{work:,} stage-microbatches, over the limit of {MAX_SEARCHED_WORK:,} for a "
            "searched schedule (about 20 s here); lower --stages or --microbatches, or use a "
            "fixed schedule (1f1b, interleaved, zb-h1)")


def chunks_of(args: argparse.Namespace) -> int:
    """The chunks per rank the run will use: --chunks, else the schedule's default."""
    return args.chunks if args.chunks is not None else SCHEDULES[args.schedule].default_chunks


def cost_model(args: argparse.Namespace, chunks: int = 1) -> CostModel:
    """The `CostModel` the cost arguments describe, for a schedule with `chunks` per rank.

    The times are for one rank's share of the model, so every schedule in a comparison
    models the same network: a chunk of an interleaved schedule costs 1/v of them.
    """
    return CostModel(forward=args.forward / chunks, backward=args.backward / chunks,
                     weight=args.weight / chunks, comm=args.comm,
                     activation_bytes=args.activation_bytes,
                     overlap=getattr(args, "overlap", 1.0))
