"""Prove a schedule complete, correctly ordered and deadlock-free, or name its first violation.

The promise, exactly. A schedule is accepted if and only if:
- every op names a stage, microbatch and peer in range, on the rank that owns the stage;
- every (stage, microbatch) has exactly one F and, in a training schedule, either exactly one
  B (or OVERLAP_B, right after an F of another microbatch) or exactly one I and one W;
- compute-only (lowered=False): every op is F, B, I, W or OVERLAP_B (any other kind is
  refused by name), and the streams run to the end under their data dependencies;
- lowered: run with blocking (rendezvous) send/recv, every rank's compute ops come in a
  dependency-respecting order (F(s,i) after F(s-1,i) has run and arrived, I/B(s,i) after
  F(s,i) and after the gradient from s+1 has run and arrived, W(s,i) after I(s,i); the
  first stage's forwards, and the last's in training, after LOAD; an overlapped pair
  F + OVERLAP_B is one op, as the simulator runs it: the B's inputs are there when its F
  starts), every send pairs with
  one matching recv in the same order on its peer, no rank is left blocked; and the
  optimizer part is either absent on every rank (`lower` without `add_optimizer_step`) or
  complete on every rank: exactly one REDUCE_GRAD per (rank, stage), after that stage's
  last gradient op, and exactly one STEP per rank, its last instruction, after them.
  A forward-only schedule has neither.
"""

from __future__ import annotations

from typing import NoReturn

from schedules.analysis.dataflow import execute
from schedules.analysis.rendezvous import Rendezvous, _fail, _message
from schedules.ir.errors import ScheduleValidationError
from schedules.ir.instructions import COMPUTE_KINDS, Kind
from schedules.ir.schedule import Schedule

__all__ = ["validate"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_OB = Kind.OVERLAP_B


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleValidationError` at the first broken invariant; return None if sound.

    Checked: every op names a stage, microbatch and peer in range, on the rank that owns the
    stage; each (stage, microbatch) has exactly one F and either one B (or OVERLAP_B, which
    must come right after an F of another microbatch) or one I and one W (none in a
    forward-only schedule); and then, executing the streams:
    - compute-only: the order can run (no rank waits forever on its dependencies);
    - lowered: with blocking (rendezvous) send/recv, F(s,i) runs after F(s-1,i) arrived,
      B(s,i) after F(s,i) and after the gradient from s+1 arrived, W after I, every send
      meets exactly one matching recv in the same order on its peer, REDUCE_GRAD follows
      the stage's last backward, STEP ends the stream, and no rank is left blocked.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate needs a schedules.Schedule (e.g. Schedule.from_text(...)), "
                        f"got {schedule!r}")
    if not schedule.lowered:
        _check_compute_only(schedule)
    _check_structure(schedule)
    if schedule.lowered:
        _check_pairing(schedule)
        Rendezvous(schedule).run()
    else:
        _check_compute_runs(schedule)


def _check_compute_only(schedule: Schedule) -> None:
    """A compute-only schedule (lowered=False) holds F, B, I, W and OVERLAP_B only."""
    for rank, stream in enumerate(schedule.streams):
        for step, op in enumerate(stream):
            if op.kind not in COMPUTE_KINDS:
                raise _fail(schedule, rank, step, f"{op.kind.value} in a compute-only schedule "
                            "(lowered=False), which holds only F, B, I, W and OVERLAP_B; drop "
                            "it (`lower` and `add_optimizer_step` add communication, loads, "
                            "REDUCE_GRAD and STEP), or build the Schedule with lowered=True")


def _check_structure(schedule: Schedule) -> None:
    placement, m = schedule.placement, schedule.num_microbatches
    num_stages = schedule.num_stages
    counts: dict[tuple[Kind, int, int], tuple[int, int]] = {}  # -> first (rank, step)
    for rank, stream in enumerate(schedule.streams):
        previous: tuple[Kind, int, int] | None = None  # the last compute op on the rank
        for step, (kind, s, i, peer) in enumerate(stream):
            if kind is _OB and (previous is None or previous[0] is not _F or previous[2] == i):
                raise _fail(schedule, rank, step, "an overlapped backward runs with the F just "
                            "before it on the rank, of another microbatch (their own F and B "
                            "depend on each other); put it right after such an F, or use B")
            if kind in (_F, _B, _I, _W, _OB):
                previous = (kind, s, i)
            if kind is Kind.STEP:
                continue
            if not 0 <= s < num_stages:
                raise _fail(schedule, rank, step, f"stage {s} is outside 0..{num_stages - 1}")
            if placement[s] != rank:
                raise _fail(schedule, rank, step,
                            f"stage {s} belongs to rank {placement[s]}, not rank {rank}")
            if kind is Kind.REDUCE_GRAD:
                continue
            if not 0 <= i < m:
                raise _fail(schedule, rank, step, f"microbatch {i} is outside 0..{m - 1}")
            if kind in (_SEND_F, _RECV_B) or kind in (_RECV_F, _SEND_B):
                neighbour = s + 1 if kind in (_SEND_F, _RECV_B) else s - 1
                if not 0 <= neighbour < num_stages or placement[neighbour] != peer:
                    expected = (f"rank {placement[neighbour]}" if 0 <= neighbour < num_stages
                                else "no rank (there is no such neighbour stage)")
                    raise _fail(schedule, rank, step,
                                f"peer {peer} is wrong: stage {neighbour} is on {expected}")
            if kind in (_F, _B, _I, _W, _OB):
                key = (_B if kind is _OB else kind, s, i)  # an overlapped B is still a B
                if key in counts:
                    first_rank, first_step = counts[key]
                    raise _fail(schedule, rank, step, f"{kind.value}({s},{i}) appears twice "
                                f"(first at rank {first_rank}, step {first_step})")
                counts[key] = (rank, step)
    has_backward = any(kind is not _F for kind, _, _ in counts)
    allowed = ({_F, _B}, {_F, _I, _W}) if has_backward else ({_F},)
    # Every (stage, microbatch) needs an F. Checked on the sorted F keys first, so a text
    # that names stage 10**9 is refused in time proportional to its length, not to S·m.
    forward_keys = sorted((s, i) for kind, s, i in counts if kind is _F)
    if len(forward_keys) != num_stages * m:
        k = next((k for k, key in enumerate(forward_keys) if key != divmod(k, m)),
                 len(forward_keys))
        _coverage_error(schedule, counts, *divmod(k, m), allowed)
    for s in range(num_stages):
        for i in range(m):
            present = {kind for kind in (_F, _B, _I, _W) if (kind, s, i) in counts}
            if present not in allowed:
                _coverage_error(schedule, counts, s, i, allowed)


def _coverage_error(schedule: Schedule, counts: dict[tuple[Kind, int, int], tuple[int, int]],
                    s: int, i: int, allowed: tuple[set[Kind], ...]) -> NoReturn:
    """Raise for a (stage, microbatch) whose compute ops are not one of `allowed`."""
    present = {kind for kind in (_F, _B, _I, _W) if (kind, s, i) in counts}
    wanted = " or ".join("+".join(k.value for k in (_F, _B, _I, _W) if k in option)
                         for option in allowed)
    found = "+".join(k.value for k in (_F, _B, _I, _W) if k in present) or "no ops"
    message = (f"stage {s}, microbatch {i} has {found}; every (stage, microbatch) "
               f"needs exactly {wanted} on rank {schedule.placement[s]}")
    if not present:
        raise ScheduleValidationError(f"{schedule.name}: {message}")
    # Point at the last present op in F, B, I, W order: the I whose W is missing, the W
    # without an I. (Kinds have no order of their own: compare positions, not Kind values.)
    last = [kind for kind in (_F, _B, _I, _W) if kind in present][-1]
    rank, step = counts[(last, s, i)]
    raise _fail(schedule, rank, step, message)


def _check_pairing(schedule: Schedule) -> None:
    sent: dict[tuple[int, int], list[tuple[tuple[Kind, int, int, int], int]]] = {}
    received: dict[tuple[int, int], list[tuple[tuple[Kind, int, int, int], int]]] = {}
    for rank, stream in enumerate(schedule.streams):
        for step, op in enumerate(stream):
            if op.kind is _SEND_F or op.kind is _SEND_B:
                sent.setdefault((rank, op.peer), []).append((_message(op, rank), step))
            elif op.kind is _RECV_F or op.kind is _RECV_B:
                received.setdefault((op.peer, rank), []).append(((op.kind, op.stage, op.microbatch,
                                                                  op.peer), step))
    for pair in sorted(set(sent) | set(received)):
        sender, receiver = pair
        sends, recvs = sent.get(pair, []), received.get(pair, [])
        for (message, send_step), (expected, recv_step) in zip(sends, recvs):
            if message != expected:
                raise _fail(schedule, receiver, recv_step,
                            f"receives out of order from rank {sender}: rank {sender} sends "
                            f"{schedule.streams[sender][send_step]} (step {send_step}) here")
        if len(sends) > len(recvs):
            step = sends[len(recvs)][1]
            raise _fail(schedule, sender, step, f"no matching recv on rank {receiver}")
        if len(recvs) > len(sends):
            step = recvs[len(sends)][1]
            raise _fail(schedule, receiver, step, f"no matching send on rank {sender}")


def _check_compute_runs(schedule: Schedule) -> None:
    zeros = [0.0] * schedule.num_stages
    ones = [1.0] * schedule.num_stages
    run = execute(schedule.streams, schedule.placement, schedule.num_microbatches,
                  ones, ones, ones, zeros)
    if run.stuck:
        rank, step = _culprit(schedule, run.stuck)
        blocked = ", ".join(f"rank {r} at {schedule.streams[r][k]}" for r, k in
                            sorted(run.stuck.items())[:8])
        raise _fail(schedule, rank, step, f"deadlock: the compute order cannot run "
                    f"(blocked: {blocked}); an op waits on one ordered after it")


def _culprit(schedule: Schedule, stuck: dict[int, int]) -> tuple[int, int]:
    """The blocked op that waits on an op later in its own rank's stream, else the first."""
    for rank, step in sorted(stuck.items()):
        kind, s, i, _ = schedule.streams[rank][step]
        needs = {(_F, s - 1, i)} if kind is _F else {(_I, s, i)} if kind is _W else {
            (_F, s, i), (_B, s + 1, i), (_I, s + 1, i), (_OB, s + 1, i)}
        later = {(op.kind, op.stage, op.microbatch) for op in schedule.streams[rank][step:]}
        if needs & later:
            return rank, step
    return min(stuck.items())
