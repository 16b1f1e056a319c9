"""Pipeline schedules as data: generators, lowering passes, a validator and a simulator.

Pure Python and numpy: integers and costs in, instruction streams and timelines out.
"""

from schedules.controllable_memory import v_half, v_min
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
from schedules.interleaved_zb import interleaved_zb, plan_interleaved_zb
from schedules.list_scheduler import ListKnobs
from schedules.looped_bfs import looped_bfs
from schedules.lowering import add_optimizer_step, lower
from schedules.registry import SCHEDULES, ScheduleSpec, build_schedule, generate_schedule
from schedules.schedule import Schedule, check_count, loop_placement, v_placement
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
from schedules.zb_optimal import OptimalPlan, solve_zb_optimal, zb_optimal
from schedules.zb_paper_greedy import PaperGreedyKnobs
from schedules.zbv import zb_v
from schedules.zbv_auto import plan_zb_v_auto, zb_v_auto
from schedules.zbv_greedy import VGreedyKnobs
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
    "ListKnobs",
    "OptimalPlan",
    "PaperGreedyKnobs",
    "Schedule",
    "ScheduleConfigError",
    "ScheduleError",
    "ScheduleParseError",
    "ScheduleSpec",
    "ScheduleValidationError",
    "Span",
    "Timeline",
    "VGreedyKnobs",
    "add_optimizer_step",
    "build_schedule",
    "check_count",
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
    "interleaved_zb",
    "loop_placement",
    "looped_bfs",
    "lower",
    "one_f_one_b",
    "parse_instruction",
    "parse_stream",
    "parse_torch_csv",
    "plan_interleaved_zb",
    "plan_zb_auto",
    "plan_zb_v_auto",
    "simulate",
    "solve_zb_optimal",
    "to_torch_rows",
    "v_half",
    "v_min",
    "v_placement",
    "validate",
    "zb_auto",
    "zb_h1",
    "zb_h2",
    "zb_optimal",
    "zb_v",
    "zb_v_auto",
]
