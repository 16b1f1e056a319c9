"""Measure this machine (the `local` cluster) and profile a model's layers, with torch,
imported only here and only when called."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError
from pipeline.planner.profile import LayerProfile, ModelProfile

__all__ = ["calibrate_local", "host_op_seconds", "matmul_flops", "measure_links", "profile_device",
           "profile_layers"]

_SMALL, _LARGE = 8, 4 * 2**20  # bytes of the latency and bandwidth probes


def _least_seconds(run: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` timed runs after a warm-up: on a shared machine, the run
    least disturbed by other processes (timeit's advice)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_links(repeats: int = 10) -> dict[str, float]:
    """On every rank of a 2-rank gloo job: P2P latency and bandwidth (ping-pong), all-reduce
    bandwidth, and the engine's fixed cost per op (a 2-stage pipeline of tiny layers).
    Returns rank 0's figures (seconds, bytes/s)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from pipeline.model.layers import LayerSpec
    from pipeline.model.module import PipelineModule
    from pipeline.parallel.local_p2p import open_local_link
    from pipeline.parallel.pingpong import round_trip
    from pipeline.runtime.engine import PipelineEngine

    rank = dist.get_rank()
    local = open_local_link(None, 60.0)  # small messages take the engine's own transport

    def ping_pong(size: int) -> float:
        buffer = torch.zeros(size // 4)
        return _least_seconds(lambda: round_trip(buffer, 1 - rank, rank == 0, link=local),
                              repeats) / 2

    latency = ping_pong(_SMALL)
    p2p = _LARGE / max(ping_pong(_LARGE) - latency, 1e-9)
    if local is not None:
        local.close()
    large = torch.zeros(_LARGE // 4)
    reduce_seconds = _least_seconds(lambda: dist.all_reduce(large), repeats)
    # ring all-reduce on d = 2: (2(d-1)/d) · n / bw + 2(d-1) · latency
    allreduce = _LARGE / max(reduce_seconds - 2 * latency, 1e-9)
    m = 8
    module = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4)],
                            num_stages=2, loss_fn=F.mse_loss, partition_method="uniform")
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=m,
                            optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
    inputs, targets = torch.randn(m, 4), torch.randn(m, 4)
    step = _least_seconds(lambda: engine.train_batch(inputs, targets), repeats)
    # a 2-stage 1F1B step is (m + p - 1) F and as many B on the critical path: 2(m + 1) ops
    return {"latency": latency, "p2p_bandwidth": p2p, "allreduce_bandwidth": allreduce,
            "op_overhead": step / (2 * (m + 1))}


def matmul_flops() -> float:
    """FLOP/s of a 256 × 512 by 512 × 512 fp32 matmul on this process's threads (the fastest
    of 20): the `local` cluster's peak, and `pipesched run`'s peak on a CPU."""
    import torch

    a, b = torch.randn(256, 512), torch.randn(512, 512)
    return 2 * 256 * 512 * 512 / _least_seconds(lambda: a @ b, 20)


def calibrate_local(*, ranks: int | None = None) -> ClusterSpec:
    """This machine as a one-node cluster of `ranks` CPU ranks (default: its cores), fp32:
    a matmul's FLOP/s on one thread, Adam's memory traffic, and gloo links measured by a
    2-rank job. Takes a few seconds."""
    import torch

    from pipeline.launcher.processes import launch

    cores = ranks or os.cpu_count() or 1
    torch.set_num_threads(1)  # the ranks run one thread each
    flops = matmul_flops()
    params = [torch.nn.Parameter(torch.randn(2**20))]
    params[0].grad = torch.randn(2**20)
    adam = torch.optim.Adam(params, lr=1e-3)
    memory_bandwidth = 7 * 4 * 2**20 / _least_seconds(adam.step, 5)
    links = launch(measure_links, 2, timeout=120.0, threads_per_rank=1)[0]
    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    return ClusterSpec(
        name="local", nodes=1, devices_per_node=cores,
        device_memory=page * pages / cores, peak_flops={"fp32": flops}, achieved_fraction=1.0,
        intra_bandwidth=min(links["p2p_bandwidth"], links["allreduce_bandwidth"]),
        intra_latency=links["latency"], inter_bandwidth=links["allreduce_bandwidth"],
        inter_latency=links["latency"], memory_bandwidth=memory_bandwidth,
        op_overhead=links["op_overhead"], precision="fp32")


def profile_layers(layers: Sequence[Any], sample: Callable[[int], Any], *,
                   batches: tuple[int, int] = (1, 8), repeats: int = 5, rounds: int = 1,
                   name: str = "profiled", seq: int = 1) -> ModelProfile:
    """Profile built layers (modules, or `LayerSpec`s built here) as a `ModelProfile`:
    forward and backward seconds at two microbatch sizes fitted to fixed + per-sample
    (the partitioner's profiler, `partition.graph_from_layers`), and the bytes each layer
    saves for its backward, counted by `torch.autograd.graph.saved_tensors_hooks`
    (storages counted once, the layer's input included; parameters excluded).
    `sample(b)` returns the first layer's input for b samples. With `rounds` > 1 each time
    is the least of that many profiles (medians of `repeats`): on a shared machine the
    least disturbed by other processes."""
    from partition import graph_from_layers

    if len(set(batches)) != 2 or min(batches) < 1:
        raise PlanError(f"batches={batches!r} must be two different sizes >= 1")
    modules = [layer.build() if hasattr(layer, "build") else layer for layer in layers]
    graphs = [[graph_from_layers(modules, sample(b), repeats=repeats) for _ in range(rounds)]
              for b in batches]
    held = [_saved_bytes(modules, sample(b)) for b in batches]
    split = [_split_seconds(modules, sample(b), max(rounds * repeats, 3)) for b in batches]
    small, large = batches
    profiles: list[LayerProfile] = []
    for index, module in enumerate(modules):
        at_small, at_large = (_least([graph.layers[index] for graph in runs])
                              for runs in graphs)

        def slope(low: float, high: float) -> float:
            return max(0.0, (high - low) / (large - small))

        forward_slope = slope(at_small.forward, at_large.forward)
        backward_slope = slope(at_small.backward, at_large.backward)
        output = at_large.activation / large
        split_slopes = tuple(slope(split[0][index][k], split[1][index][k]) for k in (0, 1))
        split_fixed = tuple(max(0.0, split[0][index][k] - split_slopes[k] * small)
                            for k in (0, 1))
        profiles.append(LayerProfile(
            name=at_large.name, params_replicated=sum(p.numel() for p in module.parameters()),
            held_replicated=max(0.0, held[1][index] / large), output_bytes=output,
            input_bytes=profiles[-1].output_bytes if profiles else 0.0,
            forward_seconds=forward_slope, backward_seconds=backward_slope,
            forward_fixed=max(0.0, at_small.forward - forward_slope * small),
            backward_fixed=max(0.0, at_small.backward - backward_slope * small),
            split_seconds=(split_slopes[0], split_slopes[1]),
            split_fixed=(split_fixed[0], split_fixed[1])))
    return ModelProfile(tuple(profiles), name=name, seq=seq)


def _least(costs: Sequence[Any]) -> Any:
    """The layer cost with the least forward and the least backward of several profiles."""
    from dataclasses import replace

    return replace(costs[0], forward=min(cost.forward for cost in costs),
                   backward=min(cost.backward for cost in costs))


def _split_seconds(modules: Sequence[Any], inputs: Any, repeats: int
                   ) -> list[tuple[float, float]]:
    """Per layer, the fastest of `repeats` timings of a split backward as the engine runs it
    (pipeline/runtime/split_backward.py): I, the gradient of the layer's input, then W, the
    layer's output gradient taken back to its parameters alone."""
    import torch

    results = []
    value = inputs
    for module in modules:
        params = [p for p in module.parameters() if p.requires_grad]
        best = [math.inf, math.inf]
        for _ in range(repeats):
            x = value.detach().requires_grad_(True) if value.is_floating_point() else value
            out = module(x)
            seed = torch.ones_like(out)
            start = time.perf_counter()
            if x.requires_grad:
                torch.autograd.grad(out, x, seed, retain_graph=True)
            middle = time.perf_counter()
            if params:
                torch.autograd.backward(out, seed, inputs=params)
            end = time.perf_counter()
            best = [min(best[0], middle - start), min(best[1], end - middle)]
        for param in params:
            param.grad = None
        results.append((best[0], best[1]))
        value = out.detach()
    return results


def _saved_bytes(modules: Sequence[Any], inputs: Any) -> list[float]:
    """Bytes each layer's forward saves for the backward on `inputs`."""
    import torch

    results = []
    value = inputs
    for module in modules:
        counted = {p.untyped_storage().data_ptr(): 0 for p in module.parameters()}

        def pack(tensor: torch.Tensor, counted: dict[int, int] = counted) -> torch.Tensor:
            storage = tensor.untyped_storage()
            counted.setdefault(storage.data_ptr(), storage.nbytes())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = value.detach().requires_grad_(True)
            value = module(value)
        results.append(float(sum(counted.values())))  # parameters were entered as 0
    return results


def _time_collectives(sizes: Sequence[int], repeats: int) -> dict[str, float]:
    """On every rank of a gloo (or NCCL) job: all-reduce seconds of each size in bytes;
    latency from the smallest, bandwidth (bus bandwidth, 2(d-1)/d of the bytes per link)
    from the largest. Returns rank 0's figures."""
    import torch
    import torch.distributed as dist

    from pipeline.device import default_device, synchronize

    device = default_device()
    world = dist.get_world_size()
    seconds = []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), device=device)

        def reduce(buffer: torch.Tensor = buffer) -> None:
            dist.all_reduce(buffer)
            synchronize(device)

        seconds.append(_least_seconds(reduce, repeats))
    latency = seconds[0] / max(1, 2 * (world - 1))
    traffic = 2 * (world - 1) / world * sizes[-1]
    return {"latency": latency,
            "allreduce_bandwidth": traffic / max(seconds[-1] - seconds[0], 1e-9),
            "ranks": float(world)}


def host_op_seconds(device: Any, ops: int = 200, repeats: int = 3) -> float:
    """Host seconds per op of an eager autograd step on `device` (`ClusterSpec.
    host_op_seconds`): a chain of `ops` tiny element-wise ops run forward with autograd
    recording and backward (one node and one kernel each), issued without waiting, over its
    2·ops ops; the fastest of `repeats`. On a GPU the 8-element kernels finish before the host
    issues the next, so the wall time is the host's; on a CPU each op also runs its (tiny)
    kernel."""
    import torch

    from pipeline.device import synchronize

    leaf = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        value = leaf
        for _ in range(ops):
            value = value * 1.0
        value.sum().backward()
        synchronize(device)

    return max(_least_seconds(chain, repeats) / (2 * ops), 1e-9)


def profile_device(*, gemm_sizes: Sequence[int] = (64, 256, 1024), repeats: int = 3,
                   ranks: int = 2, collective_sizes: Sequence[int] = (8, 2**20),
                   precision: str = "fp32") -> dict[str, Any]:
    """Time a grid of GEMM shapes (every m, n, k in `gemm_sizes`), a streaming copy and the
    host's time per eager op (`host_op_seconds`) on this process's device, and all-reduces
    over `ranks` local ranks (none when 1): the content of a device profile
    (`pipeline.planner.device_profile`)."""
    import torch

    from pipeline.device import default_device, synchronize
    from pipeline.launcher.processes import launch

    device = default_device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the planner's CPU ranks run
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    gemms = []
    for m in gemm_sizes:
        for n in gemm_sizes:
            for k in gemm_sizes:
                a = torch.randn(m, k, device=device, dtype=dtype)
                b = torch.randn(k, n, device=device, dtype=dtype)

                def multiply(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
                    torch.mm(a, b)
                    synchronize(device)

                seconds = _least_seconds(multiply, repeats)
                gemms.append([m, n, k, max(seconds, 1e-9)])
    source = torch.zeros(2**22, device=device)
    target = torch.empty_like(source)

    def stream() -> None:
        target.copy_(source)
        synchronize(device)

    copy = _least_seconds(stream, repeats)
    profile: dict[str, Any] = {
        "device": str(device), "precision": precision, "gemms": gemms,
        "memory_bandwidth": 2 * source.numel() * 4 / max(copy, 1e-9),
        "host_op_seconds": host_op_seconds(device, repeats=repeats)}
    if ranks > 1:
        profile["collectives"] = launch(_time_collectives, ranks, list(collective_sizes),
                                        repeats, timeout=120.0)[0]
    return profile
