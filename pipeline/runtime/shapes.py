"""Activation layouts learnt from shape headers, once per distinct batch signature.

A step whose batch signature differs from the previous step's is a learning step: every
forward message carries a header. Afterwards each stage edge whose messages all had one
layout is cached (no headers); an edge whose layout varied within the step stays dynamic
(headers on every message). Sender and receiver see the same headers, so they decide alike.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeline.runtime.batch import Layout

__all__ = ["ShapeBook"]


class ShapeBook:
    """Per edge (keyed by the receiving stage): the cached layout or a dynamic mark."""

    def __init__(self, always_dynamic: bool = False) -> None:
        self.always_dynamic = always_dynamic
        self.layouts: dict[int, Layout] = {}
        self.dynamic: set[int] = set()
        self.learning = True
        self._seen: dict[int, set[Layout]] = {}
        self._signature: int | None = None

    def begin_step(self, signature: int) -> None:
        """Start a step whose batch has `signature` (equal on every rank)."""
        self.learning = signature != self._signature
        self._signature = signature
        if self.learning:
            self.layouts.clear()
            self.dynamic.clear()
            self._seen.clear()

    def end_step(self) -> None:
        """Cache what a learning step saw."""
        if not self.learning:
            return
        for stage, metas in self._seen.items():
            if len(metas) == 1:
                self.layouts[stage] = next(iter(metas))
            else:
                self.dynamic.add(stage)
        self._seen.clear()
        self.learning = False

    def abandon_step(self) -> None:
        """Forget a step that failed half-way: the next one learns again."""
        self._signature = None

    def _with_header(self, stage: int) -> bool:
        return self.always_dynamic or self.learning or stage in self.dynamic

    def cached(self, stage: int) -> bool:
        """Whether the next message into `stage` comes without a header (its layout is
        known before it arrives)."""
        return not self._with_header(stage)

    def sending(self, stage: int, meta: Layout) -> Layout | None:
        """The header to send with a message into `stage` (None when the layout is cached)."""
        if not self._with_header(stage):
            return None
        if self.learning:
            self._seen.setdefault(stage, set()).add(meta)
        return meta

    def receiving(self, stage: int, read_header: Callable[[], Layout]) -> Layout:
        """The layout of the next message into `stage`: from its header, or the cache."""
        if not self._with_header(stage):
            return self.layouts[stage]
        meta = read_header()
        if self.learning:
            self._seen.setdefault(stage, set()).add(meta)
        return meta
