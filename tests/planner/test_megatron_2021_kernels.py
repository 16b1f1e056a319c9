"""Megatron-LM 2021's model as its code ran it (issue 33, Table 1's 1.7B row): the element-wise
passes its block and its fp32 cross entropy run besides this engine's, and its
--checkpoint-activations recomputing the blocks only. Each checked against the passes listed
here from that code (commit f32a638d2d), not against the planner's own sums."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, parse_shape, transformer_profile
from pipeline.planner.engines import ENGINES
from pipeline.planner.host_launch import host_pass_seconds, issue_bound_seconds
from pipeline.planner.kernels import LayerShape, layer_kernel_times
from pipeline.planner.memory import recompute_workspace, stage_activation_bytes
from pipeline.planner.profile import LayerProfile
from pipeline.planner.search import price
from pipeline.planner.stages import StageTable

__all__: list[str] = []

A100 = PRESETS["a100-80g"]
E = 2  # fp16
S, H, A, V, F = 2048, 2304, 24, 51200, 4 * 2304  # Table 1's 1.7B row


def _shape(role: str, engine: str) -> LayerShape:
    return LayerShape(role, S, H, A, H, F, V, E, attention="eager",  # type: ignore[arg-type]
                      engine=engine)  # type: ignore[arg-type]


def _passes(nbytes: float, kernels: int) -> float:
    """Memory-bound kernels moving `nbytes`, at the preset's HBM rate, each launched once."""
    return nbytes / (A100.memory_bandwidth * A100.memory_efficiency) \
        + kernels * A100.kernel_overhead


@pytest.mark.parametrize(("batch", "tp"), [(16, 1), (2, 4)])
def test_the_block_adds_the_passes_megatron_2021_runs(batch: int, tp: int) -> None:
    tokens = batch * S
    qkv, q, f = 3 * H // tp, H // tp, F // tp
    # model/transformer.py: QKV bias added after the 3-D matmul (read, write); the
    # context's permute(...).contiguous() (read, write)
    forward = [2 * qkv, 2 * q]
    # the QKV bias gradient (read); torch.split's backward, a cat (read, write); baddbmm's
    # backward scaling dQ and dK by alpha (read, write each); GeLUFunction's bias gradient
    # (read); both bias-dropout-adds' expand_as backward (read each, replicated); apex's
    # LayerNorm backward reading input and gradient once more, two norms (replicated)
    backward = [qkv, 2 * qkv, 2 * q, 2 * q, f, H, H, 2 * H, 2 * H]
    old = layer_kernel_times(_shape("block", "pipesched"), batch, tp, A100, "fp16")
    new = layer_kernel_times(_shape("block", "megatron-2021"), batch, tp, A100, "fp16")
    assert new.forward - old.forward == pytest.approx(
        _passes(tokens * sum(forward) * E, len(forward)), rel=1e-9)
    assert new.input_grad - old.input_grad == pytest.approx(
        _passes(tokens * sum(backward) * E, 7), rel=1e-9)
    assert new.weight_grad == old.weight_grad  # the GEMMs are the same


@pytest.mark.parametrize(("batch", "tp"), [(16, 1), (1, 8)])
def test_the_loss_runs_megatron_2021s_fp32_cross_entropy(batch: int, tp: int) -> None:
    logits = batch * S * math.ceil(V / tp)
    # output.float() (read e, write 4), max (read), sub_ (read, write), exp (read, write),
    # sum (read), div_ (read, write); backward: mul_ (read, write), the cast back (read 4,
    # write e)
    forward = [E + 4, 4, 8, 8, 4, 8]
    backward = [8, 4 + E]
    old = layer_kernel_times(_shape("head", "pipesched"), batch, tp, A100, "fp16")
    new = layer_kernel_times(_shape("head", "megatron-2021"), batch, tp, A100, "fp16")
    # this engine's loss: one read and write of the fp32 logits each way (2 and 1 kernels)
    assert new.forward - old.forward == pytest.approx(
        _passes(logits * sum(forward), 6) - _passes(logits * 8, 2), rel=1e-9)
    assert new.input_grad - old.input_grad == pytest.approx(
        _passes(logits * sum(backward), 2) - _passes(logits * 8, 1), rel=1e-9)


def _table(engine: str) -> StageTable:
    shape = parse_shape({"layers": 4, "hidden": 512, "heads": 8, "vocab": 32000, "seq": 512,
                         "tied_embeddings": True})
    model = transformer_profile(shape, "fp16", attention="eager", engine=engine)
    return StageTable.build(model.layers, (0, 3, 6), A100, "fp16", 1, "full")


def _forward(layer: LayerProfile, batch: int) -> float:
    """A forward pass of `layer` on one rank: the longer of its kernels' device time and the
    host's time to issue them (`host_launch`; this model's embedding and head are small)."""
    assert layer.shape is not None
    device = layer_kernel_times(layer.shape, batch, 1, A100, "fp16").forward
    return issue_bound_seconds(device,
                               host_pass_seconds(layer, batch, 1, A100, "fp16").forward)


def test_its_recomputation_reruns_the_blocks_only() -> None:
    megatron, ours = _table("megatron-2021"), _table("pipesched")
    batch = 2
    for table in (megatron, ours):
        assert [layer.name for layer in table.stages[0]] == ["embedding", "block0", "block1"]
        assert table.stages[1][-1].name == "head"
    # ParallelTransformer._checkpointed_forward wraps its blocks; the embedding, the final
    # norm, the logits and the loss run once
    for stage, blocks in ((0, (1, 2)), (1, (0, 1))):
        layers = megatron.stages[stage]
        rerun = sum(_forward(layers[i], batch) for i in blocks)
        assert megatron.costs(batch).recompute[stage] == pytest.approx(
            rerun + A100.op_overhead, rel=1e-9)
        # this engine recomputes every layer of the stage, the embedding or head included
        every = sum(_forward(layer, batch) for layer in ours.stages[stage])
        assert ours.costs(batch).recompute[stage] == pytest.approx(
            every + A100.op_overhead, rel=1e-9)


def test_what_it_does_not_recompute_it_keeps() -> None:
    model = _table("megatron-2021").stages[1]  # block2, block3, head
    head = model[-1]
    assert not head.checkpointed
    # the blocks keep their input; the head all it holds, and drops nothing to rebuild
    kept = sum(layer.input_bytes for layer in model[:-1]) + head.held(1)
    assert stage_activation_bytes(model, 1, 1, "full") == pytest.approx(kept)
    assert recompute_workspace(model, 1, 1, "full") == pytest.approx(
        max(layer.held(1) for layer in model[:-1]))
    # this engine's head is recomputed: it keeps its input and what the loss keeps
    ours = _table("pipesched").stages[1]
    assert ours[-1].checkpointed
    assert stage_activation_bytes(ours, 1, 1, "full") < stage_activation_bytes(model, 1, 1,
                                                                                "full")


def test_the_command_line_engine_prices_megatron_2021s_code(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = "layers=4,hidden=512,heads=8,vocab=32000,seq=512"
    config = PlanConfig(pp=2, tp=1, dp=4, schedule="1f1b", chunks=1, microbatch_size=2,
                        num_microbatches=4, zero_stage=0, recompute="full")
    assert main(["plan", "--model", text, "--cluster", "a100-80g", "--global-batch", "32",
                 "--precision", "fp16", "--engine", "megatron-2021", "--price",
                 "pp2,tp1,1f1b,b2,rc", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)["step_seconds"]
    cluster = replace(A100, nodes=1)
    options = SearchOptions(**ENGINES["megatron-2021"])
    steps = {engine: price(transformer_profile(parse_shape(text), "fp16", engine=engine),
                           cluster, 32, config, precision="fp16", options=options).step_seconds
             for engine in ("megatron-2021", "pipesched")}
    assert priced == pytest.approx(steps["megatron-2021"], rel=1e-9)
    assert steps["megatron-2021"] != pytest.approx(steps["pipesched"], rel=1e-6)
