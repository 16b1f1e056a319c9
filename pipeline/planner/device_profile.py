"""The device profile file: GEMM and collective timings of a real device, written by
`pipesched profile-device` and read by `pipesched plan --device-profile`, replacing the
kernel model's tile roofline and the cluster's link figures with measurements."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError

__all__ = ["FORMAT", "apply_device_profile", "read_device_profile", "write_device_profile"]

FORMAT = "pipesched-device-profile/1"


def write_device_profile(path: str | os.PathLike[str], profile: dict[str, Any]) -> None:
    """Write `profile` (device, precision, gemms [[m, n, k, seconds]], memory_bandwidth,
    host_op_seconds, collectives {latency, allreduce_bandwidth}) as the file
    `read_device_profile` reads."""
    with open(path, "w") as handle:
        json.dump({"format": FORMAT, **profile}, handle, indent=1)


def read_device_profile(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The profile in `path`, checked: every figure a finite number > 0."""
    try:
        with open(path) as handle:
            document = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise PlanError(f"device profile {os.fspath(path)!r}: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PlanError(f"device profile {os.fspath(path)!r} is not a {FORMAT} file (write "
                        f"one with pipesched profile-device)")
    gemms = document.get("gemms")
    collectives = document.get("collectives")
    numbers = [document.get("memory_bandwidth")]
    if "host_op_seconds" in document:
        numbers.append(document["host_op_seconds"])
    if isinstance(collectives, dict):
        numbers += [collectives.get("latency"), collectives.get("allreduce_bandwidth")]
    elif collectives is not None:
        numbers.append(None)
    if isinstance(gemms, list) and gemms:
        numbers += [x for row in gemms if isinstance(row, list) and len(row) == 4 for x in row]
    good = (isinstance(gemms, list) and gemms and isinstance(collectives, dict | None)
            and all(isinstance(row, list) and len(row) == 4 for row in gemms)
            and all(not isinstance(x, bool) and isinstance(x, int | float) and 0 < x < 1e300
                    for x in numbers))
    if not good:
        raise PlanError(f"device profile {os.fspath(path)!r}: needs gemms [[m, n, k, "
                        f"seconds], ...] and memory_bandwidth (and optionally collectives "
                        f"{{latency, allreduce_bandwidth}} and host_op_seconds), all numbers "
                        f"> 0")
    return document


def apply_device_profile(cluster: ClusterSpec, path: str | os.PathLike[str]) -> ClusterSpec:
    """`cluster` priced from the measurements in `path`: GEMMs at the nearest measured
    shape's FLOP/s, element-wise work at the measured memory bandwidth, collectives inside
    a node at the measured all-reduce bandwidth and latency (the figures are what was
    reached, so the efficiencies become 1, and collectives are priced α–β on them, not by
    NCCL's model: `nccl_arch` ""); the host's seconds per eager op where measured."""
    document = read_device_profile(path)
    cluster = replace(cluster,
                      gemm_measurements=tuple(tuple(row) for row in document["gemms"]),
                      memory_bandwidth=float(document["memory_bandwidth"]),
                      memory_efficiency=1.0,
                      host_op_seconds=float(document.get("host_op_seconds",
                                                         cluster.host_op_seconds)))
    collectives = document.get("collectives")
    if collectives is None:
        return cluster
    return replace(cluster, intra_bandwidth=float(collectives["allreduce_bandwidth"]),
                   intra_latency=float(collectives["latency"]), link_efficiency=1.0,
                   nccl_arch="")
