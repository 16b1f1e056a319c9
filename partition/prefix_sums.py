"""Per-stage prefix sums stored once: each stage's array is a weighted sum of shared prefixes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LinearPrefix"]


@dataclass(frozen=True)
class LinearPrefix:
    """X_k = sum_j coefficients[k, j] * bases[j] for stage k.

    Stage compute is (1 / speed_k) * P and stage memory is 1 * S + inflight_k * A, so p
    stage arrays cost a few shared prefixes instead of p copies of length n + 1. Bases are
    non-decreasing and coefficients non-negative, so every X_k is non-decreasing, also in
    floating point (scaling by a constant and adding are monotone). Every entry is computed
    by the same expression whichever slice asks, so values agree bit for bit.
    """

    bases: tuple[np.ndarray, ...]
    coefficients: np.ndarray
    """Shape (p, len(bases))."""

    @property
    def num_stages(self) -> int:
        """How many stages (rows of coefficients)."""
        return int(self.coefficients.shape[0])

    @property
    def length(self) -> int:
        """n + 1, the number of cut positions."""
        return len(self.bases[0])

    def window(self, stage: int, start: int, stop: int) -> np.ndarray:
        """X_k[start:stop]."""
        row = self.coefficients[stage]
        total = row[0] * self.bases[0][start:stop]
        for coefficient, base in zip(row[1:], self.bases[1:], strict=True):
            total = total + coefficient * base[start:stop]
        return np.asarray(total, dtype=np.float64)

    def at(self, stage: int, index: int) -> float:
        """X_k[index], by the same expression as `window` (float64 multiply and add round
        the same in Python as in numpy, so the value is bit-identical)."""
        row = self.coefficients[stage]
        total = float(row[0]) * float(self.bases[0][index])
        for coefficient, base in zip(row[1:], self.bases[1:], strict=True):
            total = total + float(coefficient) * float(base[index])
        return total

    def full(self, stage: int) -> np.ndarray:
        """X_k over all cut positions 0..n."""
        return self.window(stage, 0, self.length)

    def stage_independent(self) -> bool:
        """True when every stage has the same coefficients (one array serves all)."""
        return bool(np.all(self.coefficients == self.coefficients[0]))
