"""Which received message proves that a posted send has been taken, so it can be waited early."""

from __future__ import annotations

from collections.abc import Sequence

from schedules import Instruction, Kind

__all__ = ["MessageKey", "send_witnesses"]

MessageKey = tuple[Kind, int, int]
"""A communication instruction's (kind, stage, microbatch): unique within one rank's stream."""

_SENDS = (Kind.SEND_F, Kind.SEND_B)
_RECEIVES = (Kind.RECV_F, Kind.RECV_B)


def _key(op: Instruction) -> MessageKey:
    return (op.kind, op.stage, op.microbatch)


def _by_peer(stream: Sequence[Instruction], kinds: tuple[Kind, ...]
             ) -> dict[int, list[tuple[int, Instruction]]]:
    found: dict[int, list[tuple[int, Instruction]]] = {}
    for index, op in enumerate(stream):
        if op.kind in kinds:
            found.setdefault(op.peer, []).append((index, op))
    return found


def send_witnesses(streams: Sequence[Sequence[Instruction]],
                   rank: int) -> dict[MessageKey, list[MessageKey]]:
    """For each receive of `rank`, the sends of `rank` whose data has surely been taken once
    that receive has arrived: waiting them then costs at most the transfer, never a wait on
    another rank's progress.

    Gloo keeps a send's tensor (and its `Work` reports not completed) until `wait`, and
    moves the data only once the receiver has posted its receive. Messages between two ranks
    match in posting order. So a send from `rank` to `q` is taken once `q` has posted the
    matching receive; `q` posts it at its RECV instruction at the latest (one compute op
    earlier when it can, `pipeline.runtime.lookahead`), so any message `q` sends to `rank`
    after that instruction proves it. The witness is the first such message whose receive
    `rank` runs after the send (a message received before the send was posted proves
    nothing about it). Sends without a witness are waited at the step's end.
    """
    mine = streams[rank]
    witnesses: dict[MessageKey, list[MessageKey]] = {}
    my_receives = _by_peer(mine, _RECEIVES)
    for peer, sends in _by_peer(mine, _SENDS).items():
        their_receives = _by_peer(streams[peer], _RECEIVES).get(rank, [])
        their_sends = _by_peer(streams[peer], _SENDS).get(rank, [])
        back = my_receives.get(peer, [])
        for n, (index, send) in enumerate(sends):
            if n >= len(their_receives):
                break  # an invalid schedule: the validator names it; wait at the step's end
            taken_at = their_receives[n][0]
            for reply, (sent_at, _) in enumerate(their_sends):
                if sent_at > taken_at and reply < len(back) and back[reply][0] > index:
                    witnesses.setdefault(_key(back[reply][1]), []).append(_key(send))
                    break
    return witnesses
