"""Cost-aware schedules by search: list schedulers, greedies, zb-auto, zb-v-auto, zb-optimal."""

__all__: list[str] = []
