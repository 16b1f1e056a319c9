"""The validator's verdict equals an independent checker's on seeded mutations of every schedule.

The checker is `tests.support.validator_oracle`'s, written from the validator's promise.
Mutations: swap two ops of a rank, drop one, duplicate one, retarget a microbatch, move a
send/recv within its rank, move an op to another rank. Each generator's lowered (with and
without the optimizer part) and compute-only schedules are mutated.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from schedules import NONE, SCHEDULES, Kind, Schedule, build_schedule
from tests.support.validator_oracle import (
    RECVS,
    SENDS,
    Streams,
    independent_verdict,
    validator_verdict,
)

# --- mutations: each returns new streams or None when it does not apply -------------------

def _swap(streams: Streams, rng: random.Random) -> Streams | None:
    rank = rng.randrange(len(streams))
    if len(streams[rank]) < 2:
        return None
    a, b = rng.sample(range(len(streams[rank])), 2)
    streams[rank][a], streams[rank][b] = streams[rank][b], streams[rank][a]
    return streams


def _drop(streams: Streams, rng: random.Random) -> Streams | None:
    rank = rng.randrange(len(streams))
    if len(streams[rank]) < 2:
        return None
    del streams[rank][rng.randrange(len(streams[rank]))]
    return streams


def _duplicate(streams: Streams, rng: random.Random) -> Streams | None:
    rank = rng.randrange(len(streams))
    op = rng.choice(streams[rank])
    streams[rank].insert(rng.randrange(len(streams[rank]) + 1), op)
    return streams


def _retarget(streams: Streams, rng: random.Random, m: int) -> Streams | None:
    rank = rng.randrange(len(streams))
    k = rng.randrange(len(streams[rank]))
    op = streams[rank][k]
    if op.microbatch == NONE or m < 2:
        return None
    other = rng.choice([i for i in range(m) if i != op.microbatch])
    streams[rank][k] = op._replace(microbatch=other)
    return streams


def _move_comm(streams: Streams, rng: random.Random) -> Streams | None:
    where = [(r, k) for r, s in enumerate(streams) for k, op in enumerate(s)
             if op.kind in SENDS or op.kind in RECVS]
    if not where:
        return None
    rank, k = rng.choice(where)
    op = streams[rank].pop(k)
    streams[rank].insert(rng.randrange(len(streams[rank]) + 1), op)
    return streams


def _cross_rank(streams: Streams, rng: random.Random) -> Streams | None:
    if len(streams) < 2:
        return None
    a, b = rng.sample(range(len(streams)), 2)
    if len(streams[a]) < 2:
        return None
    op = streams[a].pop(rng.randrange(len(streams[a])))
    streams[b].insert(rng.randrange(len(streams[b]) + 1), op)
    return streams


MUTATIONS: dict[str, Callable[[Streams, random.Random, int], Streams | None]] = {
    "swap": lambda s, rng, m: _swap(s, rng),
    "drop": lambda s, rng, m: _drop(s, rng),
    "duplicate": lambda s, rng, m: _duplicate(s, rng),
    "retarget microbatch": _retarget,
    "move send/recv": lambda s, rng, m: _move_comm(s, rng),
    "cross-rank reorder": lambda s, rng, m: _cross_rank(s, rng),
}


def _bases(name: str) -> list[Schedule]:
    spec = SCHEDULES[name]
    p, m = (2, 3) if name == "zb-optimal" else (2, 4) if name.startswith("dualpipev") else (3, 4)
    chunks = None if spec.chunks[1] == 1 else 2
    lowered = build_schedule(name, p, m, chunks)
    unstepped = lowered.replace_streams(tuple(
        tuple(op for op in stream if op.kind not in (Kind.STEP, Kind.REDUCE_GRAD))
        for stream in lowered.streams))
    compute = lowered.replace_streams(lowered.compute_streams(), lowered=False)
    return [lowered, unstepped, compute]


PER_BASE = 25  # mutants per mutation, per base schedule


def test_validator_agrees_with_an_independent_checker_on_mutants() -> None:
    rng = random.Random(22)
    tally = {"mutants": 0, "refused by both": 0, "accepted by both": 0}
    disagreements: list[str] = []
    for name in sorted(SCHEDULES):
        for base in _bases(name):
            placement, m = base.placement, base.num_microbatches
            assert validator_verdict(base.streams, placement, m)
            assert independent_verdict(base.streams, placement, m), name
            for label, mutate in MUTATIONS.items():
                for _ in range(PER_BASE):
                    mutant = mutate([list(s) for s in base.streams], rng, m)
                    if mutant is None:
                        continue
                    ours = validator_verdict(mutant, placement, m)
                    theirs = independent_verdict(mutant, placement, m)
                    tally["mutants"] += 1
                    tally["accepted by both" if ours and theirs else "refused by both"] += \
                        ours == theirs
                    if ours != theirs:
                        disagreements.append(
                            f"{name} ({'lowered' if base.lowered else 'compute'}) {label}: "
                            f"validator {'accepts' if ours else 'refuses'}, checker "
                            f"{'accepts' if theirs else 'refuses'}")
    print(tally)
    assert not disagreements, f"{len(disagreements)} of {tally['mutants']}:\n" + "\n".join(
        disagreements[:20])
    assert tally["refused by both"] > tally["mutants"] // 2  # the mutations do break things

