"""`pipesched validate`: read a user's schedule (our text form or torch's CSV) and prove it
runs — every microbatch computed once, no deadlock — or say where it breaks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeline.cli.options import positive_int
from pipeline.files import InputFileType, UnreadableInputError, open_regular_file
from schedules import Schedule, add_optimizer_step, lower, parse_torch_csv, validate
from schedules.ir.errors import ScheduleParseError
from schedules.ir.limits import check_schedule_size

__all__ = ["MAX_VALIDATED_RANKS", "read_schedule_file", "register", "run"]

_MAX_BYTES = 16 << 20  # far above any real schedule; a bigger file is the wrong file
MAX_VALIDATED_RANKS = 16_384
"""Most ranks a schedule file may have for `validate` (the work limit of its checks)."""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "validate", help="check a schedule file (text or torch CSV) before running it",
        description="Parse a schedule written as `pipesched schedule` prints it (one rank a "
                    "line) or as torch.distributed.pipelining's CSV, lower it as the engine "
                    "would, and validate it: exit 0 if it runs, 2 with the first violation "
                    "(and the rank × step grid) if it would deadlock or skip a microbatch.")
    parser.add_argument("file", type=InputFileType(_MAX_BYTES), metavar="FILE",
                        help="schedule file (.csv: torch's format)")
    parser.add_argument("--format", choices=("auto", "text", "csv"), default="auto",
                        help="auto (default): .csv files are torch's CSV, others our text")
    parser.add_argument("--microbatches", type=positive_int, default=None, metavar="M",
                        help="microbatches m (default: one more than the largest seen)")
    parser.set_defaults(func=run)


def read_schedule_file(path: Path, form: str = "auto",
                       num_microbatches: int | None = None) -> Schedule:
    """The schedule in `path`, lowered and with its optimizer step, as the engine runs it."""
    raw = _read_regular_file(path, _MAX_BYTES + 1)
    if len(raw) > _MAX_BYTES:
        raise ScheduleParseError(f"{path} is over {_MAX_BYTES >> 20} MiB; not a schedule file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ScheduleParseError(f"{path} is not UTF-8 text (byte {error.start}); write the "
                                 "schedule as text, one rank a line") from None
    csv = form == "csv" or (form == "auto" and path.suffix.lower() == ".csv")
    schedule = (parse_torch_csv(text, name=path.name, num_microbatches=num_microbatches) if csv
                else Schedule.from_text(text, name=path.name, num_microbatches=num_microbatches))
    if schedule.num_ranks > MAX_VALIDATED_RANKS:  # the checks' work grows faster than p
        raise ScheduleParseError(
            f"{path} has {schedule.num_ranks:,} ranks, over the {MAX_VALIDATED_RANKS:,} "
            "`validate` checks (its work grows faster than the rank count: 100,000 ranks "
            "took over two minutes); validate a smaller pipeline of the same shape")
    if not schedule.lowered:
        validate(schedule)  # a skipped microbatch named as such, before lowering trips on it
        check_schedule_size(schedule.num_ranks, schedule.num_microbatches, schedule.chunks,
                            names=("ranks", "microbatches", "stages per rank"))
        schedule = lower(schedule)
    if schedule.has_backward and not any(op.kind.value == "STEP" for op in schedule.streams[0]):
        schedule = add_optimizer_step(schedule)
    return schedule


def _read_regular_file(path: Path, limit: int) -> bytes:
    """Up to `limit` bytes of `path` through `pipeline.files` (a regular file only: reading
    a named pipe would wait for a writer forever, a device may never end)."""
    try:
        with open_regular_file(path) as handle:
            return handle.read(limit)
    except UnreadableInputError as error:
        raise ScheduleParseError(f"cannot read {_shown(path)}: {error}; save the schedule to "
                                 "a file first") from None
    except OSError as error:
        raise ScheduleParseError(f"cannot read {_shown(path)}: {error.strerror or error}; "
                                 "give the path of a schedule file") from None


def _shown(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 80 else f"{text[:40]}...{text[-20:]}"


def run(args: argparse.Namespace) -> int:
    schedule = read_schedule_file(Path(args.file), args.format, args.microbatches)
    validate(schedule)
    print(f"{args.file}: valid — {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
          f"{schedule.num_microbatches} microbatches, {schedule.num_instructions} instructions")
    return 0
