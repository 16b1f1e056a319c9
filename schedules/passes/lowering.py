"""The passes shared by every schedule: add send/recv and loads, then gradient reduction and step.

Why the placement below cannot deadlock, even with blocking (rendezvous) send and recv:
the compute streams are first executed with unit durations (`dataflow.execute`), which
gives each op a round t (its end time). A message from the op on rank a that ends at round
t gets the key t·p + a, shared by its SEND (placed right after the producing op) and its
RECV (placed on the consumer's rank before the first op of round > t, hence before the
consumer, which ends at round ≥ t + 1). Every rank's send/recv ops then appear in
increasing key order, so the unmatched pair with the smallest key always has both sides
at the head of their ranks (everything before them is compute or a smaller key): it can
complete, and by induction every pair does.
"""

from __future__ import annotations

from operator import itemgetter

from schedules.analysis.dataflow import execute
from schedules.ir.errors import ScheduleValidationError
from schedules.ir.grid import format_grid
from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from
from schedules.ir.schedule import Schedule, gc_paused

__all__ = ["add_optimizer_step", "lower"]

_FIRST = itemgetter(0)


@gc_paused
def lower(schedule: Schedule) -> Schedule:
    """Add SEND/RECV for every cross-rank dependency and LOAD before first/last-stage forwards.

    The first stage loads inputs; in a training schedule the last stage also loads targets.
    Raises `ScheduleValidationError` if the compute order itself can never run.
    """
    if schedule.lowered:
        raise ScheduleValidationError(f"schedule {schedule.name!r} is already lowered")
    compute = schedule.compute_streams()
    placement = schedule.placement
    p, num_stages, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    ones = [1.0] * num_stages
    run = execute(compute, placement, m, ones, ones, ones, [0.0] * num_stages)
    if run.stuck:
        rank, step = min(run.stuck.items())
        raise ScheduleValidationError(
            f"compute order of {schedule.name!r} cannot run: rank {rank} waits forever at step "
            f"{step} ({compute[rank][step]}) for an op that comes after a wait on its own rank",
            rank=rank, step=step, grid=format_grid(compute, rank, step))

    kind_f, kind_b, kind_i, kind_ob = Kind.F, Kind.B, Kind.I, Kind.OVERLAP_B
    recv_f, recv_b, send_f, send_b, load = (Kind.RECV_F, Kind.RECV_B, Kind.SEND_F, Kind.SEND_B,
                                            Kind.LOAD)
    new = instruction_from
    last_stage = num_stages - 1
    loads_targets = schedule.has_backward
    recvs: list[list[tuple[int, Instruction]]] = [[] for _ in range(p)]
    sends: list[list[Instruction | None]] = []
    for a in range(p):
        rank_sends: list[Instruction | None] = []
        for (kind, s, i, _), end in zip(compute[a], run.ends[a]):
            send = None
            if kind is kind_f:
                if s < last_stage and placement[s + 1] != a:
                    b = placement[s + 1]
                    recvs[b].append((int(end) * p + a, new((recv_f, s + 1, i, a))))
                    send = new((send_f, s, i, b))
            elif (kind is kind_b or kind is kind_i or kind is kind_ob) and s > 0 and \
                    placement[s - 1] != a:
                b = placement[s - 1]
                recvs[b].append((int(end) * p + a, new((recv_b, s - 1, i, a))))
                send = new((send_b, s, i, b))
            rank_sends.append(send)
        sends.append(rank_sends)

    streams = []
    for a in range(p):
        pending = sorted(recvs[a], key=_FIRST)
        pending.append((1 << 62, pending[0][1] if pending else compute[a][0]))  # sentinel
        j = 0
        next_key = pending[0][0]
        out: list[Instruction] = []
        append = out.append
        for op, end, send in zip(compute[a], run.ends[a], sends[a]):
            round_key = int(end) * p
            while next_key < round_key:
                append(pending[j][1])
                j += 1
                next_key = pending[j][0]
            kind, s, i, _ = op
            if kind is kind_f and (s == 0 or (loads_targets and s == last_stage)):
                append(new((load, s, i, NONE)))
            append(op)
            if send is not None:
                own_key = round_key + a
                while next_key < own_key:
                    append(pending[j][1])
                    j += 1
                    next_key = pending[j][0]
                append(send)
        out.extend(instruction for _, instruction in pending[j:-1])
        streams.append(tuple(out))
    return schedule.replace_streams(tuple(streams), lowered=True)


@gc_paused
def add_optimizer_step(schedule: Schedule) -> Schedule:
    """After each stage's last backward op (and the sends that follow it) add REDUCE_GRAD for
    that stage, so its data-parallel reduction can overlap later work; end with STEP.

    A forward-only schedule is returned unchanged.
    """
    if not schedule.has_backward:
        return schedule
    backward_kinds = (Kind.B, Kind.I, Kind.W, Kind.OVERLAP_B)
    comm_sends = (Kind.SEND_F, Kind.SEND_B)
    streams = []
    for rank, stream in enumerate(schedule.streams):
        # Scan from the end: each stage's last backward is near the end of the stream.
        insert_after: dict[int, list[int]] = {}
        remaining = set(schedule.stages_of(rank))
        k = len(stream) - 1
        while remaining and k >= 0:
            kind, stage, _, _ = stream[k]
            if kind in backward_kinds and stage in remaining:
                remaining.discard(stage)
                after = k
                while after + 1 < len(stream) and stream[after + 1][0] in comm_sends:
                    after += 1
                insert_after.setdefault(after, []).append(stage)
            k -= 1
        out = list(stream)
        for after in sorted(insert_after, reverse=True):
            out[after + 1:after + 1] = [Instruction(Kind.REDUCE_GRAD, stage, NONE)
                                        for stage in sorted(insert_after[after])]
        out.append(Instruction(Kind.STEP))
        streams.append(tuple(out))
    return schedule.replace_streams(tuple(streams))
