"""Clusters the planner plans for: a typed spec, the presets, and a JSON reader."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from pipeline.planner.errors import PlanError

__all__ = ["PRESETS", "ClusterSpec", "cluster_from_json", "resolve_cluster"]

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Devices and links. Bandwidths are bytes/s one way per device; latencies seconds."""

    name: str
    nodes: int
    """Machines."""
    devices_per_node: int
    """Accelerators (or, for `local`, CPU ranks) per machine."""
    device_memory: float
    """Bytes of memory per device."""
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per precision ('bf16', 'fp16', 'fp32')."""
    achieved_fraction: float
    """Share of the peak a transformer layer's matmuls reach (model FLOPs utilisation)."""
    intra_bandwidth: float
    """Device-to-device bytes/s inside a node (NVLink; one direction)."""
    intra_latency: float
    inter_bandwidth: float
    """Bytes/s per device between nodes (its share of the node's NICs)."""
    inter_latency: float
    memory_bandwidth: float
    """Bytes/s of the device's own memory: bounds the optimizer step, which streams the
    parameters, gradients and Adam moments once."""
    op_overhead: float = 0.0
    """Fixed seconds per stage op (F, I, W) and per optimizer step whatever the batch: the
    runtime's dispatch, kernel launches, message headers."""
    precision: str = "bf16"
    """Precision the planner assumes unless told otherwise."""

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)!r} must be a whole number >= 1"
                    for name in ("nodes", "devices_per_node")
                    if isinstance(getattr(self, name), bool)
                    or not isinstance(getattr(self, name), int) or getattr(self, name) < 1]
        for name in ("device_memory", "intra_bandwidth", "inter_bandwidth", "memory_bandwidth"):
            if not _positive(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be a number > 0")
        for name in ("intra_latency", "inter_latency", "op_overhead"):
            if not _non_negative(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be a number >= 0")
        if not _positive(self.achieved_fraction) or self.achieved_fraction > 1:
            problems.append(f"achieved_fraction={self.achieved_fraction!r} must be in (0, 1]")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops or not all(
                _positive(value) for value in self.peak_flops.values()):
            problems.append(f"peak_flops={self.peak_flops!r} must map precisions such as "
                            f"'bf16' to FLOP/s > 0")
        elif self.precision not in self.peak_flops:
            problems.append(f"precision={self.precision!r} has no peak_flops entry; give one "
                            f"of {sorted(self.peak_flops)}")
        if problems:
            raise PlanError(f"cluster {self.name!r}: " + "; ".join(problems))

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def flops(self, precision: str) -> float:
        """Achieved FLOP/s of one device in `precision`."""
        if precision not in self.peak_flops:
            raise PlanError(f"cluster {self.name!r} gives no peak FLOP/s for precision "
                            f"{precision!r}; it has {sorted(self.peak_flops)}")
        return self.peak_flops[precision] * self.achieved_fraction

    def link(self, group_span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose members lie `group_span` ranks apart in the
        rank order at most: inside a node when the span fits in one, else between nodes."""
        if group_span <= self.devices_per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency


def _positive(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value > 0)


def _non_negative(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value >= 0)


# Vendor datasheet figures (dense, no sparsity). NVLink is quoted as a two-way total, so one
# direction is half; InfiniBand is 200 or 400 Gb/s per NIC with one NIC per GPU (8 per node).
# achieved_fraction 0.5: Narayanan et al. 2021 (Megatron-LM, SC'21) report 44-52% of peak on
# A100s for GPT models of 1-1000B parameters.
PRESETS: dict[str, ClusterSpec] = {
    "a100-80g": ClusterSpec(
        name="a100-80g", nodes=1, devices_per_node=8, device_memory=80 * GIB,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, achieved_fraction=0.5,
        intra_bandwidth=300e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
        memory_bandwidth=2.0e12, op_overhead=20e-6),
    "h100-80g": ClusterSpec(
        name="h100-80g", nodes=1, devices_per_node=8, device_memory=80 * GIB,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, achieved_fraction=0.5,
        intra_bandwidth=450e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
        memory_bandwidth=3.35e12, op_overhead=20e-6),
    "a800-80g": ClusterSpec(
        name="a800-80g", nodes=1, devices_per_node=8, device_memory=80 * GIB,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, achieved_fraction=0.5,
        intra_bandwidth=200e9, intra_latency=5e-6, inter_bandwidth=25e9, inter_latency=10e-6,
        memory_bandwidth=2.0e12, op_overhead=20e-6),
}
_NUMBER_KEYS = {f.name for f in fields(ClusterSpec)} - {"name", "peak_flops", "precision"}


def cluster_from_json(source: str | os.PathLike[str] | Mapping[str, Any]) -> ClusterSpec:
    """A cluster from a JSON file (or parsed mapping) with `ClusterSpec`'s field names; a
    `"preset"` key starts from a preset and overrides its fields."""
    if isinstance(source, Mapping):
        document: Any = source
    else:
        from pipeline.planner.load import read_input_json  # load imports this module

        document = read_input_json(source, "cluster file")
    if not isinstance(document, Mapping):
        raise PlanError(f"cluster JSON must be an object, got {type(document).__name__}")
    values = dict(document)
    base = values.pop("preset", None)
    known = _NUMBER_KEYS | {"name", "peak_flops", "precision"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlanError(f"cluster JSON has unknown keys {unknown}; the keys are {sorted(known)}")
    if base is not None:
        if base not in PRESETS:
            raise PlanError(f"cluster JSON names unknown preset {base!r}; presets: "
                            f"{', '.join([*PRESETS, 'local'])}")
        return replace(PRESETS[base], **values)
    missing = sorted(known - {"op_overhead", "precision", "name"} - set(values))
    if missing:
        raise PlanError(f"cluster JSON lacks {missing} (or start from a preset with "
                        f"\"preset\": \"a100-80g\")")
    values.setdefault("name", "custom")
    return ClusterSpec(**values)


def resolve_cluster(text: str, *, nodes: int | None = None) -> ClusterSpec:
    """A preset name, or a JSON file path; `nodes` overrides the node count. `local` is
    calibrated by `pipeline.planner.calibrate` (imports torch), so it is resolved there."""
    if text == "local":
        from pipeline.planner.calibrate import calibrate_local

        spec = calibrate_local()
    elif text in PRESETS:
        spec = PRESETS[text]
    elif text.endswith(".json") or os.path.exists(text):
        if not os.path.exists(text):
            raise PlanError(f"cluster file {text!r} does not exist")
        spec = cluster_from_json(text)
    else:
        raise PlanError(f"unknown cluster {text!r}; use a preset ({', '.join(PRESETS)}, "
                        f"local) or a JSON file")
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise PlanError(f"nodes={nodes!r} must be a whole number >= 1")
        spec = replace(spec, nodes=nodes)
    return spec
