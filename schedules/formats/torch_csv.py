"""Read and write torch.distributed.pipelining's schedule text: one CSV row of actions per rank.

torch's actions are ``{stage}{kind}{microbatch}`` (`_Action.__repr__`): compute F, I, W and
B (full backward), communication SEND_F, RECV_F, SEND_B, RECV_B, and UNSHARD, RESHARD,
REDUCE_GRAD (stage only). An empty cell is an idle slot; ``(0F3;3B1)OVERLAP_F_B`` runs two
actions together (DualPipeV). torch writes no peer: it follows from the placement. Its
"compute_only" rows are lowered by torch itself; "compute_comms" rows are run as written.

Mapping (ours ↔ torch):
- F, B, I, W ↔ F, B, I, W; SEND_F/RECV_F/SEND_B/RECV_B ↔ the same, peer ↔ placement.
- OVERLAP_F_B ↔ an F followed by an OVERLAP_B (our overlapped pair) when read with
  overlap=True; by default it is read as its two actions in order (F, then a plain B).
  An OVERLAP_B that does not directly follow its F in a row is written as a plain B.
- UNSHARD / RESHARD → dropped: FSDP sharding is not part of our schedules.
- REDUCE_GRAD: in compute-only rows dropped (torch's single-stage tables append it; our
  `add_optimizer_step` places it); in rows with communication kept where torch put it.
- LOAD and STEP exist only here: written as nothing, and re-added on reading rows with
  communication (LOAD before each first/last-stage F, STEP at the end of every rank).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from schedules.ir.errors import ScheduleParseError
from schedules.ir.instructions import COMM_KINDS, COMPUTE_KINDS, NONE, Instruction, Kind
from schedules.ir.schedule import Schedule
from schedules.passes.lowering import add_optimizer_step

__all__ = ["format_torch_csv", "from_torch_rows", "parse_torch_csv", "to_torch_rows"]

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                     r"(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_DROPPED = frozenset({"UNSHARD", "RESHARD"})
_WRITTEN = COMPUTE_KINDS | COMM_KINDS | {Kind.REDUCE_GRAD}


def to_torch_rows(schedule: Schedule, *, reduce_grad: bool = True) -> list[list[str]]:
    """torch's action strings, one list per rank; LOAD and STEP are left out, and
    REDUCE_GRAD too when `reduce_grad` is False (torch's `_simulate_comms_compute` and
    its compute-only loader do not take it)."""
    kinds = _WRITTEN if reduce_grad else _WRITTEN - {Kind.REDUCE_GRAD}
    rows = []
    for stream in schedule.streams:
        row: list[str] = []
        kept = [op for op in stream if op.kind in kinds]
        for k, op in enumerate(kept):
            if op.kind is Kind.OVERLAP_B and k and kept[k - 1].kind is Kind.F:
                row[-1] = f"({row[-1]};{op.stage}B{op.microbatch})OVERLAP_F_B"
            else:
                row.append(_torch_text(op))
        rows.append(row)
    return rows


def format_torch_csv(schedule: Schedule, *, reduce_grad: bool = True) -> str:
    """The CSV torch's `_dump_csv` writes: a compute-only schedule gives torch's
    "compute_only" format, a lowered one its "compute_comms" format."""
    return "".join(",".join(row) + "\n" for row in to_torch_rows(schedule,
                                                                 reduce_grad=reduce_grad))


def parse_torch_csv(text: str, *, name: str = "torch", num_microbatches: int | None = None,
                    placement: tuple[int, ...] | None = None,
                    lowered: bool | None = None, overlap: bool = False) -> Schedule:
    """A `Schedule` from torch's CSV (either format), one row per rank; see `from_torch_rows`."""
    rows = [line.split(",") for line in text.splitlines()]
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # trailing blank lines; a blank line inside is an idle rank
    return from_torch_rows(rows, name=name, num_microbatches=num_microbatches,
                           placement=placement, lowered=lowered, overlap=overlap)


def from_torch_rows(rows: Sequence[Sequence[str | None]], *, name: str = "torch",
                    num_microbatches: int | None = None,
                    placement: tuple[int, ...] | None = None,
                    lowered: bool | None = None, overlap: bool = False) -> Schedule:
    """A `Schedule` from torch's actions (strings, or None for an idle slot), rank by rank.

    Without `placement`, each stage goes to the rank whose row computes it; without
    `num_microbatches`, it is one more than the largest microbatch. `lowered` says which
    of torch's formats the rows are in; by default rows with a SEND/RECV are
    "compute_comms" (LOAD and STEP are added as described in the module docstring) and the
    rest "compute_only". Pass lowered=True for a communication-free lowered schedule
    (one rank, or all stages on one rank). With `overlap`, an OVERLAP_F_B cell of an F and
    a B becomes our overlapped pair (F, OVERLAP_B). Run `validate` on the result before
    trusting it.
    """
    parsed = [[op for row_index, cell in enumerate(row)
               for op in _parse_cell(cell, rank, row_index, overlap)]
              for rank, row in enumerate(rows)]
    if lowered is None:
        lowered = any(op[0] in COMM_KINDS for row in parsed for op in row)
    compute = [op for row in parsed for op in row if op[0] in COMPUTE_KINDS]
    if not compute:
        raise ScheduleParseError("torch schedule has no F, B, I or W action on any rank")
    if num_microbatches is None:
        num_microbatches = 1 + max(i for _, _, i in compute)
    if placement is None:
        placement = _infer_placement(parsed)
    last_stage = len(placement) - 1
    trains = any(kind is not Kind.F for kind, _, _ in compute)
    streams = []
    for row in parsed:
        stream: list[Instruction] = []
        for kind, s, i in row:
            if kind is Kind.REDUCE_GRAD and not lowered:
                continue
            if lowered and kind is Kind.F and (s == 0 or (trains and s == last_stage)):
                stream.append(Instruction(Kind.LOAD, s, i))
            stream.append(Instruction(kind, s, i, _peer(kind, s, placement)))
        streams.append(tuple(stream))
    schedule = Schedule(name, num_microbatches, placement, tuple(streams), lowered)
    if not lowered or not trains:
        return schedule
    if not any(op.kind is Kind.REDUCE_GRAD for stream in streams for op in stream):
        return add_optimizer_step(schedule)
    return schedule.replace_streams(tuple((*stream, Instruction(Kind.STEP))
                                          for stream in schedule.streams))


def _torch_text(op: Instruction) -> str:
    kind, stage, microbatch, _ = op
    text = "B" if kind is Kind.OVERLAP_B else kind.value  # torch has no lone overlapped B
    return f"{stage}{text}" + ("" if microbatch == NONE else str(microbatch))


def _parse_cell(cell: str | None, rank: int, column: int,
                pairs: bool = False) -> list[tuple[Kind, int, int]]:
    """(kind, stage, microbatch) of the actions in one cell; [] for idle or dropped ones."""
    text = (cell or "").strip()
    if not text:
        return []
    overlap = _OVERLAP.fullmatch(text)
    parts = overlap.group(1).split(";") if overlap else [text]
    out = []
    for part in parts:
        match = _ACTION.fullmatch(part.strip())
        if match is None:
            raise ScheduleParseError(
                f"rank {rank}, column {column}: cannot read torch action {part!r}; expected "
                "e.g. '0F0', '2I3', '1SEND_F0', '0REDUCE_GRAD' or '(0F3;3B1)OVERLAP_F_B'")
        stage_text, kind_text, microbatch_text = match.groups()
        if kind_text in _DROPPED:
            continue
        kind = Kind(kind_text)
        needs_microbatch = kind is not Kind.REDUCE_GRAD
        if needs_microbatch != bool(microbatch_text):
            raise ScheduleParseError(
                f"rank {rank}, column {column}: torch action {part!r} "
                + ("needs a microbatch" if needs_microbatch else "takes no microbatch"))
        out.append((kind, int(stage_text), int(microbatch_text) if microbatch_text else NONE))
    if pairs and overlap is not None and _is_pair(out):
        out[1] = (Kind.OVERLAP_B, out[1][1], out[1][2])
    return out


def _is_pair(actions: list[tuple[Kind, int, int]]) -> bool:
    """True for OVERLAP_F_B actions that are exactly an F, then a B of another microbatch."""
    return len(actions) == 2 and actions[0][0] is Kind.F and actions[1][0] is Kind.B \
        and actions[0][2] != actions[1][2]


def _infer_placement(parsed: Sequence[Sequence[tuple[Kind, int, int]]]) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, row in enumerate(parsed):
        for kind, s, _ in row:
            if kind in COMPUTE_KINDS:
                if owner.setdefault(s, rank) != rank:
                    raise ScheduleParseError(
                        f"stage {s} is computed on ranks {owner[s]} and {rank}; a stage must "
                        "live on one rank")
    if sorted(owner) != list(range(len(owner))):
        # the first few gaps only: a stage named 10**9 must not cost 10**9 steps
        last = max(owner)
        missing = [s for s in range(min(last, len(owner) + 8)) if s not in owner][:8]
        raise ScheduleParseError(f"no rank computes stages {missing} (the text names stages up "
                                 f"to {last}); pass placement= explicitly if they are meant to "
                                 "exist")
    return tuple(owner[s] for s in range(len(owner)))


def _peer(kind: Kind, stage: int, placement: tuple[int, ...]) -> int:
    """The rank on the other end of a communication op (NONE for other kinds)."""
    if kind not in COMM_KINDS:
        return NONE
    neighbour = stage + 1 if kind in (Kind.SEND_F, Kind.RECV_B) else stage - 1
    if not 0 <= neighbour < len(placement):
        raise ScheduleParseError(f"{stage}{kind.value}: stage {neighbour} does not exist")
    return placement[neighbour]
