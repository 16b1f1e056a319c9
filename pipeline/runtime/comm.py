"""Traffic between pipeline ranks: point-to-point isend/irecv, shape headers, and the step's
pipeline-wide agreements (batch vote, loss broadcast); data/tensor-parallel collectives live in
`pipeline.parallel`, checkpoint collectives in `pipeline.checkpoint`.

Sends are posted as soon as a tensor exists and waited once a later message proves the peer
took them (`release`, `pipeline.runtime.send_release`) or at the end of the step (the tensors
are kept alive until then); receives are posted at the RECV instruction and waited
when the compute op needs them. Messages between one pair of ranks match in posting order,
which the lowered schedule guarantees is the same on both sides (the validator checks it).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.device import process_group_timeout
from pipeline.errors import PipelineConfigError
from pipeline.parallel.local_p2p import LocalLink
from pipeline.parallel.small_reduce import small_all_reduce
from pipeline.runtime.batch import Layout

__all__ = ["HEADER_LENGTH", "Comm", "PendingRecv", "PostedSend", "decode_header",
           "encode_header"]

HEADER_LENGTH = 64
"""int64 words in a shape header: [is_tuple, count, (dtype, ndim, *shape) per tensor]."""

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def encode_header(message: Layout) -> torch.Tensor:
    """The header tensor describing `message`."""
    is_tuple, layout = message
    words = [int(is_tuple), len(layout)]
    for shape, dtype in layout:
        if dtype not in _DTYPE_CODES:
            raise PipelineConfigError(f"activations of dtype {dtype} cannot be sent; use one "
                                      f"of {[str(d) for d in _DTYPES]}")
        words += [_DTYPE_CODES[dtype], len(shape), *shape]
    if len(words) > HEADER_LENGTH:
        raise PipelineConfigError(
            f"an activation of {len(layout)} tensors with shapes {[s for s, _ in layout]} "
            f"needs {len(words)} header words, more than HEADER_LENGTH={HEADER_LENGTH}; pass "
            "fewer or lower-rank tensors between stages (e.g. pack them into one)")
    header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
    header[:len(words)] = torch.tensor(words, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> Layout:
    """Inverse of `encode_header`."""
    words = header.tolist()
    is_tuple, count, k = bool(words[0]), words[1], 2
    layout = []
    for _ in range(count):
        dtype, ndim = _DTYPES[words[k]], words[k + 1]
        layout.append((tuple(words[k + 2:k + 2 + ndim]), dtype))
        k += 2 + ndim
    return Layout(is_tuple, tuple(layout))


class _QueuedWork:
    """A message queued for the next `batch_isend_irecv` group: waiting it launches the
    group first (`Comm.flush`), so no rank ever blocks with its own messages unlaunched."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self.work: Any = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.work is None:
            self._comm.flush()
        return bool(self.work.wait(timeout) if timeout is not None else self.work.wait())

    def is_completed(self) -> bool:
        return self.work is not None and bool(self.work.is_completed())


@dataclass
class PendingRecv:
    """Buffers being filled by posted irecvs; `wait` returns them once they have arrived."""

    works: list[Any]
    buffers: list[torch.Tensor]
    peer: int
    timeout: datetime.timedelta

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait(self.timeout)
        self.works = []
        return self.buffers


@dataclass
class PostedSend:
    """One message's posted sends and the tensors they read (kept alive until waited)."""

    works: list[Any]
    payload: list[torch.Tensor]
    peer: int
    tag: object
    """What `release` names it by (the interpreter: the SEND's kind, stage, microbatch)."""
    local: bool
    """Whether a tensor went through the datagram link: its queued sends complete only as
    the peer reads, so `release` never blocks on them."""


class Comm:
    """Point-to-point and collectives over one pipeline's ranks.

    Peers are pipeline rank indices (as in instructions); `pipeline_ranks[peer]` is the
    global rank, which differs from the pipeline rank once there is data parallelism.
    """

    def __init__(self, pipeline_ranks: Sequence[int], device: torch.device,
                 group: Any = None, timeout: float = 300.0, *,
                 local: LocalLink | None = None) -> None:
        self.pipeline_ranks = tuple(pipeline_ranks)
        self.timeout = process_group_timeout(timeout)
        self.device = device
        self.group = group
        self._sends: list[PostedSend] = []  # in posting order
        self.grouped = device.type == "cuda" and "nccl" in str(dist.get_backend(group))
        """Messages go out in `batch_isend_irecv` groups (`flush`): NCCL's need; gloo
        posts each at once."""
        self._queued: list[tuple[Any, _QueuedWork]] = []
        self._process_group: Any = group if group is not None else dist.group.WORLD
        self._group_ranks = [rank if group is None else dist.get_group_rank(group, rank)
                             for rank in self.pipeline_ranks]
        self.local = local
        """Small CPU messages go through this link when set (`pipeline.parallel.local_p2p`)."""

    # -- point to point ------------------------------------------------------------------
    # Gloo: ProcessGroup.send/recv directly (dist.isend's Python checks cost ~150 µs a
    # message on a busy CPU), posted from the step's own thread: handing posts to a
    # background thread made messages arrive later (its GIL hand-off; measured here, 4 ranks
    # on 2 cores: median delivery 0.47 ms through a poster thread, 0.26 ms direct). Ranks of
    # one host: messages of up to 64 KiB as Unix datagrams (`local`), which skip gloo's
    # device threads.
    # NCCL: a send occupies its communicator's stream until the peer's receive is there, so
    # two ranks sending to each other one message at a time (1F1B's steady state: F out,
    # gradient back) can wait on each other forever. Every message between two compute ops
    # goes out in one `batch_isend_irecv` group instead (NCCL groups them; Megatron's
    # `send_forward_recv_backward`, torch's `_batch_p2p` do the same): the interpreter calls
    # `flush` before every instruction that is not a message, and a wait flushes first.

    def _send(self, tensor: torch.Tensor, peer: int) -> Any:
        if self.local is not None and self.local.carries(tensor):
            return self.local.send(tensor, self.pipeline_ranks[peer])
        if self.grouped:
            return self._queue(dist.isend, tensor, peer)
        return self._process_group.send([tensor], self._group_ranks[peer], 0)

    def _recv(self, tensor: torch.Tensor, peer: int) -> Any:
        if self.local is not None and self.local.carries(tensor):
            return self.local.recv(tensor, self.pipeline_ranks[peer])
        if self.grouped:
            return self._queue(dist.irecv, tensor, peer)
        return self._process_group.recv([tensor], self._group_ranks[peer], 0)

    def _queue(self, operation: Any, tensor: torch.Tensor, peer: int) -> _QueuedWork:
        handle = _QueuedWork(self)
        self._queued.append((dist.P2POp(operation, tensor, self.pipeline_ranks[peer],
                                        self.group), handle))
        return handle

    def flush(self) -> None:
        """Launch the queued messages as one `batch_isend_irecv` group (NCCL; nothing is
        queued on gloo)."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        works = dist.batch_isend_irecv([operation for operation, _ in queued])
        if len(works) == len(queued):
            for (_, handle), work in zip(queued, works):
                handle.work = work
        else:  # NCCL answers a coalesced group with one work for all of it
            for _, handle in queued:
                handle.work = works[-1]

    def _wait(self, work: Any) -> None:
        work.wait(self.timeout)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, *, header: Layout | None,
             tag: object = None) -> None:
        """Post isends of `tensors` to pipeline rank `peer`, preceded by a shape header when
        `header` is given; return at once. `tag` names the message for `release`."""
        payload = [t.detach().contiguous() for t in tensors]
        if header is not None:
            payload.insert(0, encode_header(header).to(self.device))
        self._prune()  # drop finished sends so their tensors (activations) can be freed
        local = self.local is not None and any(self.local.carries(t) for t in payload)
        self._sends.append(PostedSend([self._send(t, peer) for t in payload], payload, peer,
                                      tag, local))

    def release(self, tags: Sequence[object]) -> None:
        """Wait the sends named by `tags`, and every earlier send to the same peers, and drop
        their tensors. The caller knows the peers have posted the matching receives (a later
        message from them proves it): the wait is only the transfer, never a wait on another
        rank's progress. Sends through the datagram link are dropped only once complete."""
        peers = {entry.peer: k for k, entry in enumerate(self._sends) if entry.tag in tags}
        if not peers:
            return
        kept: list[PostedSend] = []
        for k, entry in enumerate(self._sends):
            last = peers.get(entry.peer, -1)
            if k > last:
                kept.append(entry)
            elif entry.local:
                if not all(work.is_completed() for work in entry.works):
                    kept.append(entry)
            else:
                for work in entry.works:
                    self._wait(work)
        self._sends = kept

    def recv_header(self, peer: int) -> Layout:
        """Block until the next shape header from `peer` arrives; return its layout."""
        header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self.device)
        self._wait(self._recv(header, peer))
        return decode_header(header.cpu())

    def recv(self, message: Layout, peer: int) -> PendingRecv:
        """Post irecvs for one message of layout `message` from `peer`; wait on the result
        later."""
        buffers = [torch.empty(shape, dtype=dtype, device=self.device)
                   for shape, dtype in message.tensors]
        return PendingRecv([self._recv(b, peer) for b in buffers], buffers, peer, self.timeout)

    def _prune(self) -> None:
        # a message's tensors go to one peer, whose sends complete in posting order: the
        # last one done means the message is done
        self._sends = [entry for entry in self._sends
                       if entry.works and not entry.works[-1].is_completed()]

    def wait_sends(self) -> None:
        """Wait until every posted send has completed (the step's end)."""
        sends, self._sends = self._sends, []
        for entry in sends:
            for work in entry.works:
                self._wait(work)

    def drop_pending(self) -> None:
        """Forget posted sends after a failure (the step is abandoned)."""
        self._sends = []
        self._queued = []
        if self.local is not None:
            self.local.forget()

    # -- collectives over the pipeline ---------------------------------------------------

    def agree(self, values: Sequence[int], *, failed: bool,
              pp_rank: int) -> tuple[list[int], list[int]]:
        """One all-reduce: the element-wise sum of every rank's `values` (each entry has one
        contributing rank, the others give 0) and the pipeline ranks that reported `failed`,
        in order."""
        self.flush()  # a peer may be waiting on a queued message before it can vote
        # one slot per pipeline rank (not a bitmask in one int64: that saturates at 63 ranks)
        flags = torch.zeros(len(values) + len(self.pipeline_ranks), dtype=torch.int64)
        flags[:len(values)] = torch.tensor(list(values), dtype=torch.int64)
        flags[len(values) + pp_rank] = int(failed)
        small_all_reduce(flags, group=self.group, link=self.local)
        summed = flags.tolist()
        return summed[:len(values)], [rank for rank, flag in enumerate(summed[len(values):])
                                      if flag]

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every pipeline rank's `value`, in pipeline-rank order."""
        self.flush()
        gathered: list[Any] = [None] * len(self.pipeline_ranks)
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

