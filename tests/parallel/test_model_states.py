"""Model states at the distributed-optimizer level: bytes counted at the step, the main-gradient
buffer path equal to one process, and bucket reductions launched inside the last backward.

Byte counts are deterministic: live storages after one step against an oracle written here
from the layout's definition (and Megatron's per-parameter formulas within 5%)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineConfigError, PipelineEngine, PipelineModule, launch
from pipeline.parallel.model_state import count_model_states
from pipeline.runtime.interpreter import last_backwards
from schedules import Kind, build_schedule
from tests.support.engine3d_models import MODELS, OPTIMIZERS, Case, run_case
from tests.support.equivalence import gathered_weights

WIDTH = 32
BUCKET_MB = 2**-12
MEGATRON = {"fp32": (16.0, lambda d: 8 + 8 / d), "bf16": (18.0, lambda d: 6 + 12 / d),
            "fp16": (20.0, lambda d: 4 + 16 / d)}
"""Bytes per parameter with Adam, without / with Megatron's distributed optimizer."""


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def _stepped_pieces(sizes: list[int], buckets: int, piece: int, d: int, rank: int
                    ) -> tuple[int, int]:
    """(elements, tensors) Adam steps on `rank` under ZeRO-1: the parameters, laid end to end,
    meet the rank's piece [b·d·s + r·s, b·d·s + (r+1)·s) of each bucket b; each meeting is one
    tensor the user's groups step (padding belongs to none)."""
    elements = tensors = 0
    offset = 0
    for size in sizes:
        for b in range(buckets):
            start = b * d * piece + rank * piece
            overlap = min(offset + size, start + piece) - max(offset, start)
            if overlap > 0:
                elements += overlap
                tensors += 1
        offset += size
    return elements, tensors


def _expected_bytes(sizes: list[int], precision: str, zero: int, d: int, rank: int) -> int:
    """The oracle: bytes a rank must hold after a step whose stage has parameters of `sizes`
    elements, from the definitions (Adam: two fp32 moments and a 4-byte step per tensor it
    steps; ZeRO-1: one flat region of k equal buckets of d·s elements, each split d ways,
    k = ceil(n / B) for buckets of B = d·floor(bucket bytes / (gradient bytes · d))
    elements, s = ceil(n / (k·d)): a rank holds S = k·s elements of masters, and Adam steps
    the parameters' pieces of them, `_stepped_pieces`)."""
    n = sum(sizes)
    if zero == 0:  # fp32 parameters (autocast for bf16 / fp16), fp32 .grad, Adam
        return 4 * n + 4 * n + 8 * n + 4 * len(sizes)
    param_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}[precision]
    grad_bytes = 2 if precision == "fp16" else 4  # fp32 main gradients except fp16's
    buckets = math.ceil(n / (d * max(1, int(BUCKET_MB * 2**20) // (grad_bytes * d))))
    piece = math.ceil(n / (buckets * d))
    shard = buckets * piece
    stepped, tensors = _stepped_pieces(sizes, buckets, piece, d, rank)
    total = d * shard * (param_bytes + grad_bytes) + 8 * stepped + 4 * tensors  # + moments, steps
    if precision != "fp32":
        total += 4 * shard  # the fp32 master (a view of the parameters in fp32)
    if precision == "fp16":
        total += 4 * shard  # the fp32 copy of this rank's fp16 gradient shard
    return total


def _count_states() -> list[dict[str, Any]]:
    """On each of 4 ranks, for pp × dp = 4 × 1, 2 × 2, 1 × 4 and every precision × ZeRO
    stage: counted bytes after one step, and the oracle's."""
    torch.manual_seed(0)
    rows = []
    for pp in (4, 2, 1):
        for precision in ("fp32", "bf16", "fp16"):
            for zero in (0, 1):
                layers = [nn.Linear(WIDTH, WIDTH) for _ in range(4)]
                module = PipelineModule(layers, num_stages=pp, loss_fn=F.mse_loss)
                engine = PipelineEngine(module, optimizer=_adam, num_microbatches=pp,
                                        zero_stage=zero, precision=precision,
                                        half_parameters=zero == 1 and precision != "fp32",
                                        initial_loss_scale=2.0**4, bucket_mb=BUCKET_MB,
                                        timeout=60)
                engine.train_batch(torch.randn(4 * pp, WIDTH), torch.randn(4 * pp, WIDTH))
                counted = count_model_states(module, engine.optimizer)
                sizes = [p.numel() for p in module.parameters()]
                rows.append({"pp": pp, "d": engine.topology.dp, "precision": precision,
                             "zero": zero, "counted": counted.total,
                             "per_parameter": counted.per_parameter,
                             "expected": _expected_bytes(sizes, precision, zero,
                                                         engine.topology.dp,
                                                         engine.position.dp_rank),
                             "skipped": engine.last_step_skipped,
                             "grads_on_params": any(p.grad is not None
                                                    for p in module.parameters())})
                engine.stop_watchdog()
    return rows


@pytest.mark.multiprocess
def test_bytes_per_parameter_at_the_step_match_the_distributed_optimizer() -> None:
    results = launch(_count_states, 4, timeout=60, join_timeout=300)
    for rows in results:
        for row in rows:
            label = f"{row['precision']} ZeRO-{row['zero']} pp{row['pp']}×dp{row['d']}"
            assert not row["skipped"], label  # the step ran: Adam's state exists
            assert row["counted"] == row["expected"], label
            without, with_zero = MEGATRON[row["precision"]]
            if row["zero"] == 1:  # Megatron's 8 + 8/d, 6 + 12/d, 4 + 16/d within 5 %
                megatron = with_zero(row["d"])
                assert abs(row["per_parameter"] / megatron - 1) <= 0.05, (label, row)
                assert not row["grads_on_params"], label  # gradients live only in buffers
            else:  # autocast keeps fp32 parameters: 16, at most Megatron's 16 / 18 / 20
                assert row["per_parameter"] <= without * 1.05, (label, row)


BUFFER_CASES = [
    Case("interleaved pp2×dp2 ZeRO-1 +clip", "mlp",
         {"data_parallel": 2, "zero_stage": 1, "gradient_clipping": 0.05,
          "bucket_mb": 2**-10}, schedule="interleaved", chunks=2, optimizer="adam"),
    Case("interleaved pp2×dp2 overlapped all-reduce", "mlp",
         {"data_parallel": 2, "bucket_mb": 2**-10}, schedule="interleaved", chunks=2),
    Case("pp2×dp2 ZeRO-1 no overlap", "mlp",
         {"data_parallel": 2, "zero_stage": 1, "bucket_mb": 2**-10,
          "overlap_grad_reduce": False}, optimizer="adam"),
    Case("bf16 half params pp2×dp2 ZeRO-1", "mlp",
         {"data_parallel": 2, "zero_stage": 1, "precision": "bf16", "half_parameters": True,
          "bucket_mb": 2**-10}),
]


def _run_buffer_cases() -> list[dict[str, Any]]:
    return [run_case(case) for case in BUFFER_CASES]


@pytest.mark.multiprocess
def test_main_gradient_buffers_equal_one_process() -> None:
    for results in launch(_run_buffer_cases, 4, timeout=60, join_timeout=300):
        for result in results:
            name = result["case"]
            if name.startswith("bf16"):  # bf16 parameters: the stated bf16 tolerance
                assert result["loss"] < 2e-2 and result["param"] < 2e-2, result
                assert result["grad_relative"] < 2e-2, result
            else:
                assert result["loss"] < 2e-5 and result["grad"] < 2e-5, result
                assert result["param"] < 2e-5, result


class _Probe(nn.Module):
    """A first layer whose output gradient (the last gradient of a backward, but for its
    own weight's) records how many bucket reductions the reducer had launched by then."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.reducer: Any = None
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.scale
        y.register_hook(lambda grad: self.seen.append(self.reducer.stats.calls))
        return y


def _launch_order() -> dict[tuple[int, bool], list[int]]:
    seen = {}
    for zero in (0, 1):  # plain dp's all-reduce buckets, ZeRO-1's reduce-scatter buckets
        for overlap in (False, True):
            probe = _Probe()
            layers = [probe, *(nn.Linear(WIDTH, WIDTH) for _ in range(6))]
            module = PipelineModule(layers, num_stages=1, loss_fn=F.mse_loss)
            engine = PipelineEngine(module, optimizer=_adam, num_microbatches=2,
                                    zero_stage=zero, bucket_mb=2**-12,
                                    overlap_grad_reduce=overlap, timeout=60)
            probe.reducer = engine.gradient_reducer
            engine.train_batch(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
            seen[(zero, overlap)] = probe.seen
            engine.stop_watchdog()
    return seen


@pytest.mark.multiprocess
def test_bucket_reductions_launch_inside_the_last_backward() -> None:
    for seen in launch(_launch_order, 2, timeout=60, join_timeout=180):
        for zero in (0, 1):
            # microbatch 0's backward launches nothing either way (not final yet)
            assert seen[(zero, False)] == [0, 0] and seen[(zero, True)][0] == 0, seen
            # the last backward: the later layers' buckets are on the wire before it ends
            assert seen[(zero, True)][1] > 0, seen


def test_last_backwards_marks_each_stages_last_fused_backward() -> None:
    schedule = build_schedule("interleaved", 2, 4, chunks=2)
    for stream in schedule.streams:
        marked = last_backwards(stream)
        reduce_at = {op.stage: k for k, op in enumerate(stream)
                     if op.kind is Kind.REDUCE_GRAD}
        assert sorted(marked.values()) == sorted(reduce_at), stream  # one per stage
        for k, stage in marked.items():
            assert stream[k].kind is Kind.B and stream[k].stage == stage
            assert not any(op.stage == stage and op.kind is Kind.B
                           for op in stream[k + 1:reduce_at[stage]])
    split = build_schedule("zb-h1", 2, 4)  # every stage's last backward op is a W: left out
    assert all(last_backwards(stream) == {} for stream in split.streams)


def test_half_parameters_refused_where_autocast_is_leaner() -> None:
    module = PipelineModule([nn.Linear(4, 4)], num_stages=1)
    for options, wanted in (({"precision": "bf16"}, "needs zero_stage=1"),
                            ({"zero_stage": 1}, "precision='bf16'")):
        with pytest.raises(PipelineConfigError, match=wanted):
            PipelineEngine(module, half_parameters=True, **options)


def _half_checkpoint(root: str, resume: bool) -> dict[str, Any]:
    spec = MODELS["mlp"]
    module = PipelineModule(spec.layers(), num_stages=2, loss_fn=spec.loss, base_seed=7)
    engine = PipelineEngine(module, num_microbatches=4, optimizer=OPTIMIZERS["adam"],
                            data_parallel=2, zero_stage=1, precision="bf16",
                            half_parameters=True, timeout=60)
    if resume:
        engine.load_checkpoint(root)
    else:
        _train_steps(engine, 2)
        engine.save_checkpoint(root)
    losses = _train_steps(engine, 2)
    engine.stop_watchdog()
    return {"losses": losses, "weights": gathered_weights(engine)}


def _train_steps(engine: PipelineEngine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        inputs, targets = MODELS["mlp"].batch(engine.global_step, 16)
        mine = slice(8 * engine.position.dp_rank, 8 * engine.position.dp_rank + 8)
        losses.append(engine.train_batch(inputs[mine], targets[mine]))
    return losses


@pytest.mark.multiprocess
def test_half_parameters_checkpoint_resumes_exactly_with_its_fp32_masters(
        tmp_path: Path) -> None:
    # the bf16 parameters alone would round the masters: only the saved fp32 masters make the
    # resumed run take the same steps
    root = str(tmp_path)
    straight = launch(_half_checkpoint, 4, root, False, timeout=60, join_timeout=240)
    resumed = launch(_half_checkpoint, 4, root, True, timeout=60, join_timeout=240)
    assert resumed[0]["losses"] == straight[0]["losses"]
    for key, value in straight[0]["weights"].items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(resumed[0]["weights"][key], value), key
