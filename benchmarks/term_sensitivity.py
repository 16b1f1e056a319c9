"""How much each first-principles efficiency term moves a dense 70B and an MoE prediction
(issue 48's sensitivity table): the step of a fixed configuration priced with the term and
with it switched off, under `--engine megatron-core` on H100s. Terms so far: the SMs
Transformer Engine's overlap kernels take from the GEMMs beside them
(`pipeline.planner.userbuffers`).

    PYTHONPATH=. python benchmarks/term_sensitivity.py
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from unittest import mock

import pipeline.planner.pricing as pricing
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model
from pipeline.planner.engines import engine_options
from pipeline.planner.search import price

__all__ = ["CASES", "TERMS", "sensitivity_lines"]

LLAMA_70B = ("layers=80,hidden=8192,heads=64,kv_heads=8,vocab=128256,seq=4096,mlp=swiglu,"
             "norm=rmsnorm,bias=none,learned_positions=false,ffn=28672,dropout=false")
MIXTRAL_8X22B = ("layers=56,hidden=6144,heads=48,kv_heads=8,vocab=32768,seq=4096,mlp=swiglu,"
                 "norm=rmsnorm,bias=none,learned_positions=false,ffn=16384,experts=8,topk=2,"
                 "expert_ffn=16384,dropout=false")
CASES: tuple[tuple[str, str, int, int, PlanConfig], ...] = (
    ("Llama-3-70B shape, 128 H100", LLAMA_70B, 16, 512,
     PlanConfig(pp=4, tp=4, dp=8, schedule="interleaved", chunks=4, microbatch_size=1,
                num_microbatches=64, zero_stage=1, recompute="none")),
    ("Mixtral-8x22B shape, 128 H100", MIXTRAL_8X22B, 16, 256,
     PlanConfig(pp=8, tp=4, dp=4, schedule="1f1b", chunks=1, microbatch_size=1,
                num_microbatches=64, zero_stage=1, recompute="none", ep=2)),
)
"""(name, model, nodes, global batch, configuration): the configurations the planner picks
for them today (`docs/planner.md`)."""


@contextmanager
def _no_userbuffers_sms() -> Iterator[None]:
    with mock.patch.object(pricing, "userbuffers_sms", lambda index: (0, 0, 0)):
        yield


TERMS: tuple[tuple[str, Callable[[], AbstractContextManager[None]]], ...] = (
    ("userbuffers SMs beside the GEMMs", _no_userbuffers_sms),
)
"""(term, a context manager that switches it off)."""


def _step(model: str, nodes: int, batch: int, config: PlanConfig) -> float:
    options = SearchOptions(**engine_options("megatron-core"))
    profile = load_model(model, sequence_parallel=True)
    cluster = replace(PRESETS["h100-80g"], nodes=nodes)
    return price(profile, cluster, batch, config, options=options).step_seconds


def sensitivity_lines() -> list[str]:
    lines = ["| term | case | step with | step without | moved |", "|---|---|---:|---:|---:|"]
    for term, off in TERMS:
        for name, model, nodes, batch, config in CASES:
            with_term = _step(model, nodes, batch, config)
            with off():
                without = _step(model, nodes, batch, config)
            lines.append(f"| {term} | {name}, {config.label()} | {with_term:.2f} s | "
                         f"{without:.2f} s | {with_term / without - 1:+.1%} |")
    return lines


if __name__ == "__main__":
    print("\n".join(sensitivity_lines()))
