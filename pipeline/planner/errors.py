"""The planner's one error type: a request it cannot plan, with what would fit."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A model, cluster or batch the planner cannot use; the message names the value and
    what would work instead (e.g. the smallest device memory that fits)."""
