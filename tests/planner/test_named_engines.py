"""`--engine megatron-core` and `--engine deepspeed`: the search enumerates exactly what each
engine runs (oracles written here from their code), Megatron-Core's tensor-parallel overlap is
priced by its rule (checked against an event simulation), and the pick prints each engine's
command line; for a HF model on this engine, the torchrun line and the Python entry."""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model, plan
from pipeline.planner.engines import DEEPSPEED, MEGATRON_CORE
from pipeline.planner.grid import configurations
from pipeline.planner.launch import LaunchTarget, launch_lines
from pipeline.planner.pricing import allreduce_seconds, layer_tp_pass_seconds
from pipeline.planner.search import price
from pipeline.planner.stages import block_span

__all__: list[str] = []

BLOCKS = 12
MODEL = load_model(f"layers={BLOCKS},hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,"
                   "seq=1024,mlp=swiglu", sequence_parallel=True)
CLUSTER = replace(PRESETS["h100-80g"], nodes=2)
ALL_MODES = ("none", "selective", "full", "partial")


def _enumerated(options: SearchOptions, batch: int = 32) -> set[PlanConfig]:
    return set(configurations(MODEL, CLUSTER, batch, options))


def _free() -> set[PlanConfig]:
    return _enumerated(SearchOptions(recompute_choices=ALL_MODES, max_chunks=4))


def megatron_core_runs(config: PlanConfig) -> bool:
    """From Megatron-Core (d98e8a64dd): 1F1B or interleaved (`schedules.py`); the blocks split
    evenly, p·v dividing them (`arguments.py`); interleaving at p > 1 with its default
    --overlap-p2p-communication and m a multiple of p (the microbatch group per virtual stage
    is p); ZeRO-1 is its distributed optimizer; every recomputation mode."""
    if config.schedule not in ("1f1b", "interleaved") or BLOCKS % (config.pp * config.chunks):
        return False
    if config.schedule == "interleaved":
        return config.pp >= 2 and config.num_microbatches % config.pp == 0
    return True


def deepspeed_runs(config: PlanConfig) -> bool:
    """From DeepSpeed's pipeline engine (38327e07f6): `TrainSchedule` (1F1B) only, ZeRO < 2,
    whole layers recomputed (activation_checkpoint_interval) or none."""
    return config.schedule == "1f1b" and config.zero_stage < 2 and (
        config.recompute == "none" or (config.recompute == "full"
                                       and not config.recompute_layers))


@pytest.mark.parametrize(("options", "oracle"), [(MEGATRON_CORE, megatron_core_runs),
                                                 (DEEPSPEED, deepspeed_runs)],
                         ids=["megatron-core", "deepspeed"])
def test_the_search_enumerates_exactly_what_the_engine_runs(options: dict[str, object],
                                                            oracle: object) -> None:
    assert callable(oracle)
    free = _free()
    ruled = _enumerated(SearchOptions(**options, max_chunks=4))  # type: ignore[arg-type]
    assert ruled == {config for config in free if oracle(config)}
    assert ruled and len(ruled) < len(free)


def _ring_by_events(gemm: float, collective: float, tp: int) -> float:
    """Exposed seconds of a ring-exchange all-gather beside a GEMM, by events: the device
    runs GEMM slice 0 on its own shard at once, slice k once the link's step k (one of t - 1,
    one after another) has brought shard k and slice k - 1 is done."""
    step = collective / (tp - 1)
    device = gemm / tp
    for k in range(1, tp):
        device = max(device, k * step) + gemm / tp
    return device - gemm


def test_megatron_core_tp_overlap_matches_an_event_simulation_and_hides_communication() -> None:
    from pipeline.planner.kernels import block_linear_times
    from pipeline.planner.userbuffers import userbuffers_sms

    block = MODEL.layers[1]
    assert block.shape is not None and block.shape.sequence_parallel
    tp, batch = 4, 2
    whole = layer_tp_pass_seconds(block, CLUSTER, "bf16", batch, tp)
    overlapped = layer_tp_pass_seconds(block, CLUSTER, "bf16", batch, tp, "megatron-core")
    collective = allreduce_seconds(block.tp_allreduce_bytes * batch, tp, 1, CLUSTER) / 2
    forward = backward = 0.0
    sms = CLUSTER.sm_count
    for index, (kind, (gemm, input_grad, weight_grad)) in enumerate(
            block_linear_times(block.shape, batch, tp, CLUSTER, "bf16")):
        forward += _ring_by_events(gemm, collective, tp)
        backward += (max(0.0, collective - input_grad) + max(0.0, collective - weight_grad)
                     if kind == "column" else _ring_by_events(input_grad, collective, tp))
        # and each GEMM on the SMs userbuffers' kernel leaves it (`test_userbuffers`)
        held = userbuffers_sms(index)
        forward += gemm * held[0] / (sms - held[0])
        backward += input_grad * held[1] / (sms - held[1]) \
            + weight_grad * held[2] / (sms - held[2])
    assert overlapped == pytest.approx((forward, backward), rel=1e-9)
    assert overlapped[0] < whole[0] and overlapped[1] < whole[1]
    # the embedding and head have no overlap rule: exposed whole
    for layer in (MODEL.layers[0], MODEL.layers[-1]):
        assert layer_tp_pass_seconds(layer, CLUSTER, "bf16", batch, tp, "megatron-core") == \
            layer_tp_pass_seconds(layer, CLUSTER, "bf16", batch, tp)


def test_a_tp4_step_under_megatron_core_shows_less_tp_communication() -> None:
    config = PlanConfig(pp=2, tp=4, dp=2, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=16, zero_stage=0, recompute="selective")
    core = price(MODEL, CLUSTER, 32, config, options=SearchOptions(**MEGATRON_CORE))
    exposed = price(MODEL, CLUSTER, 32, config, options=SearchOptions(
        **(dict(MEGATRON_CORE) | {"tp_overlap": "none"})))
    assert core.breakdown["tp_comm"] < exposed.breakdown["tp_comm"]
    assert core.step_seconds < exposed.step_seconds


def test_megatron_core_holds_bf16_weights_fp32_gradients_and_a_sharded_optimizer() -> None:
    config = PlanConfig(pp=1, tp=1, dp=16, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=2, zero_stage=1, recompute="full")
    memory = price(MODEL, CLUSTER, 32, config, options=SearchOptions(**MEGATRON_CORE)).memory
    params = MODEL.num_parameters
    assert memory.parameters == pytest.approx(2 * params)
    assert memory.gradients == pytest.approx(4 * params)
    assert memory.optimizer == pytest.approx(12 * params / 16)


def test_launch_lines_of_each_engine() -> None:
    config = PlanConfig(pp=4, tp=8, dp=2, schedule="interleaved", chunks=3,
                        microbatch_size=1, num_microbatches=64, zero_stage=1, recompute="full",
                        recompute_layers=2)
    target = LaunchTarget(nodes=8, devices_per_node=8)
    (line,) = launch_lines("megatron-core", config, 128, 48, target=target)
    assert line.startswith("torchrun --nnodes 8 --nproc-per-node 8")
    for flag in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 4",
                 "--num-layers-per-virtual-pipeline-stage 4", "--sequence-parallel",
                 "--tp-comm-overlap", "--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--recompute-method block --recompute-num-layers 2"):
        assert flag in line, flag
    plain = replace(config, schedule="1f1b", chunks=1, recompute="none", recompute_layers=0)
    launcher, ds_config, script = launch_lines("deepspeed", plain, 128, 48, target=target,
                                               boundaries=(0, 13, 25, 37, 50))
    assert launcher.startswith("deepspeed --num_nodes 8 --num_gpus 8")
    assert json.loads(ds_config.split(": ", 1)[1]) == {
        "train_batch_size": 128, "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 64, "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True}}
    assert "num_pp=4, num_mp=8, num_dp=2" in script


def test_a_hf_pick_prints_the_torchrun_line_of_pipesched_run_whose_cuts_fit_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    from pipeline.interop.hf_layers import layers_from_hf
    from pipeline.model.partitioning import stage_boundaries

    config = transformers.LlamaConfig(num_hidden_layers=6, hidden_size=256,
                                      num_attention_heads=8, num_key_value_heads=4,
                                      intermediate_size=512, vocab_size=1000,
                                      max_position_embeddings=128)
    config.save_pretrained(tmp_path)
    code = main(["plan", "--model", str(tmp_path), "--cluster", "h100-80g", "--global-batch",
                 "16", "--tp", "2", "--pp", "2"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(text.strip() for text in out.splitlines() if "torchrun" in text)
    # one node: torchrun's own rendezvous, nothing to set but the run's DATA, STEPS, ...
    assert line.startswith("torchrun --standalone --nproc-per-node 8 -m pipeline.cli run ")
    assert "HEAD_NODE" not in out and f"--model {tmp_path}" in line
    assert "--tp 2" in line and "--stages 2" in line and "--seq-len 128" in line
    cuts = [int(cut) for cut in line.split("--partition ")[1].split()[0].split(",")]
    hf = layers_from_hf(config)
    assert cuts[0] == 0 and cuts[-1] == len(hf.layers) == 6 + 3
    # the planner's stages (embedding, 6 blocks, head) and these cuts hold the same blocks
    model = load_model(str(tmp_path))
    first, end = block_span(model.layers)
    picked = plan(model, PRESETS["h100-80g"], 16, options=SearchOptions(
        tensor_parallel=(2,), pipeline_parallel=(2,))).best.boundaries
    blocks_per_stage = [min(b, end) - max(a, first) for a, b in pairwise(picked)]
    hf_blocks = [min(b, 1 + 6) - max(a, 1) for a, b in pairwise(cuts)]
    assert blocks_per_stage == hf_blocks
    assert stage_boundaries(hf.layers, len(cuts) - 1, cuts) == tuple(cuts)  # the engine takes it
    # priced with sequence parallelism and overlapped tp collectives: the run runs them
    assert main(["plan", "--model", str(tmp_path), "--cluster", "h100-80g", "--global-batch",
                 "16", "--tp", "2", "--pp", "2", "--sequence-parallel",
                 "--tp-comm-overlap", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    line = next(text.strip() for text in out.splitlines() if "torchrun" in text)
    assert "--sequence-parallel" in line and "--tp-comm-overlap" in line
    # many nodes: the rendezvous at a head node the text says how to name
    assert line.startswith("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
                           "--rdzv-endpoint $HEAD_NODE:29500 -m pipeline.cli run ")
    assert "HEAD_NODE set to the host name" in out


def test_engine_cli_runs_and_names_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    for engine, words in (("megatron-core", "pretrain_gpt.py"),
                          ("deepspeed", "--deepspeed_config")):
        code = main(["plan", "--model", "layers=8,hidden=512,heads=8,vocab=1000,seq=256",
                     "--cluster", "h100-80g", "--global-batch", "16", "--engine", engine,
                     "--top", "2"])
        assert code == 0 and words in capsys.readouterr().out
