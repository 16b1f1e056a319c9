"""Unix-datagram messages between ranks of one host (`pipeline.parallel.local_p2p`): order,
layouts, full queues, timeouts, exited peers, and when the engine uses them."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.parallel.local_p2p import LocalLink, open_local_link
from tests.support.equivalence import sgd
from tests.support.pipeline_models import MODELS

pytestmark = pytest.mark.multiprocess

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


def _message(index: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(index, index + 12).reshape(3, 4)
    return (values % 2).to(dtype) if dtype is torch.bool else values.to(dtype)


def _exchange_rank() -> dict[str, Any]:
    link = open_local_link(None, timeout=30)
    assert link is not None
    rank = dist.get_rank()
    received: dict[str, Any] = {}
    if rank in (1, 2):  # each sends 40 messages (beyond the kernel's queue of 10) at once
        works = [link.send(_message(rank * 100 + k, DTYPES[k % 4]), 0) for k in range(40)]
        for work in works:
            work.wait()
        received["all_sent"] = all(work.is_completed() for work in works)
    else:  # rank 0 posts from rank 2 first, waits on rank 1's first: posting order matches
        time.sleep(0.5)
        buffers = {peer: [torch.empty(3, 4, dtype=DTYPES[k % 4]) for k in range(40)]
                   for peer in (2, 1)}
        works = {peer: [link.recv(b, peer) for b in buffers[peer]] for peer in (2, 1)}
        for peer in (1, 2):
            for work in reversed(works[peer]):  # waits in reverse: filled in posting order
                work.wait()
        received["equal"] = all(
            torch.equal(buffers[peer][k], _message(peer * 100 + k, DTYPES[k % 4]))
            for peer in (1, 2) for k in range(40))
    dist.barrier()
    link.close()
    return received


def test_messages_from_many_peers_match_receives_in_posting_order() -> None:
    results = launch(_exchange_rank, 3)
    assert results[0] == {"equal": True}
    assert results[1] == results[2] == {"all_sent": True}


def _flood_rank() -> bool:
    """Two ranks send each other 60 messages before receiving any: neither blocks."""
    link = open_local_link(None, timeout=30)
    assert link is not None
    peer = 1 - dist.get_rank()
    sends = [link.send(torch.full((1000,), float(k)), peer) for k in range(60)]
    buffers = [torch.empty(1000) for _ in range(60)]
    for work in [link.recv(b, peer) for b in buffers]:
        work.wait()
    for work in sends:
        work.wait()
    ok = all(float(b[0]) == k for k, b in enumerate(buffers))
    dist.barrier()
    link.close()
    return ok


def test_two_ranks_flooding_each_other_do_not_block() -> None:
    assert launch(_flood_rank, 2) == [True, True]


def _failure_rank(case: str) -> str:
    link = open_local_link(None, timeout=0.5)
    assert link is not None
    rank = dist.get_rank()
    try:
        if case == "timeout" and rank == 0:
            start = time.monotonic()
            try:
                link.recv(torch.empty(4), 1).wait()
            except RuntimeError as error:
                return f"{error} after {time.monotonic() - start:.1f}"
        if case == "layout" and rank == 1:
            link.send(torch.zeros(5), 0)
        if case == "layout" and rank == 0:
            try:
                link.recv(torch.empty(4), 1).wait()
            except RuntimeError as error:
                return str(error)
        if case == "exited":
            dist.barrier()
            if rank == 1:
                link.close()  # as when its process has gone
            dist.barrier()
            if rank == 0:
                try:
                    link.send(torch.zeros(4), 1)
                except RuntimeError as error:
                    return str(error)
        return ""
    finally:
        dist.barrier()
        link.close()


@pytest.mark.parametrize(("case", "expected"), [
    ("timeout", "timed out after 0.5 s waiting for a message from rank 1"),
    ("layout", "a message of 20 bytes from rank 1 where 16 were expected"),
    ("exited", "no rank listens at"),
])
def test_failures_raise_runtime_errors_that_say_what_happened(case: str, expected: str) -> None:
    message = launch(_failure_rank, 2, case)[0]
    assert expected in message, message
    if case == "timeout":
        assert float(message.rsplit(" ", 1)[1]) < 5.0


def _links_rank(rank_on_other_host: int | None) -> bool:
    def key() -> str:
        return "elsewhere" if dist.get_rank() == rank_on_other_host else "here"
    link = open_local_link(None, timeout=30, key=key)
    found = link is not None
    if link is not None:
        link.close()
    return found


def test_a_link_opens_only_when_every_rank_is_on_this_host() -> None:
    assert launch(_links_rank, 3, None) == [True] * 3
    assert launch(_links_rank, 3, 2) == [False] * 3


def _engine_rank(local_p2p: bool) -> tuple[bool, float]:
    spec = MODELS["mlp"]
    module = PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=4, optimizer=sgd,
                            local_p2p=local_p2p)
    inputs, targets = spec.batch(seed=0, batch=8, length=0)
    loss = engine.train_batch(inputs, targets)
    return isinstance(engine.comm.local, LocalLink), loss


def test_the_engine_uses_the_link_unless_told_not_to() -> None:
    on, off = launch(_engine_rank, 2, True), launch(_engine_rank, 2, False)
    assert [used for used, _ in on] == [True, True]
    assert [used for used, _ in off] == [False, False]
    assert on[1][1] == off[1][1]  # the last stage's loss: equal either way
