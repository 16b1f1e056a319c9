"""Saved-tensor accounting: bytes of activations autograd holds for backward, live and at peak."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any

import torch

__all__ = ["SavedTensorMeter", "hold_outputs"]

# The meter whose `with` block this thread is in: the interpreter tells it which stage
# outputs it keeps (`hold_outputs`), which autograd's saved-tensor hooks cannot see.
_ACTIVE: ContextVar[SavedTensorMeter | None] = ContextVar("pipesched_saved_meter",
                                                          default=None)


class _Saved:
    """What autograd keeps instead of the tensor: the tensor, and a release when it goes."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor) -> None:
        # a detached alias (same storage, own TensorImpl): autograd hands the hook a node's
        # output itself, and the engine later swaps a sent output's data for a placeholder
        self.meter, self.key, self.tensor = meter, key, tensor.detach()

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Counts the bytes of tensors that autograd saves for backward inside ``with meter:``.

    A storage saved by several nodes counts once; it counts until the last node holding it
    is freed (after the backward that frees the graph, or when the graph is dropped).
    Parameters (`ignore`) are not activations and are not counted. The hooks are
    `torch.autograd.graph.saved_tensors_hooks`, so only this thread's forwards are seen.
    Stage outputs the engine keeps as backward roots count too (`hold_outputs`), until it
    frees a sent one's data or runs its backward; bytes of sends still in flight do not.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        self._ignored = {t.untyped_storage().data_ptr() for t in ignore}
        self._held: dict[int, tuple[int, int]] = {}  # storage -> (references, bytes)
        self.live = 0
        """Bytes held now."""
        self.peak = 0
        """Most bytes held at once since the last `reset_peak`."""
        self._hooks: Any = None
        self._token: Token[SavedTensorMeter | None] | None = None

    def reset_peak(self) -> None:
        """Start a new peak from what is held now."""
        self.peak = self.live

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._ignored or tensor.device.type == "meta":
            return tensor
        references, size = self._held.get(key, (0, storage.nbytes()))
        if references == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        self._held[key] = (references + 1, size)
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        references, size = self._held[key]
        if references == 1:
            del self._held[key]
            self.live -= size
        else:
            self._held[key] = (references - 1, size)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, trace)
        self._hooks = None
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None


def hold_outputs(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Count `tensors` in the active meter for as long as the returned handles live (one
    reference each, a storage once with what autograd saved); nothing without a meter."""
    meter = _ACTIVE.get()
    return [] if meter is None else [meter._pack(t) for t in tensors]
