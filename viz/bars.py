"""Many horizontal bars as one matplotlib collection (fast to build and draw), and back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.collections import PolyCollection

__all__ = ["add_bars", "bar_extents", "bars_labelled"]


def add_bars(ax: Axes, y: np.ndarray, left: np.ndarray, width: np.ndarray, height: float,
             label: str, **style: Any) -> PolyCollection:
    """One rectangle per row (centred on `y`) as a single `PolyCollection` labelled `label`.

    A `barh` call makes one Patch per bar, which takes tens of seconds for the thousands
    of ops of a large schedule; a collection of the same rectangles draws in a blink.
    """
    from matplotlib.collections import PolyCollection

    y = np.asarray(y, dtype=np.float64)
    left = np.asarray(left, dtype=np.float64)
    right = left + np.asarray(width, dtype=np.float64)
    low, high = y - height / 2, y + height / 2
    corners = np.stack([np.stack([left, low], -1), np.stack([left, high], -1),
                        np.stack([right, high], -1), np.stack([right, low], -1)], axis=1)
    bars = PolyCollection(list(corners), closed=True, label=label, **style)
    ax.add_collection(bars, autolim=False)
    return bars


def bar_extents(bars: PolyCollection) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left, width, y centre) of every rectangle of a collection made by `add_bars`."""
    paths = bars.get_paths()
    if not paths:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    corners = np.stack([np.asarray(path.vertices)[:4] for path in paths])
    left, right = corners[:, :, 0].min(axis=1), corners[:, :, 0].max(axis=1)
    centre = (corners[:, :, 1].min(axis=1) + corners[:, :, 1].max(axis=1)) / 2
    return left, right - left, centre


def bars_labelled(ax: Axes, label: str) -> list[PolyCollection]:
    """The bar collections of `ax` carrying `label` (e.g. "F", "idle")."""
    from matplotlib.collections import PolyCollection

    return [c for c in ax.collections if isinstance(c, PolyCollection) and c.get_label() == label]
