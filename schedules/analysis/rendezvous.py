"""Run lowered streams with blocking (rendezvous) send/recv, checking every data dependency."""

from __future__ import annotations

from schedules.ir.errors import ScheduleValidationError
from schedules.ir.grid import format_grid
from schedules.ir.instructions import COMPUTE_KINDS, Instruction, Kind
from schedules.ir.schedule import Schedule

__all__ = ["Rendezvous"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_OB = Kind.OVERLAP_B


def _fail(schedule: Schedule, rank: int, step: int, message: str) -> ScheduleValidationError:
    where = f"rank {rank}, step {step} ({schedule.streams[rank][step]})"
    return ScheduleValidationError(f"{schedule.name}: {where}: {message}", rank=rank, step=step,
                                   grid=format_grid(schedule.streams, rank, step))


def _message(op: Instruction, sender: int) -> tuple[Kind, int, int, int]:
    """What a send delivers, written as the receiving op: (recv kind, recv stage, mb, sender)."""
    kind, s, i, _ = op
    return (_RECV_F, s + 1, i, sender) if kind is _SEND_F else (_RECV_B, s - 1, i, sender)


class Rendezvous:
    """Execute lowered streams with blocking send/recv, checking every data dependency."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        size = schedule.num_stages * schedule.num_microbatches
        self.m = schedule.num_microbatches
        self.f_done = bytearray(size)
        self.g_done = bytearray(size)  # B or I done
        self.w_done = bytearray(size)  # B or W done: weight grads final
        self.got_f = bytearray(size)  # RECV_F of (s, i) done on the owner of s
        self.got_b = bytearray(size)
        self.loaded = bytearray(size)
        self.positions = [0] * schedule.num_ranks
        self.reduced: set[int] = set()
        # `has_backward` scans every instruction: once here, not once per loaded forward
        # (that made validating a lowered GPipe p=30, m=3000 take 11 s instead of 2 s).
        self.trains = schedule.has_backward

    def run(self) -> None:
        streams = self.schedule.streams
        runnable = list(range(len(streams) - 1, -1, -1))
        while runnable:
            rank = runnable.pop()
            partner = self._advance(rank)
            if partner is not None:
                runnable.append(partner)
                runnable.append(rank)
        blocked = [r for r, k in enumerate(self.positions) if k < len(streams[r])]
        if blocked:
            chain = "; ".join(f"rank {r} blocks at {streams[r][self.positions[r]]}"
                              for r in blocked[:8])
            raise _fail(self.schedule, blocked[0], self.positions[blocked[0]],
                        f"deadlock under blocking send/recv: {chain}")
        self._check_optimizer_on_every_rank()

    def _check_optimizer_on_every_rank(self) -> None:
        """REDUCE_GRAD and STEP on no rank (not added yet) or on every rank, every stage."""
        streams = self.schedule.streams
        stepped = [r for r, stream in enumerate(streams)
                   if any(op.kind is Kind.STEP for op in stream)]
        if not stepped and not self.reduced:
            return
        for rank, stream in enumerate(streams):
            if rank not in stepped:
                raise _fail(self.schedule, rank, len(stream) - 1,
                            f"rank {rank} has no STEP while rank {stepped[0] if stepped else 0} "
                            "reduces or steps: it would never update its weights; end every "
                            "rank with STEP (add_optimizer_step)")

    def _advance(self, rank: int) -> int | None:
        """Run `rank` until it blocks; return a partner rank released by a rendezvous."""
        stream = self.schedule.streams[rank]
        while self.positions[rank] < len(stream):
            step = self.positions[rank]
            op = stream[step]
            if op.kind in (_SEND_F, _SEND_B, _RECV_F, _RECV_B):
                return self._meet(rank, step, op)
            self._compute(rank, step, op)
            self.positions[rank] = step + 1
        return None

    def _meet(self, rank: int, step: int, op: Instruction) -> int | None:
        peer = op.peer
        peer_stream = self.schedule.streams[peer]
        peer_step = self.positions[peer]
        if peer_step >= len(peer_stream):
            return None
        other = peer_stream[peer_step]
        send, recv = (op, other) if op.kind in (_SEND_F, _SEND_B) else (other, op)
        sender = rank if send is op else peer
        if other.peer != rank or other.kind not in (_SEND_F, _SEND_B, _RECV_F, _RECV_B) \
                or send.kind not in (_SEND_F, _SEND_B) or _message(send, sender) != tuple(recv):
            return None  # the peer is busy elsewhere: wait for it to arrive here
        send_rank, send_step = (rank, step) if send is op else (peer, peer_step)
        s, i = send.stage, send.microbatch
        done = self.f_done if send.kind is _SEND_F else self.g_done
        if not done[s * self.m + i]:
            what = "F" if send.kind is _SEND_F else "its backward"
            raise _fail(self.schedule, send_rank, send_step, f"sends before {what} of stage {s}, "
                        f"microbatch {i} has run")
        arrived = self.got_f if recv.kind is _RECV_F else self.got_b
        arrived[recv.stage * self.m + recv.microbatch] = 1
        self.positions[rank] += 1
        self.positions[peer] += 1
        return peer

    def _check_pair_inputs(self, rank: int, step: int) -> None:
        """If the F at `step` opens an overlapped pair, the pair's backward must have its
        inputs too: the pair runs as one op, started when the inputs of both are there,
        and both outputs leave when it ends (the simulator's reading, `dataflow.execute`),
        so the B cannot wait on anything received after the F."""
        stream = self.schedule.streams[rank]
        after = step + 1
        while after < len(stream) and stream[after].kind not in COMPUTE_KINDS:
            after += 1
        if after == len(stream) or stream[after].kind is not _OB:
            return
        _, s, i, _ = stream[after]
        index, placement = s * self.m + i, self.schedule.placement
        ready = self.f_done[index] and (
            s == self.schedule.num_stages - 1 or (
                self.g_done[index + self.m] if placement[s + 1] == rank else self.got_b[index]))
        if not ready:
            forward = stream[step]
            raise _fail(self.schedule, rank, step,
                        f"the overlapped pair {forward} + {stream[after]} starts before "
                        f"OVERLAP_B({s},{i})'s inputs (F({s},{i}) and the gradient from stage "
                        f"{s + 1}) are there; a pair runs as one op that waits for the inputs "
                        f"of both and lets both outputs leave when it ends: receive the "
                        f"gradient before {forward}, or use B")

    def _compute(self, rank: int, step: int, op: Instruction) -> None:
        kind, s, i, _ = op
        m, placement, last = self.m, self.schedule.placement, self.schedule.num_stages - 1
        index = s * m + i
        if kind is _F:
            if s > 0 and not (self.f_done[index - m] if placement[s - 1] == rank
                              else self.got_f[index]):
                raise _fail(self.schedule, rank, step, f"F({s},{i}) runs before its input "
                            f"F({s - 1},{i}) has run and arrived")
            if (s == 0 or (s == last and self.trains)) and not self.loaded[index]:
                raise _fail(self.schedule, rank, step, f"F({s},{i}) runs before LOAD of "
                            f"microbatch {i}")
            self._check_pair_inputs(rank, step)
            self.f_done[index] = 1
        elif kind is _B or kind is _I or kind is _OB:
            if not self.f_done[index]:
                raise _fail(self.schedule, rank, step,
                            f"{kind.value}({s},{i}) runs before F({s},{i})")
            if s < last and not (self.g_done[index + m] if placement[s + 1] == rank
                                 else self.got_b[index]):
                raise _fail(self.schedule, rank, step, f"{kind.value}({s},{i}) runs before the "
                            f"gradient from stage {s + 1} has been computed and arrived")
            self.g_done[index] = 1
            self.w_done[index] = kind is not _I
        elif kind is _W:
            if not self.g_done[index]:
                raise _fail(self.schedule, rank, step, f"W({s},{i}) runs before I({s},{i})")
            self.w_done[index] = 1
        elif kind is Kind.LOAD:
            self.loaded[index] = 1
        elif kind is Kind.REDUCE_GRAD:
            missing = [j for j in range(m) if not self.w_done[s * m + j]]
            if missing:
                raise _fail(self.schedule, rank, step, f"REDUCE_GRAD of stage {s} before the "
                            f"weight gradients of microbatches {missing[:8]} are complete")
            if s in self.reduced:
                raise _fail(self.schedule, rank, step, f"REDUCE_GRAD of stage {s} appears "
                            "twice; reduce each stage's gradients once")
            self.reduced.add(s)
        elif kind is Kind.STEP:
            if step != len(self.schedule.streams[rank]) - 1:
                raise _fail(self.schedule, rank, step, "STEP must be the rank's last instruction")
            unreduced = [st for st in self.schedule.stages_of(rank) if st not in self.reduced]
            if unreduced:
                raise _fail(self.schedule, rank, step, f"STEP before REDUCE_GRAD of stages "
                            f"{unreduced}")
