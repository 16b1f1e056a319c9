"""A schedule as data: instructions, the `Schedule` value, size limits, errors, the error grid."""

__all__: list[str] = []
