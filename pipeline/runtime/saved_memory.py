"""Saved-tensor accounting: bytes of activations autograd holds for backward, live and at peak."""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

__all__ = ["SavedTensorMeter"]


class _Saved:
    """What autograd keeps instead of the tensor: the tensor, and a release when it goes."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Counts the bytes of tensors that autograd saves for backward inside ``with meter:``.

    A storage saved by several nodes counts once; it counts until the last node holding it
    is freed (after the backward that frees the graph, or when the graph is dropped).
    Parameters (`ignore`) are not activations and are not counted. The hooks are
    `torch.autograd.graph.saved_tensors_hooks`, so only this thread's forwards are seen.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()) -> None:
        self._ignored = {t.untyped_storage().data_ptr() for t in ignore}
        self._held: dict[int, tuple[int, int]] = {}  # storage -> (references, bytes)
        self.live = 0
        """Bytes held now."""
        self.peak = 0
        """Most bytes held at once since the last `reset_peak`."""
        self._hooks: Any = None

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
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, trace)
        self._hooks = None
