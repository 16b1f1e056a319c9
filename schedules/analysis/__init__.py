"""Read a schedule: dataflow, validation, simulation, timelines, memory and host costs."""

__all__: list[str] = []
