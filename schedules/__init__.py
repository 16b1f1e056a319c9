"""Pipeline schedules as data: generators, lowering passes, a validator and a simulator.

Pure Python and numpy: integers and costs in, instruction streams and timelines out.
"""

from schedules.dualpipe import dualpipev
from schedules.errors import (
    ScheduleConfigError,
    ScheduleError,
    ScheduleParseError,
    ScheduleValidationError,
)
from schedules.fuse import fuse_backward
from schedules.generators import forward_only, gpipe, interleaved_1f1b, one_f_one_b
from schedules.instructions import (
    NONE,
    Instruction,
    Kind,
    format_stream,
    parse_instruction,
    parse_stream,
)
from schedules.looped_bfs import looped_bfs
from schedules.lowering import add_optimizer_step, lower
from schedules.registry import SCHEDULES, ScheduleSpec, build_schedule, generate_schedule
from schedules.schedule import Schedule, loop_placement, v_placement
from schedules.simulate import CostModel, simulate
from schedules.timeline import KINDS, Figures, Span, Timeline, figures
from schedules.torch_format import (
    format_torch_csv,
    from_torch_rows,
    parse_torch_csv,
    to_torch_rows,
)
from schedules.validate import validate
from schedules.zb_auto import AutoPlan, Candidate, plan_zb_auto, zb_auto
from schedules.zb_greedy import GreedyKnobs
from schedules.zbv import zb_v
from schedules.zero_bubble import zb_h1, zb_h2

__all__ = [
    "KINDS",
    "NONE",
    "SCHEDULES",
    "AutoPlan",
    "Candidate",
    "CostModel",
    "Figures",
    "GreedyKnobs",
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
    "dualpipev",
    "figures",
    "format_stream",
    "format_torch_csv",
    "forward_only",
    "from_torch_rows",
    "fuse_backward",
    "generate_schedule",
    "gpipe",
    "interleaved_1f1b",
    "loop_placement",
    "looped_bfs",
    "lower",
    "one_f_one_b",
    "parse_instruction",
    "parse_stream",
    "parse_torch_csv",
    "plan_zb_auto",
    "simulate",
    "to_torch_rows",
    "v_placement",
    "validate",
    "zb_auto",
    "zb_h1",
    "zb_h2",
    "zb_v",
]
