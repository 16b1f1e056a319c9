"""Point-to-point messages between ranks of one host, over Unix datagram sockets.

Gloo on one host goes through TCP loopback and its own device thread: a receive posted
after the data is ready costs a notice's round trip, and each message wakes the sender's
and the receiver's device threads before the receiving rank (measured here, one way,
2 ranks idle: gloo 71-87 µs, a Unix datagram 11-38 µs). Stage boundaries of a pipeline
carry small messages (an activation of one microbatch) on the critical path, so the
engine sends those of at most `inline_limit` bytes as one datagram straight to the
receiving rank's socket; larger ones keep going through gloo (a copy through the kernel
buys nothing there).

Each rank binds one socket in the abstract namespace (no file, nothing to clean up), named
by the link's id (drawn by the group's first rank) and its global rank. A datagram holds
the sender's rank and the payload; it fills the oldest receive posted for its sender (or
waits for one), so messages from one peer match receives in the order both sides post
them, as gloo's do, whichever receive is waited on first. A send never blocks: when the
peer's queue is full (the kernel holds `/proc/sys/net/unix/max_dgram_qlen` datagrams per
receiver) the message waits in an outbox that every later call of this link flushes first,
and a wait reads its own socket while it flushes, so ranks sending to each other cannot
block each other.

Why not gloo's or NCCL's own shared-memory path: gloo has none, and NCCL is for GPUs.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["LocalLink", "group_members", "host_key", "open_local_link"]

_HEADER = struct.Struct("<i")  # the sender's global rank
_POLL = 0.0005  # s between attempts to flush a full peer queue while waiting


def group_members(group: Any) -> list[int]:
    """Global ranks of `group` (None: the world), in group-rank order."""
    return list(dist.get_process_group_ranks(group)) if group is not None else \
        list(range(dist.get_world_size()))


def address(job: str, rank: int) -> bytes:
    """The abstract-namespace name of `rank`'s socket in job `job`."""
    return b"\0pipesched-" + job.encode() + b"-" + str(rank).encode()


class _Done:
    """A send the kernel took: complete."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _Done()  # every send the kernel took at once is the same completed work


class _Queued:
    """A send waiting in the outbox until the peer's queue has room."""

    def __init__(self, link: LocalLink) -> None:
        self.link = link
        self.sent = False

    def is_completed(self) -> bool:
        if not self.sent:
            self.link.flush()
        return self.sent

    def wait(self, timeout: object = None) -> bool:
        self.link.wait_until(lambda: self.sent, "a send to a full queue")
        return True


class _Receive:
    """A receive from `peer` into `buffer`, filled when its datagram is read."""

    def __init__(self, link: LocalLink, buffer: torch.Tensor, peer: int) -> None:
        self.link, self.buffer, self.peer = link, buffer, peer
        self.filled = False

    def fill(self, datagram: bytes) -> None:
        target = self.buffer.view(-1).view(torch.uint8).numpy()
        if len(datagram) - _HEADER.size != target.size:
            raise RuntimeError(f"local link: a message of {len(datagram) - _HEADER.size} "
                               f"bytes from rank {self.peer} where {target.size} were expected "
                               "(sender and receiver disagree on its layout)")
        target[:] = np.frombuffer(datagram, dtype=np.uint8, offset=_HEADER.size)
        self.filled = True

    def is_completed(self) -> bool:
        return self.filled

    def wait(self, timeout: object = None) -> bool:
        if not self.filled:
            self.link.wait_until(lambda: self.filled, f"a message from rank {self.peer}")
        return True


class LocalLink:
    """This rank's end of datagram links to the ranks of its host (see the module doc)."""

    def __init__(self, job: str, rank: int, timeout: float, inline_limit: int = 64 * 1024,
                 *, ranks: frozenset[int] = frozenset()) -> None:
        self.job, self.rank, self.timeout = job, rank, timeout
        self.ranks = ranks or frozenset({rank})
        """Global ranks whose links were opened with this one (those it can reach)."""
        self.inline_limit = inline_limit
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address(job, rank))
        # sends leave through their own non-blocking socket (a full peer queue raises at
        # once; the receiving socket's timeouts would turn that into a wait)
        self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.out.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * inline_limit)
        self.out.setblocking(False)
        self._arrived: dict[int, deque[bytes]] = {}  # datagrams no receive was posted for
        self._posted: dict[int, deque[_Receive]] = {}  # receives waiting for a datagram
        self._outbox: dict[bytes, deque[tuple[list[bytes], _Queued]]] = {}  # per peer
        self._peers: dict[int, bytes] = {}
        self.sent_bytes = 0
        """Bytes handed to the kernel so far (header and payload): `sendmsg` on a Unix
        socket does not show in /proc/self/io's `wchar`, so byte counts add this."""

    def close(self) -> None:
        self.sock.close()
        self.out.close()

    def forget(self) -> None:
        """Drop unfilled receives, unsent messages and unclaimed datagrams (after a failed
        step: what they belonged to is abandoned on every rank)."""
        self._posted.clear()
        self._outbox.clear()
        self._arrived.clear()

    def spans(self, group: Any) -> bool:
        """Whether every rank of `group` (None: the world) is reachable through this link."""
        return all(rank in self.ranks for rank in group_members(group))

    def carries(self, tensor: torch.Tensor) -> bool:
        """Whether a message of `tensor` goes through this link (CPU, small enough)."""
        return tensor.device.type == "cpu" and \
            tensor.numel() * tensor.element_size() <= self.inline_limit

    def send(self, tensor: torch.Tensor, peer: int) -> _Done | _Queued:
        """Hand `tensor` (contiguous) to the kernel for `peer`, or queue it; never blocks."""
        to = self._peers.get(peer)
        if to is None:
            to = self._peers[peer] = address(self.job, peer)
        data = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        parts = [_HEADER.pack(self.rank), data]
        self.flush()
        waiting = self._outbox.get(to)
        if not waiting and self._try_send(to, parts):
            return _DONE
        queued = _Queued(self)
        self._outbox.setdefault(to, deque()).append((parts, queued))
        return queued

    def recv(self, buffer: torch.Tensor, peer: int) -> _Receive:
        """A receive of the next message from `peer` into `buffer` (done once its `wait`
        returns). Receives from one peer are filled in the order they are posted."""
        receive = _Receive(self, buffer, peer)
        early = self._arrived.get(peer)
        if early:
            receive.fill(early.popleft())
        else:
            self._posted.setdefault(peer, deque()).append(receive)
        return receive

    def _try_send(self, to: bytes, parts: list[bytes]) -> bool:
        try:
            self.sent_bytes += self.out.sendmsg(parts, [], 0, to)
        except BlockingIOError:
            return False
        except (ConnectionRefusedError, FileNotFoundError) as error:
            raise RuntimeError(f"local link: no rank listens at {to[1:].decode()} "
                               f"(it has exited): {error}") from error
        return True

    def flush(self) -> None:
        """Send what the outbox holds, in order per peer, while the peers' queues take it."""
        for to, waiting in self._outbox.items():
            while waiting:
                parts, queued = waiting[0]
                if not self._try_send(to, parts):
                    break
                queued.sent = True
                waiting.popleft()

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Read datagrams (and flush the outbox) until `done()`; RuntimeError after the
        link's timeout, as a timed-out gloo wait raises."""
        deadline = time.monotonic() + self.timeout
        while True:
            self.flush()
            if done():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"local link: timed out after {self.timeout:g} s waiting "
                                   f"for {what}")
            queued = any(self._outbox.values())
            self.sock.settimeout(min(remaining, _POLL) if queued else remaining)
            try:
                datagram = self.sock.recv(self.inline_limit + _HEADER.size)
            except TimeoutError:
                continue
            (sender,) = _HEADER.unpack_from(datagram)
            posted = self._posted.get(sender)
            if posted:
                posted.popleft().fill(datagram)
            else:
                self._arrived.setdefault(sender, deque()).append(datagram)


def host_key() -> str:
    """What ranks that can reach each other's abstract sockets share: the host (its boot)
    and the network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""  # not Linux: no abstract namespace, no local link
    return f"{socket.gethostname()}/{boot_id}/{namespace}"


def open_local_link(group: Any, timeout: float, *, key: Callable[[], str] = host_key
                    ) -> LocalLink | None:
    """This rank's `LocalLink` when every rank of `group` (None: the world) is on this host
    and bound its socket, else None on every rank (a collective over `group`; gloo only)."""
    if dist.get_backend(group) != "gloo":
        return None
    size = dist.get_world_size(group)
    mine = key()
    found: list[Any] = [None] * size
    dist.all_gather_object(found, (mine, secrets.token_hex(8)), group=group)
    if not mine or any(host != mine for host, _ in found):
        return None
    job = found[0][1]  # the group's first rank names the job: unique per link, per engine
    ranks = frozenset(group_members(group))
    link: LocalLink | None = None
    try:
        link = LocalLink(job, dist.get_rank(), timeout, ranks=ranks)
    except OSError:
        pass
    bound: list[Any] = [None] * size
    dist.all_gather_object(bound, link is not None, group=group)
    if not all(bound):
        if link is not None:
            link.close()
        return None
    return link

