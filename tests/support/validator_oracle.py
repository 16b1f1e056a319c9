"""An independent checker of schedules, written from the validator's promise, and both verdicts.

The checker is written from the validator's promise (the top of
`schedules/analysis/validate.py`), not from its code, and imports nothing of it: it runs the
ranks one head op at a time with rendezvous send/recv and checks each definition as the op
runs. `validator_verdict` is the validator's own answer on the same streams; the
`tests/schedules/test_validator_mutations*.py` tests compare the two on mutants.
"""

from __future__ import annotations

from collections.abc import Sequence

from schedules import Instruction, Kind, Schedule, ScheduleError, validate

__all__ = ["COMPUTE", "RECVS", "SENDS", "Refused", "Streams", "independent_verdict",
           "validator_verdict"]

Streams = list[list[Instruction]]
COMPUTE = {Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_B}
SENDS = {Kind.SEND_F, Kind.SEND_B}
RECVS = {Kind.RECV_F, Kind.RECV_B}


class Refused(Exception):
    """The independent checker's rejection."""


def _structure(streams: Sequence[Sequence[Instruction]], placement: Sequence[int], m: int,
               trains: bool) -> None:
    stages = len(placement)
    seen: dict[tuple[Kind, int, int], int] = {}
    for rank, stream in enumerate(streams):
        for k, op in enumerate(stream):
            if op.kind is Kind.STEP:
                continue
            if not 0 <= op.stage < stages or placement[op.stage] != rank:
                raise Refused(f"{op} not on its stage's rank")
            if op.kind is Kind.REDUCE_GRAD:
                continue
            if not 0 <= op.microbatch < m:
                raise Refused(f"{op} microbatch out of range")
            if op.kind in (Kind.SEND_F, Kind.RECV_B, Kind.RECV_F, Kind.SEND_B):
                other = op.stage + (1 if op.kind in (Kind.SEND_F, Kind.RECV_B) else -1)
                if not 0 <= other < stages or placement[other] != op.peer:
                    raise Refused(f"{op} wrong peer")
            if op.kind is Kind.OVERLAP_B:
                before = [x for x in stream[:k] if x.kind in COMPUTE]
                if not before or before[-1].kind is not Kind.F or \
                        before[-1].microbatch == op.microbatch:
                    raise Refused(f"{op} not right after an F of another microbatch")
            if op.kind in COMPUTE:
                key = (Kind.B if op.kind is Kind.OVERLAP_B else op.kind, op.stage, op.microbatch)
                seen[key] = seen.get(key, 0) + 1
    for s in range(stages):
        for i in range(m):
            have = {kind: seen.get((kind, s, i), 0) for kind in (Kind.F, Kind.B, Kind.I, Kind.W)}
            if any(count > 1 for count in have.values()) or have[Kind.F] != 1:
                raise Refused(f"({s},{i}) ops {have}")
            fused, split = have[Kind.B] == 1, have[Kind.I] == 1 and have[Kind.W] == 1
            if trains and not (fused and not have[Kind.I] and not have[Kind.W]) and \
                    not (split and not have[Kind.B]):
                raise Refused(f"({s},{i}) backward ops {have}")
            if not trains and (have[Kind.B] or have[Kind.I] or have[Kind.W]):
                raise Refused("backward op in a forward-only schedule")


class _Run:
    """Execute streams head by head: compute when its inputs are there, else refuse."""

    def __init__(self, streams: Sequence[Sequence[Instruction]], placement: Sequence[int],
                 m: int, trains: bool) -> None:
        self.streams, self.placement, self.m, self.trains = streams, placement, m, trains
        self.done: set[tuple[str, int, int]] = set()  # ("F"|"G"|"W"|"LOAD"|"GOT_F"|"GOT_B")
        self.reduced: list[set[int]] = [set() for _ in streams]
        self.heads = [0] * len(streams)

    def needs(self, rank: int, op: Instruction) -> list[tuple[str, int, int]]:
        kind, s, i = op.kind, op.stage, op.microbatch
        last = len(self.placement) - 1
        if kind is Kind.F:
            wanted = []
            if s > 0:
                wanted.append(("F", s - 1, i) if self.placement[s - 1] == rank
                              else ("GOT_F", s, i))
            if s == 0 or (s == last and self.trains):
                wanted.append(("LOAD", s, i))
            return wanted
        if kind in (Kind.B, Kind.I, Kind.OVERLAP_B):
            wanted = [("F", s, i)]
            if s < last:
                wanted.append(("G", s + 1, i) if self.placement[s + 1] == rank
                              else ("GOT_B", s, i))
            return wanted
        if kind is Kind.W:
            return [("G", s, i)]
        if kind is Kind.SEND_F:
            return [("F", s, i)]
        if kind is Kind.SEND_B:
            return [("G", s, i)]
        return []

    def pair_of(self, rank: int, op: Instruction) -> Instruction | None:
        """The OVERLAP_B that an F opens a pair with: the rank's next compute op."""
        if op.kind is not Kind.F:
            return None
        later = [x for x in self.streams[rank][self.heads[rank] + 1:] if x.kind in COMPUTE]
        return later[0] if later and later[0].kind is Kind.OVERLAP_B else None

    def run_local(self, rank: int, op: Instruction) -> None:
        # a pair is one op: its F starts only once the inputs of both are there
        paired = self.pair_of(rank, op)
        wanted = self.needs(rank, op) + (self.needs(rank, paired) if paired else [])
        missing = [need for need in wanted if need not in self.done]
        if missing:
            raise Refused(f"{op} on rank {rank} before {missing}")
        kind, s, i = op.kind, op.stage, op.microbatch
        if kind is Kind.F:
            self.done.add(("F", s, i))
        elif kind in (Kind.B, Kind.OVERLAP_B):
            self.done |= {("G", s, i), ("W", s, i)}
        elif kind is Kind.I:
            self.done.add(("G", s, i))
        elif kind is Kind.W:
            self.done.add(("W", s, i))
        elif kind is Kind.LOAD:
            self.done.add(("LOAD", s, i))
        elif kind is Kind.REDUCE_GRAD:
            if s in self.reduced[rank] or any(("W", s, j) not in self.done for j in range(self.m)):
                raise Refused(f"REDUCE_GRAD {s} twice or early")
            self.reduced[rank].add(s)
        elif kind is Kind.STEP:
            own = {t for t, r in enumerate(self.placement) if r == rank}
            if self.heads[rank] != len(self.streams[rank]) - 1 or self.reduced[rank] != own:
                raise Refused("STEP not last or before every REDUCE_GRAD")

    def rendezvous(self, rank: int, op: Instruction) -> bool:
        peer = op.peer
        if self.heads[peer] >= len(self.streams[peer]):
            return False
        other = self.streams[peer][self.heads[peer]]
        if op.kind in SENDS:
            send, recv, sender = op, other, rank
        else:
            send, recv, sender = other, op, peer
        if send.kind not in SENDS or recv.kind not in RECVS or other.peer != rank:
            return False
        expected = (Kind.RECV_F, send.stage + 1) if send.kind is Kind.SEND_F else \
            (Kind.RECV_B, send.stage - 1)
        if (recv.kind, recv.stage, recv.microbatch, recv.peer) != (*expected, send.microbatch,
                                                                  sender):
            return False
        self.run_local(sender, send)
        self.done.add(("GOT_F" if recv.kind is Kind.RECV_F else "GOT_B", recv.stage,
                       recv.microbatch))
        self.heads[rank] += 1
        self.heads[peer] += 1
        return True

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for rank, stream in enumerate(self.streams):
                while self.heads[rank] < len(stream):
                    op = stream[self.heads[rank]]
                    if op.kind in SENDS or op.kind in RECVS:
                        if not self.rendezvous(rank, op):
                            break
                    else:
                        self.run_local(rank, op)
                        self.heads[rank] += 1
                    moved = True
        if any(head < len(stream) for head, stream in zip(self.heads, self.streams)):
            raise Refused("deadlock")
        stepped = [any(op.kind is Kind.STEP for op in stream) for stream in self.streams]
        if (any(stepped) or any(self.reduced)) and not all(stepped):
            raise Refused("a rank without STEP")


def _compute_runs(streams: Sequence[Sequence[Instruction]], placement: Sequence[int]) -> None:
    """Compute-only: some rank can always run its head op once its inputs ran anywhere."""
    done: set[tuple[str, int, int]] = set()
    heads = [0] * len(streams)
    last = len(placement) - 1
    moved = True
    while moved:
        moved = False
        for rank, stream in enumerate(streams):
            while heads[rank] < len(stream):
                op = stream[heads[rank]]
                s, i = op.stage, op.microbatch
                later = [x for x in stream[heads[rank] + 1:] if x.kind in COMPUTE]
                if op.kind is Kind.F and later and later[0].kind is Kind.OVERLAP_B:
                    # a pair is one op: it waits for the inputs of both, then makes both
                    pair = later[0]
                    ready = (s == 0 or ("F", s - 1, i) in done) and ("F", pair.stage,
                                                                      pair.microbatch) in done
                    ready = ready and (pair.stage == last or ("G", pair.stage + 1,
                                                              pair.microbatch) in done)
                    if not ready:
                        break
                    done.update([("F", s, i), ("G", pair.stage, pair.microbatch)])
                    heads[rank] += 1 + stream[heads[rank] + 1:].index(pair) + 1
                    moved = True
                    continue
                if op.kind is Kind.F:
                    ready, made = s == 0 or ("F", s - 1, i) in done, [("F", s, i)]
                elif op.kind is Kind.W:
                    ready, made = ("G", s, i) in done, []
                else:
                    ready = ("F", s, i) in done and (s == last or ("G", s + 1, i) in done)
                    made = [("G", s, i)]
                if not ready:
                    break
                done.update(made)
                heads[rank] += 1
                moved = True
    if any(head < len(stream) for head, stream in zip(heads, streams)):
        raise Refused("compute order deadlocks")


def independent_verdict(streams: Sequence[Sequence[Instruction]], placement: Sequence[int],
                        m: int) -> bool:
    """True if the streams satisfy the validator's promise, checked from its definitions."""
    trains = any(op.kind in COMPUTE and op.kind is not Kind.F for s in streams for op in s)
    lowered = any(op.kind not in COMPUTE for s in streams for op in s)
    try:
        _structure(streams, placement, m, trains)
        if lowered:
            _Run(streams, placement, m, trains).run()
        else:
            _compute_runs(streams, placement)
    except Refused:
        return False
    return True


def validator_verdict(streams: Sequence[Sequence[Instruction]], placement: tuple[int, ...],
                      m: int) -> bool:
    """True if `validate` accepts the streams (as lowered when any op is not compute)."""
    lowered = any(op.kind not in COMPUTE for s in streams for op in s)
    try:
        validate(Schedule("mutant", m, placement, tuple(map(tuple, streams)), lowered))
    except ScheduleError:
        return False
    return True
