# torch's stubs give ProcessGroup's operations the public overloads; the C++ trampoline calls
# a Python group's methods with the backend signatures written below
# mypy: disable-error-code="override"
"""Messages and collectives of device tensors over gloo, staged through host memory: the
process-group backend of ranks that share one GPU, where NCCL refuses ("Duplicate GPU
detected").

`pipeline.device.default_backend` names it per device type, ``cpu:gloo,cuda:pipesched_staged``,
so torch's process group sends CPU tensors to gloo as before and hands CUDA tensors to
`StagedProcessGroup`. That copies each input to (pinned) host memory once the compute stream
has produced it, runs the gloo operation on the copies, and copies the results back onto the
device when the work is waited: the engine and every collective in `pipeline.parallel` keep
their one code path, and where a message waits is where the engine already waits.

Why our own: torch has no staged gloo path for CUDA tensors (gloo's send/recv read host
pointers), and a Python `ProcessGroup` registered with `dist.Backend.register_backend` is the
seam torch offers for a backend of one device type. On a CPU the same class stages through
plain host copies (`STAGED_HOST_BACKEND`): the tests run the engine through it there.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipeline.device.accelerator import copy_from_host, host_buffer_like, stage_to_host

__all__ = ["STAGED_BACKEND", "STAGED_HOST_BACKEND", "StagedProcessGroup", "backend_available",
           "register_staged_backend"]

STAGED_BACKEND = "pipesched_staged"
"""The backend's name in a process-group backend string (``cuda:pipesched_staged``)."""

STAGED_HOST_BACKEND = "pipesched_staged_host"
"""The same, copying CPU tensors through host buffers too: the staged path rehearsed on a
machine without a GPU (``cpu:pipesched_staged_host``), where a result never copied back shows."""

_FOREVER = datetime.timedelta(days=365)


class _StagedWork(dist._Work):
    """A gloo work on host copies; waiting it copies the results back to the device."""

    def __init__(self, inner: Any, finish: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: datetime.timedelta = _FOREVER) -> bool:
        if self._finish is not None:
            self._inner.wait(timeout)
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        if self._finish is not None and self._inner.is_completed():
            self.wait()
        return self._finish is None


def _nothing() -> None:
    pass


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
    def finish() -> None:
        for device_tensor, host in pairs:
            if host is not device_tensor:
                copy_from_host(device_tensor, host)
    return finish


class StagedProcessGroup(dist.ProcessGroup):
    """Every operation the engine uses, run by an inner gloo group on host copies."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, *,
                 stage_host_tensors: bool = False) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.inner: Any = dist.ProcessGroupGloo(dist.PrefixStore(STAGED_BACKEND, store), rank,
                                           size, timeout)
        self.stage_host_tensors = stage_host_tensors
        """Copy CPU tensors too (`STAGED_HOST_BACKEND`: the staged path rehearsed on a CPU);
        otherwise they go to gloo as they are."""
        # torch puts a Python group in place of the whole process group (every device):
        # gloo under it names the group and serves the operations this class leaves to torch
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO,
                                   self.inner)

    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not self.stage_host_tensors:
            return tensor
        return stage_to_host(tensor)

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not self.stage_host_tensors:
            return tensor
        return host_buffer_like(tensor)

    def getBackendName(self) -> str:
        return STAGED_BACKEND

    # -- point to point ------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _StagedWork:
        hosts = [self._stage(t) for t in tensors]  # kept alive by the closure below
        return _StagedWork(self.inner.send(hosts, dst, tag), lambda: hosts.clear())

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _StagedWork:
        hosts = [self._buffer(t) for t in tensors]
        return _StagedWork(self.inner.recv(hosts, src, tag), _copy_all(list(zip(tensors,
                                                                              hosts))))

    # -- collectives ---------------------------------------------------------------------

    def _in_place(self, run: Callable[[list[torch.Tensor]], Any],
                  tensors: list[torch.Tensor]) -> _StagedWork:
        hosts = [self._stage(t) for t in tensors]
        return _StagedWork(run(hosts), _copy_all(list(zip(tensors, hosts))))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _StagedWork:
        return self._in_place(lambda hosts: self.inner.allreduce(hosts, opts), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _StagedWork:
        return self._in_place(lambda hosts: self.inner.broadcast(hosts, opts), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _StagedWork:
        return self._in_place(lambda hosts: self.inner.reduce(hosts, opts), tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any) -> _StagedWork:
        host_outputs = [[self._buffer(t) for t in row] for row in outputs]
        work = self.inner.allgather(host_outputs, [self._stage(t) for t in inputs], opts)
        return _StagedWork(work, _copy_all([pair for row, hosts in zip(outputs, host_outputs)
                                            for pair in zip(row, hosts)]))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any) -> _StagedWork:
        host = self._buffer(output)
        work = self.inner._allgather_base(host, self._stage(input), opts)
        return _StagedWork(work, _copy_all([(output, host)]))

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any) -> _StagedWork:
        hosts = [self._buffer(t) for t in outputs]
        work = self.inner.reduce_scatter(hosts, [[self._stage(t) for t in row]
                                                 for row in inputs], opts)
        return _StagedWork(work, _copy_all(list(zip(outputs, hosts))))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any) -> _StagedWork:
        host = self._buffer(output)
        work = self.inner._reduce_scatter_base(host, self._stage(input), opts)
        return _StagedWork(work, _copy_all([(output, host)]))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any) -> _StagedWork:
        host = self._buffer(output)
        work = self.inner.alltoall_base(host, self._stage(input), output_split_sizes,
                                        input_split_sizes, opts)
        return _StagedWork(work, _copy_all([(output, host)]))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any) -> _StagedWork:
        host_outputs = [[self._buffer(t) for t in row] for row in outputs]
        work = self.inner.gather(host_outputs, [self._stage(t) for t in inputs], opts)
        return _StagedWork(work, _copy_all([pair for row, hosts in zip(outputs, host_outputs)
                                            for pair in zip(row, hosts)]))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any) -> _StagedWork:
        hosts = [self._buffer(t) for t in outputs]
        work = self.inner.scatter(hosts, [[self._stage(t) for t in row] for row in inputs],
                                  opts)
        return _StagedWork(work, _copy_all(list(zip(outputs, hosts))))

    def barrier(self, opts: Any) -> _StagedWork:
        return _StagedWork(self.inner.barrier(opts), _nothing)


def _create(store: Any, rank: int, size: int,
            timeout: datetime.timedelta) -> StagedProcessGroup:
    return StagedProcessGroup(store, rank, size, timeout)


def _create_host_staged(store: Any, rank: int, size: int,
                        timeout: datetime.timedelta) -> StagedProcessGroup:
    return StagedProcessGroup(store, rank, size, timeout, stage_host_tensors=True)


def register_staged_backend() -> None:
    """Make `STAGED_BACKEND` and `STAGED_HOST_BACKEND` known to torch.distributed in this
    process (idempotent)."""
    for name, creator in ((STAGED_BACKEND, _create), (STAGED_HOST_BACKEND, _create_host_staged)):
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, creator, devices=["cpu", "cuda"])


def backend_available(backend: str) -> bool:
    """Whether `backend` ("gloo", or per device "cpu:gloo,cuda:pipesched_staged") can start
    here; names `STAGED_BACKEND` register it."""
    names = [part.split(":", 1)[-1].strip().lower() for part in backend.split(",")]
    ours = (STAGED_BACKEND, STAGED_HOST_BACKEND)
    if any(name in ours for name in names):
        register_staged_backend()
    return bool(names) and all(
        name in ours or (name in dist.Backend.backend_list and
                                   dist.is_backend_available(name)) for name in names)
