"""Live tensor memory of one process: bytes of every storage torch ops create, now and at peak."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveSplit", "LiveTensorMeter"]


@dataclass(frozen=True)
class LiveSplit:
    """Live storage bytes at one moment, by what holds them."""

    states: int
    """Storages alive when the step began (`LiveTensorMeter.begin_step`): parameters,
    gradients kept between steps, optimizer state, masters, buffers an engine keeps."""
    activations: int
    """Storages created in the step that autograd holds for a backward at that moment."""
    other: int
    """Storages created in the step and not saved for backward: gradients made in the step,
    stage inputs and outputs an engine holds, communication buffers, temporaries."""

    @property
    def total(self) -> int:
        return self.states + self.activations + self.other


_STATES, _ACTIVATIONS, _OTHER = 0, 1, 2


class _Entry:
    """One counted storage: its bytes, what holds it, and how many saved tensors use it."""

    __slots__ = ("kind", "label", "nbytes", "saves", "watch")

    def __init__(self, nbytes: int, kind: int, label: str, watch: weakref.ref[Any]) -> None:
        self.nbytes, self.kind, self.label, self.watch = nbytes, kind, label, watch
        self.saves = 0


class _Saved:
    """What autograd keeps instead of a saved tensor: the tensor, and a release when it goes."""

    __slots__ = ("key", "release", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, release: Callable[[int], None]) -> None:
        self.tensor, self.key, self.release = tensor, key, release

    def __del__(self) -> None:
        self.release(self.key)


class LiveTensorMeter(TorchDispatchMode):
    """Counts the bytes of live tensor storages that torch ops create inside ``with meter:``.

    Every op's outputs pass through ``__torch_dispatch__``; each new storage is counted once,
    whatever views share it, with its full ``nbytes``, until a weak reference to it reports
    that it was freed. That is what an allocator without caching holds for tensors (CPU has
    no `torch.cuda.max_memory_allocated`), and it does not depend on which engine runs: a
    storage is counted however it is held (module, optimizer, engine buffer, autograd graph).
    `saved_tensors_hooks` mark the storages autograd holds for backward (`LiveSplit`).

    Limits: enter it before the tensors to count are made (storages made earlier are not
    seen until an op returns them); only this thread's ops are seen (CPU backward runs in
    the calling thread); storage resized in place (`UntypedStorage.resize_`) keeps the
    bytes it was counted with; memory outside tensors (Python objects, gloo's buffers,
    kernels' scratch space) is not counted.
    """

    def __init__(self, *, labels: bool = False) -> None:
        super().__init__()
        self._entries: dict[int, _Entry] = {}  # StorageImpl address -> entry
        self._totals = [0, 0, 0]  # states, activations, other
        self._labels = labels
        self.peak = LiveSplit(0, 0, 0)
        """The split at the moment the total was highest since the last `begin_step`."""
        self.peak_labels: dict[str, int] = {}
        """With ``labels=True``: at the peak, live bytes per "kind dtype op" (op that made the
        storage), for finding out what a peak is made of."""
        self._hooks: Any = None

    @property
    def live(self) -> LiveSplit:
        """The split now."""
        return LiveSplit(*self._totals)

    def begin_step(self) -> None:
        """Everything alive now counts as state from here; the peak starts from now."""
        for entry in self._entries.values():
            entry.kind = _STATES
        self._totals = [sum(self._totals), 0, 0]
        self.peak = self.live
        self.peak_labels = self._label_bytes() if self._labels else {}

    # -- counting -----------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf, str(func))
        return out

    def _track(self, tensor: torch.Tensor, label: str) -> None:
        if tensor.device.type == "meta" or tensor.is_sparse:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._entries or storage.nbytes() == 0:
            return
        # torch keeps one Python object per live storage (as it does for tensors), so the
        # reference dies with the storage itself, not with this Python handle
        watch = weakref.ref(storage, lambda _, key=key: self._free(key))  # type: ignore[misc]
        entry = _Entry(storage.nbytes(), _OTHER, f"{tensor.dtype} {label}", watch)
        self._entries[key] = entry
        self._move(entry, None, _OTHER)

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._totals[entry.kind] -= entry.nbytes

    def _move(self, entry: _Entry, old: int | None, new: int) -> None:
        if old is not None:
            self._totals[old] -= entry.nbytes
        entry.kind = new
        self._totals[new] += entry.nbytes
        if sum(self._totals) > self.peak.total:
            self.peak = self.live
            if self._labels:
                self.peak_labels = self._label_bytes()

    def _label_bytes(self) -> dict[str, int]:
        names = ("state", "activation", "other")
        found: dict[str, int] = {}
        for entry in self._entries.values():
            name = f"{names[entry.kind]} {entry.label}"
            found[name] = found.get(name, 0) + entry.nbytes
        return found

    # -- saved for backward -------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = tensor.untyped_storage()._cdata if tensor.device.type != "meta" else 0
        entry = self._entries.get(key)
        if entry is None or entry.kind == _STATES:
            return tensor  # a parameter, or a storage made before the step: state already
        entry.saves += 1
        if entry.saves == 1:
            self._move(entry, entry.kind, _ACTIVATIONS)
        return _Saved(tensor, key, self._unsave)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _unsave(self, key: int) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.kind != _ACTIVATIONS:
            return
        entry.saves -= 1
        if entry.saves == 0:
            self._move(entry, _ACTIVATIONS, _OTHER)

    def __enter__(self) -> LiveTensorMeter:
        super().__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, trace)
        self._hooks = None
        super().__exit__(kind, error, trace)
