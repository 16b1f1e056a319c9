"""Pipeline schedules as data: generators, lowering passes, a validator and a simulator.

Pure Python and numpy: integers and costs in, instruction streams and timelines out.
"""

from schedules.analysis.runs import ComputeRuns
from schedules.analysis.simulate import CostModel, GradReduction, ParamGather, simulate
from schedules.analysis.timeline import KINDS, Figures, Span, Timeline, figures
from schedules.analysis.validate import validate
from schedules.formats.torch_csv import (
    format_torch_csv,
    from_torch_rows,
    parse_torch_csv,
    to_torch_rows,
)
from schedules.generators.classic import forward_only, gpipe, interleaved_1f1b, one_f_one_b
from schedules.generators.controllable_memory import v_half, v_min
from schedules.generators.dualpipe import dualpipev
from schedules.generators.looped_bfs import looped_bfs
from schedules.generators.zb_h1_h2 import zb_h1, zb_h2
from schedules.generators.zb_v import zb_v
from schedules.ir.errors import (
    ScheduleConfigError,
    ScheduleError,
    ScheduleParseError,
    ScheduleValidationError,
)
from schedules.ir.instructions import (
    NONE,
    Instruction,
    Kind,
    format_stream,
    parse_instruction,
    parse_stream,
)
from schedules.ir.schedule import Schedule, check_count, loop_placement, v_placement
from schedules.passes.fuse import fuse_backward
from schedules.passes.lowering import add_optimizer_step, lower
from schedules.registry import SCHEDULES, ScheduleSpec, build_schedule, generate_schedule
from schedules.search.authors_greedy import PaperGreedyKnobs
from schedules.search.authors_v_greedy import VGreedyKnobs
from schedules.search.candidates import Candidate, ScheduleSearch
from schedules.search.interleaved_zb import interleaved_zb, search_interleaved_zb
from schedules.search.list_scheduler import ListKnobs
from schedules.search.paper_greedy import GreedyKnobs
from schedules.search.zb_auto import search_zb_auto, zb_auto
from schedules.search.zb_optimal import SolvedSchedule, solve_zb_optimal, zb_optimal
from schedules.search.zb_v_auto import search_zb_v_auto, zb_v_auto

__all__ = [
    "KINDS",
    "NONE",
    "SCHEDULES",
    "Candidate",
    "ComputeRuns",
    "CostModel",
    "Figures",
    "GradReduction",
    "GreedyKnobs",
    "Instruction",
    "Kind",
    "ListKnobs",
    "PaperGreedyKnobs",
    "ParamGather",
    "Schedule",
    "ScheduleConfigError",
    "ScheduleError",
    "ScheduleParseError",
    "ScheduleSearch",
    "ScheduleSpec",
    "ScheduleValidationError",
    "SolvedSchedule",
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
    "search_interleaved_zb",
    "search_zb_auto",
    "search_zb_v_auto",
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
