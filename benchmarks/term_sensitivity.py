"""How much each first-principles efficiency term moves a dense 70B and an MoE prediction
(issue 48's sensitivity table): the step of a fixed configuration priced with the term and
with it switched off (`--engine megatron-core` on H100s), an SC'21 Table 1 run
(`--engine megatron-2021` on A100s) beside them, the one case where Ampere-only terms act,
and a DeepSeek-V3-shaped one whose ep group spans nodes (where the dispatcher acts).

    PYTHONPATH=. python benchmarks/term_sensitivity.py
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any
from unittest import mock

import pipeline.planner.expert_kernels as expert_kernels
import pipeline.planner.expert_parallel as expert_parallel
import pipeline.planner.pricing as pricing
import pipeline.planner.roofline as roofline
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model
from pipeline.planner.engines import engine_options
from pipeline.planner.search import price

__all__ = ["CASES", "TERMS", "sensitivity_lines"]

LLAMA_70B = ("layers=80,hidden=8192,heads=64,kv_heads=8,vocab=128256,seq=4096,mlp=swiglu,"
             "norm=rmsnorm,bias=none,learned_positions=false,ffn=28672,dropout=false")
MIXTRAL_8X22B = ("layers=56,hidden=6144,heads=48,kv_heads=8,vocab=32768,seq=4096,mlp=swiglu,"
                 "norm=rmsnorm,bias=none,learned_positions=false,ffn=16384,experts=8,topk=2,"
                 "expert_ffn=16384,dropout=false")
CORE_CASES: tuple[tuple[str, str, int, int, PlanConfig], ...] = (
    ("Llama-3-70B shape, 128 H100", LLAMA_70B, 16, 512,
     PlanConfig(pp=4, tp=4, dp=8, schedule="interleaved", chunks=4, microbatch_size=1,
                num_microbatches=64, zero_stage=1, recompute="none")),
    ("Mixtral-8x22B shape, 128 H100", MIXTRAL_8X22B, 16, 256,
     PlanConfig(pp=8, tp=4, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                num_microbatches=64, zero_stage=1, recompute="none", ep=2)),
)
"""(name, model, nodes, global batch, configuration), under megatron-core on `h100-80g`: the
70B's pick (`docs/planner.md`), and Mixtral-8x22B's tp4 × ep2 layout it was trained with
(issue 43), the pick until the MoE compute model (`expert_kernels`), now 0.8 % behind it."""
DEEPSEEK_V3_SHAPED = ("layers=60,hidden=7168,heads=128,vocab=129280,seq=4096,mlp=swiglu,"
                      "norm=rmsnorm,bias=none,learned_positions=false,ffn=18432,dropout=false,"
                      "experts=256,topk=8,expert_ffn=2048,shared_ffn=2048,dense_layers=0;1;2,"
                      "expert_groups=8,topk_groups=4,q_lora_rank=1536,kv_lora_rank=512,"
                      "qk_nope_head_dim=128,qk_rope_head_dim=64,v_head_dim=128")
"""DeepSeek-V3's config.json: its MoE (256 routed experts of 2048, top-8 from 4 of 8 groups,
one shared expert, the first 3 blocks dense of 18432), hidden size and multi-head latent
attention (128 heads, query latent 1536, key/value latent 512, head dims 128 + 64 rotary, 128
values: `latent_attention`), with 60 blocks for its 61 (Megatron-Core splits them evenly over
pp)."""
DEEPEP_CASE = ("DeepSeek-V3 shape (60 blocks), 1024 H100, deepep", DEEPSEEK_V3_SHAPED, 128,
               2048, PlanConfig(pp=4, tp=2, dp=128, schedule="1f1b", chunks=1,
                                microbatch_size=1, num_microbatches=16, zero_stage=1,
                                recompute="none", ep=64))
"""A fixed layout (not a search's pick) whose ep group of 64 spans 16 nodes, priced with
`--moe-dispatcher deepep`: one copy of a token per destination node (`node_limited`)."""
TABLE_1_ROW = 6
"""SC'21 Table 1's 145.6B run (t8 p8 b2 v2 on 1,536 A100s), `bench_published.ROWS`."""


def _core_step(model: str, nodes: int, batch: int, config: PlanConfig,
               dispatcher: str = "alltoall") -> float:
    options = SearchOptions(**engine_options("megatron-core", moe_dispatcher=dispatcher))
    profile = load_model(model, sequence_parallel=True)
    cluster = replace(PRESETS["h100-80g"], nodes=nodes)
    return price(profile, cluster, batch, config, options=options).step_seconds


def _table_1_step() -> float:
    from benchmarks.bench_published import MEGATRON_2021, ROWS, _model

    row = ROWS[TABLE_1_ROW]
    cluster = replace(PRESETS["a100-80g"], nodes=row.gpus // 8)
    return price(_model(row), cluster, row.batch, row.config(), precision="fp16",
                 options=SearchOptions(**MEGATRON_2021)).step_seconds


def _cases() -> list[tuple[str, Callable[[], float]]]:
    cases: list[tuple[str, Callable[[], float]]] = [
        (f"{name}, {config.label()}",
         lambda m=model, n=nodes, b=batch, c=config: _core_step(m, n, b, c))
        for name, model, nodes, batch, config in CORE_CASES]
    name, model, nodes, batch, config = DEEPEP_CASE
    return [*cases, ("SC'21 145.6B, 1536 A100, pp8 tp8 b2 v2 (megatron-2021)", _table_1_step),
            (f"{name}, {config.label()}",
             lambda: _core_step(model, nodes, batch, config, dispatcher="deepep"))]


CASES = tuple(name for name, _ in _cases())


@contextmanager
def _no_userbuffers_sms() -> Iterator[None]:
    with mock.patch.object(pricing, "userbuffers_sms", lambda index: (0, 0, 0)):
        yield


@contextmanager
def _no_tile_quantization() -> Iterator[None]:
    """One-element tiles at full share: a GEMM at its FLOPs over the fitted SM rate, no
    partial tiles, no partial last wave, no smaller tiles' lower reuse."""
    with mock.patch.object(roofline, "_TILES", ((1, 1, 1.0),)):
        yield


@contextmanager
def _per_expert_dispatch() -> Iterator[None]:
    """Every token sent once per (token, expert) pair whatever the dispatcher."""
    with mock.patch.object(expert_parallel, "off_node_scale", lambda *_, **__: 1.0):
        yield
def _zero_times(*_: Any) -> tuple[float, float, float]:
    return 0.0, 0.0, 0.0


def _moe_patch(name: str, value: Any) -> Callable[[], AbstractContextManager[Any]]:
    return lambda: mock.patch.object(expert_kernels, name, value)


def _experts_as_one_gemm(shape: Any, batch: int, tp: int, cluster: Any, precision: str
                         ) -> tuple[float, ...]:
    """The busiest rank's L rows through one GEMM pair of an expert's width (one launch,
    one tile grid: the local experts' own quantization off), the shared expert as before."""
    routed = shape.routed
    rows = math.ceil(expert_kernels.routed_rows(shape, batch, tp))
    one = expert_kernels._mlp(rows, routed.expert_ffn, shape, cluster, precision)
    shared = expert_kernels._mlp(expert_kernels.rank_tokens(shape, batch, tp),
                                 routed.shared_ffn, shape, cluster, precision) \
        if routed.shared_ffn else (0.0, 0.0, 0.0)
    return tuple(a + b for a, b in zip(one, shared, strict=True))


def _presets_with(**fields: Any) -> Callable[[], AbstractContextManager[object]]:
    def switch() -> AbstractContextManager[object]:
        return mock.patch.dict(PRESETS, {name: replace(PRESETS[name], **fields)
                                         for name in ("a100-80g", "h100-80g")})
    return switch


TERMS: tuple[tuple[str, Callable[[], AbstractContextManager[Any]]], ...] = (
    ("userbuffers SMs beside the GEMMs (`userbuffers.sm_contention_seconds`)",
     _no_userbuffers_sms),
    ("GEMM epilogue after the k-loop, Ampere (`kernels.epilogue_seconds`)",
     _presets_with(gemm_epilogue_serial=False)),
    ("GEMM tile shapes and wave quantization (`roofline._TILES`)", _no_tile_quantization),
    ("kernel launch, 4 µs a kernel (`kernel_overhead`)", _presets_with(kernel_overhead=0.0)),
    ("runtime cost, 20 µs a stage op (`op_overhead`)", _presets_with(op_overhead=0.0)),
    ("host issue, 10 µs an op, a pass max(device, host) (`host_launch`, `host_op_seconds`)",
     _presets_with(host_op_seconds=0.0)),
    ("element-wise kernels at 0.85 of HBM (`memory_efficiency`)",
     _presets_with(memory_efficiency=1.0)),
    ("all-to-all at 0.8 of the link (`link_efficiency`)", _presets_with(link_efficiency=1.0)),
    ("NCCL's collective model, against α–β at 0.8 of the link (`nccl_model`)",
     _presets_with(nccl_arch="")),
    ("one copy per node under node-limited routing, deepep (`node_limited.off_node_scale`; "
     "off: per expert)", _per_expert_dispatch),
    ("MoE: one GEMM per local expert (`expert_kernels.expert_gemm_times`)",
     _moe_patch("expert_gemm_times", _experts_as_one_gemm)),
    ("MoE: busiest ep rank, sampling floor (`routing_load.busiest_rank_ratio`)",
     _moe_patch("rank_load_ratio", lambda routed, tokens, tp: 1.0)),
    ("MoE: token permutations (`expert_kernels.permutation_times`)",
     _moe_patch("permutation_times", _zero_times)),
    ("MoE: router logits, top-k, scores (`expert_kernels.router_times`)",
     _moe_patch("router_times", _zero_times)),
)
"""(term, a context manager that switches it off)."""


def sensitivity_lines() -> list[str]:
    lines = ["| term | case | step with | step without | moved |", "|---|---|---:|---:|---:|"]
    cases = _cases()
    base = [step() for _, step in cases]
    for term, off in TERMS:
        for (name, step), with_term in zip(cases, base, strict=True):
            with off():
                without = step()
            lines.append(f"| {term} | {name} | {with_term:.2f} s | {without:.2f} s | "
                         f"{with_term / without - 1:+.1%} |")
    return lines


if __name__ == "__main__":
    print("\n".join(sensitivity_lines()))
