"""The partition result as plain data, with a readable table and a JSON-ready dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partition.boundaries import stage_of, validate_boundaries
from partition.errors import InvalidOptionError
from partition.methods import Method

__all__ = ["Partition", "format_bytes", "format_seconds"]


def format_seconds(seconds: float, unit: str | None = None) -> str:
    """Seconds in s, ms or us (picked from the value unless ``unit`` is given)."""
    if unit is None:
        unit = "s" if seconds >= 1 else "ms" if seconds >= 1e-3 else "us"
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    return f"{seconds * scale:.3f} {unit}"


def format_bytes(size: float) -> str:
    """Bytes with a binary unit (B, KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@dataclass(frozen=True)
class Partition:
    """p contiguous stages of n layers and what each stage costs.

    Stage k holds layers ``boundaries[k]`` to ``boundaries[k + 1] - 1``. Times are seconds
    per microbatch (forward + backward, divided by the stage's speed), communication is the
    time to send and receive the tensors crossing the stage's cuts, memory is bytes.
    """

    boundaries: tuple[int, ...]
    """p + 1 cut indices into the layer order: first 0, last n."""
    compute: tuple[float, ...]
    """Per-stage compute seconds."""
    comm: tuple[float, ...]
    """Per-stage communication seconds (receive + send across cuts)."""
    memory: tuple[float, ...]
    """Per-stage memory bytes: parameters, optimizer state, extra, held activations."""
    method: Method = Method.BALANCED
    """The method that chose the boundaries."""
    layer_names: tuple[str, ...] = ()
    """Layer names in order, for the table (may be empty)."""
    memory_cap: float | None = None
    """The per-stage memory cap the partition respects, if any."""

    def __post_init__(self) -> None:
        p = len(self.boundaries) - 1
        if p < 1:
            raise InvalidOptionError(f"boundaries {self.boundaries} describe no stage")
        validate_boundaries(self.boundaries, self.boundaries[-1], p)
        lengths = {len(self.compute), len(self.comm), len(self.memory)}
        if lengths != {p}:
            raise InvalidOptionError(
                f"compute, comm and memory need {p} entries each (one per stage), "
                f"got {len(self.compute)}, {len(self.comm)}, {len(self.memory)}"
            )
        if self.layer_names and len(self.layer_names) != self.num_layers:
            raise InvalidOptionError(
                f"layer_names has {len(self.layer_names)} entries for {self.num_layers} layers"
            )

    @property
    def num_stages(self) -> int:
        """p, the number of stages."""
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        """n, the number of layers."""
        return self.boundaries[-1]

    @property
    def cost(self) -> tuple[float, ...]:
        """Per-stage time: compute + comm."""
        return tuple(c + m for c, m in zip(self.compute, self.comm, strict=True))

    @property
    def bottleneck(self) -> float:
        """The slowest stage's time, which bounds the pipeline's throughput."""
        return max(self.cost)

    @property
    def bottleneck_stage(self) -> int:
        """The (first) stage whose time is the bottleneck."""
        costs = self.cost
        return costs.index(max(costs))

    @property
    def imbalance(self) -> float:
        """bottleneck / mean stage time; 1.0 is perfect balance."""
        mean = sum(self.cost) / self.num_stages
        return self.bottleneck / mean if mean > 0 else 1.0

    def stage_of(self, layer_index: int) -> int:
        """The stage holding layer ``layer_index``."""
        return stage_of(self.boundaries, layer_index)

    def layers_of(self, stage: int) -> range:
        """The layer indices of stage ``stage``."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain data: boundaries, bottleneck, per-stage cost and its parts."""
        stages = []
        for stage in range(self.num_stages):
            start, stop = self.boundaries[stage], self.boundaries[stage + 1]
            entry: dict[str, Any] = {"stage": stage, "start": start, "stop": stop}
            if self.layer_names:
                entry["first"] = self.layer_names[start]
                entry["last"] = self.layer_names[stop - 1]
            entry.update(
                compute=self.compute[stage],
                comm=self.comm[stage],
                cost=self.cost[stage],
                memory=self.memory[stage],
            )
            stages.append(entry)
        return {
            "method": self.method.value,
            "num_layers": self.num_layers,
            "num_stages": self.num_stages,
            "boundaries": list(self.boundaries),
            "bottleneck": self.bottleneck,
            "bottleneck_stage": self.bottleneck_stage,
            "imbalance": self.imbalance,
            "cost": list(self.cost),
            "memory_cap": self.memory_cap,
            "stages": stages,
        }

    def format_table(self) -> str:
        """A fixed-width table, one row per stage, the bottleneck stage marked with '*'."""
        peak = max(max(self.cost), 0.0)
        unit = "s" if peak >= 1 else "ms" if peak >= 1e-3 else "us"
        header = ["stage", "layers", "first .. last", "compute", "comm", "cost", "memory"]
        rows = []
        for stage in range(self.num_stages):
            start, stop = self.boundaries[stage], self.boundaries[stage + 1]
            names = (
                f"{self.layer_names[start]} .. {self.layer_names[stop - 1]}"
                if self.layer_names
                else ""
            )
            mark = "*" if stage == self.bottleneck_stage else " "
            rows.append(
                [
                    f"{stage}{mark}",
                    f"{start}-{stop - 1} ({stop - start})",
                    names if len(names) <= 40 else names[:37] + "...",
                    format_seconds(self.compute[stage], unit),
                    format_seconds(self.comm[stage], unit),
                    format_seconds(self.cost[stage], unit),
                    format_bytes(self.memory[stage]),
                ]
            )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        left = {1, 2}

        def line(cells: list[str]) -> str:
            return "  ".join(
                cell.ljust(width) if i in left else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ).rstrip()

        cap = "" if self.memory_cap is None else f", memory cap {format_bytes(self.memory_cap)}"
        title = (
            f"{self.method.value} partition: {self.num_layers} layers into "
            f"{self.num_stages} stages{cap}"
        )
        footer = (
            f"bottleneck {format_seconds(self.bottleneck, unit)} (stage "
            f"{self.bottleneck_stage}), imbalance {self.imbalance:.3f} (bottleneck / mean)"
        )
        return "\n".join([title, line(header), *(line(row) for row in rows), footer])

    def __str__(self) -> str:
        return self.format_table()
