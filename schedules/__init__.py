"""Pipeline schedules as data: generators, lowering passes, a validator and a simulator.

Pure Python and numpy: integers and costs in, instruction streams and timelines out.
"""

from schedules.errors import (
    ScheduleConfigError,
    ScheduleError,
    ScheduleParseError,
    ScheduleValidationError,
)
from schedules.generators import forward_only, gpipe, interleaved_1f1b, one_f_one_b
from schedules.instructions import (
    NONE,
    Instruction,
    Kind,
    format_stream,
    parse_instruction,
    parse_stream,
)
from schedules.lowering import add_optimizer_step, lower
from schedules.registry import SCHEDULES, ScheduleSpec, build_schedule, generate_schedule
from schedules.schedule import Schedule, loop_placement, v_placement
from schedules.simulate import CostModel, simulate
from schedules.timeline import KINDS, Figures, Span, Timeline, figures
from schedules.validate import validate

__all__ = [
    "KINDS",
    "NONE",
    "SCHEDULES",
    "CostModel",
    "Figures",
    "Instruction",
    "Kind",
    "Schedule",
    "ScheduleConfigError",
    "ScheduleError",
    "ScheduleParseError",
    "ScheduleSpec",
    "ScheduleValidationError",
    "Span",
    "Timeline",
    "add_optimizer_step",
    "build_schedule",
    "figures",
    "format_stream",
    "forward_only",
    "generate_schedule",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "lower",
    "one_f_one_b",
    "parse_instruction",
    "parse_stream",
    "simulate",
    "v_placement",
    "validate",
]
