"""Passes over compute streams: lowering (send/recv, reduction, step) and backward fusion."""

__all__: list[str] = []
