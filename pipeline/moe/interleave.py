"""DeepSeek-V3's F&B overlap in the engine: two microbatches taking turns on one compute stream.

An overlapped pair (F, OVERLAP_B: DualPipe's F&B) runs its backward on a helper thread and
its forward on the calling one, never both at once: one holds the *turn* (the compute
stream) until it reaches an expert all-to-all, launches it asynchronously, and hands the turn
over; it takes the turn back, and waits for its all-to-all, when the other reaches its own
all-to-all or ends. So one microbatch's dispatch or combine is in flight while the other
computes (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, §3.2.1, Figure 4: each chunk
cut into attention, dispatch, MLP, combine, the two chunks' parts interleaved). The backward
starts (its combine's backward is the first all-to-all), so the parts alternate as
`schedules.analysis.all_to_all.PAIR_ORDER` prices them:

    compute:  B.head'  F.attention  B.experts'  F.experts  B.attention'  F.rest
    lane:           B.combine'   F.dispatch  B.dispatch'  F.combine

Why threads and a turn, not DeepSeek's hand-split layer functions: autograd's backward is one
call, and its all-to-all runs inside it (`expert_parallel._Exchange.backward`); a thread of
its own is how a backward can pause there. The turn makes the two threads one ordered
program: every rank of an ep group issues its collectives in the same order (the same
stream, the same handovers), so an all-to-all never meets another one on its peer.

Why a raise in one thread stops the other. A thread that raises issues no more all-to-alls;
were the other to go on, its all-to-alls would meet the peers' next ones of the failed thread
(another size, another order), and gloo aborts the process (SIGABRT) before the error could
be reported. So the other thread stops where it next takes the turn — before it launches
anything more — with `OtherHalfFailedError`, and `run_interleaved` raises the first error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from torch import nn

__all__ = ["InFlight", "Interleave", "OtherHalfFailedError", "hand_over",
           "has_expert_all_to_all", "in_turns", "run_interleaved"]


class OtherHalfFailedError(RuntimeError):
    """The thread this one takes turns with raised: this one stops before its next all-to-all
    (the first error is the one `run_interleaved` raises)."""


class InFlight(Protocol):
    """An asynchronous communication: `dist.Work`, or an emulated one."""

    def wait(self) -> object:
        """Block until it has completed."""


class Interleave:
    """The turn of two threads (0, which starts: a pair's backward, a two-batch forward's
    first half; 1: the forward, the second half)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self._failed = [False, False]
        self.handovers = 0
        """Times the turn passed to the other thread at an all-to-all (what overlapped)."""

    def wait_turn(self, me: int) -> None:
        """Wait for the turn; `OtherHalfFailedError` if the other thread raised."""
        with self._condition:
            self._condition.wait_for(lambda: self._turn == me)
            self._stop_if_other_failed(me)

    def hand_over(self, me: int) -> None:
        """Give the turn to the other thread (if it has work left) and wait to get it back;
        `OtherHalfFailedError` if the other thread raised meanwhile."""
        with self._condition:
            if not self._done[1 - me]:
                self._turn = 1 - me
                self.handovers += 1
                self._condition.notify_all()
                self._condition.wait_for(lambda: self._turn == me)
            self._stop_if_other_failed(me)

    def _stop_if_other_failed(self, me: int) -> None:
        if self._failed[1 - me]:
            raise OtherHalfFailedError(
                f"stopped: the thread this one takes turns with ({1 - me}) raised first")

    def finish(self, me: int, *, failed: bool = False) -> None:
        with self._condition:
            self._done[me] = True
            self._failed[me] = failed
            self._turn = 1 - me
            self._condition.notify_all()


_current = threading.local()


def hand_over(work: InFlight) -> None:
    """Wait for `work`, an all-to-all just launched: inside an overlapped pair, first let the
    other microbatch compute while it is in flight."""
    turn: tuple[Interleave, int] | None = getattr(_current, "turn", None)
    if turn is not None:
        turn[0].hand_over(turn[1])
    work.wait()


def in_turns() -> bool:
    """Whether this thread takes turns with another (inside `run_interleaved`)."""
    return getattr(_current, "turn", None) is not None


def _participate(interleave: Interleave, me: int, work: Callable[[], None],
                 errors: list[BaseException]) -> None:
    _current.turn = (interleave, me)
    failed = False
    try:
        interleave.wait_turn(me)
        work()
    except BaseException as error:  # re-raised on the calling thread
        failed = True
        errors.append(error)
    finally:
        _current.turn = None
        interleave.finish(me, failed=failed)


def run_interleaved(first: Callable[[], None], second: Callable[[], None]) -> int:
    """Run `first` (on a helper thread; it starts: an overlapped pair's backward) and
    `second` (here: the pair's forward) taking turns at their all-to-alls; returns how many
    times the turn passed. The first error of either is raised here once both have ended;
    the other stops at its next turn (`OtherHalfFailedError`), before another all-to-all."""
    interleave = Interleave()
    errors: list[BaseException] = []
    helper = threading.Thread(target=_participate, args=(interleave, 0, first, errors),
                              name="interleaved-first", daemon=True)
    helper.start()
    _participate(interleave, 1, second, errors)
    helper.join()
    if errors:
        raise errors[0]
    return interleave.handovers


def has_expert_all_to_all(module: nn.Module) -> bool:
    """Whether a layer of `module` (or an MoE layer's dispatcher) runs an all-to-all through
    `hand_over` (it says so with ``all_to_all_inside = True``): then an overlapped pair is
    worth its two threads."""
    return any(getattr(m, "all_to_all_inside", False)
               or getattr(getattr(m, "dispatcher", None), "all_to_all_inside", False)
               for m in module.modules())
