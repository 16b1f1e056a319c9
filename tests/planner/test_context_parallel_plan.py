"""`pipesched plan` searching context parallelism: a 128k-token pick, refusals, the accounting."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.planner import PlanConfig, SearchOptions, load_model, plan, resolve_cluster
from pipeline.planner.pricing import allgather_seconds
from pipeline.planner.report import gap_parts
from pipeline.planner.search import _context, price

__all__: list[str] = []

LLAMA_70B_128K = ("layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,"
                  "seq=131072,mlp=swiglu,norm=rmsnorm,bias=none")
GQA = ("layers=8,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=1024,mlp=swiglu,"
       "norm=rmsnorm,bias=none")


def test_128k_llama_70b_on_64_h100_picks_cp_for_memory(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    assert main(["plan", "--model", LLAMA_70B_128K, "--cluster", "h100-80g", "--nodes", "8",
                 "--global-batch", "16", "--context-parallel", "8", "--sequence-parallel",
                 "--pp", "1,2,4", "--microbatch-size", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    pick = re.search(r"^pick: (.*?)  \(", out, re.M)
    assert pick is not None, out
    cp = re.search(r" cp(\d+) ", pick.group(1) + " ")
    assert cp is not None and int(cp.group(1)) > 1, pick.group(1)
    assert f"why cp{cp.group(1)}: memory: no configuration without context parallelism " \
           f"fits" in out
    assert f"context_parallel={cp.group(1)}" in out  # the engine's argument


@pytest.mark.parametrize("argv, words", [
    (["--cp", "3"], "2·cp = 6 to divide the sequence 131072"),
    (["--cp", "2", "--engine", "deepspeed"], "outside"),
])
def test_a_cp_the_engine_cannot_run_is_refused_in_one_line(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", LLAMA_70B_128K, "--cluster", "h100-80g", "--nodes", "8",
                 "--global-batch", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("pipesched plan: error:") \
        and err.count("\n") == 1, err


def test_cp_divides_the_activations_and_prices_the_kv_collectives() -> None:
    model = load_model(GQA, precision="bf16")
    cluster = resolve_cluster("h100-80g", nodes=1)
    context = _context(model, cluster, 8, None, SearchOptions())
    for recompute in ("none", "selective", "full"):
        one, two = (context.table(PlanConfig(
            pp=2, tp=2, dp=4 // cp, cp=cp, schedule="1f1b", chunks=1, microbatch_size=1,
            num_microbatches=8 // (4 // cp), zero_stage=0, recompute=recompute))
            for cp in (1, 2))
        # the definition: every activation is of the rank's S / cp tokens; the gathered K/V
        # (4 blocks a stage, 2 · 1024 tokens · (4 heads · 64) · 2 bytes (bf16) / tp 2) are
        # gathered again in the backward, not kept
        np.testing.assert_allclose(two.held, one.held / 2, rtol=1e-12)
        np.testing.assert_allclose(two.cp_bytes[:, 0], 4 * 2 * 1024 * (4 * 64) * 2 / 2)
        np.testing.assert_allclose(two.workspace, one.workspace / 2, rtol=1e-12)
    config = PlanConfig(pp=2, tp=2, dp=1, cp=2, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=8, zero_stage=0, recompute="none")
    prediction = price(model, cluster, 8, config)
    breakdown = prediction.breakdown
    # per microbatch and block: an all-gather of K/V forward, and backward the all-gather
    # again and a reduce-scatter of their gradients, each moving half of 2·1024·256·2 / 2
    # bytes over NVLink (cp 2): NCCL's pick for it on the preset
    one = allgather_seconds(2 * 1024 * 256 * 2 / 2, 2, 2, cluster)
    assert breakdown["cp_comm"] == pytest.approx(8 * 4 * 3 * one, rel=1e-9)
    assert sum(breakdown.values()) == pytest.approx(prediction.step_seconds, rel=1e-9)


def test_a_hf_model_picked_with_cp_prints_the_context_parallel_entry(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `pipesched run` has no cp: the pick is printed as the Python entry with
    # context_parallel_hf and PipelineEngine(context_parallel=), and --json leaves out the
    # run arguments that would drop it
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False}))
    argv = ["plan", "--model", str(tmp_path), "--cluster", "h100-80g", "--global-batch", "8",
            "--cp", "2", "--top", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hf = context_parallel_hf(hf)" in out and "context_parallel=2" in out, out
    assert "pipeline.cli run" not in out
    assert main([*argv, "--json"]) == 0
    pick = json.loads(capsys.readouterr().out)["pick"]
    assert pick["config"]["cp"] == 2 and "run_arguments" not in pick


def test_why_slower_parts_sum_to_the_gap_with_and_without_cp() -> None:
    model = load_model(GQA, precision="bf16")
    cluster = resolve_cluster("h100-80g", nodes=1)
    result = plan(model, cluster, 8, options=SearchOptions(context_parallel=(1, 2, 4),
                                                           top=20, max_chunks=2))
    cps = {p.config.cp for p in result.predictions}
    assert cps >= {1, 2}, cps
    for loser in result.predictions:
        gap = loser.step_seconds - result.best.step_seconds
        assert sum(gap_parts(loser, result.best).values()) == pytest.approx(gap, abs=1e-12)


def test_price_names_a_cp_and_prices_it_as_the_search(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    argv = ["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8", "--json"]
    assert main([*argv, "--price", "pp2,tp2,cp2,1f1b,b1"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["config"]["cp"] == 2 and priced["config"]["dp"] == 1
    assert priced["breakdown"]["cp_comm"] > 0
    assert main([*argv, "--cp", "2", "--pp", "2", "--tp", "2", "--microbatch-size", "1",
                 "--schedules", "1f1b", "--recompute", "none", "--zero", "0"]) == 0
    searched = json.loads(capsys.readouterr().out)["pick"]
    assert searched["config"]["label"] == priced["config"]["label"]
    assert searched["step_seconds"] == priced["step_seconds"]
