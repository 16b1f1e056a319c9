"""Clusters the planner plans for: a typed spec, the presets, and a JSON reader (data only:
`pipeline.planner.resolve` turns a CLUSTER argument into one, `local` included)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from pipeline.planner.errors import PlanError
from pipeline.planner.input_files import read_input_json

__all__ = ["NCCL_ARCHS", "PRESETS", "ClusterSpec", "cluster_from_json"]

GIB = 2**30
NCCL_ARCHS = ("ampere", "hopper")
"""GPU architectures whose NCCL tuning tables `nccl_model` holds."""


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
    sm_count: int = 0
    """Streaming multiprocessors: the kernel model's tiles run in waves of this many
    (`pipeline.planner.kernels`); 0 prices layers at `achieved_fraction` of the peak."""
    gemm_efficiency: float = 0.85
    """Share of its peak an SM reaches on a full GEMM tile (cuBLAS on large shapes)."""
    memory_efficiency: float = 0.85
    """Share of `memory_bandwidth` that streaming element-wise kernels reach."""
    kernel_overhead: float = 0.0
    """Seconds every kernel costs whatever its size (launch, ramp-up, tail)."""
    host_op_seconds: float = 0.0
    """Host seconds to issue one op (an eager PyTorch kernel launch or collective call): a
    layer pass on the kernel model takes the longer of its device time and its ops' host
    time (`pipeline.planner.host_launch`); 0: off (a CUDA-graphed step). The presets:
    `host_launch.HOST_OP_SECONDS`."""
    nics_per_node: int = 0
    """Network cards per node for traffic between nodes; 0: `inter_bandwidth` as given."""
    nic_bandwidth: float = 0.0
    """Bytes/s one way of each network card."""
    link_efficiency: float = 1.0
    """Share of a link's bandwidth a collective reaches (bus bandwidth / the link's) where
    collectives are priced α–β: every collective when `nccl_arch` is empty (`local`, a
    profiled device, a cluster file without it); with NCCL's model only what it does not
    price (the MoE all-to-all)."""
    nccl_arch: str = ""
    """"ampere" or "hopper": all-reduce, reduce-scatter, all-gather and point-to-point
    messages priced by NCCL's own cost model with that architecture's tables
    (`pipeline.planner.nccl_model`); "": α–β at `link_efficiency` of the link."""
    gemm_epilogue_serial: bool = False
    """The device's GEMM kernels store each output tile after its k-loop, the SM idle
    meanwhile (Ampere's CUTLASS 2.x / cuBLAS kernels; `kernels.epilogue_seconds`); False:
    the store overlaps the next tile's k-loop (Hopper's warp-specialised kernels)."""
    gemm_measurements: tuple[tuple[int, int, int, float], ...] = ()
    """Measured (m, n, k, seconds) GEMMs of `pipesched profile-device`: when given, a GEMM
    is priced at the FLOP/s of the nearest measured shape instead of the tile model."""
    compute_capability: int = 0
    """CUDA compute capability, major × 10 + minor (80 A100, 90 H100): sizes torch's cuBLAS
    workspace (`runtime_memory`); 0: no CUDA runtime (the CPU `local` cluster), no
    workspaces or NCCL buffers priced."""
    nvlink_links: int = 0
    """NVLink links per GPU (A100 12, H100 18): NCCL opens 2 channels per link to a peer in
    the node, each with its buffers (`runtime_memory.nccl_channels`); 0: PCIe, 2 channels."""
    memory_margin: float = 0.0
    """Bytes per device kept free besides what the planner prices: the CUDA context and the
    allocator's fragmentation, for which no source gives a figure (`plan --memory-margin`)."""

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
        for name in ("sm_count", "nics_per_node", "compute_capability", "nvlink_links"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                problems.append(f"{name}={value!r} must be a whole number >= 0")
        for name in ("kernel_overhead", "nic_bandwidth", "memory_margin", "host_op_seconds"):
            if not _non_negative(getattr(self, name)):
                problems.append(f"{name}={getattr(self, name)!r} must be a number >= 0")
        for name in ("gemm_efficiency", "memory_efficiency", "link_efficiency"):
            value = getattr(self, name)
            if not _positive(value) or value > 1:
                problems.append(f"{name}={value!r} must be in (0, 1]")
        if self.nccl_arch not in ("", *NCCL_ARCHS):
            problems.append(f"nccl_arch={self.nccl_arch!r} must be one of "
                            f"{', '.join(NCCL_ARCHS)} or \"\" (collectives priced α–β)")
        if not isinstance(self.gemm_epilogue_serial, bool):
            problems.append(f"gemm_epilogue_serial={self.gemm_epilogue_serial!r} must be "
                            f"true or false")
        if not isinstance(self.gemm_measurements, tuple) or not all(
                isinstance(row, tuple) and len(row) == 4 and all(_positive(x) for x in row)
                for row in self.gemm_measurements):
            problems.append("gemm_measurements must be (m, n, k, seconds) rows of numbers > 0")
        if not _positive(self.achieved_fraction) or self.achieved_fraction > 1:
            problems.append(f"achieved_fraction={self.achieved_fraction!r} must be in (0, 1]")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops or not all(
                _positive(value) for value in self.peak_flops.values()):
            problems.append(f"peak_flops={self.peak_flops!r} must map precisions such as "
                            f"'bf16' to FLOP/s > 0")
        elif self.precision not in self.peak_flops:
            problems.append(f"precision={self.precision!r} has no peak_flops entry; give one "
                            f"of {sorted(self.peak_flops)}")
        if _non_negative(self.memory_margin) and _positive(self.device_memory) \
                and self.memory_margin >= self.device_memory:
            problems.append(f"memory_margin={self.memory_margin!r} must be below "
                            f"device_memory={self.device_memory!r}")
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

    @property
    def device_inter_bandwidth(self) -> float:
        """Bytes/s one way a device has to other nodes: its share of the node's network
        cards when they are given, else `inter_bandwidth`."""
        if self.nics_per_node and self.nic_bandwidth:
            return self.nics_per_node * self.nic_bandwidth / self.devices_per_node
        return self.inter_bandwidth

    def link(self, group_span: int) -> tuple[float, float]:
        """(bandwidth, latency) of a group whose members lie `group_span` ranks apart in the
        rank order at most: inside a node when the span fits in one, else between nodes;
        bandwidth as a collective reaches it (`link_efficiency`)."""
        if group_span <= self.devices_per_node:
            return self.intra_bandwidth * self.link_efficiency, self.intra_latency
        return self.device_inter_bandwidth * self.link_efficiency, self.inter_latency


def _positive(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value > 0)


def _non_negative(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value >= 0)


# Vendor datasheet figures (dense, no sparsity); NVLink is quoted as a two-way total, so one
# direction is half. InfiniBand NICs for compute traffic: 8 a node (one per GPU).
# - A100 80GB SXM: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TFLOPS, FP32
#   19.5, HBM2e 2,039 GB/s, NVLink 600 GB/s; 108 SMs (NVIDIA A100 Tensor Core GPU
#   Architecture whitepaper, 2020). DGX A100 datasheet: 8 × 200 Gb/s HDR InfiniBand.
# - H100 80GB SXM5: NVIDIA H100 Tensor Core GPU datasheet (2023): BF16 989 TFLOPS dense, FP32
#   67, HBM3 3.35 TB/s, NVLink 900 GB/s; 132 SMs (NVIDIA H100 Tensor Core GPU Architecture
#   whitepaper, 2022). DGX H100 datasheet: 8 × 400 Gb/s ConnectX-7.
# - A800 80GB SXM: NVIDIA A800 Tensor Core GPU datasheet (2022): the A100's chip (312 TFLOPS,
#   2,039 GB/s) with NVLink cut to 400 GB/s (200 one way); 8 × 200 Gb/s NICs assumed as DGX A100.
# - Memory: the total the CUDA runtime reports for each, which is what an allocator can have
#   (torch's out-of-memory messages: A100 80GB "79.35 GiB total capacity", H100 80GB "a
#   total capacity of 79.11 GiB", A800 80GB "79.33 GiB"; nvidia-smi lists 81,920 MiB and
#   81,559 MiB, of which the driver keeps the rest). NCCL's buffers and torch's cuBLAS
#   workspaces come out of it and are priced per configuration from their sources
#   (`runtime_memory.runtime_bytes`: compute capability 8.0 / 9.0; NVLink links 12 on the
#   A100, 18 on the H100, 8 on the A800, whose NVLink is cut to 400 GB/s); the CUDA context
#   and the allocator's fragmentation beyond its rounding have no source figure and are
#   left to `memory_margin` (`plan --memory-margin GIB`; 0 in the presets).
# Efficiencies: element-wise kernels 0.85 of HBM bandwidth, the all-to-all 0.8 of the link
# (`link_efficiency`; the other collectives and P2P by NCCL's own model, `nccl_arch`, whose
# NVLink rating is 20.0 / 20.6 GB/s of a link's 25), 4 µs a kernel: each a device
# figure, though set in the pass that first compared with Table 1, and not refitted by its
# leave-one-out (benchmarks/term_sensitivity.py shows what each moves). The one constant
# fitted to runs is the share of an SM's peak a full 256 × 128 GEMM tile's k-loop reaches,
# fitted to Narayanan et al. 2021 (Megatron-LM, SC'21, Table 1; leave-one-out error in
# benchmarks/table1_loo.py): 0.7225 on the A100s, whose kernels store each output tile after
# its k-loop (`gemm_epilogue_serial`, `kernels.epilogue_seconds`). The H100 keeps 0.70, the
# value fitted to the same table before that term (its warp-specialised kernels overlap the
# store, so the term does not apply there and nothing was refitted for it).
# achieved_fraction prices layers without a shape. Host: 10 µs to issue an op of an eager
# PyTorch step (`host_launch.HOST_OP_SECONDS`, cited there; a pass takes the longer of its
# device and host time), not fitted.
_A100 = {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}
_DEVICE_MODEL: dict[str, Any] = {
    "gemm_efficiency": 0.70, "memory_efficiency": 0.85, "link_efficiency": 0.8,
    "kernel_overhead": 4e-6, "host_op_seconds": 10e-6}
_AMPERE_GEMMS: dict[str, Any] = {"gemm_efficiency": 0.7225, "gemm_epilogue_serial": True}
PRESETS: dict[str, ClusterSpec] = {
    "a100-80g": ClusterSpec(
        name="a100-80g", nodes=1, devices_per_node=8, device_memory=79.35 * GIB,
        peak_flops=_A100, achieved_fraction=0.5, intra_bandwidth=300e9, intra_latency=5e-6,
        inter_bandwidth=25e9, inter_latency=10e-6, memory_bandwidth=2.039e12,
        op_overhead=20e-6, sm_count=108, nics_per_node=8, nic_bandwidth=25e9,
        nccl_arch="ampere", compute_capability=80, nvlink_links=12,
        **(_DEVICE_MODEL | _AMPERE_GEMMS)),
    "h100-80g": ClusterSpec(
        name="h100-80g", nodes=1, devices_per_node=8, device_memory=79.11 * GIB,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, achieved_fraction=0.5,
        intra_bandwidth=450e9, intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6,
        memory_bandwidth=3.35e12, op_overhead=20e-6, sm_count=132, nics_per_node=8,
        nic_bandwidth=50e9, nccl_arch="hopper", compute_capability=90, nvlink_links=18,
        **_DEVICE_MODEL),
    "a800-80g": ClusterSpec(
        name="a800-80g", nodes=1, devices_per_node=8, device_memory=79.33 * GIB,
        peak_flops=_A100, achieved_fraction=0.5, intra_bandwidth=200e9, intra_latency=5e-6,
        inter_bandwidth=25e9, inter_latency=10e-6, memory_bandwidth=2.039e12,
        op_overhead=20e-6, sm_count=108, nics_per_node=8, nic_bandwidth=25e9,
        nccl_arch="ampere", compute_capability=80, nvlink_links=8,
        **(_DEVICE_MODEL | _AMPERE_GEMMS)),
}
_TEXT_KEYS = {"name", "peak_flops", "precision", "nccl_arch"}
_NUMBER_KEYS = {f.name for f in fields(ClusterSpec)} - _TEXT_KEYS
_OPTIONAL_KEYS = {f.name for f in fields(ClusterSpec) if f.default is not MISSING
                  or f.default_factory is not MISSING}


def cluster_from_json(source: str | os.PathLike[str] | Mapping[str, Any]) -> ClusterSpec:
    """A cluster from a JSON file (or parsed mapping) with `ClusterSpec`'s field names; a
    `"preset"` key starts from a preset and overrides its fields."""
    if isinstance(source, Mapping):
        document: Any = source
    else:

        document = read_input_json(source, "cluster file")
    if not isinstance(document, Mapping):
        raise PlanError(f"cluster JSON must be an object, got {type(document).__name__}")
    values = dict(document)
    base = values.pop("preset", None)
    known = _NUMBER_KEYS | _TEXT_KEYS
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlanError(f"cluster JSON has unknown keys {unknown}; the keys are {sorted(known)}")
    if base is not None:
        if base not in PRESETS:
            raise PlanError(f"cluster JSON names unknown preset {base!r}; presets: "
                            f"{', '.join([*PRESETS, 'local'])}")
        return replace(PRESETS[base], **_tuples(values))
    missing = sorted(known - _OPTIONAL_KEYS - {"name"} - set(values))
    if missing:
        raise PlanError(f"cluster JSON lacks {missing} (or start from a preset with "
                        f"\"preset\": \"a100-80g\")")
    values.setdefault("name", "custom")
    return ClusterSpec(**_tuples(values))


def _tuples(values: dict[str, Any]) -> dict[str, Any]:
    """JSON lists of `gemm_measurements` rows as the tuples the spec holds."""
    rows = values.get("gemm_measurements")
    if isinstance(rows, list):
        values["gemm_measurements"] = tuple(tuple(row) if isinstance(row, list) else row
                                            for row in rows)
    return values
