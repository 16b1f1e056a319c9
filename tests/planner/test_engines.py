"""`pipesched plan --engine`: another engine's options narrow what the planner searches and
prices, and a filter or a named configuration outside them is refused, named."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, PlanError, SearchOptions, parse_shape, plan
from pipeline.planner.engines import ENGINES, engine_options, launch_lines
from pipeline.planner.search import price
from pipeline.planner.transformer_layers import transformer_profile
from schedules import SCHEDULES

__all__: list[str] = []

SHAPE = "layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"
MODEL = transformer_profile(parse_shape(SHAPE), "fp16", attention="eager")
CLUSTER = replace(PRESETS["a100-80g"], nodes=2)
# Megatron-LM of 2021, from its paper and code (written here, not read from engines.py):
# 1F1B and the interleaved schedule, no ZeRO, recomputation none or full (selective: 2022)
MEGATRON_SCHEDULES = {"1f1b", "interleaved"}
MEGATRON_RECOMPUTE = {"none", "full"}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_schedule_filter_is_refused_exactly_where_megatron_2021_cannot_run_it(
        name: str) -> None:
    if name in MEGATRON_SCHEDULES:
        assert engine_options("megatron-2021", schedules=(name,))["schedules"] == (name,)
    else:
        with pytest.raises(PlanError, match=f"cannot run schedules {name}"):
            engine_options("megatron-2021", schedules=(name,))


def test_zero_and_recompute_filters_narrow_but_never_widen() -> None:
    assert engine_options("megatron-2021", zero_stages=(0,))["zero_stages"] == (0,)
    with pytest.raises(PlanError, match="zero_stages 1"):
        engine_options("megatron-2021", zero_stages=(0, 1))
    for mode in ("none", "selective", "full", "partial"):
        if mode in MEGATRON_RECOMPUTE:
            engine_options("megatron-2021", recompute_choices=(mode,))
        else:
            with pytest.raises(PlanError, match=f"recompute_choices {mode}"):
                engine_options("megatron-2021", recompute_choices=(mode,))
    assert engine_options("pipesched", zero_stages=(1,)) == {"zero_stages": (1,)}
    with pytest.raises(PlanError, match="engine 'torchtitan' is not known"):
        engine_options("torchtitan")


def test_a_search_under_megatron_2021_proposes_only_what_it_runs() -> None:
    options = SearchOptions(**engine_options("megatron-2021", top=50))
    found = plan(MODEL, CLUSTER, 64, precision="fp16", options=options)
    assert found.predictions
    for prediction in found.predictions:
        config = prediction.config
        assert config.schedule in MEGATRON_SCHEDULES and config.zero_stage == 0
        assert config.recompute in MEGATRON_RECOMPUTE and not config.recompute_layers
        if config.schedule == "interleaved":  # its rules: p > 2, p | m
            assert config.pp > 2 and config.num_microbatches % config.pp == 0


@pytest.mark.parametrize(("schedule", "zero", "recompute", "refused"), [
    ("1f1b", 0, "full", None), ("zb-v", 0, "none", "schedule zb-v"),
    ("1f1b", 1, "none", "ZeRO stage 1"), ("1f1b", 0, "selective", "recompute selective")])
def test_pricing_a_named_configuration_refuses_what_the_engine_cannot_run(
        schedule: str, zero: int, recompute: str, refused: str | None) -> None:
    config = PlanConfig(pp=4, tp=1, dp=4, schedule=schedule, chunks=2 if schedule == "zb-v"
                        else 1, microbatch_size=1, num_microbatches=16, zero_stage=zero,
                        recompute=recompute)
    options = SearchOptions(**ENGINES["megatron-2021"])
    if refused is None:
        assert price(MODEL, CLUSTER, 64, config, precision="fp16", options=options)
    else:
        with pytest.raises(PlanError, match=refused):
            price(MODEL, CLUSTER, 64, config, precision="fp16", options=options)
        # this engine runs it
        assert price(MODEL, CLUSTER, 64, config, precision="fp16").step_seconds > 0


def test_the_command_line_engine(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["plan", "--model", SHAPE, "--cluster", "a100-80g", "--nodes", "2",
              "--global-batch", "64", "--precision", "fp16"]
    assert main([*common, "--engine", "megatron-2021", "--json", "--top", "3"]) == 0
    pick = json.loads(capsys.readouterr().out)["pick"]["config"]
    assert pick["schedule"] in MEGATRON_SCHEDULES and pick["zero_stage"] == 0
    assert main([*common, "--engine", "megatron-2021", "--schedules", "zb-v,1f1b"]) == 2
    assert "megatron-2021 cannot run schedules zb-v" in capsys.readouterr().err
    assert main([*common, "--engine", "megatron-2021", "--price", "pp2,tp1,1f1b,b1,z1"]) == 2
    assert "ZeRO stage 1" in capsys.readouterr().err


def test_the_pick_is_given_as_the_paper_scripts_megatron_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    # run_table_1.sh, 76B: TP=8 PP=4 MBS=2 GBS=1792 NLS=60, DDP=local,
    # "--checkpoint-activations --num-layers-per-virtual-pipeline-stage 5" (v = 60 / 4 / 5)
    config = PlanConfig(pp=4, tp=8, dp=32, schedule="interleaved", chunks=3,
                        microbatch_size=2, num_microbatches=28, zero_stage=0, recompute="full")
    (line,) = launch_lines("megatron-2021", config, 1792, 60)
    text = line.split("pretrain_gpt.py ")[1]
    flags = {"--" + flag.strip() for flag in text.split("--") if flag.strip()}
    assert flags == {"--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 4",
                     "--micro-batch-size 2", "--global-batch-size 1792",
                     "--num-layers-per-virtual-pipeline-stage 5", "--checkpoint-activations",
                     "--DDP-impl local"}
    # 1.7B: TP=1 PP=1 MBS=16, DDP=torch, 1F1B: no virtual stages
    plain = replace(config, pp=1, tp=1, schedule="1f1b", chunks=1, microbatch_size=16,
                    num_microbatches=1, recompute="none")
    assert launch_lines("megatron-2021", plain, 512, 24) == [
        "Megatron-LM (2021) pretrain_gpt.py --tensor-model-parallel-size 1 "
        "--pipeline-model-parallel-size 1 --micro-batch-size 16 --global-batch-size 512 "
        "--DDP-impl torch"]
    assert "pipesched train" in launch_lines("pipesched", plain, 512, 24)[1]
    assert main(["plan", "--model", SHAPE, "--cluster", "a100-80g", "--nodes", "2",
                 "--global-batch", "64", "--engine", "megatron-2021", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["engine"] == "megatron-2021"
    assert document["pick"]["launch"][0].startswith("Megatron-LM (2021) pretrain_gpt.py")
